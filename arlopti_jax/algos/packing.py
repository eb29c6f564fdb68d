"""Packing a rollout batch's sequences into rows of a fixed token budget (host side, numpy).

The rollout arrives dense: [B, T] rows of a left-padded prompt and a right-padded response,
T = bucketed prompt length + max_response_length, however short the real sequences are. The
update and the log-prob passes run on packed micro-batches instead. A micro-batch holds
``tokens_per_device`` (L) tokens per data x fsdp device, as ``L / S`` rows of ``S`` tokens:

    S       the row length, an entry of the run's ``Shapes.row_lengths`` (a short ladder fixed by
            the config: ``shapes_for``) that holds the longest sequence of the micro-batch: the
            one that packs the most real tokens per unit of cost, where a slot costs its linear
            work plus S attended keys (``attention_cost``);
    rows    whole sequences back to back (first-fit, longest first), attending within their
            own sequence, so attention costs S keys per token, not L;
    tokens  token ids, ``segment_ids`` (1, 2, ... per sequence of the row, 0 = padding) and
            ``positions`` (restarting at 0 in each sequence), for ``packed_hidden_states``;
    targets the slots whose next token is a response token (``target_pos``: the slot's
            index in its device's rows, flattened) and that token's index in the dense batch
            (``target_src``), one list per device as long as the device's token slots, so the
            loss reads response positions only, however the rows are filled.

Sequences are taken longest first: the first micro-batches hold the long sequences, the last
ones the short sequences. A full micro-batch is [D * (L // S), S]; the tail of a mini-batch
takes the cheapest shapes of the set (half the rows, a quarter, ...) that hold it, as coins: a
half and a quarter for three quarters. The shapes are known before the first step
(``Shapes.all``: row lengths x row counts, at most 8 with the defaults
``train.pack_row_lengths=2``, ``train.pack_fills=4``), so each pass compiles that many programs
at most, whatever the lengths of the responses. Everything here is a pure function of the lengths
(and, with a shared prefix, of the prompts' tokens), so every process of a multi-process run
computes the same plan.

**Shared prefix** (``input_ids`` given; ``train.shared_prefix``). The responses of a GRPO group
repeat one prompt. Sequences of the packed rows whose prompts (the tokens before the first response
token) are equal token for token share it: a row that holds such a prompt's first sequence takes
another of them for its response alone, and lays them out as one prefix segment followed by the
response segments (then the row's other sequences):

    segment_ids  [ 1 1 1 1 | 2 2 2 | 3 3 | 4 4 4 4 ... ]   prompt, response a, response b, next sequence
    prefix_ids   [ 0 0 0 0 | 1 1 1 | 1 1 | 0 0 0 0 ... ]   the prefix segment each response also sees
    positions    [ 0 1 2 3 | 4 5 6 | 4 5 | 0 1 2 3 ... ]   responses continue from the prompt's length

so a group of n responses costs P + n x R tokens instead of n x (P + R). A response token attends
to its prefix segment and causally to its own segment, never to a sibling (``segment_mask``); the
prompt's last slot predicts every response's first token. Each query thus sees exactly the keys,
positions and tokens it sees in its own unshared row: the outputs, log-probs and gradients equal
the unshared layout's to float rounding, whatever the pass (update, reference, pi_old recompute,
diagnostics). Sharing is found from the tokens, not from group ids: rows with equal prompts from
anywhere in the batch share (after DAPO's filtering or a shuffle into mini-batches too), and rows
whose prompt no other row of the packed set repeats (n = 1, a group's only row in a mini-batch)
keep the unshared layout. A group is never required to fit one row: its responses fill the rows
that hold its prompt, and the rest go to other rows (each with its own copy of the prompt), in
this or a later micro-batch. The packing value counts a sequence at its unshared length, so a row
length is chosen for the sequences it covers per unit of cost.

Attention form: one boolean [B, 1, T, T] mask per micro-batch, built from ``segment_ids`` and
``prefix_ids`` (``decoder.segment_mask``), the same shape the unshared rows already use: XLA's
path (and the CPU's causal blocks) hold no larger mask and no per-head copy, and cuDNN's fused
kernel takes it as it takes the unshared mask. Splitting attention into a prefix part and an
own-segment part merged by log-sum-exp would let each part run unmasked only when a row holds
one group; rows packed with several groups need a mask in both parts, so that split would double
the attention calls and add the merge for no saving here.

What the mask form gives up: a prompt is laid out again in every row that holds its group's
responses, and a row holds only as many as fit its length, which the attention cost (keys per
token grow with it) keeps near the longest sequence. With responses longer than the prompt, a
group's eight land in three or four rows: on K&K prompt lengths (264-328 tokens) and responses of
median 390, 4.0 copies per prompt, 18.8k packed tokens against 23.5k unshared and 15.2k with each
prompt once (measured 2026-11-26, journal issue 29), on the CPU benchmarks' tiny model, whose dear attention
keeps rows short. At a real model's widths keys are cheap, rows grow to hold a whole group and its
prompt is forwarded about once (compiler figures, journal issue 29). Rows that read their prompt's keys
from another row of their device reach one copy everywhere, but every row of such a micro-batch
pays those keys: tried, exact, and no faster (docs/measurements/journal.md, issue 29, fourth session).
"""

from __future__ import annotations

import dataclasses

import numpy as np

ROW_QUANTUM = 64  # row lengths are multiples of this (or the whole budget) on GPUs and TPUs
CPU_ROW_QUANTUM = 16  # and on the CPU (journal, issue 68: 32 rows of 144 tokens fill rows of 288, not 320)
ROW_LADDER = 1.2  # consecutive row lengths differ by at least this factor (few compiled shapes)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One packed micro-batch's layout (host arrays, [R, S] unless noted); ``gather`` fills it.

    token_src   int64  flat index into the dense [B, T] arrays of each slot's token; -1 = pad
    segment_ids int32
    positions   int32
    prefix_ids  int32  the segment id of a response's shared prefix segment; 0 elsewhere
    target_pos  int32  [D, K]: the slot whose hidden state predicts device d's target k, as an
                       index into that device's [R / D, S] rows flattened (0 for unused targets)
    target_src  int64  [D, K]: flat dense index of that target (a response token); -1 = unused
    sequences   int    sequences packed in this micro-batch
    """

    token_src: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    prefix_ids: np.ndarray
    target_pos: np.ndarray
    target_src: np.ndarray
    sequences: int

    @property
    def row_length(self) -> int:
        return self.token_src.shape[1]

    @property
    def real_tokens(self) -> int:
        return int((self.token_src >= 0).sum())

    @property
    def target_count(self) -> int:
        return int((self.target_src >= 0).sum())


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The packed micro-batch shapes a run may use, fixed before its first step, so that every
    program of its passes is known ahead (``all``) and none is compiled for a new length later.

    A shape is a row length S from ``row_lengths`` and a row count per device from
    ``rows_per_device(S)``: the full micro-batch's ``tokens_per_device // S`` rows, then half of
    it, a quarter, ... (``fills`` counts in all), which only a mini-batch's last micro-batch uses.
    Each device's target list has one slot per token slot (``targets``), so the target width adds
    no program; the vocabulary projection then also runs at prompt positions, a small share where
    a group's responses share one prompt copy (``shared_prefix``)."""

    tokens_per_device: int
    row_lengths: tuple[int, ...]  # ascending
    fills: int = 1

    def rows_per_device(self, length: int) -> tuple[int, ...]:
        full = self.tokens_per_device // length
        return tuple(sorted({-(-full // 2**j) for j in range(self.fills)}))

    def all(self) -> list[tuple[int, int]]:
        """Every (row length, rows per device) a plan may use: one program per pass each."""
        return [(length, rows) for length in self.row_lengths for rows in self.rows_per_device(length)]

    @staticmethod
    def targets(rows_per_device: int, length: int) -> int:
        """Target-list width per device of a shape."""
        return rows_per_device * length


def shapes_for(tokens_per_device: int, longest: int | None = None, row_lengths: int = 2, fills: int = 4,
               quantum: int = ROW_QUANTUM) -> Shapes:
    """The shape set of a budget of ``tokens_per_device`` for sequences of at most ``longest``
    tokens (default: the budget): ``row_lengths`` row lengths, the longest twice ``longest``
    (room for a group's prompt and several of its responses) rounded up to ``quantum`` but at
    most the budget, each next one half the one before (down to ``quantum``); ``fills`` row
    counts each (``Shapes``). ``quantum``: ROW_QUANTUM for accelerators' tiles, CPU_ROW_QUANTUM on
    the CPU (``rl/run_setup.pack_shapes``), where a row's slots past its sequences are pure cost."""
    if row_lengths < 1 or fills < 1:
        raise ValueError(f"row_lengths={row_lengths} and fills={fills}: each must be >= 1")
    longest = tokens_per_device if longest is None else longest
    if longest > tokens_per_device:
        raise ValueError(f"sequences of up to {longest} tokens do not fit tokens_per_device={tokens_per_device}")
    length = min(tokens_per_device, -(-2 * longest // quantum) * quantum)
    ladder = [length]
    while len(ladder) < row_lengths and ladder[-1] > quantum:
        ladder.append(max(quantum, -(-ladder[-1] // 2 // quantum) * quantum))
    return Shapes(tokens_per_device, tuple(sorted(set(ladder))), fills)


def sequence_spans(attention_mask: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """[n, 2] (start, end) of each row's attended tokens, which must be contiguous (a
    left-padded prompt followed by a right-padded response). Rows with no token get (0, 0)."""
    mask = np.asarray(attention_mask) > 0
    if rows is not None:
        mask = mask[rows]
    any_tok = mask.any(axis=1)
    start = np.where(any_tok, mask.argmax(axis=1), 0)
    end = np.where(any_tok, mask.shape[1] - mask[:, ::-1].argmax(axis=1), 0)
    bad = np.flatnonzero(mask.sum(axis=1) != end - start)
    if bad.size:
        row = int(bad[0] if rows is None else np.asarray(rows)[bad[0]])
        raise ValueError(f"batch row {row}: attention_mask has holes; packing needs each row's tokens "
                         "contiguous (left-padded prompt, right-padded response)")
    return np.stack([start, end], axis=1)


def shared_prompts(input_ids: np.ndarray, response_mask: np.ndarray, rows, spans: np.ndarray):
    """(prefix [n], group [n]) of the sequences of dense batch ``rows`` (``spans`` their
    ``sequence_spans``): sequence i's prompt length (the tokens before its first response
    token) and the index of the first sequence with the same prompt, where at least one other
    sequence repeats it token for token; prefix 0 and group -1 elsewhere."""
    rows = np.asarray(rows, np.int64)
    prefix, group = np.zeros(len(rows), np.int64), np.full(len(rows), -1, np.int64)
    first: dict[bytes, int] = {}
    for i, (row, (start, end)) in enumerate(zip(rows, spans)):
        resp = np.flatnonzero(np.asarray(response_mask[row, start:end]) > 0)
        if resp.size and resp[0] > 0:  # a prompt, then a response (resp[0] == 0 is _layout's error)
            p = int(resp[0])
            key = np.asarray(input_ids[row, start:start + p]).astype(np.int64).tobytes()
            prefix[i], group[i] = p, first.setdefault(key, i)
    counts = np.bincount(group[group >= 0], minlength=len(rows))
    alone = (group < 0) | (counts[np.maximum(group, 0)] < 2)
    prefix[alone], group[alone] = 0, -1
    return prefix, group


def plan_micro_batches(attention_mask: np.ndarray, response_mask: np.ndarray, rows, *,
                       tokens_per_device: int, num_devices: int, attention_cost: float = 0.0,
                       input_ids: np.ndarray | None = None, shapes: Shapes | None = None) -> list[MicroBatch]:
    """Pack the sequences of dense batch ``rows`` into micro-batches of ``tokens_per_device``
    tokens per device on ``num_devices`` (data x fsdp) devices, each of a shape of ``shapes``
    (default ``shapes_for(tokens_per_device)``). Rows without tokens (batch padding) are
    skipped. ``attention_cost``: the cost of one attended key per slot relative to a slot's
    other (linear) cost (``attention_cost_per_key(model_cfg)``); a shape of ``rows x S`` costs
    rows * S * (1 + attention_cost * S). ``input_ids`` given: sequences with equal prompts share
    one prefix segment where they share a row (the module docstring)."""
    shapes = shapes_for(tokens_per_device) if shapes is None else shapes
    if shapes.tokens_per_device != tokens_per_device:
        raise ValueError(f"shapes for {shapes.tokens_per_device} tokens per device, not {tokens_per_device}")
    attention_mask, response_mask = np.asarray(attention_mask), np.asarray(response_mask)
    rows = np.asarray(rows, np.int64)
    spans = sequence_spans(attention_mask, rows)
    lengths = spans[:, 1] - spans[:, 0]
    too_long = np.flatnonzero(lengths > shapes.row_lengths[-1])
    if too_long.size:
        i = int(too_long[0])
        raise ValueError(f"batch row {int(rows[i])} holds {int(lengths[i])} tokens, more than the longest packed "
                         f"row ({shapes.row_lengths[-1]} of train.max_tokens_per_micro_batch={tokens_per_device}): "
                         "raise it to at least the longest prompt + response")
    share = (shared_prompts(input_ids, response_mask, rows, spans) if input_ids is not None
             else (np.zeros(len(rows), np.int64), np.full(len(rows), -1, np.int64)))
    remaining = sorted(np.flatnonzero(lengths > 0).tolist(), key=lambda i: (-int(lengths[i]), i))
    ladder = shapes.row_lengths
    cost = lambda length, count: count * length * (1.0 + attention_cost * length)
    out = []
    while remaining:
        # the row length that packs the most sequence tokens per unit of cost: longer rows fit short
        # sequences (and more of a group's responses) together, at attention's price of more keys
        # per token. A sequence counts at its full length, shared prompt or not.
        best = None
        for length in (s for s in ladder if s >= lengths[remaining[0]]):
            count = num_devices * (tokens_per_device // length)
            members, left = _first_fit(remaining, lengths, length, count, share)
            value = sum(int(lengths[i]) for g in members for i in g) / cost(length, count)
            if best is None or value > best[0]:
                best = (value, length, members, left)
        _, length, members, left = best
        if not left:  # what is left fits one micro-batch: the cheapest smaller shapes that hold it
            length, members, left = _tail(remaining, lengths, share, shapes, num_devices, cost, length, members)
        out.append(_layout(members, length, num_devices, rows, spans, response_mask, attention_mask.shape[1],
                           share[0], share[1]))
        remaining = left
    return out


def _tail(remaining, lengths, share, shapes: Shapes, num_devices: int, cost, length: int, members):
    """The next micro-batch of a mini-batch's tail, which a full micro-batch of rows of ``length``
    would hold (as ``members``): (row length, members, left for later micro-batches). Of the set's
    smaller shapes, either the cheapest that holds the whole tail, or the largest that does not,
    filled, when it and the cheapest shape holding the rest cost less: the tail is covered by
    fills as coins (a half and a quarter for three quarters), so its padding stays below the
    smallest fill, not below the largest."""
    whole = (cost(length, len(members)), length, members)
    smaller = _smaller_shapes(shapes, int(lengths[remaining[0]]), num_devices, cost)
    holding = [(cost(s, n), s, fit) for s, n in smaller for fit, rest in [_first_fit(remaining, lengths, s, n, share)]
               if not rest]
    best = min([whole] + holding[:1], key=lambda c: c[0])
    for s, n in sorted(smaller, key=lambda shape: -shape[0] * shape[1]):  # the largest that does not hold it
        fit, rest = _first_fit(remaining, lengths, s, n, share)
        if not rest:
            continue
        after = min((cost(s2, n2) for s2, n2 in smaller if not _first_fit(rest, lengths, s2, n2, share)[1]),
                    default=None)
        if after is not None and cost(s, n) + after < best[0]:
            return s, fit, rest
        break
    return best[1], best[2], []


def _smaller_shapes(shapes: Shapes, shortest: int, num_devices: int, cost) -> list[tuple[int, int]]:
    """(row length >= shortest, rows) shapes of ``shapes`` with fewer slots than a full micro-batch,
    cheapest first."""
    full = num_devices * shapes.tokens_per_device
    found = [(cost(length, num_devices * r), length, num_devices * r) for length, r in shapes.all()
             if length >= shortest and num_devices * r * length < full]
    return [(length, count) for _, length, count in sorted(found)]


def _first_fit(order, lengths, length: int, count: int, share):
    """First fit of ``order`` (longest first) into ``count`` rows of ``length``: (rows' members,
    leftovers). A sequence whose prompt a row already holds (``share``: prefix lengths, groups)
    goes to the first such row with room for its response alone, and costs only that."""
    prefix, group = share
    members: list[list[int]] = [[] for _ in range(count)]
    room = np.full(count, length)
    holders: dict[int, list[int]] = {}  # group -> rows holding its prompt
    left = []
    for i in order:
        size, g = int(lengths[i]), int(group[i])
        r = next((r for r in holders.get(g, ()) if room[r] >= size - prefix[i]), None) if g >= 0 else None
        if r is not None:
            size -= int(prefix[i])
        else:
            r = int(np.argmax(room >= size))
            if room[r] < size:
                left.append(i)
                continue
            if g >= 0:
                holders.setdefault(g, []).append(r)
        members[r].append(i)
        room[r] -= size
    return members, left


def _units(row_members: list[int], group) -> list[list[int]]:
    """A row's members as units laid out together: each shared group's members (its first holds
    the prompt), then every other sequence alone, in order of first appearance."""
    units: dict[int, list[int]] = {}
    for i in row_members:
        units.setdefault(int(group[i]) if group[i] >= 0 else -1 - i, []).append(i)
    return list(units.values())


def _layout(members: list[list[int]], length: int, num_devices: int, rows, spans, response_mask,
            width: int, prefix, group) -> MicroBatch:
    shape = (len(members), length)
    per_device = len(members) // num_devices
    token_src = np.full(shape, -1, np.int64)
    segment_ids = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    prefix_ids = np.zeros(shape, np.int32)
    pos_lists: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
    src_lists: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
    for r, row_members in enumerate(members):
        slot, seg = 0, 0
        base = (r % per_device) * length  # the row's first slot in its device's flattened rows
        for unit in _units(row_members, group):
            p = int(prefix[unit[0]]) if len(unit) > 1 else 0  # a prompt alone in its row is not split off
            if p:  # the shared prompt, from the unit's first sequence
                row, start = int(rows[unit[0]]), int(spans[unit[0]][0])
                seg += 1
                token_src[r, slot:slot + p] = row * width + np.arange(start, start + p)
                segment_ids[r, slot:slot + p] = seg
                positions[r, slot:slot + p] = np.arange(p)
                shared_seg, prompt_end = seg, slot + p - 1  # the slot that predicts each first response token
                slot += p
            for i in unit:  # each sequence (its response alone after a shared prompt)
                row, (start, end) = int(rows[i]), spans[i]
                start = int(start) + p
                n = int(end - start)
                seg += 1
                token_src[r, slot:slot + n] = row * width + np.arange(start, end)
                segment_ids[r, slot:slot + n] = seg
                positions[r, slot:slot + n] = np.arange(p, p + n)
                resp = np.flatnonzero(response_mask[row, start:end] > 0)
                if resp.size and resp[0] == 0 and not p:
                    raise ValueError(f"batch row {row}: a response token has no preceding token to predict it from")
                pred = slot + resp - 1  # the slot before each target predicts it
                if p:
                    prefix_ids[r, slot:slot + n] = shared_seg
                    pred = np.where(resp == 0, prompt_end, pred)
                pos_lists[r // per_device].append(base + pred)
                src_lists[r // per_device].append(row * width + start + resp)
                slot += n
    counts = [sum(len(x) for x in lst) for lst in pos_lists]
    k = Shapes.targets(per_device, length)
    target_pos = np.zeros((num_devices, k), np.int32)
    target_src = np.full((num_devices, k), -1, np.int64)
    for d in range(num_devices):
        if counts[d]:
            target_pos[d, :counts[d]] = np.concatenate(pos_lists[d])
            target_src[d, :counts[d]] = np.concatenate(src_lists[d])
    return MicroBatch(token_src, segment_ids, positions, prefix_ids, target_pos, target_src,
                      sum(len(g) for g in members))


def empty(length: int, rows: int, num_devices: int) -> MicroBatch:
    """A micro-batch of ``rows`` x ``length`` slots (all devices) holding nothing: ``gather`` gives
    arrays of that shape, for compiling a shape's programs before a batch needs it."""
    shape, per_device = (rows, length), rows // num_devices
    zeros = np.zeros(shape, np.int32)
    return MicroBatch(np.full(shape, -1, np.int64), zeros, zeros, zeros,
                      np.zeros((num_devices, Shapes.targets(per_device, length)), np.int32),
                      np.full((num_devices, Shapes.targets(per_device, length)), -1, np.int64), 0)


def gather(mb: MicroBatch, tokens: dict[str, np.ndarray], targets: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The micro-batch's arrays: ``tokens`` entries (dense [B, T]) at its slots, ``targets``
    entries at its targets (0 where unused), plus segment_ids, positions, prefix_ids, target_pos and
    ``target_mask`` (1 on used targets)."""
    out = {"segment_ids": mb.segment_ids, "positions": mb.positions, "prefix_ids": mb.prefix_ids,
           "target_pos": mb.target_pos, "target_mask": (mb.target_src >= 0).astype(np.int32)}
    for arrays, index in ((tokens, mb.token_src), (targets, mb.target_src)):
        safe, valid = np.maximum(index, 0), index >= 0
        for key, dense in arrays.items():
            dense = np.asarray(dense)
            out[key] = np.where(valid, dense.reshape(-1)[safe], 0).astype(dense.dtype)
    return out


def scatter_targets(micro_batches: list[MicroBatch], values: list[np.ndarray], shape) -> np.ndarray:
    """Per-target values of each micro-batch -> a dense float32 array of ``shape`` (0 off the targets)."""
    out = np.zeros(int(np.prod(shape)), np.float32)
    for mb, v in zip(micro_batches, values):
        used = mb.target_src >= 0
        out[mb.target_src[used]] = np.asarray(v)[used]
    return out.reshape(shape)


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a plan processes: token slots, real tokens among them, and target slots (the
    positions projected onto the vocabulary, used or not)."""

    slots: int = 0
    real_tokens: int = 0
    target_slots: int = 0

    @property
    def padding(self) -> float:
        """Share of the processed token slots that hold no real token."""
        return 1.0 - self.real_tokens / max(self.slots, 1)

    def __add__(self, other: "Summary") -> "Summary":
        return Summary(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def summary(micro_batches: list[MicroBatch]) -> Summary:
    return sum((Summary(mb.token_src.size, mb.real_tokens, mb.target_src.size) for mb in micro_batches), Summary())
