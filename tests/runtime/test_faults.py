"""Crash anywhere, resume exactly: a run killed (SIGKILL, ``faults.py``) at each place it writes, then
resumed, leaves the records an uninterrupted run leaves (metrics.jsonl and eval.jsonl line by
line, timings aside; every generations file byte for byte), in one process and in two
(``jax.distributed`` on CPU, where the other process stops too). The sweep's results.json and
worker records and the start point's cache are checked the same way; the converter's folder and
the package download in ``test_gguf.py``.

The matrix runs training dozens of times, so it is marked slow (CI runs it after the default
suite); the default suite keeps the record-trimming rules and the fault switch itself."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from arlopti_jax.runtime import faults
from arlopti_jax.rl.evaluation import trim_jsonl
from arlopti_jax.train import train
from run_fixtures import TIMING, assert_nothing_compiled_late, cli, make_config, overrides
from two_processes import launch_two

REPO = Path(__file__).resolve().parents[2]
TESTS = str(Path(__file__).resolve().parents[1] / "helpers")


# ---- the default suite: the rules a resume relies on ----

def test_trim_drops_half_written_lines_and_keeps_standalone_evaluations(tmp_path):
    path = tmp_path / "eval.jsonl"
    standalone = {"model": "m", "time": 1.0, "eval/x/greedy_acc": 0.5}
    lines = [json.dumps({"step": 0}), json.dumps(standalone), json.dumps({"step": 2}), json.dumps({"step": 4})]
    path.write_text("\n".join(lines) + "\n" + '{"step": 6, "eval/x/gr')  # killed mid-line
    trim_jsonl(path, 2)
    assert path.read_text().splitlines() == lines[:3]
    trim_jsonl(path, -1)  # a restart from scratch keeps only what is not the training's
    assert path.read_text().splitlines() == [lines[1]]
    path.write_text(json.dumps({"step": 1}))  # a whole last record without its newline
    trim_jsonl(path, 1)
    assert path.read_text() == json.dumps({"step": 1}) + "\n"


def test_the_fault_switch(tmp_path, monkeypatch):
    """SITE:N kills the N-th pass (a write site leaves half its text); other sites run on; a wrong
    spec or an unknown site is an error, not a silent no-op."""
    script = ("import sys; from arlopti_jax.runtime import faults\n"
              "f = open(sys.argv[1], 'w')\n"
              "for i in range(3):\n    faults.write(f, f'line {i}\\n', 'metrics'); f.flush()\n")
    killed = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out")], capture_output=True,
                            env={**os.environ, faults.ENV: "metrics:2"})
    assert killed.returncode == -signal.SIGKILL and (tmp_path / "out").read_text() == "line 0\nlin"
    monkeypatch.setenv(faults.ENV, "eval:1")
    with open(tmp_path / "other", "w") as f:
        for i in range(3):
            faults.write(f, f"line {i}\n", "metrics")
    assert (tmp_path / "other").read_text() == "line 0\nline 1\nline 2\n"
    for bad in ("metrics", "metrics:x", "nowhere:1", "metrics:1@p"):
        monkeypatch.setenv(faults.ENV, bad)
        with pytest.raises(ValueError, match="ARLOPTI_FAULT"):
            faults.point("metrics")
    monkeypatch.setenv(faults.ENV, "metrics:1")
    with pytest.raises(ValueError, match="unknown site"):
        faults.point("metricz")


# ---- the matrix (slow) ----

def run_values(sp: Path, run_dir: Path, **extra) -> dict:
    """4 steps, evaluations at 0, 2 and 4 (with their generations), checkpoints at 2 and 4."""
    return overrides(sp, run_dir, **{
        "data.test_files": str(sp / "data" / "test_2ppl.parquet"), "data.max_prompt_length": 128,
        "train.eval_every": 2, "train.eval_max_prompts": 4, "train.eval_n": 2, "train.eval_ks": (1, 2),
        "reward.fn": "reward_fixtures:length_reward", "reward.workers": 0, **extra})


def records(run_dir: Path) -> dict:
    """What a run leaves: its metrics and eval lines (timings aside), in order, and its generations."""
    lines = lambda name: [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
                          for line in (run_dir / name).read_text().splitlines()]
    generations = {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted((run_dir / "generations").rglob("*"))
                   if p.is_file()}
    return {"metrics": lines("metrics.jsonl"), "eval": lines("eval.jsonl"), "generations": generations}


def assert_same(got: dict, want: dict, what: str):
    for kind in ("metrics", "eval"):
        assert [r.get("step") for r in got[kind]] == [r.get("step") for r in want[kind]], f"{what}: {kind} steps"
        for a, b in zip(got[kind], want[kind]):
            assert a == b, f"{what}: {kind} record of step {b.get('step')} differs"
    assert got["generations"] == want["generations"], f"{what}: generations differ"


def env_with(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]), **extra}


@pytest.fixture(scope="module")
def uninterrupted(start_point, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    train(make_config(run_values(start_point, run_dir)))
    return records(run_dir)


# site:pass, and what the crash must have left (so that the test tests what it says)
ONE_PROCESS = {
    "metrics:5": lambda run: not (run / "metrics.jsonl").read_text().endswith("\n"),  # step 3's line, cut
    "eval:3": lambda run: not (run / "eval.jsonl").read_text().endswith("\n"),  # step 4's evaluation, cut
    "generations:3": lambda run: any((run / "generations" / "step_4").glob("*.tmp")),
    "checkpoint_write:2": lambda run: not (run / "checkpoints" / "4").exists(),
    "checkpoint_commit:2": lambda run: any((run / "checkpoints").glob("4.orbax-checkpoint-tmp*"))
                                       and not (run / "checkpoints" / "4").exists(),
    "checkpoint_committed:1": lambda run: (run / "checkpoints" / "2" / "commit_success.txt").exists()
                                          or (run / "checkpoints" / "2").is_dir(),
    "checkpoint_committed:2": lambda run: (run / "checkpoints" / "4").is_dir(),  # the final one: nothing to redo
}


@pytest.mark.slow
@pytest.mark.xdist_group("faults_one_process")  # one worker builds the module's reference run
@pytest.mark.parametrize("fault", list(ONE_PROCESS))
def test_one_process_killed_at_a_write_resumes_exactly(fault, start_point, uninterrupted, tmp_path):
    values = run_values(start_point, tmp_path / "run")
    killed = subprocess.run(cli(values), capture_output=True, text=True, env=env_with(**{faults.ENV: fault}),
                            timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert ONE_PROCESS[fault](tmp_path / "run"), f"{fault}: the crash did not leave what it should"
    assert_nothing_compiled_late(train(make_config({**values, "resume": "auto"})))
    assert_same(records(tmp_path / "run"), uninterrupted, fault)


@pytest.mark.slow
def test_a_stop_signal_at_an_evaluation_step_leaves_the_evaluation_to_the_resumed_run(start_point, tmp_path):
    """SIGTERM during an evaluation step's update (it lands as step 2's metrics record is written)
    saves checkpoint 2 and exits 75 at the step's end; the evaluation is not run then, and the
    resumed run runs it first (checkpoint meta eval_pending)."""
    values = run_values(start_point, tmp_path / "run", **{"train.eval_before": False})
    proc = subprocess.run(cli(values), capture_output=True, text=True, timeout=600,
                          env=env_with(**{faults.ENV: "metrics:2", faults.SIGNAL_ENV: "SIGTERM"}))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 75 and re.search(r"received SIGTERM: checkpoint 2 saved in [0-9.]+ s", out), out[-3000:]
    assert not (tmp_path / "run" / "eval.jsonl").exists()  # step 2's evaluation was not run
    assert_nothing_compiled_late(train(make_config({**values, "resume": "auto"})))
    reference = run_values(start_point, tmp_path / "reference", **{"train.eval_before": False})
    train(make_config(reference))
    assert_same(records(tmp_path / "run"), records(tmp_path / "reference"), "stop at step 2")


# Two processes (launch/local.sh, 2 x 4 CPU devices, gloo): a chain of crashes in one run folder,
# each resume killed at the next site, in either process; the last resume finishes. The first link
# commits checkpoint 2, so every later one resumes from it.
TWO_PROCESSES = ("checkpoint_committed:1@0", "metrics:2@0", "generations:1@1", "checkpoint_write:1@1", "eval:1@0",
                 "checkpoint_commit:1@0")


def launch(values: dict, logs: Path, **env) -> subprocess.CompletedProcess:
    flags = [f"--config.{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in values.items()]
    return launch_two(flags, logs, 600, **env)


@pytest.mark.slow
@pytest.mark.xdist_group("two_processes")  # never beside another two-process test: 4 processes on 2 cores
def test_two_processes_killed_at_each_write_resume_exactly(start_point, tmp_path):
    values = run_values(start_point, tmp_path / "run", **{"mesh.fsdp": 8, "distributed.heartbeat_timeout_s": 10})
    reference = launch({**values, "run_dir": str(tmp_path / "reference")}, tmp_path / "logs_reference")
    assert reference.returncode == 0, reference.stdout[-3000:]
    for i, fault in enumerate(TWO_PROCESSES):
        crashed = launch(values, tmp_path / f"logs_{i}", **{faults.ENV: fault})
        # the launcher's status is the first failure's: the killed process's SIGKILL (128 + 9)
        assert crashed.returncode == 137, f"{fault}: the run was not killed\n{crashed.stdout[-3000:]}"
        logs = {p.name: p.read_text() for p in (tmp_path / f"logs_{i}").glob("*.log")}
        assert not any("arlopti_jax: finished" in text for text in logs.values()), fault  # both stopped
        survivor = logs[f"process_{1 - int(fault[-1])}.log"]  # stopped by the lost connection or heartbeat
        assert "Gloo" in survivor or "JAX distributed service detected fatal errors" in survivor, fault
        assert i == 0 or f"resumed from {tmp_path / 'run' / 'checkpoints'}/2" in logs["process_0.log"], fault
    done = launch(values, tmp_path / "logs_last")
    assert done.returncode == 0, done.stdout[-3000:]
    assert_same(records(tmp_path / "run"), records(tmp_path / "reference"), "two processes")
    assert (tmp_path / "run" / "generations" / "step_4" / "test_2ppl.process1.jsonl").is_file()


LORA = {"model.lora_rank": 4, "model.lora_alpha": 8.0, "model.lora_targets": "q,v,gate", "optim.lr": 1e-3}


@pytest.mark.slow
def test_a_lora_run_killed_at_its_checkpoint_writes_resumes_exactly(start_point, tmp_path):
    """LoRA (adapter-only checkpoints, the base checked by its hash): one process killed while
    checkpoint 4 is written and just after checkpoint 2 is committed, then two processes killed
    after checkpoint 2's commit; each resumed run's records equal its uninterrupted run's."""
    reference = tmp_path / "reference"
    train(make_config(run_values(start_point, reference, **LORA)))
    for fault in ("checkpoint_write:2", "checkpoint_committed:1"):
        values = run_values(start_point, tmp_path / fault.replace(":", "_"), **LORA)
        killed = subprocess.run(cli(values), capture_output=True, text=True, env=env_with(**{faults.ENV: fault}),
                                timeout=600)
        assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
        assert ONE_PROCESS[fault](Path(values["run_dir"])), f"{fault}: the crash did not leave what it should"
        train(make_config({**values, "resume": "auto"}))
        assert_same(records(Path(values["run_dir"])), records(reference), f"LoRA, {fault}")

    values = run_values(start_point, tmp_path / "two", **{**LORA, "mesh.fsdp": 8,
                                                         "distributed.heartbeat_timeout_s": 10})
    reference = launch({**values, "run_dir": str(tmp_path / "two_reference")}, tmp_path / "logs_reference")
    assert reference.returncode == 0, reference.stdout[-3000:]
    crashed = launch(values, tmp_path / "logs_crashed", **{faults.ENV: "checkpoint_committed:1@0"})
    assert crashed.returncode == 137, crashed.stdout[-3000:]
    done = launch(values, tmp_path / "logs_done")
    assert done.returncode == 0, done.stdout[-3000:]
    resumed = (tmp_path / "logs_done" / "process_0.log").read_text()
    assert f"resumed from {tmp_path / 'two' / 'checkpoints'}/2" in resumed
    assert_same(records(tmp_path / "two"), records(tmp_path / "two_reference"), "LoRA, two processes")


# ---- the sweep and the start point's cache ----

SWEEP = ["--quick", "--variants", "grpo,grpo_ar", "--seeds", "0", "--diagnostics-every", "0"]


def sweep(out: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = env_with(**({faults.ENV: fault} if fault else {}))
    return subprocess.run([sys.executable, "-m", "arlopti_jax.reproduce", "--out", str(out), *SWEEP, *extra],
                          capture_output=True, text=True, env=env, timeout=900)


def sweep_records(out: Path) -> dict:
    """results.json's runs without their wall times."""
    runs = json.loads((out / "results.json").read_text())["runs"]
    return {name: {k: v for k, v in record.items() if k != "seconds"} for name, record in runs.items()}


@pytest.mark.slow
def test_sweep_killed_at_its_writes_resumes_exactly(tmp_path):
    reference = sweep(tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    want = sweep_records(tmp_path / "reference")
    assert set(want) == {"grpo/seed0", "grpo_ar/seed0"} and all(r["finished"] for r in want.values())
    # the start point's cache (killed before its folder is renamed into place), then results.json
    # (killed mid-write after the first run), then a --jobs 2 worker's records (mid-write)
    for fault, extra in (("start_point:1", ()), ("results:1", ()), ("worker_records:1", ("--jobs", "2"))):
        out = tmp_path / fault.split(":")[0]
        if fault.startswith("worker_records"):  # both workers inherit the switch: each dies at its first record
            crashed = sweep(out, *extra, fault=fault)
            assert crashed.returncode != 0 and "failed (exit code -9)" in crashed.stderr, crashed.stderr[-3000:]
        else:
            crashed = sweep(out, *extra, fault=fault)
            assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
        if fault.startswith("start_point"):
            assert not (out / "start_point").exists() and (out / "start_point.building").is_dir()
        if fault.startswith("results"):
            assert not (out / "results.json").exists() and (out / "results.tmp").is_file()
        resumed = sweep(out, *extra)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert sweep_records(out) == want, fault
        assert (out / "start_point" / "model" / "model.safetensors").read_bytes() == (
            tmp_path / "reference" / "start_point" / "model" / "model.safetensors").read_bytes()


# The sampler on its own devices one version ahead (rollout.devices=4 of 8, k = 1, tis): the
# checkpoint also holds the version that samples the batch in flight, synced to the sampler's mesh
# on resume. A chain of crashes in one run folder, as the two-process chain below, in one process
# and in two.
SPLIT = {"rollout.devices": 4, "rollout.max_staleness": 1, "rollout.correction": "tis", "mesh.fsdp": 4,
         "train.micro_batch": 4}
CHAIN = tuple(fault.split("@")[0] for fault in TWO_PROCESSES)  # the same sites, in one process


@pytest.mark.slow
def test_split_meshes_one_version_ahead_killed_at_each_write_resume_exactly(start_point, tmp_path):
    values = run_values(start_point, tmp_path / "run", **SPLIT)
    train(make_config({**values, "run_dir": str(tmp_path / "reference")}))
    for fault in CHAIN:
        killed = subprocess.run(cli(values), capture_output=True, text=True, env=env_with(**{faults.ENV: fault}),
                                timeout=600)
        assert killed.returncode == -signal.SIGKILL, f"{fault}: " + killed.stdout[-2000:] + killed.stderr[-2000:]
    assert_nothing_compiled_late(train(make_config({**values, "resume": "auto"})))
    assert_same(records(tmp_path / "run"), records(tmp_path / "reference"), "split, k = 1")


@pytest.mark.slow
@pytest.mark.xdist_group("two_processes")  # never beside another two-process test: 4 processes on 2 cores
def test_split_meshes_on_two_processes_killed_at_each_write_resume_exactly(start_point, tmp_path):
    """Each process 2 trainer + 2 sampler devices; the two-process chain's kills (``TWO_PROCESSES``)."""
    values = run_values(start_point, tmp_path / "run", **SPLIT, **{"distributed.heartbeat_timeout_s": 10})
    reference = launch({**values, "run_dir": str(tmp_path / "reference")}, tmp_path / "logs_reference")
    assert reference.returncode == 0, reference.stdout[-3000:]
    for i, fault in enumerate(TWO_PROCESSES):
        crashed = launch(values, tmp_path / f"logs_{i}", **{faults.ENV: fault})
        assert crashed.returncode == 137, f"{fault}: the run was not killed\n{crashed.stdout[-3000:]}"
    done = launch(values, tmp_path / "logs_last")
    assert done.returncode == 0, done.stdout[-3000:]
    assert_same(records(tmp_path / "run"), records(tmp_path / "reference"), "split, k = 1, two processes")
