"""The fused decode products (``models/decode_matmul.py``), run here in Pallas' interpret mode,
against the plain-jnp reference and against the decoder's own layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.models import decode_matmul as dm
from arlopti_jax.models.decoder import RMSNorm

# (rows, contracted, columns, block_m, block_k): fewer rows than a block, blocks that do not divide the
# contracted axis or the columns, blocks that do, and rows over several row blocks
SHAPES = [(5, 96, 40, 0, 64), (20, 64, 16, 16, 32), (33, 130, 70, 16, 128)]
FUSIONS = {"plain": {}, "norm": {"norm"}, "norm+up": {"norm", "up"}, "residual": {"residual"}}


def _operands(rng, m, k, n, dtype):
    r = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, dtype)
    return dict(x=r(m, k, scale=3.0), w=r(k, n, scale=k ** -0.5), up=r(k, n, scale=k ** -0.5), residual=r(m, n),
                norm=jnp.asarray(1.0 + 0.3 * rng.standard_normal(k), dtype))


@pytest.mark.parametrize("fusion", FUSIONS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_equals_the_reference(shape, fusion):
    """float32 to within rounding, bfloat16 to within a few of its last places (the products' sums
    run in another order, and silu is taken in float32 before one rounding); every row and column,
    edges included, is written."""
    m, k, n, block_m, block_k = shape
    for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)):
        ops = _operands(np.random.default_rng(sum(shape)), m, k, n, dtype)
        extra = {name: ops[name] for name in FUSIONS[fusion]}
        got = dm.fused_matmul(ops["x"], ops["w"], **extra, block_m=block_m, block_k=block_k, interpret=True)
        want = dm.reference(ops["x"], ops["w"], **extra)
        assert got.shape == (m, n) and got.dtype == dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


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
