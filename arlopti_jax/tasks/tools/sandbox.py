"""The Python tool: model-written programs run in a separate, limited process, one per call.

    executor = PythonExecutor(SandboxLimits(wall_s=5, memory_bytes=1 << 30))
    executor.check()                      # at start-up: runs print(1); the Isolation it achieved
    result = executor.run("print(sum(range(10)))")   # ToolResult(output='45\\n', error=None, ...)

`CodeExecutor` is the interface: one method, ``run(code, timeout_s=None) -> ToolResult``, which
never raises on the program's account. `PythonExecutor` is the local backend. A real sandbox
plugs in as another CodeExecutor, and the environments take any (``math_python``'s ``executor``):
a container per call (docker/podman run --network=none --read-only --pids-limit --memory), gVisor
(runsc), nsjail or firejail wrapping the same command, or an HTTP sandbox service (the request
carries the code and the limits, the response the output and the exit status).

What every call of PythonExecutor gets:
  * a fresh interpreter, ``python -I -S`` (isolated mode: no PYTHON* variables, no user site, no
    script folder on the path; ``site_packages=True`` drops -S so the interpreter's installed
    packages, sympy and numpy among them, can be imported), in a new session (its own process
    group), stdin /dev/null, and an environment of its own, nothing inherited: PATH, LANG and
    LC_ALL C.UTF-8, HOME its folder, TMPDIR that or the private /tmp (root), BLAS on one thread;
  * an empty temporary working folder holding only main.py, removed afterwards;
  * limits: wall-clock ``wall_s`` (the process group killed at the deadline; the caller waits at
    most that plus a moment), CPU ``cpu_s`` (RLIMIT_CPU), address space ``memory_bytes``
    (RLIMIT_AS: an allocation past it is a MemoryError), file size ``file_bytes`` (RLIMIT_FSIZE),
    ``open_files`` (RLIMIT_NOFILE), no core files; stdout and stderr each read up to
    ``output_bytes`` and the rest drained unread (``truncated``), so a huge print costs the parent
    no memory;
  * on Linux x86_64/aarch64, a seccomp filter (`_sandbox_child`): no fork/vfork/clone of a new
    process (a fork bomb's first fork fails with EAGAIN; threads still work) unless
    ``processes=True``; signals only to itself (with processes and a private user id: to that
    user id's processes, the only ones it may signal); no socket of any family (EACCES: no
    network, no Unix socket such as a Docker daemon's), no ptrace or reading other processes'
    memory, no io_uring, bpf, namespaces, mounts;
  * when the parent runs as root (``private_uid``, the default then): a user id of its own per
    call (not root, no groups; RLIMIT_NPROC then binds, to ``tasks``), in a mount namespace where
    /tmp, /var/tmp, /dev/shm and /run/lock (the usual world-writable folders) are fresh tmpfs's of
    ``tmp_bytes`` (gone after the call) and a 0700 folder on the way to the interpreter (pyenv
    under /root) holds only the interpreter's folders. Where the kernel refuses the namespace
    (root in a container without CAP_SYS_ADMIN), or with ``private_tmp=False``, the program runs
    in its host folder with the host's /tmp (``Isolation.notes`` says so), if the user id can
    reach the interpreter; otherwise every call fails with a message saying why.
    As root with no private user id the program would be root: the executor refuses to start
    (``private_uid=False`` as root must be asked for with ``allow_root=True``).

What it does NOT defend against (use a real sandbox backend where these matter):
  * reading: the program reads every file its user id may read. With a private user id that is
    the world-readable ones (the project's source, its data, world-readable model files,
    /etc/passwd, /proc's public parts: other processes' command lines); run as the trainer's own
    (non-root) user, it is everything that user may read, the trainer's environment included
    (/proc/<trainer pid>/environ: the child's own environment is empty, but the parent's file is
    the same user's);
  * writing: with a private user id, world-writable folders other than those four keep what it
    writes (``find / -xdev -type d -perm -0002`` lists a system's); as the trainer's own user it
    may write wherever that user may, outside its folder included;
  * without seccomp (other systems, other architectures) sockets and the network are open; with
    ``processes=True`` or without seccomp processes can be made: as a non-root user RLIMIT_NPROC
    counts all of the user's processes, so the limit is set to the user's present count plus
    ``tasks`` (racy), and a process that leaves the session outlives the call (the group kill
    misses it); as root with a private user id RLIMIT_NPROC binds to ``tasks`` and every process
    of that user id is killed when the call ends;
  * the kernel's attack surface (a seccomp deny-list is not an allow-list), side channels, and
    resource contention: CPU and memory bandwidth taken from the trainer by concurrent calls
    (RLIMIT_CPU bounds each call's own CPU time, not its share of the machine), and the page
    cache, which RLIMIT_AS does not count.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Protocol

from arlopti_jax.tasks.tools.result import ToolResult

log = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("_sandbox_child.py")
SETUP_FAILED = 70  # the child's exit status when the limits could not be applied
_UID_BASE = 1_800_000_000  # private user ids: far above any real account, below 2**31
_UID_SLOTS = 1024  # per process; a process's block of ids is chosen by its pid


class CodeExecutor(Protocol):
    """Runs one program; a backend (local process, container, service) implements this method."""

    def run(self, code: str, timeout_s: float | None = None) -> ToolResult: ...


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0
    cpu_s: float = 5.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    tmp_bytes: int = 64 << 20  # each private tmpfs (root: /tmp, /var/tmp, /dev/shm)
    open_files: int = 64
    tasks: int = 32  # processes and threads, where RLIMIT_NPROC binds (module docstring)
    output_bytes: int = 64 << 10  # of stdout, and of stderr
    code_bytes: int = 256 << 10
    site_packages: bool = False
    processes: bool = False  # may the program start processes (then bounded by RLIMIT_NPROC, where it binds)

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_bytes", "file_bytes", "tmp_bytes", "open_files", "tasks",
                     "output_bytes", "code_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name}={getattr(self, name)!r}: must be positive")


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What a call achieved, as the child reported it."""

    seccomp: bool
    uid: int
    private_tmp: bool
    notes: tuple[str, ...] = ()


def _python_paths() -> list[str]:
    """The folders the child's interpreter reads: its prefixes and its executable's folder."""
    paths = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(p for p in paths if p)


def _processes_of(uid: int, zombies: bool = False) -> list[int]:
    """Processes of a user id; zombies (dead, waiting for their parent to reap them) only if asked."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid and (zombies or Path(entry.path, "stat").read_text().split()[2] != "Z"):
                    pids.append(int(entry.name))
            except (OSError, IndexError):  # gone meanwhile
                pass
    return pids


def _kill_all_of(uid: int) -> None:
    """Kill every live process of a private user id (one that left the call's group included)."""
    for _ in range(50):
        pids = _processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    log.warning("sandbox: processes of user id %d survive SIGKILL: %s", uid, _processes_of(uid))


class _Uids:
    """Private user ids for concurrent calls of this process, each in use by one call at a time. An
    id whose processes are not all reaped yet (zombies count towards RLIMIT_NPROC) waits until they
    are before it is used again."""

    def __init__(self):
        self.base = _UID_BASE + (os.getpid() % 300_000) * _UID_SLOTS
        self.free = list(range(_UID_SLOTS))
        self.waiting: list[int] = []
        self.lock = threading.Lock()

    def take(self) -> int:
        with self.lock:
            if self.waiting:
                clean = [i for i in self.waiting if not _processes_of(self.base + i, zombies=True)]
                self.waiting = [i for i in self.waiting if i not in clean]
                self.free += clean
            if not self.free:
                raise RuntimeError(f"more than {_UID_SLOTS} concurrent sandboxed calls (or unreaped processes)")
            return self.base + self.free.pop()

    def give(self, uid: int) -> None:
        _kill_all_of(uid)
        with self.lock:
            (self.waiting if _processes_of(uid, zombies=True) else self.free).append(uid - self.base)


_uids = _Uids()


def _user_tasks() -> int:
    """Processes and threads of this user id now (what RLIMIT_NPROC counts for a non-root user)."""
    count, me = 0, os.getuid()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == me:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                pass
    return count


class PythonExecutor:
    """The local process backend of CodeExecutor (module docstring)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), *, private_uid: bool | None = None,
                 private_tmp: bool = True, allow_root: bool = False):
        if not sys.executable:
            raise RuntimeError("the Python tool needs sys.executable, and this interpreter has none")
        root = os.geteuid() == 0
        self.limits = limits
        self.private_uid = root if private_uid is None else private_uid
        self.private_tmp = private_tmp
        if self.private_uid and not root:
            raise ValueError("private_uid=True needs the trainer to run as root (it sets the child's user id)")
        if root and not self.private_uid and not allow_root:
            raise ValueError("the trainer runs as root: a program without a private user id would run as root; "
                             "keep private_uid (the default) or pass allow_root=True")
        self.env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self._warned: set[str] = set()
        self.last_isolation: Isolation | None = None  # of the latest call that started

    def _config(self, uid: int | None, report_fd: int) -> dict:
        lim = self.limits
        if uid is not None:
            tasks = lim.tasks
        elif os.geteuid() != 0 and sys.platform == "linux":
            tasks = _user_tasks() + lim.tasks
        else:  # root keeps its processes unlimited whatever RLIMIT_NPROC says; other systems: not counted here
            tasks = None
        return {"uid": uid, "private_tmp": self.private_tmp, "report_fd": report_fd, "python_paths": _python_paths(),
                "tmp_bytes": lim.tmp_bytes,
                "cpu_s": max(1, math.ceil(lim.cpu_s)), "memory_bytes": lim.memory_bytes, "file_bytes": lim.file_bytes,
                "open_files": lim.open_files, "tasks": tasks, "processes": lim.processes,
                "python_flags": ["-I"] if lim.site_packages else ["-I", "-S"],
                "env": self.env}

    def run(self, code: str, timeout_s: float | None = None) -> ToolResult:
        """Run ``code`` (module docstring); its output, or why it failed, as a ToolResult."""
        start = time.monotonic()
        wall = self.limits.wall_s if timeout_s is None else timeout_s
        data = code.encode("utf-8", errors="replace")
        if len(data) > self.limits.code_bytes:
            return ToolResult("", f"the program is longer than {self.limits.code_bytes} bytes")
        uid = _uids.take() if self.private_uid else None
        workdir = tempfile.mkdtemp(prefix="arlopti-sandbox-")
        try:
            Path(workdir, "main.py").write_bytes(data)
            return self._run(uid, workdir, wall, start)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if uid is not None:
                _uids.give(uid)

    def _run(self, uid: int | None, workdir: str, wall: float, start: float) -> ToolResult:
        report_r, report_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(CHILD), json.dumps(self._config(uid, report_w))],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
                env=self.env, start_new_session=True, close_fds=True, pass_fds=(report_w,))
        except OSError as e:
            os.close(report_r)
            return ToolResult("", f"the sandbox could not start: {e}", time.monotonic() - start)
        finally:
            os.close(report_w)
        deadline = start + wall
        streams, killed = self._read(proc, report_r, deadline)
        returncode = proc.wait()
        seconds = time.monotonic() - start
        return self._result(streams, returncode, killed, wall, seconds)

    def _read(self, proc: subprocess.Popen, report_r: int, deadline: float) -> tuple[dict, bool]:
        """stdout, stderr (each capped) and the report until all close, or the deadline kills the group."""
        cap = self.limits.output_bytes
        out = {"stdout": bytearray(), "stderr": bytearray(), "report": bytearray()}
        dropped = {"stdout": 0, "stderr": 0, "report": 0}
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        sel.register(report_r, selectors.EVENT_READ, "report")
        killed = False
        exited_at = None
        while sel.get_map():
            now = time.monotonic()
            if proc.poll() is not None and exited_at is None:
                exited_at = now  # a leftover process may hold the pipes: give them a moment, then stop
            if now >= deadline or (exited_at is not None and now - exited_at > 0.2):
                if now >= deadline and proc.poll() is None:
                    killed = True
                break
            for key, _ in sel.select(timeout=min(0.05, max(0.0, deadline - now))):
                fd = key.fd if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                room = cap - len(out[key.data])
                out[key.data] += chunk[:max(0, room)]
                dropped[key.data] += max(0, len(chunk) - max(0, room))
        for _ in range(100):  # the program, and anything left in its group (again, while members fork)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                break
            proc.poll()  # reap it, so that the group empties
            time.sleep(0.002)
        sel.close()
        os.close(report_r)
        proc.stdout.close()
        proc.stderr.close()
        return {**out, "truncated": bool(dropped["stdout"] or dropped["stderr"])}, killed

    def _result(self, streams: dict, returncode: int, killed: bool, wall: float, seconds: float) -> ToolResult:
        stdout = streams["stdout"].decode("utf-8", errors="replace")
        stderr = streams["stderr"].decode("utf-8", errors="replace")
        lines = [json.loads(line) for line in streams["report"].decode(errors="replace").splitlines() if line.strip()]
        setup_error = next((r["setup_error"] for r in lines if "setup_error" in r), None)
        if setup_error is not None or (not lines and not killed):
            message = setup_error or f"the sandbox's child died before the program started ({stderr.strip()[-200:]})"
            if message not in self._warned:
                self._warned.add(message)
                log.warning("Python tool: %s", message)
            return ToolResult("", f"the sandbox could not run the program: {message}", seconds)
        if lines:
            self.last_isolation = Isolation(lines[0]["seccomp"], lines[0]["uid"], lines[0]["private_tmp"],
                                            tuple(lines[0]["notes"]))
        output = stdout + stderr
        timed_out, error = False, None
        if killed:
            timed_out, error = True, f"timed out after {wall:g} s"
        elif returncode == -signal.SIGXCPU:
            timed_out, error = True, f"CPU time limit ({max(1, math.ceil(self.limits.cpu_s))} s) exceeded"
        elif returncode == -signal.SIGKILL:
            timed_out, error = True, "killed by SIGKILL (the CPU time limit's hard stop, or out of memory)"
        elif returncode == -signal.SIGXFSZ:
            error = f"file size limit ({self.limits.file_bytes} bytes) exceeded"
        elif returncode < 0:
            error = f"killed by signal {signal.Signals(-returncode).name}"
        elif returncode > 0:
            last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            error = f"exit status {returncode}" + (f": {last[:200]}" if last else "")
        return ToolResult(output, error, seconds, timed_out, streams["truncated"])

    def check(self) -> Isolation:
        """Run ``print(1)``; the Isolation it got. RuntimeError when the program cannot run here."""
        result = self.run("print(1)")
        if result.output != "1\n" or result.error is not None:
            raise RuntimeError(f"the Python tool cannot run a program here: {result.error or repr(result.output)}")
        return self.last_isolation
