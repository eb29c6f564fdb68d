"""JAX's persistent compilation cache: every compiled program is written to a folder, and a
later process (a second run, a resume, an evaluation, the next test session) reads it back
instead of compiling it again.

    compile_cache.enable(config.compile_cache_dir)

The command lines (``cli.parse_command_line``: train, eval, sft), ``reproduce`` and the tests
(``tests/conftest.py``) call this before compiling anything.

The default folder is per user, ``~/.cache/arlopti_jax/jax``, not one beside the run folder:
a compiled program depends on the model's shapes, the mesh and the code, not on the run, so
every run of a model (a sweep's variants and seeds, a resume, an evaluation) reuses the same
programs; and a run folder of a multi-host run lives on a shared filesystem, often a slow one.
On several hosts only process 0 writes entries (JAX's rule), so other hosts reuse them only
from a folder they all share.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
from pathlib import Path

import jax

DEFAULT_DIR = "~/.cache/arlopti_jax/jax"
_REMOTE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")  # gs://bucket/..., s3://...: not a local path
MAX_BYTES = 4 << 30  # beyond this, ``enable`` deletes the least recently used entries (``trim``)


def _host_tag() -> str:
    """A folder name per CPU instruction set. XLA:CPU compiles for the host's CPU features and
    the cache key does not include them: a program compiled on an AVX-512 machine, read on a
    machine without AVX-512 through a shared home folder, would crash."""
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    digest = hashlib.sha256(f"{platform.machine()} {' '.join(sorted(flags.split()))}".encode()).hexdigest()
    return f"{platform.machine()}-{digest[:10]}"


def _enable_remote(url: str) -> str:
    """A folder on remote storage (gs://, s3://, ...), which JAX reads through etils.epath: made
    here, so that a storage backend that is not installed (gcsfs for gs://, s3fs for s3://) or a
    bucket that cannot be written stops the command at start-up in one line (ValueError), not at
    its first compile."""
    from etils import epath

    folder = url.rstrip("/") + "/" + _host_tag()
    try:
        epath.Path(folder).mkdir(parents=True, exist_ok=True)
    except Exception as err:  # noqa: BLE001 - ImportError for a missing backend, the backend's own errors
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"config.compile_cache_dir={url} cannot be used: {detail}") from None
    return use(folder)


def use(folder: str | Path) -> str | Path:
    """Compile through the persistent cache in ``folder`` as it is (no subfolder), caching every
    program however fast it compiled: the one place these settings are made. JAX's own size bound
    stays off (its default): it rescans the whole folder at every write, 0.1 s per compiled program
    on a folder of 2,600 programs (2026-11-29), and takes a file lock at every read; ``enable``
    bounds a local folder once, with ``trim``."""
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", -1)
    return folder


def trim(folder: Path, max_bytes: int = MAX_BYTES) -> int:
    """When ``folder`` holds more than ``max_bytes``, deletes its least recently used entries (by the
    files' access times) until it holds at most three quarters of that; returns how many. An entry
    another process is reading as it goes is compiled again there, with a warning."""
    entries = []
    for entry in os.scandir(folder):
        if entry.is_file() and not entry.name.startswith("."):
            stat = entry.stat()
            entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, entry.path))
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    deleted = 0
    for _, size, path in sorted(entries):
        if total <= max_bytes * 3 // 4:
            break
        Path(path).unlink(missing_ok=True)
        total -= size
        deleted += 1
    return deleted


def enable(directory: str) -> Path | str | None:
    """Compile through the persistent cache in ``directory`` (``~`` expanded; a subfolder per
    CPU instruction set; a URL such as gs://bucket/folder is a remote folder, ``_enable_remote``);
    '' leaves JAX's own setting alone. Every program is cached, however
    fast it compiled (JAX's default skips those under a second: dozens of them per run).
    Returns the folder used, or None."""
    if not directory:
        return None
    if _REMOTE.match(directory):
        return _enable_remote(directory)
    path = Path(directory).expanduser() / _host_tag()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a read-only home, say: compile as without the cache
        logging.getLogger(__name__).warning("no persistent compilation cache: %s", err)
        return None
    trim(path, MAX_BYTES)
    return use(path)
