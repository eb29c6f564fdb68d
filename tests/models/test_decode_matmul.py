"""The fused decode products (``models/decode_matmul.py``), run here in Pallas' interpret mode,
against the plain-jnp reference and against the decoder's own layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.models import decode_matmul as dm
from arlopti_jax.models.decoder import RMSNorm

# (rows, contracted, columns, block_m, block_n, block_k, splits): fewer rows than a block, blocks that do not
# divide the contracted axis or the columns, blocks that do, rows over several row blocks; the contracted
# axis whole (1 split), in 2 and 3 splits, in one split per block (0: the kernel's choice for so few programs)
SHAPES = [(5, 96, 40, 0, 16, 64, 1), (20, 64, 16, 16, 16, 32, 2), (33, 130, 70, 16, 32, 32, 3),
          (16, 200, 64, 0, 64, 64, 0)]
FUSIONS = {"plain": {}, "norm": {"norm"}, "norm+up": {"norm", "up"}, "residual": {"residual"}}


def _operands(rng, m, k, n, dtype):
    r = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    return dict(x=r(m, k, scale=3.0), w=r(k, n, scale=k ** -0.5), up=r(k, n, scale=k ** -0.5), residual=r(m, n),
                norm=jnp.asarray(1.0 + 0.3 * rng.standard_normal(k), dtype))


@pytest.mark.parametrize("fusion", FUSIONS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_equals_the_reference(shape, fusion):
    """float32 to within rounding, bfloat16 to within a few of its last places (the products' sums
    run in another order, the norm's 1 / rms is applied after the product, and silu is taken in
    float32 before one rounding); every row and column, edges included, is written."""
    m, k, n, block_m, block_n, block_k, splits = shape
    for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)):
        ops = _operands(np.random.default_rng(sum(shape)), m, k, n, dtype)
        extra = {name: ops[name] for name in FUSIONS[fusion]}
        got = dm.fused_matmul(ops["x"], ops["w"], **extra, block_m=block_m, block_n=block_n, block_k=block_k,
                              splits=splits, interpret=True)
        want = dm.reference(ops["x"], ops["w"], **extra)
        assert got.shape == (m, n) and got.dtype == dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_the_grid_splits_the_contracted_axis_for_enough_programs():
    """1.5B's down product at 64 rows: 24 blocks of 64 columns, its 70 blocks of 128 contracted
    elements in 10 splits of 7 (240 programs); gate and up: 140 column blocks, 2 splits; 256 rows
    of the output product: 4 x 24 blocks, 3 splits. Never more splits than blocks."""
    assert dm.grid_for(64, 1536, 8960, 64, 64, 128) == (1, 24, 10, 7)
    assert dm.grid_for(64, 8960, 1536, 64, 64, 128) == (1, 140, 2, 6)
    assert dm.grid_for(256, 1536, 1536, 64, 64, 128) == (4, 24, 3, 4)
    assert dm.grid_for(8, 64, 96, 16, 64, 128) == (1, 1, 1, 1)
    assert dm.grid_for(64, 1536, 8960, 64, 64, 128, splits=1) == (1, 24, 1, 70)


def test_threaded_counters_come_back_zero_and_serve_the_next_call():
    """With several splits the programs count themselves in ``counters``; each call leaves them at
    zero, so one buffer serves a step's calls in turn (``decode.fused_layer``), whatever their grids."""
    ops = _operands(np.random.default_rng(1), 20, 96, 48, jnp.float32)
    counters = jnp.zeros(dm.counters_for(20, (48, 96), block_m=16, block_n=16), jnp.int32)
    out, counters = dm.fused_matmul(ops["x"], ops["w"], norm=ops["norm"], counters=counters, block_m=16,
                                    block_n=16, block_k=32, splits=3, interpret=True)
    np.testing.assert_allclose(out, dm.reference(ops["x"], ops["w"], norm=ops["norm"]), rtol=2e-5, atol=1e-5)
    np.testing.assert_array_equal(counters, 0)
    square = jnp.asarray(np.random.default_rng(2).standard_normal((48, 96)) * 0.1, jnp.float32)
    again, counters = dm.fused_matmul(out, square, counters=counters, block_m=16, block_n=16, block_k=16, splits=2,
                                      interpret=True)
    np.testing.assert_allclose(again, dm.reference(out, square), rtol=2e-5, atol=1e-5)
    np.testing.assert_array_equal(counters, 0)
    with pytest.raises(ValueError, match=r"fused_matmul: counters hold 3 blocks, 12 needed"):
        dm.fused_matmul(out, square, counters=counters[:3], block_m=16, block_n=16, splits=2, interpret=True)


def test_the_reference_is_the_decoders_layers():
    """``reference`` computes what ``decoder.RMSNorm``, ``decoder.MLP``'s silu x up and a residual add
    compute, so the kernel's test stands for the layer's."""
    rng = np.random.default_rng(3)
    ops = _operands(rng, 6, 32, 24, jnp.float32)
    norm = RMSNorm(1e-6, jnp.float32, jnp.float32)
    normed = norm.apply({"params": {"scale": ops["norm"]}}, ops["x"])
    want = jax.nn.silu(normed @ ops["w"]) * (normed @ ops["up"])
    got = dm.reference(ops["x"], ops["w"], norm=ops["norm"], up=ops["up"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dm.reference(ops["x"], ops["w"],
                                            residual=ops["residual"]), ops["residual"] + ops["x"] @ ops["w"],
                               rtol=1e-5, atol=1e-5)


def test_operands_of_the_wrong_shape_are_named():
    ops = _operands(np.random.default_rng(0), 4, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"fused_matmul: residual has shape \(4, 8\), expected \(4, 16\)"):
        dm.fused_matmul(ops["x"], ops["w"], residual=ops["residual"][:, :8], interpret=True)
    with pytest.raises(ValueError, match=r"fused_matmul: norm has shape \(31,\), expected \(32,\)"):
        dm.fused_matmul(ops["x"], ops["w"], norm=ops["norm"][:31], interpret=True)
