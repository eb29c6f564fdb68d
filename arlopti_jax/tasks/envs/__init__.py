"""Multi-turn environments: the policy's text in, a tool's output (or the episode's end) out.

    from arlopti_jax.tasks.envs import Environment, Step, load_environment, run_step, StepPool

    factory = load_environment("calc")           # or 'math_python', or 'my_pkg.envs:MyEnv'
    env = factory()                              # one per episode
    first = env.reset(problem)                   # problem: a PromptDataset row; str or None
    step = env.step(action_text)                 # Step(observation, reward, done, info)

Modules: base (the contract: Environment, Step, INFO_COUNTS; ToolEnvironment, the built-ins'
base), calls (tool calls in the text: Qwen's JSON in <tool_call>, or plain text between markers),
loading (load_environment, EnvironmentLoadError, the built-ins), runner (run_reset, run_step,
StepPool: a failing or hanging environment ends its episode, never the run), calc and
math_python (the built-in environments).
"""

from arlopti_jax.tasks.envs.base import INFO_COUNTS, Environment, Step, ToolEnvironment
from arlopti_jax.tasks.envs.calls import CallFormat, ToolCall, parse_calls
from arlopti_jax.tasks.envs.loading import BUILTIN, EnvironmentFactory, EnvironmentLoadError, load_environment
from arlopti_jax.tasks.envs.runner import StepPool, run_reset, run_step

__all__ = ["BUILTIN", "INFO_COUNTS", "CallFormat", "Environment", "EnvironmentFactory", "EnvironmentLoadError",
           "Step", "StepPool", "ToolCall", "ToolEnvironment", "load_environment", "parse_calls", "run_reset",
           "run_step"]
