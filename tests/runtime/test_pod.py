"""A pod in miniature: 4 processes x 2 CPU devices (``launch/local.sh --own-dirs``: each process in
its own working directory, temporary folder and staging folder, as on hosts that share no disk),
sharing only a bucket (a GCS emulator on localhost). SIGTERM to one process stops every process
at the same step, each saves it within the grace period and exits 75, and ``resume=auto``
finishes the run to the uninterrupted one's records. A run folder the hosts do not share stops
every process at start-up with one line."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gcs_fixtures import emulator, make_bucket, upload
from two_processes import child_flags
from run_fixtures import overrides, step_metrics

from arlopti_jax.runtime import paths

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each run starts 4 JAX processes; CI runs the slow tests


def launch(n: int, values: dict, logs: Path, **env) -> subprocess.Popen:
    flag = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else v
    cmd = ["bash", str(REPO / "launch" / "local.sh"), str(n), "--devices", str(8 // n), "--own-dirs",
           "--logs", str(logs), "--", *[f"--config.{k}={flag(v)}" for k, v in values.items()]]
    path = os.pathsep.join([str(REPO / "tests" / "helpers"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHON": sys.executable, "XLA_FLAGS": child_flags(),
                                                "PYTHONPATH": path, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, logs: Path, expect: int, timeout: int = 900) -> None:
    """Wait for the launcher; AssertionError with its output and the logs' ends unless it exits ``expect``."""
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0] + "\n(timed out)"
    ends = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.log")))
    assert proc.returncode == expect, f"exit {proc.returncode}, not {expect}:\n{out[-3000:]}\n{ends}"


@pytest.fixture(scope="module")
def bucket(start_point):
    with emulator():
        name = make_bucket("pod")
        upload(start_point / "model", f"{name}/models/start")
        upload(start_point / "data" / "train.parquet", f"{name}/data/train.parquet")
        yield name


def pod_values(start_point, bucket, run, **extra):
    return overrides(start_point, f"{bucket}/{run}", **{
        "model.path": f"{bucket}/models/start", "data.train_files": f"{bucket}/data/train.parquet",
        "train.max_steps": 6, "train.save_every": 100, **extra})


def test_sigterm_to_one_host_stops_all_at_one_step_and_resume_finishes_the_run(start_point, bucket, tmp_path):
    finish(launch(4, pod_values(start_point, bucket, "a"), tmp_path / "a"), tmp_path / "a", 0)
    want = step_metrics(f"{bucket}/a")
    assert set(want) == set(range(1, 7))

    values = pod_values(start_point, bucket, "b")
    proc = launch(4, values, tmp_path / "b")
    staged = []  # process 0's records, staged on its "host" until a checkpoint copies them up
    deadline = time.time() + 900
    while time.time() < deadline:
        staged = [p for p in (tmp_path / "b" / "process_0" / "staging").rglob("metrics.jsonl")]
        if staged and len(staged[0].read_text().splitlines()) >= 2:
            break
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    pid = int(subprocess.run(["pgrep", "-f", f"run_dir={bucket}/b.*process_id=2"], capture_output=True,
                             text=True).stdout.split()[0])
    os.kill(pid, signal.SIGTERM)  # one host's preemption notice
    finish(proc, tmp_path / "b", 75)  # stopped, resume me
    saved = {}
    for i in range(4):
        log = (tmp_path / "b" / f"process_{i}.log").read_text()
        stops = re.findall(r"checkpoint (\d+) saved in ([0-9.]+) s \(train.grace_s=30\), exiting \(exit code 75", log)
        assert len(stops) == 1, log[-3000:]
        saved[i] = int(stops[0][0])
        assert float(stops[0][1]) < 30, log[-3000:]  # inside the grace period
    assert len(set(saved.values())) == 1 and 2 <= saved[0] < 6, saved
    assert paths.path(f"{bucket}/b/checkpoints/{saved[0]}").is_dir()

    finish(launch(4, {**values, "resume": "auto"}, tmp_path / "b2"), tmp_path / "b2", 0)
    got = step_metrics(f"{bucket}/b")
    assert got == want
    lines = [json.loads(x)["step"] for x in paths.path(f"{bucket}/b/metrics.jsonl").read_text().splitlines()]
    assert lines == list(range(1, 7))


def test_a_run_folder_the_hosts_do_not_share_stops_them_all_at_start_up(start_point, bucket, tmp_path):
    values = {**pod_values(start_point, bucket, "unused"), "run_dir": "runs/r"}  # relative: each host's own disk
    finish(launch(2, values, tmp_path / "c"), tmp_path / "c", 2, timeout=600)
    for i in range(2):
        errors = [line for line in (tmp_path / "c" / f"process_{i}.log").read_text().splitlines()
                  if line.startswith("error:")]
        assert len(errors) == 1 and "config.run_dir=" in errors[0] and "do not see the folder" in errors[0], errors
