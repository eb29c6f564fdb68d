"""Deterministic scoring: math_guard refuses the slow shapes before math-verify, so that a response
scores the same alone, in a batch, with any number of workers and on a repeat, and the time limit
is never reached; ``scoring_fuzz.py`` is the adversarial set (1,200 responses)."""

import glob
import time

import pytest

from arlopti_jax.tasks import math_reward, registry, score_batch
from arlopti_jax.tasks.math_guard import MAX_CHARS, MAX_DEPTH, refusal
from scoring_fuzz import EQUAL, MATH_TRUTHS, adversarial_set
from task_fixtures import SHARED_DATA, requires_shared_data

HAZARDS = {  # measured past 10 s, or refused for the reason given
    "9^{9^{9}}": "a power with more than",
    "\\sqrt{2}9^{9^{9^{9}}}": "powers nested deeper",
    "x^29^{9^{9^{9}}}": "a double superscript",
    "9^9^9^9": "a double superscript",
    "(10^{6})!": "a factorial",
    "1000!": "more than 1000 digits",
    "\\binom{100000}{50000}": "a binomial",
    "(x+1)^{1000}": "a sum raised",
    "10^{10^{5}}": "a power with more than",
    "\\int e^{x^2}\\sin(x^3) dx": "command \\int",
    "\\lim_{x\\to 0} x": "command \\lim",
    "\\sum_{k=1}^{n} k": "command \\sum",
    "\\frac{d}{dx} x^{x^{x}}": "a derivative",
    "{" * 20 + "2" + "}" * 20: "groups nested deeper",
    "\\frac{1}{" * 20 + "2" + "}" * 20: "groups nested deeper",
    "x+" * 70 + "x": "more than 128 tokens",
    "1" * 300: f"longer than {MAX_CHARS}",
    "e^{10^{4}}": "a power with more than",
}
ORDINARY = ("\\frac{12!}{2^6}", "\\left( \\frac{k+1}{k} \\right)^k", "(-1)^{n-1}", "e^{-2x^2}", "2^{1000}",
            "\\begin{pmatrix} -5 & -2 \\\\ -8 & 0 \\end{pmatrix}", "(x+1)^{8}", "\\binom{3000}{5}", "450",
            "x_{10}^{2}", "\\sqrt[3]{2}", "\\{1,2,3\\}", "10^{999}", "0.000001", "3\\pi/4", "\\infty",
            "[0,1) \\cup ((2,3] \\cup ((4,5] \\cup (6,7)))")


def public_truths() -> list[str]:
    import pyarrow.parquet as pq

    return [str(r["reward_model"]["ground_truth"]) for f in glob.glob(str(SHARED_DATA / "math" / "*.parquet"))
            for r in pq.read_table(f, columns=["reward_model"]).to_pylist()]


def test_guard_refuses_the_measured_hazards_and_accepts_ordinary_answers():
    for answer, reason in HAZARDS.items():
        assert reason in (refusal(answer) or ""), (answer, refusal(answer))
    for answer in ORDINARY + MATH_TRUTHS + tuple(a for pair in EQUAL for a in pair):
        assert refusal(answer) is None, (answer, refusal(answer))
    nested = "1"
    for depth in range(1, MAX_DEPTH + 2):
        nested = f"({nested})"
        assert (refusal(nested) is None) == (depth <= MAX_DEPTH)
    _, responses, _ = adversarial_set()  # a total function: an answer, or a reason, never an error
    answers = [math_reward.last_boxed(math_reward.final_response(r)) for r in responses]
    reasons = [refusal(a) for a in answers if a]
    assert sum(r is None for r in reasons) > 200 and sum(r is not None for r in reasons) > 200


@requires_shared_data
def test_guard_accepts_every_public_ground_truth():
    truths = public_truths()  # every ground truth of the public math sets
    assert len(truths) > 500, len(truths)
    assert not [t for t in truths if refusal(t)], [(t, refusal(t)) for t in truths if refusal(t)][:5]


def test_refused_answers_score_as_wrong_and_still_match_as_strings():
    respond = lambda answer: f"<|im_start|>assistant\nSo \\boxed{{{answer}}}"
    assert math_reward.compute_math_score(respond("9^{9^{9}}"), "9^{9^{9}}") == 1.0  # the same string
    assert math_reward.compute_math_score(respond("9^{9^{9}}"), "9^{387420489}") == 0.0  # refused
    assert math_reward.compute_math_score(respond("2^{2}"), "4") == 1.0  # accepted: math-verify decides


def _time_limit_hits() -> int:
    pools = list(registry._pools.values()) + ([math_reward._sandbox] if math_reward._sandbox else [])
    return sum(p.killed for p in pools)


def _check_paths(pick, paths, alone: bool):
    """Score the fuzz responses ``pick`` chooses (indices) along ``paths`` (num_workers values for
    one batch) and, with ``alone``, one response per call; every result equal, no time-limit hit,
    no failure."""
    sources, responses, truths = adversarial_set()
    chosen = pick(responses)
    sources, responses, truths = ([x[i] for i in chosen] for x in (sources, responses, truths))
    n = len(chosen)
    hits = _time_limit_hits()
    results = {}
    for workers in paths:
        start = time.monotonic()
        results[f"batch, {workers} workers"] = score_batch(registry.compute_score, sources, responses, truths,
                                                           num_workers=workers, timeout_s=10.0, failure_score=-99.0)
        print(f"batch of {n}, {workers} workers: {time.monotonic() - start:.1f} s")
    if alone:
        start = time.monotonic()
        results["alone"] = [score_batch(registry.compute_score, [s], [r], [t], timeout_s=10.0, failure_score=-99.0)[0]
                            for s, r, t in zip(sources, responses, truths)]
        print(f"{n} alone: {time.monotonic() - start:.1f} s")
    first = next(iter(results.values()))
    assert -99.0 not in first and _time_limit_hits() == hits
    for path, scores in results.items():
        diff = [(i, responses[i][:80], first[i], s) for i, s in enumerate(scores) if s != first[i]]
        assert not diff, f"{path}: {diff[:5]}"
    right = sum(s == 1.0 for s, src in zip(first, sources) if src != "kk_logic3")
    assert right >= n // 100  # the ordinary answers are graded, not all refused


def test_fuzz_sample_scores_the_same_alone_and_in_workers():
    """The default suite's share of the fuzz set (the slow test below runs all of it)."""
    def pick(responses):  # 60 in order, and 20 of the shapes the guard refuses as slow
        slow = [i for i, r in enumerate(responses) if any(
            w in (refusal(math_reward.last_boxed(math_reward.final_response(r)) or "") or "")
            for w in ("power", "factorial", "command", "sum"))]
        return list(range(60)) + slow[:20]

    _check_paths(pick, paths=(2,), alone=True)


@pytest.mark.slow
def test_fuzz_set_scores_the_same_on_every_path_and_repeat_without_a_time_limit_hit():
    """1,200 adversarial responses: alone, in one batch in this process, with 1 and 2 workers, and
    the 2-worker batch again; 0 time-limit hits at the default 10 s."""
    _check_paths(lambda responses: range(len(responses)), paths=(0, 1, 2, 2), alone=True)
