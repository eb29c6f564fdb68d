"""Importing the package sets nothing; a command sets its own process's settings and says so."""

import os
import subprocess
import sys

import pytest

SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler"

# In a fresh interpreter: JAX imported first, then a snapshot of the environment, of every jax.config
# value and of what file descriptor 2 is; then the package and each subpackage (every module a
# command imports) imported; then the same snapshot. ``hide`` makes the accelerator plugins of .[aot]
# (jax_plugins, libtpu) unimportable, as on a machine without them.
_INERT = """
import importlib, json, os, sys
if sys.argv[1] == "hide":
    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("jax_plugins", "libtpu"):
                raise ModuleNotFoundError(name)
    sys.meta_path.insert(0, Hide())
import jax

def snapshot():
    stat = os.fstat(2)
    return {"environ": dict(os.environ), "fd2": [stat.st_dev, stat.st_ino, os.readlink("/proc/self/fd/2")],
            "config": {k: repr(v) for k, v in jax.config.values.items()}}

before = snapshot()
import arlopti_jax
for name in ("runtime", "models", "algos", "rollout", "tasks", "config", "store", "finetune", "embedded", "rl",
             "experiments", "aot", "aot.__main__", "train", "eval", "sft", "export", "plot", "reproduce", "warm_start"):
    importlib.import_module(f"arlopti_jax.{name}")
after = snapshot()
print(json.dumps({k: [before[k], after[k]] for k in before}))
"""


@pytest.mark.parametrize("plugins", ["installed", "hide"])
def test_importing_the_package_sets_no_environment_no_jax_config_and_no_file_descriptor(plugins):
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # where the package once added flags
    proc = subprocess.run([sys.executable, "-c", _INERT, plugins], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for what, (before, after) in got.items():
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)) \
            if isinstance(before, dict) else (before != after)
        assert not changed, f"importing the package changed {what}: {changed}"


@pytest.mark.parametrize("environ,expected,added", [
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
     f"--xla_force_host_platform_device_count=8 {SCHEDULER}=false", True),
    ({"XLA_FLAGS": "", "JAX_NUM_CPU_DEVICES": "4"}, f"{SCHEDULER}=false", True),  # JAX's own setting counts too
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, "--xla_force_host_platform_device_count=1", False),
    ({"XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {SCHEDULER}=true"},  # the user's choice stands
     f"--xla_force_host_platform_device_count=4 {SCHEDULER}=true", False),
    ({}, "", False),
])
def test_a_command_sets_the_scheduler_flag_only_with_several_host_devices(environ, expected, added):
    from arlopti_jax.runtime import process

    flags, lines = process.command_flags(environ)
    assert flags == expected and bool(lines) == added
    assert "ynn" not in flags  # XLA:CPU's fusions are XLA's default: nobody sets them


def test_a_command_says_its_settings_and_the_platforms_jax_did_not_start_in_its_start_up_line(tmp_path):
    """A command's process (``process.prepare`` before JAX's import, then the backend's start, as
    ``python -m arlopti_jax.train`` runs them):
    the flag in force when the backend starts (the backend has the 3 devices the same XLA_FLAGS asks
    for), the start-up line naming it; JAX_PLATFORMS unset, so JAX chooses the platform, and what it
    could not start (.[aot]'s plugins on this CPU machine) is named, without the plugins' C++ lines."""
    code = ("import os; from arlopti_jax.runtime import process; process.prepare(); import jax; "
            "from arlopti_jax.runtime import chips; chips.print_backend(); print(os.environ['XLA_FLAGS']); "
            "print(jax.config.jax_platforms)")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line, flags, platforms = proc.stdout.strip().splitlines()[-3:]
    assert line.startswith("backend: cpu, 3 devices") and f"this command set XLA_FLAGS += {SCHEDULER}=false" in line
    assert flags.endswith(f"{SCHEDULER}=false") and platforms == "None"  # JAX's choice, never written
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:  # .[aot] here: JAX tried its TPU and said why it failed
        assert "not started: " in line and "tpu (" in line, line
    assert "Failed to find host bounds" not in proc.stderr and "libtpu_init_utils" not in proc.stderr
    assert "cudart_stub" not in proc.stderr  # the CUDA plugin's lines at JAX's import, taken out by prepare


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
