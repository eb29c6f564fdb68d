"""A Flax decoder for the Qwen2 / Qwen2.5, Llama, Qwen3 (dense) and Gemma 3 (text) families.

Pre-norm transformer: RMSNorm -> grouped-query attention with RoPE -> residual ->
RMSNorm -> gated MLP -> residual, with each family's differences (q/k norms, Gemma's norms
around each sublayer, GELU gating, sliding-window layers, soft-capping) in ``variants.py``.
Layers are stacked with ``nn.scan`` (one compiled layer body, parameters with a leading
``layers`` axis) and optionally rematerialised; a layer's kind (sliding or global) is read from
its index inside the body, which picks its mask and its RoPE frequencies (``variants.per_layer``).

Every parameter carries logical axis names (see ``arlopti_jax.runtime.sharding``) so the
parallel layout is a rule table, not code.

With a KV cache (``models/decode.py``: its layout, ``cached_attention`` and the GPU's fused
decode step) the whole cache rides in the layer scan's carry and layer i updates only its new
slots in place, so a decode step reads the cache once and writes T slots per layer (a per-layer
cache slice as scan input/output would be copied whole every step). Without a cache, keys are
the call's own tokens and ``kv_mask`` is the attention mask.

Packed rows (the trainer's update and log-prob passes): ``segment_ids`` [B, T] number the
sequences packed into each row (0 = padding) and ``positions`` restart at 0 in each one; a
token attends to the earlier tokens of its own segment (``segment_mask``). With a shared prompt
(``prefix_ids``, ``algos/packing.py``) a response segment also attends to its group's prefix
segment, and its positions continue from the prefix's length; one [B, 1, T, T] mask either way,
and a second, narrowed to the sliding window, for models with sliding layers (``layer_masks``).
A cache's window is counted in slots (each row's tokens are one contiguous run), a packed row's
in positions (a shared prompt's later responses sit further along the row than they are from it).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import variants
from arlopti_jax.models.attention import attention
from arlopti_jax.models.rope import apply_rope, rope_inv_freq
from arlopti_jax.models.config import ModelConfig
from arlopti_jax.models.decode import cached_attention, decode_kernel, fused_decode

Array = jax.Array


def _param(module: nn.Module, name: str, init, shape, axes, dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


@functools.lru_cache(maxsize=None)
def _barrier_einsum(spec: str):
    """``jnp.einsum(spec, x, w)`` whose backward materialises the incoming gradient first."""
    inputs, out = spec.split("->")
    x_spec, w_spec = inputs.split(",")

    @jax.custom_vjp
    def f(x, w):
        return jnp.einsum(spec, x, w)

    def bwd(res, g):
        x, w = res
        g = jax.lax.optimization_barrier(g)
        return jnp.einsum(f"{out},{w_spec}->{x_spec}", g, w), jnp.einsum(f"{x_spec},{out}->{w_spec}", x, g)

    f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)
    return f


def project(spec: str, x: Array, w: Array) -> Array:
    """``jnp.einsum(spec, x, w)``: a layer's projection by its weight ``w``. On CPU the
    backward pass first materialises the incoming gradient: XLA:CPU otherwise fuses that
    gradient's elementwise producer (e.g. SwiGLU's derivative) into the transposing copy its
    weight-gradient dot asks for, and that fused copy ran ~10x slower than a plain one (a
    third of a small model's backward pass). Other backends use the einsum as it is."""
    if shd.platform() == "cpu":
        return _barrier_einsum(spec)(x, w)
    return jnp.einsum(spec, x, w)



def adapted(module: nn.Module, name: str, spec: str, x: Array, w: Array, axes: tuple[str, ...]) -> Array:
    """``project(spec, x, w)`` for the layer's weight ``w`` (logical ``axes``, already in the
    compute dtype), plus its LoRA adapter when the config adapts projection ``name``:
    (lora_alpha / rank) x ``x`` A B, where A ("{name}_lora_a") maps w's contracted axes to the rank
    and B ("{name}_lora_b") the rank to w's other axes. A starts as PEFT's (Kaiming-uniform over
    its fan-in), B at zero, so a new adapter leaves the model as it was; the adapter is applied
    unmerged (two thin products), never forming the full-size B A. Adapters are float32 whatever
    ``param_dtype`` the base has (a bfloat16 base trains float32 adapters and AdamW moments, as
    PEFT's ``autocast_adapter_dtype`` does)."""
    cfg = module.cfg
    y = project(spec, x, w)
    if not cfg.adapts(name):
        return y
    inputs, out = spec.split("->")
    x_spec, w_spec = inputs.split(",")
    contracted = "".join(c for c in w_spec if c in x_spec)
    kept = "".join(c for c in w_spec if c not in x_spec)
    rows = "".join(c for c in x_spec if c not in contracted)
    dims, names = dict(zip(w_spec, w.shape)), dict(zip(w_spec, axes))
    r = cfg.lora_rank
    a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=tuple(range(len(contracted))),
                                              out_axis=-1)
    a = _param(module, f"{name}_lora_a", a_init, tuple(dims[c] for c in contracted) + (r,),
               tuple(names[c] for c in contracted) + ("lora_rank",), jnp.float32)
    b = _param(module, f"{name}_lora_b", nn.initializers.zeros, (r,) + tuple(dims[c] for c in kept),
               ("lora_rank",) + tuple(names[c] for c in kept), jnp.float32)
    dt = cfg.compute_dtype
    low = jnp.einsum(f"{x_spec},{contracted}r->{rows}r", x, a.astype(dt))
    return y + cfg.lora_scale * jnp.einsum(f"{rows}r,r{kept}->{out}", low, b.astype(dt))


class RMSNorm(nn.Module):
    """``variants.rms_norm`` with its scale parameter (ones, or zeros where the scale is 1 + w)."""

    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    offset: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = _param(self, "scale", init, (x.shape[-1],), ("norm",), self.param_dtype)
        return variants.rms_norm(x, scale, self.eps, self.dtype, self.offset)


def norm(cfg: ModelConfig, name: str | None = None) -> RMSNorm:
    """The model's RMS norm (its family's form) named ``name``."""
    return RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.weight_dtype, variants.norm_offset(cfg), name=name)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, positions, masks, cache, layer, cache_index):
        cfg = self.cfg
        dt, pdt = cfg.compute_dtype, cfg.weight_dtype
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = nn.initializers.normal(0.02)

        mask = variants.per_layer(cfg, layer, *masks)
        inv_freq = variants.per_layer(cfg, layer, rope_inv_freq(cfg), rope_inv_freq(cfg, sliding=True))
        scale, cap = cfg.attention_scale, cfg.attn_logit_softcapping

        def output(out):  # the output projection of the heads' outputs [B, T, N, H]
            o_axes = ("heads", "head_dim", "embed")
            wo = _param(self, "o_kernel", init, (n, h, d), o_axes, pdt)
            return adapted(self, "o", "btnh,nhd->btd", out, wo.astype(dt), o_axes)

        if self.has_variable("params", "qkv_kernel"):  # ``fuse_qkv``'s layout: the sampler's weights on a GPU
            w = self.get_variable("params", "qkv_kernel").astype(dt)
            qkv = jnp.einsum("btd,dkgh->btkgh", x, w)  # [B, T, K, G + 2, H]
            if cfg.qk_norm:  # before RoPE, which the fused kernel applies (no bias with q/k norms)
                qkv = jnp.concatenate([norm(cfg, "q_norm")(qkv[:, :, :, :-2]), norm(cfg, "k_norm")(qkv[:, :, :, -2:-1]),
                                       qkv[:, :, :, -1:]], axis=3)
            bias = (self.get_variable("params", "qkv_bias").astype(dt) if cfg.qkv_bias else
                    jnp.zeros(w.shape[1:], dt))
            if cache is not None and isinstance(cache["k"], (list, tuple)) and x.shape[1] == 1 and decode_kernel(cfg):
                out, cache = fused_decode(qkv, bias, positions, inv_freq, mask, scale, cache, layer, cache_index)
                return output(out), cache
            qkv = qkv + bias if cfg.qkv_bias else qkv
            b, t = x.shape[:2]
            q, kk, v = qkv[:, :, :, :-2].reshape(b, t, n, h), qkv[:, :, :, -2], qkv[:, :, :, -1]
        else:
            def proj(name, heads, axes):
                w_axes = ("embed", axes, "head_dim")
                w = _param(self, f"{name}_kernel", init, (d, heads, h), w_axes, pdt)
                y = adapted(self, name, "btd,dnh->btnh", x, w.astype(dt), w_axes)
                if cfg.qkv_bias:
                    y = y + _param(self, f"{name}_bias", nn.initializers.zeros, (heads, h), (axes, "head_dim"),
                                   pdt).astype(dt)
                return y

            q, kk, v = proj("q", n, "heads"), proj("k", k, "kv_heads"), proj("v", k, "kv_heads")
            if cfg.qk_norm:
                q, kk = norm(cfg, "q_norm")(q), norm(cfg, "k_norm")(kk)
        q, kk = apply_rope(q, positions, inv_freq), apply_rope(kk, positions, inv_freq)
        q = nn.with_logical_constraint(q, ("act_batch", "act_length", "act_heads", "head_dim"))
        if cache is not None:
            out, cache = cached_attention(q, kk, v, mask, scale, cache, layer, cache_index, softcap=cap)
        else:
            out = attention(q, kk, v, mask, scale=scale, impl=cfg.attention, softcap=cap)
        return output(out), cache


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
        act = variants.activation(cfg)
        hid = (act(adapted(self, "gate", "btd,df->btf", x, gate.astype(dt), ("embed", "mlp")))
               * adapted(self, "up", "btd,df->btf", x, up.astype(dt), ("embed", "mlp")))
        hid = nn.with_logical_constraint(hid, ("act_batch", "act_length", "act_mlp"))
        return adapted(self, "down", "btf,fd->btd", hid, down.astype(dt), ("mlp", "embed"))


class Block(nn.Module):
    """One layer. Its norms: ``input_norm`` before the attention and ``post_attn_norm`` before the MLP;
    with Gemma's sandwich norms also ``attn_out_norm`` and ``mlp_out_norm`` on the sublayers' outputs."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, carry, layer, positions, masks, cache_index):
        x, cache = carry
        cfg = self.cfg
        sandwich = variants.sandwich_norms(cfg)
        out, cache = Attention(cfg, name="attn")(norm(cfg, "input_norm")(x), positions, masks, cache, layer,
                                                 cache_index)
        x = x + (norm(cfg, "attn_out_norm")(out) if sandwich else out)
        out = MLP(cfg, name="mlp")(norm(cfg, "post_attn_norm")(x))
        x = x + (norm(cfg, "mlp_out_norm")(out) if sandwich else out)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        return (x, cache), None


def attention_mask(kv_mask: Array, q_len: int, cache_index) -> Array:
    """Boolean [B, 1, T, S]: query t (at slot cache_index + t) sees valid slots <= its own, and
    always its own slot, so that a padding query's row is not empty (its output is unused; an
    empty row is what fused kernels may turn into NaN)."""
    s = kv_mask.shape[1]
    q_slot = cache_index + jnp.arange(q_len)[:, None]
    causal = jnp.arange(s)[None, :] <= q_slot  # [T, S]
    own = jnp.arange(s)[None, :] == q_slot
    return (causal[None, None] & kv_mask[:, None, None, :].astype(bool)) | own[None, None]


def segment_mask(segment_ids: Array, prefix_ids: Array | None = None) -> Array:
    """Boolean [B, 1, T, T]: causal attention within packed segments, and from a token whose
    ``prefix_ids`` names a segment (its shared prompt, earlier in the row) to that segment too;
    never to a sibling segment of the same prompt. Padding tokens (segment 0) see themselves
    only, so no softmax row is empty."""
    slot = jnp.arange(segment_ids.shape[1])
    q_seg, k_seg = segment_ids[:, :, None], segment_ids[:, None, :]
    seen = q_seg == k_seg
    if prefix_ids is not None:  # 0 (no shared prefix) matches no key: k_seg > 0 below
        seen = seen | (prefix_ids[:, :, None] == k_seg)
    same = seen & (slot[None, :] <= slot[:, None]) & (k_seg > 0)
    return (same | (slot[None, :] == slot[:, None]))[:, None]


def layer_masks(cfg: ModelConfig, kv_mask: Array | None, q_len: int, cache_index=0, segment_ids=None,
                prefix_ids=None, positions=None) -> tuple[Array, Array | None]:
    """(the global layers' mask, the sliding layers' or None): ``attention_mask`` over a cache's
    slots, or with ``segment_ids`` the packed rows' ``segment_mask``, and that mask narrowed to the
    sliding window (``variants.window``) when the model has sliding layers."""
    size = cfg.sliding_window if any(cfg.sliding_layers) else None
    if segment_ids is not None:
        full = segment_mask(segment_ids, prefix_ids)
        return full, variants.window(full, positions, positions, size)
    full = attention_mask(kv_mask, q_len, cache_index)
    q_slot = (cache_index + jnp.arange(q_len))[None]
    return full, variants.window(full, q_slot, jnp.arange(kv_mask.shape[1])[None], size)


def embed(cfg: ModelConfig, table: Array, tokens: Array) -> Array:
    """The tokens' embeddings in the compute dtype (Gemma: times sqrt(hidden), ``variants.embedding_scale``)."""
    x = jnp.take(table, tokens, axis=0).astype(cfg.compute_dtype)
    scale = variants.embedding_scale(cfg, cfg.compute_dtype)
    return x if scale is None else x * scale


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
            unroll=cfg.num_layers if cfg.unroll_layers else 1,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, name="layers")
        self.final_norm = norm(cfg, "final_norm")
        if not cfg.tie_word_embeddings:
            self.lm_head = self.param(
                "lm_head", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "vocab")),
                (cfg.hidden_size, cfg.vocab_size), cfg.weight_dtype)

    def __call__(self, tokens, positions, kv_mask, cache=None, cache_index=0, segment_ids=None, prefix_ids=None):
        x = embed(self.cfg, self.embedding, tokens)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        masks = layer_masks(self.cfg, kv_mask, tokens.shape[1], cache_index, segment_ids, prefix_ids, positions)
        layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        (x, new_cache), _ = self.layers((x, cache), layers, positions, masks, cache_index)
        return self.final_norm(x), new_cache


def position_ids(attention_mask: Array) -> Array:
    """Positions that skip left padding: cumsum(mask) - 1, clipped at 0 (as HF generate)."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)
