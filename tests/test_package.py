"""What importing the package sets up before JAX starts its backend."""

import os
import subprocess
import sys

import pytest

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


@pytest.mark.parametrize("flags,expected", [
    ("--xla_force_host_platform_device_count=8", f"--xla_force_host_platform_device_count=8 {FLAG}=false"),
    (f"--xla_force_host_platform_device_count=4 {FLAG}=true", f"--xla_force_host_platform_device_count=4 {FLAG}=true"),
    ("", ""),  # one host device: no collectives, nothing changed
])
def test_several_host_devices_get_collectives_in_one_order(flags, expected):
    """Several host devices in one process: the scheduler that deadlocked 8-device FSDP steps on
    2 cores is off, unless the user chose it, and it is in force when the backend starts."""
    code = ("import os, arlopti_jax, jax; print(os.environ.get('XLA_FLAGS', '')); "
            "print(len(jax.devices()))")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got, devices = proc.stdout.split("\n")[:2]
    assert got.strip() == expected and int(devices) == (int(flags.split("=")[1].split()[0]) if flags else 1)
