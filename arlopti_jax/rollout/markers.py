"""A text marker that ends a turn (a tool call's close, ``</tool_call>``), matched on device
whatever tokens spell it.

The decode loop cannot decode text, and a marker of several characters can be spelled by many
token sequences (``</tool_call>`` is one special token in Qwen2.5's vocabulary, four or five
plain tokens in SmolLM2's, split in any of several ways). ``marker_table`` turns the marker into
a finite automaton over token ids: state k (0 <= k < M, M = the marker's length) says the text so
far ends with the marker's first k characters and holds no whole marker; state M that a whole
marker has been written. ``table[token, k]`` is the state after appending that token's text, by
Knuth-Morris-Pratt's failure function run over the token's characters, M once the marker is
complete anywhere in them (a token such as ``">\\n"`` completes it and goes on). One gather
``table[token, state]`` per row and decode step follows the text exactly, for any tokenization:
the alternative, checking the decoded text on the host at the loop's reads, would let every row
decode past its marker until the next read and then undo those tokens in the KV cache
(docs/guides/tools.md, "How a turn stops").

Each token's text is ``tokenizer.decode([id])`` with special tokens kept. That is the token's
own text for byte-level BPE (GPT-2 style: Qwen, SmolLM2, Llama 3); a token holding part of a
multi-byte character decodes to U+FFFD, which no ASCII marker contains, so markers are ASCII
(``check_marker``). A token without text (an id the tokenizer does not know, in a model's padded
vocabulary, or one that decodes to nothing) leaves the state as it is.
"""

from __future__ import annotations

import numpy as np


def check_marker(marker: str) -> str | None:
    """Why ``marker`` cannot end turns (one phrase), or None."""
    if not marker:
        return "is empty"
    if not marker.isascii() or not marker.isprintable():
        return "must be printable ASCII (markers are matched on each token's own text)"
    return None


def _failure(marker: str) -> list[int]:
    """KMP's failure function: fail[k] = the longest proper border of marker[:k]."""
    fail = [0] * (len(marker) + 1)
    k = 0
    for i in range(1, len(marker)):
        while k and marker[i] != marker[k]:
            k = fail[k]
        if marker[i] == marker[k]:
            k += 1
        fail[i + 1] = k
    return fail


def advance(marker: str, state: int, text: str, fail: list[int] | None = None) -> int:
    """The automaton's state after ``text`` from ``state`` (len(marker) once complete: it stays)."""
    m = len(marker)
    fail = _failure(marker) if fail is None else fail
    if state >= m:
        return m
    for ch in text:
        while state and ch != marker[state]:
            state = fail[state]
        if ch == marker[state]:
            state += 1
        if state == m:
            return m
    return state


def marker_table(token_texts: list[str], marker: str, vocab_size: int) -> np.ndarray:
    """[vocab_size, M + 1] int8 (int32 for markers of 127 characters or more): the transition of
    each token id (``token_texts[id]``, ids beyond the list: no text) from each state."""
    problem = check_marker(marker)
    if problem:
        raise ValueError(f"stop marker {marker!r} {problem}")
    m = len(marker)
    table = np.broadcast_to(np.arange(m + 1), (vocab_size, m + 1)).astype(np.int8 if m < 127 else np.int32)
    fail = _failure(marker)
    chars = set(marker)
    for token, text in enumerate(token_texts[:vocab_size]):
        if not text:  # no text (an id the tokenizer does not know, a token that decodes to nothing): no move
            continue
        if text[-1] not in chars and marker[-1] not in text:  # a state above 0 needs the text's last
            table[token, :m] = 0  # character in the marker, completion its last one
            continue
        for state in range(m):
            table[token, state] = advance(marker, state, text, fail)
    return table


def token_texts(tokenizer) -> list[str]:
    """Each token id's own text, special tokens kept (``marker_table``'s input)."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)
