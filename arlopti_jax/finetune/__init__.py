"""Supervised fine-tuning on (prompt, response) pairs: the `sft` command's loop and the embedded
default's warm start."""
