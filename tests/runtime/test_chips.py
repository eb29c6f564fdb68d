"""What a command says it runs on: ``chips.backend()`` (the platform, read from JAX_PLATFORMS
without starting a backend where it is set) and ``chips.describe_devices()`` (the start-up line of
train, eval and sft), printed from process 0 only."""

import dataclasses
import os
import subprocess
import sys

import jax
import pytest

from arlopti_jax.config.cli import STARTUP_CHECK_ENV
from arlopti_jax.runtime import chips


@dataclasses.dataclass
class Device:
    platform: str
    device_kind: str
    process_index: int = 0


def test_the_backend_line_names_the_platform_and_devices():
    version = f"(jax {jax.__version__})"
    assert chips.describe_devices([Device("gpu", "NVIDIA H200")]) == f"backend: gpu, 1 x NVIDIA H200 {version}"
    assert chips.describe_devices([Device("cpu", "cpu")] * 8) == f"backend: cpu, 8 devices {version}"
    assert chips.describe_devices([Device("cpu", "cpu")]) == f"backend: cpu, 1 device {version}"
    pod = [Device("tpu", "TPU v5 lite", process_index=i // 4) for i in range(16)]
    assert chips.describe_devices(pod) == f"backend: tpu, 16 x TPU v5 lite over 4 processes {version}"
    mixed = [Device("gpu", "NVIDIA H100"), Device("gpu", "NVIDIA A100")]
    assert chips.describe_devices(mixed) == f"backend: gpu, 1 x NVIDIA H100, 1 x NVIDIA A100 {version}"
    # this test session's devices: the fake CPU devices of conftest.py
    assert chips.describe_devices() == f"backend: cpu, {jax.device_count()} devices {version}"


def test_only_process_0_prints_the_backend_line(monkeypatch, capsys):
    chips.print_backend()
    assert capsys.readouterr().out == chips.describe_devices() + "\n"
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    chips.print_backend()
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("listed, platform", [("cuda", "gpu"), ("cuda,cpu", "gpu"), ("rocm", "gpu"), ("tpu", "tpu"),
                                               ("cpu", "cpu"), (" tpu , cpu", "tpu")])
def test_jax_platforms_names_the_backend_without_starting_one(monkeypatch, listed, platform):
    monkeypatch.setenv("JAX_PLATFORMS", listed)
    monkeypatch.setattr(jax, "default_backend", lambda: pytest.fail("a backend was started"))
    assert chips.backend() == platform


def test_without_jax_platforms_the_backend_is_jax_default(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    before = jax.config.jax_platforms  # read from JAX_PLATFORMS at import: this session's "cpu"
    jax.config.update("jax_platforms", None)
    try:
        assert chips.backend() == "tpu"
    finally:
        jax.config.update("jax_platforms", before)


def test_sft_prints_the_backend_line_at_start_up(tmp_path):
    """sft's start point path stops under ARLOPTI_STARTUP_CHECK=1 right after the line."""
    env = {**os.environ, STARTUP_CHECK_ENV: "1", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.sft", "--config.tiny=True",
                           f"--config.out_dir={tmp_path / 'sp'}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"backend: cpu, 1 device (jax {jax.__version__})", proc.stdout
    assert "start-up check passed" in lines[1]
