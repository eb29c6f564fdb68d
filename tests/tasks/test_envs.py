"""The environment API: loading by name with one-line errors, tool-call parsing, the runner and pool
that keep a failing or hanging environment from ending the run, and scripted calc episodes."""

import json
import textwrap
import threading
import time

import pytest

from arlopti_jax.runtime.startup import ConfigError
from arlopti_jax.tasks.envs import (
    BUILTIN, INFO_COUNTS, CallFormat, EnvironmentLoadError, Step, StepPool, load_environment, parse_calls, run_reset,
    run_step,
)

PROBLEM = {"prompt_text": "What is 48213 * 9071?", "data_source": "calc", "ground_truth": str(48213 * 9071),
           "extra_info": {}, "source": "data/calc/train.parquet", "row": 17}


def qwen_call(name: str, **arguments) -> str:
    return f"Let me compute.\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---------------------------------------------------------------- loading
@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(textwrap.dedent("""
        from arlopti_jax.tasks.envs import Environment, Step

        class Echo(Environment):
            def __init__(self, prefix="echo: "):
                self.prefix = prefix
            def reset(self, problem):
                return "start"
            def step(self, action):
                return Step(self.prefix + action, {"turn": 0.5}, False, {})

        class NoStep(Environment):
            def reset(self, problem):
                return None

        class DuckNoStep:
            def reset(self, problem):
                return None

        def broken_factory():
            raise RuntimeError("no licence for the maze")

        class Raises(Environment):
            def reset(self, problem):
                raise KeyError("ground_truth")
            def step(self, action):
                raise ZeroDivisionError("the tool divided by zero")

        class BadReturn(Environment):
            def reset(self, problem):
                return None
            def step(self, action):
                return ("obs", 1.0, False) if action == "tuple" else Step("x", {"score": float("nan")}, False, {})

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_envs"


def test_builtins_and_user_classes_load(user_module):
    calc = load_environment("calc")
    assert calc.stop_strings == ("</tool_call>",)
    assert calc.tools[0]["function"]["name"] == "calculator"
    assert calc.tools[0]["function"]["parameters"]["required"] == ["expression"]
    text = load_environment("calc", {"call_style": "text", "call_open": "<calc>", "call_close": "</calc>"})
    assert text.stop_strings == ("</calc>",) and "<calc>EXPRESSION</calc>" in text.instructions
    for spec in (f"{user_module}:Echo", f"{user_module}.Echo"):
        factory = load_environment(spec, {"prefix": "> "})
        env = factory()
        assert env is not factory() and env.reset({}) == "start" and env.step("hi").observation == "> hi"


@pytest.mark.parametrize("spec,params,message", [
    ("not a path!", {}, f"not a built-in ({', '.join(BUILTIN)}) and not an import path"),
    ("nosuch_module_xyz:Env", {}, "cannot import module 'nosuch_module_xyz' (ModuleNotFoundError: No module named"),
    ("my_envs:Missing", {}, "module 'my_envs' has no attribute 'Missing'"),
    ("my_envs.NOT_CALLABLE", {}, "names a int, not a class or a function"),
    ("my_envs:NoStep", {}, "NoStep does not define step"),
    ("my_envs:DuckNoStep", {}, "a DuckNoStep has no step method"),
    ("my_envs:broken_factory", {}, "making the environment raised RuntimeError: no licence for the maze"),
    ("my_envs:Echo", {"colour": 1}, "cannot make the environment with parameters {'colour': 1} (TypeError"),
    ("calc", {"call_style": "xml"}, "making the environment raised ValueError: tool-call style 'xml'"),
    ("calc", {"call_open": "```python", "call_close": "```"}, "must not occur inside the opening one"),
])
def test_load_errors_are_one_line_naming_the_environment(user_module, spec, params, message):
    with pytest.raises(EnvironmentLoadError) as err:
        load_environment(spec, params, field="config.env.name")
    text = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in text
    assert text.startswith(f"config.env.name={spec!r}") and message in text, text


# ---------------------------------------------------------------- calls
def test_json_calls_and_their_errors():
    tools = {"calculator": "expression"}
    fmt = CallFormat()
    [ok] = parse_calls(qwen_call("calculator", expression="2*3"), fmt, tools)
    assert (ok.name, ok.arguments, ok.error) == ("calculator", {"expression": "2*3"}, None)
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    assert parse_calls(as_string, fmt, tools)[0].arguments == {"expression": "1+1"}
    two = parse_calls(qwen_call("calculator", expression="1") + " and " + qwen_call("calculator", expression="2"),
                      fmt, tools)
    assert [c.arguments["expression"] for c in two] == ["1", "2"]
    assert parse_calls("The answer is \\boxed{6}.", fmt, tools) == []
    cases = {
        "<tool_call>{name: calculator}</tool_call>": "not valid JSON",
        "<tool_call>[1, 2]</tool_call>": "must be a JSON object",
        '<tool_call>{"name": "python", "arguments": {}}</tool_call>': "unknown tool 'python'; the tools are: calc",
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>': "needs the string argument",
        '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>': "needs the string argument",
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "calculator", "arguments": "nope"}</tool_call>': "are not a JSON object",
        '<tool_call>{"name": "calculator"': "has no closing </tool_call>",
        "<tool_call>" + "[" * 100_000 + "</tool_call>": "longer than 20000 characters",
        "<tool_call>" + "[" * 19_000 + "</tool_call>": "not valid JSON",  # deep nesting: a RecursionError caught
        "<tool_call>" + "1" * 5000 + "</tool_call>": "not valid JSON",  # int digits limit
    }
    for text, error in cases.items():
        [call] = parse_calls(text, fmt, tools)
        assert call.error is not None and error in call.error, (text[:60], call.error)


def test_text_calls_take_the_one_argument():
    fmt = CallFormat("text", "<calc>", "</calc>")
    calls = parse_calls("first <calc> 2 * 3 </calc> then <calc>7-1</calc>", fmt, {"calculator": "expression"})
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2 * 3"}),
                                                      ("calculator", {"expression": "7-1"})]
    assert "no closing </calc>" in parse_calls("<calc>2*3", fmt, {"calculator": "expression"})[0].error


# ---------------------------------------------------------------- runner and pool
def test_exceptions_and_bad_returns_end_the_episode_with_a_message(user_module, caplog):
    env = load_environment(f"{user_module}:Raises")()
    first = run_reset(env, PROBLEM, problem_id="train.parquet:17", env_name="maze")
    assert first.done and first.observation is None and first.reward == {} and first.info["env_errors"] == 1
    assert first.info["error"] == "environment 'maze' on problem 'train.parquet:17' at turn 0: reset raised " \
                                  "KeyError: 'ground_truth'"
    step = run_step(env, "go", problem_id="train.parquet:17", turn=3, env_name="maze")
    assert step.done and step.reward == {} and step.info["env_errors"] == 1
    assert step.info["error"] == ("environment 'maze' on problem 'train.parquet:17' at turn 3: step raised "
                                  "ZeroDivisionError: the tool divided by zero")
    assert step.info["error"] in caplog.text
    bad = load_environment(f"{user_module}:BadReturn")()
    assert "returned a tuple, not a Step" in run_step(bad, "tuple", problem_id=1, turn=1).info["error"]
    assert "reward part 'score' = nan" in run_step(bad, "nan", problem_id=1, turn=1).info["error"]
    ok = run_step(load_environment(f"{user_module}:Echo")(), "x", problem_id=1, turn=1)
    assert (ok.observation, ok.reward, ok.done) == ("echo: x", {"turn": 0.5}, False)


class Sleepy:
    """Steps that take ``action`` seconds; 'forever' never returns (until released)."""

    release = threading.Event()

    def reset(self, problem):
        return None

    def step(self, action):
        if action == "forever":
            self.release.wait()
        else:
            time.sleep(float(action))
        return Step(f"slept {action}", {}, False, {})


def test_pool_returns_within_its_limit_whatever_the_steps_do():
    with StepPool("sleepy", max_workers=8) as pool:
        start = time.monotonic()
        steps = pool.steps([(Sleepy(), a, i, 1) for i, a in enumerate(["0", "forever", "0.05", "forever", "0"])],
                           timeout_s=1.0)
        elapsed = time.monotonic() - start
        assert elapsed < 1.5, elapsed
        assert [s.observation for s in steps] == ["slept 0", None, "slept 0.05", None, "slept 0"]
        stuck = steps[1]
        assert stuck.done and stuck.info["timed_out"] and stuck.info["env_errors"] == 1
        assert stuck.info["error"] == "environment 'sleepy' on problem 1 at turn 1: step did not return within 1 s"
        assert pool.given_up == 2
        # the pool goes on with fresh threads in place of the stuck ones; more jobs than workers queue
        steps = pool.steps([(Sleepy(), "0.02", i, 2) for i in range(40)], timeout_s=5.0)
        assert [s.observation for s in steps] == ["slept 0.02"] * 40
        # a job no worker could start before the deadline is given up as well
        steps = pool.steps([(Sleepy(), "0.5", i, 3) for i in range(32)], timeout_s=1.2)
        assert any("could not start" in (s.info.get("error") or "") for s in steps)
        assert all(s.observation == "slept 0.5" or s.info["timed_out"] for s in steps)
    Sleepy.release.set()


# ---------------------------------------------------------------- calc episodes
def test_calc_episode_scripted():
    env = load_environment("calc", {"tool_error_penalty": 0.1})()
    assert env.reset(PROBLEM) is None
    step = env.step(qwen_call("calculator", expression="48213 * 9071"))
    assert (step.observation, step.done, step.reward) == (str(48213 * 9071), False, {"tool_error": 0.0})
    assert step.info["tool_calls"] == 1 and step.info["tool_errors"] == 0 and set(INFO_COUNTS) <= set(step.info)
    bad = env.step("<tool_call>\n{\"name\": \"calculator\", \"arguments\": {expression: 1}}\n</tool_call>")
    assert bad.observation.startswith("Error: the tool call is not valid JSON") and not bad.done
    assert bad.reward == {"tool_error": -0.1} and bad.info["tool_errors"] == 1
    div = env.step(qwen_call("calculator", expression="1/0"))
    assert div.observation == "Error: division by zero" and div.info["tool_errors"] == 1
    right = env.step(f"So 48213 * 9071 = {48213 * 9071}. The answer is \\boxed{{{48213 * 9071}}}.")
    assert (right.observation, right.done, right.reward) == (None, True, {"answer": 1.0})
    env.reset(PROBLEM)
    wrong = env.step("The answer is \\boxed{437000000}.")
    assert (wrong.done, wrong.reward) == (True, {"answer": 0.0})
    assert env.step("I do not know.").reward == {"answer": 0.0}  # no boxed answer
    assert env.step("The answer is \\boxed{48213 * 9071}.").reward == {"answer": 0.0}  # the question restated


def test_calc_observations_several_calls_caps_and_text_markers():
    env = load_environment("calc", {"max_calls_per_turn": 2, "max_observation_chars": 40})()
    env.reset(PROBLEM)
    three = env.step("".join(qwen_call("calculator", expression=e) for e in ("1+1", "2**3", "9-1")))
    full = "[1] 2\n[2] 8\n[3] Error: not run: at most 2 tool calls per turn"
    assert three.observation == full[:40] + f"\n[... {len(full) - 40} more characters cut]"
    assert three.info["tool_calls"] == 3 and three.info["tool_errors"] == 1 and three.reward == {}
    long = env.step(qwen_call("calculator", expression="10**100"))
    assert long.observation == "1" + "0" * 39 + "\n[... 61 more characters cut]"
    text = load_environment("calc", {"call_style": "text", "call_open": "<calc>", "call_close": "</calc>"})()
    text.reset(PROBLEM)
    assert text.step("I use <calc>48213*9071</calc>").observation == str(48213 * 9071)
    assert text.step(qwen_call("calculator", expression="1")).done  # the other format is no call here


# ---------------------------------------------------------------- math_python episodes
MATH = {"prompt_text": "What is 1/2 + 1/3?", "data_source": "math_dsr", "ground_truth": "\\frac{5}{6}",
        "extra_info": {}, "source": "data/math/train.parquet", "row": 3}


def test_math_python_episode_scripted():
    factory = load_environment("math_python", {"wall_s": 1.5, "cpu_s": 1, "site_packages": False})
    assert factory.tools[0]["function"]["name"] == "python" and factory.stop_strings == ("</tool_call>",)
    env = factory()
    env.reset(MATH)
    ran = env.step(qwen_call("python", code="from fractions import Fraction\nprint(Fraction(1, 2) + Fraction(1, 3))"))
    assert (ran.observation, ran.done, ran.info["tool_calls"], ran.info["tool_errors"]) == ("5/6", False, 1, 0)
    assert ran.info["tool_seconds"] > 0
    crashed = env.step(qwen_call("python", code="print('partial')\n1 / 0"))
    assert crashed.observation.startswith("partial\nTraceback (most recent call last):")
    assert crashed.observation.endswith("ZeroDivisionError: division by zero\n"
                                        "Error: exit status 1: ZeroDivisionError: division by zero")
    assert crashed.info["tool_errors"] == 1 and crashed.info["tool_timeouts"] == 0
    loop = env.step(qwen_call("python", code="while True:\n    pass"))
    assert loop.observation in ("Error: timed out after 1.5 s", "Error: CPU time limit (1 s) exceeded")
    assert loop.info["tool_timeouts"] == 1 and loop.info["tool_errors"] == 1 and not loop.done
    assert env.step(qwen_call("python", code="x = 1")).observation == "(no output)"
    two = env.step(qwen_call("python", code="print(1)") + qwen_call("python", code="print(2)"))
    assert two.observation == "[1] 1\n[2] Error: not run: at most 1 tool calls per turn"
    right = env.step("So the sum is $\\boxed{\\dfrac{5}{6}}$.")  # math-verify: \dfrac equals \frac
    assert (right.done, right.reward) == (True, {"answer": 1.0})
    env.reset(MATH)
    assert env.step("The answer is \\boxed{0.8}.").reward == {"answer": 0.0}


class ScriptedSandbox:
    """Another CodeExecutor backend (as a container or a sandbox service would be): it answers every
    program with the limits it was made with."""

    def __init__(self, limits):
        self.limits = limits

    def run(self, code, timeout_s=None):
        from arlopti_jax.tasks.tools import ToolResult

        return ToolResult(f"remote ran {len(code)} bytes within {self.limits.wall_s:g} s", None, 0.01)


def test_math_python_checks_its_sandbox_at_start_up():
    """The local sandbox runs one program when the environment is first made with its limits: one it
    cannot run in (here: too little memory for the interpreter) stops the start-up with the reason."""
    with pytest.raises(EnvironmentLoadError) as err:
        load_environment("math_python", {"memory_bytes": 4 << 20}, field="config.env.name")
    assert str(err.value).startswith("config.env.name='math_python': making the environment raised RuntimeError: "
                                     "the Python tool cannot run a program here: ")
    assert "\n" not in str(err.value)


def test_math_python_takes_another_sandbox_by_import_path():
    env = load_environment("math_python", {"executor": f"{__name__}:ScriptedSandbox", "wall_s": 7})()
    env.reset(MATH)
    assert env.step(qwen_call("python", code="print(1)")).observation == "remote ran 8 bytes within 7 s"
    with pytest.raises(EnvironmentLoadError, match="executor='nowhere_xyz:Box': cannot import module"):
        load_environment("math_python", {"executor": "nowhere_xyz:Box"})


def test_the_pool_runs_many_episodes_tool_calls_at_once():
    """Eight math_python episodes whose programs each take 0.6 s: their steps overlap in the pool, each
    with its own result, and one that overruns the sandbox's limit is a timeout, not a wait."""
    factory = load_environment("math_python", {"wall_s": 1.5, "cpu_s": 1, "site_packages": False})
    envs = [factory() for _ in range(8)]
    with StepPool("math_python", max_workers=8) as pool:
        assert all(s.observation is None and not s.done for s in pool.resets([(e, MATH, i) for i, e in
                                                                               enumerate(envs)], timeout_s=5))
        codes = [f"import time\ntime.sleep(0.6)\nprint({i} * 11)" for i in range(7)] + ["import time\ntime.sleep(60)"]
        start = time.monotonic()
        steps = pool.steps([(e, qwen_call("python", code=c), i, 1) for i, (e, c) in enumerate(zip(envs, codes))],
                           timeout_s=10)
        elapsed = time.monotonic() - start
    assert [s.observation for s in steps[:7]] == [str(i * 11) for i in range(7)]
    assert steps[7].observation == "Error: timed out after 1.5 s" and steps[7].info["tool_timeouts"] == 1
    assert elapsed < 1.5 + 2.0, elapsed  # the slowest call's limit and a margin, not 7 * 0.6 s + 1.5 s
