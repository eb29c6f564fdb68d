"""A GCS emulator (``gcp-storage-emulator``, with real GCS's generation headers: gcs_emulator.py)
on localhost for the bucket tests: ``bucket(name)``
yields ``gs://name`` with the environment pointing gcsfs, google-cloud-storage and tensorstore
(what orbax writes arrays through) at it, for this process and its children."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def emulator():
    """The emulator's environment while it runs (in memory); stopped at the end."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("gcs_emulator.py")), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://localhost:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_CLOUD_PROJECT": "test",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # no hierarchical-namespace probe: the emulator has no gRPC
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("localhost", port), timeout=1):
                break
            time.sleep(0.1)
        yield env
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        proc.terminate()
        proc.wait(timeout=30)


def make_bucket(name: str) -> str:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="test", credentials=AnonymousCredentials())
    if client.lookup_bucket(name) is None:
        client.create_bucket(name)
    return f"gs://{name}"


def upload(local: Path, remote: str) -> str:
    """Copy a local file or folder into the bucket path ``remote``; returns ``remote``."""
    from etils import epath

    dst = epath.Path(remote)
    if local.is_dir():
        for child in sorted(local.iterdir()):
            upload(child, f"{remote}/{child.name}")
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(local.read_bytes())
    return remote
