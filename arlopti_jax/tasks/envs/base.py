"""The environment contract, and the base of the built-in tool environments.

    class Environment:                                  # subclass it, or duck-type it
        def reset(self, problem: dict) -> str | None    # the first observation, or None for none
        def step(self, action: str) -> Step             # the policy's text for this turn
        stop_strings: tuple[str, ...] = ()              # where the sampler ends a turn (a call's close)
        tools: list[dict] = []                          # JSON schemas for a chat template's ``tools=``
        instructions: str | None = None                 # how to call the tools, for templates without them

    @dataclasses.dataclass
    class Step:
        observation: str | None   # the tool's output to append; None when the episode ends
        reward: dict[str, float]  # reward parts of this turn (the collector sums them over the episode)
        done: bool
        info: dict                # counts of this turn: the INFO_COUNTS keys, plus 'error' (a message)

One environment object runs one episode: the collector makes one per episode (the factory of
`loading.load_environment`), calls ``reset`` with the problem, then ``step`` with each turn's
text until a Step says done. ``problem`` is the data row as `tasks.data.PromptDataset` gives it:
'prompt_text', 'prompt_ids', 'data_source', 'ground_truth', 'extra_info', 'source', 'row' (a raw
parquet row's ``reward_model.ground_truth`` is read too). The episode's reward is the sum of every
Step's reward parts; the final answer's score is the part 'answer', given when done. ``info``'s
counts (`INFO_COUNTS`) are summed per episode by the collector: tool calls, tool errors (malformed
calls included), timeouts, tool seconds, and env_errors (set by the runner when reset or step
raised or overran: `runner.run_step`).

`ToolEnvironment` is the built-ins' shape: one tool, calls found by `calls.parse_calls`, a turn
without a call is the final answer, graded by ``grade`` (the math reward by default: ``\\boxed{}``, as
the single-turn tasks are; ``calc``'s is the integer reward, as its data source's). Its parameters:
the call format (``call_style``, ``call_open``, ``call_close``), ``max_calls_per_turn`` (later calls
in the turn are answered with an error), ``max_observation_chars`` (longer observations are cut,
with a marker saying how much), ``tool_error_penalty`` (a reward part 'tool_error' of minus this per
failed call; default 0) and ``grading_timeout_s``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from arlopti_jax.tasks.envs.calls import CallFormat, ToolCall, parse_calls
from arlopti_jax.tasks.math_reward import compute_math_score
from arlopti_jax.tasks.tools.result import ToolResult

INFO_COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds", "env_errors")
TRUNCATION_MARKER = "\n[... {n} more characters cut]"


@dataclasses.dataclass
class Step:
    observation: str | None
    reward: dict[str, float] = dataclasses.field(default_factory=dict)
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
    """The contract (module docstring). A subclass defines reset and step; one that leaves either
    out cannot be made (and `load_environment` says which is missing)."""

    stop_strings: tuple[str, ...] = ()
    tools: list[dict] = []
    instructions: str | None = None

    @abc.abstractmethod
    def reset(self, problem: dict) -> str | None:
        """Start an episode on ``problem``; the first observation, or None."""

    @abc.abstractmethod
    def step(self, action: str) -> Step:
        """The outcome of the policy's text for one turn."""


def ground_truth(problem: dict) -> Any:
    """The problem's ground truth: PromptDataset's 'ground_truth', or a raw row's reward_model's."""
    if problem.get("ground_truth") is not None:
        return problem["ground_truth"]
    truth = (problem.get("reward_model") or {}).get("ground_truth")
    if truth is None:
        raise KeyError("the problem has no 'ground_truth' (nor 'reward_model.ground_truth')")
    return truth


def cut(text: str, max_chars: int) -> str:
    """``text`` up to ``max_chars`` characters, the rest replaced by a marker saying how much."""
    return text if len(text) <= max_chars else text[:max_chars] + TRUNCATION_MARKER.format(n=len(text) - max_chars)


class ToolEnvironment(Environment):
    """One tool, answer graded by the math reward (module docstring). Subclasses set ``tool_name``,
    ``argument`` (the tool's one string argument), ``description`` and ``argument_description``, and
    define ``run_tool(argument) -> ToolResult``."""

    tool_name: str = ""
    argument: str = ""
    description: str = ""
    argument_description: str = ""

    def __init__(self, *, call_style: str = "json", call_open: str = "<tool_call>", call_close: str = "</tool_call>",
                 max_calls_per_turn: int = 4, max_observation_chars: int = 2000, tool_error_penalty: float = 0.0,
                 grading_timeout_s: float = 5.0):
        self.format = CallFormat(call_style, call_open, call_close)
        if max_calls_per_turn < 1 or max_observation_chars < 1:
            raise ValueError(f"max_calls_per_turn={max_calls_per_turn}, max_observation_chars="
                             f"{max_observation_chars}: both must be at least 1")
        self.max_calls_per_turn = max_calls_per_turn
        self.max_observation_chars = max_observation_chars
        self.tool_error_penalty = float(tool_error_penalty)
        self.grading_timeout_s = grading_timeout_s
        self.stop_strings = self.format.stop_strings
        self.tools = [{"type": "function", "function": {
            "name": self.tool_name, "description": self.description,
            "parameters": {"type": "object", "required": [self.argument],
                           "properties": {self.argument: {"type": "string", "description": self.argument_description}}},
        }}]
        self.instructions = self._instructions()
        self.truth: Any = None

    def _instructions(self) -> str:
        if self.format.style == "json":
            example = f'{{"name": "{self.tool_name}", "arguments": {{"{self.argument}": "..."}}}}'
            return (f"{self.description} To call it, write {self.format.open}\n{example}\n{self.format.close}; "
                    "its output follows. Give the final answer as \\boxed{ANSWER}.")
        return (f"{self.description} To call it, write {self.format.open}{self.argument.upper()}{self.format.close}; "
                "its output follows. Give the final answer as \\boxed{ANSWER}.")

    @abc.abstractmethod
    def run_tool(self, argument: str) -> ToolResult:
        """The tool on its one argument."""

    def grade(self, answer: str) -> float:
        """The final answer's score: 1 for the right ``\\boxed{}`` answer (``math_reward``), else 0."""
        return compute_math_score(answer, self.truth, timeout_s=self.grading_timeout_s)

    def reset(self, problem: dict) -> str | None:
        self.truth = ground_truth(problem)
        return None

    def _answer(self, call: ToolCall, index: int) -> ToolResult:
        if call.error is not None:
            return ToolResult("", call.error)
        if index >= self.max_calls_per_turn:
            return ToolResult("", f"not run: at most {self.max_calls_per_turn} tool calls per turn")
        return self.run_tool(call.arguments[self.argument])

    def observation(self, results: list[ToolResult]) -> str:
        """The turn's observation: each call's output ('(no output)' when it printed nothing), then
        ``Error: REASON`` if it failed; numbered when there are several."""
        parts = []
        for i, r in enumerate(results):
            text = r.output.rstrip("\n")
            if r.error is not None:
                text = f"{text}\nError: {r.error}" if text.strip() else f"Error: {r.error}"
            text = text if text.strip() else "(no output)"
            parts.append(text if len(results) == 1 else f"[{i + 1}] {text}")
        return cut("\n".join(parts), self.max_observation_chars)

    def step(self, action: str) -> Step:
        calls = parse_calls(action, self.format, {self.tool_name: self.argument})
        if not calls:
            return Step(None, {"answer": float(self.grade(action))}, True, dict.fromkeys(INFO_COUNTS, 0))
        results = [self._answer(call, i) for i, call in enumerate(calls)]
        errors = sum(not r.ok for r in results)
        info = {"tool_calls": len(calls), "tool_errors": errors, "tool_timeouts": sum(r.timed_out for r in results),
                "tool_seconds": sum(r.seconds for r in results), "env_errors": 0}
        reward = {"tool_error": -self.tool_error_penalty * errors} if self.tool_error_penalty else {}
        return Step(self.observation(results), reward, False, info)
