"""A Flax decoder for the Qwen2 / Qwen2.5 and Llama families.

Pre-norm transformer: RMSNorm -> grouped-query attention with RoPE -> residual ->
RMSNorm -> SwiGLU MLP -> residual. Layers are stacked with ``nn.scan`` (one compiled
layer body, parameters with a leading ``layers`` axis) and optionally rematerialised.

Every parameter carries logical axis names (see ``arlopti_jax.sharding``) so the
parallel layout is a rule table, not code.

The KV cache is explicit and functional: ``cache = {"k": [L, B, S, K, H], "v": ...}``.
A call writes its T tokens at cache slots ``[cache_index, cache_index + T)`` and a query
at slot ``cache_index + t`` attends to slots ``<= cache_index + t`` that ``kv_mask`` marks
valid. The whole cache rides in the layer scan's carry and layer i updates only its new
slots in place, so a decode step reads the cache once and writes T slots per layer (a
per-layer cache slice as scan input/output would be copied whole every step). Without a cache, keys are the call's own tokens and ``kv_mask`` is the
attention mask.

Packed rows (the trainer's update and log-prob passes): ``segment_ids`` [B, T] number the
sequences packed into each row (0 = padding) and ``positions`` restart at 0 in each one; a
token attends to the earlier tokens of its own segment. With ``block`` > 0 the row is cut
into query blocks of ``block`` tokens, and each block attends only to itself and the two
blocks before it (``segment_mask``): exact whenever no segment is longer than 2 * block,
and the attention then costs 3 * block keys per token instead of the row length.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from arlopti_jax.models.config import ModelConfig

Array = jax.Array


def _param(module: nn.Module, name: str, init, shape, axes, dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def rope_inv_freq(cfg: ModelConfig) -> Array:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_scaling is None:
        return inv
    s = dict(cfg.rope_scaling)  # Llama 3 frequency-dependent scaling
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


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",), self.param_dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * xf.astype(self.dtype)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask, cache, layer, cache_index):
        cfg = self.cfg
        dt, pdt = cfg.compute_dtype, cfg.weight_dtype
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = nn.initializers.normal(0.02)

        def proj(name, heads, axes):
            w = _param(self, f"{name}_kernel", init, (d, heads, h), ("embed", axes, "head_dim"), pdt)
            y = jnp.einsum("btd,dnh->btnh", x, w.astype(dt))
            if cfg.qkv_bias:
                b = _param(self, f"{name}_bias", nn.initializers.zeros, (heads, h), (axes, "head_dim"), pdt)
                y = y + b.astype(dt)
            return y

        q = proj("q", n, "heads")
        kk = proj("k", k, "kv_heads")
        v = proj("v", k, "kv_heads")
        inv_freq = rope_inv_freq(cfg)
        q = apply_rope(q, positions, inv_freq)
        kk = apply_rope(kk, positions, inv_freq)
        q = nn.with_logical_constraint(q, ("act_batch", "act_length", "act_heads", "head_dim"))

        if cache is not None:
            axes = ("layers", "cache_batch", "cache_length", "kv_heads", "head_dim")
            zero = jnp.zeros((), jnp.int32)
            start = (layer, zero, jnp.asarray(cache_index, jnp.int32), zero, zero)
            cache = {name: nn.with_logical_constraint(
                jax.lax.dynamic_update_slice(cache[name], new[None].astype(cache[name].dtype), start), axes)
                for name, new in (("k", kk), ("v", v))}
            kk = jax.lax.dynamic_index_in_dim(cache["k"], layer, 0, keepdims=False).astype(dt)
            v = jax.lax.dynamic_index_in_dim(cache["v"], layer, 0, keepdims=False).astype(dt)

        if mask.ndim == 5:  # packed rows in query blocks (see segment_mask)
            out = blocked_attention(q, kk, v, mask, scale=1.0 / math.sqrt(h))
        else:
            out = jax.nn.dot_product_attention(q, kk, v, mask=mask, scale=1.0 / math.sqrt(h))
        wo = _param(self, "o_kernel", init, (n, h, d), ("heads", "head_dim", "embed"), pdt)
        return jnp.einsum("btnh,nhd->btd", out, wo.astype(dt)), cache


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dt, pdt = cfg.compute_dtype, cfg.weight_dtype
        d, f = cfg.hidden_size, cfg.intermediate_size
        init = nn.initializers.normal(0.02)
        gate = _param(self, "gate_kernel", init, (d, f), ("embed", "mlp"), pdt)
        up = _param(self, "up_kernel", init, (d, f), ("embed", "mlp"), pdt)
        down = _param(self, "down_kernel", init, (f, d), ("mlp", "embed"), pdt)
        hid = jax.nn.silu(x @ gate.astype(dt)) * (x @ up.astype(dt))
        hid = nn.with_logical_constraint(hid, ("act_batch", "act_length", "act_mlp"))
        return hid @ down.astype(dt)


class Block(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, carry, layer, positions, mask, cache_index):
        x, cache = carry
        cfg = self.cfg
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.weight_dtype, name=name)
        attn_out, cache = Attention(cfg, name="attn")(norm("input_norm")(x), positions, mask, cache, layer, cache_index)
        x = x + attn_out
        x = x + MLP(cfg, name="mlp")(norm("post_attn_norm")(x))
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        return (x, cache), None


def attention_mask(kv_mask: Array, q_len: int, cache_index) -> Array:
    """Boolean [B, 1, T, S]: query t (at slot cache_index + t) sees valid slots <= its own."""
    s = kv_mask.shape[1]
    q_slot = cache_index + jnp.arange(q_len)[:, None]
    causal = jnp.arange(s)[None, :] <= q_slot  # [T, S]
    return (causal[None, None] & kv_mask[:, None, None, :].astype(bool))


BLOCK_LOOKBACK = 2  # earlier query blocks a packed block attends to (the window is 2 blocks long)


def _block_windows(x: Array, block: int, fill) -> Array:
    """[B, T, ...] -> [B, T / block, (BLOCK_LOOKBACK + 1) * block, ...]: for each query block, the
    positions of the BLOCK_LOOKBACK blocks before it and its own (``fill`` before the row start)."""
    b, t = x.shape[:2]
    pad = [(0, 0), (BLOCK_LOOKBACK * block, 0)] + [(0, 0)] * (x.ndim - 2)
    blocks = jnp.pad(x, pad, constant_values=fill).reshape(b, t // block + BLOCK_LOOKBACK, block, *x.shape[2:])
    n = t // block
    return jnp.concatenate([blocks[:, s:s + n] for s in range(BLOCK_LOOKBACK + 1)], axis=2)


def segment_mask(segment_ids: Array, block: int = 0) -> Array:
    """Causal attention within packed segments. ``block`` = 0: a boolean [B, 1, T, T] mask.
    ``block`` > 0 (dividing T): a [B, T / block, 1, block, 3 * block] mask of each query block
    over its key window (``blocked_attention``), exact when no segment exceeds 2 * block tokens.
    Padding tokens (segment 0) see themselves only, so no softmax row is empty."""
    b, t = segment_ids.shape
    slot = jnp.arange(t)
    if not block:
        q_seg, k_seg, q_slot, k_slot = segment_ids[:, :, None], segment_ids[:, None, :], slot[:, None], slot[None]
        same = (q_seg == k_seg) & (k_slot <= q_slot) & (k_seg > 0)
        return (same | (k_slot == q_slot))[:, None]
    n = t // block
    q_seg = segment_ids.reshape(b, n, block)[..., :, None]
    k_seg = _block_windows(segment_ids, block, 0)[:, :, None, :]
    q_slot = slot.reshape(n, block)[None, :, :, None]
    k_slot = _block_windows(slot[None], block, -1)[:, :, None, :]
    same = (q_seg == k_seg) & (k_slot <= q_slot) & (k_seg > 0)
    return (same | (k_slot == q_slot))[:, :, None]


def blocked_attention(q: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
    """Attention of query blocks over their key windows. q [B, T, N, H]; k, v [B, T, K, H];
    mask [B, T / block, 1, block, 3 * block] from ``segment_mask``."""
    b, t, n, h = q.shape
    nb, block = mask.shape[1], mask.shape[3]
    kw, vw = (_block_windows(x, block, 0).reshape(b * nb, -1, *x.shape[2:]) for x in (k, v))
    out = jax.nn.dot_product_attention(q.reshape(b * nb, block, n, h), kw, vw,
                                       mask=mask.reshape(b * nb, 1, block, -1), scale=scale)
    return out.reshape(b, t, n, h)


class Decoder(nn.Module):
    """Returns final-norm hidden states [B, T, D] and the updated cache (or None)."""

    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        self.embedding = self.param(
            "embedding", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
            (cfg.vocab_size, cfg.hidden_size), cfg.weight_dtype)
        block = nn.remat(Block, prevent_cse=False) if cfg.remat else Block
        self.layers = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, name="layers")
        self.final_norm = RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.weight_dtype, name="final_norm")
        if not cfg.tie_word_embeddings:
            self.lm_head = self.param(
                "lm_head", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "vocab")),
                (cfg.hidden_size, cfg.vocab_size), cfg.weight_dtype)

    def __call__(self, tokens, positions, kv_mask, cache=None, cache_index=0, segment_ids=None, block=0):
        x = jnp.take(self.embedding, tokens, axis=0).astype(self.cfg.compute_dtype)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        if segment_ids is not None:
            mask = segment_mask(segment_ids, block)
        else:
            mask = attention_mask(kv_mask, tokens.shape[1], cache_index)
        layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        (x, new_cache), _ = self.layers((x, cache), layers, positions, mask, cache_index)
        return self.final_norm(x), new_cache

    def unembed_matrix(self):
        """[D, V] output projection (the embedding's transpose when tied)."""
        return self.embedding.T if self.cfg.tie_word_embeddings else self.lm_head

    def logits(self, hidden):
        w = self.unembed_matrix()
        return jnp.einsum("btd,dv->btv", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)


def position_ids(attention_mask: Array) -> Array:
    """Positions that skip left padding: cumsum(mask) - 1, clipped at 0 (as HF generate)."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> dict:
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype or cfg.compute_dtype
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
