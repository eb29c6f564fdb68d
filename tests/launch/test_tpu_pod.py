"""``launch/tpu_pod.sh``: its ``--dry-run`` against the gcloud commands it must run for a new, a
READY and a PREEMPTED TPU (and the verbs), written out here by hand; and the worker side,
``launch/tpu_worker.sh``, run on this machine with a stand-in trainer (``stop_standin.py`` as
``arlopti_jax.train`` in a fake home): started detached, a relaunch stops the earlier run (and
an orphan of an earlier launcher) first, ``stop`` ends it with its checkpoint, ``status`` reads
what happened. No gcloud, TPU or network here: what runs on the TPU VM itself (uv, libtpu,
gcsfuse) is not exercised."""

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
POD = REPO / "launch" / "tpu_pod.sh"
WORKER = REPO / "launch" / "tpu_worker.sh"
HELPERS = REPO / "tests" / "helpers"

NAME, ZONE = "rl-v5e", "us-west4-a"
TRAIN = ["--config=configs/layouts/v5e16.py:3b,grpo_ar_lopti",
         "--config.model.path=/mnt/my-bucket/models/Qwen2.5-3B-Instruct",
         "--config.data.train_files=/mnt/my-bucket/data/kk/3ppl/train.parquet",
         "--config.run_dir=gs://my-bucket/runs/kk3b", "--config.train.note=two words"]


def dry_run(tmp_path, *args: str) -> tuple[int, list[list[str]], str]:
    proc = subprocess.run(["bash", str(POD), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"})  # no gcloud
    return proc.returncode, [shlex.split(line) for line in proc.stdout.splitlines()], proc.stderr


def tpu(*words: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", *words]


def expected(state: str, tmp_path: Path) -> list[list[str]]:
    where = ["--zone", ZONE]
    ssh = lambda command: tpu("ssh", NAME, *where, "--worker=all", f"--command={command}")
    worker = "bash ~/arlopti_jax/launch/tpu_worker.sh"
    out = [tpu("describe", NAME, *where, "--format=value(state)")]
    if state == "PREEMPTED":
        out.append(tpu("delete", NAME, *where, "--quiet"))
    if state != "READY":
        out.append(tpu("create", NAME, *where, "--accelerator-type=v5litepod-16", "--version=v2-alpha-tpuv5-lite",
                       "--spot"))
    out += [tpu("scp", f"{tmp_path}/arlopti_jax.XXXXXX.tgz", f"{NAME}:arlopti_jax.tgz", *where, "--worker=all"),
            ssh("rm -rf ~/arlopti_jax.new && mkdir ~/arlopti_jax.new && tar xzf ~/arlopti_jax.tgz -C ~/arlopti_jax.new"
                " && bash ~/arlopti_jax.new/launch/tpu_worker.sh install ~/arlopti_jax.new"),
            ssh(f"{worker} mount my-bucket"),
            ssh(f"{worker} start kk3b " + " ".join(TRAIN[:-1]) + " '--config.train.note=two words'")]
    return out


@pytest.mark.parametrize("state", ["NEW", "READY", "PREEMPTED"])
def test_dry_run_prints_every_gcloud_command(tmp_path, state):
    code, commands, err = dry_run(tmp_path, "--name", NAME, "--zone", ZONE, "--type", "v5litepod-16", "--spot",
                                  "--bucket", "gs://my-bucket", "--dry-run", "--assume-state", state, "--", *TRAIN)
    assert code == 0, err
    assert commands == expected(state, tmp_path)
    assert not list(tmp_path.iterdir()), "a dry run made the tarball"
    # the start command's words reach the worker script as the trainer's arguments, quoting intact
    assert shlex.split(commands[-1][-1].split("=", 1)[1])[3:] == ["kk3b", *TRAIN]


def test_dry_run_other_states_projects_and_skipped_installs(tmp_path):
    base = ["--name", NAME, "--zone", ZONE, "--project", "proj", "--dry-run"]
    code, commands, err = dry_run(tmp_path, *base, "--type", "v4-32", "--assume-state", "STOPPED", "--", "--x=1")
    assert code == 0, err
    assert [c[4] for c in commands] == ["describe", "delete", "create", "scp", "ssh", "ssh"]  # not READY: recreated
    assert all(c[c.index("--project") + 1] == "proj" for c in commands)
    assert commands[2][-2:] == ["--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base"]  # no --spot
    assert commands[-1][-1] == "--command=bash ~/arlopti_jax/launch/tpu_worker.sh start run --x=1"  # no run_dir
    code, commands, err = dry_run(tmp_path, *base, "--skip-install", "--run", "r1", "--assume-state", "READY")
    assert code == 0, err
    assert [c[4] for c in commands] == ["describe", "ssh"]
    assert commands[-1][-1] == "--command=bash ~/arlopti_jax/launch/tpu_worker.sh start r1"
    code, commands, err = dry_run(tmp_path, *base, "--skip-install", "--type", "v5p-8", "--assume-state", "NEW")
    assert [c[4] for c in commands] == ["describe", "create", "scp", "ssh", "ssh"]  # a new VM is installed anyway
    assert commands[1][-1] == "--version=v2-alpha-tpuv5"


def test_the_verbs(tmp_path):
    base = ["--name", NAME, "--zone", ZONE, "--dry-run"]
    ssh = lambda workers, verb: tpu("ssh", NAME, "--zone", ZONE, f"--worker={workers}",
                                    f"--command=bash ~/arlopti_jax/launch/tpu_worker.sh {verb}")
    describe = tpu("describe", NAME, "--zone", ZONE, "--format=value(state)")
    assert dry_run(tmp_path, *base, "--assume-state", "READY", "--status")[1] == [describe, ssh("all", "status")]
    assert dry_run(tmp_path, *base, "--assume-state", "PREEMPTED", "--status")[1] == [describe]
    assert dry_run(tmp_path, *base, "--assume-state", "READY", "--stop")[1] == [ssh("all", "stop")]
    assert dry_run(tmp_path, *base, "--assume-state", "READY", "--logs", "--worker", "2")[1] == [ssh("2", "logs")]


def test_mistakes_are_one_line(tmp_path):
    code, _, err = dry_run(tmp_path, "--name", NAME, "--zone", ZONE, "--dry-run", "--assume-state", "NEW", "--", "-x")
    assert code == 2
    assert err.strip().splitlines()[-1] == "tpu_pod.sh: error: TPU rl-v5e is NEW; give --type to create it"
    code, _, err = dry_run(tmp_path, "--name", NAME, "--zone", ZONE, "--dry-run")
    assert code == 2 and "--assume-state" in err
    code, _, err = dry_run(tmp_path, "--name", NAME, "--zone", ZONE, "--assume-state", "READY")
    assert code == 2 and "--dry-run only" in err


# ---- the worker side, on this machine ----

@pytest.fixture
def home(tmp_path):
    """A worker's home: ~/arlopti_jax whose arlopti_jax.train is the stand-in, ~/arlopti_venv/bin/python."""
    home = tmp_path / "home"
    package = home / "arlopti_jax" / "arlopti_jax"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(HELPERS / "stop_standin.py", package / "train.py")
    (home / "arlopti_venv" / "bin").mkdir(parents=True)
    (home / "arlopti_venv" / "bin" / "python").symlink_to(sys.executable)
    return home


def worker(home: Path, *args: str, stop_wait: int = 20) -> str:
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "ARLOPTI_STOP_WAIT": str(stop_wait)}
    proc = subprocess.run(["bash", str(WORKER), *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def wait_for(predicate, what: str, timeout: float = 60) -> None:
    start = time.time()
    while not predicate():
        assert time.time() - start < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


def steps(run_dir: Path) -> list[int]:
    import json

    path = run_dir / "steps_0.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_worker_starts_detached_relaunches_over_a_run_and_stops_it(home, tmp_path):
    run_dir = tmp_path / "run"
    args = [f"--config.run_dir={run_dir}", "--config.train.max_steps=400", "--config.standin.step_s=0.05"]
    # an orphan of an earlier launch (a dropped `ssh --worker=all` connection): the venv's trainer
    orphan = subprocess.Popen([str(home / "arlopti_venv" / "bin" / "python"), "-m", "arlopti_jax.train",
                               f"--config.run_dir={tmp_path / 'orphan'}", "--config.train.max_steps=100000"],
                              cwd=home / "arlopti_jax", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: steps(tmp_path / "orphan"), "the orphan's first step")
        out = worker(home, "start", "r1", *args)  # returns at once: the run goes on detached
        assert "started run r1" in out and orphan.wait(timeout=30) == 75  # stopped with its checkpoint first
    finally:
        if orphan.poll() is None:
            orphan.kill()
    logs = home / "arlopti_logs" / "r1"
    me = out.split("worker ")[1].split(":")[0]
    wait_for(lambda: len(steps(run_dir)) >= 5, "5 steps")
    assert "is running (pid" in worker(home, "status")
    pid = int((logs / f"worker_{me}.pid").read_text())
    worker(home, "start", "r1", *args)  # a relaunch: the running one saves and stops, the new one resumes
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    wait_for(lambda: len(steps(run_dir)) >= 12, "12 steps")
    out = worker(home, "stop")
    assert "stopping 1 arlopti_jax process" in out
    status = worker(home, "status")
    assert "run r1 stopped with a checkpoint (75): launch it again to resume" in status
    log = (logs / f"worker_{me}.log").read_text()
    assert log.count("process 0 starts after step 0,") == 1 and log.count("stopped after step") == 2
    done = steps(run_dir)
    assert done == list(range(1, len(done) + 1))  # every step once across the relaunch
    worker(home, "start", "r1", *args[:1], "--config.train.max_steps=3")  # already past step 3: finishes
    wait_for(lambda: (logs / f"worker_{me}.exit").exists(), "the exit status")
    assert "run r1 finished" in worker(home, "status")


def test_a_trainer_that_ignores_sigterm_is_killed_and_the_stop_returns(home, tmp_path):
    """SIGKILL after ARLOPTI_STOP_WAIT s: the detached waiter records 137 and leaves (bash answers a second
    ``wait`` for a killed job with its saved status, which once kept the waiter spinning and ``stop`` waiting
    for it until the test's 120 s ran out)."""
    run_dir = tmp_path / "run"
    worker(home, "start", "r2", f"--config.run_dir={run_dir}", "--config.train.max_steps=100000",
           "--config.standin.step_s=0.05", "--config.standin.ignore_stop=1")
    wait_for(lambda: len(steps(run_dir)) >= 3, "3 steps")
    began = time.time()
    out = worker(home, "stop", stop_wait=2)
    assert "stopping 1 arlopti_jax process" in out and time.time() - began < 30
    assert "run r2 failed with status 137" in worker(home, "status")
    assert not (run_dir / "checkpoint_0").exists()
