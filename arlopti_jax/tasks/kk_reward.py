"""K&K reward: the Logic-RL scheme used by the reference (docs/paper.md, "K&K reward").

    format  : '<think>', '</think>', '<answer>', '</answer>' each exactly once, in that
              order, counting the prompt's opening '<think>'       -> +1, else -1
    answer  : every person's role parsed from the answer block and equal to the key
              -> +2; parsed but different -> -1.5; not parsed, or format failed -> -2
    total   : 3 (correct), -0.5 (format ok, wrong), -1 (format ok, unparseable),
              -3 (format failed)

`solution_str` is the decoded prompt and response together (verl's convention): the
part checked is everything after the last '<|im_start|>assistant', which includes the
prompt's opening '<think>' when the prompt holds one. A string with no assistant
marker is taken as the response alone, with the opening '<think>' in the prompt.

Parsing the answer block: each person of the key is looked up by name,
'NAME is a knight|knave' (case-insensitive, whole words; the '(k)' numbering is
optional, as in Logic-RL), and the block must mention 'knight'/'knave' exactly as many
times as there are people, so an answer that lists both roles for someone fails.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

ASSISTANT_MARKER = "<|im_start|>assistant"
TAGS = ("<think>", "</think>", "<answer>", "</answer>")

FORMAT_OK, FORMAT_FAILED = 1.0, -1.0
ANSWER_CORRECT, ANSWER_WRONG, ANSWER_UNPARSEABLE = 2.0, -1.5, -2.0
CORRECT_SCORE = FORMAT_OK + ANSWER_CORRECT  # 3.0: the accuracy criterion

_KEY_LINE = re.compile(r"\(\s*\d+\s*\)\s*(.+?)\s+is\s+a\s+(knight|knave)\b", re.IGNORECASE)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class KKOutcome:
    format_ok: bool
    parsed: dict[str, str] | None  # name -> 'knight' | 'knave', None if unparseable
    correct: bool
    score: float


def response_region(solution_str: str) -> str:
    """The text the format check looks at, with the opening '<think>' included."""
    head, marker, tail = solution_str.rpartition(ASSISTANT_MARKER)
    if marker:
        return tail
    return "<think>" + solution_str


def format_ok(region: str) -> bool:
    """Each tag exactly once, and in the order <think> </think> <answer> </answer>."""
    if any(region.count(tag) != 1 for tag in TAGS):
        return False
    positions = [region.index(tag) for tag in TAGS]
    return positions == sorted(positions)


def answer_key(ground_truth: Any) -> dict[str, str]:
    """name -> role from the ground truth: a dict holding 'solution_text_format', or that text."""
    text = ground_truth
    if isinstance(ground_truth, Mapping):
        if "solution_text_format" not in ground_truth:
            raise ValueError("K&K ground truth has no 'solution_text_format' key")
        text = ground_truth["solution_text_format"]
    if not isinstance(text, str):
        raise TypeError(f"K&K ground truth must be a dict or str, got {type(ground_truth).__name__}")
    key = {m.group(1).strip(): m.group(2).lower() for m in _KEY_LINE.finditer(text)}
    if not key:
        raise ValueError(f"K&K ground truth has no '(k) NAME is a knight|knave' lines: {text!r}")
    return key


def parse_answer(answer: str, names: list[str]) -> dict[str, str] | None:
    """name -> role for every expected name, or None when the block cannot be read."""
    lowered = answer.lower()
    if lowered.count("knight") + lowered.count("knave") != len(names):
        return None
    parsed = {}
    for name in names:
        m = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+(knight|knave)\b", answer, re.IGNORECASE)
        if m is None:
            return None
        parsed[name] = m.group(1).lower()
    return parsed


def kk_outcome(solution_str: str, ground_truth: Any) -> KKOutcome:
    key = answer_key(ground_truth)
    region = response_region(solution_str)
    if not format_ok(region):
        return KKOutcome(False, None, False, FORMAT_FAILED + ANSWER_UNPARSEABLE)
    answer = _ANSWER_BLOCK.search(region).group(1).strip()
    parsed = parse_answer(answer, list(key)) if answer else None
    if parsed is None:
        return KKOutcome(True, None, False, FORMAT_OK + ANSWER_UNPARSEABLE)
    correct = parsed == key
    return KKOutcome(True, parsed, correct, FORMAT_OK + (ANSWER_CORRECT if correct else ANSWER_WRONG))


def kk_answer(solution_str: str, ground_truth: Any) -> tuple[tuple[str, str], ...] | None:
    """The response's answer for majority voting: its parsed assignment as sorted (name, role)
    pairs, or None when the format check or the parsing fails."""
    parsed = kk_outcome(solution_str, ground_truth).parsed
    return None if parsed is None else tuple(sorted(parsed.items()))


def compute_kk_score(solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The Logic-RL total: 3, -0.5, -1 or -3 (see the module docstring)."""
    return kk_outcome(solution_str, ground_truth).score
