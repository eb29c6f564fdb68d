"""The Python executor against hostile programs: each ends within its limit, leaves nothing behind
and the test process goes on. What the sandbox holds depends on the machine (root: a private user
id and private /tmp; Linux x86_64/aarch64: the seccomp filter); each test asserts what the
executor's docstring says for the isolation this machine gets (`PythonExecutor.check`)."""

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from arlopti_jax.tasks.tools import PythonExecutor, SandboxLimits
from arlopti_jax.tasks.tools import sandbox as sandbox_module

LIMITS = SandboxLimits(wall_s=1.5, cpu_s=1, memory_bytes=256 << 20, output_bytes=4096, file_bytes=1 << 20)
SLACK_S = 1.0  # the caller waits at most the wall-clock limit plus this (killing, reaping, cleaning up)
EXECUTOR = PythonExecutor(LIMITS)
ISOLATION = EXECUTOR.check()
PRIVATE = ISOLATION.private_tmp  # root: a user id of its own and private tmpfs's


def run(code: str, executor: PythonExecutor = EXECUTOR):
    start = time.monotonic()
    result = executor.run(code)
    elapsed = time.monotonic() - start
    assert elapsed < executor.limits.wall_s + SLACK_S, (elapsed, result)
    return result


def session_members(sid: int) -> list[int]:
    """Processes whose session is ``sid`` (the call's process started a session of its own), zombies aside."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def test_a_program_runs_and_its_output_and_errors_come_back():
    ok = run("import sys\nprint('héllo ✓ 数学')\nprint('warn', file=sys.stderr)")
    assert (ok.output, ok.error, ok.timed_out, ok.truncated) == ("héllo ✓ 数学\nwarn\n", None, False, False)
    failed = run("x = 1\nraise ValueError('no such number')")
    assert failed.error == "exit status 1: ValueError: no such number" and "Traceback" in failed.output
    assert run("import sys; sys.exit(3)").error == "exit status 3"
    assert "longer than" in EXECUTOR.run("#" * (LIMITS.code_bytes + 1)).error
    threads = run("import threading\nt = threading.Thread(target=print, args=('in a thread',))\nt.start(); t.join()")
    assert threads.output == "in a thread\n"


def test_the_child_sees_no_parent_environment(monkeypatch):
    secret = f"s3cret-{uuid.uuid4()}"
    monkeypatch.setenv("ARLOPTI_TEST_SECRET", secret)
    result = run("import os, sys\nprint(sorted(os.environ))\nprint(os.environ.get('ARLOPTI_TEST_SECRET'))\n"
                 "print(sys.flags.isolated, sys.flags.no_site)\n"
                 f"try:\n    print(open('/proc/{os.getpid()}/environ').read())\n"
                 "except OSError as e:\n    print('unreadable:', e.strerror)")
    names, value, flags, parent = result.output.splitlines()[:4]
    assert value == "None" and "ARLOPTI_TEST_SECRET" not in names and flags == "1 1"
    assert set(ast.literal_eval(names)) == {"HOME", "LANG", "LC_ALL", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                                            "OPENBLAS_NUM_THREADS", "PATH", "TMPDIR"}
    if PRIVATE:  # another user id: the trainer's /proc/<pid>/environ is not its to read
        assert parent == "unreadable: Permission denied" and secret not in result.output
    else:  # documented: as the trainer's own user, the trainer's environ file is readable
        assert secret in parent


def test_an_infinite_loop_and_a_sleep_are_stopped_at_the_wall_clock_limit():
    for code in ("while True:\n    pass", "import time\ntime.sleep(600)",
                 "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"):
        result = run(code)
        assert result.timed_out and result.error in ("timed out after 1.5 s", "CPU time limit (1 s) exceeded",
                                                     "killed by SIGKILL (the CPU time limit's hard stop, or out of "
                                                     "memory)"), result


def test_the_cpu_limit_stops_a_loop_before_a_longer_wall_clock_limit():
    result = PythonExecutor(SandboxLimits(wall_s=30, cpu_s=1)).run("while True:\n    pass")
    assert result.timed_out and result.error == "CPU time limit (1 s) exceeded" and result.seconds < 25


def test_a_memory_hog_gets_a_memory_error():
    executor = PythonExecutor(SandboxLimits(wall_s=10, cpu_s=10, memory_bytes=256 << 20))  # page faults take CPU
    for code in ("x = bytearray(1 << 40)", "x = []\nwhile True:\n    x.append(bytearray(16 << 20))"):
        result = run(code, executor)
        assert result.error == "exit status 1: MemoryError" and not result.timed_out, result


def test_a_huge_print_is_capped_and_costs_the_parent_nothing():
    finite = run("import sys\nsys.stdout.write('x' * (50 << 20))\nprint('end', file=sys.stderr)")
    assert finite.truncated and finite.error is None
    assert finite.output == "x" * LIMITS.output_bytes + "end\n"
    endless = run("while True:\n    print('y' * 1000)")
    assert endless.timed_out and endless.truncated and len(endless.output) == LIMITS.output_bytes


def test_a_fork_bomb_ends_within_its_limit_and_leaves_no_process():
    bomb = "import os\nprint(os.getpid(), os.getuid(), flush=True)\nwhile True:\n    os.fork()"
    result = run(bomb)
    sid, uid = map(int, result.output.split()[:2])
    if ISOLATION.seccomp:  # the first fork fails
        assert result.error == "exit status 1: BlockingIOError: [Errno 11] Resource temporarily unavailable"
    assert session_members(sid) == []
    if PRIVATE:
        assert sandbox_module._processes_of(uid) == []


def test_a_fork_bomb_with_processes_allowed_is_bounded_and_killed():
    """processes=True: as root with a private user id RLIMIT_NPROC binds and every process of the
    id dies with the call, one that left the session included; as another user the bomb's group is
    killed at the deadline (a process that left the session would outlive it: documented)."""
    executor = PythonExecutor(SandboxLimits(wall_s=1.5, cpu_s=2, tasks=16, processes=True))
    bomb = ("import os\nprint(os.getpid(), os.getuid(), flush=True)\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass")
    result = run(bomb, executor)
    sid, uid = map(int, result.output.split()[:2])
    assert result.timed_out
    assert session_members(sid) == []
    if PRIVATE:
        assert sandbox_module._processes_of(uid) == []
        escaper = run("import os, time\nprint(os.getuid(), flush=True)\nif os.fork() == 0:\n    os.setsid()\n"
                      "    time.sleep(600)\n", executor)
        assert escaper.error is None and sandbox_module._processes_of(int(escaper.output)) == []
    spawned = run("import subprocess\nprint(subprocess.run(['echo', 'child'], capture_output=True).stdout)", executor)
    assert spawned.output == "b'child\\n'\n"


def test_writing_outside_the_folder(tmp_path):
    """Root (private user id): nothing outside changes, not even in the world-writable /tmp; as the
    trainer's own user the program may write where that user may (documented)."""
    mine, shared = tmp_path / "outside.txt", Path(f"/tmp/arlopti-sandbox-test-{uuid.uuid4()}.txt")
    result = run(f"import os\nprint(os.getcwd(), flush=True)\nopen('inside.txt', 'w').write('ok')\n"
                 f"for p in ({str(mine)!r}, {str(shared)!r}):\n"
                 "    try:\n        open(p, 'w').write('escaped')\n        print('wrote', p)\n"
                 "    except OSError as e:\n        print('refused', e.strerror)")
    workdir = result.output.splitlines()[0]
    try:
        assert not (PRIVATE and Path("/tmp/work").exists())  # the private /tmp was never the host's
        assert not Path(workdir).exists() or PRIVATE  # the host folder of the call is removed afterwards
        if PRIVATE:  # its /tmp is a fresh tmpfs: neither path is the host's
            assert not mine.exists() and not shared.exists()
            assert result.output.splitlines()[1].startswith("refused") and "wrote " + str(shared) in result.output
        else:
            assert mine.read_text() == "escaped" and shared.read_text() == "escaped"
    finally:
        shared.unlink(missing_ok=True)
    assert not list(Path(tempfile.gettempdir()).glob("arlopti-sandbox-*/inside.txt"))


def test_sockets(tmp_path):
    """With seccomp no socket of any family can be made (no network, no Unix socket); without it
    (other systems) sockets are open: documented."""
    result = run("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\nprint('made')\n"
                 "s.settimeout(0.5)\ns.connect(('127.0.0.1', 9))")
    if ISOLATION.seccomp:
        assert result.error == "exit status 1: PermissionError: [Errno 13] Permission denied", result
        assert run("import socket\nsocket.socket(socket.AF_UNIX)").error.endswith("Permission denied")
    else:
        assert result.output.startswith("made")


def test_signals_and_ptrace_reach_no_other_process():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        result = run(f"import os, signal\nos.kill({sleeper.pid}, signal.SIGKILL)")
        assert result.error is not None and "PermissionError" in result.error
        assert sleeper.poll() is None  # still alive
        assert run("import os\nos.kill(os.getpid(), 0)\nprint('self ok')").output == "self ok\n"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_concurrent_calls_run_in_parallel_with_their_own_folders():
    code = "import os, time\ntime.sleep(0.3)\nopen('mine', 'w').write('x')\nprint(len(os.listdir('.')), os.getuid())"
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: EXECUTOR.run(code), range(8)))
    assert time.monotonic() - start < 0.3 * 8  # not one after another
    assert all(r.error is None and r.output.split()[0] == "2" for r in results), results  # main.py and 'mine'
    if PRIVATE:
        assert len({r.output.split()[1] for r in results}) == 8  # a user id each


def test_site_packages_are_importable_when_asked():
    executor = PythonExecutor(SandboxLimits(wall_s=30, cpu_s=30, site_packages=True))
    result = executor.run("import sympy\nprint(sympy.factorint(2**32 + 1))")
    assert result.output == "{641: 1, 6700417: 1}\n", result
    assert "ModuleNotFoundError" in run("import sympy").error


def test_root_needs_a_private_user_id():
    if os.geteuid() == 0:
        with pytest.raises(ValueError, match="allow_root=True"):
            PythonExecutor(private_uid=False)
    else:
        with pytest.raises(ValueError, match="needs the trainer to run as root"):
            PythonExecutor(private_uid=True)
    with pytest.raises(ValueError, match="wall_s=0"):
        SandboxLimits(wall_s=0)


SYSTEM_PYTHON = "/usr/bin/python3"
needs_root_and_system_python = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv") or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="runs the executor under another interpreter or user: needs root, setpriv and a system python3")


def run_script(body: str, *prefix: str) -> list[str]:
    """The lines a script printed that makes an executor and runs programs with it (``ex``), run by
    the system python3 after ``prefix`` (e.g. setpriv to another user), from a folder others may read."""
    folder = Path(tempfile.mkdtemp(dir="/tmp"))  # not pytest's tmp_path: its parent is root's 0700 folder
    script = folder / "script.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
                      "from arlopti_jax.tasks.tools import PythonExecutor, SandboxLimits\n" + body)
    folder.chmod(0o755)
    script.chmod(0o644)
    env = {"PATH": "/usr/bin:/bin", "ARLOPTI_TEST_SECRET": "visible"}
    try:
        proc = subprocess.run([*prefix, SYSTEM_PYTHON, str(script)], capture_output=True, text=True, env=env,
                              timeout=60, cwd="/")
    finally:
        shutil.rmtree(folder)
    if "ModuleNotFoundError" in proc.stderr or "SyntaxError" in proc.stderr:
        pytest.skip(f"the system python3 cannot import the package: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@needs_root_and_system_python
def test_as_a_non_root_user_the_documented_limits_hold():
    """The executor as a non-root trainer runs it (CI's case), checked here from root: seccomp stops
    forks and sockets, and the trainer's environment is readable (documented)."""
    lines = run_script("ex = PythonExecutor(SandboxLimits(wall_s=5))\nprint(ex.check())\n"
                       "print(ex.run('import os\\nos.fork()').error)\n"
                       "print(ex.run('import socket\\nsocket.socket()').error)\n"
                       "import os\nprint(ex.run(f'print(open(\"/proc/{os.getpid()}/environ\").read())').output)\n",
                       "setpriv", "--reuid=4321", "--regid=4321", "--clear-groups")
    assert lines[0] == "Isolation(seccomp=True, uid=4321, private_tmp=False, notes=())"
    assert lines[1] == "exit status 1: BlockingIOError: [Errno 11] Resource temporarily unavailable"
    assert lines[2] == "exit status 1: PermissionError: [Errno 13] Permission denied"
    assert "ARLOPTI_TEST_SECRET=visible" in lines[3]


@needs_root_and_system_python
def test_as_root_without_a_mount_namespace_the_private_user_id_still_holds():
    """private_tmp=False (as where the kernel refuses the namespace): the program runs as its own user
    id in the host folder of the call, if that id can reach the interpreter (the system python3 here);
    the trainer's interpreter under a 0700 folder cannot be reached, and each call says so."""
    lines = run_script("ex = PythonExecutor(SandboxLimits(wall_s=5), private_tmp=False)\niso = ex.check()\n"
                       "print(iso.private_tmp, iso.uid > 10**9, iso.seccomp)\n"
                       "out = ex.run('import os\\nprint(os.getcwd().startswith(\"/tmp/arlopti-sandbox-\"))\\n"
                       "open(\"/etc/arlopti-test\", \"w\")').output.splitlines()\nprint(out[0])\nprint(out[-1])\n")
    assert lines == ["False True True", "True", "PermissionError: [Errno 13] Permission denied: '/etc/arlopti-test'"]
    assert not Path("/etc/arlopti-test").exists()
    blocked = [p for p in sandbox_module._python_paths() if not os.access(p, os.X_OK) or
               any(not Path(*Path(p).parts[:i]).stat().st_mode & 0o001 for i in range(2, len(Path(p).parts) + 1))]
    if blocked:  # this machine's trainer interpreter lives where another user id cannot go
        result = PythonExecutor(LIMITS, private_tmp=False).run("print(1)")
        assert result.error.startswith("the sandbox could not run the program: PermissionError: [Errno 13] the "
                                       "private user id cannot enter"), result


def test_the_test_process_goes_on():
    assert threading.active_count() >= 1 and run("print(2 + 2)").output == "4\n"
