"""Decode attention on a GPU: one Pallas (Triton) kernel per layer that takes the step's q, k and v
projections, adds their biases, applies RoPE, writes the new key and value into the layer's KV cache
and attends over each row's live slots only.

The sampler's decode step on a GPU holds a KV cache buffer per layer, ``[B, K, S, H]`` (rows, kv
heads, slots, head dim; ``rollout/programs.per_layer_cache``). A row's live slots are one run
``[start, pos]``: its left-padded prompt from ``start``, then the response tokens, ending at slot
``pos``, this step's token, whose key and value arrive with the call. XLA ran this as about ten
kernels per layer (the RoPE'd key and value each written into the cache, the scores as a batched
matrix product over every slot, the softmax, the values' product). Here one kernel does it:

- the projections arrive grouped by kv head (``decode.fuse_qkv``): kv head h's G = N / K query
  heads, then its key, then its value, one block of ``BLOCK_G`` rows (so G <= ``BLOCK_G`` - 2);
- grid (B, K, splits): program (b, h, s) takes the G query heads that share kv head h (padded to
  16 rows for the tensor cores) and the slots of split s, in blocks of ``block_k``
  slots from the first block that holds a live slot to the last one before ``pos``: slots before
  a row's prompt and after this step's token are never read;
- an online softmax over the blocks in float32 (scores and the running maximum and sum), the
  probabilities cast to the values' dtype for their product, as ``decode.cached_attention``
  does;
- the last split also scores this step's own key and value from the call's arrays (never from the
  cache: the slot is written by the same kernel, so no program reads it) and writes them into
  slot ``pos`` of the cache buffers, which are aliased to the outputs (updated in place);
- with one split the kernel writes the normalised output; with several it writes each split's
  unnormalised output, maximum and sum, and ``decode_attention`` combines them (one fusion).

Splits exist for parallelism: 64 rows x 2 kv heads is 128 programs for a GPU's 132
multiprocessors, too few to keep its memory busy, so the slots are split until there are about
``PROGRAMS`` programs (``splits_for``).

Why Pallas on Triton: cuDNN's fused attention (``jax.nn.dot_product_attention``) takes sequence
lengths (a live run that starts at slot 0) and the [B, S, K, H] layout, not a left-padded
prompt's start; ``jax.experimental.pallas.ops.gpu.decode_attention`` wants [B, S, K, H] too, does
not write the cache, and is deprecated. JAX 0.11 deprecates Pallas' Triton backend in favour of
Mosaic GPU; this kernel runs on JAX 0.10 and 0.11 (``docs/reference/performance.md``).

On a CPU the same kernel runs in Pallas' interpret mode (tests; slow), so its arithmetic is
tested against the XLA attention without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # deprecated since JAX 0.11 for Mosaic GPU: a JAX without it decodes with XLA's attention ("auto")
    from jax.experimental.pallas import triton as pltriton
except ImportError:
    pltriton = None

from arlopti_jax.models.rope import apply_rope

Array = jax.Array

PROGRAMS = 512  # programs to aim for: about four per multiprocessor of an H100 or H200 (132)
BLOCK_G = 16  # query rows per program: the smallest tile of a Triton dot
# slots per block: on an H200, one 1.5B layer at 64 rows x 1,536 slots took 42.4 us with 128, 47.6 with 64 and 50.2
# with 32 (XLA's attention: 55.6; docs/measurements/gpu_2026-11-27c)
BLOCK_K = 128
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score: exp(_NEG - m) == 0 for any real maximum m


def supported(groups: int, head_dim: int) -> str | None:
    """Why the kernel cannot take these heads (None: it can): a kv head's query heads, key and value
    in one block (at most ``BLOCK_G`` - 2 query heads per kv head), and, compiled, half a head a power
    of two of at least 16 (a Triton product's smallest side)."""
    half = head_dim // 2
    if pltriton is None:
        return f"jax {jax.__version__} has no Pallas Triton backend"
    if not 1 <= groups <= BLOCK_G - 2:
        return f"{groups} query heads per kv head (the kernel takes 1 to {BLOCK_G - 2})"
    if head_dim % 2 or half < 16 or half & (half - 1):
        return f"head_dim {head_dim} (the kernel takes twice a power of two, at least 32)"
    return None


def splits_for(rows: int, kv_heads: int, slots: int, block_k: int) -> int:
    """Splits of the slots: enough for about ``PROGRAMS`` programs, at most one per block."""
    return max(1, min(-(-PROGRAMS // (rows * kv_heads)), -(-slots // block_k)))


def _kernel(start_ref, pos_ref, position_ref, freq_ref, qkv_ref, bias_ref, kc_ref, vc_ref, *outs, scale: float,
            groups: int, block_k: int, chunk: int, splits: int):
    """Program (b, h, s): query heads [BLOCK_G, H] of kv head h over slots [s * chunk, (s + 1) * chunk)
    of row b's live run, and in the last split this step's own key and value (written to the cache).
    Head vectors are handled as two halves (RoPE rotates one into the other): a score is the sum of
    the halves' products."""
    o_ref, m_ref, l_ref, kc_out, vc_out = outs if splits > 1 else (outs[0], None, None, *outs[1:])
    s = pl.program_id(2)
    start, pos = start_ref[()], pos_ref[()]
    h = kc_ref.shape[-1]
    half = h // 2
    halves = (pl.ds(0, half), pl.ds(half, half))
    heads = jnp.arange(BLOCK_G) < groups
    rows = pl.ds(0, BLOCK_G)
    dtype = kc_ref.dtype

    # RoPE of this row's position: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), in float32 as
    # ``rope.apply_rope``, after the bias is added in the model's dtype
    angle = position_ref[()].astype(jnp.float32) * freq_ref[...]  # [H / 2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)

    def rope(x1, x2):
        x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        return (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)

    def query(part):  # the G query heads' half, [BLOCK_G, H / 2] (rows >= G zero)
        load = lambda ref: pltriton.load(ref.at[rows, part], mask=heads[:, None], other=0.0)
        return load(qkv_ref) + load(bias_ref)

    q1, q2 = rope(query(halves[0]), query(halves[1]))
    k1, k2 = rope(*(qkv_ref[groups, part] + bias_ref[groups, part] for part in halves))  # this step's key
    vn = qkv_ref[groups + 1, :] + bias_ref[groups + 1, :]  # this step's value, [H]
    lo = jnp.maximum(start, s * chunk)
    hi = jnp.minimum(pos, (s + 1) * chunk)  # the cache's live slots of this split: [lo, hi)

    def block(j, carry):
        m, l, acc = carry
        slots = j * block_k + jnp.arange(block_k)
        live = (slots >= lo) & (slots < hi)
        at = pl.ds(j * block_k, block_k)
        key = lambda part: pltriton.load(kc_ref.at[at, part], mask=live[:, None], other=0.0)
        scores = (jnp.dot(q1, key(halves[0]).T, preferred_element_type=jnp.float32)
                  + jnp.dot(q2, key(halves[1]).T, preferred_element_type=jnp.float32)) * scale  # [BLOCK_G, block_k]
        scores = jnp.where(live[None, :], scores, _NEG)
        top = jnp.maximum(m, scores.max(axis=1))
        fade = jnp.exp(m - top)
        p = jnp.exp(scores - top[:, None])
        v = pltriton.load(vc_ref.at[at, :], mask=live[:, None], other=0.0)
        acc = acc * fade[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return top, l * fade + p.sum(axis=1), acc

    init = (jnp.full((BLOCK_G,), _NEG, jnp.float32), jnp.zeros((BLOCK_G,), jnp.float32),
            jnp.zeros((BLOCK_G, h), jnp.float32))
    # every block in [lo // block_k, ceil(hi / block_k)) holds a live slot, so its maximum is a real score
    m, l, acc = jax.lax.fori_loop(lo // block_k, jnp.where(lo < hi, -(-hi // block_k), 0), block, init)

    # this step's own key and value, in the last split: scored from registers, then written to the cache
    last = s == splits - 1
    dot = lambda a, b: jnp.sum(a.astype(jnp.float32) * b.astype(jnp.float32)[None, :], axis=1)
    own = (dot(q1, k1) + dot(q2, k2)) * scale
    top = jnp.where(last, jnp.maximum(m, own), m)
    fade = jnp.exp(m - top)
    p = jnp.where(last, jnp.exp(own - top), 0.0)
    l = l * fade + p
    acc = acc * fade[:, None] + p.astype(dtype).astype(jnp.float32)[:, None] * vn.astype(jnp.float32)[None, :]
    slot = pl.ds(pos, 1)
    for ref, part, value in ((kc_out, halves[0], k1), (kc_out, halves[1], k2), (vc_out, slice(None), vn)):
        pltriton.store(ref.at[slot, part], value[None, :], mask=jnp.full((1, value.shape[0]), last))

    if splits == 1:
        pltriton.store(o_ref.at[rows, :], (acc / l[:, None]).astype(o_ref.dtype), mask=heads[:, None])
    else:
        pltriton.store(o_ref.at[rows, :], acc, mask=heads[:, None])
        pltriton.store(m_ref.at[rows], top, mask=heads)
        pltriton.store(l_ref.at[rows], l, mask=heads)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "splits", "num_warps", "num_stages", "interpret"),
                   donate_argnames=("k_cache", "v_cache"))
def decode_attention(qkv: Array, bias: Array, positions: Array, inv_freq: Array, k_cache: Array, v_cache: Array,
                     start: Array, pos: Array, *, scale: float, block_k: int = BLOCK_K, splits: int = 0,
                     num_warps: int = 4, num_stages: int = 2, interpret: bool = False) -> tuple[Array, Array, Array]:
    """One decode step's attention for one layer, on one device's rows.

    qkv [B, K, G + 2, H]: this step's projections grouped by kv head (its G query heads, then its key
    and its value; ``decode.fuse_qkv``), before ``bias`` [K, G + 2, H] and RoPE (at ``positions``
    [B] int32 with frequencies ``inv_freq`` [H / 2], ``rope.rope_inv_freq``), which the kernel
    adds; k_cache, v_cache [B, K, S, H], the layer's buffers (donated: updated in place); start [B]
    int32, each row's first live slot; pos int32 scalar, this step's slot (every row's). Row b
    attends to slots [start[b], pos), read from the cache, and to its own key and value at pos.
    ``splits`` 0: ``splits_for``. Returns (out [B, K * G, H] in the cache's dtype, k_cache, v_cache)
    with the new key and value at slot pos.
    """
    b, kv, width, h = qkv.shape
    s = k_cache.shape[2]
    groups = width - 2
    why = supported(groups, h)
    if why and not (interpret and supported(groups, 32) is None and h % 2 == 0):  # interpret: any even head_dim
        raise ValueError(f"decode_attention: {why}; use model.decode_attention=xla")
    splits = splits or splits_for(b, kv, s, block_k)
    chunk = -(-s // (splits * block_k)) * block_k  # slots per split, whole blocks
    splits = -(-s // chunk)
    dtype = k_cache.dtype
    per_row = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (b,))
    row = lambda *rest: pl.BlockSpec((None,) + rest, lambda i, j, k: (i,) + (0,) * len(rest))
    head = lambda *rest: pl.BlockSpec((None, None) + rest, lambda i, j, k: (i, j) + (0,) * len(rest))
    split = lambda *rest: pl.BlockSpec((None, None, None) + rest, lambda i, j, k: (i, j, k) + (0,) * len(rest))
    cache = head(s, h)
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((b, kv, groups, h), dtype)]
        out_specs = [head(BLOCK_G, h)]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, kv, splits, groups, h), jnp.float32),
                     jax.ShapeDtypeStruct((b, kv, splits, groups), jnp.float32),
                     jax.ShapeDtypeStruct((b, kv, splits, groups), jnp.float32)]
        out_specs = [split(BLOCK_G, h), split(BLOCK_G), split(BLOCK_G)]
    outs = len(out_shape)
    result = pl.pallas_call(
        functools.partial(_kernel, scale=scale, groups=groups, block_k=block_k, chunk=chunk, splits=splits),
        grid=(b, kv, splits),
        in_specs=[row(), row(), row(), pl.BlockSpec((h // 2,), lambda i, j, k: (0,)), head(BLOCK_G, h),
                  pl.BlockSpec((None, BLOCK_G, h), lambda i, j, k: (j, 0, 0)), cache, cache],
        out_specs=out_specs + [cache, cache],
        out_shape=out_shape + [jax.ShapeDtypeStruct(k_cache.shape, dtype), jax.ShapeDtypeStruct(v_cache.shape, dtype)],
        input_output_aliases={6: outs, 7: outs + 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention",
    )(per_row(start), per_row(pos), per_row(positions), inv_freq.astype(jnp.float32), qkv.astype(dtype),
      bias.astype(dtype), k_cache, v_cache)
    if splits == 1:
        out, k_cache, v_cache = result
    else:
        acc, m, l, k_cache, v_cache = result
        weight = jnp.exp(m - m.max(axis=2, keepdims=True))  # [B, K, splits, G]: a split with no slot gets 0
        out = (jnp.sum(acc * weight[..., None], axis=2) / jnp.sum(l * weight, axis=2)[..., None]).astype(dtype)
    return out.reshape(b, kv * groups, h), k_cache, v_cache


def reference(qkv: Array, bias: Array, positions: Array, inv_freq: Array, k_cache: Array, v_cache: Array,
              start: Array, pos: Array, *, scale: float) -> tuple[Array, Array, Array]:
    """``decode_attention`` in plain jnp, as ``decoder.Attention`` computes it (the bias in the cache's
    dtype, ``apply_rope``, float32 scores and softmax, the cache written before it is read): for tests."""
    b, kv, width, h = qkv.shape
    s = k_cache.shape[2]
    dtype = k_cache.dtype
    qkv = qkv.astype(dtype) + bias.astype(dtype)
    rope = lambda x: apply_rope(x[:, None], positions[:, None], inv_freq)[:, 0]
    q, k_new, v_new = rope(qkv[:, :, :-2].reshape(b, -1, h)), rope(qkv[:, :, -2]), qkv[:, :, -1]
    k_cache = jax.lax.dynamic_update_slice(k_cache, k_new[:, :, None], (0, 0, pos, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v_new[:, :, None], (0, 0, pos, 0))
    scores = jnp.einsum("bkgh,bksh->bkgs", q.reshape(b, kv, width - 2, h), k_cache,
                        preferred_element_type=jnp.float32) * scale
    live = (jnp.arange(s)[None, :] >= start[:, None]) & (jnp.arange(s)[None, :] <= pos)
    probs = jax.nn.softmax(jnp.where(live[:, None, None, :], scores, -jnp.inf), axis=-1).astype(dtype)
    out = jnp.einsum("bkgs,bksh->bkgh", probs, v_cache)
    return out.reshape(b, -1, h), k_cache, v_cache
