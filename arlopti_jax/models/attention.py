"""Attention over a call's own tokens (the training passes and the prefill): cuDNN's fused kernel,
XLA's lowering, or the causal query blocks with a written gradient (CPUs and TPUs, and any model
that soft-caps its attention scores). The KV cache's attention is ``decode.py``'s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models.config import cudnn_attention_takes
from arlopti_jax.models.variants import softcap as capped, softcap_grad

Array = jax.Array


def attention(q: Array, k: Array, v: Array, mask: Array, scale: float, impl: str = "auto",
              softcap: float | None = None) -> Array:
    """Causal grouped-query attention over a call's own tokens: q [B, T, N, H], k and v
    [B, T, K, H], boolean mask [B, 1, T, T] that lets no query see a later slot and leaves no
    row empty (``attention_mask`` and ``segment_mask`` guarantee both).
    ``impl`` "cudnn" (what "auto" picks on a GPU at 16-bit, for heads of at most 128: not Gemma 3's
    256, which cuDNN refuses): ``jax.nn.dot_product_attention``'s
    cuDNN fused kernel, which never holds the [T, S] scores (on an H100, 1.5B's heads over 4 packed
    rows of 4,096 tokens: forward + backward 5.4 ms against 23 ms, docs/measurements/journal.md). "xla": its
    XLA lowering on a GPU; on CPUs and TPUs ``_causal_blocks`` computes the same math without the
    scores above the diagonal (XLA:TPU's estimate of a 3B layer at 4,544 tokens: 27.0 ms
    against 34.5 ms for the whole [T, T] scores, docs/measurements/journal.md). ``softcap``: scores s
    become softcap tanh(s / softcap) before the softmax (Gemma 2 style), which neither of
    ``jax.nn.dot_product_attention``'s kernels does: the causal blocks then run on every backend
    ('cudnn' is refused by ``ModelConfig``, 'auto' falls back with a start-up line)."""
    backend = shd.platform()
    if softcap:
        return _causal_blocks(q, k, v, mask, scale, softcap)
    if impl == "auto":  # cuDNN's kernel where it takes the heads (``config.cudnn_attention_takes``)
        cudnn = backend == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and cudnn_attention_takes(q.shape[-1])
        impl = "cudnn" if cudnn else "xla"
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")
    if backend == "gpu":
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
    return _causal_blocks(q, k, v, mask, scale)


def _causal_blocks(q: Array, k: Array, v: Array, mask: Array, scale: float, softcap: float | None = None) -> Array:
    """``attention`` on CPUs and TPUs: heads ahead of positions (the query heads sharing a key
    head batched together); rows of 512 slots or more run their queries in blocks of about 256
    (at most 8) that each attend only to the keys up to their last slot, so most scores above the
    diagonal are never computed (XLA's own lowering computes, writes and reads all T x T of them,
    forward and backward). The gradient is written out (``_blocks``): the forward keeps only the
    output and each query's log-sum-exp, and the backward recomputes a block's probabilities from
    them, as fused attention kernels do, instead of autodiff saving and re-reading float32
    probabilities and the softmax's intermediates.

    Forward and backward against autodiff through the same blocks (measured on 2026-11-26 with the
    since-removed bench/attention_blocks.py; docs/measurements/journal.md): on the CPU in float32,
    2 rows of 640 (2 blocks) 9.7 ms against 24.3, 1
    row of 1,536 (6 blocks) 125 against 212, 8 rows of 320 (1 block) 77 against 78, SmolLM2's
    whole layer stack 1.09-1.18x faster; XLA:TPU's estimate of a 3B layer at 4,544 tokens, 22.2 ms
    against 27.0. Smaller blocks run faster on the CPU but every block adds to the
    compilation: blocks of 96 made the embedded default's update compile 53 s instead of 31 s for
    0.2 s less per step, a loss over its 30 steps."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    qh = q.transpose(0, 2, 1, 3).reshape(b, kv, n // kv, t, h)
    return _blocks(qh, k, v, mask, scale, softcap).reshape(b, n, t, h).transpose(0, 2, 1, 3)


def _edges(t: int) -> list[int]:
    blocks = max(1, min(t // 256, 8))
    return [round(t * i / blocks) for i in range(blocks + 1)]


def _block_scores(qh: Array, k: Array, mask: Array, scale: float, cap: float | None, lo: int, hi: int,
                  masked: bool = True) -> Array:
    """float32 [B, K, G, hi - lo, hi]: queries lo:hi against keys :hi, scaled, soft-capped by ``cap``,
    and (``masked``) masked out to the float32 minimum."""
    scores = jnp.einsum("bkgth,bskh->bkgts", qh[:, :, :, lo:hi], k[:, :hi], preferred_element_type=jnp.float32)
    scores = capped(scores * scale, cap)
    return jnp.where(mask[:, :, None, lo:hi, :hi], scores, jnp.finfo(jnp.float32).min) if masked else scores


def _blocks_forward(qh: Array, k: Array, v: Array, mask: Array, scale: float, cap: float | None):
    """qh [B, K, G, T, H], k and v [B, S, K, H] -> (out [B, K, G, T, H], residuals). On a TPU each
    block's scores are computed twice, once for their maximum and once for the probabilities (the
    second from a copy of the queries that XLA cannot merge with the first): a matrix product is
    cheap there next to writing and re-reading float32 scores, which is what XLA:TPU does with one.
    XLA:CPU is bound by the products instead, and computes them once (8 rows of 320: 77 ms against
    84 with two, measured on 2026-11-26)."""
    outs, lses = [], []
    again = qh if shd.platform() == "cpu" else jax.lax.optimization_barrier(qh)
    edges = _edges(qh.shape[3])
    for lo, hi in zip(edges, edges[1:]):
        top = _block_scores(qh, k, mask, scale, cap, lo, hi).max(axis=-1, keepdims=True)
        weights = jnp.exp(_block_scores(again, k, mask, scale, cap, lo, hi) - top)
        total = weights.sum(axis=-1, keepdims=True)
        out = jnp.einsum("bkgts,bskh->bkgth", weights.astype(v.dtype), v[:, :hi], preferred_element_type=jnp.float32)
        outs.append((out / total).astype(v.dtype))
        lses.append(top + jnp.log(total))
    out = jnp.concatenate(outs, axis=3)
    return out, (qh, k, v, mask, out, jnp.concatenate(lses, axis=3))


def _blocks_backward(scale: float, cap: float | None, residuals, grad: Array):
    """With p = softmax(s): dv = p^T g, ds = p * (g v^T - rowsum(g * out)), dq = ds k * scale,
    dk = ds^T q * scale; p recomputed from the saved log-sum-exp. Soft-capped scores c = cap tanh(s /
    cap) also multiply ds by dc / ds = 1 - (c / cap)^2."""
    qh, k, v, mask, out, lse = residuals
    f32 = jnp.float32
    delta = jnp.sum(grad.astype(f32) * out.astype(f32), axis=-1, keepdims=True)
    dq, dk, dv = [], jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    edges = _edges(qh.shape[3])
    for lo, hi in zip(edges, edges[1:]):
        scores = _block_scores(qh, k, mask, scale, cap, lo, hi, masked=False)
        probs = jnp.where(mask[:, :, None, lo:hi, :hi], jnp.exp(scores - lse[:, :, :, lo:hi]), 0.0)
        g = grad[:, :, :, lo:hi]
        dprobs = jnp.einsum("bkgth,bskh->bkgts", g, v[:, :hi], preferred_element_type=f32)
        dscores = (probs * (dprobs - delta[:, :, :, lo:hi]) * softcap_grad(scores, cap) * scale).astype(qh.dtype)
        dq.append(jnp.einsum("bkgts,bskh->bkgth", dscores, k[:, :hi], preferred_element_type=f32).astype(qh.dtype))
        dk = dk.at[:, :hi].add(jnp.einsum("bkgts,bkgth->bskh", dscores, qh[:, :, :, lo:hi], preferred_element_type=f32))
        dv = dv.at[:, :hi].add(jnp.einsum("bkgts,bkgth->bskh", probs.astype(v.dtype), g, preferred_element_type=f32))
    return jnp.concatenate(dq, axis=3), dk.astype(k.dtype), dv.astype(v.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blocks(qh: Array, k: Array, v: Array, mask: Array, scale: float, cap: float | None) -> Array:
    return _blocks_forward(qh, k, v, mask, scale, cap)[0]


_blocks.defvjp(_blocks_forward, _blocks_backward)

