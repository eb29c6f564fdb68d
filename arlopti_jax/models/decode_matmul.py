"""A decode step's products on a GPU with their neighbours fused in: one Pallas (Triton) kernel for
each of a layer's four weight products, which also does the RMS norm before it, and the residual
add or the SwiGLU after it.

At a decode step a layer's products are thin: 64 rows against a weight of 1536 x 2048 (1.5B's
q, k and v) or more, so each reads its weight once and does little arithmetic. XLA:GPU ran a
layer in 11 kernels (``docs/measurements/aot_2026-11-28_decode_anatomy``): the norms, the
residual adds and silu x up as kernels of their own, and three of the four products split over
their contracted axis with the partial sums added by one more kernel. At 64 rows the step is
bound by its kernel count more than its bytes, so here each product is one kernel:

- ``norm``: RMS norm on the way in. The norm's scale multiplies each block of ``x`` before the
  product (in the model's dtype), the rows' sums of squares are taken from the same blocks
  (float32), and each row's 1 / rms multiplies the float32 sums at the end: norm(x) W =
  diag(1 / rms) (x * scale) W, with no second pass over ``x``;
- ``up``: a second weight of the same shape whose product's block the program also makes, and the
  output is silu(x W) * (x W_up) (``decoder.MLP``'s gate and up);
- ``residual``: the output is residual + x W, added in the model's dtype as ``decoder.Block``;
- grid (row blocks, column blocks, splits): program (i, j, s) makes output block [i, j] over split
  s of the contracted axis, in blocks of ``block_k``, float32 sums. Splits exist for parallelism
  (1.5B's down product at 64 rows has 24 blocks of 64 columns for 132 multiprocessors), as in
  XLA's split-K products, but the partial sums are added by the kernel itself: each program
  writes its sums to a workspace and counts itself in ``counters`` (an atomic add); the last of
  block [i, j]'s programs adds all the splits' sums in split order (so the result does not depend
  on which finishes last), applies the norm, silu x up and the residual, writes the output and
  sets the counter back to zero. Narrow column blocks with no split would give as many programs,
  but each program reads all of its rows of ``x``: at 64 rows and 16 columns that is four times
  the weight's bytes again, from L2.

With the attention kernel (``decode_attention``), a layer is 6 kernels: norm + q, k, v product;
attention; the combine of its splits; output product + residual; norm + gate and up + silu x up;
down product + residual. On an H200 (2026-11-28) that was slower than XLA's 11: the realistic
1.5B step's rollout ran 0.71x as fast, the gate and up product alone 0.49x. So
``ModelConfig.decode_matmul`` is "xla" by default.

On a CPU the kernel runs in Pallas' interpret mode (tests; slow), so its arithmetic is tested
against ``reference`` without a GPU; the programs run there one after another, so the counting
is exercised but not its concurrency, which only a GPU run checks (``bench/decode_matmul.py``
compares every setting's output with the reference).
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

PROGRAMS = 264  # programs to aim for: two per multiprocessor of an H100 or H200 (132)
BLOCK_N = 64  # output columns per program
BLOCK_K = 128  # contracted elements per step of a program's loop


def grid_for(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, splits: int = 0) -> tuple[int, ...]:
    """(row blocks, column blocks, splits of the contracted axis, its blocks per split). ``block_m``
    0: ``fused_matmul``'s choice; ``splits`` 0: enough for about ``PROGRAMS`` programs, at most one
    per block of ``block_k``."""
    block_m = block_m or _block_m(m)
    rows, cols, blocks = -(-m // block_m), -(-n // block_n), -(-k // block_k)
    splits = max(1, min(splits or -(-PROGRAMS // (rows * cols)), blocks))
    chunk = -(-blocks // splits)
    return rows, cols, -(-blocks // chunk), chunk


def _kernel(*refs, norm: bool, up: bool, residual: bool, eps: float, block_m: int, block_n: int, block_k: int,
            chunk: int, splits: int, interpret: bool):
    """Program (i, j, s): output block [i, j] over blocks [s * chunk, (s + 1) * chunk) of the
    contracted axis; with several splits, the last of block [i, j]'s programs to finish adds their
    partial sums in split order and writes the output."""
    it = iter(refs)
    x_ref = next(it)
    g_ref = next(it) if norm else None
    w_ref = next(it)
    u_ref = next(it) if up else None
    r_ref = next(it) if residual else None
    next(it) if splits > 1 else None  # the counters' input (aliased to their output)
    o_ref = next(it)
    part_ref, squares_ref, count_ref = (next(it), next(it) if norm else None, next(it)) if splits > 1 else (None,) * 3
    m, k = x_ref.shape
    n = w_ref.shape[1]
    dtype = x_ref.dtype
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    live_rows = i * block_m + jnp.arange(block_m) < m
    live_cols = j * block_n + jnp.arange(block_n) < n
    row_at, col_at = pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)
    weights = (w_ref, u_ref)[:1 + up]

    def step(b, carry):  # one block of the contracted axis: x (times the norm's scale) into each product
        accs, squares = carry
        at = pl.ds(b * block_k, block_k)
        live_k = b * block_k + jnp.arange(block_k) < k
        x = pltriton.load(x_ref.at[row_at, at], mask=live_rows[:, None] & live_k[None, :], other=0.0)
        if norm:
            squares = squares + jnp.sum(jnp.square(x.astype(jnp.float32)), axis=1)
            x = x * pltriton.load(g_ref.at[at], mask=live_k, other=0.0)[None, :]
        w = [pltriton.load(ref.at[at, col_at], mask=live_k[:, None] & live_cols[None, :], other=0.0) for ref in weights]
        return tuple(acc + jnp.dot(x, wi, preferred_element_type=jnp.float32) for acc, wi in zip(accs, w)), squares

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    blocks = -(-k // block_k)
    carry = ((zeros,) * len(weights), jnp.zeros((block_m,), jnp.float32))
    accs, squares = jax.lax.fori_loop(s * chunk, jnp.minimum((s + 1) * chunk, blocks), step, carry)

    def finish(accs, squares):  # the norm's 1 / rms per row, then silu x up, then the residual
        if norm:
            inv = jax.lax.rsqrt(squares / k + eps)
            accs = [acc * inv[:, None] for acc in accs]
        y = accs[0].astype(dtype)
        if up:  # silu(gate) * up, each product first in the model's dtype as decoder.MLP's
            gate = y.astype(jnp.float32)
            y = (gate / (1.0 + jnp.exp(-gate))).astype(dtype) * accs[1].astype(dtype)
        live = live_rows[:, None] & live_cols[None, :]
        if residual:
            y = pltriton.load(r_ref.at[row_at, col_at], mask=live, other=0.0) + y
        pltriton.store(o_ref.at[row_at, col_at], y.astype(o_ref.dtype), mask=live)

    if splits == 1:
        finish(accs, squares)
        return
    # this program's partial sums into the workspace (padded to whole blocks: no masks), then the counter
    which = lambda p: jnp.asarray(p, jnp.int32)  # a product's index (a Python int does not index here)
    for p, acc in enumerate(accs):
        pltriton.store(part_ref.at[s, which(p), row_at, col_at], acc)
    if norm:
        pltriton.store(squares_ref.at[s, j, row_at], squares)
    if not interpret:
        pltriton.debug_barrier()  # every thread's stores before the counter's release
    tile = i * pl.num_programs(1) + j
    done = pltriton.atomic_add(count_ref, tile, jnp.ones((), jnp.int32))

    @pl.when(done == splits - 1)
    def _():  # the last: every split's sums, in split order (the same result whichever finishes last)
        read = lambda ref, at: pltriton.load(ref.at[at], volatile=True)  # from L2, never a stale L1 line

        def add(t, carry):
            accs, squares = carry
            accs = tuple(acc + read(part_ref, (t, which(p), row_at, col_at)) for p, acc in enumerate(accs))
            return accs, squares + (read(squares_ref, (t, j, row_at)) if norm else 0.0)

        finish(*jax.lax.fori_loop(0, splits, add, ((zeros,) * len(weights), jnp.zeros((block_m,), jnp.float32))))
        pltriton.atomic_add(count_ref, tile, jnp.full((), -splits, jnp.int32))  # zero again for the next call


def counters_for(m: int, widths, block_m: int = 0, block_n: int = BLOCK_N) -> int:
    """The length of a counters buffer that serves products of ``m`` rows and output ``widths``."""
    block_m = block_m or _block_m(m)
    return max(-(-m // block_m) * -(-n // block_n) for n in widths)


def _block_m(m: int) -> int:
    return min(64, max(16, 1 << (m - 1).bit_length()))


@functools.partial(jax.jit, static_argnames=("eps", "block_m", "block_n", "block_k", "splits", "num_warps",
                                             "num_stages", "interpret"))
def fused_matmul(x: Array, w: Array, *, norm: Array | None = None, up: Array | None = None,
                 residual: Array | None = None, counters: Array | None = None, eps: float = 1e-6,
                 block_m: int = 0, block_n: int = BLOCK_N, block_k: int = BLOCK_K, splits: int = 0,
                 num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """[M, N] in x's dtype: ``x`` [M, K] (RMS-normalised with scale ``norm`` [K] first, when given)
    times ``w`` [K, N]; with ``up`` [K, N], silu(that) * (the same rows times ``up``); plus
    ``residual`` [M, N] when given.

    The contracted axis is split over ``splits`` programs per output block (0: ``grid_for``'s
    choice) whose float32 partial sums the last of them adds. The programs count themselves in
    ``counters`` (int32 [``counters_for``], zero, as every call leaves it): pass it, and get
    (out, counters) back, to thread one buffer through a step's calls; without it, each call
    zeroes a buffer of its own. ``block_m`` 0: the rows rounded up to a power of two, 16 to 64
    (a Triton product's smallest side to the most one program holds)."""
    m, k = x.shape
    n = w.shape[1]
    block_m = block_m or _block_m(m)
    for name, a, shape in (("w", w, (k, n)), ("up", up, (k, n)), ("residual", residual, (m, n)), ("norm", norm, (k,))):
        if a is not None and a.shape != shape:
            raise ValueError(f"fused_matmul: {name} has shape {a.shape}, expected {shape} for x {x.shape}, w {w.shape}")
    rows, cols, splits, chunk = grid_for(m, n, k, block_m, block_n, block_k, splits)
    threaded = counters is not None
    if counters is None:
        counters = jnp.zeros((rows * cols,), jnp.int32)
    elif counters.shape[0] < rows * cols:
        raise ValueError(f"fused_matmul: counters hold {counters.shape[0]} blocks, {rows * cols} needed")
    args = [a.astype(x.dtype) for a in (x, norm, w, up, residual) if a is not None]  # the kernel's order
    out_shape = [jax.ShapeDtypeStruct((m, n), x.dtype)]
    aliases = {}
    if splits > 1:  # the workspace: partial sums (and the rows' partial sums of squares), then the counters
        out_shape.append(jax.ShapeDtypeStruct((splits, 1 + (up is not None), rows * block_m, cols * block_n),
                                              jnp.float32))
        if norm is not None:
            out_shape.append(jax.ShapeDtypeStruct((splits, cols, rows * block_m), jnp.float32))
        out_shape.append(jax.ShapeDtypeStruct(counters.shape, jnp.int32))
        aliases = {len(args): len(out_shape) - 1}
        args.append(counters)
    out = pl.pallas_call(
        functools.partial(_kernel, norm=norm is not None, up=up is not None, residual=residual is not None, eps=eps,
                          block_m=block_m, block_n=block_n, block_k=block_k, chunk=chunk, splits=splits,
                          interpret=interpret),
        grid=(rows, cols, splits),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages) if pltriton else None,
        interpret=interpret,
        name="decode_matmul",
    )(*args)
    if not threaded:
        return out[0]
    return out[0], (out[-1] if splits > 1 else counters)


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
