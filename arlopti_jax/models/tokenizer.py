"""A model folder's tokenizer, checked before a run uses it.

    tokenizer = load_tokenizer("models/smollm2-135m")   # transformers' AutoTokenizer of the folder

transformers 5 builds an empty tokenizer (one token, every text encoded as no ids) from a folder
that holds a config.json and no tokenizer files, so a run would start and fail later, in the
sampler, on empty prompts. Here a folder without a vocabulary's files, with files the tokenizer
cannot be read from, or with more tokens than the model's embedding has rows (config.json's
``vocab_size``: a larger id would read past the table) is a ``TokenizerError``: one line naming the
folder and the files.
"""

from __future__ import annotations

from pathlib import Path

from arlopti_jax.models.hf_config import ModelFolderError, read_folder

# what a tokenizer's vocabulary is read from, each group enough on its own: transformers' fast
# tokenizer file, a SentencePiece model (Llama 2, Gemma), a byte-level BPE's vocabulary and merges
VOCABULARY_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


class TokenizerError(ModelFolderError):
    """A model folder whose tokenizer is missing, unreadable or larger than the model's vocabulary."""


def _looked_for() -> str:
    return ", ".join(" with ".join(group) for group in VOCABULARY_FILES)


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer (``AutoTokenizer``; no code from the folder is run), or TokenizerError."""
    folder = Path(folder)
    if not any(all((folder / name).is_file() for name in group) for group in VOCABULARY_FILES):
        raise TokenizerError(f"{folder}: no tokenizer (looked for {_looked_for()})")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    # the files are the user's: transformers and tokenizers refuse a damaged one with whatever their
    # parsers raise (JSONDecodeError, TypeError, the Rust side's plain Exception), so any of them is
    # this folder's fault, reported with its type and first line
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise TokenizerError(f"{folder}: the tokenizer cannot be read from its files ({type(err).__name__}"
                             f"{': ' + reason if reason else ''})") from None
    vocab = read_folder(folder)["vocab_size"] if (folder / "config.json").is_file() else None
    if vocab is not None and len(tokenizer) > vocab:
        raise TokenizerError(f"{folder}: the tokenizer has {len(tokenizer)} tokens and the model's embedding "
                             f"{vocab} rows ({folder / 'config.json'} vocab_size): ids from {vocab} on have no row")
    return tokenizer
