"""TensorBoard logging, throughput/MFU, and phase timing.

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

from arlopti_jax import faults

# Dense bf16 peak FLOP/s per chip, for MFU. Keys are substrings of jax's device_kind.
PEAK_BF16_FLOPS = {
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12,
    "TPU v6": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12,
}


def peak_flops_per_device() -> float | None:
    """Peak bf16 FLOP/s of one local accelerator, or None (CPU / unknown)."""
    kind = jax.devices()[0].device_kind
    for key, flops in PEAK_BF16_FLOPS.items():
        if key.lower() in kind.lower():
            return flops
    return None


def train_flops(num_params: int, tokens: int) -> float:
    """6 N per token: forward (2N) plus backward (4N), attention excluded."""
    return 6.0 * num_params * tokens


def mfu(num_params: int, tokens: int, seconds: float, flops_per_token_factor: float = 6.0) -> float | None:
    peak = peak_flops_per_device()
    if peak is None or seconds <= 0:
        return None
    return flops_per_token_factor * num_params * tokens / seconds / (peak * jax.device_count())


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
