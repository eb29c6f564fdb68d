"""Advantage estimators against plain-numpy float64 loops written here from PAPER.md."""

import numpy as np
import pytest

from arlopti_jax.algos import advantages
from arlopti_jax.algos import AdvantageConfig, advantage_estimators, compute_advantages, register_advantage_estimator

T = 9


def _batch():
    """Prompts of different lengths (zeros before the response), right padding after it,
    groups of different sizes and non-contiguous ids, a size-1 group, a group with equal
    rewards, and a padding row (no response token) that shares group 7's id."""
    lengths = [(2, 5), (3, 4), (1, 8), (4, 3), (2, 6), (5, 2), (0, 9), (3, 1), (2, 4), (1, 3), (0, 0)]
    mask = np.zeros((len(lengths), T), np.float32)
    for row, (start, n) in enumerate(lengths):
        mask[row, start:start + n] = 1
    group_ids = np.array([7, 3, 7, 3, 7, 11, 3, 5, 5, 7, 7], np.int32)
    rewards = np.array([3.0, -0.5, -1.0, 3.0, -3.0, 1.0, 3.0, 2.0, 2.0, 0.5, 100.0], np.float32)
    return rewards, group_ids, mask


def _members(i, group_ids, real):
    return [j for j in range(len(group_ids)) if group_ids[j] == group_ids[i] and real[j]]


def np_grpo(r, g, mask, eps=1e-6, divide_std=True):
    r = r.astype(np.float64)
    real = mask.sum(1) > 0
    out = np.zeros(mask.shape)
    for i in range(len(r)):
        if not real[i]:
            continue
        vals = [r[j] for j in _members(i, g, real)]
        if len(vals) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(vals) / len(vals)
            std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
        a = (r[i] - mean) / (std + eps) if divide_std else r[i] - mean
        out[i] = a * mask[i]
    return out


def np_rloo(r, g, mask):
    r = r.astype(np.float64)
    real = mask.sum(1) > 0
    out = np.zeros(mask.shape)
    for i in range(len(r)):
        if not real[i]:
            continue
        others = [r[j] for j in _members(i, g, real) if j != i]
        out[i] = (r[i] - sum(others) / len(others) if others else 0.0) * mask[i]
    return out


def np_reinforce_pp(r, mask, gamma):
    b, t = mask.shape
    token_r = np.zeros((b, t))
    for i in range(b):
        valid = np.nonzero(mask[i])[0]
        if len(valid):
            token_r[i, valid[-1]] = r[i]
    returns = np.zeros((b, t))
    for i in range(b):
        running = 0.0
        for s in reversed(range(t)):
            if mask[i, s]:
                running = token_r[i, s] + gamma * running
                returns[i, s] = running
    vals = returns[mask > 0]
    mean, var = vals.mean(), vals.var(ddof=1)
    return (returns - mean) / np.sqrt(var + 1e-8) * mask


def _run(name, rewards, group_ids, mask, **kw):
    return np.asarray(compute_advantages(AdvantageConfig(estimator=name, **kw), rewards, group_ids, mask))


def test_grpo_matches_numpy_with_padding_and_size_one_groups():
    rewards, gid, mask = _batch()
    got = _run("grpo", rewards, gid, mask)
    want = np_grpo(rewards, gid, mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the same A_i on every response token, 0 elsewhere
    assert np.all(got[mask == 0] == 0)
    for i in np.nonzero(mask.any(1))[0]:
        assert np.ptp(got[i][mask[i] > 0]) == 0
    assert got[5, 5] == pytest.approx(1.0 / (1.0 + 1e-6))  # size-1 group: mean 0, std 1
    assert np.all(got[7:9] == 0)  # equal rewards in a group: no signal
    assert np.all(got[10] == 0)  # padding row: nothing, and not counted in group 7


def test_dr_grpo_and_rloo_match_numpy():
    rewards, gid, mask = _batch()
    np.testing.assert_allclose(_run("dr_grpo", rewards, gid, mask), np_grpo(rewards, gid, mask, divide_std=False),
                               rtol=1e-5, atol=1e-6)
    got = _run("rloo", rewards, gid, mask)
    np.testing.assert_allclose(got, np_rloo(rewards, gid, mask), rtol=1e-5, atol=1e-6)
    assert np.all(got[5] == 0)  # size-1 group


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_numpy(gamma):
    rewards, gid, mask = _batch()
    rewards = rewards / 3.0  # the padding row (reward 33) must not enter the whitening
    got = _run("reinforce_plus_plus", rewards, gid, mask, gamma=gamma)
    np.testing.assert_allclose(got, np_reinforce_pp(rewards, mask, gamma), rtol=1e-5, atol=1e-5)
    if gamma == 1.0:  # the return of every response token is its reward: constant per row
        for i in np.nonzero(mask.any(1))[0]:
            assert np.ptp(got[i][mask[i] > 0]) < 1e-6


def test_group_ids_need_not_be_contiguous():
    rewards, gid, mask = _batch()
    perm = np.random.default_rng(0).permutation(len(rewards))
    a = _run("grpo", rewards, gid, mask)[perm]
    b = _run("grpo", rewards[perm], gid[perm], mask[perm])
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_registry():
    assert {"grpo", "reinforce_plus_plus", "rloo", "dr_grpo"} <= set(advantage_estimators())
    with pytest.raises(ValueError, match="AdvantageConfig.estimator='ppo'"):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(lambda *a: None)

    @register_advantage_estimator("test_constant")
    def constant(cfg, rewards, group_ids, mask):
        return mask * 2.0

    try:
        rewards, gid, mask = _batch()
        np.testing.assert_array_equal(_run("test_constant", rewards, gid, mask), 2.0 * mask)
    finally:
        advantages._ESTIMATORS.pop("test_constant")
