"""``launch/local.sh 2 --devices 4``: a command on 2 CPU processes x 4 devices (gloo), as the
multi-process tests run it, with its group killed if it outlives its time."""

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_flags() -> str:
    """The tests' XLA_FLAGS (``tests/conftest.py``) less the host device count, for processes that
    choose their own (``launch/local.sh --devices``): they compile as the tests' one-process runs
    they are compared with do."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_force_host_platform_device_count"))


def launch_two(args: list[str], logs: Path, timeout: int, module: str | None = None, devices: int = 4,
               wait: bool = True, **env: str):
    """Run ``train`` (or ``--module``, a module of tests/helpers) with ``args`` in both processes,
    their logs in ``logs``. Returns the launcher's exit status and its combined output; past
    ``timeout`` seconds the processes are killed (status -9) and the output ends with their logs'
    last lines."""
    cmd = ["bash", str(REPO / "launch" / "local.sh"), "2", "--devices", str(devices),
           *(["--module", module] if module else []),
           "--logs", str(logs), "--", *args]
    path = os.pathsep.join([str(REPO / "tests" / "helpers"), str(REPO), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHON": sys.executable, "XLA_FLAGS": child_flags(),
                                                "PYTHONPATH": path, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    if not wait:  # the caller waits (or kills the group: os.killpg(proc.pid, ...))
        return proc
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # the caller's assertion shows where each process was
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0] + f"\nlaunch_two: killed after {timeout} s; the processes' logs end:\n" + "\n".join(
            f"--- {name}\n{text[-3000:]}" for name, text in logs_of(logs).items())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def logs_of(logs: Path) -> dict[str, str]:
    """Each process's log, by file name."""
    return {p.name: p.read_text() for p in sorted(logs.glob("*.log"))}
