"""The first program of a sandboxed call: applies the limits, then becomes the user's program.

Run by `sandbox.PythonExecutor` as ``python -I -S _sandbox_child.py CONFIG_JSON`` in the call's
temporary folder, which holds ``main.py``; it imports nothing but the standard library (no site,
no arlopti_jax) and ends in ``os.execve`` of the interpreter on ``main.py``, so the program's
process is this one (its exit status and signals reach the parent as its own) and everything set
here holds for it:

  1. as root, with a private user id (CONFIG 'uid'): a mount namespace of its own (CONFIG
     'private_tmp'), in which /tmp, /var/tmp, /dev/shm and /run/lock are fresh size-limited
     tmpfs's (gone with it), and any folder on the way to the interpreter that the user id could
     not enter (pyenv under a 0700 /root) is a tmpfs holding only the interpreter's folders,
     bound back in place; the program then runs in /tmp/work. Where the kernel refuses the
     namespace (root in a container without CAP_SYS_ADMIN) it runs in the call's host folder,
     given to the user id, with a note, provided the user id can reach the interpreter. Then
     the user id is set, without supplementary groups;
  2. the resource limits (CPU seconds, address space, file size, open files, core 0, and tasks
     where the parent gives a count: RLIMIT_NPROC does not bind root);
  3. a seccomp filter (x86_64 and aarch64 Linux): no new processes (fork, vfork, clone without
     CLONE_THREAD: EAGAIN; clone3: ENOSYS, so threads fall back to clone) unless CONFIG
     'processes'; signals only to itself unless it has processes and a private user id (which
     can signal nothing else); no sockets (EACCES); no ptrace, process_vm_*, io_uring, bpf,
     perf_event_open, userfaultfd, keyrings, namespaces or mounts (EPERM). NO_NEW_PRIVS is set first, so no
     set-uid program regains anything.
It writes what it achieved as one JSON line to the report descriptor (CONFIG 'report_fd', closed by
the exec) just before the exec: {"seccomp": bool, "uid": int, "private_tmp": bool, "notes": [...]}.
No seccomp filter (another system or architecture) is a note, and the call runs with what remains;
any other failure (the kernel refuses the namespace or the user id, the exec fails) would leave the
program more privileged than asked or not run it, so it stops the call: {"setup_error": MESSAGE}
and exit status 70.
"""

import ctypes
import json
import os
import platform
import resource
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_THREAD = 0x00010000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
EAGAIN, EACCES, EPERM, ENOSYS = 11, 13, 1, 38
# (audit arch, syscall numbers); x86_64's and aarch64's tables (asm/unistd_64.h, asm-generic/unistd.h)
ARCHES = {
    "x86_64": (0xC000003E, dict(
        fork=57, vfork=58, clone=56, clone3=435, socket=41, kill=62, tkill=200, tgkill=234, rt_sigqueueinfo=129,
        rt_tgsigqueueinfo=297, ptrace=101, process_vm_readv=310, process_vm_writev=311, unshare=272, setns=308,
        bpf=321, userfaultfd=323, perf_event_open=298, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
        pidfd_send_signal=424, pidfd_getfd=438, mount=165, umount2=166, pivot_root=155, chroot=161, keyctl=250,
        add_key=248, request_key=249, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
        fspick=433, mount_setattr=442)),
    "aarch64": (0xC00000B7, dict(
        clone=220, clone3=435, socket=198, kill=129, tkill=130, tgkill=131, rt_sigqueueinfo=138,
        rt_tgsigqueueinfo=240, ptrace=117, process_vm_readv=270, process_vm_writev=271, unshare=97, setns=268,
        bpf=280, userfaultfd=282, perf_event_open=241, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
        pidfd_send_signal=424, pidfd_getfd=438, mount=40, umount2=39, pivot_root=41, chroot=51, keyctl=219,
        add_key=217, request_key=218, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
        fspick=433, mount_setattr=442)),
}
DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "unshare", "setns", "bpf", "userfaultfd",
          "perf_event_open", "io_uring_setup", "io_uring_enter", "io_uring_register", "pidfd_send_signal",
          "pidfd_getfd", "mount", "umount2", "pivot_root", "chroot", "keyctl", "add_key", "request_key", "open_tree",
          "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr")
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # the usual world-writable folders
TO_SELF_ONLY = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")  # their first argument: a pid

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _blocked_ancestor(path: str) -> str | None:
    """The outermost folder on the way to ``path`` that others may not enter, or None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        folder = "/" + "/".join(parts[:i])
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


def private_filesystem(config: dict) -> None:
    """Step 1 of the module docstring (root only): raises OSError when the kernel refuses."""
    needed = [p for p in config["python_paths"] if os.path.isdir(p)]
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    covers = {os.path.realpath(p) for p in SHARED_TMP if os.path.isdir(p)}  # /var/lock -> /run/lock: once
    covers |= {a for a in map(_blocked_ancestor, needed) if a}
    covers = {c for c in covers if not any(c.startswith(o + "/") for o in covers)}  # the outermost only
    keep = {p: os.open(p, os.O_PATH) for p in needed if any(p == c or p.startswith(c + "/") for c in covers)}
    size = config["tmp_bytes"]
    for cover in sorted(covers):
        mode = "1777" if cover in SHARED_TMP else "755"
        _mount("tmpfs", cover, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")
    for path, fd in sorted(keep.items()):
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    os.makedirs("/tmp/work", mode=0o700)
    os.chown("/tmp/work", config["uid"], config["uid"])


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def _seccomp_program(arch: int, numbers: dict, pid: int, processes: bool,
                     signals: bool) -> list[tuple[int, int, int, int]]:
    """The filter of step 3 as (code, jt, jf, k) instructions; ``processes``: fork and clone pass;
    ``signals``: signals to other processes pass."""
    ld, jeq, jset, jge, ret = 0x20, 0x15, 0x45, 0x35, 0x06
    nr, arch_off, arg0 = 0, 4, 16  # struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6] (low word first)
    prog = [(ld, 0, 0, arch_off), (jeq, 1, 0, arch), (ret, 0, 0, RET_KILL_PROCESS), (ld, 0, 0, nr)]
    if arch == ARCHES["x86_64"][0]:  # the x32 ABI's numbers would dodge the table
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, RET_ERRNO | ENOSYS)]
    for name in ("fork", "vfork") if not processes else ():
        if name in numbers:
            prog += [(jeq, 0, 1, numbers[name]), (ret, 0, 0, RET_ERRNO | EAGAIN)]
    if not processes:
        prog += [(jeq, 0, 1, numbers["clone3"]), (ret, 0, 0, RET_ERRNO | ENOSYS)]
        prog += [(jeq, 0, 4, numbers["clone"]), (ld, 0, 0, arg0), (jset, 0, 1, CLONE_THREAD), (ret, 0, 0, RET_ALLOW),
                 (ret, 0, 0, RET_ERRNO | EAGAIN)]
    prog += [(jeq, 0, 1, numbers["socket"]), (ret, 0, 0, RET_ERRNO | EACCES)]
    for name in DENIED:
        prog += [(jeq, 0, 1, numbers[name]), (ret, 0, 0, RET_ERRNO | EPERM)]
    for name in TO_SELF_ONLY if not signals else ():
        prog += [(jeq, 0, 4, numbers[name]), (ld, 0, 0, arg0), (jeq, 0, 1, pid), (ret, 0, 0, RET_ALLOW),
                 (ret, 0, 0, RET_ERRNO | EPERM)]
    return prog + [(ret, 0, 0, RET_ALLOW)]


def install_seccomp(processes: bool, signals: bool) -> None:
    """Step 3 of the module docstring; OSError when the kernel or the architecture has no filter."""
    if sys.platform != "linux" or platform.machine() not in ARCHES:
        raise OSError(0, f"no seccomp filter for {sys.platform} {platform.machine()}")
    arch, numbers = ARCHES[platform.machine()]
    prog = _seccomp_program(arch, numbers, os.getpid(), processes, signals)
    filters = (_Filter * len(prog))(*[_Filter(*i) for i in prog])
    program = _Program(len(prog), filters)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0), "prctl(SECCOMP)")


def set_limits(config: dict) -> None:
    cpu = config["cpu_s"]
    limits = {resource.RLIMIT_CPU: (cpu, cpu + 1), resource.RLIMIT_AS: config["memory_bytes"],
              resource.RLIMIT_FSIZE: config["file_bytes"], resource.RLIMIT_NOFILE: config["open_files"],
              resource.RLIMIT_CORE: 0}
    if config["tasks"] is not None:  # a private user id's count, or the user's count plus the call's
        limits[resource.RLIMIT_NPROC] = config["tasks"]
    for which, value in limits.items():
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(which, (soft, hard))


def _setup(config: dict, report: dict) -> None:
    uid = config["uid"]
    os.umask(0o022)  # the folders made for the interpreter must be enterable by the user id
    with open("main.py", "rb") as f:
        code = f.read()
    if uid is not None and config["private_tmp"]:
        try:
            private_filesystem(config)
            os.chdir("/tmp/work")
            report["private_tmp"] = True
        except OSError as e:  # e.g. root in a container without CAP_SYS_ADMIN
            report["notes"].append(f"no private /tmp ({e}): the program may write in the host's world-writable folders")
    if uid is not None and not report["private_tmp"]:
        blocked = sorted({a for a in map(_blocked_ancestor, config["python_paths"]) if a})
        if blocked:
            raise OSError(EACCES, f"the private user id cannot enter {blocked[0]}, where the interpreter lives, "
                          "without a private mount namespace: install Python where others may read it, allow the "
                          "namespace (CAP_SYS_ADMIN), or run the trainer as a non-root user")
        os.chown(".", uid, uid)  # the host folder of the call; main.py stays root's, readable
    set_limits(config)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        report["uid"] = os.getuid()
        if report["private_tmp"]:
            with open("main.py", "wb") as f:
                f.write(code)
    try:
        install_seccomp(config["processes"], signals=config["processes"] and uid is not None)
        report["seccomp"] = True
    except OSError as e:
        report["notes"].append(f"no seccomp filter: {e.strerror}")


def main() -> None:
    config = json.loads(sys.argv[1])
    fd = config["report_fd"]
    os.set_inheritable(fd, False)  # closed by a successful exec: the parent reads EOF there
    report = {"seccomp": False, "uid": os.getuid(), "private_tmp": False, "notes": []}
    try:
        _setup(config, report)
        os.write(fd, json.dumps(report).encode() + b"\n")
        home = os.getcwd()  # the call's folder: /tmp/work, or the host folder
        env = {**config["env"], "HOME": home, "TMPDIR": "/tmp" if report["private_tmp"] else home}
        os.execve(sys.executable, [sys.executable, *config["python_flags"], "main.py"], env)
    except Exception as e:  # the call cannot run as asked: say so, and run nothing
        os.write(fd, json.dumps({"setup_error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        sys.exit(70)


if __name__ == "__main__":
    main()
