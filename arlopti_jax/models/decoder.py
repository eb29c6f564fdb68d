"""A Flax decoder for the Qwen2 / Qwen2.5 and Llama families.

Pre-norm transformer: RMSNorm -> grouped-query attention with RoPE -> residual ->
RMSNorm -> SwiGLU MLP -> residual. Layers are stacked with ``nn.scan`` (one compiled
layer body, parameters with a leading ``layers`` axis) and optionally rematerialised.

Every parameter carries logical axis names (see ``arlopti_jax.runtime.sharding``) so the
parallel layout is a rule table, not code.

The KV cache is explicit and functional: ``cache = {"k": [L, B, K, S, H], "v": ...}``
(kv heads ahead of slots: each (row, kv head) holds its keys contiguously, and both
attention products read the cache in place with no per-step transposing copy). A call
writes its T tokens at cache slots ``[cache_index, cache_index + T)`` and a query at slot
``cache_index + t`` attends to slots ``<= cache_index + t`` that ``kv_mask`` marks valid.
The whole cache rides in the layer scan's carry and layer i updates only its new slots in
place, so a decode step reads the cache once and writes T slots per layer (a per-layer
cache slice as scan input/output would be copied whole every step). Without a cache, keys
are the call's own tokens and ``kv_mask`` is the attention mask.

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
from arlopti_jax.models import decode_attention, decode_matmul
from arlopti_jax.models.rope import apply_rope, rope_inv_freq
from arlopti_jax.models.config import ModelConfig

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


CACHE_AXES = ("layers", "cache_batch", "kv_heads", "cache_length", "head_dim")


def cached_attention(q: Array, k: Array, v: Array, mask: Array, scale: float, cache: dict, layer: Array,
                     cache_index) -> tuple[Array, dict]:
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
    ``jax.nn.dot_product_attention``. (A GPU's decode steps run ``fused_decode`` instead.)
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
        scores = jnp.where(mask[:, :, None], _scores(qg, read(cache, "k").astype(q.dtype)) * scale, low)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bksh->bkgth", probs, read(cache, "v").astype(v.dtype))
        return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h), cache
    parts = []  # (scores [B, K, G, T, S'] masked, values [B, K, S', H])
    if not (isinstance(cache_index, int) and cache_index == 0 and t == mask.shape[-1]):
        slots = jnp.arange(mask.shape[-1])
        stale = (slots >= index) & (slots < index + t)
        seen = mask & ~stale[None, None, None, :]
        parts.append((jnp.where(seen[:, :, None], _scores(qg, read(cache, "k").astype(q.dtype)) * scale, low),
                      read(cache, "v")))
    seen = jax.lax.dynamic_slice_in_dim(mask, index, t, axis=3)  # [B, 1, T, T]: causal among the call's tokens
    parts.append((jnp.where(seen[:, :, None], _scores(qg, own["k"].astype(q.dtype)) * scale, low), own["v"]))
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
    ``mask`` [B, 1, 1, S] (``attention_mask``) is each row's live run of slots ending at
    ``cache_index``. Per device under the mesh: rows over the batch axes, kv heads over theirs
    where they divide them (the kernel sees one device's arrays)."""
    index = jnp.asarray(cache_index, jnp.int32)
    start = index + 1 - jnp.sum(mask[:, 0, 0, :], axis=-1, dtype=jnp.int32)  # the run's first slot
    kernel = functools.partial(decode_attention.decode_attention, scale=scale,
                               interpret=shd.platform() != "gpu")  # a CPU runs it in Pallas' interpret mode
    args = (qkv[:, 0], bias, positions[:, 0], inv_freq, cache["k"][layer], cache["v"][layer], start, index)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        out, kc, vc = kernel(*args)
    else:
        rows, heads = (nn.logical_to_mesh_axes((name,))[0] for name in ("cache_batch", "kv_heads"))
        names = () if heads is None else heads if isinstance(heads, tuple) else (heads,)
        if qkv.shape[2] % math.prod(mesh.shape[a] for a in names):
            heads = None  # kv heads the axis does not divide: all of them on every device
        P = jax.sharding.PartitionSpec
        buf = P(rows, heads, None, None)
        out, kc, vc = jax.shard_map(kernel, mesh=mesh, check_vma=False, out_specs=(P(rows, heads, None), buf, buf),
                                    in_specs=(buf, P(heads, None, None), P(rows), P(), buf, buf, P(rows), P()))(*args)
    cache = {name: tuple(nn.with_logical_constraint(new, CACHE_AXES[1:]) if i == layer else buf
                         for i, buf in enumerate(cache[name])) for name, new in (("k", kc), ("v", vc))}
    return out[:, None], cache


def decode_kernel(cfg: ModelConfig) -> bool:
    """Whether a decode step over a buffer per layer runs the fused kernel (``fused_decode``):
    ``cfg.decode_attention`` "pallas", or "auto" on a GPU when the kernel takes the model's heads
    (``decode_attention.supported``; see ``ModelConfig``)."""
    if cfg.decode_attention == "auto":
        return shd.platform() == "gpu" and decode_attention.supported(
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
    split = lambda name: any(mesh.shape[a] > 1 for a in _mesh_axes(name)) if not mesh.empty else False
    return decode_kernel(cfg) and not any(split(name) for name in ("embed", "heads", "kv_heads", "mlp", "head_dim"))


def _mesh_axes(logical: str) -> tuple[str, ...]:
    axes = nn.logical_to_mesh_axes((logical,))[0]
    return () if axes is None else axes if isinstance(axes, tuple) else (axes,)


def fused_layer(cfg: ModelConfig, p: dict, x: Array, positions: Array, mask: Array, cache: dict, layer: int,
                cache_index, counters: Array) -> tuple[Array, dict, Array]:
    """``Block`` for one decode step (``fused_layers``) in 6 kernels: the RMS norm and the q, k, v
    product; the attention (``fused_decode``) and its combine; the output product and the residual
    add; the norm, the gate and up products and silu x up; the down product and the residual add
    (``decode_matmul.fused_matmul``). ``p``: the layer's weights in ``fuse_qkv``'s layout, in the
    compute dtype (``Sampler.sampling_params``); x [B, 1, D]; ``counters``: the products' buffer
    (``fused_counters``), threaded from call to call. Returns (x [B, 1, D], cache, counters)."""
    b, d = x.shape[0], cfg.hidden_size
    attn, mlp = p["attn"], p["mlp"]
    dt = cfg.compute_dtype
    k, h = cfg.num_kv_heads, cfg.head_dim
    x = x[:, 0]
    matmul = functools.partial(_fused_matmul, cfg)
    qkv, counters = matmul(x, attn["qkv_kernel"].astype(dt).reshape(d, -1), counters,
                           norm=p["input_norm"]["scale"].astype(dt))
    qkv = qkv.reshape(b, 1, k, -1, h)
    bias = attn["qkv_bias"].astype(dt) if cfg.qkv_bias else jnp.zeros(qkv.shape[2:], dt)
    out, cache = fused_decode(qkv, bias, positions, rope_inv_freq(cfg), mask, 1.0 / math.sqrt(h), cache, layer,
                              cache_index)
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

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return run(x, w, counters, *(operands[n] for n in names))
    P = jax.sharding.PartitionSpec
    batch = nn.logical_to_mesh_axes(("act_batch",))[0]
    rows = P(batch, None)
    specs = {"norm": P(None), "up": P(None, None), "residual": rows}
    return jax.shard_map(run, mesh=mesh, in_specs=(rows, P(None, None), P(batch), *(specs[n] for n in names)),
                         out_specs=(rows, P(batch)), check_vma=False)(x, w, counters, *(operands[n] for n in names))


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


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> dict:
    """An empty KV cache {"k", "v"}: [L, batch, K, length, H] (axes ``CACHE_AXES``)."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)
    dtype = dtype or cfg.compute_dtype
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
