"""arlopti_jax: RL from verifiable rewards in JAX, with Advantage Reweighting and Lopti."""

__version__ = "0.1.0"


def _cpu_collectives_in_one_order() -> None:
    """With several host devices in one process (``--xla_force_host_platform_device_count=N``, as
    the tests and CPU rehearsals of a mesh use), XLA:CPU's concurrency-optimized scheduler can let
    the devices enter two independent collectives in different orders: each waits in the one the
    others have not reached, and after 40 s XLA aborts the process. On 2 cores with 8 devices an
    FSDP SFT step did so about once in 100 (3 of 4 processes of 150 steps; 0 of 4 with this flag;
    jax 0.10.2, 2026-11-27). Its other scheduler keeps one order. Set before JAX reads XLA_FLAGS
    (when its backend starts); a value the user set for the flag is kept."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags and "concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = flags + " --xla_cpu_enable_concurrency_optimized_scheduler=false"


def _cpu_fusions_by_xla() -> None:
    """XLA:CPU hands dots, reductions and elementwise fusions to YNNPACK by default
    (``--xla_cpu_experimental_ynn_fusion_type``); with this flag empty it emits them itself. On this
    project's 2-core CPU (jax 0.10.2, 2026-12-02) that made SmolLM2's update 1.34x faster (45 s
    -> 33.5 s a step: the log-softmax's reductions over a 49,152-token vocabulary ran 3x slower in
    YNNPACK) and the tiny Qwen2's 1.2x (docs/reference/performance.md, "XLA:CPU's fusions"). It
    touches only the CPU backend; a value the user set for the flag is kept. Only on the jaxlib it was
    measured on: XLA ends the process on a flag its release does not know. Not with several host
    devices (``--xla_force_host_platform_device_count=N``, N > 1): there XLA's own fusions made
    SmolLM2's greedy decode wrong after a few tokens on any mesh of 2 or more devices (all 32 rows
    of a probe, log-probs off by 23 from a forward pass; step 1's sampler/trainer KL 3.4 in a
    training run), where YNNPACK's are exact (2026-12-06, docs/measurements/journal.md). The same
    flag makes the decode wrong beside a concurrent program on one device (``bench/cpu_thread_race.py``),
    which is why the CPU runs the sampling loop's jobs in the main thread (``rl.pipeline.in_thread``)."""
    import importlib.metadata
    import os
    import re

    try:
        measured = importlib.metadata.version("jaxlib").startswith("0.10.")
    except importlib.metadata.PackageNotFoundError:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    count = re.search(r"xla_force_host_platform_device_count=(\d+)", flags)
    if count and int(count.group(1)) > 1:
        return
    if measured and "xla_cpu_experimental_ynn_fusion_type" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_experimental_ynn_fusion_type=").strip()


def _import_jax_quietly() -> None:
    """Import JAX with the lines the compile-only CUDA plugin prints from C++ as its libraries load
    on a machine without a GPU ("Could not find cuda drivers", with absl's banner: six lines no
    Python or environment setting reaches) taken out of stderr; every other line is written back.
    The backend's start does the same (``runtime.chips.start_backend``)."""
    import sys

    if "jax" in sys.modules:
        return
    from arlopti_jax.runtime.platforms import plugin_noise_removed

    with plugin_noise_removed():
        try:
            import jax  # noqa: F401
        except Exception:  # any import problem shows itself again at the caller's own import
            pass


def _platforms_that_can_start() -> None:
    """JAX's platform list without the compile-only plugins whose devices are absent
    (``runtime.platforms``), as JAX's own setting in this process alone: a child process decides
    again, and the start-up line says what was left out."""
    from arlopti_jax.runtime.platforms import leave_out_absent_accelerators

    platforms = leave_out_absent_accelerators()
    if platforms:
        import jax

        jax.config.update("jax_platforms", platforms)


_cpu_collectives_in_one_order()
_cpu_fusions_by_xla()
_import_jax_quietly()
_platforms_that_can_start()
