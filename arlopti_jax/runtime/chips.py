"""The accelerators this project knows: peak dense bf16 FLOP/s per chip, and MFU against it."""

from __future__ import annotations

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
