"""What a command sets for its own process, and nothing set by importing the package.

Importing ``arlopti_jax`` or any of its modules changes no environment variable, no ``jax.config``
value and no file descriptor (``tests/test_package.py`` holds it). A command run as
``python -m arlopti_jax.X`` calls ``prepare()`` first, before it imports JAX, and ``start_backend()``
once its arguments are read; the start-up line (``chips.describe_devices``) then names every setting
it chose and every platform JAX could not start. A setting the user made (in ``XLA_FLAGS``) is kept.

What ``prepare`` sets, and why:

- With several host devices in one process (``--xla_force_host_platform_device_count=N`` or
  ``JAX_NUM_CPU_DEVICES=N``, N > 1: the CPU rehearsals of a mesh), XLA:CPU's concurrency-optimized
  scheduler off. With it, the devices can enter two independent collectives in different orders,
  each waiting in the one the others have not reached, until XLA aborts the process after 40 s: on
  2 cores an 8-device FSDP SFT step did so about once in 100 (3 of 4 processes of 150 steps; 0 of 4
  without it; jax 0.10.2, 2026-11-27). The flag touches only the CPU backend.
- Nothing else. XLA:CPU's fusions are left to XLA's default (YNNPACK's): the empty
  ``--xla_cpu_experimental_ynn_fusion_type=`` that the package set from 2026-12-02 made SmolLM2's
  greedy decode wrong on meshes of 2 or more host devices and beside a concurrent program
  (docs/measurements/journal.md, 2026-12-06 and 2026-12-07). The platform is JAX's choice: it
  starts every platform whose devices it finds (``/dev/nvidia*``, WSL2's ``/dev/dxg``, a TPU) and
  falls back to the CPU; ``start_backend`` says what did not start and why.

``JAX_PLATFORMS`` and ``jax.config`` are never written: a user's choice stands, and a child process
decides again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile

# What ``prepare`` set in this process, for the start-up line; and the platforms JAX could not start
SETTINGS: list[str] = []
NOT_STARTED: dict[str, str] = {}

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"

# Lines the accelerator plugins print from C++ as they start or fail on a machine without their
# devices (the CUDA plugin's driver probe with absl's banner; libtpu's host probe): what they mean is
# in the start-up line's "not started" part, so a command takes them out of stderr around JAX's import
# and its backend's start. Every other line is written back.
PLUGIN_NOISE = re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers|"
                          r"^WARNING: All log messages before absl::InitializeLog\(\) is called|"
                          r"^WARNING: Logging before InitGoogle\(\) is written to STDERR|"
                          r"Failed to find host bounds for accelerator type|"
                          r"could not determine TPU worker hostnames|"
                          r"^=== Source Location Trace: ===|libtpu_init_utils\.cc:\d+$")


def host_device_count(environ=None) -> int:
    """The CPU devices this process's backend will make, from ``XLA_FLAGS`` and ``JAX_NUM_CPU_DEVICES``
    (JAX's own setting, which wins when set), read before the backend starts."""
    env = os.environ if environ is None else environ
    if env.get("JAX_NUM_CPU_DEVICES", "").strip().lstrip("-").isdigit() and int(env["JAX_NUM_CPU_DEVICES"]) > 0:
        return int(env["JAX_NUM_CPU_DEVICES"])
    found = re.search(r"xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    return int(found.group(1)) if found else 1


def command_flags(environ=None) -> tuple[str, list[str]]:
    """(``XLA_FLAGS`` for a command's process, the settings added, each with its reason)."""
    env = os.environ if environ is None else environ
    flags = env.get("XLA_FLAGS", "")
    added = []
    count = host_device_count(env)
    if count > 1 and SCHEDULER_FLAG not in flags:
        flags = f"{flags} {SCHEDULER_FLAG}=false".strip()
        added.append(f"{SCHEDULER_FLAG}=false ({count} host devices: collectives in one order)")
    return flags, added


def prepare() -> None:
    """A command's own settings (the module docstring), in ``os.environ`` before its backend starts,
    then JAX imported with the plugins' load lines taken out of stderr. A command module calls it
    first, under ``if __name__ == "__main__":``, before its own imports (which import JAX): importing
    that module as a library runs none of it. A second call changes nothing."""
    if SETTINGS or "jax" in sys.modules:
        return
    flags, added = command_flags()
    if added:
        os.environ["XLA_FLAGS"] = flags
        SETTINGS.extend(f"XLA_FLAGS += {line}" for line in added)
    with plugin_noise_removed():
        try:
            import jax  # noqa: F401
        except Exception:  # an import problem shows itself again at the command's own import
            pass


class _Refusals(logging.Handler):
    """JAX's log lines about plugins and platforms that would not start, kept instead of printed."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "plugin configuration error" in message or "Unable to initialize backend" in message:
            detail = record.exc_info[1] if record.exc_info and record.exc_info[1] is not None else None
            self.lines.append(f"{message}: {detail}" if detail is not None else message)


def start_backend() -> None:
    """Start JAX's backend (``jax.devices()``), the platform JAX's own choice, without the plugins'
    C++ load lines on stderr; the platforms JAX tried and could not start go to ``NOT_STARTED``
    (platform -> JAX's reason), which the start-up line names. Commands call it through
    ``chips.print_backend`` or ``distributed.initialize``."""
    import jax

    refusals = _Refusals()
    logger = logging.getLogger("jax._src.xla_bridge")
    propagate, level = logger.propagate, logger.level
    logger.addHandler(refusals)
    logger.propagate = False
    logger.setLevel(logging.INFO)  # a platform that fails quietly is said at INFO
    try:
        with plugin_noise_removed():
            jax.devices()
    finally:
        logger.removeHandler(refusals)
        logger.propagate, logger.level = propagate, level
    for line in refusals.lines:
        found = re.search(r"backend '(\w+)': (.*)", line) or re.search(r"xla_(\w+?)\d*\.initialize\(\)\S*: (.*)", line)
        if found:
            NOT_STARTED.setdefault(found.group(1), found.group(2).strip().splitlines()[-1][:160])


@contextlib.contextmanager
def plugin_noise_removed():
    """Run the body with file descriptor 2 captured; then write back every line but ``PLUGIN_NOISE``'s,
    in order, and leave fd 2 as it was. Where stderr cannot be duplicated, the body runs as it is."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines()
                    if not PLUGIN_NOISE.search(line)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                sys.stderr.flush()
