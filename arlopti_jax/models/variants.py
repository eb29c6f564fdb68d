"""Where the families differ, as plain functions the decoder, the decode step and the losses share.

- Qwen2 and Llama: pre-norm blocks, RMS norm ``w * x``, SwiGLU, every layer global.
- Qwen3 (dense): Qwen2 without the q/k/v biases and with an RMS norm over each query and key head
  before RoPE (``qk_norm``); its head_dim need not be hidden / heads.
- Gemma 3 (text): RMS norms ``(1 + w) * x`` computed in float32 (``norm_offset``), the embedding
  scaled by sqrt(hidden), each sublayer's output normalised too before its residual add
  ("sandwich" norms), GELU (tanh form) gating, q/k norms, scores scaled by
  query_pre_attn_scalar^-1/2, sliding-window layers between global ones with their own RoPE theta,
  and optionally tanh soft-capping of the attention scores and of the final logits.

A layer's kind (sliding or global) picks its mask and its RoPE frequencies: ``per_layer`` picks
between the two at a Python int layer (straight-line layers) or a traced one (the layer scan).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from arlopti_jax.models.config import ModelConfig

Array = jax.Array


def norm_offset(cfg: ModelConfig) -> bool:
    """Whether an RMS norm's scale is (1 + w), its product taken in float32 (Gemma), rather than w."""
    return cfg.family == "gemma3"


def rms_norm(x: Array, scale: Array, eps: float, dtype, offset: bool = False) -> Array:
    """RMS norm over the last axis, as each family's transformers class computes it: Qwen2 / Llama
    cast the normalised float32 input to ``dtype`` and multiply by the scale there; Gemma multiplies
    by 1 + scale in float32 and casts the product."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (1.0 + scale.astype(jnp.float32))).astype(dtype)
    return scale.astype(dtype) * xf.astype(dtype)


def sandwich_norms(cfg: ModelConfig) -> bool:
    """Whether each sublayer's output is normalised before its residual add (Gemma 3)."""
    return cfg.family == "gemma3"


def activation(cfg: ModelConfig):
    """The MLP's gate activation: SiLU, or GELU in its tanh form (transformers' gelu_pytorch_tanh)."""
    if cfg.family == "gemma3":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


def embedding_scale(cfg: ModelConfig, dtype) -> Array | None:
    """What the embedded tokens are multiplied by (Gemma: sqrt(hidden), rounded to ``dtype`` first as
    transformers rounds it to the weights' dtype), or None."""
    return jnp.asarray(math.sqrt(cfg.hidden_size), dtype) if cfg.family == "gemma3" else None


def softcap(x: Array, cap: float | None) -> Array:
    """cap tanh(x / cap), or x without a cap."""
    return x if not cap else cap * jnp.tanh(x / cap)


def softcap_grad(capped: Array, cap: float | None) -> Array:
    """d softcap / dx from the capped value c = cap tanh(x / cap): 1 - (c / cap)^2."""
    return 1.0 if not cap else 1.0 - jnp.square(capped / cap)


def per_layer(cfg: ModelConfig, layer, full, sliding):
    """``sliding`` at a sliding-window layer, else ``full`` (each an array or a tuple of arrays of one
    shape). ``layer``: a Python int (straight-line layers: the choice is made here) or a traced index
    (the layer scan: a select on the layer's kind). Models without sliding layers get ``full``."""
    kinds = cfg.sliding_layers
    if sliding is None or not any(kinds):
        return full
    if isinstance(layer, int):
        return sliding if kinds[layer] else full
    is_sliding = jnp.asarray(kinds)[layer]
    return jax.tree.map(lambda f, s: jnp.where(is_sliding, s, f), full, sliding)


def window(mask: Array, q_at: Array, k_at: Array, size: int | None) -> Array | None:
    """``mask`` [B, 1, T, S] narrowed to keys less than ``size`` slots (or positions) behind their
    query, as transformers' sliding-window mask: q_at [B or 1, T] and k_at [B or 1, S] are the
    queries' and keys' slots (a cache: contiguous runs) or positions (packed rows, where a shared
    prompt's responses sit further along the row than their positions say). None without a window."""
    if not size:
        return None
    near = (q_at[:, :, None] - k_at[:, None, :]) < size
    return mask & near[:, None]
