"""Reward routing by data source, user reward functions, batched scoring in worker processes."""

from __future__ import annotations

import math
import multiprocessing
import time

import pytest

from arlopti_jax.tasks import compute_score, load_reward_fn, registry, score_batch
from arlopti_jax.tasks.kk_reward import compute_kk_score
from arlopti_jax.tasks.math_reward import compute_math_score
from arlopti_jax.tasks.workers import WorkerPool

KK_GT = {"solution_text_format": "(1) Ava is a knight\n(2) Mia is a knave", "statements": "()"}
KK_RIGHT = "<|im_start|>assistant\n<think>x</think><answer>(1) Ava is a knight\n(2) Mia is a knave</answer>"
KK_WRONG = "<|im_start|>assistant\n<think>x</think><answer>(1) Ava is a knave\n(2) Mia is a knave</answer>"


# Module-level reward functions, importable by worker processes as 'test_reward_registry:...'.
def constant_reward(data_source, solution_str, ground_truth, extra_info=None):
    return 0.25


def unruly_reward(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "raise":
        raise RuntimeError("boom")
    if solution_str == "nan":
        return math.nan
    if solution_str == "text":
        return "not a number"
    return float(len(solution_str))


def sleepy_reward(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 at once, or after a minute for the response 'sleep'."""
    if solution_str == "sleep":
        time.sleep(60)
    return 1.0


@pytest.mark.parametrize("source", ["kk_logic", "kk_logic3", "kk_logic_7ppl"])
def test_kk_sources_route_to_kk(source):
    assert compute_score(source, KK_RIGHT, KK_GT) == 3.0
    assert compute_score(source, KK_WRONG, KK_GT) == -0.5


@pytest.mark.parametrize("source", ["aime_dsr", "amc_dsr", "math_dsr", "deepscaler"])
def test_math_sources_route_to_math(source):
    assert compute_score(source, "<think>x</think> \\boxed{142}", 142.0) == 1.0
    assert compute_score(source, "<think>x</think> \\boxed{141}", 142.0) == 0.0


def test_unknown_source_is_named():
    with pytest.raises(ValueError, match="'gsm8k_custom'"):
        compute_score("gsm8k_custom", "x", "1")
    with pytest.raises(ValueError, match="'gsm8k_custom'"):
        score_batch(compute_score, ["gsm8k_custom"], ["x"], ["1"])


def test_load_reward_fn():
    assert load_reward_fn(None) is compute_score
    assert load_reward_fn("arlopti_jax.tasks.registry:compute_score") is compute_score
    assert load_reward_fn("test_reward_registry:constant_reward")("s", "x", None) == 0.25
    with pytest.raises(ValueError, match="module:function"):
        load_reward_fn("no_colon_here")
    with pytest.raises(ValueError, match="config.reward.fn='no_such_module_xyz:f': cannot import"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="config.reward.fn=.*has no attribute 'nope'"):
        load_reward_fn("arlopti_jax.tasks.registry:nope")
    with pytest.raises(ValueError, match="not a function"):
        load_reward_fn("arlopti_jax.tasks.registry:KK_PREFIX")


def _mixed_batch():
    sources, strs, gts = [], [], []
    for i in range(12):
        sources += ["kk_logic", "math_dsr"]
        strs += [KK_RIGHT if i % 2 else KK_WRONG, f"<think>t</think> \\boxed{{{i % 3}}}"]
        gts += [KK_GT, "1"]
    return sources, strs, gts


def test_score_batch_inline_matches_direct_calls():
    sources, strs, gts = _mixed_batch()
    expected = [compute_score(*args) for args in zip(sources, strs, gts)]
    assert score_batch(compute_score, sources, strs, gts, num_workers=0) == expected
    assert expected[:4] == [-0.5, 0.0, 3.0, 1.0]


@pytest.mark.parametrize("mp_context", ["spawn", "forkserver"])
def test_score_batch_in_workers_with_jax_running(mp_context):
    import jax.numpy as jnp  # here, so that workers importing this module stay light

    # JAX has started its runtime threads in this process; workers must not be forked from it.
    assert float(jnp.ones(4).sum()) == 4.0
    sources, strs, gts = _mixed_batch()
    expected = [compute_score(*args) for args in zip(sources, strs, gts)]
    got = score_batch(compute_score, sources, strs, gts, num_workers=2, timeout_s=20, mp_context=mp_context)
    assert got == expected


def test_score_batch_timeouts_and_failures():
    strs = ["ab", "hang", "raise", "abc", "nan", "text", "hang", "abcd"]
    start = time.monotonic()
    got = score_batch(unruly_reward, ["any"] * 8, strs, [None] * 8, num_workers=2, timeout_s=1.5,
                      failure_score=-1.0)  # fmt: skip
    assert time.monotonic() - start < 30
    assert got == [2.0, -1.0, -1.0, 3.0, -1.0, -1.0, -1.0, 4.0]
    # The pool recovered: the killed workers were replaced.
    assert score_batch(unruly_reward, ["any"] * 8, ["x"] * 8, [None] * 8, num_workers=2) == [1.0] * 8


# (num_workers, items): asked to score in this process; fewer items than inline_below, with
# and without workers; a batch for the worker pool.
SCORING_PATHS = [(0, 10), (0, 4), (2, 4), (2, 10)]


@pytest.mark.parametrize("num_workers, n", SCORING_PATHS)
def test_time_limit_holds_for_a_user_reward_on_every_path(num_workers, n):
    strs = ["x", "sleep"] + ["x"] * (n - 2)
    start = time.monotonic()
    got = score_batch(sleepy_reward, ["any"] * n, strs, [None] * n, num_workers=num_workers, timeout_s=0.5,
                      failure_score=-1.0)  # fmt: skip
    assert got == [1.0, -1.0] + [1.0] * (n - 2)
    assert time.monotonic() - start < 30  # worker start-up included; the sleep alone takes 60 s


if multiprocessing.current_process().name == "arlopti-worker":
    # a worker loading this module's rewards, a replacement for a killed one included, loads math-verify
    # before its first deadline, as the built-in router's workers do (registry._BUILTIN_PRELOAD): a cold
    # first grading under load could overrun the tests' 1 s limit on its own
    from arlopti_jax.tasks import math_reward as _math_reward

    _math_reward.warm_up()


def unguarded_math(data_source, solution_str, ground_truth, extra_info=None):
    """The math reward's grading without math_guard: only the time limit can stop it."""
    from arlopti_jax.tasks import math_reward

    answer = math_reward.last_boxed(solution_str)
    return float(math_reward._verify_or_false(answer, math_reward.ground_truth_strings(ground_truth)))


@pytest.mark.parametrize("num_workers, n", SCORING_PATHS)
def test_time_limit_is_the_last_resort_for_math_on_every_path(num_workers, n, monkeypatch):
    """Past the guard (switched off: in this process for the built-in router's inline paths; by a
    reward that skips it for the worker pool's), grading a power tower runs until the time limit
    stops it, and the response gets the failure score on every path, not a path-dependent 0."""
    from arlopti_jax.tasks import math_reward

    pooled = num_workers > 0 and n >= 8  # where score_batch hands the built-in router to workers
    fn = unguarded_math if pooled else compute_score
    monkeypatch.setattr(math_reward, "refusal", lambda answer: None)
    # math-verify loaded (sandbox and workers started) before the clock starts
    warm = score_batch(fn, ["math_dsr"] * n, ["\\boxed{\\frac{1}{2}}"] * n, ["0.5"] * n, num_workers=num_workers)
    assert warm == [1.0] * n
    strs = ["\\boxed{2}", "\\boxed{9^{9^{9^{9}}}}"] + ["\\boxed{2}"] * (n - 2)
    start = time.monotonic()
    got = score_batch(fn, ["math_dsr"] * n, strs, ["2"] * n, num_workers=num_workers, timeout_s=1.0,
                      failure_score=-1.0)
    elapsed = time.monotonic() - start
    assert got == [1.0, -1.0] + [1.0] * (n - 2)
    # stopped at this 1 s limit (unstopped, the tower runs for minutes); the rest is the pool's replacement
    # of the killed worker, which imports math-verify again: 10.5 s on 2 busy cores on 2026-12-05
    assert elapsed < 30.0, elapsed


def test_the_guard_answers_a_power_tower_at_once_on_every_path():
    """With the guard, the tower never reaches math-verify: 0.0 (a wrong answer), not the failure
    score, alone, in process and in the worker pool."""
    for num_workers, n in SCORING_PATHS:
        strs = ["\\boxed{9^{9^{9^{9}}}}"] + ["\\boxed{2}"] * (n - 1)
        start = time.monotonic()
        got = score_batch(compute_score, ["math_dsr"] * n, strs, ["2"] * n, num_workers=num_workers, timeout_s=30.0,
                          failure_score=-1.0)
        assert got == [0.0] + [1.0] * (n - 1) and time.monotonic() - start < 25, (num_workers, n)


def test_worker_pool_switches_functions_after_kills():
    """A worker replaced at the end of a call may still be loading the old function."""
    with WorkerPool(2) as pool:
        items = [("any", s, None, None) for s in ("hang", "ab", "hang", "abc")]
        assert pool.map(unruly_reward, items, timeout_s=1.0, failure_value=-1.0) == [-1.0, 2.0, -1.0, 3.0]
        assert pool.map(constant_reward, items, timeout_s=5.0) == [0.25] * 4
        assert pool.killed == 2


def test_score_batch_rejects_bad_inputs():
    with pytest.raises(ValueError, match="equally long"):
        score_batch(compute_score, ["kk_logic"], ["a", "b"], [KK_GT])
    for num_workers in (0, 1):  # a user function runs in a worker even with num_workers=0
        with pytest.raises(TypeError, match="module-level function"):
            score_batch(lambda *a: 1.0, ["x"] * 10, ["s"] * 10, [None] * 10, num_workers=num_workers)


def test_builtin_rewards_take_verl_arguments():
    assert compute_kk_score(KK_RIGHT, KK_GT, {"index": 0}) == 3.0
    assert compute_math_score("\\boxed{1}", "1", None) == 1.0
    assert registry.reward_for("kk_logic5") is compute_kk_score


# verl's compute_score is a plain function people call from anywhere: an unguarded script and
# stdin must get the score (math-verify runs in a worker process that must not re-run them).
UNGUARDED = """
from arlopti_jax.tasks import compute_score, score_batch
half = "<|im_start|>assistant\\nso \\\\boxed{\\\\frac{1}{2}}"
print("single", compute_score("math_dsr", half, "0.5"), compute_score("math_dsr", half, "0.25"))
print("batch", score_batch(compute_score, ["math_dsr"] * 8, [half] * 8, ["0.5", "0.25"] * 4, num_workers=2))
"""


def _run_python(args, stdin=None, cwd=None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


@pytest.mark.parametrize("how", ["script", "stdin"])
def test_compute_score_from_unguarded_script_and_stdin(how, tmp_path):
    script = tmp_path / "score_me.py"
    script.write_text(UNGUARDED)
    proc = _run_python([str(script)]) if how == "script" else _run_python(["-"], stdin=UNGUARDED, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines == ["single 1.0 0.0", f"batch {[1.0, 0.0] * 4}"], proc.stdout + proc.stderr[-2000:]


def test_reward_defined_in_unguarded_main_says_what_to_do(tmp_path):
    user_fn = "def my_reward(source, text, truth, extra=None):\n    return 1.0\n"
    call = ("from arlopti_jax.tasks import score_batch\n"
            "score_batch(my_reward, ['x'] * 8, ['s'] * 8, [None] * 8, num_workers=1)\n")
    script = tmp_path / "mine.py"
    script.write_text(user_fn + call)
    proc = _run_python([str(script)])
    assert proc.returncode != 0 and "if __name__ == '__main__':" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    proc = _run_python(["-"], stdin=user_fn + call, cwd=tmp_path)
    assert proc.returncode != 0 and "define the function in a module file" in proc.stderr.splitlines()[-1], \
        proc.stderr[-2000:]
    # guarded, the same function is scored in workers
    script.write_text(user_fn + "if __name__ == '__main__':\n" + "".join(f"    {l}\n" for l in call.splitlines())
                      .replace("score_batch(my", "print(score_batch(my").replace("num_workers=1)", "num_workers=1))"))
    proc = _run_python([str(script)])
    assert proc.returncode == 0 and proc.stdout.strip() == str([1.0] * 8), proc.stderr[-2000:]


def test_answers_for_majority_voting():
    from arlopti_jax.tasks import answer_for

    kk = answer_for("kk_logic3")
    assert kk(KK_RIGHT, KK_GT) == (("Ava", "knight"), ("Mia", "knave"))
    assert kk(KK_WRONG, KK_GT) == (("Ava", "knave"), ("Mia", "knave"))
    assert kk("<|im_start|>assistant\n<think>x</think> Ava is a knight", KK_GT) is None  # format fails
    math = answer_for("math_dsr")
    assert math("<think>t</think> so \\boxed{\\dfrac{1}{2}}", "0.5") == "\\frac{1}{2}"
    assert math("<think>t</think> \\boxed{142.0}", "142") == math("\\boxed{ 142 }", "142") == "142"
    assert math("no box here", "1") is None and math("\\boxed{__import__('os')}", "1") is None
    assert answer_for("my_custom_source") is None
