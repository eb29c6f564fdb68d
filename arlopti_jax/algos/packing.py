"""Packing a rollout batch's sequences into rows of a fixed token budget (host side, numpy).

The rollout arrives dense: [B, T] rows of a left-padded prompt and a right-padded response,
T = bucketed prompt length + max_response_length, however short the real sequences are. The
update and the log-prob passes run on packed micro-batches instead:

    rows    one per data x fsdp device (``num_rows``), each ``tokens_per_row`` (L) long,
            holding whole sequences back to back (first-fit decreasing by length);
    tokens  token ids, ``segment_ids`` (1, 2, ... per sequence of the row, 0 = padding) and
            ``positions`` (restarting at 0 in each sequence), for ``packed_hidden_states``;
    targets the row slots whose next token is a response token (``target_pos``) and that
            token's index in the dense batch (``target_src``), listed first in each row
            (capacity L), so log-probs are computed at response positions only;
    block   the attention query block of the micro-batch (``decoder.segment_mask``): the
            smallest divisor of L in multiples of 64 with 2 * block >= its longest sequence,
            or 0 (whole-row attention) when that saves nothing. Sequences are packed longest
            first, so micro-batches of short sequences get small blocks.

A micro-batch's shape is always [num_rows, L]; only ``block`` varies, so the passes compile
once per block size. Padding is whatever the bins leave unfilled: typically a few percent.
Everything here is a pure function of the lengths, so every process of a multi-process run
computes the same plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

BLOCK_QUANTUM = 64  # attention blocks are multiples of this (or the whole row)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One packed micro-batch's layout (host arrays); ``gather`` fills it from dense arrays.

    token_src   [R, L] int64  flat index into the dense [B, T] arrays of each slot's token; -1 = pad
    segment_ids [R, L] int32
    positions   [R, L] int32
    target_pos  [R, L] int32  slot whose hidden state predicts target k (0 for unused targets)
    target_src  [R, L] int64  flat dense index of target k (a response token); -1 = unused
    block       int           attention query block (0 = whole row)
    sequences   int           sequences packed in this micro-batch
    """

    token_src: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    target_pos: np.ndarray
    target_src: np.ndarray
    block: int
    sequences: int

    @property
    def real_tokens(self) -> int:
        return int((self.token_src >= 0).sum())

    @property
    def target_count(self) -> int:
        return int((self.target_src >= 0).sum())


def sequence_spans(attention_mask: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """[n, 2] (start, end) of each row's attended tokens, which must be contiguous (a
    left-padded prompt followed by a right-padded response). Rows with no token get (0, 0)."""
    mask = np.asarray(attention_mask) > 0
    if rows is not None:
        mask = mask[rows]
    any_tok = mask.any(axis=1)
    start = np.where(any_tok, mask.argmax(axis=1), 0)
    end = np.where(any_tok, mask.shape[1] - mask[:, ::-1].argmax(axis=1), 0)
    counts = mask.sum(axis=1)
    bad = np.flatnonzero(counts != end - start)
    if bad.size:
        row = int(bad[0] if rows is None else np.asarray(rows)[bad[0]])
        raise ValueError(f"batch row {row}: attention_mask has holes; packing needs each row's tokens "
                         "contiguous (left-padded prompt, right-padded response)")
    return np.stack([start, end], axis=1)


def choose_block(tokens_per_row: int, longest: int) -> int:
    """The smallest block (a divisor of the row length, a multiple of BLOCK_QUANTUM) whose
    2-block window covers ``longest``; 0 (whole-row attention) if the window would not be
    shorter than the row."""
    for block in range(BLOCK_QUANTUM, tokens_per_row // 2, BLOCK_QUANTUM):
        if tokens_per_row % block == 0 and 2 * block >= longest:
            return block if 3 * block < tokens_per_row else 0
    return 0


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity, items longest first; bins
    in order of creation (so by decreasing first item)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        size = int(lengths[i])
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(i)
                room[b] -= size
                break
        else:
            bins.append([i])
            room.append(capacity - size)
    return bins


def plan_micro_batches(attention_mask: np.ndarray, response_mask: np.ndarray, rows, *,
                       tokens_per_row: int, num_rows: int) -> list[MicroBatch]:
    """Pack the sequences of dense batch ``rows`` into micro-batches of ``num_rows`` x
    ``tokens_per_row``. Rows without tokens (batch padding) are skipped."""
    attention_mask, response_mask = np.asarray(attention_mask), np.asarray(response_mask)
    rows = np.asarray(rows, np.int64)
    width = attention_mask.shape[1]
    spans = sequence_spans(attention_mask, rows)
    lengths = spans[:, 1] - spans[:, 0]
    too_long = np.flatnonzero(lengths > tokens_per_row)
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"batch row {int(rows[i])} holds {int(lengths[i])} tokens, more than "
                         f"train.max_tokens_per_micro_batch={tokens_per_row}: raise it to at least the longest "
                         "prompt + response")
    present = np.flatnonzero(lengths > 0)
    bins = [[int(present[i]) for i in b] for b in first_fit_decreasing(lengths[present], tokens_per_row)]
    out = []
    for first in range(0, len(bins), num_rows):
        group = bins[first:first + num_rows]
        shape = (num_rows, tokens_per_row)
        token_src = np.full(shape, -1, np.int64)
        segment_ids = np.zeros(shape, np.int32)
        positions = np.zeros(shape, np.int32)
        target_pos = np.zeros(shape, np.int32)
        target_src = np.full(shape, -1, np.int64)
        longest = 0
        for r, members in enumerate(group):
            slot = n_targets = 0
            for seg, i in enumerate(members, start=1):
                row, (start, end) = int(rows[i]), spans[i]
                n = int(end - start)
                longest = max(longest, n)
                token_src[r, slot:slot + n] = row * width + np.arange(start, end)
                segment_ids[r, slot:slot + n] = seg
                positions[r, slot:slot + n] = np.arange(n)
                resp = np.flatnonzero(response_mask[row, start:end] > 0)
                if resp.size and resp[0] == 0:
                    raise ValueError(f"batch row {row}: a response token has no preceding token to predict it from")
                k = resp.size
                target_pos[r, n_targets:n_targets + k] = slot + resp - 1
                target_src[r, n_targets:n_targets + k] = row * width + start + resp
                slot += n
                n_targets += k
        out.append(MicroBatch(token_src, segment_ids, positions, target_pos, target_src,
                              choose_block(tokens_per_row, longest), sum(len(g) for g in group)))
    return out


def gather(mb: MicroBatch, tokens: dict[str, np.ndarray], targets: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The micro-batch's arrays: ``tokens`` entries (dense [B, T]) at its slots, ``targets``
    entries at its targets (0 where unused), plus segment_ids, positions, target_pos and
    ``target_mask`` (1 on used targets)."""
    out = {"segment_ids": mb.segment_ids, "positions": mb.positions, "target_pos": mb.target_pos,
           "target_mask": (mb.target_src >= 0).astype(np.int32)}
    for name, index in ((tokens, mb.token_src), (targets, mb.target_src)):
        safe, valid = np.maximum(index, 0), index >= 0
        for key, dense in name.items():
            dense = np.asarray(dense)
            out[key] = np.where(valid, dense.reshape(-1)[safe], 0).astype(dense.dtype)
    return out


def scatter_targets(micro_batches: list[MicroBatch], values: list[np.ndarray], shape) -> np.ndarray:
    """Per-target values of each micro-batch ([R, L] each) -> a dense [B, T] float32 array
    (0 off the targets)."""
    out = np.zeros(int(np.prod(shape)), np.float32)
    for mb, v in zip(micro_batches, values):
        used = mb.target_src >= 0
        out[mb.target_src[used]] = np.asarray(v)[used]
    return out.reshape(shape)


def padding_fraction(micro_batches: list[MicroBatch]) -> float:
    """Share of the processed token slots that hold no real token."""
    slots = sum(mb.token_src.size for mb in micro_batches)
    return 1.0 - sum(mb.real_tokens for mb in micro_batches) / max(slots, 1)
