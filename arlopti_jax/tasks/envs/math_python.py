"""``math_python``: the math task (DeepScaleR-style ``\\boxed{}`` answers) with a Python interpreter as the tool.

    load_environment("math_python")                                   # Qwen-style JSON calls
    load_environment("math_python", {"call_style": "text", "call_open": "<python>", "call_close": "</python>"})
    load_environment("math_python", {"executor": "my_pkg.sandboxes:make_executor"})   # another sandbox

The tool is ``python`` with one string argument ``code``: a whole program, run by a CodeExecutor
(by default `tools.sandbox.PythonExecutor`: a fresh limited process per call, nothing carried over
between calls; what it defends against and what not is in its docstring). The observation is what
the program printed (stdout, then stderr), and ``Error: REASON`` when it failed or ran out of time.
A turn without a call is the final answer, graded by the math reward like the math data sources
(aime_dsr, amc_dsr, math_dsr, deepscaler) are in the reward registry.

Parameters: those of `base.ToolEnvironment` (``max_calls_per_turn`` defaults to 1 here, so that one
step lasts at most one program's limit), the sandbox's limits ``wall_s``, ``cpu_s``,
``memory_bytes`` and ``site_packages`` (default True: sympy and numpy importable), and
``executor``: a CodeExecutor, or the import path of a callable that takes the SandboxLimits and
returns one, for a real sandbox (a container, gVisor, a service) in place of the local process.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from arlopti_jax.tasks.envs.base import ToolEnvironment
from arlopti_jax.tasks.envs.loading import resolve
from arlopti_jax.tasks.tools.result import ToolResult
from arlopti_jax.tasks.tools.sandbox import CodeExecutor, PythonExecutor, SandboxLimits


log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def local_executor(limits: SandboxLimits) -> PythonExecutor:
    """The local process backend for ``limits``, one per process, checked once when first made (a
    program that cannot run here stops the start-up with the reason, instead of failing every call)."""
    executor = PythonExecutor(limits)
    isolation = executor.check()
    log.info("Python tool: seccomp filter %s, user id %d, private /tmp %s%s", "on" if isolation.seccomp else "off",
             isolation.uid, isolation.private_tmp, "".join(f"; {n}" for n in isolation.notes))
    return executor


def make_executor(executor: Any, limits: SandboxLimits) -> CodeExecutor:
    """``executor`` as a CodeExecutor: None -> the local process backend (`local_executor`); an import
    path -> what the callable it names returns for ``limits``; any object with a ``run`` method -> itself."""
    if executor is None:
        return local_executor(limits)
    if isinstance(executor, str):
        executor = resolve(executor, f"executor={executor!r}")(limits)
    if not callable(getattr(executor, "run", None)):
        raise ValueError(f"executor {executor!r} has no run(code, timeout_s) method")
    return executor


class MathPythonEnvironment(ToolEnvironment):
    tool_name = "python"
    argument = "code"
    description = ("A Python 3 interpreter: runs a program and returns what it prints. Each call is a fresh "
                   "process; nothing carries over between calls.")
    argument_description = "a complete Python program that prints its results"

    def __init__(self, *, wall_s: float = 5.0, cpu_s: float = 5.0, memory_bytes: int = 1 << 30,
                 site_packages: bool = True, executor: Any = None, max_calls_per_turn: int = 1, **params):
        super().__init__(max_calls_per_turn=max_calls_per_turn, **params)
        limits = SandboxLimits(wall_s=wall_s, cpu_s=cpu_s, memory_bytes=memory_bytes, site_packages=site_packages)
        self.executor = make_executor(executor, limits)

    def run_tool(self, argument: str) -> ToolResult:
        return self.executor.run(argument)
