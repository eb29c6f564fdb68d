"""What importing the package sets up before JAX starts its backend."""

import os
import subprocess
import sys

import pytest

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
YNN = "--xla_cpu_experimental_ynn_fusion_type"


@pytest.mark.parametrize("flags,expected", [
    # several host devices: YNNPACK's fusions (XLA's own made SmolLM2's decode wrong there, 2026-12-06)
    ("--xla_force_host_platform_device_count=8", f"--xla_force_host_platform_device_count=8 {FLAG}=false"),
    ("--xla_force_host_platform_device_count=1", f"--xla_force_host_platform_device_count=1 {FLAG}=false {YNN}="),
    (f"--xla_force_host_platform_device_count=4 {FLAG}=true {YNN}=dot",
     f"--xla_force_host_platform_device_count=4 {FLAG}=true {YNN}=dot"),
    ("", f"{YNN}="),  # one host device: no collectives, XLA's own fusions
])
def test_several_host_devices_get_collectives_in_one_order(flags, expected):
    """Several host devices in one process: the scheduler that deadlocked 8-device FSDP steps on
    2 cores is off, unless the user chose it, and it is in force when the backend starts. With one
    host device XLA:CPU emits its fusions itself (not YNNPACK's) unless the user chose otherwise."""
    code = ("import os, arlopti_jax, jax; print(os.environ.get('XLA_FLAGS', '')); "
            "print(len(jax.devices()))")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got, devices = proc.stdout.split("\n")[:2]
    import importlib.metadata

    if not importlib.metadata.version("jaxlib").startswith("0.10.") and f"{YNN}=dot" not in flags:
        expected = expected.replace(f"{YNN}=", "").strip()  # the fusion flag is set on the jaxlib measured alone
    assert got.strip() == expected and int(devices) == (int(flags.split("=")[1].split()[0]) if flags else 1)


@pytest.mark.parametrize("files,plugins,libtpu,expected,left", [
    ((), ["xla_cuda12"], True, "cpu", {"cuda", "tpu"}),  # .[aot] on a CPU machine
    (("/dev/nvidia0",), ["xla_cuda12"], True, "cuda,cpu", {"tpu"}),  # a GPU machine with .[aot]
    (("/dev/accel0",), ["xla_cuda12"], True, "tpu,cpu", {"cuda"}),  # a TPU VM with .[aot]
    (("/dev/nvidia0",), ["xla_cuda13"], False, None, set()),  # .[cuda] alone: nothing left out
    ((), [], False, None, set()),  # plain jax: JAX decides
    (("/dev/kfd",), ["xla_cuda12"], True, None, set()),  # an AMD GPU: JAX decides
    ((), ["xla_cuda12", "xla_rocm7"], True, None, set()),  # a plugin this does not know: JAX decides
])
def test_only_compile_only_plugins_without_devices_are_left_out(monkeypatch, files, plugins, libtpu, expected, left):
    import fnmatch

    from arlopti_jax.runtime import platforms

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platforms, "LEFT_OUT", {})
    exists = lambda pattern: any(fnmatch.fnmatch(f, pattern) for f in files)
    assert platforms.leave_out_absent_accelerators(exists, plugins, libtpu) == expected
    assert set(platforms.LEFT_OUT) == left
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # the user's choice is never replaced
    assert platforms.leave_out_absent_accelerators(exists, plugins, libtpu) is None


def test_importing_the_package_leaves_the_environment_and_jax_private_api_alone():
    """The platform choice is JAX's own setting in this process, said at start-up; JAX_PLATFORMS
    is not written (a child process decides again), and no private JAX function is called."""
    code = ("import os, arlopti_jax, jax; from arlopti_jax.runtime import chips; "
            "print(os.environ.get('JAX_PLATFORMS')); print(jax.config.jax_platforms); chips.print_backend()")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    environ, platforms, line = proc.stdout.splitlines()[:3]
    import arlopti_jax

    assert environ == "None"
    if platforms == "cpu":  # .[aot] on this CPU machine: the start-up line names what was left out
        assert "left out: cuda (no /dev/nvidia*)" in line and "JAX_PLATFORMS chooses" in line
    assert "cudart_stub" not in proc.stderr and "Could not find cuda drivers" not in proc.stderr
    source = open(arlopti_jax.__file__).read()
    assert "jax._src" not in source and "os.environ[\"JAX_PLATFORMS\"]" not in source


def test_every_extra_installs_the_one_jax_ci_tests():
    """The core dependency and the cuda, cuda12, tpu and aot extras pin one JAX version, so what CI
    tests (``.[test]``, which takes ``.[aot]``) is what a GPU or TPU install gets."""
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *(d for extra in project["optional-dependencies"].values() for d in extra)]
    jax_pins = {re.sub(r"\[.*\]", "", d.split(";")[0]).strip() for d in specs
                if re.match(r"jax(\[|[=<>~ ]|$)", d) or d.startswith(("jax-cuda", "jaxlib"))}
    versions = {re.split(r"==", pin)[1] for pin in jax_pins if "==" in pin}
    assert all("==" in pin for pin in jax_pins) and len(versions) == 1, jax_pins
    import jax

    assert jax.__version__ in versions
