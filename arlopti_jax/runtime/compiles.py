"""What this process compiled: every XLA program, its seconds and its argument shapes.

    log = compiles.watch()        # idempotent: one log per process, from JAX's own events
    log.programs, log.seconds     # so far (persistent-cache loads included: they are programs too)
    log.warm()                    # the warm-up is over: each later program is logged as a warning
    log.warm(False)               # the run is over: compiles are quiet again
    log.since(mark)               # the programs after ``mark = len(log.records)``

A program is one ``backend compile`` of JAX (``/jax/core/compile/backend_compile_duration``): an
XLA compilation, or a load from the persistent compilation cache, which still costs a lowering.
Its argument shapes come from the line JAX writes before lowering a jitted function ("Compiling
NAME with global shapes and types ..."), taken at debug level by a filter on JAX's logger, so
nothing reaches the console unless ``JAX_LOG_COMPILES=1`` asked for it. A warning after the
warm-up names the program and the shapes that differ from its previous compilation, which is the
shape that was new.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading

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
