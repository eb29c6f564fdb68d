"""The sampler: a jitted prefill of left-padded prompts, then ``lax.while_loop`` decoding
over a preallocated KV cache, sharded over the trainer's mesh with the trainer's params. The
device programs are in ``programs.py``; this module runs them.

Per call, on device:

1. ``prefill``: each distinct prompt runs ONCE through the decoder, filling a prompt-sized
   cache [L, B, K, P, H] and giving the next-token logits of its last position. Every
   program runs the layers as the decoder's loop (``programs.py`` says why).
2. ``start``: that cache is repeated along the batch to the n samples of each prompt and
   padded to the first phase's P + e_1 slots; every sample draws its first response token
   independently from the shared prefill logits.
3. ``decode``: a ``lax.while_loop`` feeds the last token at slot P + t - 1 and samples token
   t. It runs until every row has emitted an EOS id or R tokens, or the phase's cache is
   full (t = e_i), or (length-aware) the device with the most unfinished rows could hold
   them in a smaller row bucket. The state (cache included) is donated and updated in place.
4. Length-aware decoding (``SamplingConfig.length_aware``, the default) alternates 3 with
   ``compact`` and ``grow``. ``compact`` scatters the rows' results into the [N, R] outputs
   and halves each device's batch, keeping its own unfinished rows first (a gather within
   the device's rows: no communication); it runs until the batch is the next power of two
   >= the busiest device's live rows (not below ``min_rows``). When the phase's cache is
   full, ``grow`` widens it to the next phase's P + e_{i+1} slots (e =
   ``SamplingConfig.phase_ends()``: phase_tokens, doubling, up to R). Attention thus spans
   at most about twice the filled cache, and finished rows stop costing once their device's
   batch halves. The host reads two numbers (the step and the busiest device's live rows,
   global values on every process) after each loop. The dense path (``length_aware=False``)
   is one loop over all P + R slots and all rows.

Weights: ``sampling_params`` gives the programs their own copy in the compute dtype (bfloat16
under float32 master weights), once per ``generate``; with LoRA the adapters are merged into it and
the programs are the plain model's. On a GPU the copy holds a buffer per layer,
the KV cache too (``programs.per_layer_cache``), and the decode step runs its layers straight-line:
XLA:GPU then reads each layer's weights and cache in place and launches the whole step as one
command buffer (1.5B, 64 rows, full 4,608-slot cache, compiled for an H100: 14.2 GB moved per step
against a 11.5 GB minimum, where the stacked layer loop moved 41.2 GB in 30 command buffers;
bench/roofline.py, docs/measurements/journal.md).

Randomness: the Gumbel noise of global row r (prompt i, sample j: r = i * n + j, in the
padded batch) at response position t is ``gumbel_noise(key, t, r)`` (``sampling.py``), a
function of (key, t, r) alone: a sample's draws are the same however the batch is padded,
compacted or sharded, so both paths give the same tokens, and a run is reproducible from
its key on any mesh.

Compiled programs: prefill and start per (prompt bucket, batch bucket), the prompt bucket being
one per run when it passes ``SamplingConfig.prompt_width`` (``train`` and ``eval`` do); one decode loop per
(rows per device, cache slots) pair met (at most len(phase_ends) x the row buckets: the
batch's rows per device, then the powers of two below it down to ``min_rows``); one compact
per (row bucket above the smallest, phase) met, one grow per (row bucket, phase before the
last), one scatter per row bucket. Every step from one shape to another is one of these
programs, so a run has at most about 3 x phases x buckets of them: ``Sampler.schedule`` lists them
all, ``python -m arlopti_jax.aot`` compiles them for a target, and ``train``'s warm-up
(``rl/warm_up.py``) compiles them before the first step, met or not. Each program's outputs have
named shardings (``_state_shardings``), so a state reaches a program in one layout whichever program
made it. Memory: a grow holds the old and the new cache at once;
growing a cache of r rows from P + e_i to P + 2 e_i slots peaks at r (2 P + 3 e_i) slots,
1.5x the dense cache when no row has finished by the last phase (``length_aware=False``
then).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax.runtime import compiles
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models.config import ModelConfig
from arlopti_jax.models import decode
from arlopti_jax.models.decode import CACHE_AXES
from arlopti_jax.rollout import programs
from arlopti_jax.rollout.output import Rollout
from arlopti_jax.rollout.programs import OUTPUTS, DecodeState, row_fields
from arlopti_jax.rollout.sampling import SamplingConfig, bucket

Array = jax.Array

SAMPLING_WEIGHTS = "sampling weights"  # ``programs``' name of the weights' copy (``aot`` holds it through a rollout)
log = logging.getLogger(__name__)
_warn_once = functools.cache(log.warning)  # a run builds its sampler at start-up and again in the loop

WHOLE_WEIGHTS = ("auto", "on", "off")  # ``Sampler``'s whole_weights, ``rollout.whole_weights``


def _whole_weights(cfg: ModelConfig, mesh, rules, setting: str, device_memory: int | None) -> bool:
    """``Sampler``'s choice for ``whole_weights`` (see there)."""
    if setting not in WHOLE_WEIGHTS:
        raise ValueError(f"whole_weights={setting!r}: allowed {list(WHOLE_WEIGHTS)}")
    if setting != "auto":
        return setting == "on"
    split = {a for name, axes in rules if name in shd.PARAM_AXES
             for a in (axes if isinstance(axes, tuple) else (axes,)) if a in shd.BATCH_AXES}
    if not any(mesh.shape.get(a, 1) > 1 for a in split) or mesh.devices.flat[0].platform not in ("gpu", "tpu"):
        return False
    if device_memory is None:
        try:
            device_memory = (mesh.devices.flat[0].memory_stats() or {}).get("bytes_limit")
        except Exception:  # a compile-only device (aot passes its target's memory)
            device_memory = None
    tensor = mesh.shape.get("tensor", 1)
    size = cfg.num_params() * jnp.dtype(cfg.compute_dtype).itemsize / tensor
    return bool(device_memory) and size <= device_memory / 8


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



def in_context(steps, context):
    """The generator ``steps`` run with ``context()`` entered around each of its turns and left before
    each of its yields: a context (a mesh, sharding rules) entered inside a generator would otherwise
    stay in force while the code it yields to runs."""
    while True:
        with context():
            try:
                next(steps)
            except StopIteration as done:
                return done.value
        yield


def drain(steps):
    """Run a generator of ``decode_steps``' kind to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _half(rows: int) -> int:
    """The row bucket below ``rows``: the largest power of two < rows (1 for 1)."""
    return 1 << max(0, (rows - 1).bit_length() - 1)


def batch_rows(count: int, sampling: SamplingConfig, div: int) -> int:
    """Rows of the padded prompt batch of ``count`` prompts (all processes'): ``count`` bucketed by
    ``sampling.batch_bucket``, then rounded up to a multiple of ``div``, the mesh's data x fsdp."""
    return -(-bucket(count, sampling.batch_bucket) // div) * div


def eos_width(sampling: SamplingConfig) -> int:
    """Slots of the traced EOS-id array: the ids padded with -1 (never a token) to a multiple of 8,
    so one program serves any count."""
    return -(-max(1, len(sampling.eos_ids)) // 8) * 8


class Sampler:
    """Draws groups of responses from the policy ``(model_cfg, params)`` on ``mesh``.

    ``params`` are the trainer's arrays, passed into the jitted programs with their own
    shardings (never gathered to one device). Prompts and samples are split over the mesh's
    data x fsdp axes; the KV cache [L, N, K, S, H] is split as ``CACHE_AXES`` under ``rules``
    (batch over data x fsdp, kv heads over tensor).

    ``whole_weights``: whether the programs' own copy of the weights (``sampling_params``) is whole
    along the batch axes (``shd.weights_off_batch_axes``; split over "tensor" still), so that each
    device decodes its rows with no collective. With the weights split over fsdp as the trainer's
    are, every decode step gathers them all: 3B on 8 H100s with fsdp=8, compiled, 133 all-gathers
    of 6.17 GB per device per step (docs/measurements/aot_2026-11-28_sampler_weights). "on",
    "off", or "auto": on where a mesh axis of the batch splits the weights, on a GPU or TPU, and
    the copy takes at most an eighth of a device's memory (``device_memory`` bytes; default: the
    device's own figure, where it gives one). An eighth, because the copy is held through the
    rollout beside the training state and two KV caches: 7B on a v5p-8 (fsdp=4), whose copy is
    16% of a chip, compiled to 97.7 GiB of 95 with it whole, 87.1 without.
    """

    def __init__(self, model_cfg: ModelConfig, mesh, rules=shd.DEFAULT_RULES, whole_weights: str = "auto",
                 device_memory: int | None = None):
        # LoRA: the programs run the plain model on weights with the adapters merged, once per
        # rollout (``sampling_params``); applied unmerged, a 1.5B decode step compiled for an H100
        # ran 790 kernels and moved 12.9 GB instead of 413 and 7.5 (docs/measurements/lora_2026-11-27)
        self._lora = model_cfg if model_cfg.lora_rank else None
        model_cfg = model_cfg.replace(lora_rank=0)
        self.whole_weights = _whole_weights(model_cfg, mesh, rules, whole_weights, device_memory)
        if self.whole_weights:
            rules = shd.weights_off_batch_axes(rules)
        self.cfg, self.mesh, self.rules = model_cfg, mesh, rules
        if model_cfg.decode_matmul == "pallas":
            with nn.logical_axis_rules(rules):
                split = decode.split_weight_axes(dict(mesh.shape))
            if split:  # fused_layers falls back to XLA's products: say so where the run starts
                _warn_once(f"model.decode_matmul=pallas: the sampler's mesh {dict(mesh.shape)} splits the weights' "
                           f"{', '.join(split)} axes, and the fused products take whole weights: the decode steps "
                           "use XLA's products (rollout.whole_weights=on or a mesh without those splits keeps them)")
        self.devices = shd.batch_divisor(mesh)
        self.processes = dist.mesh_processes(mesh)  # the processes that launch its programs (and gather among)
        per_layer = programs.per_layer_cache(mesh.devices.flat[0].platform)  # straight-line layers
        # every program's outputs in the shardings its constraints give them, named: left to the
        # compiler, a 1-device mesh's outputs come back as P('tensor', 'fsdp') from one program and
        # P() from another, the same layout under two names, and the program that reads them compiles
        # once per name (``schedule`` lists one)
        state, rows, status = self._state_shardings(per_layer)
        self._prefill = jax.jit(functools.partial(programs.prefill, model_cfg), out_shardings=(state.cache, rows))
        self._start = jax.jit(programs.start, static_argnames=("n", "max_len", "slots", "kernel"), out_shardings=state)
        self._decode = jax.jit(functools.partial(programs.decode, model_cfg, devices=self.devices),
                               static_argnames=("kernel",), donate_argnames=("state",), out_shardings=(state, status))
        outputs = {name: getattr(state, name) for name in OUTPUTS}
        self._compact = jax.jit(functools.partial(programs.compact, devices=self.devices), static_argnames=("rows",),
                                donate_argnames=("out",), out_shardings=(state, outputs))  # the state changes shape
        self._grow = jax.jit(programs.grow, static_argnames=("slots",), out_shardings=state)
        self._scatter = jax.jit(functools.partial(programs.scatter, devices=self.devices), donate_argnames=("out",),
                                out_shardings=outputs)
        self._cast = None
        if model_cfg.weight_dtype != model_cfg.compute_dtype or per_layer or self._lora or self.whole_weights:
            from arlopti_jax.models import lora, param_shardings

            dtype, shardings = model_cfg.compute_dtype, param_shardings(model_cfg, mesh, rules)

            def prepare(p):
                if self._lora:
                    p = lora.merge(self._lora, p)
                p = jax.tree.map(lambda w: w.astype(dtype), p)
                if per_layer:  # a buffer per layer, q, k and v as one projection (``decode.fuse_qkv``)
                    p = {**p, "layers": tuple(
                        {**layer, "attn": decode.fuse_qkv(model_cfg, layer["attn"])}
                        for layer in (jax.tree.map(lambda w: w[i], p["layers"]) for i in range(model_cfg.num_layers)))}
                return p

            if per_layer:
                one = jax.tree.map(lambda sh: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                    *sh.spec[1:])), shardings["layers"])
                heads = (model_cfg.num_kv_heads, model_cfg.num_heads // model_cfg.num_kv_heads + 2)
                fused = shd.logical_to_shardings(
                    {"qkv_kernel": jax.sharding.PartitionSpec(*decode.QKV_AXES),
                     "qkv_bias": jax.sharding.PartitionSpec(*decode.QKV_AXES[1:])}, mesh, rules,
                    shapes={"qkv_kernel": jax.ShapeDtypeStruct((model_cfg.hidden_size, *heads, model_cfg.head_dim),
                                                               dtype),
                            "qkv_bias": jax.ShapeDtypeStruct((*heads, model_cfg.head_dim), dtype)})
                attn = {name: sh for name, sh in one["attn"].items() if name not in decode.QKV_NAMES}
                attn["qkv_kernel"] = fused["qkv_kernel"]
                if model_cfg.qkv_bias:
                    attn["qkv_bias"] = fused["qkv_bias"]
                shardings = {**shardings, "layers": ({**one, "attn": attn},) * model_cfg.num_layers}
            self._cast = jax.jit(prepare, out_shardings=shardings)

    def _state_shardings(self, per_layer: bool):
        """(``DecodeState`` of shardings, [N, V] logits', the [2] status'): as ``programs._constrain``
        lays them out (a per-layer cache buffer without the layer axis), kv heads that "tensor" does not
        divide replicated as ``shd.logical_to_shardings`` fits them."""
        cfg, mesh, rules = self.cfg, self.mesh, self.rules
        axes, shape = CACHE_AXES, (cfg.num_layers, self.devices, cfg.num_kv_heads, 1, cfg.head_dim)
        if per_layer:
            axes, shape = axes[1:], shape[1:]
        cache = shd.logical_to_shardings(jax.sharding.PartitionSpec(*axes), mesh, rules,
                                         shapes=jax.ShapeDtypeStruct(shape, jnp.float32))
        row = lambda ndim: shd.logical_to_shardings(jax.sharding.PartitionSpec("act_batch", *[None] * (ndim - 1)),
                                                    mesh, rules)
        rep = shd.replicated(mesh)
        state = DecodeState(cache=cache, kv_mask=row(2), prompt_len=row(1), tokens=row(2), logprobs=row(2),
                            mask=row(2), finished=row(1), rows=row(1), stop_at=row(1), prompt_slots=rep, step=rep)
        return state, row(2), rep

    def sampling_params(self, params):
        """The weights the sampler's programs read, made once per ``generate``: ``params`` in the
        compute dtype (with float32 master weights and bfloat16 compute, the programs' own casts
        would read 4 bytes per weight, and write and read 2 more, at every decode step; the values
        are those of the casts it replaces), on a GPU with a buffer per layer (its layers run
        straight-line; XLA:GPU copies a slice of a stacked weight out before each product), and
        with LoRA the adapters merged into their weights (``lora.merge``)."""
        if self._cast is None:
            return params
        with shd.activate(self.mesh, self.rules):
            return self._cast(params)

    @property
    def cache_sharding(self):
        """The NamedSharding of the "k" and "v" cache arrays [L, N, K, S, H]."""
        return shd.logical_to_shardings(jax.sharding.PartitionSpec(*CACHE_AXES), self.mesh, self.rules)

    def _global_layout(self, count: int, longest: int, sampling: SamplingConfig,
                       pad_to: int = 0) -> tuple[int, int, int]:
        """(prompt width, global rows, this process's rows). Several processes agree on the
        width and on a global row count laid out as in one process (see ``process_share``), that
        of at least ``pad_to`` prompts."""
        procs = self.processes
        if procs > 1:
            counts, longests = dist.gather(np.array([count]), np.array([longest]))
            total, longest, count = int(counts.sum()), int(longests.max()), int(counts.max())
        else:
            total = count
        if total == 0:
            raise ValueError("generate: prompts is empty")
        div = shd.batch_divisor(self.mesh)
        rows = batch_rows(max(total, pad_to), sampling, div)
        per = div // procs  # every process holds the same number of rows, whole shards
        local = max(rows // procs, -(-count // per) * per)
        return sampling.width(longest), local * procs, local

    def process_share(self, num_prompts: int, sampling: SamplingConfig, pad_to: int = 0) -> slice:
        """This process's prompts of a global list of ``num_prompts``, chosen so the global
        padded batch (that of at least ``pad_to`` prompts: ``generate``) is laid out as one process
        would (the same samples; eval uses this). All of them with one process."""
        if self.processes == 1:
            return slice(0, num_prompts)
        div = shd.batch_divisor(self.mesh)
        rows = batch_rows(max(num_prompts, pad_to, 1), sampling, div)
        index = shd.batch_sharding(self.mesh, 1).addressable_devices_indices_map((rows,))
        start = min(s[0].indices(rows)[0] for s in index.values())
        return slice(min(start, num_prompts), min(start + rows // self.processes, num_prompts))

    def pad_prompts(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
                    pad_to: int = 0) -> PromptBatch:
        """Left-pad ``prompts`` (this process's, in a multi-process run: every process calls
        this with its own, possibly none) to the bucketed batch, that of ``pad_to`` prompts (all
        processes') where that is more."""
        if not prompts and self.processes == 1:
            raise ValueError("generate: prompts is empty")
        lengths = [len(p) for p in prompts]
        if lengths and min(lengths) < 1:
            raise ValueError(f"generate: prompt {lengths.index(min(lengths))} is empty")
        width, global_rows, rows = self._global_layout(len(prompts), max(lengths, default=1), sampling, pad_to)
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
        """(temperature, top_p, EOS ids, greedy): the settings the programs read as data."""
        eos = np.full(eos_width(sampling), -1, np.int32)
        eos[: len(sampling.eos_ids)] = sampling.eos_ids
        # host values: a jnp scalar here would be an eager program of its own
        return np.float32(sampling.temperature), np.float32(sampling.top_p), eos, np.bool_(sampling.greedy)

    def start(self, params, batch: PromptBatch, n: int, key: Array, sampling: SamplingConfig,
              stop_at: np.ndarray | None = None) -> DecodeState:
        """Prefill each prompt once and sample every row's first token (dispatch only, no
        sync). ``stop_at``: see ``generate``."""
        if n < 1:
            raise ValueError(f"generate: n={n} must be >= 1")
        if sampling.top_k > self.cfg.vocab_size:
            raise ValueError(f"SamplingConfig.top_k={sampling.top_k} exceeds the vocabulary ({self.cfg.vocab_size})")
        temperature, top_p, eos, greedy = self._traced_settings(sampling)
        rows = shd.batch_sharding(self.mesh, 2)
        live = np.arange(batch.ids.shape[0]) < batch.num_prompts
        stops = self._stop_rows(stop_at, batch, n, sampling)
        with shd.activate(self.mesh, self.rules):
            ids, mask = shd.put(batch.ids, rows, batch.global_rows), shd.put(batch.mask, rows, batch.global_rows)
            cache, logits = self._prefill(params, ids, mask)
            one = shd.batch_sharding(self.mesh, 1)
            live = shd.put(live, one, batch.global_rows)
            stops = shd.put(stops, one, (batch.global_rows or batch.ids.shape[0]) * n)
            return self._start(cache, logits, mask, live, stops, key, temperature, top_p, eos, n=n,
                               max_len=sampling.max_response_len,
                               slots=batch.ids.shape[1] + sampling.phase_ends()[0], kernel=sampling.kernel_key,
                               greedy=greedy)

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
        return drain(self.decode_steps(params, state, key, sampling))

    def decode_steps(self, params, state: DecodeState, key: Array, sampling: SamplingConfig):
        """``decode`` as a generator: it yields after dispatching each decode loop, before the host
        reads that loop's two numbers (the only wait), so that the caller can dispatch other programs
        meanwhile (``rl/pipeline.py``, ``run_together``); it returns the ``Decoded``. The sampler's mesh
        and rules are in force during its turns alone (``in_context``), never across a yield, where
        the other programs are traced."""
        return (yield from in_context(self._decode_loops(params, state, key, sampling),
                                      lambda: shd.activate(self.mesh, self.rules)))

    def _decode_loops(self, params, state: DecodeState, key: Array, sampling: SamplingConfig):
        temperature, top_p, eos, greedy = self._traced_settings(sampling)
        ends = sampling.phase_ends()
        phase, out, loops = 0, None, []
        max_len = sampling.max_response_len
        while True:
            rows = state.finished.shape[0] // self.devices
            # leave the loop once the busiest device's live rows fit the next smaller bucket
            compacts = sampling.length_aware and sampling.min_rows <= _half(rows) < rows
            compact_at = np.int32(_half(rows) if compacts else 0)
            state, status = self._decode(params, state, key, temperature, top_p, eos, compact_at,
                                         kernel=sampling.kernel_key, greedy=greedy)
            yield  # the loop is dispatched; its status is read next
            step, busiest = (int(v) for v in dist.to_host(status))
            loops.append((rows, state.kv_mask.shape[1], step))
            if step >= max_len or busiest == 0:
                break
            # halving, one bucket at a time, makes one program per (bucket, phase) rather
            # than per (bucket, bucket, phase); the rows kept are the same
            while rows > self._row_bucket(busiest, rows, sampling):
                rows = _half(rows)
                state, out = self._compact(state, out, rows=rows)
            if step >= ends[phase]:  # the cache is full: grow it to the next phase's
                phase += 1
                state = self._grow(state, slots=state.kv_mask.shape[1] + ends[phase] - ends[phase - 1])
        final = {name: getattr(state, name) for name in OUTPUTS} if out is None else self._scatter(
            out, row_fields(state))
        return Decoded(**final, steps=step, loops=tuple(loops))

    def schedule(self, params, prompts: int, longest: int, n: int, sampling: SamplingConfig,
                 key=None) -> list[compiles.Program]:
        """Every program a ``generate`` of ``prompts`` prompts (the global count; the longest
        ``longest`` tokens) x ``n`` samples can run, in the order ``decode`` meets them: the weights'
        cast to the compute dtype (``sampling_params``), prefill,
        start, then one decode loop per (rows per device, cache slots) the schedule can reach,
        with each compaction, growth and final scatter between them (``length_aware``; the
        dense path is one loop). Each is a ``compiles.Program`` on abstract arguments: ``params``
        (ShapeDtypeStructs with their shardings), ``key`` (the generate's key, ``compiles.abstract``;
        default: one replicated over the mesh), the settings as the host values ``_traced_settings``
        passes, and each state as the ``compiles.Output`` of the program that makes it. Nothing is
        allocated. ``programs`` compiles them one after another (``arlopti_jax.aot``),
        ``compiles.compile_all`` in parallel (``train``'s warm-up)."""
        div = self.devices
        b = batch_rows(prompts, sampling, div)
        p, r = sampling.width(longest), sampling.max_response_len
        rows2, rows1, rep = (shd.batch_sharding(self.mesh, 2), shd.batch_sharding(self.mesh, 1),
                             shd.replicated(self.mesh))
        spec = lambda shape, dtype, sharding: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
        ids, live, stops = (spec((b, p), jnp.int32, rows2), spec((b,), jnp.bool_, rows1),
                            spec((b * n,), jnp.int32, rows1))
        key = spec((), jax.eval_shape(lambda: jax.random.key(0)).dtype, rep) if key is None else key
        # host values, as ``_traced_settings`` passes them: no sharding of their own. greedy is data:
        # greedy and sampled decoding share these programs
        temperature, top_p, eos_ids, greedy = (jax.ShapeDtypeStruct(np.shape(v), v.dtype)
                                               for v in self._traced_settings(sampling))
        ends, kernel = sampling.phase_ends(), sampling.kernel_key
        out: list[compiles.Program] = []

        def add(name, jitted, *args, **kwargs) -> compiles.Output:
            out.append(compiles.Program(name, jitted, args, kwargs))
            return compiles.Output(name)

        weights = params if self._cast is None else add(SAMPLING_WEIGHTS, self._cast, params)
        prefill = add("prefill", self._prefill, weights, ids, ids)
        start = add("start", self._start, prefill.part(lambda o: o[0]), prefill.part(lambda o: o[1]), ids, live,
                    stops, key, temperature, top_p, eos_ids, n=n, max_len=r, slots=p + ends[0], kernel=kernel,
                    greedy=greedy)
        first = b * n // div
        step_args = (key, temperature, top_p, eos_ids, jax.ShapeDtypeStruct((), jnp.int32))
        if not sampling.length_aware:
            add(f"decode rows={first} slots={p + r}", self._decode, weights, start, *step_args, kernel=kernel,
                greedy=greedy)
            return out
        # rows per device: the batch's, then the powers of two below it down to min_rows
        buckets = [first] + [1 << i for i in reversed(range((first - 1).bit_length()))
                             if 1 << i >= sampling.min_rows]
        full = start.part(lambda s: {name: getattr(s, name) for name in OUTPUTS})
        states = {(first, 0): start}
        for phase, end in enumerate(ends):  # as decode meets them: phases up, rows down
            for i, rows in enumerate(buckets):
                state = states.get((rows, phase))
                if state is None:
                    continue
                slots = p + end
                add(f"decode rows={rows} slots={slots}", self._decode, weights, state, *step_args, kernel=kernel,
                    greedy=greedy)
                if rows != first and phase == 0:  # the final scatter reads only the rows' outputs
                    add(f"scatter rows={rows}", self._scatter, full, state.part(row_fields))
                if i + 1 < len(buckets):  # nothing compacted yet (out None) while the batch is whole
                    states[(buckets[i + 1], phase)] = add(
                        f"compact rows={rows} slots={slots}", self._compact, state,
                        None if rows == first else full, rows=buckets[i + 1]).part(lambda o: o[0])
                if phase + 1 < len(ends):
                    states[(rows, phase + 1)] = add(f"grow rows={rows} slots={slots}", self._grow, state,
                                                    slots=p + ends[phase + 1])
        return out

    def programs(self, params, prompts: int, longest: int, n: int, sampling: SamplingConfig, compile,
                 key=None) -> None:
        """``schedule``'s programs, each to ``compile(name, jitted, *args, **kwargs)`` in turn, under
        the sampler's mesh and rules; ``compile`` returns the program's outputs as abstract values
        (``arlopti_jax.aot``)."""
        with shd.activate(self.mesh, self.rules):
            compiles.run_in_order(self.schedule(params, prompts, longest, n, sampling, key), compile)

    def generate(self, params, prompts: Sequence[Sequence[int]], n: int, key: Array,
                 sampling: SamplingConfig, stop_at: np.ndarray | None = None, pad_to: int = 0) -> Rollout:
        """n responses to each prompt (token id lists), as host arrays grouped by prompt.
        Multi-process: every process passes its own prompts (any number, none included) and
        gets back the responses to those, sampled as one global batch.

        ``stop_at`` (benchmarks and tests): per response row (prompt i, sample j at row
        i * n + j), the response length at which the first EOS id is forced in place of the
        draw, so responses end at chosen lengths on any model; a value > max_response_len
        never forces. The forced token is recorded as if sampled: in the mask, with its
        log-prob under the model, the row finished (not truncated).

        ``pad_to``: lay the batch out as for this many prompts (all processes') when there are fewer:
        the extra rows are batch padding (finished from the start, dropped from the result), so the
        responses are the same, and calls with varying prompt counts up to ``pad_to`` share one
        prompt-count bucket, one set of compiled programs (evaluation's last chunk of a test set).
        """
        return drain(self.generate_steps(params, prompts, n, key, sampling, stop_at, pad_to))

    def generate_steps(self, params, prompts: Sequence[Sequence[int]], n: int, key: Array,
                       sampling: SamplingConfig, stop_at: np.ndarray | None = None, pad_to: int = 0):
        """``generate`` as a generator that yields where the host would wait for a decode loop
        (``decode_steps``) and returns the ``Rollout``."""
        batch = self.pad_prompts(prompts, sampling, pad_to)
        params = self.sampling_params(params)
        done = yield from self.decode_steps(params, self.start(params, batch, n, key, sampling, stop_at), key,
                                            sampling)
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
