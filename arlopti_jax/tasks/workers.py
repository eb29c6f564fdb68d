"""Worker processes that run functions on untrusted input under a hard time limit.

Rewards grade model output, which may be pathological (a 10^6-character answer, a
power tower that sympy tries to expand). `WorkerPool.map` runs each call in a
separate process and kills the process when the call overruns its deadline; the
call then yields `failure_value` and a fresh worker replaces the killed one.

Workers are started with the 'spawn' (default) or 'forkserver' method, never 'fork':
forking a parent that has started JAX's threads can deadlock the child. A spawned
worker starts a new interpreter and imports only what its job needs (its function's
module and `preload`), so JAX is not initialised there. Unlike multiprocessing's
default, it does not re-import the parent's main module: a script without an
`if __name__ == "__main__":` guard, or code read from stdin, would run again there (or
not be found) and kill the worker. A pool whose functions live in `__main__` asks for
that import with `import_main=True`, and then the usual guard is needed.

    pool = WorkerPool(num_workers=4)
    scores = pool.map(fn, [(a, b), (c, d)], timeout_s=10.0, failure_value=0.0)
    pool.close()

Inside a worker, `in_worker()` is True; code that would otherwise hand work to a
sandbox (math grading) runs directly there, since the worker is the sandbox.
"""

from __future__ import annotations

import collections
import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import pickle
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

START_METHODS = ("spawn", "forkserver")
_IN_WORKER = False


def in_worker() -> bool:
    """True inside a WorkerPool process."""
    return _IN_WORKER


def _run_preload(preload: Sequence[str]) -> None:
    """Import 'module' entries; call 'module:function' entries (warm-ups)."""
    for entry in preload:
        module, _, func = entry.partition(":")
        mod = importlib.import_module(module)
        if func:
            getattr(mod, func)()


def _worker_main(conn: mp.connection.Connection, preload: Sequence[str]) -> None:
    """Serve ('load', fn) and ('call', args) messages until None or a closed pipe."""
    global _IN_WORKER
    _IN_WORKER = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _run_preload(preload)
    conn.send(("ready", True, None))
    fn = None
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        kind = "result"
        try:
            msg = pickle.loads(data)
            if msg is None:
                return
            kind = "loaded" if msg[0] == "load" else "result"
            if kind == "loaded":
                fn = msg[1]
                reply = (kind, True, None)
            else:
                reply = (kind, True, fn(*msg[1]))
        except Exception as e:  # reported to the parent; the worker keeps serving
            reply = (kind, False, f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except Exception as e:
            conn.send((kind, False, f"result could not be sent back: {type(e).__name__}: {e}"))


_start_lock = threading.Lock()


def _start_without_main(proc: mp.Process) -> None:
    """Start ``proc`` so that it does not import the parent's ``__main__``: multiprocessing
    reads the main module's name or file while starting a 'spawn'/'forkserver' child, so a
    blank stand-in is shown to it for that moment."""
    with _start_lock:
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            proc.start()
        finally:
            sys.modules["__main__"] = main


def main_is_importable() -> bool:
    """Whether a child process can import this process's ``__main__`` (a script or ``-m``
    module; not stdin, ``-c`` or an interactive session)."""
    main = sys.modules["__main__"]
    if getattr(main.__spec__, "name", None):
        return True
    path = getattr(main, "__file__", None)
    return bool(path) and not path.startswith("<")


class _Worker:
    """One process and its state: 'starting' -> 'idle' <-> 'loading' | 'busy'."""

    def __init__(self, ctx, preload: Sequence[str], start_timeout_s: float, import_main: bool):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main, args=(child, tuple(preload)), daemon=True, name="arlopti-worker"
        )
        if import_main:
            self.proc.start()
        else:
            _start_without_main(self.proc)
        child.close()
        self.state = "starting"
        self.deadline = time.monotonic() + start_timeout_s
        self.item: int | None = None
        self.fn_key: bytes | None = None  # the pickled function this worker holds
        self.loading_key: bytes | None = None  # the one it is loading (replies may come late)

    def send(self, payload: bytes, state: str, deadline: float) -> None:
        self.conn.send_bytes(payload)
        self.state, self.deadline = state, deadline

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


class WorkerPool:
    """A fixed number of worker processes with per-call deadlines (see module docstring)."""

    def __init__(
        self,
        num_workers: int,
        *,
        mp_context: str = "spawn",
        preload: Sequence[str] = (),
        start_timeout_s: float = 120.0,
        import_main: bool = False,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if mp_context not in START_METHODS:
            raise ValueError(f"mp_context must be one of {START_METHODS}, got {mp_context!r}")
        self._ctx = mp.get_context(mp_context)
        self._num_workers = num_workers
        self._preload = tuple(preload)
        self._start_timeout_s = start_timeout_s  # also bounds loading a function's module
        self._import_main = import_main
        if import_main and not main_is_importable():
            raise ValueError(
                "WorkerPool(import_main=True): this process's __main__ is stdin, -c or an "
                "interactive session, which a worker process cannot import; define the "
                "function in a module file, or call it in this process"
            )
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.killed = 0  # workers killed for overrunning, over the pool's life

    def map(
        self,
        fn: Callable[..., Any],
        arg_tuples: Sequence[tuple],
        timeout_s: float,
        failure_value: Any = None,
    ) -> list[Any]:
        """fn(*args) for each args, in order; failure_value where a call raised or overran.

        The deadline covers the call only: starting a worker and importing fn's module
        there happen before it (bounded by start_timeout_s, a RuntimeError past it).
        """
        try:
            fn_key = pickle.dumps(fn)
        except Exception as e:
            raise TypeError(
                f"{fn!r} cannot be sent to a worker process ({e}); "
                "use a module-level function (importable as 'module:function')"
            ) from e
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if getattr(fn, "__module__", None) == "__main__" and not self._import_main:
            raise ValueError(
                f"{fn!r} is defined in __main__, which this pool's workers do not import; "
                "move it to a module, or use WorkerPool(import_main=True) (the script then "
                "needs an `if __name__ == '__main__':` guard)"
            )
        with self._lock:
            try:
                return self._map(fn, fn_key, list(arg_tuples), timeout_s, failure_value)
            except BaseException:
                # Workers mid-message would answer into the next call: drop them.
                for w in [w for w in self._workers if w.state != "idle"]:
                    w.kill()
                    self._workers.remove(w)
                raise

    def _map(self, fn, fn_key, arg_tuples, timeout_s, failure_value):
        results = [failure_value] * len(arg_tuples)
        pending = collections.deque(range(len(arg_tuples)))
        while len(self._workers) < self._num_workers:
            self._workers.append(self._new_worker())
        failures = 0
        while pending or any(w.state == "busy" for w in self._workers):
            for w in list(self._workers):
                if w.state != "idle" or not pending:
                    continue
                now = time.monotonic()
                try:
                    if w.fn_key != fn_key:
                        w.loading_key = fn_key
                        w.send(pickle.dumps(("load", fn)), "loading", now + self._start_timeout_s)
                        continue
                    i = pending.popleft()
                    try:
                        payload = pickle.dumps(("call", arg_tuples[i]))
                    except Exception as e:
                        log.warning("item %d cannot be sent to a worker: %s", i, e)
                        failures += 1
                        continue
                    w.item = i
                    w.send(payload, "busy", now + timeout_s)
                except OSError:  # the idle worker has died: retry on a fresh one
                    if w.item is not None and w.state == "idle":
                        pending.appendleft(w.item)
                    self._replace(w)
            waiting = {w.conn: w for w in self._workers if w.state != "idle"}
            if not waiting:
                continue
            wait_s = max(0.0, min(w.deadline for w in waiting.values()) - time.monotonic())
            for conn in mp.connection.wait(list(waiting), timeout=wait_s):
                failures += self._receive(waiting[conn], results)
            now = time.monotonic()
            for w in list(self._workers):
                if w.state == "busy" and now >= w.deadline:
                    log.warning("item %d overran its %.1fs limit; killing its worker", w.item, timeout_s)
                    failures += 1
                    self.killed += 1
                    self._replace(w)
                elif w.state in ("starting", "loading") and now >= w.deadline:
                    what = "start" if w.state == "starting" else f"load {fn!r}"
                    self._replace(w)
                    raise RuntimeError(f"worker process did not {what} within {self._start_timeout_s}s")
        if failures:
            log.info("%d of %d items got the failure value", failures, len(arg_tuples))
        return results

    def _receive(self, w: _Worker, results: list) -> int:
        """Handle one message from w; returns 1 if an item failed, else 0."""
        try:
            kind, ok, value = w.conn.recv()
        except (EOFError, OSError):
            kind, ok, value = None, False, f"worker died (exit code {w.proc.exitcode})"
        if w.state == "busy":
            i, w.item = w.item, None
            if kind == "result" and ok:
                results[i] = value
                w.state = "idle"
                return 0
            log.warning("item %d failed in a worker: %s", i, value)
            if kind is None:  # crashed (e.g. out of memory)
                self._replace(w)
            else:
                w.state = "idle"
            return 1
        if not ok:
            state = w.state
            self._replace(w)
            hint = ""
            if state == "starting" and self._import_main:
                hint = (
                    "; its start re-imports the main module, which fails when the script's "
                    "top-level code is not under `if __name__ == '__main__':`: add that guard, "
                    "or move the function to a module"
                )
            raise RuntimeError(f"worker process failed while {state}: {value}{hint}")
        if w.state == "loading":
            w.fn_key = w.loading_key
        w.state = "idle"
        return 0

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self._preload, self._start_timeout_s, self._import_main)

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = self._new_worker()

    def close(self) -> None:
        with self._lock:
            for w in self._workers:
                try:
                    w.conn.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
            for w in self._workers:
                w.proc.join(timeout=2)
                w.kill()
            self._workers = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
