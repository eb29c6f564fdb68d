"""PPO dual-clip loss, KL estimators, aggregation modes and the micro-batch identity,
against numpy float64 loops written from PAPER.md and verl's formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.algos import AGG_MODES, LossConfig, aggregation_weights, kl_penalty, policy_loss, ppo_clipped_loss

EL, EH, C = 0.2, 0.24, 3.0


def np_ppo(logp, old, adv, el=EL, eh=EH, c=C):
    """Returns per-token loss, d loss / d logp, and the low/high/dual clip indicators."""
    loss, grad = np.zeros(logp.shape), np.zeros(logp.shape)
    low, high, dual = (np.zeros(logp.shape, bool) for _ in range(3))
    for idx in np.ndindex(logp.shape):
        a = float(adv[idx])
        r = float(np.exp(np.float64(logp[idx]) - np.float64(old[idx])))
        unclipped = -a * r
        clipped = -a * min(max(r, 1 - el), 1 + eh)
        value, d = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
        if a < 0 and value > -a * c:
            value, d = -a * c, 0.0
            dual[idx] = True
        loss[idx], grad[idx] = value, d
        low[idx] = a < 0 and r < 1 - el
        high[idx] = a > 0 and r > 1 + eh
    return loss, grad, low, high, dual


def np_kl(logp, ref, kind):
    logp, ref = logp.astype(np.float64), ref.astype(np.float64)
    if kind in ("k1", "kl"):
        return logp - ref
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref) ** 2
    d = np.clip(ref - logp, -5, 5)
    return np.clip(np.exp(d) - d - 1, -10, 10)


def np_agg(x, mask, mode):
    """verl's agg_loss, counting in the seq modes only rows with a valid token."""
    rows = [i for i in range(x.shape[0]) if mask[i].sum() > 0]
    if mode == "token-mean":
        return sum((x[i] * mask[i]).sum() for i in rows) / mask.sum()
    if mode == "seq-mean-token-sum":
        return sum((x[i] * mask[i]).sum() for i in rows) / len(rows)
    return sum((x[i] * mask[i]).sum() / mask[i].sum() for i in rows) / len(rows)


def _tokens(seed=0, shape=(6, 10)):
    """Ratios spread over every region: below 1 - eps_low, inside, above 1 + eps_high, above c."""
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.01, 0.9, shape)).astype(np.float32)
    log_ratio = rng.choice([-1.0, -0.4, -0.1, 0.05, 0.15, 0.4, 1.5, 2.0], shape) + rng.uniform(-0.02, 0.02, shape)
    logp = (old + log_ratio).astype(np.float32)
    adv = rng.choice([-1.5, -0.5, 0.0, 0.7, 2.0], shape).astype(np.float32)
    mask = np.zeros(shape, np.float32)
    for i, (s, n) in enumerate([(0, 10), (2, 5), (1, 1), (0, 0), (4, 6), (3, 2)]):
        mask[i, s:s + n] = 1
    return logp, old, adv, mask


def test_ppo_dual_clip_matches_numpy_values_gradients_and_clip_flags():
    logp, old, adv, mask = _tokens()
    loss, info = jax.jit(ppo_clipped_loss, static_argnums=(3, 4, 5))(jnp.asarray(logp), old, adv, EL, EH, C)
    grad = jax.jit(jax.grad(lambda lp: ppo_clipped_loss(lp, old, adv, EL, EH, C)[0].sum()))(jnp.asarray(logp))
    want, want_grad, low, high, dual = np_ppo(logp, old, adv)
    np.testing.assert_allclose(np.asarray(loss), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(info["clip_low"]), low)
    np.testing.assert_array_equal(np.asarray(info["clip_high"]), high)
    np.testing.assert_array_equal(np.asarray(info["dual_clip"]), dual)
    assert low.any() and high.any() and dual.any() and (~(low | high | dual)).any()  # all regions hit


@pytest.mark.parametrize("kind", ["k1", "kl", "k2", "mse", "k3", "low_var_kl"])
def test_kl_estimators_match_numpy(kind):
    rng = np.random.default_rng(1)
    logp = np.log(rng.uniform(1e-4, 1, (4, 8))).astype(np.float32)
    ref = (logp + rng.choice([-7.0, -1.0, -0.1, 0.0, 0.3, 2.0, 6.0], logp.shape)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(kl_penalty(logp, ref, kind)), np_kl(logp, ref, kind), rtol=1e-5, atol=1e-6)
    if kind == "k3":  # the clamps bind in this batch
        assert np.abs(ref - logp).max() > 5


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_matches_numpy(mode):
    logp, old, adv, mask = _tokens(seed=2)
    x = np.random.default_rng(2).normal(size=mask.shape).astype(np.float32)
    got = (x.astype(np.float64) * aggregation_weights(mask, mode)).sum()
    np.testing.assert_allclose(float(got), np_agg(x.astype(np.float64), mask, mode), rtol=1e-5)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kl_type", ["low_var_kl", "k2"])
def test_policy_loss_matches_numpy(mode, kl_type):
    logp, old, adv, mask = _tokens(seed=3)
    rng = np.random.default_rng(3)
    entropy = rng.uniform(0, 3, mask.shape).astype(np.float32)
    ref = (logp + rng.normal(0, 0.5, mask.shape)).astype(np.float32)
    loss_mask = (mask * (rng.uniform(size=mask.shape) < 0.6)).astype(np.float32)  # a Lopti pass's tokens
    cfg = LossConfig(clip_low=EL, clip_high=EH, dual_clip=C, kl_coef=0.05, kl_type=kl_type, entropy_coef=0.01,
                     agg=mode)
    batch = dict(advantages=adv, old_logprobs=old, response_mask=mask, loss_mask=loss_mask, ref_logprobs=ref,
                 agg_weight=aggregation_weights(mask, mode))
    loss, stats = policy_loss(cfg, jnp.asarray(logp), jnp.asarray(entropy), batch)
    pg, _, low, high, dual = np_ppo(logp, old, adv)
    kl = np_kl(logp, ref, kl_type) * loss_mask
    want = np_agg(pg, mask, mode) + 0.05 * np_agg(kl, mask, mode) - 0.01 * np_agg(entropy * loss_mask, mask, mode)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(stats["pg_loss"]), np_agg(pg, mask, mode), rtol=1e-5)
    assert float(stats["clipfrac_low_sum"]) == (low * mask).sum()
    assert float(stats["clipfrac_high_sum"]) == (high * mask).sum()
    assert float(stats["dual_clipfrac_sum"]) == (dual * mask).sum()
    ratio = np.exp(logp.astype(np.float64) - old)
    assert float(stats["ratio_max"]) == pytest.approx(ratio[mask > 0].max(), rel=1e-5)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_sums_with_global_weights_equal_the_whole_batch(mode):
    """Cut into micro-batches with very uneven token counts, the sum of the micro-batch
    contributions (mini-batch-global weights) is the whole mini-batch's loss, and so is its
    gradient; verl's mean of per-micro-batch means is not."""
    logp, old, adv, mask = _tokens(seed=4)
    cfg = LossConfig(kl_coef=0.0, agg=mode, dual_clip=C)
    batch = dict(advantages=adv, old_logprobs=old, response_mask=mask, loss_mask=mask,
                 agg_weight=aggregation_weights(mask, mode))

    def whole(lp):
        return policy_loss(cfg, lp, jnp.zeros_like(lp), batch)[0]

    def accumulated(lp):
        total = 0.0
        for rows in ([0], [1, 2, 3], [4, 5]):
            part = {k: v[rows] for k, v in batch.items()}
            total = total + policy_loss(cfg, lp[jnp.asarray(rows)], jnp.zeros((len(rows), 10)), part)[0]
        return total

    lp = jnp.asarray(logp)
    (acc, acc_grad), (one, one_grad) = (jax.jit(jax.value_and_grad(f))(lp) for f in (accumulated, whole))
    # the summands are near 1: a few float32 ulps of them (the order of the sums differs)
    np.testing.assert_allclose(float(acc), float(one), rtol=1e-6, atol=5e-7)
    np.testing.assert_allclose(np.asarray(acc_grad), np.asarray(one_grad), rtol=1e-6, atol=1e-8)
    pg = np_ppo(logp, old, adv, c=C)[0]
    per_micro = [np_agg(pg[r], mask[r], mode) for r in ([0], [1, 2, 3], [4, 5])]
    if mode == "token-mean":
        assert abs(np.mean(per_micro) - float(whole(lp))) > 1e-3


def test_loss_config_errors_name_the_field():
    for kw, field in [({"agg": "sum"}, "agg"), ({"kl_type": "k4"}, "kl_type"), ({"dual_clip": 1.0}, "dual_clip"),
                      ({"clip_low": 1.0}, "clip_low"), ({"temperature": 0.0}, "temperature")]:
        with pytest.raises(ValueError, match=f"LossConfig.{field}"):
            LossConfig(**kw)
