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


def _parity_reward(data_source, solution_str, ground_truth, extra_info) -> float:
    """A score that follows the response: full marks (3, K&K's correct) for an odd length."""
    return 3.0 * (len(solution_str) % 2)


def test_last_chunk_padded_to_a_full_one_keeps_every_response_and_metric(start_point, tmp_path):
    """With every chunk laid out as a full one (``pad_to``), a test set whose size is a multiple of
    the chunk and one whose size is not (and greedy and sampled chunks of other sizes) get the same
    responses and metrics as each chunk laid out on its own (``pad_to=0``, the previous behaviour),
    and the sampler's programs see one prompt-row count per chunk size instead of one per size met."""
    import json

    import jax

    from arlopti_jax.rl import run_setup
    from arlopti_jax.rl.evaluation import Evaluator
    from run_fixtures import make_config, overrides

    # responses per generate call: batch_prompts x rollout.n = 4; chunks: 4 prompts greedy, 2 sampled
    config = make_config(overrides(start_point, tmp_path / "run", **{
        "train.batch_prompts": 1, "rollout.n": 4, "train.eval_n": 2, "train.eval_ks": (1, 2),
        "rollout.max_response_length": 10}))
    mesh = run_setup.make_mesh(config, devices=jax.devices()[:1])  # row counts not rounded up to 8 devices
    policy = run_setup.load_policy(config, mesh, start_point / "model")
    data = start_point / "data"
    full = run_setup.prompt_dataset(config, [data / "test_2ppl.parquet"], policy.tokenizer)
    other = run_setup.prompt_dataset(config, [data / "test_3ppl.parquet"], policy.tokenizer)
    assert len(full.rows) >= 4 and len(other.rows) >= 5
    full.rows, other.rows = full.rows[:4], other.rows[:5]  # 4: whole chunks; 5: 4 + 1 greedy, 2 + 2 + 1 sampled
    run = run_setup.assemble(config, mesh, policy.model_cfg, eos_ids=run_setup.eos_ids(policy),
                             pad_id=run_setup.pad_id(policy), total_steps=1)
    results, generations, rows_seen = {}, {}, {}
    for padded in (True, False):
        evaluator = Evaluator(config, run, policy.tokenizer, {"whole": full, "ragged": other}, _parity_reward)
        prefill, seen = evaluator.sampler._prefill, []
        evaluator.sampler._prefill = lambda params, ids, mask: seen.append(ids.shape[0]) or prefill(params, ids, mask)
        if not padded:
            chunk = evaluator._chunk
            evaluator._chunk = lambda *args: chunk(*args[:-1], 0)  # each chunk laid out on its own
        try:
            folder = tmp_path / f"gen_{padded}"
            results[padded] = evaluator.run(policy.params, jax.random.key(3), generations_dir=folder)
        finally:
            evaluator.sampler._prefill = prefill
        generations[padded] = {p.name: [json.loads(line) for line in p.read_text().splitlines()]
                               for p in sorted(folder.glob("*.jsonl"))}
        rows_seen[padded] = seen
    assert results[True] == results[False]
    assert generations[True] == generations[False]
    assert [len(g) for g in generations[True].values()] == [3 * 5, 3 * 4]  # greedy + 2 sampled each
    # greedy chunks of 4 prompts: 1 (whole) + 2 (ragged); sampled ones of 2: 2 (whole) + 3 (ragged)
    assert sorted(rows_seen[True]) == [2] * 5 + [4] * 3
    assert sorted(rows_seen[False]) == [1] * 2 + [2] * 4 + [4] * 2  # each last prompt: a bucket of its own
    assert 0 < results[True]["eval/avg/greedy_acc"] < 1 or 0 < results[True]["eval/avg/sampled_acc"] < 1
