"""The embedded default: its config file (default.py) and its start point (generated K&K
puzzles, a trained tokenizer and a small model warm-started by SFT)."""
