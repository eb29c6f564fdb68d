"""Functional entry points on a ``(ModelConfig, params)`` policy.

``params`` is the plain (unboxed) parameter tree of :class:`Decoder`; its logical axis
names come from ``param_logical_specs`` and its shardings from ``param_shardings``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models.config import ModelConfig
from arlopti_jax.models.decoder import Decoder, position_ids
from arlopti_jax.models.variants import softcap as capped, softcap_grad

Array = jax.Array


@functools.lru_cache(maxsize=32)
def _abstract_boxed(cfg: ModelConfig):
    model = Decoder(cfg)

    def init():  # every array traced, none made: the active mesh may be a compile-only one (aot)
        toks = jnp.zeros((1, 1), jnp.int32)
        return model.init(jax.random.key(0), toks, toks, toks)

    with nn.logical_axis_rules(()):  # shapes only: activation constraints off, whatever mesh is active
        return jax.eval_shape(init)["params"]


def abstract_params(cfg: ModelConfig):
    """ShapeDtypeStruct tree of the parameters (no allocation)."""
    boxed = lambda x: isinstance(x, nn.meta.AxisMetadata)  # raw values: unbox() would add a constraint
    return jax.tree_util.tree_map(lambda x: x.value if boxed(x) else x, _abstract_boxed(cfg), is_leaf=boxed)


def param_logical_specs(cfg: ModelConfig):
    """Tree of PartitionSpecs naming each parameter dimension logically."""
    return nn.get_partition_spec(_abstract_boxed(cfg))


def param_shardings(cfg: ModelConfig, mesh, rules=shd.DEFAULT_RULES):
    return shd.logical_to_shardings(param_logical_specs(cfg), mesh, rules, shapes=abstract_params(cfg))


@functools.lru_cache(maxsize=8)
def _jitted_init(cfg: ModelConfig, mesh, rules):
    toks = jnp.zeros((1, 1), jnp.int32)
    model = Decoder(cfg)

    @functools.partial(jax.jit, out_shardings=param_shardings(cfg, mesh, rules))
    def init(key):
        return nn.meta.unbox(model.init(key, toks, toks, toks))["params"]

    return init


def init_params(cfg: ModelConfig, rng: Array, mesh, rules=shd.DEFAULT_RULES):
    """Randomly initialised parameters, created directly in their shardings (compiled once
    per config, mesh and rules)."""
    return _jitted_init(cfg, mesh, tuple(rules))(rng)


def hidden_states(cfg: ModelConfig, params, input_ids: Array, attention_mask: Array) -> Array:
    """Final-norm hidden states [B, T, D] for a (left- or right-) padded batch."""
    hidden, _ = Decoder(cfg).apply({"params": params}, input_ids, position_ids(attention_mask), attention_mask)
    return hidden


def packed_hidden_states(cfg: ModelConfig, params, tokens: Array, positions: Array, segment_ids: Array,
                         prefix_ids: Array | None = None) -> Array:
    """Final-norm hidden states [B, T, D] of packed rows: several sequences per row, numbered
    by ``segment_ids`` (0 = padding), ``positions`` restarting at 0 in each; a segment whose
    ``prefix_ids`` name another segment also attends to it (a shared prompt, ``algos/packing.py``)."""
    hidden, _ = Decoder(cfg).apply({"params": params}, tokens, positions, None, segment_ids=segment_ids,
                                   prefix_ids=prefix_ids)
    return hidden


def unembed_matrix(cfg: ModelConfig, params) -> Array:
    return params["embedding"].T if cfg.tie_word_embeddings else params["lm_head"]


def _project(h: Array, w: Array, softcap: float | None) -> Array:
    """float32 logits of hidden states h [..., T, D] by the unembedding w [D, V], soft-capped by
    ``softcap`` (``ModelConfig.final_logit_softcapping``; None: as they are)."""
    return capped(jnp.einsum("...td,dv->...tv", h, w.astype(h.dtype), preferred_element_type=jnp.float32), softcap)


def unembed(cfg: ModelConfig, params, hidden: Array) -> Array:
    """float32 logits [B, T, V] of final-norm hidden states [B, T, D]."""
    return _project(hidden, unembed_matrix(cfg, params), cfg.final_logit_softcapping)


def logits(cfg: ModelConfig, params, input_ids: Array, attention_mask: Array) -> Array:
    """Full float32 logits [B, T, V]. For training use :func:`token_logprobs`, which never
    holds this tensor."""
    return unembed(cfg, params, hidden_states(cfg, params, input_ids, attention_mask))


def _chunk_logprobs(w: Array, temperature: float, h: Array, targets: Array, entropy_grad: bool = True,
                    softcap: float | None = None):
    logit = _project(h, w, softcap) / temperature
    lse = jax.nn.logsumexp(logit, axis=-1)
    picked = jnp.take_along_axis(logit, targets[..., None], axis=-1)[..., 0]
    ent_in = (logit, lse) if entropy_grad else jax.lax.stop_gradient((logit, lse))
    probs = jnp.exp(ent_in[0] - ent_in[1][..., None])
    entropy = ent_in[1] - jnp.sum(probs * ent_in[0], axis=-1)
    return picked - lse, entropy


DIRECT_LOGITS_BYTES = 64 << 20  # a device's target logits up to this size are projected in one piece


def target_logprobs(w: Array, hidden: Array, target_pos: Array, target_ids: Array, active: Array,
                    temperature: float = 1.0, chunk_size: int = 256,
                    entropy_grad: bool = True, softcap: float | None = None) -> tuple[Array, Array]:
    """log pi and entropy [D, K] of chosen targets only. ``hidden`` [R, S, D_model] holds D
    devices' rows (R / D each, in order); target k of device d is token ``target_ids[d, k]``
    predicted from slot ``target_pos[d, k]`` of that device's rows flattened to R / D * S slots.

    Devices list their active targets (``active`` 1) first. When a device's float32 target
    logits fit ``DIRECT_LOGITS_BYTES`` (small vocabularies), the vocabulary projection runs on
    all K at once and autodiff keeps them. Otherwise it runs ``chunk_size`` x R / D targets at
    a time (the memory of ``chunk_size`` positions per row) under ``jax.checkpoint`` and skips
    (``lax.cond``) chunks with no active target, forward and backward. Either way its cost
    follows the number of targets, not the number of slots. ``entropy_grad=False`` computes
    the entropy as a constant (no gradient path), for losses that only report it. ``softcap``: the
    model's final logit soft-cap, applied before the temperature. Inactive targets return 0.
    """
    d, k = target_pos.shape
    r, s, dm = hidden.shape
    h = jnp.take_along_axis(hidden.reshape(d, r // d * s, dm), target_pos[..., None], axis=1)  # [D, K, Dm]
    keep = active.astype(jnp.float32)
    body = functools.partial(_chunk_logprobs, w, temperature, entropy_grad=entropy_grad, softcap=softcap)
    if k * w.shape[1] * 4 <= DIRECT_LOGITS_BYTES:
        lp, ent = body(h, target_ids)
        return lp * keep, ent * keep
    c = max(1, min(chunk_size * (r // d), k))
    pad = (-k) % c
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    ids, act = (jnp.pad(x, ((0, 0), (0, pad))) for x in (target_ids, active.astype(jnp.int32)))
    n = (k + pad) // c
    chunks = lambda x: x.reshape(d, n, c, *x.shape[2:]).swapaxes(0, 1)
    lp, ent = _projected_chunks(w, chunks(h), chunks(ids), chunks(act), temperature, entropy_grad, softcap)
    unchunk = lambda x: x.swapaxes(0, 1).reshape(d, n * c)[:, :k] * keep
    return unchunk(lp), unchunk(ent)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _projected_chunks(w: Array, h: Array, ids: Array, active: Array, temperature: float, entropy_grad: bool,
                      softcap: float | None):
    """log pi and entropy [n, D, c] of n chunks of targets (h [n, D, c, Dm], ids and active
    [n, D, c]), one chunk's logits at a time, chunks without an active target skipped. The
    backward pass recomputes each chunk's logits and sums the projection's gradient in one
    [Dm, V] float32 buffer: autodiff of the chunk loop stacked every chunk's gradient first
    ([n, Dm, V]: 18.5 GiB per device at Qwen2.5-3B's vocabulary with 4,096 targets in 16 chunks)."""
    zeros = jnp.zeros(ids.shape[1:], jnp.float32)

    def one(xs):
        hc, tc, ac = xs
        return jax.lax.cond(jnp.any(ac > 0),
                            lambda: _chunk_logprobs(w, temperature, hc, tc, entropy_grad, softcap),
                            lambda: (zeros, zeros))

    return jax.lax.map(one, (h, ids, active))


def _projected_chunks_fwd(w, h, ids, active, temperature, entropy_grad, softcap):
    return _projected_chunks(w, h, ids, active, temperature, entropy_grad, softcap), (w, h, ids, active)


def _projected_chunks_bwd(temperature, entropy_grad, softcap, res, cotangents):
    """lp = z[id] - lse and entropy H = lse - sum p z for logits z = c / T, c = softcap(h w), give
    dz = g_lp (onehot(id) - p) + g_H p (E_p[z] - z); then with dc = dz (1 - (c / cap)^2) / T
    (``variants.softcap_grad``; 1 / T uncapped), dh = dc w^T and dw = h^T dc."""
    w, h, ids, active = res
    g_lp, g_ent = cotangents

    def one(dw, xs):
        hc, tc, ac, glc, gec = xs

        def grads():
            c = _project(hc, w, softcap)
            z = c / temperature
            p = jax.nn.softmax(z, axis=-1)
            dz = glc[..., None] * (jax.nn.one_hot(tc, z.shape[-1], dtype=jnp.float32) - p)
            if entropy_grad:
                dz = dz + gec[..., None] * p * (jnp.sum(p * z, axis=-1, keepdims=True) - z)
            dz = (dz * softcap_grad(c, softcap) / temperature).astype(hc.dtype)
            dh = jnp.einsum("btv,dv->btd", dz, w.astype(hc.dtype), preferred_element_type=jnp.float32)
            return dw + jnp.einsum("btd,btv->dv", hc, dz, preferred_element_type=jnp.float32), dh.astype(hc.dtype)

        return jax.lax.cond(jnp.any(ac > 0), grads, lambda: (dw, jnp.zeros_like(hc)))

    dw, dh = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32), (h, ids, active, g_lp, g_ent))
    return dw.astype(w.dtype), dh, None, None


_projected_chunks.defvjp(_projected_chunks_fwd, _projected_chunks_bwd)


def logprobs_from_hidden(w: Array, hidden: Array, input_ids: Array, temperature: float = 1.0,
                         chunk_size: int = 256, softcap: float | None = None) -> tuple[Array, Array]:
    """log pi(input_ids[:, t] | input_ids[:, :t]) and the entropy of that distribution.

    Returns two float32 [B, T] arrays aligned with ``input_ids`` (column 0 is 0: the
    first token has no context). The vocabulary projection runs ``chunk_size`` positions
    at a time under ``jax.checkpoint``, so neither the forward nor the backward pass holds
    a [B, T, V] tensor. ``softcap``: as ``target_logprobs``'.
    """
    b, t, d = hidden.shape
    h, targets = hidden[:, :-1], input_ids[:, 1:]
    n = t - 1
    c = max(1, min(chunk_size, n))
    pad = (-n) % c
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    k = (n + pad) // c
    h = h.reshape(b, k, c, d).swapaxes(0, 1)
    targets = targets.reshape(b, k, c).swapaxes(0, 1)
    body = jax.checkpoint(functools.partial(_chunk_logprobs, w, temperature, softcap=softcap))
    lp, ent = jax.lax.map(lambda xs: body(*xs), (h, targets))
    lp = lp.swapaxes(0, 1).reshape(b, k * c)[:, :n]
    ent = ent.swapaxes(0, 1).reshape(b, k * c)[:, :n]
    zero = jnp.zeros((b, 1), jnp.float32)
    return jnp.concatenate([zero, lp], axis=1), jnp.concatenate([zero, ent], axis=1)


def token_logprobs(cfg: ModelConfig, params, input_ids: Array, attention_mask: Array, *,
                   temperature: float = 1.0, chunk_size: int = 256) -> tuple[Array, Array]:
    """Per-token log-probs and entropies [B, T] of a batch under the policy (see
    :func:`logprobs_from_hidden` for alignment). ``temperature`` divides the logits, as
    the sampler does, so these are the log-probs of the distribution it sampled from."""
    hidden = hidden_states(cfg, params, input_ids, attention_mask)
    return logprobs_from_hidden(unembed_matrix(cfg, params), hidden, input_ids, temperature, chunk_size,
                                cfg.final_logit_softcapping)
