"""Environments by name: the built-ins, or a user's class or factory by import path.

    factory = load_environment("calc")                               # a built-in (BUILTIN)
    factory = load_environment("my_pkg.envs:Maze", {"size": 5})     # 'package.module:Name'
    factory = load_environment("my_pkg.envs.Maze")                   # or 'package.module.Name'
    env = factory()                                                  # one per episode
    factory.stop_strings, factory.tools, factory.instructions        # read once, from a probe

The named object is a class or any callable that takes the parameters as keywords and returns an
environment (`base.Environment`, subclassed or duck-typed: callable ``reset`` and ``step``).
`load_environment` makes one probe environment at once, so that everything wrong with the name
shows at start-up, before any weights load: a malformed path, a module that does not import, a
missing attribute, something not callable, a constructor that raises (bad parameters included),
an object without ``reset`` or ``step``. Each is an `EnvironmentLoadError` (a `ConfigError`: the
commands print it as one ``error:`` line), naming ``field`` and the environment.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from arlopti_jax.runtime.startup import ConfigError

BUILTIN = {
    "calc": "arlopti_jax.tasks.envs.calc:CalcEnvironment",
    "math_python": "arlopti_jax.tasks.envs.math_python:MathPythonEnvironment",
}
METHODS = ("reset", "step")


class EnvironmentLoadError(ConfigError):
    """An environment that cannot be loaded or made; the message is one line naming it."""


@dataclasses.dataclass(frozen=True)
class EnvironmentFactory:
    """Makes one environment per episode; what the sampler and the chat template need, read once."""

    name: str  # the spec as given: 'calc', 'my_pkg.envs:Maze'
    make: Callable[..., Any]
    params: Mapping[str, Any]
    stop_strings: tuple[str, ...]
    tools: list[dict]
    instructions: str | None

    def __call__(self) -> Any:
        return self.make(**self.params)


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def resolve(spec: str, where: str) -> Callable[..., Any]:
    """The callable a built-in name or an import path names; EnvironmentLoadError (one line, starting
    ``where``) when there is none."""
    path = BUILTIN.get(spec, spec)
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr or ":" in attr or not all(p.isidentifier() for p in
                                                           module_name.split(".") + attr.split(".")):
        raise EnvironmentLoadError(f"{where}: not a built-in ({', '.join(BUILTIN)}) and not an import path "
                                   "'package.module:Name' or 'package.module.Name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises as it is imported
        raise EnvironmentLoadError(f"{where}: cannot import module {module_name!r} ({_reason(e)})") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvironmentLoadError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EnvironmentLoadError(f"{where} names a {type(obj).__name__}, not a class or a function that "
                                   "makes an environment")
    return obj


def load_environment(spec: str, params: Mapping[str, Any] | None = None, *,
                     field: str = "environment") -> EnvironmentFactory:
    """The factory of the environment ``spec`` names, made with ``params``; EnvironmentLoadError
    (one line, starting ``{field}={spec!r}``) when it cannot be (module docstring)."""
    params = dict(params or {})
    where = f"{field}={spec!r}"
    make = resolve(spec, where)
    if inspect.isabstract(make):  # a subclass of Environment that leaves a method out
        missing = sorted(make.__abstractmethods__)
        raise EnvironmentLoadError(f"{where}: {make.__name__} does not define {' or '.join(missing)} "
                                   "(an environment needs reset(problem) and step(action))")
    try:
        probe = make(**params)
    except TypeError as e:
        raise EnvironmentLoadError(f"{where}: cannot make the environment with parameters {params} "
                                   f"({_reason(e)})") from None
    except Exception as e:
        raise EnvironmentLoadError(f"{where}: making the environment raised {_reason(e)}") from None
    missing = [m for m in METHODS if not callable(getattr(probe, m, None))]
    if missing:
        raise EnvironmentLoadError(f"{where}: a {type(probe).__name__} has no {' or '.join(missing)} method "
                                   "(an environment needs reset(problem) and step(action))")
    stops = tuple(getattr(probe, "stop_strings", ()) or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise EnvironmentLoadError(f"{where}: stop_strings must be non-empty strings, got {stops!r}")
    return EnvironmentFactory(spec, make, params, stops, list(getattr(probe, "tools", None) or []),
                              getattr(probe, "instructions", None))
