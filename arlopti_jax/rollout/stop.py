"""Stop strings (``rollout.stop``): a response ends at the token that completes one, as vLLM's
``stop`` ends it, matched on the decoded text (so a string may end inside a token or span several).

The sampler decodes as it does without them (EOS on device); ``apply_stops`` then trims the
host's ``Rollout``. Response i ends at the first k such that the decoded text of its first k
tokens holds a stop string: tokens from k on leave the response (mask, ids, log-probs, length),
and the row counts as finished, not truncated. The k-th token stays: the policy emitted it, and
vLLM stops after it. Of the stop strings that token completes, the first in ``stops``' order
wins, at its first occurrence (vLLM's ``check_stop_strings``). The text the rewards see ends at
the start of that occurrence, or at its end with ``include`` (``rollout.include_stop_str``,
vLLM's ``include_stop_str_in_output``); the characters the k-th token decodes to beyond that are
dropped either way (``Rollout.text_cut``). Texts are decoded with special tokens kept, as the
rewards read them.

Matching at the host, once per rollout, keeps the decode loop as it is. ``bench/stop_strings.py``
measures the alternatives (docs/measurements/journal.md, "Issue 67"): with half the responses
rambling on after their stop string, stopping rows at the length-aware schedule's host reads would
save 9% of the decode row-steps, stopping them on device 20%; the trimming costs about 3x the
rewards' own batch decode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from arlopti_jax.rollout.output import Rollout


def find_stop(decode, ids: Sequence[int], stops: Sequence[str], include: bool = False) -> tuple[int, int] | None:
    """(k, cut) for a response of token ``ids`` that a stop string ends, else None: it keeps its
    first k tokens, and the text given to rewards drops the last ``cut`` characters of
    ``decode(ids[:k])``. ``decode``: token ids -> text."""
    if not stops or not any(s in decode(ids) for s in stops):
        return None
    lo, hi = 1, len(ids)  # the first prefix holding a stop string (decoded prefixes only grow)
    while lo < hi:
        mid = (lo + hi) // 2
        text = decode(ids[:mid])
        lo, hi = (lo, mid) if any(s in text for s in stops) else (mid + 1, hi)
    text = decode(ids[:lo])
    stop = next(s for s in stops if s in text)
    end = text.find(stop) + (len(stop) if include else 0)
    return lo, len(text) - end


def apply_stops(rollout: Rollout, tokenizer, stops: Sequence[str], include: bool, pad_id: int) -> Rollout:
    """``rollout`` with each response a stop string ends trimmed after the token that completes it
    (module docstring); the same object when ``stops`` is empty. The decode cost recorded
    (``decode_steps``, ``decode_loops``) is what the sampler ran."""
    if not stops:
        return rollout
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    responses = rollout.responses()
    texts = tokenizer.batch_decode(responses, skip_special_tokens=False)
    ids, mask, logprobs = (np.array(a) for a in (rollout.response_ids, rollout.response_mask, rollout.logprobs))
    lengths, truncated = rollout.lengths.copy(), rollout.truncated.copy()
    cut = np.zeros(len(responses), np.int32)
    for i, (response, text) in enumerate(zip(responses, texts)):
        found = find_stop(decode, response, stops, include) if any(s in text for s in stops) else None
        if found is None:
            continue
        k, cut[i] = found
        ids[i, k:], mask[i, k:], logprobs[i, k:] = pad_id, 0, 0.0
        lengths[i], truncated[i] = k, False
    return dataclasses.replace(rollout, response_ids=ids, response_mask=mask, logprobs=logprobs, lengths=lengths,
                               truncated=truncated, text_cut=cut)


def cut_texts(texts: list[str], rollout: Rollout) -> list[str]:
    """Decoded responses (or prompt + response) of ``rollout`` less each one's ``text_cut``."""
    if rollout.text_cut is None:
        return texts
    return [t[: len(t) - int(c)] if c else t for t, c in zip(texts, rollout.text_cut)]
