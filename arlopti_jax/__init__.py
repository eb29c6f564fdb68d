"""arlopti_jax: RL from verifiable rewards in JAX, with Advantage Reweighting and Lopti."""

__version__ = "0.1.0"


def _default_to_cpu_without_accelerators() -> None:
    """``JAX_PLATFORMS=cpu`` by default on a machine with no GPU or TPU device files. The
    compile-only compilers of ``.[aot]`` (libtpu, the CUDA plugin) would otherwise each try to
    start their backend in every process, print errors, and fall back to the CPU; with no
    accelerator there is nothing else they could start. A set ``JAX_PLATFORMS`` is kept."""
    import glob
    import os

    if "JAX_PLATFORMS" not in os.environ and not any(glob.glob(p) for p in ("/dev/nvidia*", "/dev/accel*",
                                                                            "/dev/vfio/[0-9]*")):
        os.environ["JAX_PLATFORMS"] = "cpu"


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


def _import_jax_without_cuda_stub_lines() -> None:
    """Import JAX with two lines of native start-up logging removed from stderr.

    The CUDA plugin that ``.[aot]`` installs (the compiler of the compile-only H100 target)
    loads its libraries whenever JAX starts, and on a machine without a GPU each load logs
    "Could not find cuda drivers on your machine" (with absl's "before InitializeLog" banner)
    from C++, where no Python or environment setting reaches: every command's stderr would
    open with six such lines. The import runs with the process's stderr captured; every other
    line is written back unchanged."""
    import importlib.util
    import os
    import re
    import sys
    import tempfile

    if ("jax" in sys.modules or os.environ.get("JAX_PLATFORMS") != "cpu"
            or importlib.util.find_spec("jax_plugins") is None):
        return
    try:
        if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
            return
        saved = os.dup(2)
    except (ImportError, OSError, ValueError):
        return
    noise = re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers|"
                       r"^WARNING: All log messages before absl::InitializeLog\(\) is called")
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            import jax  # noqa: F401
            from jax._src import xla_bridge

            xla_bridge._discover_and_register_pjrt_plugins()  # the plugin's libraries load here too
        except Exception:  # any import problem shows itself again at the caller's own import
            pass
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        kept = [line for line in captured.read().decode(errors="replace").splitlines() if not noise.search(line)]
    if kept:
        sys.stderr.write("\n".join(kept) + "\n")


_default_to_cpu_without_accelerators()
_cpu_collectives_in_one_order()
_import_jax_without_cuda_stub_lines()
