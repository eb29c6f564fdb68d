"""The accelerators this project knows: peak dense bf16 FLOP/s per chip, MFU against it, the
backend a command runs on (``backend``) and the one line that names it (``describe_devices``)."""

from __future__ import annotations

import os

import jax

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


def mfu(num_params: int, tokens: int, seconds: float, flops_per_token_factor: float = 6.0) -> float | None:
    peak = peak_flops_per_device()
    if peak is None or seconds <= 0:
        return None
    return flops_per_token_factor * num_params * tokens / seconds / (peak * jax.device_count())


def backend() -> str:
    """The platform this process's programs run on, as ``jax.default_backend()`` names it
    (``"cpu"``, ``"gpu"``, ``"tpu"``), for choosing defaults when a config is loaded. Where
    ``JAX_PLATFORMS`` lists the platforms (``cuda``, ``tpu,cpu``, ...) the first one is the answer and
    no backend starts, so ``jax.distributed.initialize`` can still follow (a multi-process run of the
    embedded default: set ``JAX_PLATFORMS``); otherwise ``jax.default_backend()`` starts the default
    backend, the one the command would start next anyway, and no other."""
    listed = [p.strip() for p in (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").split(",")]
    first = next((p for p in listed if p), "")
    if first:
        return "gpu" if first in ("cuda", "rocm", "gpu") else first
    return jax.default_backend()


def start_backend() -> None:
    """Start JAX's backend on the platform JAX chooses (``runtime.process.start_backend``). Commands
    call it through ``print_backend``, after ``jax.distributed``'s start."""
    from arlopti_jax.runtime import process

    process.start_backend()


def describe_devices(devices=None) -> str:
    """One line naming the backend and the devices a command runs on, e.g. ``backend: gpu, 1 x
    NVIDIA H200 (jax 0.11.2)`` or ``backend: cpu, 8 devices (jax 0.11.2)``; with several processes,
    over how many. ``devices``: every device (``jax.devices()``) when None."""
    from collections import Counter

    devices = jax.devices() if devices is None else list(devices)
    platform = devices[0].platform
    if platform == "cpu":
        what = f"{len(devices)} device{'s' if len(devices) != 1 else ''}"
    else:
        what = ", ".join(f"{count} x {kind}" for kind, count in Counter(d.device_kind for d in devices).items())
    processes = len({d.process_index for d in devices})
    over = f" over {processes} processes" if processes > 1 else ""
    from arlopti_jax.runtime.process import NOT_STARTED, SETTINGS

    tried = ("; not started: " + ", ".join(f"{p} ({why})" for p, why in NOT_STARTED.items())) if NOT_STARTED else ""
    chosen = ("; this command set " + "; ".join(SETTINGS)) if SETTINGS else ""
    return f"backend: {platform}, {what}{over} (jax {jax.__version__}){tried}{chosen}"


def print_backend() -> None:
    """Print ``describe_devices()`` from process 0 (the others print nothing): train, eval and
    sft say at start-up what they run on."""
    start_backend()
    if jax.process_index() == 0:
        print(describe_devices(), flush=True)
