"""The device programs of tool episodes (``episodes.py`` runs them): ``start``, the ``decode`` loop
(one ``step`` per token), ``resume`` (the host's answers in, the cache realigned), and the
length-aware schedule's ``compact``, ``grow`` and ``scatter``. The prefill is the sampler's
(``programs.prefill``), and so are the forward pass and the draw.

A row's response is its episode after the prompt: the policy's tokens and the observations' in
one buffer ``tokens`` [N, R], ``kind`` saying which is which (``ACTION``, ``OBSERVATION``). Every
row runs at its own position: ``length`` (its tokens so far; the last one not yet in the cache)
counts its draws, so a row's Gumbel noise is that of (key, its position, its global index), as in
the single-turn sampler, whatever the other rows did. An observation is fed as forced tokens, one
per decode step: the host writes it to the row's ``feed`` buffer [N, O] (``resume``) and the step
puts ``feed[feed_at]`` where it would have drawn, with no log-prob (0) and ``kind`` OBSERVATION,
so the observation costs the row its own length in steps of a loop the batch runs anyway (no
prefill program per observation length, and rows that are drawing are never held up).

The KV cache is the sampler's, one write slot ``cursor`` for every row per step. A row whose turn
has ended (``WAITING``: an EOS, its stop marker, its turn's token cap or the total budget) waits for
the host: its slots from then on are holes (``kv_mask`` 0), and the loop leaves once half of the
rows still in play wait (or one of the sampler's exits: a full cache, rows that fit a smaller row
bucket). ``resume`` then takes the host's answers (the observation to feed, or the end of the
episode) and realigns the cache, which keeps every row's slots contiguous, as the GPU's decode
kernel and a sliding window need: each row's slots are rolled right past its holes, and every row
left by the free slots they all have (the longest row's prompt padding, or holes), so the cursor
sits just past the longest row and holes never use up the cache. One roll of the whole cache, a
layer at a time, skipped when no row moves.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from arlopti_jax.models.config import ModelConfig
from arlopti_jax.rollout.programs import (_cache_map, _constrain_cache, _forward, _is_eos, _next_logits, _pad_axis,
                                          _rows, per_layer_cache)
from arlopti_jax.rollout.sampling import sample_tokens

Array = jax.Array
ACTIVE, WAITING, DONE = 0, 1, 2  # a row's status
ACTION, OBSERVATION = 1, 2  # ``kind`` of a response token (0: padding)
EOS, MARKER, TURN_CAP, BUDGET = 1, 2, 3, 4  # ``reason``: why a row's turn ended
REASONS = {EOS: "eos", MARKER: "marker", TURN_CAP: "turn_cap", BUDGET: "budget"}
OUTPUTS = ("tokens", "logprobs", "kind", "length", "reason")  # what ``scatter`` writes out per row
ROW_FIELDS = ("kv_mask", "prompt_len", "tokens", "logprobs", "kind", "length", "status", "reason", "turn_start",
              "marker", "feed", "feed_len", "feed_at", "holes", "rows")


class EpisodeState(NamedTuple):
    """The episode decode loop's carry. N rows (padded prompts x n, fewer after compaction); S
    cache slots; R = the episode's token budget after the prompt; O = an observation's most tokens."""

    cache: dict  # the sampler's: {"k", "v"} [L, N, K, S, H], or a tuple of L buffers each (GPU)
    kv_mask: Array  # [N, S] int32: 1 on a row's filled slots (its prompt, then what it has fed)
    prompt_len: Array  # [N] int32: the prompt's real tokens (position id of response token 0)
    tokens: Array  # [N, R] int32: the episode's tokens after the prompt, in order
    logprobs: Array  # [N, R] float32: the policy's log-prob of each drawn token; 0 on observations
    kind: Array  # [N, R] int32: ACTION, OBSERVATION, 0 after the end
    length: Array  # [N] int32: tokens so far (the last one is fed at the next step)
    status: Array  # [N] int32: ACTIVE, WAITING, DONE (batch padding starts DONE)
    reason: Array  # [N] int32: why the last turn ended (``REASONS``), 0 while it runs
    turn_start: Array  # [N] int32: the index in ``tokens`` of this turn's first action token
    marker: Array  # [N] int32: the stop marker's automaton state over this turn (``markers.py``)
    feed: Array  # [N, O] int32: the observation being fed
    feed_len: Array  # [N] int32
    feed_at: Array  # [N] int32: its next token to feed
    holes: Array  # [N] int32: slots a waiting row has let pass (its run's end lies that far back)
    rows: Array  # [N] int32: each row's global index (i * n + j); >= the output rows for filler rows
    cursor: Array  # int32: the cache slot every row writes at the next step


def constrain(state: EpisodeState) -> EpisodeState:
    return state._replace(cache=_constrain_cache(state.cache), **{f: _rows(getattr(state, f)) for f in ROW_FIELDS})


def _put_at(buf: Array, index: Array, values: Array) -> Array:
    """``buf[r, index[r]] = values[r]`` for every row (an index out of range writes nothing)."""
    return buf.at[jnp.arange(buf.shape[0]), index].set(values.astype(buf.dtype), mode="drop")


def _draw(logits, key, s: EpisodeState, temperature, top_p, kernel, greedy):
    """Each active row's next token at its own position: its observation's next token where it is
    being fed (log-prob 0), else a draw; and whether it was fed."""
    top_k, use_top_p, _ = kernel
    active = s.status == ACTIVE
    feeding = active & (s.feed_at < s.feed_len)
    forced = jnp.take_along_axis(s.feed, jnp.minimum(s.feed_at, s.feed.shape[1] - 1)[:, None], axis=1)[:, 0]
    tok, lp = sample_tokens(logits, key, s.length, s.rows, temperature, top_p, top_k=top_k, use_top_p=use_top_p,
                            greedy=greedy, forced=jnp.where(feeding, forced, -1))
    return tok, jnp.where(feeding, 0.0, lp), feeding


def _record(s: EpisodeState, tok, lp, feeding, eos_ids, table, turn_tokens) -> EpisodeState:
    """``s`` with each active row's new token appended and its turn ended where it must be."""
    active = s.status == ACTIVE
    index = jnp.where(active, s.length, s.tokens.shape[1])
    length = s.length + active
    drawn = active & ~feeding
    marker = jnp.where(drawn, table[tok, s.marker].astype(jnp.int32), s.marker)
    eos = drawn & _is_eos(tok, eos_ids)
    called = drawn & (marker == table.shape[1] - 1)
    capped = drawn & (length - s.turn_start >= turn_tokens)
    budget = active & (length >= s.tokens.shape[1])
    ends = eos | called | capped | budget
    reason = jnp.select([eos, called, budget, capped], [EOS, MARKER, BUDGET, TURN_CAP], 0)  # in this order
    waiting = s.status == WAITING
    return s._replace(
        tokens=_put_at(s.tokens, index, tok), logprobs=_put_at(s.logprobs, index, lp),
        kind=_put_at(s.kind, index, jnp.where(feeding, OBSERVATION, ACTION)),
        length=length, status=jnp.where(ends, WAITING, s.status), reason=jnp.where(ends, reason, s.reason),
        marker=marker, feed_at=s.feed_at + feeding, holes=jnp.where(waiting, s.holes + 1, 0))


def start(prompt_cache: dict, logits: Array, prompt_mask: Array, live: Array, feed: Array, feed_len: Array,
          key: Array, temperature: Array, top_p: Array, eos_ids: Array, table: Array, turn_tokens: Array, *,
          n: int, max_len: int, slots: int, kernel: tuple, greedy: Array | bool = False) -> EpisodeState:
    """The prompts' cache repeated to their n samples and widened to ``slots``; every row's first
    token: its first observation's (``feed`` [N, O], ``feed_len`` [N]: the environment's, from its
    reset; none is 0), else a draw from the shared prefill logits."""
    pad_id = kernel[2]
    prompt_slots = prompt_mask.shape[1]
    cache = _cache_map(prompt_cache, lambda c, axis: _pad_axis(jnp.repeat(c, n, axis=axis), axis + 2,
                                                                 slots - prompt_slots), 1)
    mask_n = jnp.repeat(prompt_mask, n, axis=0)
    count = mask_n.shape[0]
    live = jnp.repeat(live, n, axis=0)
    zeros = jnp.zeros((count,), jnp.int32)
    state = EpisodeState(
        cache=cache, kv_mask=jnp.pad(mask_n, ((0, 0), (0, slots - prompt_slots))),
        prompt_len=jnp.sum(mask_n, axis=1, dtype=jnp.int32),
        tokens=jnp.full((count, max_len), pad_id, jnp.int32), logprobs=jnp.zeros((count, max_len), jnp.float32),
        kind=jnp.zeros((count, max_len), jnp.int32), length=zeros,
        status=jnp.where(live, ACTIVE, DONE).astype(jnp.int32), reason=zeros, turn_start=feed_len, marker=zeros,
        feed=feed, feed_len=feed_len, feed_at=zeros, holes=zeros, rows=jnp.arange(count, dtype=jnp.int32),
        cursor=jnp.int32(prompt_slots))
    tok, lp, feeding = _draw(jnp.repeat(logits, n, axis=0), key, state, temperature, top_p, kernel, greedy)
    tok = jnp.where(live, tok, pad_id)
    return constrain(_record(state, tok, lp, feeding, eos_ids, table, turn_tokens))


def step(cfg: ModelConfig, params, s: EpisodeState, key: Array, temperature: Array, top_p: Array, eos_ids: Array,
         table: Array, turn_tokens: Array, *, kernel: tuple, unroll: bool = False,
         greedy: Array | bool = False) -> EpisodeState:
    """One decode step: each active row feeds its last token at slot ``cursor`` and appends its
    next; the others mark that slot empty."""
    pad_id = kernel[2]
    active = s.status == ACTIVE
    prev = jnp.take_along_axis(s.tokens, jnp.maximum(s.length - 1, 0)[:, None], axis=1)
    pos = (s.prompt_len + s.length - 1)[:, None]
    kv_mask = jax.lax.dynamic_update_slice_in_dim(s.kv_mask, active[:, None].astype(s.kv_mask.dtype), s.cursor, axis=1)
    hidden, cache = _forward(cfg, params, prev, pos, kv_mask, s.cache, s.cursor, unroll)
    s = s._replace(cache=cache, kv_mask=kv_mask, cursor=s.cursor + 1)
    tok, lp, feeding = _draw(_next_logits(cfg, params, hidden), key, s, temperature, top_p, kernel, greedy)
    return constrain(_record(s, jnp.where(active, tok, pad_id), lp, feeding, eos_ids, table, turn_tokens))


def counts(status: Array, devices: int) -> tuple[Array, Array, Array]:
    """(the most rows still in play on one device, rows waiting, rows in play): rows are split
    evenly over ``devices``."""
    playing = status != DONE
    busiest = jnp.max(jnp.sum(playing.reshape(devices, -1), axis=1, dtype=jnp.int32))
    return busiest, jnp.sum(status == WAITING, dtype=jnp.int32), jnp.sum(playing, dtype=jnp.int32)


def status_of(state: EpisodeState, devices: int) -> Array:
    """What the host reads after each program: [cursor, busiest, waiting, in play]."""
    return jnp.stack([state.cursor, *counts(state.status, devices)])


def decode(cfg: ModelConfig, params, state: EpisodeState, key: Array, temperature: Array, top_p: Array,
           eos_ids: Array, table: Array, turn_tokens: Array, compact_at: Array, *, kernel: tuple, devices: int,
           greedy: Array | bool = False) -> tuple[EpisodeState, Array]:
    """Decode while the cache has room, some device holds more than ``compact_at`` rows in play,
    and fewer than half of the rows in play wait for the host. Returns the state and
    ``status_of`` it."""
    unroll = per_layer_cache()

    def cond(s: EpisodeState):
        busiest, waiting, playing = counts(s.status, devices)
        return (s.cursor < s.kv_mask.shape[1]) & (busiest > compact_at) & (2 * waiting < playing)

    def body(s: EpisodeState) -> EpisodeState:
        return step(cfg, params, s, key, temperature, top_p, eos_ids, table, turn_tokens, kernel=kernel,
                    unroll=unroll, greedy=greedy)

    state = jax.lax.while_loop(cond, body, constrain(state))
    return state, status_of(state, devices)


def _roll_slots(x: Array, shift: Array, slot_axis: int, row_axis: int) -> Array:
    """Each row's slots moved right by its ``shift`` (left where negative), cyclically."""
    s = x.shape[slot_axis]
    source = (jnp.arange(s)[None, :] - shift[:, None]) % s  # [N, S]
    shape = [1] * x.ndim
    shape[row_axis], shape[slot_axis] = source.shape
    return jnp.take_along_axis(x, source.reshape(shape), axis=slot_axis)


def _roll_layers(x: Array, shift: Array, axis: int) -> Array:
    """``_roll_slots`` of a cache buffer whose rows are ``axis``: a per-layer buffer at once, the
    stacked one ([L, N, K, S, H]) a layer at a time in place, so that the temporaries are one layer's
    (a gather of the whole stack took twice the cache's bytes on XLA:TPU)."""
    if axis == 0:
        return _roll_slots(x, shift, 2, 0)

    def layer(i, x):
        rolled = _roll_slots(jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), shift, 2, 0)
        return jax.lax.dynamic_update_index_in_dim(x, rolled, i, 0)
    return jax.lax.fori_loop(0, x.shape[0], layer, x)


def resume(state: EpisodeState, finish: Array, feed: Array, feed_len: Array, *, devices: int):
    """The host's answers to the waiting rows: ``finish`` [N] ends a row's episode; any other
    waiting row resumes, feeding ``feed`` [N, O] (``feed_len`` [N] tokens). Then the realignment
    (module docstring). Returns the state and ``status_of`` it."""
    waiting = state.status == WAITING
    serve = waiting & ~finish
    status = jnp.where(finish, DONE, jnp.where(serve, ACTIVE, state.status)).astype(jnp.int32)
    playing = status != DONE
    slot = jnp.arange(state.kv_mask.shape[1])
    run = jnp.sum(state.kv_mask * (slot[None, :] < state.cursor), axis=1, dtype=jnp.int32)
    free = state.cursor - run  # a row's free slots once its holes are gone
    common = jnp.where(jnp.any(playing), jnp.min(jnp.where(playing, free, state.cursor)), 0)
    shift = jnp.where(playing, state.holes - common, 0)
    moves = jnp.any(shift != 0)
    roll = lambda c, axis: jax.lax.cond(moves, lambda c: _roll_layers(c, shift, axis), lambda c: c, c)
    kv_mask = jnp.where(moves, _roll_slots(state.kv_mask, shift, 1, 0), state.kv_mask)
    wrapped = (slot[None, :] < shift[:, None])  # slots a right roll brought round from the end: empty
    new = state._replace(
        cache=_cache_map(state.cache, roll, 1), kv_mask=jnp.where(wrapped, 0, kv_mask).astype(state.kv_mask.dtype),
        status=status, feed=jnp.where(serve[:, None], feed, state.feed), feed_len=jnp.where(serve, feed_len,
                                                                                            state.feed_len),
        feed_at=jnp.where(serve, 0, state.feed_at), turn_start=jnp.where(serve, state.length + feed_len,
                                                                           state.turn_start),
        marker=jnp.where(serve, 0, state.marker), reason=jnp.where(serve, 0, state.reason),
        holes=jnp.zeros_like(state.holes), cursor=state.cursor - common)
    new = constrain(new)
    return new, status_of(new, devices)


def _take_rows(x: Array, order: Array, devices: int, axis: int = 0) -> Array:
    """Rows ``order`` [devices, rows] of each device's block of ``x``'s ``axis``."""
    per = x.shape[axis] // devices
    rows = order.shape[1]
    split = x.reshape(x.shape[:axis] + (devices, per) + x.shape[axis + 1:])
    index = order.reshape((1,) * axis + (devices, rows) + (1,) * (x.ndim - axis - 1))
    picked = jnp.take_along_axis(split, index, axis=axis + 1)
    return picked.reshape(x.shape[:axis] + (devices * rows,) + x.shape[axis + 1:])


def row_part(state: EpisodeState) -> dict:
    """What ``scatter`` reads of a state: its outputs and its rows' global indices."""
    return {name: getattr(state, name) for name in OUTPUTS + ("rows",)}


def scatter(out: dict, part: dict, devices: int) -> dict:
    """Write a state's rows (``row_part``) into the full outputs at their global indices; each
    device writes its own block (a row never leaves its device; filler rows are dropped)."""
    per_out, per = out["tokens"].shape[0] // devices, part["rows"].shape[0] // devices
    local = part["rows"].reshape(devices, per) - per_out * jnp.arange(devices, dtype=jnp.int32)[:, None]
    local = jnp.where((local >= 0) & (local < per_out), local, per_out)

    def put(buf: Array, new: Array) -> Array:
        split = buf.reshape((devices, per_out) + buf.shape[1:])
        rows = new.reshape((devices, per) + new.shape[1:])
        return _rows(jax.vmap(lambda b, i, x: b.at[i].set(x, mode="drop"))(split, local, rows).reshape(buf.shape))

    return {name: put(out[name], part[name]) for name in OUTPUTS}


def outputs(state: EpisodeState) -> dict:
    return {name: _rows(getattr(state, name)) for name in OUTPUTS}


def compact(state: EpisodeState, out: dict | None, *, rows: int, devices: int):
    """Save every row into ``out`` (the state's own arrays when None), then keep ``rows`` of each
    device's rows, those still in play first (filler: finished rows, marked out of range)."""
    out = outputs(state) if out is None else scatter(out, row_part(state), devices)
    order = jnp.argsort((state.status == DONE).reshape(devices, -1), axis=1, stable=True)[:, :rows]
    taken = {f: _take_rows(getattr(state, f), order, devices) for f in ROW_FIELDS}
    done = taken["status"] == DONE
    taken["rows"] = jnp.where(done, out["tokens"].shape[0], taken["rows"])
    cache = _cache_map(state.cache, lambda c, axis: _take_rows(c, order, devices, axis), 1)
    return constrain(state._replace(cache=cache, **taken)), out


def grow(state: EpisodeState, *, slots: int) -> EpisodeState:
    """The state with ``slots`` cache slots (the new ones empty)."""
    extra = slots - state.kv_mask.shape[1]
    cache = _cache_map(state.cache, lambda c, axis: _pad_axis(c, axis, extra), 3)
    return constrain(state._replace(cache=cache, kv_mask=jnp.pad(state.kv_mask, ((0, 0), (0, extra)))))
