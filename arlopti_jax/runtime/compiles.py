"""What this process compiled: every XLA program, its seconds and its argument shapes.

    log = compiles.watch()        # idempotent: one log per process, from JAX's own events
    log.programs, log.seconds     # so far (persistent-cache loads included: they are programs too)
    log.warm()                    # the warm-up is over: each later program is logged as a warning
    log.warm(False)               # the run is over: compiles are quiet again
    log.since(mark)               # the programs after ``mark = len(log.records)``

    compile_all(schedule, ...)    # a warm-up: lists of ``Program``s compiled in parallel threads

A program is one ``backend compile`` of JAX (``/jax/core/compile/backend_compile_duration``): an
XLA compilation, or a load from the persistent compilation cache, which still costs a lowering.
Its argument shapes come from the line JAX writes before lowering a jitted function ("Compiling
NAME with global shapes and types ..."), taken at debug level by a filter on JAX's logger, so
nothing reaches the console unless ``JAX_LOG_COMPILES=1`` asked for it. A warning after the
warm-up names the program and the shapes that differ from its previous compilation, which is the
shape that was new.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import re
import threading
from typing import Any, Callable, Sequence

import jax

log = logging.getLogger(__name__)

_PXLA_LOGGER = "jax._src.interpreters.pxla"
_COMPILING = re.compile(r"^Compiling (\S+) with global shapes and types (.*?)\. Argument mapping")
_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class Record:
    name: str  # JAX's name of the program, e.g. "jit(accumulate)"
    seconds: float
    shapes: str  # its arguments' shapes and dtypes, as JAX lists them ("" when unknown)


class CompileLog:
    def __init__(self):
        self.records: list[Record] = []
        self._shapes: dict[str, list[str]] = {}  # program name -> shapes of its lowerings not compiled yet
        self._last: dict[str, str] = {}  # program name -> shapes of its previous compilation
        self._warm = False
        self._lock = threading.Lock()
        self._local = threading.local()  # a compile on this thread: its lowering's shapes (``compiling``)

    @property
    def programs(self) -> int:
        return len(self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def since(self, mark: int) -> list[Record]:
        return self.records[mark:]

    def lowered(self, name: str) -> str:
        """The shapes of the latest lowering of ``name`` not compiled yet ("" when none)."""
        with self._lock:
            return (self._shapes.get(name) or [""])[-1]

    @contextlib.contextmanager
    def compiling(self, shapes: str):
        """Compiles on this thread within the block are of a lowering with these ``shapes``: for
        lowerings compiled later, on other threads, in any order (``algos.PackedPrograms``)."""
        self._local.shapes = shapes
        try:
            yield
        finally:
            self._local.shapes = None

    def warm(self, on: bool = True) -> None:
        """From now on a new program is a warning: the run should have compiled everything
        (``on=False`` ends that, when the run ends)."""
        self._warm = on

    @property
    def is_warm(self) -> bool:
        return self._warm

    # JAX's hooks ---------------------------------------------------------------------------
    def _on_lowering(self, record: logging.LogRecord) -> bool:
        """Logger filter: keep each lowering's shapes; pass on only what the logger's own level lets
        through (the line is at WARNING with JAX_LOG_COMPILES=1, else at DEBUG and dropped here)."""
        match = _COMPILING.match(record.getMessage())
        if match:
            with self._lock:
                self._shapes.setdefault(match.group(1), []).append(match.group(2))
        return record.levelno >= self._level

    def _on_event(self, event: str, seconds: float, **kwargs) -> None:
        if event != _EVENT:
            return
        name = str(kwargs.get("fun_name", "?"))
        with self._lock:
            pending = self._shapes.get(name, [])
            shapes = getattr(self._local, "shapes", None)
            if shapes is not None and shapes in pending:
                pending.remove(shapes)
            elif shapes is None:
                shapes = pending.pop(0) if pending else ""
            previous = self._last.get(name)
            self._last[name] = shapes
            self.records.append(Record(name, float(seconds), shapes))
        if self._warm:
            log.warning("compiled %s after the warm-up (%.2f s): %s", name, seconds,
                        _new_shapes(previous, shapes))

    def install(self) -> None:
        logger = logging.getLogger(_PXLA_LOGGER)
        self._level = logger.getEffectiveLevel()
        logger.addFilter(self._on_lowering)
        logger.setLevel(logging.DEBUG)  # so JAX writes the "Compiling ..." line for the filter
        jax.monitoring.register_event_duration_secs_listener(self._on_event)


def _new_shapes(previous: str | None, shapes: str) -> str:
    """The argument shapes of a program, shortened to those that differ from its previous
    compilation (all of them the first time)."""
    if not shapes:
        return "shapes unknown"
    now = _split(shapes)
    if previous is None:
        return "first compilation, shapes " + _clip(", ".join(now))
    before = _split(previous)
    changed = [f"argument {i}: {b} -> {a}" for i, (a, b) in enumerate(zip(now, before)) if a != b]
    if len(now) != len(before):
        changed.append(f"{len(before)} -> {len(now)} arguments")
    return "new shapes " + _clip("; ".join(changed) or "none (same shapes, another trace)")


def _split(shapes: str) -> list[str]:
    """'(ShapedArray(int32[4,8]), ShapedArray(float32[])...)' -> ['int32[4,8]', 'float32[]', ...]."""
    return re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", shapes)


def _clip(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


_LOG: CompileLog | None = None


def watch() -> CompileLog:
    """This process's compile log (installed on the first call)."""
    global _LOG
    if _LOG is None:
        _LOG = CompileLog()
        _LOG.install()
    return _LOG


# ---- warm-ups: programs compiled ahead of their first call ---------------------------------------

@dataclasses.dataclass(frozen=True)
class Output:
    """An argument of a ``Program``: the outputs of the earlier program ``of`` of its schedule, or the
    part of them that ``pick`` takes."""

    of: str
    pick: Callable | None = None

    def part(self, fn: Callable) -> "Output":
        """The part ``fn`` takes of this argument."""
        return Output(self.of, fn if self.pick is None else lambda outputs: fn(self.pick(outputs)))

    def resolve(self, outputs: dict):
        value = outputs[self.of]
        return value if self.pick is None else self.pick(value)


@dataclasses.dataclass(frozen=True)
class Program:
    """``jitted(*args, **kwargs)``: a ``jax.jit`` function on abstract arguments (``abstract``'s
    ``ShapeDtypeStruct``s, static values, or ``Output``s of earlier programs of its schedule)."""

    name: str
    jitted: Any
    args: tuple
    kwargs: dict

    def arguments(self, outputs: dict) -> tuple[tuple, dict]:
        resolve = lambda v: v.resolve(outputs) if isinstance(v, Output) else v
        return tuple(map(resolve, self.args)), {k: resolve(v) for k, v in self.kwargs.items()}

    def needs(self) -> set[str]:
        return {v.of for v in (*self.args, *self.kwargs.values()) if isinstance(v, Output)}


def abstract(tree):
    """The abstract values of a tree of arrays as a jitted function sees them: shape, dtype and, for
    an array committed to its devices, its sharding (an uncommitted one, such as a key made on the
    default device, has none: a program lowered with that sharding would not be the one its call runs)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding if getattr(x, "committed", False) else None), tree)


def outputs_of(lowered, compiled):
    """A compiled program's outputs as abstract values, in the shardings the compiler chose."""
    return jax.tree.map(lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
                        lowered.out_info, compiled.output_shardings)


def run_in_order(schedule: Sequence[Program], compile: Callable) -> dict:
    """``compile(name, jitted, *args, **kwargs)`` (which returns the outputs as abstract values) on each
    program of ``schedule`` in turn; returns each program's outputs by name (``aot``)."""
    outputs = {}
    for program in schedule:
        args, kwargs = program.arguments(outputs)
        outputs[program.name] = compile(program.name, program.jitted, *args, **kwargs)
    return outputs


def _signature(program: Program, args: tuple, kwargs: dict) -> tuple:
    leaves, tree = jax.tree.flatten((args, kwargs))
    return (id(program.jitted), tree, tuple(leaves))


def compile_all(*schedules: Sequence[Program], context: Callable = contextlib.nullcontext,
                threads: int | None = None) -> list[dict]:
    """Compile every program of ``schedules`` (lists of ``Program``s whose ``Output``s name programs of
    the same list), each once, however many schedules list it; returns each schedule's outputs by name.

    A program is lowered on this thread, inside ``context()`` (the mesh and logical axis rules its
    calls run under, which are this thread's), once the programs it reads have compiled (its
    arguments' shardings are the ones they compiled to), and compiled on one of ``threads`` threads
    (default: one per CPU; XLA compiles outside Python's lock), or loaded from the persistent
    compilation cache. JAX's caches then hold the executable: a later call of ``jitted`` on arrays of
    those shapes and shardings (committed ones; ``abstract``), under the same context, runs it without
    compiling. Each compilation is in this process's log (``watch``), named by its shapes."""
    log = watch()
    outputs: list[dict] = [{} for _ in schedules]
    waiting = [(i, p) for i, schedule in enumerate(schedules) for p in schedule]
    running: dict[concurrent.futures.Future, list[tuple[int, str]]] = {}
    by_signature: dict[tuple, concurrent.futures.Future] = {}

    def compile_one(lowered, shapes: str):
        with log.compiling(shapes):  # compiled on another thread, in any order: named by its shapes
            return outputs_of(lowered, lowered.compile())

    with concurrent.futures.ThreadPoolExecutor(max(1, threads or os.cpu_count() or 1)) as pool:
        while waiting or running:
            ready = [(i, p) for i, p in waiting if p.needs() <= outputs[i].keys()]
            waiting = [item for item in waiting if item not in ready]
            for i, program in ready:
                args, kwargs = program.arguments(outputs[i])
                signature = _signature(program, args, kwargs)
                future = by_signature.get(signature)
                if future is None:  # a program no schedule has listed yet
                    with context():
                        lowered = program.jitted.lower(*args, **kwargs)
                    future = pool.submit(compile_one, lowered, log.lowered(f"jit({program.jitted.__name__})"))
                    by_signature[signature], running[future] = future, []
                if future in running:
                    running[future].append((i, program.name))
                else:
                    outputs[i][program.name] = future.result()
            if not running:
                if waiting:
                    missing = sorted({o for i, p in waiting for o in p.needs() - outputs[i].keys()})
                    raise ValueError(f"compile_all: programs read the outputs of {missing}, which none lists first")
                break
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                for i, name in running.pop(future):
                    outputs[i][name] = future.result()
    return outputs
