"""Math reward (DeepScaleR scheme): 1.0 when the final boxed answer is right, else 0.0.

    response = text after the last '<|im_start|>assistant' (if any), then after the
               last '</think>' (if any)
    answer   = content of the last \\boxed{...} or \\fbox{...} (balanced braces)
    correct  = normalised strings equal, or math-verify finds them equivalent

Model output is untrusted. It never reaches eval/exec:
  * sympy's sympify/parse_expr evaluate Python, so they are never called on model
    text. math-verify's `parse` calls parse_expr only for its ExprExtractionConfig
    (plain-text expressions); we parse with LatexExtractionConfig alone, whose path
    (latex2sympy2_extended's grammar) builds sympy objects without evaluating text.
  * `is_safe_answer` rejects, before any parsing, answers longer than
    MAX_ANSWER_CHARS, nested deeper than MAX_BRACE_DEPTH, or holding Python-like
    tokens ('__', 'import', 'lambda', 'eval', ...).
Grading can be slow (sympy computing 9^{9^{9}} takes longer than anyone waits), and a
time limit makes a score depend on the machine's speed: so before math-verify sees an
answer, `math_guard.refusal` refuses, from the text alone, every shape that was measured
to be slow (power towers, huge numbers, deep nesting, calculus, ...), and a refused answer
scores as a wrong one. The same response then scores the same alone, in a batch, with any
number of workers and on a repeat. math-verify's own signal-based limits are off (they
made a result depend on timing); the time limit stays as the last resort: math-verify
runs in a worker process with a hard deadline (`workers.WorkerPool`), killed on overrun,
and the response then gets the batch scorer's failure score on every path (`GradingStopped`).
Inside a worker process (batched scoring) it runs in place: that process is already the
sandbox, and the batch scorer enforces the deadline.

Arithmetic problems (``tasks.arith``, ``tasks.calc``) are graded by ``compute_integer_score``: the
boxed answer must be an integer written out (``-123``, ``637519680``, or grouped ``637,519,680``)
equal to the ground truth. math-verify would accept ``\\boxed{79680 * 8001}`` as equal to 637519680,
an answer that restates the question: on ``calc`` GRPO learned exactly that in 16 steps (seed 1,
2026-12-07, ``docs/results/tool_calc.md``) and stopped calling the calculator.
"""

from __future__ import annotations

import atexit
import math
import re
import threading
from collections.abc import Sequence
from typing import Any

from arlopti_jax.tasks import workers
from arlopti_jax.tasks.math_guard import refusal

ASSISTANT_MARKER = "<|im_start|>assistant"
DEFAULT_TIMEOUT_S = 5.0
MAX_ANSWER_CHARS = 1000
MAX_BRACE_DEPTH = 20
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_UNSAFE = re.compile(
    r"__|\b(?:import|lambda|eval|exec|compile|getattr|setattr|delattr|globals|locals|"
    r"vars|builtins|subprocess|breakpoint|input)\b|\b(?:os|sys)\s*\.|\b(?:open|system)\s*\("
)


# ---------------------------------------------------------------- extraction
def final_response(solution_str: str) -> str:
    """The text graded: after the assistant marker, then after '</think>' when present."""
    text = solution_str.rpartition(ASSISTANT_MARKER)[2]
    return text.rpartition("</think>")[2]


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...}, or None (absent, unbalanced, too long).

    Braces are matched with escapes (\\{ \\}) skipped; the scan stops after
    MAX_ANSWER_CHARS, so its cost is bounded whatever the text.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    rest = text[i : i + MAX_ANSWER_CHARS + 2]
    stripped = rest.lstrip()
    if not stripped:
        return None
    if stripped[0] != "{":
        if rest[:1] != " ":  # e.g. '\boxedfoo' is another command
            return None
        m = re.match(r"[^\s$]+", stripped)  # '\boxed 5' form
        return m.group(0) if m else None
    depth, j = 0, len(rest) - len(stripped)
    while j < len(rest):
        c = rest[j]
        if c == "\\":
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return rest[len(rest) - len(stripped) + 1 : j]
        j += 1
    return None


def brace_depth(s: str) -> int:
    depth = deepest = 0
    for c in s:
        if c in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "})]":
            depth = max(0, depth - 1)
    return deepest


def is_safe_answer(s: str) -> bool:
    """Whether an answer may be handed to the LaTeX parser at all."""
    return (
        len(s) <= MAX_ANSWER_CHARS
        and all(c.isprintable() or c in "\n\t" for c in s)
        and brace_depth(s) <= MAX_BRACE_DEPTH
        and _UNSAFE.search(s) is None
    )


# ---------------------------------------------------------------- string match
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SIZING = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])")
_DROP = ("\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\ ",
         "^\\circ", "^{\\circ}", "\\%", "%", "$")  # fmt: skip


def normalize_answer(s: str) -> str:
    """A canonical string for exact comparison: LaTeX spacing and wrappers removed,
    dfrac/tfrac -> frac, '\\frac12' -> '\\frac{1}{2}', 'x=' prefix, thousands
    separators and trailing decimal zeros dropped ('142.0' -> '142', '.5' -> '0.5')."""
    s = _SIZING.sub("", _TEXT_WRAPPERS.sub(r"\1", s.strip()))
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^[a-zA-Z]=", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d*\.\d+", s):
        s = s.rstrip("0").rstrip(".")
        s = re.sub(r"^(-?)\.", r"\g<1>0.", s)
    return s


def ground_truth_strings(ground_truth: Any) -> list[str]:
    """Ground truth as answer strings: str as is, 142.0 -> '142', 0.5 -> '0.5', lists flattened."""
    if isinstance(ground_truth, bool) or ground_truth is None:
        raise TypeError(f"math ground truth must be a string or number, got {ground_truth!r}")
    if isinstance(ground_truth, (list, tuple)):
        return [g for item in ground_truth for g in ground_truth_strings(item)]
    if isinstance(ground_truth, int):
        return [str(ground_truth)]
    if isinstance(ground_truth, float):
        if not math.isfinite(ground_truth):
            raise ValueError(f"math ground truth is not finite: {ground_truth!r}")
        return [str(int(ground_truth)) if ground_truth.is_integer() else repr(ground_truth)]
    if isinstance(ground_truth, str):
        boxed = last_boxed(ground_truth) if ground_truth.lstrip().startswith(_BOX_COMMANDS) else None
        return [boxed if boxed is not None else ground_truth.strip()]
    raise TypeError(f"math ground truth must be a string or number, got {type(ground_truth).__name__}")


# ---------------------------------------------------------------- symbolic match
class GradingStopped(RuntimeError):
    """math-verify overran its time limit (or its process died): the last resort, which the
    guard keeps from happening; the batch scorer gives the response its failure score."""


def warm_up() -> None:
    """Import math-verify and build its parser once (run in each new worker)."""
    _math_verify_equal("1", ["1"])


def _math_verify_equal(answer: str, truths: Sequence[str]) -> bool:
    """math-verify on LaTeX only, without its own time limits (a result that depends on timing):
    the process around it enforces one. Runs in a worker process (see module docstring)."""
    import logging

    from math_verify import LatexExtractionConfig, parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):  # "timeout is disabled": it is ours
        logging.getLogger(name).setLevel(logging.ERROR)
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    predicted = parse("\\boxed{" + answer + "}", extraction_config=config, parsing_timeout=None)
    if not predicted:
        return False
    for truth in truths:
        gold = parse("\\boxed{" + truth + "}", extraction_config=config, parsing_timeout=None)
        if gold and verify(gold, predicted, timeout_seconds=None):
            return True
    return False


def _verify_or_false(answer: str, truths: Sequence[str]) -> bool:
    """math-verify, with an answer it raises on counted as not equal."""
    try:
        return _math_verify_equal(answer, truths)
    except Exception:
        return False


_sandbox: workers.WorkerPool | None = None
_sandbox_lock = threading.Lock()


def _get_sandbox() -> workers.WorkerPool:
    global _sandbox
    with _sandbox_lock:
        if _sandbox is None:
            _sandbox = workers.WorkerPool(
                1, preload=("arlopti_jax.tasks.math_reward:warm_up",), start_timeout_s=120.0
            )
            atexit.register(_sandbox.close)
        return _sandbox


def verify_in_sandbox(answer: str, truths: Sequence[str], timeout_s: float) -> bool:
    """math-verify in the sandbox process, killed past ``timeout_s``: GradingStopped then."""
    result = _get_sandbox().map(_verify_or_false, [(answer, truths)], timeout_s, None)[0]
    if result is None:
        raise GradingStopped(f"math grading of {answer[:40]!r} overran its {timeout_s:g} s limit")
    return bool(result)


def answers_match(answer: str, truths: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """String match, then math-verify under a hard time limit. Unsafe answers, and answers the
    guard refuses (``math_guard``), never match by math-verify."""
    if not answer.strip() or not is_safe_answer(answer):
        return False
    normalized = normalize_answer(answer)
    if normalized and any(normalized == normalize_answer(t) for t in truths):
        return True
    if refusal(answer) is not None:
        return False
    truths = [t for t in truths if is_safe_answer(t) and refusal(t) is None]
    if not truths:
        return False
    if workers.in_worker():  # the pool around this process enforces the limit
        return _verify_or_false(answer, truths)
    return verify_in_sandbox(answer, truths, timeout_s)


def math_answer(solution_str: str, ground_truth: Any = None) -> str | None:
    """The response's answer for majority voting: its last boxed answer, normalised
    (``normalize_answer``), or None when there is none or it is unsafe to parse. Equivalent
    forms that normalise differently ('0.5', '\\frac{1}{2}') count as different answers."""
    answer = last_boxed(final_response(solution_str))
    if answer is None or not answer.strip() or not is_safe_answer(answer):
        return None
    return normalize_answer(answer) or None


_INTEGER = re.compile(r"-?(?:\d+|\d{1,3}(?:,\d{3})+)")


def integer_answer(solution_str: str, ground_truth: Any = None) -> str | None:
    """The response's last boxed answer as an integer's decimal digits (``-`` for a negative one;
    spaces and thousands commas dropped), or None when it is no integer written out."""
    answer = last_boxed(final_response(solution_str))
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return None
    answer = answer.replace(" ", "")
    if not _INTEGER.fullmatch(answer):
        return None
    return str(int(answer.replace(",", "")))


def compute_integer_score(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the last boxed answer is an integer written out (``integer_answer``) equal to the
    ground truth (an integer or its digits), else 0.0. An expression is no answer, even one equal
    to the truth."""
    answer = integer_answer(solution_str)
    if answer is None:
        return 0.0
    truths = [t.replace(" ", "").replace(",", "") for t in ground_truth_strings(ground_truth)]
    return 1.0 if any(re.fullmatch(r"-?\d+", t) and int(t) == int(answer) for t in truths) else 0.0


def compute_math_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> float:
    """1.0 if the last boxed answer of the response matches the ground truth, else 0.0."""
    answer = last_boxed(final_response(solution_str))
    if answer is None:
        return 0.0
    return 1.0 if answers_match(answer, ground_truth_strings(ground_truth), timeout_s) else 0.0
