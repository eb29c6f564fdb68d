"""Math reward: extraction, equivalence, and hostile answers (never executed, time-bounded)."""

from __future__ import annotations

import time

import pytest

from arlopti_jax.tasks import math_reward
from arlopti_jax.tasks.math_reward import (
    compute_math_score,
    final_response,
    ground_truth_strings,
    is_safe_answer,
    last_boxed,
    normalize_answer,
)

TIMEOUT_S = 2.0


def respond(answer: str) -> str:
    return f"<think>working</think>\nThe answer is $\\boxed{{{answer}}}$.<|im_end|>"


EQUIVALENT = [
    ("\\frac{1}{2}", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\tfrac12", "\\frac{1}{2}"),
    ("\\frac {1} { 2 }", "\\frac{1}{2}"),
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "0.5"),
    ("\\frac{2}{4}", "\\frac12"),
    ("142", 142.0),
    ("142.0", 142.0),
    ("142.00", "142"),
    ("0142", 142),
    ("25", "025"),
    ("1,000", "1000"),
    ("x = 5", "5"),
    ("10\\%", "10"),
    ("90^\\circ", "90"),
    ("\\text{5}", "5"),
    ("(1, 2]", "(1,2]"),
    ("[-1,3)", "[-1, 3)"),
    ("(-\\infty, 0) \\cup (1, \\infty)", "(-\\infty,0)\\cup(1,\\infty)"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("(1,2,3)", "(1, 2, 3)"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt2}"),
    ("p - q", "p-q"),
    ("-q + p", "p - q"),
    ("\\frac{1}{2}", ["3", "0.5"]),  # any of several accepted answers
]

WRONG = [
    ("\\frac{1}{3}", "\\frac{1}{2}"),
    ("141", 142.0),
    ("142.5", 142.0),
    ("(1,2)", "(1,2]"),
    ("(2,1)", "(1,2)"),
    ("p + q", "p - q"),
    ("\\sqrt{3}", "\\sqrt{2}"),
    ("", "1"),
]


@pytest.mark.parametrize("pred,gt", EQUIVALENT)
def test_equivalent_answers_score_one(pred, gt):
    assert compute_math_score(respond(pred), gt, timeout_s=TIMEOUT_S) == 1.0


@pytest.mark.parametrize("pred,gt", WRONG)
def test_wrong_answers_score_zero(pred, gt):
    assert compute_math_score(respond(pred), gt, timeout_s=TIMEOUT_S) == 0.0


def test_extraction():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{\\sqrt{2}}} c") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{1} then \\fbox{ 2 }") == " 2 "
    assert last_boxed("\\boxed 5$") == "5"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed("\\boxed{unbalanced") is None
    assert last_boxed("no box here") is None
    assert final_response("prompt \\boxed{} <|im_start|>assistant\n<think>a \\boxed{1}</think> b") == " b"
    assert final_response("x</think>y</think>z") == "z"


def test_only_the_final_response_counts():
    prompt = "<|im_start|>user\nput it in \\boxed{}<|im_end|>\n<|im_start|>assistant\n"
    assert compute_math_score(prompt + "<think>\\boxed{4}</think> I give up.", "4") == 0.0
    assert compute_math_score(prompt + "<think>hmm</think> \\boxed{4}", "4") == 1.0
    assert compute_math_score("no think tags, answer \\boxed{4}", "4") == 1.0
    assert compute_math_score("the answer is 4", "4") == 0.0


def test_ground_truth_types():
    assert ground_truth_strings(142.0) == ["142"]
    assert ground_truth_strings(0.25) == ["0.25"]
    assert ground_truth_strings(7) == ["7"]
    assert ground_truth_strings("\\boxed{3}") == ["3"]
    assert ground_truth_strings(["1", 2.0]) == ["1", "2"]
    for bad in (None, True, {"a": 1}):
        with pytest.raises(TypeError):
            ground_truth_strings(bad)


def test_normalize_answer():
    assert normalize_answer("\\left( 3, \\dfrac{\\pi}{2} \\right).") == "(3,\\frac{\\pi}{2})"
    assert normalize_answer(".50") == "0.5"
    assert normalize_answer("\\leftarrow") == "\\leftarrow"


def test_guard():
    assert is_safe_answer("\\frac{1}{2}")
    for bad in ("__import__('os')", "lambda x: x", "import os", "().__class__", "os.system('ls')",
                "{" * 50 + "}" * 50, "1" * 5000, "eval(1)"):  # fmt: skip
        assert not is_safe_answer(bad), bad


def _hostile_answers(marker):
    return {
        "import": f"__import__('os').system('touch {marker}')",
        "subclasses": "().__class__.__bases__[0].__subclasses__()",
        "lambda": f"(lambda: __import__('os').system('touch {marker}'))()",
        "open": f"open('{marker}', 'w')",
        "nested braces": "{" * 10_000 + "1" + "}" * 10_000,
        "huge": "9" * 1_000_000,
        "power tower": "9^9^9^9",
        "braced power tower": "9^{9^{9^{9}}}",
    }


@pytest.mark.parametrize("name", list(_hostile_answers("m")))
def test_hostile_answers_score_zero_fast_and_run_nothing(tmp_path, name):
    marker = tmp_path / "pwned"
    answer = _hostile_answers(marker)[name]
    start = time.monotonic()
    assert compute_math_score(respond(answer), "3", timeout_s=TIMEOUT_S) == 0.0
    # Limit + the sandbox process's start-up (cold or after a kill) + slack.
    assert time.monotonic() - start < TIMEOUT_S + 15.0
    assert not marker.exists()


def test_math_verify_latex_path_evaluates_no_python(tmp_path):
    """Even past the guard, the LaTeX-only math-verify path treats Python as symbols."""
    marker = tmp_path / "pwned"
    code = f"__import__('os').system('touch {marker}')"
    assert math_reward._math_verify_equal(code, ["0"]) is False
    assert math_reward._math_verify_equal(f"eval(\"open('{marker}','w')\")", ["0"]) is False
    assert not marker.exists()


def test_sandbox_survives_a_kill():
    assert compute_math_score(respond("9^{9^{9^{9}}}"), "3", timeout_s=1.0) == 0.0
    assert compute_math_score(respond("\\frac{6}{4}"), "1.5", timeout_s=TIMEOUT_S) == 1.0


def test_math_verify_never_reaches_parse_expr(monkeypatch):
    """sympy's parse_expr evaluates Python; math-verify calls it only for plain-text
    expressions, which we never ask for."""
    import math_verify.parser

    calls = []
    monkeypatch.setattr(math_verify.parser, "parse_expr", lambda *a, **k: calls.append(a))
    math_verify.parser.parse_expr_cached.cache_clear()
    for answer in ("1/2 + 3*4", "(1+2)^3", "\\frac{1}{2}", "x^2 - 1", "2*(3+4)"):
        math_reward._math_verify_equal(answer, ["1"])
    assert calls == []
