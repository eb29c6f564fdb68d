"""Shared helpers for the task tests: the shared data folder and a tiny offline tokenizer."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

# The public reference data lives beside the repository (<repo>/../shared/data), or
# wherever ARLOPTI_SHARED_DATA points. Tests that need it skip when it is absent.
SHARED_DATA = Path(
    os.environ.get("ARLOPTI_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data")
)
_skip_without_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(),
    reason=f"shared reference data folder {SHARED_DATA} is absent (set ARLOPTI_SHARED_DATA)",
)


def requires_shared_data(test):
    """Skips the test when the shared data is absent; under CI=true that skip fails
    (tests/conftest.py), as a real-model test's does."""
    return pytest.mark.shared_data(_skip_without_data(test))


def shared_files(pattern: str) -> list[Path]:
    """Shared data files matching a glob pattern, sorted; empty when the folder is absent."""
    return sorted(SHARED_DATA.glob(pattern)) if SHARED_DATA.is_dir() else []


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "A very special island is inhabited only by knights and knaves.",
    "Knights always tell the truth, and knaves always lie. Who is a knight and who is a knave?",
    "<think> reasoning process here </think><answer> (1) Zoey is a knight </answer>",
    "Let's think step by step and output the final answer within \\boxed{}.",
    "Find the value of $x$ such that \\frac{1}{2} + x^2 = 3.",
]


@functools.lru_cache(maxsize=None)
def tiny_tokenizer(vocab_size: int = 400):
    """A transformers.PreTrainedTokenizerFast with <|im_start|>/<|im_end|>/<|endoftext|>."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )
