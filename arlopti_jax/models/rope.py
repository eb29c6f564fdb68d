"""Rotary position embeddings (RoPE), rotate-half form, with Llama 3's frequency scaling and linear
scaling (Gemma 3's global layers): the decoder's (``decoder.Attention``) and the fused decode kernel's
reference (``decode_attention``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from arlopti_jax.models.config import ModelConfig

Array = jax.Array


def rope_inv_freq(cfg: ModelConfig, sliding: bool = False) -> Array:
    """[head_dim / 2] float32 frequencies of the full-attention layers, or (``sliding``) of the
    sliding-window layers: plain RoPE at ``rope_local_theta`` (Gemma 3's local layers)."""
    dim = cfg.head_dim
    theta = cfg.rope_local_theta if sliding and cfg.rope_local_theta else cfg.rope_theta
    inv = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_scaling is None or sliding:
        return inv
    s = dict(cfg.rope_scaling)
    if s["rope_type"] == "linear":  # positions divided by the factor
        return inv / s["factor"]
    # Llama 3 frequency-dependent scaling
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotate-half RoPE. x: [B, T, heads, H]; positions: [B, T]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    return (xf * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)
