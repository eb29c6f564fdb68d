"""``launch/slurm_gpu.sh`` under a real scheduler: Debian's slurm-wlm started on localhost
(``slurm_cluster.py``: slurmctld, slurmd and munged in a temporary folder), jobs submitted with
``sbatch`` exactly as the guide says, on CPU devices (``--gpus-per-node=0``, JAX_PLATFORMS=cpu).

- the trainer, 2 tasks x 4 CPU devices, runs to the end (exit 0, every step logged once);
- a trainer job stopped by SIGTERM (``scancel --signal=TERM``) saves, exits 75, is requeued by
  the script, resumes from its checkpoint and ends with the uninterrupted run's records (needs
  the trainer's stop contract: exit 75 and ``train.grace_s``; skipped until the trainer has it);
- the script's own rules with a stand-in for the trainer (``stop_standin.py``, no JAX): a stop
  sent to the tasks or to the whole job (preemption) is requeued and resumes, a failure is not;
  the CPUs per task come from the allocation.

SLURM delays a requeued job's start by about two minutes (its EligibleTime); the tests move it to
now (``scontrol update StartTime=now``) to stay short. Slow suite; skipped only where SLURM
cannot run (not installed: ``apt-get install slurm-wlm munge``, which ``.ci/run`` does; not root)."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from arlopti_jax.config import base_config
from run_fixtures import TIMING, overrides, step_metrics

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "helpers"
SCRIPT = REPO / "launch" / "slurm_gpu.sh"
STOPPED = 75

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("two_processes")]  # 2 processes on 2 cores


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    c = slurm_cluster.start_cluster(tmp_path_factory.mktemp("slurm"))
    yield c
    c.stop()


def submit(cluster, workdir: Path, args: list[str], *sbatch: str, module: str | None = None,
           devices: int = 4) -> str:
    """``sbatch [SBATCH...] launch/slurm_gpu.sh ARGS`` from ``workdir``; returns the job id."""
    # a port of its own: the script's default (20000 + job id) is the same for the two xdist workers'
    # clusters, which both number their jobs from 1, and two jobs on one coordinator port abort
    # (seen 2026-12-06 when both workers ran this file's trainer jobs at once)
    env = {**cluster.env, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
           "JAX_COORDINATOR_PORT": str(slurm_cluster.free_port()),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "PYTHONPATH": os.pathsep.join([str(HELPERS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    if module:
        env["ARLOPTI_MODULE"] = module
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--time=20",
           f"--output={workdir}/%x-%j.out", *sbatch, str(SCRIPT), *args]
    return cluster.run(*cmd, env=env, cwd=workdir).stdout.strip().split(";")[0]


def output(workdir: Path, job: str) -> str:
    return (workdir / f"arlopti-{job}.out").read_text()


def ended(info: dict) -> bool:
    return info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for_end(cluster, job: str, workdir: Path, timeout: float) -> dict:
    """Wait until the job ends; a requeued job pending on SLURM's requeue delay starts once 2 s have
    passed since it was seen requeued. Started at once, slurmd may refuse it: a credential made in
    the second it revoked the old one is refused ("Job credential revoked", a clean-clone CI run of
    2026-12-02), one reason SLURM itself holds a requeued job back for minutes."""
    start = time.time()
    requeued_at = None
    while True:
        info = cluster.job(job)
        if ended(info):
            return info
        if info["JobState"] == "PENDING" and info["Restarts"] != "0" and info.get("Reason") == "BeginTime":
            requeued_at = requeued_at or time.time()
            if time.time() - requeued_at >= 2:
                cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        if time.time() - start > timeout:
            out = output(workdir, job) if (workdir / f"arlopti-{job}.out").exists() else ""
            raise AssertionError(f"job {job} still {info['JobState']} after {timeout:.0f} s\n{out[-4000:]}\n"
                                 f"{cluster.logs()}")
        time.sleep(0.5)


def wait_until(predicate, cluster, job: str, workdir: Path, timeout: float, what: str) -> None:
    start = time.time()
    while not predicate():
        info = cluster.job(job)
        if ended(info) or time.time() - start > timeout:
            out = output(workdir, job) if (workdir / f"arlopti-{job}.out").exists() else ""
            raise AssertionError(f"job {job} is {info['JobState']} (exit {info['ExitCode']}) before {what}\n"
                                 f"{out[-4000:]}")
        time.sleep(0.5)


# ---- the trainer ----

def trainer_flags(start_point: Path, run_dir: Path) -> list[str]:
    values = overrides(start_point, run_dir, **{"train.max_steps": 4, "train.save_every": 2, "mesh.fsdp": 8})
    return [f"--config.{k}={v}" for k, v in values.items()]


def steps_logged(run_dir: Path) -> list[int]:
    return sorted(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())


@pytest.fixture(scope="module")
def uninterrupted(cluster, start_point, tmp_path_factory):
    """The 4-step tiny run as one uninterrupted 2-task job."""
    work = tmp_path_factory.mktemp("whole")
    run_dir = work / "run"
    job = submit(cluster, work, trainer_flags(start_point, run_dir))
    info = wait_for_end(cluster, job, work, 900)
    return work, job, info, run_dir


def test_a_two_task_job_trains_to_the_end(uninterrupted):
    work, job, info, run_dir = uninterrupted
    out = output(work, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), out[-4000:]
    assert "2 tasks x 1 CPUs" in out  # the node's 2 CPUs over its 2 tasks, passed to srun
    assert "process 0 of 2: 4 local devices of 8" in out
    assert steps_logged(run_dir) == [1, 2, 3, 4]  # every step once


def test_a_stopped_trainer_job_is_requeued_and_resumes(cluster, start_point, uninterrupted, tmp_path):
    if "grace_s" not in base_config().train:
        pytest.skip("the trainer's stop contract (exit 75 on SIGTERM, train.grace_s) is not on this branch; "
                    "the script's requeue is tested with the stand-in below")
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, trainer_flags(start_point, run_dir))
    first = run_dir / "checkpoints" / "2" / "commit_success.txt"
    wait_until(first.exists, cluster, job, tmp_path, 900, "its first checkpoint")
    cluster.run("scancel", "--signal=TERM", job)  # to the tasks, as --signal=TERM@120 sends it
    info = wait_for_end(cluster, job, tmp_path, 900)
    out = output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-4000:]
    assert f"stopped with a checkpoint (status {STOPPED}); requeueing job {job}" in out
    assert "(restart 1)" in out
    assert steps_logged(run_dir) == [1, 2, 3, 4]  # each step once: the resumed job went on after the save
    want = step_metrics(uninterrupted[3])
    got = step_metrics(run_dir)
    for step in want:
        bad = {k: (got[step][k], v) for k, v in want[step].items()
               if not k.startswith(TIMING) and isinstance(v, float) and abs(got[step][k] - v) > 1e-6 + 1e-4 * abs(v)}
        assert not bad, f"step {step}: the resumed job's records differ from the uninterrupted job's: {bad}"


# ---- the script's rules, with the stand-in ----

def standin_steps(run_dir: Path, process: int) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / f"steps_{process}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stop", ["scancel", "preemption"])
def test_a_stopped_job_is_requeued_once_and_resumes(cluster, tmp_path, stop):
    """A SIGTERM to the tasks, as --signal=TERM@120 sends it (scancel --signal=TERM), or SLURM's
    preemption (a job in a higher partition: SIGTERM to the tasks, then the GraceTime)."""
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, [f"--config.run_dir={run_dir}", "--config.train.max_steps=12",
                                     "--config.standin.step_s=0.3"], module="stop_standin")
    records = run_dir / "steps_1.jsonl"
    wait_until(lambda: records.exists() and len(records.read_text().splitlines()) >= 3, cluster, job, tmp_path,
               120, "3 steps")
    if stop == "scancel":
        cluster.run("scancel", "--signal=TERM", job)
    else:  # needs the node's 2 CPUs
        cluster.run("sbatch", "--partition=urgent", "--ntasks=2", f"--output={tmp_path}/urgent.out", "--wrap=true")
    info = wait_for_end(cluster, job, tmp_path, 180)
    out = output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out
    assert out.count("requeueing job") == 1 and "(restart 1)" in out
    for process in (0, 1):
        assert f"stop_standin: process {process} starts after step 0," in out
        stopped_after = int(out.split(f"process {process} stopped after step ")[1].split()[0])
        assert 3 <= stopped_after < 12 and f"process {process} starts after step {stopped_after}," in out
        assert standin_steps(run_dir, process) == list(range(1, 13))  # every step once, across the requeue


def test_a_failed_job_is_not_requeued(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, [f"--config.run_dir={run_dir}", "--config.train.max_steps=6",
                                     "--config.standin.step_s=0.2", "--config.standin.fail_at=3"],
                 module="stop_standin")
    info = wait_for_end(cluster, job, tmp_path, 120)
    out = output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "1:0", "0"), out
    assert "requeueing" not in out and "srun exited with status 1" in out


@pytest.mark.parametrize("sbatch,per_task", [((), 1), (("--ntasks-per-node=1",), 2),
                                             (("--cpus-per-task=1", "--ntasks-per-node=1"), 1)])
def test_cpus_per_task_come_from_the_allocation(cluster, tmp_path, sbatch, per_task):
    run_dir = tmp_path / "run"
    job = submit(cluster, tmp_path, [f"--config.run_dir={run_dir}", "--config.train.max_steps=1",
                                     "--config.standin.step_s=0"], *sbatch, module="stop_standin")
    info = wait_for_end(cluster, job, tmp_path, 120)
    out = output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", out
    tasks = 1 if sbatch else 2
    assert f"{tasks} tasks x {per_task} CPUs" in out
    assert out.count(f"SLURM_CPUS_PER_TASK={per_task}") == tasks  # what srun gave each task
