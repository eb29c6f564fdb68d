"""Compile-only accelerators: TPU slices and H100s described to their own compilers, on any machine.

``jax.experimental.topologies`` gives devices of a named TPU topology (through libtpu, the
``jax[tpu]`` package) or of GPUs described by an XLA ``GpuTargetConfig`` (through the CUDA
plugin, ``jax-cuda12-plugin``; cuDNN's library for the fused attention kernel). Such devices
run nothing: programs lowered for a mesh of them are compiled by the target's own compiler,
and the compiled program reports its real memory, cost and optimized HLO. Install with
``pip install -e ".[aot]"``.

Each target carries the chip's public figures (HBM capacity and bandwidth, dense bf16 peak),
which turn the compiler's bytes and flops into fit, roofline and MFU figures. ``2xv5e-16`` (any
``N x`` a named TPU slice) is N such slices joined by the data-center network (multislice):
libtpu's compile-only topology gives each device its ``slice_index``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from pathlib import Path

GIB = 1 << 30
SPECS = Path(__file__).with_name("h100_sxm.txtpb")


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile-only slice (or ``slices`` of them): ``chips`` devices on ``hosts`` hosts (processes), in all."""

    name: str
    platform: str  # "tpu" | "gpu"
    topology: str  # libtpu's topology name, or the CUDA plugin's "slices x hosts x gpus"
    hosts: int
    chips: int
    hbm_bytes: int  # per chip
    hbm_bytes_per_s: float
    peak_flops: float  # dense bfloat16, per chip
    chips_per_host: tuple[int, int, int] = (2, 2, 1)  # TPU host bounds
    chip_config: str = "default"  # libtpu's chip config: "megacore" makes a v4 chip's two cores one device
    slices: int = 1  # TPU slices joined by the data-center network (multislice)

    @property
    def label(self) -> str:
        over = f", {self.slices} slices" if self.slices > 1 else ""
        return f"{self.name} ({self.chips} x {self.hbm_bytes / GIB:.0f} GiB, {self.hosts} host(s){over})"


# Public figures: v5e 16 GiB at 819 GB/s and 197 TFLOP/s; v5p 95 GiB at 2765 GB/s and 459 TFLOP/s;
# v4 32 GiB at 1228 GB/s and 275 TFLOP/s; H100 SXM 80 GB (79.1 GiB) at 3.35 TB/s and 989 TFLOP/s.
# v5e and v4/v5p hosts hold 4 chips (v5e-8: one host of 8); v5p and v4 names count TensorCores
# (two per chip). A v4 chip runs as one JAX device over both cores (megacore), as on the pod;
# libtpu's default chip config for v4 would make each core a device.
_V5E = dict(platform="tpu", hbm_bytes=16 * GIB, hbm_bytes_per_s=819e9, peak_flops=197e12)
_V5P = dict(platform="tpu", hbm_bytes=95 * GIB, hbm_bytes_per_s=2765e9, peak_flops=459e12)
_V4 = dict(platform="tpu", hbm_bytes=32 * GIB, hbm_bytes_per_s=1228e9, peak_flops=275e12)
_H100 = dict(platform="gpu", hbm_bytes=84942979072, hbm_bytes_per_s=3.35e12, peak_flops=989e12)
TARGETS = {t.name: t for t in (
    Target("v5e-1", topology="v5e:1x1", hosts=1, chips=1, chips_per_host=(1, 1, 1), **_V5E),
    Target("v5e-8", topology="v5e:2x4", hosts=1, chips=8, chips_per_host=(2, 4, 1), **_V5E),
    Target("v5e-16", topology="v5e:4x4", hosts=4, chips=16, **_V5E),
    Target("v5e-256", topology="v5e:16x16", hosts=64, chips=256, **_V5E),
    Target("v5p-8", topology="v5p:2x2x1", hosts=1, chips=4, **_V5P),
    Target("v5p-16", topology="v5p:2x2x2", hosts=2, chips=8, **_V5P),
    Target("v5p-32", topology="v5p:2x2x4", hosts=4, chips=16, **_V5P),
    Target("v5p-64", topology="v5p:4x4x2", hosts=8, chips=32, **_V5P),
    Target("v4-32", topology="v4:2x2x4", hosts=4, chips=16, chip_config="megacore", **_V4),
    Target("h100", topology="1x1x1", hosts=1, chips=1, **_H100),
    Target("h100x8", topology="1x1x8", hosts=1, chips=8, **_H100),
)}


def prepare_environment() -> None:
    """What libtpu and the CUDA plugin need to build compile-only devices on a machine without
    either accelerator: no TPU metadata server, no CUDA driver check. Call before JAX starts
    a backend (``python -m arlopti_jax.aot`` does, first thing)."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")  # silences libtpu's probe; topologies are named
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several processes (pytest workers) compiling at once


class TargetError(RuntimeError):
    """The compiler for a target is missing (one line: what to install)."""


def local() -> Target:
    """This machine's own devices (``--target=local``): the programs compile for what ``train``
    would run here, through the persistent compilation cache, and can be timed here."""
    import os

    import jax

    from arlopti_jax.runtime.chips import PEAK_BF16_FLOPS

    found = jax.local_devices()
    stats = getattr(found[0], "memory_stats", lambda: None)() or {}
    memory = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    kind = found[0].device_kind
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k.lower() in kind.lower()), 0.0)
    return Target("local", platform=found[0].platform, topology=kind, hosts=1, chips=len(found),
                  hbm_bytes=int(memory), hbm_bytes_per_s=hbm_bandwidth(kind) or 0.0, peak_flops=peak)


# Datasheet HBM bandwidth of a GPU, bytes/s, by a substring of jax's device_kind (first match wins).
GPU_HBM_BANDWIDTH = (
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB", 1.935e12), ("A100", 1.555e12),
)


def hbm_bandwidth(device_kind: str) -> float | None:
    """A GPU's HBM bandwidth from ``GPU_HBM_BANDWIDTH``, or None where the kind is not listed."""
    return next((bw for name, bw in GPU_HBM_BANDWIDTH if name in device_kind), None)


@functools.lru_cache(maxsize=None)
def devices(target: Target) -> tuple:
    """The target's compile-only devices, in the topology's order (``local``: this machine's)."""
    from jax.experimental import topologies

    if target.name == "local":
        import jax

        return tuple(jax.local_devices())
    prepare_environment()
    try:
        if target.platform == "tpu":
            desc = topologies.get_topology_desc(platform="tpu", topology_name=target.topology,
                                                chip_config_name=target.chip_config,
                                                chips_per_host_bounds=target.chips_per_host,
                                                num_slices=target.slices, wrap=(False, False, False))
        else:
            desc = topologies.get_topology_desc(platform="cuda", target_config=SPECS.read_text(),
                                                topology=target.topology)
    except Exception as err:  # a missing plugin shows as a RuntimeError or ValueError, worded per release
        package = "jax[tpu]" if target.platform == "tpu" else "jax-cuda12-plugin"
        raise TargetError(f"--target={target.name}: no compile-only {target.platform.upper()} devices "
                          f"({str(err).splitlines()[0][:160]}); install the compilers with "
                          f"pip install -e \".[aot]\" (it brings {package})") from None
    found = tuple(desc.devices)
    if len(found) != target.chips:
        raise TargetError(f"--target={target.name}: topology {target.topology} gave {len(found)} devices, "
                          f"expected {target.chips}")
    return found


def get(name: str) -> Target:
    """A named target, ``local``, or ``NxNAME``: N slices of the named TPU slice (multislice)."""
    if name == "local":
        return local()
    multi = re.fullmatch(r"(\d+)x(.+)", name)
    if multi and multi.group(2) in TARGETS:
        one, slices = TARGETS[multi.group(2)], int(multi.group(1))
        if one.platform != "tpu" or slices < 1:
            problem = f"{one.name} is a GPU target" if one.platform != "tpu" else "N must be >= 1"
            raise TargetError(f"--target={name}: NxNAME is N slices of a TPU target (multislice): {problem}")
        return dataclasses.replace(one, name=name, slices=slices, hosts=one.hosts * slices, chips=one.chips * slices)
    if name not in TARGETS:
        raise TargetError(f"--target={name}: unknown; targets are {', '.join(TARGETS)}, NxNAME (N TPU slices: "
                          "multislice), local")
    return TARGETS[name]
