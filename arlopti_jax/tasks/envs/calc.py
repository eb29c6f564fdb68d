"""``calc``: arithmetic with large operands (`tasks.calc`'s problems), the exact calculator as the tool.

    load_environment("calc")                                         # Qwen-style JSON calls
    load_environment("calc", {"call_style": "text", "call_open": "<calc>", "call_close": "</calc>"})

The tool is ``calculator`` with one string argument ``expression`` (`tools.calculator`: exact
rational arithmetic, + - * / // % ** and parentheses); its observation is the value, or
``Error: REASON``. A turn without a call is the final answer, graded as the ``calc`` data source
is in the reward registry (``math_reward.compute_integer_score``: 1 for the right integer written
out in ``\\boxed{}``, never an expression equal to it), so the same problems trained without the
tool score the same way. Parameters: those of
`base.ToolEnvironment`, and ``max_digits`` (the calculator's bound on a number's digits).
"""

from __future__ import annotations

from arlopti_jax.tasks.envs.base import ToolEnvironment
from arlopti_jax.tasks.math_reward import compute_integer_score
from arlopti_jax.tasks.tools.calculator import CalculatorLimits, calculate
from arlopti_jax.tasks.tools.result import ToolResult


class CalcEnvironment(ToolEnvironment):
    tool_name = "calculator"
    argument = "expression"
    description = "An exact calculator for + - * / // % ** and parentheses on integers and decimals."
    argument_description = "the arithmetic expression, for example (48213 * 907) - 51"

    def __init__(self, *, max_digits: int = 1000, **params):
        super().__init__(**params)
        self.limits = CalculatorLimits(max_digits=max_digits)

    def run_tool(self, argument: str) -> ToolResult:
        return calculate(argument, self.limits)

    def grade(self, answer: str) -> float:
        return compute_integer_score(answer, self.truth)
