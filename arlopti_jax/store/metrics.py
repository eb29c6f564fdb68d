"""A run's records, and phase timing (MFU: ``runtime.chips``).

Only process 0 writes. Every scalar goes to ``metrics.jsonl`` in the run folder, one line per
call, so runs can be compared without a tracker; the config, scalars, histograms, texts and the
end-of-run summary go to each tracker of ``train.loggers`` (``store/trackers.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import jax
import numpy as np

from arlopti_jax.runtime import faults, paths
from arlopti_jax.store import trackers

log = logging.getLogger(__name__)

class Timer:
    """Accumulates wall time per phase: ``with timer("rollout"): ...``. Between ``pause()`` and
    ``resume()`` the clock of every open phase stops: the sampling loop pauses its timer while the
    main thread works for the update (``rl/pipeline.py``), so a phase counts the host's seconds on
    its own work (dispatching, waiting for its own devices, scoring), not the update's."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._away = 0.0  # seconds spent paused, in all
        self._paused_at: float | None = None

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start, away = time.perf_counter(), self._away
        try:
            yield
        finally:
            spent = time.perf_counter() - start - (self._away - away)
            self.seconds[phase] = self.seconds.get(phase, 0.0) + spent

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._away += time.perf_counter() - self._paused_at
            self._paused_at = None

    def pop(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


class MetricsWriter:
    """Process 0's records of a run: every scalar to ``metrics.jsonl``, and the run's config (at
    the start), scalars, histograms, texts and summary to each tracker of ``loggers``.

    ``run_dir``: the folder the records are written in (a bucket run's staging folder); the trackers
    name the run after ``config["run_dir"]`` (``trackers.run_name``). A run whose ``metrics.jsonl``
    already holds records (one that carries on from a checkpoint: the loop has trimmed the records
    after it) continues its trackers' runs of ``run_dir/trackers.json``; one that starts over starts
    new ones. A tracker that cannot start raises ``trackers.TrackerError`` (one line naming it: the
    user asked for it, and ``trackers.check`` at start-up let it pass), the others it started closed
    again. One that fails later is reported in one warning line and dropped: the run and the other
    trackers go on."""

    def __init__(self, run_dir: str | Path, enabled: bool | None = None, loggers: str = "tensorboard",
                 config: dict | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.run_dir = Path(run_dir)
        self._trackers: dict[str, object] = {}
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            config = config or {}
            named = config.get("run_dir") or str(self.run_dir)
            jsonl = self.run_dir / "metrics.jsonl"
            carry_on = jsonl.is_file() and jsonl.stat().st_size > 0
            run = trackers.Run(self.run_dir, trackers.run_name(named),
                               named if paths.is_remote(named) else str(self.run_dir.absolute()),
                               trackers.TrackerIds(self.run_dir, carry_on))
            for name in trackers.names(loggers):
                try:
                    self._trackers[name] = trackers.start(name, run, config)
                except Exception as err:  # whatever the tracker's client raises: it did not start
                    self.close_trackers()
                    raise trackers.TrackerError(f"config.train.loggers: the {name} tracker could not start: "
                                                f"{trackers.reason(err)}") from None
            self._jsonl = open(jsonl, "a")

    @property
    def loggers(self) -> list[str]:
        """The trackers that are logging."""
        return list(self._trackers)

    def _each(self, method: str, *args) -> None:
        for name, tracker in list(self._trackers.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as err:
                log.warning("the %s tracker failed (%s), the run goes on without it: %s", name, method, err)
                del self._trackers[name]

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items() if v is not None and np.isfinite(float(v))}
        self._each("scalars", step, clean)
        faults.write(self._jsonl, json.dumps({"step": step, **clean}) + "\n", "metrics")
        self._jsonl.flush()

    def histogram(self, step: int, tag: str, values) -> None:
        values = np.asarray(values)
        if self.enabled and values.size:
            self._each("histogram", step, tag, values)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            self._each("text", step, tag, text)

    def summary(self, step: int, text: str, values: dict[str, float]) -> None:
        """The end-of-run summary: its text (what the run printed) and its numbers."""
        if self.enabled:
            self._each("summary", step, text, {k: float(v) for k, v in values.items()
                                               if v is not None and np.isfinite(float(v))})

    def flush(self) -> None:
        if self.enabled:
            self._each("flush")

    def close_trackers(self) -> None:
        self._each("close")
        self._trackers.clear()

    def close(self) -> None:
        if self.enabled:
            self.close_trackers()
            self._jsonl.close()
