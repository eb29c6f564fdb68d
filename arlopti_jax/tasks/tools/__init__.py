"""Tools an environment runs for the policy: an exact calculator and a Python executor.

    from arlopti_jax.tasks.tools import ToolResult, calculate, PythonExecutor, SandboxLimits

    calculate("12345 * 6789 + 1/3") -> ToolResult(output='251810106/3', error=None, seconds=...)
    PythonExecutor(SandboxLimits(wall_s=5)).run("print(2**10)") -> ToolResult(output='1024\\n', ...)

Every tool call gives a `ToolResult`; a tool never raises on its input (a parse error, a division
by zero, a program that crashes, loops or overruns is a result with ``error`` set). Modules:
result (ToolResult), calculator (the parser and exact arithmetic), sandbox (the executor interface and the local
process backend), _sandbox_child (the script that applies the limits inside the child process).
"""

from arlopti_jax.tasks.tools.calculator import CalculatorLimits, calculate
from arlopti_jax.tasks.tools.result import ToolResult
from arlopti_jax.tasks.tools.sandbox import CodeExecutor, Isolation, PythonExecutor, SandboxLimits

__all__ = ["CalculatorLimits", "CodeExecutor", "Isolation", "PythonExecutor", "SandboxLimits", "ToolResult",
           "calculate"]
