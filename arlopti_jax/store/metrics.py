"""TensorBoard logging and phase timing (MFU: ``runtime.chips``).

Only process 0 writes. Every scalar also goes to ``metrics.jsonl`` in the run folder,
one line per step, so runs can be compared without TensorBoard.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import jax
import numpy as np

from arlopti_jax.runtime import faults

class Timer:
    """Accumulates wall time per phase: ``with timer("rollout"): ...``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return out


class MetricsWriter:
    def __init__(self, run_dir: str | Path, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.run_dir = Path(run_dir)
        self._tb = None
        if self.enabled:
            from tensorboardX import SummaryWriter

            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(str(self.run_dir / "tb"))
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in values.items() if v is not None and np.isfinite(float(v))}
        for key, value in clean.items():  # TensorBoard tags take no '@' (tensorboardX would rename and log it)
            self._tb.add_scalar(key.replace("@", "_"), value, step)
        faults.write(self._jsonl, json.dumps({"step": step, **clean}) + "\n", "metrics")
        self._jsonl.flush()

    def histogram(self, step: int, tag: str, values) -> None:
        values = np.asarray(values)
        if self.enabled and values.size:
            self._tb.add_histogram(tag, values, step)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            self._tb.add_text(tag, text, step)

    def flush(self) -> None:
        if self.enabled:
            self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._tb.close()
            self._jsonl.close()
