"""A decode step's products on a GPU with their neighbours fused in: one Pallas (Triton) kernel for
each of a layer's four weight products, which also does the RMS norm before it, and the residual
add or the SwiGLU after it.

At a decode step a layer's products are thin: 64 rows against a weight of 1536 x 2048 (1.5B's
q, k and v) or more, so each reads its weight once and does little arithmetic. XLA:GPU ran a
layer in 11 kernels (``docs/measurements/aot_2026-11-28_decode_anatomy``): the norms, the
residual adds and silu x up as kernels of their own, and three of the four products split over
their contracted axis with the partial sums added by one more kernel. At 64 rows the step is
bound by its kernel count more than its bytes, so here each product is one kernel:

- ``norm``: the rows are RMS-normalised on the way in. Each program reads its rows' whole
  contracted axis anyway (its block of output columns needs all of it), so it first sums their
  squares (float32), then normalises each block of ``x`` as ``decoder.RMSNorm`` does (float32,
  cast to the model's dtype, times the norm's scale in that dtype) before its product;
- ``up``: a second weight of the same shape whose product's block the program also makes, and the
  output is silu(x W) * (x W_up) (``decoder.MLP``'s gate and up);
- ``residual``: the output is residual + x W, added in the model's dtype as ``decoder.Block``;
- grid (row blocks, column blocks): program (i, j) makes output block [i, j] over the whole
  contracted axis in blocks of ``block_k``, float32 accumulation. No split over the contracted
  axis, so no partial sums to add; the parallelism comes from narrow column blocks
  (``block_n`` 16: 1.5B's down product is 96 programs, its gate and up 560).

With the attention kernel (``decode_attention``), a layer is 6 kernels: norm + q, k, v product;
attention; the combine of its splits; output product + residual; norm + gate and up + silu x up;
down product + residual. Whether that is faster than XLA's 11 is a GPU measurement
(``bench/gpu.sh kernel``); ``ModelConfig.decode_matmul`` chooses, "xla" by default until then.

On a CPU the kernel runs in Pallas' interpret mode (tests; slow), so its arithmetic is tested
against ``reference`` without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # deprecated since JAX 0.11 for Mosaic GPU (as in ``decode_attention``)
    from jax.experimental.pallas import triton as pltriton
except ImportError:
    pltriton = None

Array = jax.Array

BLOCK_N = 16  # output columns per program: the smallest side of a Triton product, for the most programs
BLOCK_K = 128  # contracted elements per step of a program's loop


def _kernel(*refs, norm: bool, up: bool, residual: bool, eps: float, block_m: int, block_n: int, block_k: int):
    it = iter(refs)
    x_ref = next(it)
    g_ref = next(it) if norm else None
    w_ref = next(it)
    u_ref = next(it) if up else None
    r_ref = next(it) if residual else None
    o_ref = next(it)
    m, k = x_ref.shape
    n = w_ref.shape[1]
    dtype = x_ref.dtype
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * block_m + jnp.arange(block_m)
    cols = j * block_n + jnp.arange(block_n)
    live_rows, live_cols = rows < m, cols < n
    row_at, col_at = pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)
    steps = -(-k // block_k)

    def x_block(s):  # [block_m, block_k] of x, zero past its edges
        live = live_rows[:, None] & (s * block_k + jnp.arange(block_k) < k)[None, :]
        return pltriton.load(x_ref.at[row_at, pl.ds(s * block_k, block_k)], mask=live, other=0.0)

    def w_block(ref, s):  # [block_k, block_n] of a weight, zero past its edges
        live = (s * block_k + jnp.arange(block_k) < k)[:, None] & live_cols[None, :]
        return pltriton.load(ref.at[pl.ds(s * block_k, block_k), col_at], mask=live, other=0.0)

    if norm:  # the rows' mean square, float32, over the whole contracted axis
        def square(s, total):
            xf = x_block(s).astype(jnp.float32)
            return total + jnp.sum(xf * xf, axis=1)

        total = jax.lax.fori_loop(0, steps, square, jnp.zeros((block_m,), jnp.float32))
        inv = jax.lax.rsqrt(total / k + eps)

    def step(s, accs):
        x = x_block(s)
        if norm:
            scale = pltriton.load(g_ref.at[pl.ds(s * block_k, block_k)],
                                  mask=s * block_k + jnp.arange(block_k) < k, other=0.0)
            x = scale.astype(dtype)[None, :] * (x.astype(jnp.float32) * inv[:, None]).astype(dtype)
        return tuple(acc + jnp.dot(x, w_block(ref, s), preferred_element_type=jnp.float32)
                     for acc, ref in zip(accs, (w_ref, u_ref)[:1 + up]))

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = jax.lax.fori_loop(0, steps, step, (zeros,) * (1 + up))
    y = accs[0].astype(dtype)
    if up:  # silu(gate) * up, each product first in the model's dtype as decoder.MLP's
        gate = y.astype(jnp.float32)
        y = (gate / (1.0 + jnp.exp(-gate))).astype(dtype) * accs[1].astype(dtype)
    live = live_rows[:, None] & live_cols[None, :]
    if residual:
        y = pltriton.load(r_ref.at[row_at, col_at], mask=live, other=0.0) + y
    pltriton.store(o_ref.at[row_at, col_at], y.astype(o_ref.dtype), mask=live)


@functools.partial(jax.jit, static_argnames=("eps", "block_m", "block_n", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def fused_matmul(x: Array, w: Array, *, norm: Array | None = None, up: Array | None = None,
                 residual: Array | None = None, eps: float = 1e-6, block_m: int = 0, block_n: int = BLOCK_N,
                 block_k: int = BLOCK_K, num_warps: int = 4, num_stages: int = 3,
                 interpret: bool = False) -> Array:
    """[M, N] in x's dtype: ``x`` [M, K] (RMS-normalised with scale ``norm`` [K] first, when given)
    times ``w`` [K, N]; with ``up`` [K, N], silu(that) * (the same rows times ``up``); plus
    ``residual`` [M, N] when given. ``block_m`` 0: the rows rounded up to a power of two, 16 to 64
    (a Triton product's smallest side to the most one program holds)."""
    m, k = x.shape
    n = w.shape[1]
    block_m = block_m or min(64, max(16, 1 << (m - 1).bit_length()))
    for name, a, shape in (("w", w, (k, n)), ("up", up, (k, n)), ("residual", residual, (m, n)), ("norm", norm, (k,))):
        if a is not None and a.shape != shape:
            raise ValueError(f"fused_matmul: {name} has shape {a.shape}, expected {shape} for x {x.shape}, w {w.shape}")
    args = [a.astype(x.dtype) for a in (x, norm, w, up, residual) if a is not None]  # the kernel's order
    params = dict(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        functools.partial(_kernel, norm=norm is not None, up=up is not None, residual=residual is not None, eps=eps,
                          block_m=block_m, block_n=block_n, block_k=block_k),
        grid=(-(-m // block_m), -(-n // block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltriton.CompilerParams(**params) if pltriton else None,
        interpret=interpret,
        name="decode_matmul",
    )(*args)


def reference(x: Array, w: Array, *, norm: Array | None = None, up: Array | None = None,
              residual: Array | None = None, eps: float = 1e-6) -> Array:
    """``fused_matmul`` as the model's layers compute it (``decoder.RMSNorm``, the products in x's
    dtype, ``jax.nn.silu``, the residual added in x's dtype): for tests."""
    dtype = x.dtype
    if norm is not None:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        x = norm.astype(dtype) * xf.astype(dtype)
    y = jnp.dot(x, w.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
    if up is not None:
        y = jax.nn.silu(y) * jnp.dot(x, up.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
    return y if residual is None else residual.astype(dtype) + y
