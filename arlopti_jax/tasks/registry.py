"""Reward functions by data source, user reward functions, and batched scoring.

verl's convention: a reward function is

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

where solution_str is the decoded prompt and response together. It returns the score, or a
verl-style dict: ``{'score': float, 'acc': bool, ...}`` with the score, optionally the
reward's own verdict on whether the response is correct (``acc``), and any other numbers to
log. `score_rewards` gives each item as a `Reward` (score, acc, info, failed); `score_batch`
gives the scores alone. The built-in
`compute_score` routes on data_source:

    kk_logic*                                -> kk_reward.compute_kk_score
    aime_dsr, amc_dsr, math_dsr, deepscaler  -> math_reward.compute_math_score
    arith, calc                              -> math_reward.compute_integer_score (an integer
                                                written out: no expression equal to it)

`load_reward_fn(spec)` returns that router for spec None, or the function named by a
'package.module:function' import path.

`score_rewards` / `score_batch` score many responses under a per-item time limit; an item that
raises, overruns or returns a non-finite score (or a dict without one) gets `failure_score`
and is marked failed. The limit holds on every
path, because a call that may overrun only ever runs where it can be killed:
  * a user function (anything but the built-in router) always runs in worker processes
    (workers.WorkerPool, spawn/forkserver, safe with JAX in the parent; at least one, also
    with num_workers=0), killed on overrun. In this process nothing could stop it: a
    thread cannot be killed, and a signal reaches only the main thread and cannot
    interrupt C code such as sympy's;
  * the built-in router may score in this process (num_workers=0, or fewer than
    `inline_below` items), since its cost there is bounded: K&K scoring is a linear scan
    of the response, and math grading hands its one unbounded step, math-verify, to its
    own sandbox process under the same time limit.
Pools are kept between calls and shut down at exit (`shutdown_pools`). Workers do not
import the caller's __main__ module, so scoring works from any script, `python -`, or a
notebook; only a reward function defined in __main__ itself makes them import it (the
script then needs the usual `if __name__ == "__main__":` guard; from stdin or a notebook,
define the function in a module).

`answer_for(data_source)` gives the answer extractor majority voting (maj@k) uses:
K&K's parsed assignment, math's normalised boxed answer, arithmetic's integer; None for other sources.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import logging
import math
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from arlopti_jax.tasks.kk_reward import compute_kk_score, kk_answer
from arlopti_jax.tasks.math_reward import compute_integer_score, compute_math_score, integer_answer, math_answer
from arlopti_jax.tasks.workers import WorkerPool

log = logging.getLogger(__name__)

RewardFn = Callable[..., Any]  # -> float, or a dict with 'score' (verl's)
KK_PREFIX = "kk_logic"
MATH_DATA_SOURCES = ("aime_dsr", "amc_dsr", "math_dsr", "deepscaler")
INTEGER_DATA_SOURCES = ("arith", "calc")  # tasks/arith.py, calc.py
DEFAULT_TIMEOUT_S = 10.0
# The built-in router's workers import math-verify before their first deadline starts.
_BUILTIN_PRELOAD = ("arlopti_jax.tasks.registry", "arlopti_jax.tasks.math_reward:warm_up")


def reward_for(data_source: str) -> Callable[[str, Any, Any], float]:
    """The built-in reward for a data source; ValueError naming it when there is none."""
    if data_source.startswith(KK_PREFIX):
        return compute_kk_score
    if data_source in MATH_DATA_SOURCES:
        return compute_math_score
    if data_source in INTEGER_DATA_SOURCES:
        return compute_integer_score
    raise ValueError(
        f"no reward function for data_source {data_source!r}: built-in sources are "
        f"'{KK_PREFIX}*' and {', '.join(MATH_DATA_SOURCES + INTEGER_DATA_SOURCES)}; pass a custom reward "
        "function as 'module:function'"
    )


def answer_for(data_source: str) -> Callable[[str, Any], Hashable | None] | None:
    """``answer(solution_str, ground_truth)`` of a built-in data source (None: no answer
    parsed), or None when the source has no built-in answer format."""
    if data_source.startswith(KK_PREFIX):
        return kk_answer
    if data_source in MATH_DATA_SOURCES:
        return math_answer
    if data_source in INTEGER_DATA_SOURCES:
        return integer_answer
    return None


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None, *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> float:
    """The built-in reward router (see the module docstring). ``timeout_s`` bounds math
    grading (math-verify, in a sandbox process); K&K scoring is a bounded scan."""
    reward = reward_for(data_source)
    if reward is compute_math_score:
        return float(compute_math_score(solution_str, ground_truth, extra_info, timeout_s=timeout_s))
    return float(reward(solution_str, ground_truth, extra_info))


def load_reward_fn(spec: str | None = None) -> RewardFn:
    """None -> compute_score; 'package.module:function' -> that function. ValueError, one line
    naming ``config.reward.fn``, where the spec is malformed, its module does not import or it
    names no function: commands call this at start-up, before the weights load."""
    if spec is None:
        return compute_score
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"config.reward.fn={spec!r}: must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises as it is imported
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"config.reward.fn={spec!r}: cannot import module {module_name!r} "
                         f"({type(e).__name__}: {reason})") from None
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"config.reward.fn={spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"config.reward.fn={spec!r} names a {type(fn).__name__}, not a function")
    return fn


@dataclasses.dataclass(frozen=True)
class Reward:
    """One scored item: its score, the reward's own verdict ``acc`` (None when it gave none),
    its other numeric values ``info``, and whether scoring failed (raised, overran, or returned
    no finite score: the score is then the failure score)."""

    score: float
    acc: bool | None = None
    info: dict[str, float] = dataclasses.field(default_factory=dict)
    failed: bool = False


def _finite(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def as_reward(value: Any, failure_score: float) -> Reward:
    """A reward function's return value (a score, or a dict with 'score') as a Reward."""
    if not isinstance(value, dict):
        score = _finite(value)
        return Reward(failure_score, failed=True) if score is None else Reward(score)
    score = _finite(value.get("score"))
    if score is None:
        return Reward(failure_score, failed=True)
    acc = value.get("acc")
    verdict = None if acc is None or _finite(acc) is None else bool(_finite(acc))
    info = {str(k): float(v) for k, v in value.items()
            if k not in ("score", "acc") and not isinstance(v, str) and _finite(v) is not None}
    return Reward(score, verdict, info)


_pools: dict[tuple[int, str, bool, tuple[str, ...]], WorkerPool] = {}
_pools_lock = threading.Lock()


def _pool(num_workers: int, mp_context: str, import_main: bool, preload: tuple[str, ...]) -> WorkerPool:
    with _pools_lock:
        key = (num_workers, mp_context, import_main, preload)
        if key not in _pools:
            _pools[key] = WorkerPool(num_workers, mp_context=mp_context, preload=preload, import_main=import_main)
        return _pools[key]


def shutdown_pools() -> None:
    """Stop the worker processes kept by score_batch."""
    with _pools_lock:
        for pool in _pools.values():
            pool.close()
        _pools.clear()


atexit.register(shutdown_pools)


def default_num_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) - 1))


def score_rewards(
    fn: RewardFn,
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    num_workers: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    failure_score: float = 0.0,
    inline_below: int = 8,
    mp_context: str = "spawn",
) -> list[Reward]:
    """fn(data_source, solution_str, ground_truth, extra_info) for every item, as Rewards.

    Each call is limited to `timeout_s` seconds; an item that raises, overruns or returns no
    finite score is failed and scores `failure_score`. Where items run (the module docstring says
    why): the built-in router `compute_score` in this process when num_workers=0 or there are
    fewer than `inline_below` items; otherwise, and for any other function always, in
    `num_workers` worker processes (default: cpu count - 1, at most 8; at least 1), an
    overrunning one killed and replaced.
    """
    n = len(solution_strs)
    extra_infos = [None] * n if extra_infos is None else list(extra_infos)
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(
            "score_batch needs equally long inputs, got "
            f"{len(data_sources)} data_sources, {n} solution_strs, "
            f"{len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos"
        )
    builtin = fn is compute_score
    if builtin:  # an unknown source is a set-up error, not a zero reward
        for source in set(data_sources):
            reward_for(source)
    items = list(zip(data_sources, solution_strs, ground_truths, extra_infos))
    num_workers = default_num_workers() if num_workers is None else num_workers
    if builtin and (num_workers == 0 or n < inline_below):
        rewards = []
        for i, args in enumerate(items):
            try:
                rewards.append(as_reward(compute_score(*args, timeout_s=timeout_s), failure_score))
            except Exception as e:
                log.warning("reward raised on item %d (data_source %r): %s", i, args[0], e)
                rewards.append(Reward(failure_score, failed=True))
        return rewards
    in_main = getattr(fn, "__module__", None) == "__main__"  # its workers must import __main__
    pool = _pool(max(1, num_workers), mp_context, in_main, _BUILTIN_PRELOAD if builtin else ())
    failed = object()  # what the pool gives an item that raised or overran
    raw = pool.map(fn, items, timeout_s, failure_value=failed)
    return [Reward(failure_score, failed=True) if v is failed else as_reward(v, failure_score) for v in raw]


def score_batch(fn: RewardFn, *args, **kwargs) -> list[float]:
    """The scores of ``score_rewards(fn, ...)`` (same arguments), as floats."""
    return [r.score for r in score_rewards(fn, *args, **kwargs)]
