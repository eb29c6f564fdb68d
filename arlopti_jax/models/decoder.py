"""A Flax decoder for the Qwen2 / Qwen2.5 and Llama families.

Pre-norm transformer: RMSNorm -> grouped-query attention with RoPE -> residual ->
RMSNorm -> SwiGLU MLP -> residual. Layers are stacked with ``nn.scan`` (one compiled
layer body, parameters with a leading ``layers`` axis) and optionally rematerialised.

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
segment, and its positions continue from the prefix's length; one [B, 1, T, T] mask either way.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from arlopti_jax.runtime import sharding as shd
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


def attention(q: Array, k: Array, v: Array, mask: Array, scale: float, impl: str = "auto") -> Array:
    """Causal grouped-query attention over a call's own tokens: q [B, T, N, H], k and v
    [B, T, K, H], boolean mask [B, 1, T, T] that lets no query see a later slot and leaves no
    row empty (``attention_mask`` and ``segment_mask`` guarantee both).
    ``impl`` "cudnn" (what "auto" picks on a GPU at 16-bit): ``jax.nn.dot_product_attention``'s
    cuDNN fused kernel, which never holds the [T, S] scores (on an H100, 1.5B's heads over 4 packed
    rows of 4,096 tokens: forward + backward 5.4 ms against 23 ms, docs/measurements/journal.md). "xla": its
    XLA lowering on a GPU; on CPUs and TPUs ``_causal_blocks`` computes the same math without the
    scores above the diagonal (XLA:TPU's estimate of a 3B layer at 4,544 tokens: 27.0 ms
    against 34.5 ms for the whole [T, T] scores, docs/measurements/journal.md)."""
    backend = shd.platform()
    if impl == "auto":
        impl = "cudnn" if backend == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) else "xla"
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")
    if backend == "gpu":
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
    return _causal_blocks(q, k, v, mask, scale)


def _causal_blocks(q: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
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
    return _blocks(qh, k, v, mask, scale).reshape(b, n, t, h).transpose(0, 2, 1, 3)


def _edges(t: int) -> list[int]:
    blocks = max(1, min(t // 256, 8))
    return [round(t * i / blocks) for i in range(blocks + 1)]


def _block_scores(qh: Array, k: Array, mask: Array, scale: float, lo: int, hi: int) -> Array:
    """float32 [B, K, G, hi - lo, hi]: queries lo:hi against keys :hi, scaled, masked out to the
    float32 minimum."""
    scores = jnp.einsum("bkgth,bskh->bkgts", qh[:, :, :, lo:hi], k[:, :hi], preferred_element_type=jnp.float32)
    return jnp.where(mask[:, :, None, lo:hi, :hi], scores * scale, jnp.finfo(jnp.float32).min)


def _blocks_forward(qh: Array, k: Array, v: Array, mask: Array, scale: float):
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
        top = _block_scores(qh, k, mask, scale, lo, hi).max(axis=-1, keepdims=True)
        weights = jnp.exp(_block_scores(again, k, mask, scale, lo, hi) - top)
        total = weights.sum(axis=-1, keepdims=True)
        out = jnp.einsum("bkgts,bskh->bkgth", weights.astype(v.dtype), v[:, :hi], preferred_element_type=jnp.float32)
        outs.append((out / total).astype(v.dtype))
        lses.append(top + jnp.log(total))
    out = jnp.concatenate(outs, axis=3)
    return out, (qh, k, v, mask, out, jnp.concatenate(lses, axis=3))


def _blocks_backward(scale: float, residuals, grad: Array):
    """With p = softmax(s): dv = p^T g, ds = p * (g v^T - rowsum(g * out)), dq = ds k * scale,
    dk = ds^T q * scale; p recomputed from the saved log-sum-exp."""
    qh, k, v, mask, out, lse = residuals
    f32 = jnp.float32
    delta = jnp.sum(grad.astype(f32) * out.astype(f32), axis=-1, keepdims=True)
    dq, dk, dv = [], jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    edges = _edges(qh.shape[3])
    for lo, hi in zip(edges, edges[1:]):
        probs = jnp.exp(_block_scores(qh, k, mask, scale, lo, hi) - lse[:, :, :, lo:hi])
        g = grad[:, :, :, lo:hi]
        dprobs = jnp.einsum("bkgth,bskh->bkgts", g, v[:, :hi], preferred_element_type=f32)
        dscores = (probs * (dprobs - delta[:, :, :, lo:hi]) * scale).astype(qh.dtype)
        dq.append(jnp.einsum("bkgts,bskh->bkgth", dscores, k[:, :hi], preferred_element_type=f32).astype(qh.dtype))
        dk = dk.at[:, :hi].add(jnp.einsum("bkgts,bkgth->bskh", dscores, qh[:, :, :, lo:hi], preferred_element_type=f32))
        dv = dv.at[:, :hi].add(jnp.einsum("bkgts,bkgth->bskh", probs.astype(v.dtype), g, preferred_element_type=f32))
    return jnp.concatenate(dq, axis=3), dk.astype(k.dtype), dv.astype(v.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocks(qh: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
    return _blocks_forward(qh, k, v, mask, scale)[0]


_blocks.defvjp(_blocks_forward, _blocks_backward)


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

        inv_freq = rope_inv_freq(cfg)
        scale = 1.0 / math.sqrt(h)

        def output(out):  # the output projection of the heads' outputs [B, T, N, H]
            o_axes = ("heads", "head_dim", "embed")
            wo = _param(self, "o_kernel", init, (n, h, d), o_axes, pdt)
            return adapted(self, "o", "btnh,nhd->btd", out, wo.astype(dt), o_axes)

        if self.has_variable("params", "qkv_kernel"):  # ``fuse_qkv``'s layout: the sampler's weights on a GPU
            w = self.get_variable("params", "qkv_kernel").astype(dt)
            qkv = jnp.einsum("btd,dkgh->btkgh", x, w)  # [B, T, K, G + 2, H]
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
        q, kk = apply_rope(q, positions, inv_freq), apply_rope(kk, positions, inv_freq)
        q = nn.with_logical_constraint(q, ("act_batch", "act_length", "act_heads", "head_dim"))
        if cache is not None:
            out, cache = cached_attention(q, kk, v, mask, scale, cache, layer, cache_index)
        else:
            out = attention(q, kk, v, mask, scale=scale, impl=cfg.attention)
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
        hid = (jax.nn.silu(adapted(self, "gate", "btd,df->btf", x, gate.astype(dt), ("embed", "mlp")))
               * adapted(self, "up", "btd,df->btf", x, up.astype(dt), ("embed", "mlp")))
        hid = nn.with_logical_constraint(hid, ("act_batch", "act_length", "act_mlp"))
        return adapted(self, "down", "btf,fd->btd", hid, down.astype(dt), ("mlp", "embed"))


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
        self.final_norm = RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.weight_dtype, name="final_norm")
        if not cfg.tie_word_embeddings:
            self.lm_head = self.param(
                "lm_head", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "vocab")),
                (cfg.hidden_size, cfg.vocab_size), cfg.weight_dtype)

    def __call__(self, tokens, positions, kv_mask, cache=None, cache_index=0, segment_ids=None, prefix_ids=None):
        x = jnp.take(self.embedding, tokens, axis=0).astype(self.cfg.compute_dtype)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        if segment_ids is not None:
            mask = segment_mask(segment_ids, prefix_ids)
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
