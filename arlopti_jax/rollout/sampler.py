"""The sampler: a jitted prefill of left-padded prompts, then a ``lax.while_loop`` decode
over a preallocated KV cache, sharded over the trainer's mesh with the trainer's params.

Per call, on device (no host round trip until the results are fetched):

1. ``prefill``: each distinct prompt runs ONCE through the decoder, filling a prompt-sized
   cache [L, B, P, K, H] and giving the next-token logits of its last position.
2. ``start``: that cache is repeated along the batch to the n samples of each prompt and
   padded to P + R slots; every sample draws its first response token independently from
   the shared prefill logits.
3. ``decode``: a ``lax.while_loop`` feeds the last token at slot P + t - 1 and samples
   token t, until every sample has emitted an EOS id or R tokens. The state (cache
   included) is donated, so the loop updates it in place.

Shapes are bucketed (``SamplingConfig.prompt_bucket`` / ``batch_bucket``), so a run
compiles a handful of programs. Randomness is ``fold_in(key, t)`` at response position t:
a run is reproducible from its key, and the same on every mesh layout.
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
from arlopti_jax.models.decoder import Decoder, init_cache, position_ids
from arlopti_jax.models.policy import unembed_matrix
from arlopti_jax.rollout.output import Rollout
from arlopti_jax.rollout.sampling import SamplingConfig, bucket, sample_tokens

Array = jax.Array

# The full cache [L, B, S, K, H]; the decoder constrains each layer's slice to the last four.
CACHE_AXES = ("layers", "cache_batch", "cache_length", "kv_heads", "head_dim")


class DecodeState(NamedTuple):
    """The decode loop's carry. N rows = padded prompts x n; S = P + R cache slots."""

    cache: dict  # {"k", "v"}: [L, N, S, K, H]
    kv_mask: Array  # [N, S] int32: the prompt mask, then ones over the response slots
    prompt_len: Array  # [N] int32: position id of response token 0
    tokens: Array  # [N, R] int32
    logprobs: Array  # [N, R] float32
    mask: Array  # [N, R] int32
    finished: Array  # [N] bool (batch-padding rows start finished)
    step: Array  # int32: the next response position to sample


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


def _constrain(state: DecodeState) -> DecodeState:
    cache = {name: nn.with_logical_constraint(c, CACHE_AXES) for name, c in state.cache.items()}
    return state._replace(cache=cache, kv_mask=_rows(state.kv_mask), prompt_len=_rows(state.prompt_len),
                          tokens=_rows(state.tokens), logprobs=_rows(state.logprobs), mask=_rows(state.mask),
                          finished=_rows(state.finished))


def _next_logits(cfg: ModelConfig, params, hidden: Array) -> Array:
    """float32 logits [B, V] of the last position of hidden [B, T, D]."""
    w = unembed_matrix(cfg, params)
    return jnp.einsum("bd,dv->bv", hidden[:, -1], w.astype(hidden.dtype), preferred_element_type=jnp.float32)


def _is_eos(tokens: Array, eos_ids: Array) -> Array:
    return jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)


def _prefill(cfg: ModelConfig, params, prompt_ids: Array, prompt_mask: Array):
    b, p = prompt_ids.shape
    cache = {name: nn.with_logical_constraint(c, CACHE_AXES) for name, c in init_cache(cfg, b, p).items()}
    hidden, cache = Decoder(cfg).apply({"params": params}, prompt_ids, position_ids(prompt_mask), prompt_mask,
                                       cache=cache, cache_index=0)
    cache = {name: nn.with_logical_constraint(c, CACHE_AXES) for name, c in cache.items()}
    return cache, _rows(_next_logits(cfg, params, hidden))


def _sample(logits, key, step, temperature, top_p, kernel):
    top_k, use_top_p, greedy, _ = kernel
    return sample_tokens(logits, jax.random.fold_in(key, step), temperature, top_p,
                         top_k=top_k, use_top_p=use_top_p, greedy=greedy)


def _start(prompt_cache: dict, logits: Array, prompt_mask: Array, live: Array, key: Array, temperature: Array,
           top_p: Array, eos_ids: Array, *, n: int, max_len: int, kernel: tuple) -> DecodeState:
    pad_id = kernel[3]
    widen = ((0, 0), (0, 0), (0, max_len), (0, 0), (0, 0))
    cache = {name: jnp.pad(jnp.repeat(c, n, axis=1), widen) for name, c in prompt_cache.items()}
    mask_n = jnp.repeat(prompt_mask, n, axis=0)
    rows = mask_n.shape[0]
    live = jnp.repeat(live, n, axis=0)
    tok, lp = _sample(jnp.repeat(logits, n, axis=0), key, 0, temperature, top_p, kernel)
    tok = jnp.where(live, tok, pad_id)
    state = DecodeState(
        cache=cache,
        kv_mask=jnp.concatenate([mask_n, jnp.ones((rows, max_len), mask_n.dtype)], axis=1),
        prompt_len=jnp.sum(mask_n, axis=1, dtype=jnp.int32),
        tokens=jnp.full((rows, max_len), pad_id, jnp.int32).at[:, 0].set(tok),
        logprobs=jnp.zeros((rows, max_len), jnp.float32).at[:, 0].set(jnp.where(live, lp, 0.0)),
        mask=jnp.zeros((rows, max_len), jnp.int32).at[:, 0].set(live.astype(jnp.int32)),
        finished=~live | _is_eos(tok, eos_ids),
        step=jnp.ones((), jnp.int32),
    )
    return _constrain(state)


def _decode(cfg: ModelConfig, params, state: DecodeState, key: Array, temperature: Array, top_p: Array,
            eos_ids: Array, *, kernel: tuple) -> DecodeState:
    pad_id = kernel[3]
    max_len = state.tokens.shape[1]
    prompt_slots = state.kv_mask.shape[1] - max_len
    model = Decoder(cfg)

    def cond(s: DecodeState):
        return (s.step < max_len) & ~jnp.all(s.finished)

    def body(s: DecodeState) -> DecodeState:
        t = s.step
        prev = jax.lax.dynamic_slice_in_dim(s.tokens, t - 1, 1, axis=1)
        pos = (s.prompt_len + t - 1)[:, None]
        hidden, cache = model.apply({"params": params}, prev, pos, s.kv_mask, cache=s.cache,
                                    cache_index=prompt_slots + t - 1)
        tok, lp = _sample(_next_logits(cfg, params, hidden), key, t, temperature, top_p, kernel)
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

    return jax.lax.while_loop(cond, body, _constrain(state))


def _put(x: np.ndarray, sharding, global_rows: int = 0) -> Array:
    """Host rows -> a global array in ``sharding``: with one process ``x`` is the whole array;
    with several, ``x`` is this process's rows of a ``global_rows``-row array."""
    if jax.process_count() == 1:
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.make_array_from_process_local_data(sharding, x, (global_rows,) + x.shape[1:])


class Sampler:
    """Draws groups of responses from the policy ``(model_cfg, params)`` on ``mesh``.

    ``params`` are the trainer's arrays, passed into the jitted programs with their own
    shardings (never copied or gathered to one device). Prompts and samples are split over
    the mesh's data x fsdp axes; the KV cache [L, N, S, K, H] is split as ``CACHE_AXES``
    under ``rules`` (batch over data x fsdp, kv heads over tensor).
    """

    def __init__(self, model_cfg: ModelConfig, mesh, rules=shd.DEFAULT_RULES):
        self.cfg, self.mesh, self.rules = model_cfg, mesh, rules
        self._prefill = jax.jit(functools.partial(_prefill, model_cfg))
        self._start = jax.jit(_start, static_argnames=("n", "max_len", "kernel"))
        self._decode = jax.jit(functools.partial(_decode, model_cfg), static_argnames=("kernel",),
                               donate_argnames=("state",))

    @property
    def cache_sharding(self):
        """The NamedSharding of the full KV cache's "k" and "v" arrays."""
        return shd.logical_to_shardings(jax.sharding.PartitionSpec(*CACHE_AXES), self.mesh, self.rules)

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

    def start(self, params, batch: PromptBatch, n: int, key: Array, sampling: SamplingConfig) -> DecodeState:
        """Prefill each prompt once and sample every row's first token (dispatch only, no sync)."""
        if n < 1:
            raise ValueError(f"generate: n={n} must be >= 1")
        if sampling.top_k > self.cfg.vocab_size:
            raise ValueError(f"SamplingConfig.top_k={sampling.top_k} exceeds the vocabulary ({self.cfg.vocab_size})")
        temperature, top_p, eos = self._traced_settings(sampling)
        rows = shd.batch_sharding(self.mesh, 2)
        live = np.arange(batch.ids.shape[0]) < batch.num_prompts
        with shd.activate(self.mesh, self.rules):
            ids, mask = _put(batch.ids, rows, batch.global_rows), _put(batch.mask, rows, batch.global_rows)
            cache, logits = self._prefill(params, ids, mask)
            live = _put(live, shd.batch_sharding(self.mesh, 1), batch.global_rows)
            return self._start(cache, logits, mask, live, key,
                               temperature, top_p, eos, n=n, max_len=sampling.max_response_len,
                               kernel=sampling.kernel_key)

    def decode(self, params, state: DecodeState, key: Array, sampling: SamplingConfig) -> DecodeState:
        """Run the decode loop to the end (``state`` is donated)."""
        temperature, top_p, eos = self._traced_settings(sampling)
        with shd.activate(self.mesh, self.rules):
            return self._decode(params, state, key, temperature, top_p, eos, kernel=sampling.kernel_key)

    def generate(self, params, prompts: Sequence[Sequence[int]], n: int, key: Array,
                 sampling: SamplingConfig) -> Rollout:
        """n responses to each prompt (token id lists), as host arrays grouped by prompt.
        Multi-process: every process passes its own prompts (any number, none included) and
        gets back the responses to those, sampled as one global batch."""
        batch = self.pad_prompts(prompts, sampling)
        state = self.decode(params, self.start(params, batch, n, key, sampling), key, sampling)
        keep = batch.num_prompts * n
        fetch = lambda x: dist.local_rows(x)[:keep]
        response_mask = fetch(state.mask)
        lengths = response_mask.sum(axis=1).astype(np.int32)
        finished = fetch(state.finished)
        return Rollout(
            prompt_ids=np.repeat(batch.ids[: batch.num_prompts], n, axis=0),
            prompt_mask=np.repeat(batch.mask[: batch.num_prompts], n, axis=0),
            response_ids=fetch(state.tokens),
            response_mask=response_mask,
            logprobs=fetch(state.logprobs),
            lengths=lengths,
            truncated=~finished,
            group_ids=np.repeat(np.arange(batch.num_prompts, dtype=np.int32), n),
            decode_steps=int(dist.to_host(state.step)),
        )
