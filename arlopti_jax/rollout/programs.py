"""The sampler's device programs, jitted by ``Sampler`` (``sampler.py`` says when each runs):
``prefill``, ``start``, the ``decode`` loop (one ``step`` per token), and the length-aware
schedule's ``compact``, ``grow`` and ``scatter``.

On CPU and TPU the KV cache is {"k", "v"}: [L, N, K, S, H] (``CACHE_AXES``) and the layers run
as the decoder's own loop (``Decoder``'s scan, the whole cache in its carry, each layer writing
its new slots in place), whatever ``ModelConfig.unroll_layers`` says: a program holds one layer
body, so its compile time does not grow with the layer count (all sampler programs at 1.5B: 20 s
instead of 186 s on CPU, docs/measurements/journal.md). The price, on CPU: a decode step of 4 layers at
0.5B's widths took 1.14x the straight-line layers' time (interleaved runs of bench/rollout.py).
On a GPU (``per_layer_cache``) the cache is a tuple of L buffers [N, K, S, H] each, the weights
likewise (``Sampler.sampling_params``), and the layers run straight-line: XLA:GPU copies a layer's
slice of a stacked array out before every product that reads it, and the straight-line step
becomes one command buffer. ``unroll_layers`` still shapes the training passes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models.config import ModelConfig
from arlopti_jax.models.decode import CACHE_AXES, fused_counters, fused_layer, fused_layers
from arlopti_jax.models.decoder import Block, Decoder, embed, layer_masks, norm, position_ids
from arlopti_jax.models.policy import unembed
from arlopti_jax.rollout.sampling import sample_tokens

Array = jax.Array
OUTPUTS = ("tokens", "logprobs", "mask", "finished")


class DecodeState(NamedTuple):
    """The decode loop's carry. N rows (padded prompts x n, fewer after compaction);
    S = P + e cache slots; R = max_response_len."""

    cache: dict  # {"k", "v"}: [L, N, K, S, H]
    kv_mask: Array  # [N, S] int32: the prompt mask, then ones over the response slots
    prompt_len: Array  # [N] int32: position id of response token 0
    tokens: Array  # [N, R] int32
    logprobs: Array  # [N, R] float32
    mask: Array  # [N, R] int32
    finished: Array  # [N] bool (batch-padding rows start finished)
    rows: Array  # [N] int32: each row's global index (i * n + j); >= the output rows for filler rows
    stop_at: Array  # [N] int32: response length at which an EOS is forced (> R: never)
    prompt_slots: Array  # int32: P, the cache slot of response token 0
    step: Array  # int32: the next response position to sample


def row_fields(state: DecodeState) -> dict:
    """What ``scatter`` reads of a state: its outputs and its rows' global indices."""
    return {name: getattr(state, name) for name in OUTPUTS + ("rows",)}


def _pad_axis(x: Array, axis: int, extra: int) -> Array:
    """``x`` with ``extra`` zeros appended along ``axis``."""
    return jnp.pad(x, [(0, extra if i == axis else 0) for i in range(x.ndim)])


def _rows(x: Array) -> Array:
    return nn.with_logical_constraint(x, ("act_batch",) + (None,) * (x.ndim - 1))


def per_layer_cache(platform: str | None = None) -> bool:
    """Whether the cache is one buffer per layer, the decode step's layers running straight-line
    and each attending to a whole buffer of its own (on a GPU), rather than one stacked buffer the
    layer loop indexes (elsewhere). With the stacked cache, XLA:GPU copies each layer's slice out
    before reading it, at every layer of every step; XLA:TPU reads it in place (the attention reads
    the cache before it writes it: ``decode.cached_attention``), and the loop keeps compiles short.
    ``platform``: the mesh's (default: the one programs are traced for, ``sharding.platform``)."""
    return (platform or shd.platform()) == "gpu"


def _cache_map(cache: dict, fn, axis: int) -> dict:
    """``fn(buffer, axis)`` on every cache buffer; ``axis`` counts the stacked layout's axes
    ([L, N, K, S, H]), one less in a per-layer buffer ([N, K, S, H])."""
    if isinstance(cache["k"], (list, tuple)):
        return {name: tuple(fn(c, axis - 1) for c in buffers) for name, buffers in cache.items()}
    return {name: fn(c, axis) for name, c in cache.items()}


def _constrain_cache(cache: dict) -> dict:
    if isinstance(cache["k"], (list, tuple)):
        return {name: tuple(nn.with_logical_constraint(c, CACHE_AXES[1:]) for c in buffers)
                for name, buffers in cache.items()}
    return {name: nn.with_logical_constraint(c, CACHE_AXES) for name, c in cache.items()}


def _constrain(state: DecodeState) -> DecodeState:
    cache = _constrain_cache(state.cache)
    rows = {f: _rows(getattr(state, f)) for f in ("kv_mask", "prompt_len", "rows", "stop_at") + OUTPUTS}
    return state._replace(cache=cache, **rows)


def _next_logits(cfg: ModelConfig, params, hidden: Array) -> Array:
    """float32 logits [B, V] of the last position of hidden [B, T, D] (soft-capped where the model caps them)."""
    return unembed(cfg, params, hidden[:, -1:])[:, 0]


def _is_eos(tokens: Array, eos_ids: Array) -> Array:
    return jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)


def _forward(cfg: ModelConfig, params, tokens: Array, positions: Array, kv_mask: Array, cache: dict,
             cache_index, unroll: bool = False) -> tuple[Array, dict]:
    """Final-norm hidden states [B, T, D] and the updated cache, the layers as a loop (``unroll``:
    straight-line layers, each reading its own weights and cache slice at a constant index). A
    sampling pass keeps no activations for a backward pass, so it never rematerialises."""
    cfg = dataclasses.replace(cfg, unroll_layers=False, remat=False)
    if not unroll and not isinstance(cache["k"], (list, tuple)) and not isinstance(params["layers"], tuple):
        hidden, cache = Decoder(cfg).apply({"params": params}, tokens, positions, kv_mask, cache=cache,
                                           cache_index=cache_index)
        return hidden, _constrain_cache(cache)
    x = embed(cfg, params["embedding"], tokens)
    masks = layer_masks(cfg, kv_mask, tokens.shape[1], cache_index)
    counters = fused_counters(cfg, tokens.shape[0]) if fused_layers(cfg, tokens.shape[1], cache) else None
    for i in range(cfg.num_layers):
        layers = params["layers"]  # a buffer per layer (``Sampler.sampling_params``), or stacked
        layer = layers[i] if isinstance(layers, tuple) else jax.tree.map(lambda w: w[i], layers)
        if counters is not None:  # a decode step's layer in 6 kernels (GPU; ``decode.fused_layer``)
            x, cache, counters = fused_layer(cfg, layer, x, positions, masks, cache, i, cache_index, counters)
        else:
            (x, cache), _ = Block(cfg).apply({"params": layer}, (x, cache), i, positions, masks, cache_index)
    return norm(cfg).apply({"params": params["final_norm"]}, x), _constrain_cache(cache)


def prefill(cfg: ModelConfig, params, prompt_ids: Array, prompt_mask: Array):
    """Each prompt once through the decoder: its cache of P slots and its next-token logits."""
    b, p = prompt_ids.shape
    layer = (b, cfg.num_kv_heads, p, cfg.head_dim)
    if per_layer_cache():
        zeros = lambda: tuple(jnp.zeros(layer, cfg.compute_dtype) for _ in range(cfg.num_layers))
    else:
        zeros = lambda: jnp.zeros((cfg.num_layers,) + layer, cfg.compute_dtype)
    empty = _constrain_cache({"k": zeros(), "v": zeros()})
    hidden, cache = _forward(cfg, params, prompt_ids, position_ids(prompt_mask), prompt_mask, empty, 0)
    return cache, _rows(_next_logits(cfg, params, hidden))


def _sample(logits, key, step, rows, stop_at, eos_ids, temperature, top_p, kernel, greedy):
    top_k, use_top_p, _ = kernel
    forced = jnp.where(step + 1 >= stop_at, eos_ids[0], -1)
    return sample_tokens(logits, key, step, rows, temperature, top_p, top_k=top_k, use_top_p=use_top_p,
                         greedy=greedy, forced=forced)


def start(prompt_cache: dict, logits: Array, prompt_mask: Array, live: Array, stop_at: Array, key: Array,
          temperature: Array, top_p: Array, eos_ids: Array, *, n: int, max_len: int, slots: int,
          kernel: tuple, greedy: Array | bool = False) -> DecodeState:
    """The prompts' cache repeated to their n samples and widened to ``slots``; every sample
    draws its first token from the shared prefill logits. ``greedy``: a traced bool (argmax
    decoding or the draw, one program for both; ``sampling.sample_tokens``)."""
    pad_id = kernel[2]
    prompt_slots = prompt_mask.shape[1]
    cache = _cache_map(prompt_cache, lambda c, axis: _pad_axis(jnp.repeat(c, n, axis=axis), axis + 2,
                                                                 slots - prompt_slots), 1)
    mask_n = jnp.repeat(prompt_mask, n, axis=0)
    count = mask_n.shape[0]
    live = jnp.repeat(live, n, axis=0)
    rows = jnp.arange(count, dtype=jnp.int32)
    tok, lp = _sample(jnp.repeat(logits, n, axis=0), key, 0, rows, stop_at, eos_ids, temperature, top_p, kernel,
                      greedy)
    tok = jnp.where(live, tok, pad_id)
    state = DecodeState(
        cache=cache,
        kv_mask=jnp.concatenate([mask_n, jnp.ones((count, slots - prompt_slots), mask_n.dtype)], axis=1),
        prompt_len=jnp.sum(mask_n, axis=1, dtype=jnp.int32),
        tokens=jnp.full((count, max_len), pad_id, jnp.int32).at[:, 0].set(tok),
        logprobs=jnp.zeros((count, max_len), jnp.float32).at[:, 0].set(jnp.where(live, lp, 0.0)),
        mask=jnp.zeros((count, max_len), jnp.int32).at[:, 0].set(live.astype(jnp.int32)),
        finished=~live | _is_eos(tok, eos_ids),
        rows=rows,
        stop_at=stop_at,
        prompt_slots=jnp.int32(prompt_slots),
        step=jnp.ones((), jnp.int32),
    )
    return _constrain(state)


def _busiest(finished: Array, devices: int) -> Array:
    """The most unfinished rows any one device holds (rows are split evenly over ``devices``)."""
    return jnp.max(jnp.sum(~finished.reshape(devices, -1), axis=1, dtype=jnp.int32))


def step(cfg: ModelConfig, params, s: DecodeState, key: Array, temperature: Array, top_p: Array, eos_ids: Array, *,
         kernel: tuple, unroll: bool = False, greedy: Array | bool = False) -> DecodeState:
    """One decode step: feed the last token at slot P + t - 1, sample token t for every row."""
    pad_id = kernel[2]
    t = s.step
    prev = jax.lax.dynamic_slice_in_dim(s.tokens, t - 1, 1, axis=1)
    pos = (s.prompt_len + t - 1)[:, None]
    hidden, cache = _forward(cfg, params, prev, pos, s.kv_mask, s.cache, s.prompt_slots + t - 1, unroll)
    tok, lp = _sample(_next_logits(cfg, params, hidden), key, t, s.rows, s.stop_at, eos_ids, temperature,
                      top_p, kernel, greedy)
    alive = ~s.finished
    tok = jnp.where(alive, tok, pad_id)
    put = lambda buf, col: jax.lax.dynamic_update_slice_in_dim(buf, col[:, None].astype(buf.dtype), t, axis=1)
    return _constrain(s._replace(
        cache=cache,
        tokens=put(s.tokens, tok),
        logprobs=put(s.logprobs, jnp.where(alive, lp, 0.0)),
        mask=put(s.mask, alive),
        finished=s.finished | _is_eos(tok, eos_ids),
        step=t + 1,
    ))


def decode(cfg: ModelConfig, params, state: DecodeState, key: Array, temperature: Array, top_p: Array,
           eos_ids: Array, compact_at: Array, *, kernel: tuple, devices: int,
           greedy: Array | bool = False) -> tuple[DecodeState, Array]:
    """Decode until R tokens, a full cache, or no device holds more than ``compact_at``
    unfinished rows (0: until every row has finished). Returns the state and [step, busiest]."""
    max_len = state.tokens.shape[1]
    limit = jnp.minimum(max_len, state.kv_mask.shape[1] - state.prompt_slots)

    def cond(s: DecodeState):
        return (s.step < limit) & (_busiest(s.finished, devices) > compact_at)

    # On a GPU the step's layers run straight-line, each reading its own weights and cache buffer at a
    # constant index (per_layer_cache), and the whole step is one command buffer (one CUDA graph
    # launch per token instead of about 16 per layer; bench/roofline.py). Elsewhere the loop keeps
    # compiles short (on CPU 20 s instead of 186 s for the sampler's programs at 1.5B).
    unroll = per_layer_cache()

    def body(s: DecodeState) -> DecodeState:
        return step(cfg, params, s, key, temperature, top_p, eos_ids, kernel=kernel, unroll=unroll, greedy=greedy)

    state = jax.lax.while_loop(cond, body, _constrain(state))
    return state, jnp.stack([state.step, _busiest(state.finished, devices)])


def scatter(out: dict, part: dict, devices: int) -> dict:
    """Write a state's rows (``row_fields``) into the [N, R] outputs at their global indices.
    A row never leaves its device (``compact``), so each device writes into its own block of
    rows (filler rows, whose index is out of range, are dropped)."""
    per_out, per = out["tokens"].shape[0] // devices, part["rows"].shape[0] // devices
    local = part["rows"].reshape(devices, per) - per_out * jnp.arange(devices, dtype=jnp.int32)[:, None]
    local = jnp.where((local >= 0) & (local < per_out), local, per_out)

    def put(buf: Array, new: Array) -> Array:
        split = buf.reshape((devices, per_out) + buf.shape[1:])
        rows = new.reshape((devices, per) + new.shape[1:])
        done = jax.vmap(lambda b, i, x: b.at[i].set(x, mode="drop"))(split, local, rows)
        return _rows(done.reshape(buf.shape))

    return {name: put(out[name], part[name]) for name in OUTPUTS}


def compact(state: DecodeState, out: dict | None, *, rows: int, devices: int):
    """Save every row into ``out`` (the state's own arrays when None: nothing compacted yet),
    then keep ``rows`` of each device's rows, its unfinished ones first (filler: finished
    rows, marked out of range). The cache keeps its slots."""
    out = {name: _rows(getattr(state, name)) for name in OUTPUTS} if out is None else scatter(
        out, row_fields(state), devices)
    count = state.finished.shape[0]
    per = count // devices
    # a stable sort of each device's own rows, unfinished first: a gather that stays on the device
    order = jnp.argsort(state.finished.reshape(devices, per), axis=1, stable=True)[:, :rows]

    def take(x: Array, axis: int = 0) -> Array:
        split = x.reshape(x.shape[:axis] + (devices, per) + x.shape[axis + 1:])
        index = order.reshape((1,) * axis + (devices, rows) + (1,) * (x.ndim - axis - 1))
        picked = jnp.take_along_axis(split, index, axis=axis + 1)
        return picked.reshape(x.shape[:axis] + (devices * rows,) + x.shape[axis + 1:])

    finished = take(state.finished)
    new = state._replace(
        cache=_cache_map(state.cache, lambda c, axis: take(c, axis=axis), 1),
        kv_mask=take(state.kv_mask),
        prompt_len=take(state.prompt_len),
        tokens=take(state.tokens),
        logprobs=take(state.logprobs),
        mask=take(state.mask),
        finished=finished,
        rows=jnp.where(finished, out["tokens"].shape[0], take(state.rows)),
        stop_at=take(state.stop_at),
    )
    return _constrain(new), out


def grow(state: DecodeState, *, slots: int) -> DecodeState:
    """The state with ``slots`` cache slots: the new ones empty and attendable (kv_mask 1)."""
    extra = slots - state.kv_mask.shape[1]
    cache = _cache_map(state.cache, lambda c, axis: _pad_axis(c, axis, extra), 3)
    return _constrain(state._replace(cache=cache, kv_mask=jnp.pad(state.kv_mask, ((0, 0), (0, extra)),
                                                                  constant_values=1)))
