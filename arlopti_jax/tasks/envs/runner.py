"""Running environments without trusting them: one failing episode ends, the run goes on.

    step = run_step(env, action, problem_id="data/calc/train.parquet:17", turn=2, env_name="calc")
    pool = StepPool("calc", max_workers=64)
    firsts = pool.resets([(env, problem, problem_id), ...], timeout_s=10.0)       # list[Step]
    steps = pool.steps([(env, action, problem_id, turn), ...], timeout_s=10.0)    # list[Step], in order
    pool.close()

`run_reset` and `run_step` never raise: an exception inside the environment, or a return value
that is not a Step (``observation`` a string or None, ``reward`` a dict of finite numbers,
``done`` a bool), gives an ended episode, ``Step(None, {}, True, {'env_errors': 1, 'error':
MESSAGE})``, and logs MESSAGE, which names the environment, the problem and the turn (turn 0: the
reset). Its reward parts are dropped with it, so the episode scores 0. A reset that succeeds is
``Step(first_observation, {}, False, {})``. A step whose observation is None is done.

`StepPool` runs the steps (or resets) of many episodes at once, each in one of ``max_workers``
daemon threads (the tools they call are subprocesses or fast pure Python, so threads overlap
them), and returns within ``timeout_s`` (plus scheduling slack) of the call whatever the
environments do: a job still running at its deadline is given up (an ended episode, as above,
with ``info['timed_out']``), as is one no thread could start by then. A thread cannot be stopped,
so a given-up job's thread runs on to its end and then exits; a fresh thread takes its place. The
built-in environments bound each step themselves (their tools' limits), so the pool's limit is
the backstop for user environments.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from arlopti_jax.tasks.envs.base import Step

log = logging.getLogger(__name__)


def _failed(message: str, **info: Any) -> Step:
    log.warning("%s", message)
    return Step(None, {}, True, {"env_errors": 1, "error": message, **info})


def _checked(result: Any, what: str) -> Step:
    """The environment's return value as a Step; ValueError saying what is wrong with it."""
    if not all(hasattr(result, a) for a in ("observation", "reward", "done")):
        raise ValueError(f"{what} returned a {type(result).__name__}, not a Step(observation, reward, done, info)")
    observation, reward, info = result.observation, result.reward, getattr(result, "info", None) or {}
    if observation is not None and not isinstance(observation, str):
        raise ValueError(f"{what} returned an observation of type {type(observation).__name__}, not str or None")
    if not isinstance(reward, dict) or not all(isinstance(k, str) for k in reward):
        raise ValueError(f"{what} returned reward {reward!r}: must be a dict of named parts")
    parts = {}
    for key, value in reward.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{what} returned reward part {key!r} = {value!r}: must be a finite number")
        parts[key] = float(value)
    if not isinstance(info, dict):
        raise ValueError(f"{what} returned info of type {type(info).__name__}, not dict")
    return Step(observation, parts, bool(result.done) or observation is None, dict(info))


def _where(env_name: str, problem_id: Any, turn: int) -> str:
    return f"environment {env_name!r} on problem {problem_id!r} at turn {turn}"


def run_reset(env: Any, problem: dict, *, problem_id: Any, env_name: str = "") -> Step:
    """env.reset(problem) as a Step (module docstring); never raises."""
    where = _where(env_name or type(env).__name__, problem_id, 0)
    try:
        first = env.reset(problem)
        if first is not None and not isinstance(first, str):
            raise ValueError(f"reset returned a {type(first).__name__}, not str or None")
    except Exception as e:
        return _failed(f"{where}: reset raised {type(e).__name__}: {e}")
    return Step(first, {}, False, {})


def run_step(env: Any, action: str, *, problem_id: Any, turn: int, env_name: str = "") -> Step:
    """env.step(action) as a checked Step (module docstring); never raises."""
    where = _where(env_name or type(env).__name__, problem_id, turn)
    try:
        return _checked(env.step(action), "step")
    except Exception as e:
        return _failed(f"{where}: step raised {type(e).__name__}: {e}")


class _Job:
    def __init__(self, fn: Callable[[], Step], deadline: float):
        self.fn, self.deadline = fn, deadline
        self.result: Step | None = None
        self.started = self.abandoned = False
        self.lock = threading.Lock()
        self.done = threading.Event()


class StepPool:
    """Many episodes' resets or steps at once, each within the call's time limit (module docstring)."""

    def __init__(self, env_name: str, max_workers: int = 64):
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}: must be at least 1")
        self.env_name = env_name
        self.max_workers = max_workers
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = 0
        self._lock = threading.Lock()
        self.given_up = 0  # jobs given up at their deadline, over the pool's life

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            with job.lock:
                if job.abandoned or time.monotonic() > job.deadline:
                    job.done.set()
                    continue
                job.started = True
            job.result = job.fn()
            job.done.set()
            with job.lock:
                if job.abandoned:  # the caller gave up on it and started a fresh thread
                    return

    def _start_thread(self) -> None:
        threading.Thread(target=self._work, name=f"env-step-{self.env_name}", daemon=True).start()

    def _run(self, what: str, fns: Sequence[Callable[[], Step]], wheres: Sequence[str],
             timeout_s: float) -> list[Step]:
        deadline = time.monotonic() + timeout_s
        jobs = [_Job(fn, deadline) for fn in fns]
        with self._lock:
            while self._threads < min(self.max_workers, len(jobs)):
                self._start_thread()
                self._threads += 1
        for job in jobs:
            self._jobs.put(job)
        results = []
        for job, where in zip(jobs, wheres):
            if not job.done.wait(max(0.0, deadline - time.monotonic())) or job.result is None:
                with job.lock:
                    job.abandoned = True
                    running = job.started and not job.done.is_set()
                if running:  # its thread is lost to a step that may never end: replace it
                    self._start_thread()
                    self.given_up += 1
                state = "did not return" if job.started else "could not start (every worker was busy)"
                results.append(job.result if job.done.is_set() and job.result is not None else
                               _failed(f"{where}: {what} {state} within {timeout_s:g} s", timed_out=True))
            else:
                results.append(job.result)
        return results

    def resets(self, items: Sequence[tuple[Any, dict, Any]], timeout_s: float) -> list[Step]:
        """run_reset for each (env, problem, problem_id), at most ``timeout_s`` in all."""
        fns = [lambda e=e, p=p, i=i: run_reset(e, p, problem_id=i, env_name=self.env_name) for e, p, i in items]
        return self._run("reset", fns, [_where(self.env_name, i, 0) for _, _, i in items], timeout_s)

    def steps(self, items: Sequence[tuple[Any, str, Any, int]], timeout_s: float) -> list[Step]:
        """run_step for each (env, action, problem_id, turn), at most ``timeout_s`` in all."""
        fns = [lambda e=e, a=a, i=i, t=t: run_step(e, a, problem_id=i, turn=t, env_name=self.env_name)
               for e, a, i, t in items]
        return self._run("step", fns, [_where(self.env_name, i, t) for _, _, i, t in items], timeout_s)

    def close(self) -> None:
        """Stop the idle threads (a thread still inside a given-up step stops when it returns)."""
        with self._lock:
            for _ in range(self._threads):
                self._jobs.put(None)
            self._threads = 0

    def __enter__(self) -> StepPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
