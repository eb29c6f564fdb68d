"""One path type for every file a run reads or writes: a local path, or a bucket (``gs://``),
both as ``etils.epath`` paths, the abstraction orbax itself writes checkpoints through.

    path("runs/kk3b")                 # a local folder: a pathlib.Path, absolute
    path("gs://bucket/runs/kk3b")     # a bucket folder: an epath.Path (gcsfs underneath)
    path("s3://b/x", "config.run_dir")  # ValueError: config.run_dir=s3://b/x: the scheme s3 is not supported
    check_writable("runs/kk3b", "config.run_dir", need_bytes)  # start-up: a folder the run can write, with room

Orbax writes the checkpoints' arrays into a bucket directly (tensorstore's gcs driver). The rest
of what a run writes there, its JSON-lines records and TensorBoard events, cannot be appended to
in a bucket (an object is written whole), so ``RunFolder`` keeps them in a local staging folder
and copies them up whole (``sync``) at every checkpoint and at the end: a resumed run reads them
back first. A model folder or a data file in a bucket is read from a copy on the host's disk
(``local_copy``), made once per host: the first process of a host copies, the others on it wait
for its lock and reuse the copy.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from arlopti_jax.runtime.startup import StartupError

SUPPORTED = ("gs",)  # remote schemes: gcsfs (fsspec) for files, tensorstore for orbax's arrays
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
STAGING = "~/.cache/arlopti_jax"  # the host's copies of remote models and data, and run-folder staging


def scheme(value) -> str:
    """The URL scheme of ``value`` (``"gs"``), or ``""`` for a local path."""
    match = _SCHEME.match(str(value))
    return match.group(1).lower() if match else ""


def is_remote(value) -> bool:
    return bool(scheme(value))


def check(value, field: str) -> None:
    """ValueError, one line naming ``field``, for a scheme this project cannot read or write."""
    s = scheme(value)
    if s and s not in SUPPORTED:
        raise ValueError(f"{field}={value}: the scheme {s}:// is not supported (local paths and "
                         f"{', '.join(x + '://' for x in SUPPORTED)} are)")


def path(value, field: str = "path"):
    """``value`` as a path: a ``pathlib.Path`` made absolute for a local one, an ``epath.Path`` for a
    bucket one (``check``'s error for another scheme)."""
    check(value, field)
    if is_remote(value):
        import importlib.util

        from etils import epath

        if importlib.util.find_spec("gcsfs") is None:
            raise ValueError(f"{field}={value}: gs:// paths need gcsfs: pip install 'arlopti_jax[gcs]'")
        return epath.Path(str(value))
    return Path(value).expanduser().absolute()


def check_writable(value, field: str, need_bytes: int = 0) -> None:
    """StartupError, one line naming ``field`` and the path, where a run could not write its folder
    ``value``: a file where a folder must be, no permission, a read-only filesystem, or less free space
    than ``need_bytes`` (one checkpoint of the run). A bucket's folder is written through this host's
    staging folder (``RunFolder``), which is checked instead. Leaves nothing behind: the probe is a
    nameless file (``O_TMPFILE``) in the folder, or in its nearest existing parent while the folder
    does not exist yet, which is not created."""
    folder = staging_root() if is_remote(value) else path(value, field)
    where = f"{field}={value}" + (f" (staged on this host in {folder}, ARLOPTI_STAGING)" if is_remote(value) else "")
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StartupError(f"{where}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise StartupError(f"{where}: cannot write in {existing} ({err.strerror or err})") from None
    free = shutil.disk_usage(existing).free
    if not is_remote(value) and free < need_bytes:
        raise StartupError(f"{where}: {free / 2**30:.2f} GiB free on the disk of {existing}, and one checkpoint of "
                           f"this run takes {need_bytes / 2**30:.2f} GiB")


def staging_root() -> Path:
    """This host's folder for copies of bucket files and the records of bucket run folders."""
    return Path(os.environ.get("ARLOPTI_STAGING", STAGING)).expanduser()


def _copy_tree(src, dst: Path) -> None:
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            _copy_tree(child, dst / child.name)
    else:
        with src.open("rb") as f_in, open(dst, "wb") as f_out:
            shutil.copyfileobj(f_in, f_out, 16 << 20)


def local_copy(value, field: str = "path") -> Path:
    """A local path for ``value``: itself when it is local; for a bucket file or folder, its copy in
    the host's staging folder (``ARLOPTI_STAGING``, default ``~/.cache/arlopti_jax``), made whole
    once per host under a file lock and reused by every later process (a ``.complete`` mark says
    it is whole). FileNotFoundError, naming ``field``, where the bucket has nothing there."""
    if not is_remote(value):
        return path(value, field)
    from filelock import FileLock

    src = path(value, field)
    digest = hashlib.sha256(str(value).rstrip("/").encode()).hexdigest()[:16]
    dst = staging_root() / "remote" / f"{digest}-{src.name}"
    done = dst.with_name(dst.name + ".complete")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dst) + ".lock"):
        if not done.exists():
            if not src.exists():
                raise FileNotFoundError(f"{field}={value}: nothing there")
            if dst.exists():
                shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
            _copy_tree(src, dst)
            done.write_text(time.strftime("%Y-%m-%d %H:%M:%S"))
    return dst


class RunFolder:
    """Where a run's records go. ``local``: the folder the records are written in (``run_dir``
    itself when it is local; else a staging folder on this host, filled at start from the bucket).
    ``remote``: the bucket folder or None. ``sync()`` copies every record file of ``local`` up
    (process 0 writes the records; it alone syncs)."""

    # trackers.json: the trackers' run ids (store/trackers.py), so that a run resumed on another host
    # logs into the same dashboard runs
    RECORDS = ("metrics.jsonl", "eval.jsonl", "metrics.jsonl.replaced", "eval.jsonl.replaced", "trackers.json")

    def __init__(self, run_dir, field: str = "config.run_dir"):
        self.run_dir = path(run_dir, field)
        self._synced: dict[Path, tuple[int, int]] = {}
        if not is_remote(run_dir):
            self.local, self.remote = self.run_dir, None
            return
        digest = hashlib.sha256(str(run_dir).rstrip("/").encode()).hexdigest()[:16]
        self.local, self.remote = staging_root() / "runs" / digest, self.run_dir
        self.local.mkdir(parents=True, exist_ok=True)

    def fetch(self) -> None:
        """Bring the bucket's records (a run resumed on another host) down into ``local``,
        replacing what a previous run on this host left there."""
        if self.remote is None:
            return
        for name in self.RECORDS:
            src, dst = self.remote / name, self.local / name
            if src.exists():
                with src.open("rb") as f_in, open(dst, "wb") as f_out:
                    shutil.copyfileobj(f_in, f_out)
            elif dst.exists():
                dst.unlink()
        tb = self.remote / "tb"
        if tb.exists():
            _copy_tree(tb, self.local / "tb")

    def sync(self) -> None:
        """Copy the record files, TensorBoard events and generations of ``local`` that changed
        since the last sync (by size and time) to the bucket, each file whole."""
        if self.remote is None:
            return
        for src in sorted(self.local.rglob("*")):
            if not src.is_file() or src.name.endswith((".tmp", ".lock")):
                continue
            stat = src.stat()
            if self._synced.get(src) == (stat.st_size, stat.st_mtime_ns):
                continue
            dst = self.remote / str(src.relative_to(self.local))
            dst.parent.mkdir(parents=True, exist_ok=True)
            with open(src, "rb") as f_in, dst.open("wb") as f_out:
                shutil.copyfileobj(f_in, f_out, 16 << 20)
            self._synced[src] = (stat.st_size, stat.st_mtime_ns)
