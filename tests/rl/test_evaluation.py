"""pass@k / maj@k / mean@k against brute force on fixed outcomes, and the result tables."""

import itertools
from fractions import Fraction

import numpy as np
import pytest

from arlopti_jax.rl.evaluation import compare_table, format_table, majority_correct, pass_at_k, prompt_stats, stat_names

OUTCOMES = [
    [0, 0, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 1, 0, 1, 0, 0, 1],
    [1, 1, 1, 1, 1, 1, 0, 1],
    [1] * 8,
    [0, 1, 0, 1],
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
]


def brute_pass_at_k(outcomes, k) -> Fraction:
    """The share of k-subsets of the samples holding a correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


@pytest.mark.parametrize("outcomes", OUTCOMES)
def test_pass_at_k_equals_brute_force(outcomes):
    n, c = len(outcomes), sum(outcomes)
    for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(outcomes, k)), abs=1e-12), (outcomes, k)


def test_pass_at_k_averaged_over_prompts():
    ks = (1, 2, 4)
    stats = np.stack([prompt_stats(np.array(o[:4], bool), None, ks) for o in OUTCOMES])
    want = [np.mean([float(brute_pass_at_k(o[:4], k)) for o in OUTCOMES]) for k in ks]
    np.testing.assert_allclose(stats[:, :3].mean(0), want, atol=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_majority_vote_rules():
    ok = [True, False, False, True, False]
    assert majority_correct(["a", "b", "b", "a", "b"], ok) is False  # b: 3 votes
    assert majority_correct(["a", "b", None, "a", None], ok) is True  # None does not vote
    assert majority_correct(["b", "a", "a", "b"], [False, True, True, False]) is False  # tie: b appeared first
    assert majority_correct(["a", "b", "b", "a"], [True, False, False, True]) is True  # tie: a appeared first
    assert majority_correct([None, None], [False, False]) is False  # no answer at all
    assert majority_correct([("x", 1)], [True]) is True  # any hashable answer (K&K: name/role pairs)


def test_prompt_stats_use_the_first_k_samples_for_maj_and_mean():
    correct = np.array([False, True, True, False, True, True, False, False])
    answers = ["x", "y", "y", "x", "y", "y", "x", "x"]
    got = dict(zip(stat_names((1, 2, 4, 8)), prompt_stats(correct, answers, (1, 2, 4, 8))))
    assert got["maj@1"] == 0.0  # x
    assert got["maj@2"] == 0.0  # x, y tie: x first
    assert got["maj@4"] == 0.0  # x x y y: x first
    assert got["maj@8"] == 0.0  # 4 x 4 tie: x first
    assert got["mean@1"] == 0.0 and got["mean@2"] == 0.5 and got["mean@4"] == 0.5 and got["mean@8"] == 0.5
    assert got["pass@1"] == pytest.approx(0.5) and got["pass@8"] == 1.0
    assert np.isnan(prompt_stats(correct, None, (2,))[1])  # no answer format: no maj@k


def test_tables():
    results = {"eval/test_2ppl/greedy_acc": 0.25, "eval/test_2ppl/sampled_acc": 0.5,
               "eval/test_2ppl/greedy_reward": -1.0, "eval/test_2ppl/pass@4": 0.75, "eval/test_2ppl/pass@1": 0.5,
               "eval/test_2ppl/maj@4": 0.25}
    settings = {"eval_n": 4, "eval_temperature": 1.0, "eval_top_p": 1.0, "eval_top_k": 0}
    table = format_table(results, settings)
    header, row, last = table.splitlines()
    assert header.split()[-3:] == ["pass@1", "pass@4", "maj@4"]
    assert row.split() == ["test_2ppl", "0.250", "0.500", "-1.000", "0.500", "0.750", "0.250"]
    assert last == "sampled: 4 per prompt at temperature 1 (top_p 1, top_k 0)"
    before = {k: v / 2 for k, v in results.items()}
    assert "0.375 -> 0.750" in compare_table(before, results).splitlines()[1]
