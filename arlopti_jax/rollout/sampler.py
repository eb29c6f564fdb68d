"""The sampler: a jitted prefill of left-padded prompts, then ``lax.while_loop`` decoding
over a preallocated KV cache, sharded over the trainer's mesh with the trainer's params.

Per call, on device:

1. ``prefill``: each distinct prompt runs ONCE through the decoder, filling a prompt-sized
   cache (per layer [B, K, P, H]) and giving the next-token logits of its last position.
2. ``start``: that cache is repeated along the batch to the n samples of each prompt and
   padded to the first phase's P + e_1 slots; every sample draws its first response token
   independently from the shared prefill logits.
3. ``decode``: a ``lax.while_loop`` feeds the last token at slot P + t - 1 and samples token
   t. It runs until every row has emitted an EOS id or R tokens, or the phase's cache is
   full (t = e_i), or (length-aware) the device with the most unfinished rows could hold
   them in a smaller row bucket. The state (cache included) is donated and updated in place.
4. Length-aware decoding (``SamplingConfig.length_aware``, the default) alternates 3 with
   ``resize``: finished rows' results are scattered into the [N, R] outputs, each device
   keeps its own unfinished rows (a gather within the device's rows: no communication) in
   a batch of rows per device = the next power of two >= the busiest device's live rows
   (not below ``min_rows``), and when the phase's cache is full it grows to the next
   phase's P + e_{i+1} slots (e = ``SamplingConfig.phase_ends()``: phase_tokens, doubling,
   up to R). Attention thus spans at most about twice the filled cache, and finished rows
   stop costing once their device's batch halves. The host reads two numbers (the step and
   the busiest device's live rows, global values on every process) after each loop. The
   dense path (``length_aware=False``) is one loop over all P + R slots and all rows.

Randomness: the Gumbel noise of global row r (prompt i, sample j: r = i * n + j, in the
padded batch) at response position t is ``gumbel_noise(key, t, r)`` (``sampling.py``), a
function of (key, t, r) alone: a sample's draws are the same however the batch is padded,
compacted or sharded, so both paths give the same tokens, and a run is reproducible from
its key on any mesh.

Compiled programs: prefill and start per (prompt bucket, batch bucket); one decode loop per
(rows per device, cache slots) pair met (at most len(phase_ends) x the power-of-two row
buckets from the batch's rows per device down to ``min_rows``), and one resize per
(from, to) shape pair. Memory: a resize holds the old and the new cache at once; growing
a cache of r rows from P + e_i to P + 2 e_i slots peaks at r (2 P + 3 e_i) slots, 1.5x the
dense cache when no row has finished by the last phase (``length_aware=False`` then).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax import distributed as dist
from arlopti_jax import sharding as shd
from arlopti_jax.models.config import ModelConfig
from arlopti_jax.models.decoder import CACHE_AXES, Block, RMSNorm, attention_mask, position_ids
from arlopti_jax.models.policy import unembed_matrix
from arlopti_jax.rollout.output import Rollout
from arlopti_jax.rollout.sampling import SamplingConfig, bucket, sample_tokens

Array = jax.Array
OUTPUTS = ("tokens", "logprobs", "mask", "finished")
LAYER_CACHE_AXES = CACHE_AXES[1:]  # one layer's cache: [N, K, S, H]


class DecodeState(NamedTuple):
    """The decode loop's carry. N rows (padded prompts x n, fewer after compaction);
    S = P + e cache slots; R = max_response_len."""

    cache: tuple  # per layer {"k", "v"}: [N, K, S, H]
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


class Decoded(NamedTuple):
    """``Sampler.decode``'s result: global [N, R] / [N] arrays in the original row order."""

    tokens: Array
    logprobs: Array
    mask: Array
    finished: Array
    steps: int  # response positions produced (< R when every row finished early)
    loops: tuple  # (rows per device, cache slots, step reached) of each decode loop run


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Prompts left-padded to a bucketed [B, P] on the host; rows >= num_prompts are padding.
    In a multi-process run these are this process's rows of a global batch of
    ``global_rows`` rows (0: the same as B, one process)."""

    ids: np.ndarray
    mask: np.ndarray
    num_prompts: int
    global_rows: int = 0


def _rows(x: Array) -> Array:
    return nn.with_logical_constraint(x, ("act_batch",) + (None,) * (x.ndim - 1))


def _constrain_cache(cache: tuple) -> tuple:
    return tuple({name: nn.with_logical_constraint(c, LAYER_CACHE_AXES) for name, c in layer.items()}
                 for layer in cache)


def _constrain(state: DecodeState) -> DecodeState:
    cache = _constrain_cache(state.cache)
    rows = {f: _rows(getattr(state, f)) for f in ("kv_mask", "prompt_len", "rows", "stop_at") + OUTPUTS}
    return state._replace(cache=cache, **rows)


def _next_logits(cfg: ModelConfig, params, hidden: Array) -> Array:
    """float32 logits [B, V] of the last position of hidden [B, T, D]."""
    w = unembed_matrix(cfg, params)
    return jnp.einsum("bd,dv->bv", hidden[:, -1], w.astype(hidden.dtype), preferred_element_type=jnp.float32)


def _is_eos(tokens: Array, eos_ids: Array) -> Array:
    return jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)


def _layer_weights(params) -> list:
    """Each layer's weights, sliced from the stacked [L, ...] params."""
    count = jax.tree_util.tree_leaves(params["layers"])[0].shape[0]
    return [jax.tree_util.tree_map(lambda w: w[i], params["layers"]) for i in range(count)]


def _forward(cfg: ModelConfig, params, layers: list, tokens: Array, positions: Array, kv_mask: Array, cache: tuple,
             cache_index) -> tuple[Array, tuple]:
    """``Decoder`` over a cache held as one array pair per layer (the layers unrolled): a
    layer's attention then reads its own buffer in place, where slicing a layer out of a
    stacked [L, ...] cache copied it (and the layer's weights) every step on CPU."""
    x = jnp.take(params["embedding"], tokens, axis=0).astype(cfg.compute_dtype)
    x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
    mask = attention_mask(kv_mask, tokens.shape[1], cache_index)
    block, out = Block(cfg), []
    for weights, layer in zip(layers, cache):
        stacked = {name: c[None] for name, c in layer.items()}  # the decoder's [1, N, K, S, H] layout
        (x, stacked), _ = block.apply({"params": weights}, (x, stacked), 0, positions, mask, cache_index)
        out.append({name: c[0] for name, c in stacked.items()})
    norm = RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.weight_dtype)
    return norm.apply({"params": params["final_norm"]}, x), _constrain_cache(tuple(out))


def _prefill(cfg: ModelConfig, params, prompt_ids: Array, prompt_mask: Array):
    b, p = prompt_ids.shape
    shape = (b, cfg.num_kv_heads, p, cfg.head_dim)
    empty = _constrain_cache(tuple({"k": jnp.zeros(shape, cfg.compute_dtype), "v": jnp.zeros(shape, cfg.compute_dtype)}
                                   for _ in range(cfg.num_layers)))
    hidden, cache = _forward(cfg, params, _layer_weights(params), prompt_ids, position_ids(prompt_mask), prompt_mask,
                             empty, 0)
    return cache, _rows(_next_logits(cfg, params, hidden))


def _sample(logits, key, step, rows, stop_at, eos_ids, temperature, top_p, kernel):
    top_k, use_top_p, greedy, _ = kernel
    forced = jnp.where(step + 1 >= stop_at, eos_ids[0], -1)
    return sample_tokens(logits, key, step, rows, temperature, top_p, top_k=top_k, use_top_p=use_top_p,
                         greedy=greedy, forced=forced)


def _start(prompt_cache: dict, logits: Array, prompt_mask: Array, live: Array, stop_at: Array, key: Array,
           temperature: Array, top_p: Array, eos_ids: Array, *, n: int, max_len: int, slots: int,
           kernel: tuple) -> DecodeState:
    pad_id = kernel[3]
    prompt_slots = prompt_mask.shape[1]
    widen = ((0, 0), (0, 0), (0, slots - prompt_slots), (0, 0))
    cache = tuple({name: jnp.pad(jnp.repeat(c, n, axis=0), widen) for name, c in layer.items()}
                  for layer in prompt_cache)
    mask_n = jnp.repeat(prompt_mask, n, axis=0)
    count = mask_n.shape[0]
    live = jnp.repeat(live, n, axis=0)
    rows = jnp.arange(count, dtype=jnp.int32)
    tok, lp = _sample(jnp.repeat(logits, n, axis=0), key, 0, rows, stop_at, eos_ids, temperature, top_p, kernel)
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


def _decode(cfg: ModelConfig, params, state: DecodeState, key: Array, temperature: Array, top_p: Array,
            eos_ids: Array, compact_at: Array, *, kernel: tuple, devices: int) -> tuple[DecodeState, Array]:
    """Decode until R tokens, a full cache, or no device holds more than ``compact_at``
    unfinished rows (0: until every row has finished). Returns the state and [step, busiest]."""
    pad_id = kernel[3]
    max_len = state.tokens.shape[1]
    limit = jnp.minimum(max_len, state.kv_mask.shape[1] - state.prompt_slots)
    # XLA:CPU copies a layer's weights out of the stacked params at every step (it does not
    # hoist a slice out of a loop); slicing them once per call instead costs one more copy
    # of the weights in host memory. Accelerators read the slices in place.
    hoisted = _layer_weights(params) if jax.default_backend() == "cpu" else None

    def cond(s: DecodeState):
        return (s.step < limit) & (_busiest(s.finished, devices) > compact_at)

    def body(s: DecodeState) -> DecodeState:
        t = s.step
        prev = jax.lax.dynamic_slice_in_dim(s.tokens, t - 1, 1, axis=1)
        pos = (s.prompt_len + t - 1)[:, None]
        layers = _layer_weights(params) if hoisted is None else hoisted
        hidden, cache = _forward(cfg, params, layers, prev, pos, s.kv_mask, s.cache, s.prompt_slots + t - 1)
        tok, lp = _sample(_next_logits(cfg, params, hidden), key, t, s.rows, s.stop_at, eos_ids, temperature,
                          top_p, kernel)
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

    state = jax.lax.while_loop(cond, body, _constrain(state))
    return state, jnp.stack([state.step, _busiest(state.finished, devices)])


def _scatter(out: dict, state: DecodeState, devices: int) -> dict:
    """Write the state's rows into the [N, R] outputs at their global indices. A row never
    leaves its device (``_resize``), so each device writes into its own block of rows (filler
    rows, whose index is out of range, are dropped)."""
    per_out, per = out["tokens"].shape[0] // devices, state.rows.shape[0] // devices
    local = state.rows.reshape(devices, per) - per_out * jnp.arange(devices, dtype=jnp.int32)[:, None]
    local = jnp.where((local >= 0) & (local < per_out), local, per_out)

    def put(buf: Array, new: Array) -> Array:
        split = buf.reshape((devices, per_out) + buf.shape[1:])
        rows = new.reshape((devices, per) + new.shape[1:])
        done = jax.vmap(lambda b, i, x: b.at[i].set(x, mode="drop"))(split, local, rows)
        return _rows(done.reshape(buf.shape))

    return {name: put(out[name], getattr(state, name)) for name in OUTPUTS}


def _resize(state: DecodeState, out: dict | None, *, rows: int, slots: int, devices: int):
    """Save every row into ``out`` (the state's own arrays when None: nothing compacted yet),
    then keep each device's unfinished rows first, ``rows`` per device (filler: finished
    rows, marked out of range), in a cache of ``slots`` slots."""
    out = {name: _rows(getattr(state, name)) for name in OUTPUTS} if out is None else _scatter(out, state, devices)
    count = state.finished.shape[0]
    per = count // devices
    # a stable sort of each device's own rows, unfinished first: a gather that stays on the device
    order = jnp.argsort(state.finished.reshape(devices, per), axis=1, stable=True)[:, :rows]

    def take(x: Array) -> Array:
        split = x.reshape((devices, per) + x.shape[1:])
        index = order.reshape((devices, rows) + (1,) * (x.ndim - 1))
        return jnp.take_along_axis(split, index, axis=1).reshape((devices * rows,) + x.shape[1:])

    finished = take(state.finished)
    grow = slots - state.kv_mask.shape[1]
    cache = tuple({name: jnp.pad(take(c), ((0, 0), (0, 0), (0, grow), (0, 0))) for name, c in layer.items()}
                  for layer in state.cache)
    new = state._replace(
        cache=cache,
        kv_mask=jnp.pad(take(state.kv_mask), ((0, 0), (0, grow)), constant_values=1),
        prompt_len=take(state.prompt_len),
        tokens=take(state.tokens),
        logprobs=take(state.logprobs),
        mask=take(state.mask),
        finished=finished,
        rows=jnp.where(finished, out["tokens"].shape[0], take(state.rows)),
        stop_at=take(state.stop_at),
    )
    return _constrain(new), out


def _put(x: np.ndarray, sharding, global_rows: int = 0) -> Array:
    """Host rows -> a global array in ``sharding``: with one process ``x`` is the whole array;
    with several, ``x`` is this process's rows of a ``global_rows``-row array."""
    if jax.process_count() == 1:
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.make_array_from_process_local_data(sharding, x, (global_rows,) + x.shape[1:])


class Sampler:
    """Draws groups of responses from the policy ``(model_cfg, params)`` on ``mesh``.

    ``params`` are the trainer's arrays, passed into the jitted programs with their own
    shardings (never gathered to one device; on CPU a decode call slices each layer's
    weights out once, see ``_decode``). Prompts and samples are split over
    the mesh's data x fsdp axes; each layer's KV cache [N, K, S, H] is split as ``LAYER_CACHE_AXES``
    under ``rules`` (batch over data x fsdp, kv heads over tensor).
    """

    def __init__(self, model_cfg: ModelConfig, mesh, rules=shd.DEFAULT_RULES):
        self.cfg, self.mesh, self.rules = model_cfg, mesh, rules
        self.devices = shd.batch_divisor(mesh)
        self._prefill = jax.jit(functools.partial(_prefill, model_cfg))
        self._start = jax.jit(_start, static_argnames=("n", "max_len", "slots", "kernel"))
        self._decode = jax.jit(functools.partial(_decode, model_cfg, devices=self.devices),
                               static_argnames=("kernel",), donate_argnames=("state",))
        self._resize = jax.jit(functools.partial(_resize, devices=self.devices), static_argnames=("rows", "slots"),
                               donate_argnames=("out",))  # the state's arrays change shape
        self._scatter = jax.jit(functools.partial(_scatter, devices=self.devices), donate_argnames=("out",))

    @property
    def cache_sharding(self):
        """The NamedSharding of each layer's "k" and "v" cache arrays [N, K, S, H]."""
        return shd.logical_to_shardings(jax.sharding.PartitionSpec(*LAYER_CACHE_AXES), self.mesh, self.rules)

    def _global_layout(self, count: int, longest: int, sampling: SamplingConfig) -> tuple[int, int, int]:
        """(prompt width, global rows, this process's rows). Several processes agree on the
        width and on a global row count laid out as in one process (see ``process_share``)."""
        procs = jax.process_count()
        if procs > 1:
            counts, longests = dist.gather(np.array([count]), np.array([longest]))
            total, longest, count = int(counts.sum()), int(longests.max()), int(counts.max())
        else:
            total = count
        if total == 0:
            raise ValueError("generate: prompts is empty")
        div = shd.batch_divisor(self.mesh)
        rows = -(-bucket(total, sampling.batch_bucket) // div) * div
        per = div // procs  # every process holds the same number of rows, whole shards
        local = max(rows // procs, -(-count // per) * per)
        return bucket(longest, sampling.prompt_bucket), local * procs, local

    def process_share(self, num_prompts: int, sampling: SamplingConfig) -> slice:
        """This process's prompts of a global list of ``num_prompts``, chosen so the global
        padded batch is laid out as one process would (the same samples; eval uses this).
        All of them with one process."""
        if jax.process_count() == 1:
            return slice(0, num_prompts)
        div = shd.batch_divisor(self.mesh)
        rows = -(-bucket(max(num_prompts, 1), sampling.batch_bucket) // div) * div
        index = shd.batch_sharding(self.mesh, 1).addressable_devices_indices_map((rows,))
        start = min(s[0].indices(rows)[0] for s in index.values())
        return slice(min(start, num_prompts), min(start + rows // jax.process_count(), num_prompts))

    def pad_prompts(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig) -> PromptBatch:
        """Left-pad ``prompts`` (this process's, in a multi-process run: every process calls
        this with its own, possibly none) to the bucketed batch."""
        if not prompts and jax.process_count() == 1:
            raise ValueError("generate: prompts is empty")
        lengths = [len(p) for p in prompts]
        if lengths and min(lengths) < 1:
            raise ValueError(f"generate: prompt {lengths.index(min(lengths))} is empty")
        width, global_rows, rows = self._global_layout(len(prompts), max(lengths, default=1), sampling)
        ids = np.full((rows, width), sampling.pad_id, np.int32)
        mask = np.zeros((rows, width), np.int32)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = p
            mask[i, width - len(p):] = 1
        mask[len(prompts):, -1] = 1  # padding rows hold one pad token, so no row attends to nothing
        bad = (ids < 0) | (ids >= self.cfg.vocab_size)
        if bad.any():
            row = int(np.argwhere(bad)[0][0])
            raise ValueError(f"generate: prompt {row} has token ids outside [0, {self.cfg.vocab_size})")
        return PromptBatch(ids, mask, len(prompts), global_rows)

    @staticmethod
    def _traced_settings(sampling: SamplingConfig):
        # EOS ids padded with -1 (never a token) to a multiple of 8: one program for any count
        eos = np.full(-(-max(1, len(sampling.eos_ids)) // 8) * 8, -1, np.int32)
        eos[: len(sampling.eos_ids)] = sampling.eos_ids
        return jnp.float32(sampling.temperature), jnp.float32(sampling.top_p), jnp.asarray(eos)

    def start(self, params, batch: PromptBatch, n: int, key: Array, sampling: SamplingConfig,
              stop_at: np.ndarray | None = None) -> DecodeState:
        """Prefill each prompt once and sample every row's first token (dispatch only, no
        sync). ``stop_at``: see ``generate``."""
        if n < 1:
            raise ValueError(f"generate: n={n} must be >= 1")
        if sampling.top_k > self.cfg.vocab_size:
            raise ValueError(f"SamplingConfig.top_k={sampling.top_k} exceeds the vocabulary ({self.cfg.vocab_size})")
        temperature, top_p, eos = self._traced_settings(sampling)
        rows = shd.batch_sharding(self.mesh, 2)
        live = np.arange(batch.ids.shape[0]) < batch.num_prompts
        stops = self._stop_rows(stop_at, batch, n, sampling)
        with shd.activate(self.mesh, self.rules):
            ids, mask = _put(batch.ids, rows, batch.global_rows), _put(batch.mask, rows, batch.global_rows)
            cache, logits = self._prefill(params, ids, mask)
            one = shd.batch_sharding(self.mesh, 1)
            live = _put(live, one, batch.global_rows)
            stops = _put(stops, one, (batch.global_rows or batch.ids.shape[0]) * n)
            return self._start(cache, logits, mask, live, stops, key, temperature, top_p, eos, n=n,
                               max_len=sampling.max_response_len,
                               slots=batch.ids.shape[1] + sampling.phase_ends()[0], kernel=sampling.kernel_key)

    @staticmethod
    def _stop_rows(stop_at, batch: PromptBatch, n: int, sampling: SamplingConfig) -> np.ndarray:
        """This process's rows of the padded batch's forced-EOS lengths (R + 1: none)."""
        out = np.full(batch.ids.shape[0] * n, sampling.max_response_len + 1, np.int32)
        if stop_at is None:
            return out
        stop_at = np.asarray(stop_at)
        want = batch.num_prompts * n
        if stop_at.shape != (want,) or not np.issubdtype(stop_at.dtype, np.integer):
            raise ValueError(f"generate: stop_at must be integers of shape ({want},) (prompts x n), got "
                             f"{stop_at.dtype} {stop_at.shape}")
        if not sampling.eos_ids:
            raise ValueError("generate: stop_at forces an EOS token, but SamplingConfig.eos_ids is empty")
        if want and stop_at.min() < 1:
            row = int(np.argmin(stop_at))
            raise ValueError(f"generate: stop_at[{row}]={stop_at[row]} must be >= 1 (a response length)")
        out[:want] = np.minimum(stop_at, sampling.max_response_len + 1)
        return out

    def _row_bucket(self, live: int, rows: int, sampling: SamplingConfig) -> int:
        """Rows per device to hold ``live`` unfinished rows: a power of two, at least
        min_rows, at most the current ``rows``."""
        return min(rows, max(sampling.min_rows, 1 << max(0, live - 1).bit_length()))

    def decode(self, params, state: DecodeState, key: Array, sampling: SamplingConfig) -> Decoded:
        """Run the decode loops to the end (``state`` is donated): one loop over the whole
        batch and cache when not ``sampling.length_aware``, else phases and compaction."""
        temperature, top_p, eos = self._traced_settings(sampling)
        ends = sampling.phase_ends()
        phase, out, loops = 0, None, []
        max_len = sampling.max_response_len
        with shd.activate(self.mesh, self.rules):
            while True:
                rows = state.finished.shape[0] // self.devices
                # leave the loop once the busiest device's live rows fit the next smaller bucket
                smaller = 1 << max(0, (rows - 1).bit_length() - 1)
                compacts = sampling.length_aware and sampling.min_rows <= smaller < rows
                compact_at = np.int32(smaller if compacts else 0)
                state, status = self._decode(params, state, key, temperature, top_p, eos, compact_at,
                                             kernel=sampling.kernel_key)
                step, busiest = (int(v) for v in dist.to_host(status))
                loops.append((rows, state.kv_mask.shape[1], step))
                if step >= max_len or busiest == 0:
                    break
                slots = state.kv_mask.shape[1]
                if step >= ends[phase]:  # the cache is full: grow it to the next phase's
                    phase += 1
                    slots += ends[phase] - ends[phase - 1]
                state, out = self._resize(state, out, rows=self._row_bucket(busiest, rows, sampling), slots=slots)
            final = {name: getattr(state, name) for name in OUTPUTS} if out is None else self._scatter(out, state)
        return Decoded(**final, steps=step, loops=tuple(loops))

    def generate(self, params, prompts: Sequence[Sequence[int]], n: int, key: Array,
                 sampling: SamplingConfig, stop_at: np.ndarray | None = None) -> Rollout:
        """n responses to each prompt (token id lists), as host arrays grouped by prompt.
        Multi-process: every process passes its own prompts (any number, none included) and
        gets back the responses to those, sampled as one global batch.

        ``stop_at`` (benchmarks and tests): per response row (prompt i, sample j at row
        i * n + j), the response length at which the first EOS id is forced in place of the
        draw, so responses end at chosen lengths on any model; a value > max_response_len
        never forces. The forced token is recorded as if sampled: in the mask, with its
        log-prob under the model, the row finished (not truncated).
        """
        batch = self.pad_prompts(prompts, sampling)
        done = self.decode(params, self.start(params, batch, n, key, sampling, stop_at), key, sampling)
        keep = batch.num_prompts * n
        fetch = lambda x: dist.local_rows(x)[:keep]
        response_mask = fetch(done.mask)
        return Rollout(
            prompt_ids=np.repeat(batch.ids[: batch.num_prompts], n, axis=0),
            prompt_mask=np.repeat(batch.mask[: batch.num_prompts], n, axis=0),
            response_ids=fetch(done.tokens),
            response_mask=response_mask,
            logprobs=fetch(done.logprobs),
            lengths=response_mask.sum(axis=1).astype(np.int32),
            truncated=~fetch(done.finished),
            group_ids=np.repeat(np.arange(batch.num_prompts, dtype=np.int32), n),
            decode_steps=done.steps,
            decode_loops=tuple((rows * self.devices, slots, step) for rows, slots, step in done.loops),
        )
