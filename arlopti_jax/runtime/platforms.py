"""Which platforms JAX may start, and the compile-only plugins kept quiet, decided as the package
is imported (``arlopti_jax/__init__.py``) and said at start-up (``chips.describe_devices``).

``leave_out_absent_accelerators()``: the compile-only compilers of ``.[aot]`` (the CUDA plugin,
libtpu) left out of JAX's platform list where their devices are absent, and nothing else decided.
``plugin_noise_removed()``: the lines the CUDA plugin prints from C++ as it loads on a machine
without a GPU, taken out of stderr, around JAX's import and its backend's start
(``chips.start_backend``). Imports nothing of JAX, so the package can use it before JAX."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

# platform -> why the package left it out of JAX's list (``leave_out_absent_accelerators``); the
# start-up line says so (``chips.describe_devices``)
LEFT_OUT: dict[str, str] = {}


def leave_out_absent_accelerators(exists=None, plugins=None, has_libtpu=None) -> str | None:
    """The platform list for JAX where the only accelerator compilers installed are ``.[aot]``'s
    compile-only ones (the CUDA plugin, libtpu) and their devices are absent: every platform that
    could start, ``cpu`` last (for example ``"cpu"`` on a CPU machine with ``.[aot]``), so that those
    plugins do not each try to start a backend, print errors and fall back in every process.
    None (JAX chooses, as always) where ``JAX_PLATFORMS`` is set, where another accelerator's
    devices or plugin are there (``/dev/kfd``: ROCm; a plugin this does not know), or where no
    compile-only plugin would be left out. What it leaves out goes to ``LEFT_OUT``.
    ``exists``, ``plugins``, ``has_libtpu``: the device-file check, the installed ``jax_plugins``
    module names and whether libtpu is installed (tests pass their own)."""
    import glob
    import importlib.util
    import os
    import pkgutil

    if os.environ.get("JAX_PLATFORMS"):
        return None
    exists = exists or (lambda pattern: bool(glob.glob(pattern)))
    if plugins is None:
        spec = importlib.util.find_spec("jax_plugins")  # a namespace package the plugins install into
        plugins = [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)] if spec else []
    has_libtpu = importlib.util.find_spec("libtpu") is not None if has_libtpu is None else has_libtpu
    if exists("/dev/kfd") or any(not name.startswith("xla_cuda") for name in plugins):
        return None  # an AMD GPU, or an accelerator plugin this does not know: JAX decides
    installed = {"cuda": any(plugins), "tpu": has_libtpu}
    devices = {"cuda": exists("/dev/nvidia*"), "tpu": exists("/dev/accel*") or exists("/dev/vfio/[0-9]*")}
    why = {"cuda": "no /dev/nvidia*", "tpu": "no /dev/accel* or /dev/vfio/N"}
    left = {p: why[p] for p in installed if installed[p] and not devices[p]}
    if not left:
        return None
    LEFT_OUT.update(left)
    return ",".join([p for p in installed if installed[p] and devices[p]] + ["cpu"])


PLUGIN_NOISE = re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers|"
                          r"^WARNING: All log messages before absl::InitializeLog\(\) is called")


@contextlib.contextmanager
def plugin_noise_removed():
    """Run the body with file descriptor 2 captured; then write back every line but
    ``PLUGIN_NOISE``'s, in order. Where stderr cannot be duplicated, the body runs as it is."""
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
