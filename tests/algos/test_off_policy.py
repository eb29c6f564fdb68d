"""The off-policy correction (algos/off_policy.py) against numpy float64 loops written from its
docstring: the weights, the mismatch metrics, and the corrected loss and its gradient, on log-probs
that vary (several seeds and shapes, a row without response tokens)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.algos import (CorrectionConfig, LossConfig, aggregation_weights, correct_passes, correction_weights,
                               mismatch_metrics, policy_loss)

SHAPES = [(5, 9), (8, 16), (3, 31)]


def _batch(seed, shape):
    """Behaviour and pi_old log-probs apart by amounts from tiny to large, per token and per row."""
    rng = np.random.default_rng(seed)
    behaviour = np.log(rng.uniform(0.01, 0.95, shape)).astype(np.float32)
    # per row: large per-token noise (tis caps some tokens; the mask drops the row), a tiny shift (kept),
    # a large shift (dropped), none; row 1 is batch padding
    regimes = [(0.0, 0.6), (0.0, 0.0), (0.004, 0.0), (-0.3, 0.0), (0.0, 0.0), (0.0, 0.6), (-0.006, 0.01), (0.5, 0.0)]
    shift, noise = (np.array([regimes[i % 8][j] for i in range(shape[0])])[:, None] for j in (0, 1))
    old = (behaviour + shift + rng.normal(0, 1.0, shape) * noise).astype(np.float32)
    mask = np.zeros(shape, np.float32)
    for i in range(shape[0]):
        start, length = rng.integers(0, 3), rng.integers(1, shape[1] - 2)
        mask[i, start:start + length] = 1
    mask[1] = 0  # batch padding: no response tokens
    return old, behaviour, mask


def np_weights(kind, old, behaviour, mask, cap, bound):
    w = np.zeros(old.shape)
    for i in range(old.shape[0]):
        tokens = [t for t in range(old.shape[1]) if mask[i, t]]
        log_g = np.mean([float(old[i, t]) - float(behaviour[i, t]) for t in tokens]) if tokens else 0.0
        for t in tokens:
            r = np.exp(np.float64(old[i, t]) - np.float64(behaviour[i, t]))
            if kind == "tis":
                w[i, t] = min(r, cap)
            elif kind == "seq_mask":
                w[i, t] = 1.0 if 1 / bound <= np.exp(log_g) <= bound else 0.0
            else:
                w[i, t] = 1.0
    return w


@pytest.mark.parametrize("kind", ["none", "tis", "seq_mask"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weights_and_metrics_match_numpy(kind, seed):
    old, behaviour, mask = _batch(seed, SHAPES[seed])
    cfg = CorrectionConfig(kind=kind, tis_cap=1.5, seq_mask_bound=1.02)
    got = np.asarray(correction_weights(cfg, old, behaviour, mask))
    want = np_weights(kind, old, behaviour, mask, 1.5, 1.02)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    valid = mask > 0
    r = np.exp(old.astype(np.float64) - behaviour)[valid]
    metrics = mismatch_metrics(cfg, old, behaviour, mask)
    assert metrics["offpolicy/kl_k3"] == pytest.approx(np.mean(r - 1 - np.log(r)), rel=1e-4, abs=1e-7)
    assert metrics["offpolicy/ratio_mean"] == pytest.approx(r.mean(), rel=1e-5)
    if kind == "tis":
        assert metrics["offpolicy/tis_clipped"] == pytest.approx(np.mean(r > 1.5))
        assert 0 < metrics["offpolicy/tis_clipped"] < 1  # the cap binds on some tokens, not all
    if kind == "seq_mask":
        assert metrics["offpolicy/seq_masked"] == pytest.approx(np.mean(want[valid] == 0))
        assert 0 < metrics["offpolicy/seq_masked"] < 1


def np_corrected_loss(logp, old, adv, weight, mask, loss_mask, ref, agg_w, el, eh, c, kl_coef):
    """sum_t agg_w (c_t * pg_t + kl_coef * k3_t * loss_mask_t) and its gradient in logp, token by token."""
    total, grad = 0.0, np.zeros(logp.shape)
    for idx in np.ndindex(logp.shape):
        if not mask[idx]:
            continue
        a, r = float(adv[idx]), float(np.exp(np.float64(logp[idx]) - np.float64(old[idx])))
        unclipped, clipped = -a * r, -a * min(max(r, 1 - el), 1 + eh)
        pg, d_pg = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
        if a < 0 and pg > -a * c:
            pg, d_pg = -a * c, 0.0
        d = np.float64(ref[idx]) - np.float64(logp[idx])
        k3, d_k3 = (np.exp(d) - d - 1, 1 - np.exp(d)) if abs(d) < 5 else (np.exp(np.clip(d, -5, 5)) - np.clip(d, -5, 5)
                                                                           - 1, 0.0)
        lm = float(loss_mask[idx])
        total += agg_w[idx] * (weight[idx] * pg + kl_coef * k3 * lm)
        grad[idx] = agg_w[idx] * (weight[idx] * d_pg + kl_coef * d_k3 * lm)
    return total, grad


@pytest.mark.parametrize("kind", ["tis", "seq_mask"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_corrected_loss_and_gradient_match_numpy(kind, seed):
    """The pass's advantages times the weights (``correct_passes``) give the loss whose
    policy-gradient term alone is reweighted, with the KL term as it was, in value and gradient."""
    shape = SHAPES[seed]
    old, behaviour, mask = _batch(seed, shape)
    rng = np.random.default_rng(10 + seed)
    logp = (old + rng.choice([-0.5, -0.1, 0.0, 0.1, 0.4, 1.2], shape) + rng.uniform(-0.02, 0.02, shape)) \
        .astype(np.float32)
    adv = (rng.choice([-1.5, -0.5, 0.0, 0.7, 2.0], shape) * mask).astype(np.float32)
    ref = (logp + rng.normal(0, 0.5, shape)).astype(np.float32)
    loss_mask = (mask * (rng.uniform(size=shape) < 0.7)).astype(np.float32)  # a Lopti pass's tokens
    cfg = CorrectionConfig(kind=kind, tis_cap=1.3, seq_mask_bound=1.02)
    weight = correction_weights(cfg, old, behaviour, mask)
    (corrected, same_mask), = correct_passes(((jnp.asarray(adv), jnp.asarray(loss_mask)),), weight)
    np.testing.assert_array_equal(np.asarray(same_mask), loss_mask)
    loss_cfg = LossConfig(clip_low=0.2, clip_high=0.24, dual_clip=3.0, kl_coef=0.1, kl_type="low_var_kl")
    agg_w = aggregation_weights(mask, "token-mean")
    batch = dict(advantages=corrected, old_logprobs=old, response_mask=mask, loss_mask=loss_mask, ref_logprobs=ref,
                 agg_weight=agg_w)
    fn = lambda lp: policy_loss(loss_cfg, lp, jnp.zeros_like(lp), batch)[0]
    loss, grad = jax.value_and_grad(fn)(jnp.asarray(logp))
    want_w = np_weights(kind, old, behaviour, mask, 1.3, 1.02)
    want, want_grad = np_corrected_loss(logp, old, adv, want_w, mask, loss_mask, ref, agg_w, 0.2, 0.24, 3.0, 0.1)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-7)
    assert (want_w[mask > 0] != 1).any()  # the correction changed the loss


def test_bad_settings_are_refused():
    for bad in (dict(kind="is"), dict(tis_cap=0.5), dict(seq_mask_bound=1.0)):
        with pytest.raises(ValueError, match="CorrectionConfig"):
            CorrectionConfig(**bad)
