"""AR / TR-GRPO weights, Lopti splits and the quartile diagnostic against numpy references."""

import numpy as np
import pytest

from arlopti_jax.algos import (AdvantageConfig, LoptiConfig, TokenWeightConfig, compute_advantages, lopti_masks,
                               lopti_threshold, prepare_updates, probability_quartiles, token_weightings,
                               weight_advantages)
from test_advantages import _batch, np_grpo

GRPO = AdvantageConfig("grpo")


def _old_logprobs(mask, seed=0):
    """Distinct probabilities spread over (0, 1), log-spaced like a real policy's."""
    rng = np.random.default_rng(seed)
    p = np.exp(rng.uniform(np.log(1e-4), np.log(0.999), mask.shape))
    return np.where(mask > 0, np.log(p), 0.0).astype(np.float32)


def np_ar(adv, logp, mask, alpha):
    p = np.exp(logp.astype(np.float64))
    return (alpha * p + 1 - alpha) * adv * mask


def np_tr(p, a, tau, mu, lo, hi):
    return np.clip(a * (1.0 / (1.0 + np.exp(-p / tau)) - mu), lo, hi)


def test_ar_matches_numpy():
    rewards, gid, mask = _batch()
    logp = _old_logprobs(mask)
    adv = np_grpo(rewards, gid, mask)
    for alpha in (0.0, 0.2, 0.3, 1.0):
        got = weight_advantages(TokenWeightConfig("ar", alpha=alpha), adv.astype(np.float32), logp, mask)
        np.testing.assert_allclose(np.asarray(got), np_ar(adv, logp, mask, alpha), rtol=1e-5, atol=1e-6)


def test_tr_matches_numpy_and_defaults_are_increasing():
    rewards, gid, mask = _batch()
    logp = _old_logprobs(mask, seed=1)
    adv = np_grpo(rewards, gid, mask)
    cfg = TokenWeightConfig("tr", tr_scale=3.0, tr_tau=0.4, tr_mu=0.55, tr_min=0.05, tr_max=0.9)
    got = weight_advantages(cfg, adv.astype(np.float32), logp, mask)
    want = np_tr(np.exp(logp.astype(np.float64)), 3.0, 0.4, 0.55, 0.05, 0.9) * adv * mask
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)

    # defaults: weight non-decreasing on [0, 1], strictly increasing where unclipped, <= 1
    d = TokenWeightConfig("tr")
    p = np.linspace(0.0, 1.0, 1001)
    ones = np.ones_like(p, np.float32)[None]
    w = np.asarray(weight_advantages(d, ones, np.log(np.maximum(p, 1e-30))[None].astype(np.float32), ones))[0]
    np.testing.assert_allclose(w, np_tr(p, d.tr_scale, d.tr_tau, d.tr_mu, d.tr_min, d.tr_max), rtol=1e-5, atol=1e-6)
    assert np.all(np.diff(w) >= 0)
    free = (w > d.tr_min) & (w < d.tr_max)
    assert free.sum() > 900 and np.all(np.diff(w)[free[1:]] > 0)
    assert w[0] == pytest.approx(d.tr_min) and 0.9 < w[-1] <= 1.0


def test_weights_apply_to_both_signs_and_only_on_response():
    rewards, gid, mask = _batch()
    logp = _old_logprobs(mask, seed=2)
    adv = np_grpo(rewards, gid, mask).astype(np.float32)
    for name in token_weightings():
        got = np.asarray(weight_advantages(TokenWeightConfig(name), adv, logp, mask))
        assert np.all(got[mask == 0] == 0)
        assert np.all(np.sign(got) == np.sign(adv))  # positive weights, both signs scaled


def test_alpha_zero_is_exactly_grpo():
    rewards, gid, mask = _batch()
    logp = _old_logprobs(mask)
    (adv, loss_mask), = prepare_updates(GRPO, TokenWeightConfig("ar", alpha=0.0), LoptiConfig(),
                                        rewards, gid, mask, logp)
    plain = compute_advantages(GRPO, rewards, gid, mask)
    np.testing.assert_array_equal(np.asarray(adv), np.asarray(plain))
    np.testing.assert_allclose(np.asarray(adv), np_grpo(rewards, gid, mask), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(loss_mask), mask)


def _np_split(logp, mask, eta, quantile):
    p = np.exp(logp.astype(np.float64))
    thr = np.quantile(p[mask > 0], abs(eta)) if quantile else abs(eta)
    low = (p < thr) & (mask > 0)
    high = (p >= thr) & (mask > 0)
    return (low, high) if eta > 0 else (high, low)


@pytest.mark.parametrize("eta,quantile", [(0.4, False), (0.5, False), (-0.5, False), (0.3, True), (-0.3, True)])
def test_lopti_masks_match_numpy(eta, quantile):
    rewards, gid, mask = _batch()
    logp = _old_logprobs(mask, seed=3)
    cfg = LoptiConfig(enabled=True, eta=eta, quantile=quantile)
    first, second = (np.asarray(m) for m in lopti_masks(cfg, logp, mask))
    want_first, want_second = _np_split(logp, mask, eta, quantile)
    np.testing.assert_array_equal(first, want_first.astype(np.float32))
    np.testing.assert_array_equal(second, want_second.astype(np.float32))
    np.testing.assert_array_equal(first + second, mask)  # a partition of the response tokens
    if quantile:
        p = np.exp(logp.astype(np.float64))[mask > 0]
        assert float(lopti_threshold(cfg, logp, mask)) == pytest.approx(np.quantile(p, abs(eta)), rel=1e-5)
        assert first.sum() > 0 and second.sum() > 0


def test_prepare_updates_with_lopti():
    rewards, gid, mask = _batch()
    logp = _old_logprobs(mask, seed=4)
    weights = TokenWeightConfig("ar", alpha=0.3)
    passes = prepare_updates(GRPO, weights, LoptiConfig(True, 0.5), rewards, gid, mask, logp)
    assert len(passes) == 2
    low, high = _np_split(logp, mask, 0.5, False)
    full = np_ar(np_grpo(rewards, gid, mask), logp, mask, 0.3)
    for (adv, loss_mask), keep in zip(passes, (low, high)):
        np.testing.assert_array_equal(np.asarray(loss_mask), keep.astype(np.float32))
        np.testing.assert_allclose(np.asarray(adv), full * keep, rtol=1e-5, atol=1e-6)
    # eta above every pi_old: everything in the first (low) pass, nothing in the second
    (a1, m1), (a2, m2) = prepare_updates(GRPO, weights, LoptiConfig(True, 1.0), rewards, gid, mask, logp)
    np.testing.assert_array_equal(np.asarray(m1), mask)
    assert not np.asarray(m2).any() and not np.asarray(a2).any()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="TokenWeightConfig.weighting='sqrt'"):
        TokenWeightConfig("sqrt")
    with pytest.raises(ValueError, match="TokenWeightConfig.alpha"):
        TokenWeightConfig("ar", alpha=1.5)
    with pytest.raises(ValueError, match="TokenWeightConfig.tr_tau"):
        TokenWeightConfig("tr", tr_tau=0.0)
    with pytest.raises(ValueError, match="LoptiConfig.eta"):
        LoptiConfig(enabled=True, eta=0.0)
    with pytest.raises(ValueError, match="LoptiConfig.eta"):
        LoptiConfig(enabled=True, eta=1.0, quantile=True)
    LoptiConfig(enabled=False, eta=0.0)  # not checked while disabled


def test_probability_quartiles_match_numpy():
    rewards, gid, mask = _batch()
    logp = _old_logprobs(mask, seed=5)
    adv = np_ar(np_grpo(rewards, gid, mask), logp, mask, 0.2).astype(np.float32)
    got = {k: np.asarray(v) for k, v in probability_quartiles(logp, adv, mask).items()}
    p = np.exp(logp.astype(np.float64))[mask > 0]
    a = np.abs(adv[mask > 0])
    edges = np.quantile(p, [0.25, 0.5, 0.75])
    np.testing.assert_allclose(got["edges"], edges, rtol=1e-5)
    bounds = [-np.inf, *edges, np.inf]
    for q in range(4):
        sel = (p >= bounds[q]) & (p < bounds[q + 1])
        assert got["count"][q] == sel.sum()
        np.testing.assert_allclose(got["mean_prob"][q], p[sel].mean(), rtol=1e-5)
        np.testing.assert_allclose(got["mean_abs_adv"][q], a[sel].mean(), rtol=1e-5)
    assert got["count"].sum() == mask.sum()
