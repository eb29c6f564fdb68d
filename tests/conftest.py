import os
import subprocess
import sys

# Eight fake CPU devices so sharding tests exercise real meshes. Must precede the jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Tests compile thousands of small programs and run each a few times: XLA:CPU's cheapest code
# generation cut a cold default suite's backend compile from 1,783 s to 652 s (2026-11-29). These
# flags choose how much the compiler optimizes, not which fusions it emits: XLA:CPU's fusions are
# XLA's default (YNNPACK's), what a user's command gets (runtime/process.py; the empty
# --xla_cpu_experimental_ynn_fusion_type= the package and this file set until 2026-12-07 made
# SmolLM2's decode wrong on several host devices). The 8 fake devices are 8 threads that meet at
# every collective: the scheduler flag is the one the commands set with several host devices
# (runtime/process.py), and XLA ends the process when one is 40 s late, which on 2 busy cores aborted
# an end-to-end test twice (2026-11-29), so allow 10 minutes. Inherited by the processes tests launch
# (xdist's workers too); a flag already in XLA_FLAGS is left as set. XLA ends the process on a flag
# it does not know, and flags come and go between jaxlib releases (jaxlib 0.11 dropped the
# fusion-emitter one), so a child process tries them first.
TEST_FLAGS = {"--xla_backend_optimization_level": "0", "--xla_llvm_disable_expensive_passes": "true",
              "--xla_cpu_use_fusion_emitters": "false", "--xla_cpu_collective_call_terminate_timeout_seconds": "600",
              "--xla_cpu_enable_concurrency_optimized_scheduler": "false"}


def _known_to_xla(flags: list[str]) -> list[str]:
    def starts(some: list[str]) -> bool:
        env = {**os.environ, "XLA_FLAGS": " ".join(some), "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True).returncode == 0

    return flags if not flags or starts(flags) else [flag for flag in flags if starts([flag])]


os.environ["XLA_FLAGS"] = " ".join([os.environ["XLA_FLAGS"]] + _known_to_xla([
    f"{flag}={value}" for flag, value in TEST_FLAGS.items() if flag not in os.environ["XLA_FLAGS"]]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch (the parity references) on one thread: its OpenMP threads spin-wait, and beside the other
# xdist worker on 2 cores that made a 40-token transformers generate take 96 s instead of 6 s
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from arlopti_jax.runtime import compile_cache  # noqa: E402
from arlopti_jax.config import base_config  # noqa: E402

# programs compiled by one test session are read back by the next (the trainer's default folder)
compile_cache.enable(base_config().compile_cache_dir)


import pytest  # noqa: E402

# The embedded default's start point at test size (the `start_point` fixture).
SMALL = dict(sft_steps=3, sft_rows_per_size=24, train_rows_per_size=40, test_rows_per_size=6)


@pytest.fixture(scope="session")  # built once per test process, shared by every test module
def start_point(tmp_path_factory):
    from arlopti_jax.embedded.start_point import ensure_start_point

    return ensure_start_point(tmp_path_factory.mktemp("sp") / "start_point", seed=0, sizes=SMALL)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skipped real-model or shared-data test fails: a missing model file or data
    folder must not pass quietly."""
    outcome = yield
    report = outcome.get_result()
    needs = next((m for m in ("real_model", "shared_data") if item.get_closest_marker(m)), None)
    if report.skipped and os.environ.get("CI") == "true" and needs:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"a {needs.replace('_', '-')} test was skipped under CI=true: {reason}"
