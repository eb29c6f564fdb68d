"""The KV cache and the decode step.

The cache is explicit and functional: ``{"k": [L, B, K, S, H], "v": ...}`` (``CACHE_AXES``: kv heads
ahead of slots, so each (row, kv head) holds its keys contiguously and both attention products read
the cache in place with no per-step transposing copy), or, in the sampler on a GPU, a tuple of L
buffers [B, K, S, H] each. A call writes its T tokens at slots ``[cache_index, cache_index + T)``;
a query at slot ``cache_index + t`` attends to the slots ``<= cache_index + t`` that its mask
marks valid.

- ``cached_attention``: XLA's attention over the cache, every backend.
- On a GPU a decode step (one token per row) runs fused kernels instead: ``fused_decode``
  (``decode_attention``: RoPE, the cache write and the attention in one kernel per layer) over
  the sampler's weights in ``fuse_qkv``'s layout, and, with ``model.decode_matmul=pallas``,
  ``fused_layer`` (the layer's four products with their norms, silu x up and residual adds,
  ``decode_matmul``). ``decode_kernel`` and ``fused_layers`` say when each applies.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import decode_attention, decode_matmul, variants
from arlopti_jax.models.rope import rope_inv_freq
from arlopti_jax.models.config import ModelConfig

Array = jax.Array
P = jax.sharding.PartitionSpec


CACHE_AXES = ("layers", "cache_batch", "kv_heads", "cache_length", "head_dim")


def cached_attention(q: Array, k: Array, v: Array, mask: Array, scale: float, cache: dict, layer: Array,
                     cache_index, softcap: float | None = None) -> tuple[Array, dict]:
    """Attend q [B, T, N, H] over layer ``layer`` of ``cache`` ({"k", "v"}: [L, B, K, S, H], or L
    buffers [B, K, S, H] each with a Python int ``layer``) and over this call's own keys and values
    k, v [B, T, K, H], which go to slots [cache_index, cache_index + T), under the boolean
    ``mask`` [B, 1, T, S]; then write k and v there. Returns ([B, T, N, H], cache).

    On a TPU a stacked cache is read before it is written: the scores against the cache leave
    out this call's slots (stale until the write), those against its own keys come from k
    directly, and one softmax spans both. A loop carrying the stacked cache then updates it in
    place (read after write, XLA:TPU kept a second copy of the whole cache as a temporary). A
    prefill that fills the whole cache reads none of it. Elsewhere the keys and values are
    written first and the layer's slots read whole: on a GPU (a buffer per layer) the split
    costs more traffic than it saves, and XLA:CPU runs the split 2.4x slower (a sampler whose
    rows decode up to 512 tokens: 14.2 s against 5.8 s per rollout). Both products batch over
    (row, kv head) and read the cache in its own layout, each kv head's [S, H] block contiguous,
    with the G query heads sharing it side by side. Scores and softmax are float32, as in
    ``jax.nn.dot_product_attention``; ``softcap`` caps the scaled scores (``variants.softcap``).
    (A GPU's decode steps run ``fused_decode`` instead, where it applies.)
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    zero = jnp.zeros((), jnp.int32)
    index = jnp.asarray(cache_index, jnp.int32)
    listed = isinstance(cache["k"], (list, tuple))  # a buffer per layer (accelerators' sampler): an int layer
    own = {name: new.transpose(0, 2, 1, 3).astype((cache[name][0] if listed else cache[name]).dtype)
           for name, new in (("k", k), ("v", v))}  # [B, K, T, H], as the cache will hold them
    qg = q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    low = jnp.finfo(jnp.float32).min
    scores_of = lambda keys: variants.softcap(_scores(qg, keys.astype(q.dtype)) * scale, softcap)

    def write(cache):  # this call's keys and values into their slots of the layer
        if listed:
            return {name: tuple(nn.with_logical_constraint(jax.lax.dynamic_update_slice(
                buf, own[name], (zero, zero, index, zero)), CACHE_AXES[1:]) if i == layer else buf
                for i, buf in enumerate(cache[name])) for name in "kv"}
        return {name: nn.with_logical_constraint(jax.lax.dynamic_update_slice(
            cache[name], own[name][None], (layer, zero, zero, index, zero)), CACHE_AXES) for name in "kv"}

    def read(cache, name):  # the layer's [B, K, S, H] slots
        return cache[name][layer] if listed else jax.lax.dynamic_index_in_dim(cache[name], layer, 0, keepdims=False)

    if listed or not read_before_write():  # written first, then the layer's slots read whole
        cache = write(cache)
        scores = jnp.where(mask[:, :, None], scores_of(read(cache, "k")), low)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bksh->bkgth", probs, read(cache, "v").astype(v.dtype))
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h), cache
    parts = []  # (scores [B, K, G, T, S'] masked, values [B, K, S', H])
    if not (isinstance(cache_index, int) and cache_index == 0 and t == mask.shape[-1]):
        slots = jnp.arange(mask.shape[-1])
        stale = (slots >= index) & (slots < index + t)
        seen = mask & ~stale[None, None, None, :]
        parts.append((jnp.where(seen[:, :, None], scores_of(read(cache, "k")), low), read(cache, "v")))
    seen = jax.lax.dynamic_slice_in_dim(mask, index, t, axis=3)  # [B, 1, T, T]: causal among the call's tokens
    parts.append((jnp.where(seen[:, :, None], scores_of(own["k"]), low), own["v"]))
    top = functools.reduce(jnp.maximum, [s.max(axis=-1, keepdims=True) for s, _ in parts])
    weights = [jnp.exp(s - top) for s, _ in parts]
    total = sum(w.sum(axis=-1, keepdims=True) for w in weights)
    out = sum(jnp.einsum("bkgts,bksh->bkgth", (w / total).astype(v.dtype), x.astype(v.dtype))
              for w, (_, x) in zip(weights, parts))
    cache = write(cache)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h), cache


QKV_NAMES = ("q_kernel", "k_kernel", "v_kernel", "q_bias", "k_bias", "v_bias")  # what ``fuse_qkv`` replaces
QKV_AXES = ("embed", "kv_heads", None, "head_dim")  # ``fuse_qkv``'s weight; its bias drops "embed"


def fuse_qkv(cfg: ModelConfig, attn: dict) -> dict:
    """A layer's attention weights with q, k and v as one projection grouped by kv head: ``qkv_kernel``
    [D, K, G + 2, H] (kv head j's G query heads, then its key, then its value) and ``qkv_bias``
    [K, G + 2, H]. The sampler's own weights on a GPU hold this (``Sampler.sampling_params``): the
    decode step then makes one product, and the fused kernel reads each kv head's group as one block,
    sharded over kv heads like the cache. ``Attention`` takes either layout."""
    d, k, h = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // k
    out = {name: w for name, w in attn.items() if name not in QKV_NAMES}
    out["qkv_kernel"] = jnp.concatenate([attn["q_kernel"].reshape(d, k, g, h), attn["k_kernel"][:, :, None],
                                         attn["v_kernel"][:, :, None]], axis=2)
    if cfg.qkv_bias:
        out["qkv_bias"] = jnp.concatenate([attn["q_bias"].reshape(k, g, h), attn["k_bias"][:, None],
                                           attn["v_bias"][:, None]], axis=1)
    return out


def fused_decode(qkv: Array, bias: Array, positions: Array, inv_freq: Array, mask: Array, scale: float, cache: dict,
                 layer: int, cache_index) -> tuple[Array, dict]:
    """A decode step's attention (one token per row) over layer ``layer``'s own cache buffers, by
    ``decode_attention.decode_attention``: qkv [B, 1, K, G + 2, H] (``fuse_qkv``'s layout) before
    ``bias`` and RoPE, which the kernel adds. Returns ([B, 1, N, H], cache), as ``cached_attention``.
    ``mask`` [B, 1, 1, S] (``attention_mask``, or its sliding-window narrowing at a sliding layer) is
    each row's live run of slots ending at ``cache_index``: a window only moves the run's start. Per
    device under the mesh: rows over the batch axes, kv heads over theirs where they divide them (the
    kernel sees one device's arrays)."""
    index = jnp.asarray(cache_index, jnp.int32)
    start = index + 1 - jnp.sum(mask[:, 0, 0, :], axis=-1, dtype=jnp.int32)  # the run's first slot
    kernel = functools.partial(decode_attention.decode_attention, scale=scale,
                               interpret=shd.platform() != "gpu")  # a CPU runs it in Pallas' interpret mode
    args = (qkv[:, 0], bias, positions[:, 0], inv_freq, cache["k"][layer], cache["v"][layer], start, index)

    def specs(mesh):
        rows, heads = _mesh_axes("cache_batch"), _mesh_axes("kv_heads")
        if qkv.shape[2] % math.prod(mesh.shape[a] for a in heads):
            heads = ()  # kv heads the axis does not divide: all of them on every device
        buf = P(rows, heads, None, None)
        return (buf, P(heads, None, None), P(rows), P(), buf, buf, P(rows), P()), (P(rows, heads, None), buf, buf)

    out, kc, vc = _per_device(kernel, args, specs)
    cache = {name: tuple(nn.with_logical_constraint(new, CACHE_AXES[1:]) if i == layer else buf
                         for i, buf in enumerate(cache[name])) for name, new in (("k", kc), ("v", vc))}
    return out[:, None], cache


def decode_kernel(cfg: ModelConfig) -> bool:
    """Whether a decode step over a buffer per layer runs the fused kernel (``fused_decode``):
    ``cfg.decode_attention`` "pallas", or "auto" on a GPU when the kernel takes the model's heads
    (``decode_attention.supported``; see ``ModelConfig``) and the model does not soft-cap its
    attention scores (which the kernel does not do: ``ModelConfig.fallbacks``)."""
    if cfg.decode_attention == "auto":
        return shd.platform() == "gpu" and not cfg.attn_logit_softcapping and decode_attention.supported(
            cfg.num_heads // cfg.num_kv_heads, cfg.head_dim) is None
    return cfg.decode_attention == "pallas"


def fused_layers(cfg: ModelConfig, length: int, cache: dict | None) -> bool:
    """Whether a call's layers run as ``fused_layer``: ``cfg.decode_matmul`` "pallas", a decode step
    (``length`` 1) over a buffer per layer that runs the attention kernel (``decode_kernel``), and
    no weight split over a mesh axis of more than one device (the kernels take whole weights; a
    split product's partial sums would need an all-reduce before the residual add)."""
    if cfg.decode_matmul != "pallas" or length != 1 or cache is None or not isinstance(cache["k"], (list, tuple)):
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return decode_kernel(cfg) and not (split_weight_axes(dict(mesh.shape)) if not mesh.empty else [])


def split_weight_axes(mesh_shape: dict) -> list[str]:
    """The weights' logical axes that the current logical rules split over a mesh axis of more than
    one device (``mesh_shape``: axis name -> size): where there are any, ``fused_layers`` is off."""
    return [name for name in ("embed", "heads", "kv_heads", "mlp", "head_dim")
            if any(mesh_shape.get(a, 1) > 1 for a in _mesh_axes(name))]


def _mesh_axes(logical: str) -> tuple[str, ...]:
    axes = nn.logical_to_mesh_axes((logical,))[0]
    return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def fused_layer(cfg: ModelConfig, p: dict, x: Array, positions: Array, masks: tuple, cache: dict, layer: int,
                cache_index, counters: Array) -> tuple[Array, dict, Array]:
    """``Block`` for one decode step (``fused_layers``) in 6 kernels: the RMS norm and the q, k, v
    product; the attention (``fused_decode``) and its combine; the output product and the residual
    add; the norm, the gate and up products and silu x up; the down product and the residual add
    (``decode_matmul.fused_matmul``); Qwen3's q/k norms between the first two, in XLA (Gemma 3 is
    refused by ``ModelConfig``). ``p``: the layer's weights in ``fuse_qkv``'s layout, in the
    compute dtype (``Sampler.sampling_params``); x [B, 1, D]; ``masks``: ``decoder.layer_masks``';
    ``counters``: the products' buffer (``fused_counters``), threaded from call to call. Returns
    (x [B, 1, D], cache, counters)."""
    b, d = x.shape[0], cfg.hidden_size
    attn, mlp = p["attn"], p["mlp"]
    dt = cfg.compute_dtype
    k, h = cfg.num_kv_heads, cfg.head_dim
    x = x[:, 0]
    matmul = functools.partial(_fused_matmul, cfg)
    qkv, counters = matmul(x, attn["qkv_kernel"].astype(dt).reshape(d, -1), counters,
                           norm=p["input_norm"]["scale"].astype(dt))
    qkv = qkv.reshape(b, 1, k, -1, h)
    if cfg.qk_norm:
        qk_norm = lambda x, name: variants.rms_norm(x, attn[name]["scale"], cfg.rms_norm_eps, dt,
                                                    variants.norm_offset(cfg))
        qkv = jnp.concatenate([qk_norm(qkv[:, :, :, :-2], "q_norm"), qk_norm(qkv[:, :, :, -2:-1], "k_norm"),
                               qkv[:, :, :, -1:]], axis=3)
    bias = attn["qkv_bias"].astype(dt) if cfg.qkv_bias else jnp.zeros(qkv.shape[2:], dt)
    inv_freq = variants.per_layer(cfg, layer, rope_inv_freq(cfg), rope_inv_freq(cfg, sliding=True))
    out, cache = fused_decode(qkv, bias, positions, inv_freq, variants.per_layer(cfg, layer, *masks),
                              cfg.attention_scale, cache, layer, cache_index)
    x, counters = matmul(out.reshape(b, -1), attn["o_kernel"].astype(dt).reshape(-1, d), counters, residual=x)
    hid, counters = matmul(x, mlp["gate_kernel"].astype(dt), counters, norm=p["post_attn_norm"]["scale"].astype(dt),
                           up=mlp["up_kernel"].astype(dt))
    x, counters = matmul(hid, mlp["down_kernel"].astype(dt), counters, residual=x)
    return nn.with_logical_constraint(x[:, None], ("act_batch", "act_length", "act_embed")), cache, counters


def fused_counters(cfg: ModelConfig, rows: int) -> Array:
    """The zeroed counters ``fused_layer``'s products share (``decode_matmul.fused_matmul``): one
    buffer per device, enough for ``rows`` rows of any of the layer's products."""
    q = cfg.num_kv_heads * (cfg.num_heads // cfg.num_kv_heads + 2) * cfg.head_dim
    n = decode_matmul.counters_for(rows, (q, cfg.hidden_size, cfg.intermediate_size))
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else math.prod(mesh.shape[a] for a in _mesh_axes("act_batch"))
    return nn.with_logical_constraint(jnp.zeros((devices * n,), jnp.int32), ("act_batch",))


def _fused_matmul(cfg: ModelConfig, x: Array, w: Array, counters: Array, **operands) -> tuple[Array, Array]:
    """``decode_matmul.fused_matmul`` on each device's rows (the batch axes), whole weights on each,
    and the device's own counters."""
    names = sorted(operands)

    def run(x, w, counters, *rest):
        return decode_matmul.fused_matmul(x, w, **dict(zip(names, rest)), counters=counters, eps=cfg.rms_norm_eps,
                                          interpret=shd.platform() != "gpu")  # a CPU: Pallas' interpret mode

    def specs(mesh):
        batch = _mesh_axes("act_batch")
        rows = P(batch, None)
        operand = {"norm": P(None), "up": P(None, None), "residual": rows}
        return (rows, P(None, None), P(batch), *(operand[n] for n in names)), (rows, P(batch))

    return _per_device(run, (x, w, counters, *(operands[n] for n in names)), specs)


def _per_device(fn, args: tuple, specs):
    """``fn(*args)`` on each device's share of the mesh in context, by ``shard_map`` with the
    (in_specs, out_specs) that ``specs(mesh)`` returns; on one device (or none), ``fn(*args)``.
    The kernels inside see one device's arrays."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(*args)
    in_specs, out_specs = specs(mesh)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def read_before_write() -> bool:
    """Whether ``cached_attention`` reads a stacked cache before writing the call's own slots
    (on a TPU: see there)."""
    return shd.platform() == "tpu"


def _scores(qg: Array, keys: Array) -> Array:
    """float32 [B, K, G, T, S] of queries [B, K, G, T, H] against keys [B, K, S, H]."""
    if shd.platform() == "cpu":
        # keys as the left operand, [S, H] x [H, G*T]: XLA:CPU's matmul repacks a transposed
        # right operand, and [G*T, H] x [S, H]^T read the keys at a third of the speed of the
        # values product (a decode step over 1088 slots: 15 ms of 26). The barrier keeps XLA
        # from swapping the operands back.
        return jax.lax.optimization_barrier(
            jnp.einsum("bksh,bkgth->bksgt", keys, qg, preferred_element_type=jnp.float32)).transpose(0, 1, 3, 4, 2)
    return jnp.einsum("bkgth,bksh->bkgts", qg, keys, preferred_element_type=jnp.float32)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> dict:
    """An empty KV cache {"k", "v"}: [L, batch, K, length, H] (axes ``CACHE_AXES``)."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
    dtype = dtype or cfg.compute_dtype
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
