"""train.loggers: the run's config, scalars, sample texts and summary reach TensorBoard, W&B (offline)
and MLflow (a local file store), read back with the trackers' own formats and clients and compared
with metrics.jsonl; the runs are named after run_dir's last part (a bucket's too), and a run killed
and resumed logs into the same W&B and MLflow runs (their ids in run_dir/trackers.json), one that
starts over into new ones; a tracker that cannot start is one line (at the start-up check, or as the
run starts its trackers), one that fails later a warning that leaves the run going; only process 0
logs."""

import json
import logging
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from tracker_readers import offline_env, read_mlflow, read_wandb, wandb_logs

from arlopti_jax.config import ConfigError, base_config, validate
from arlopti_jax.plot import read_scalars
from arlopti_jax.store import trackers
from arlopti_jax.store.metrics import MetricsWriter

CONFIG = {"train": {"mini_batch": 256, "eval_ks": [1, 4], "loggers": "tensorboard,wandb,mlflow"},
          "optim": {"lr": 1e-6}, "reward": {"correct_at": None}, "run_dir": "runs/x"}


def _steps(seed: int) -> list[tuple[int, dict]]:
    rng = np.random.default_rng(seed)
    return [(step, {"reward/mean": float(rng.random()), "eval/test_2ppl/pass@4": float(rng.random()),
                    "acc/kk_logic": float(step) / 4, "skipped": math.nan, "none": None})
            for step in range(4)]


@pytest.mark.parametrize("seed", [0, 1])
def test_every_tracker_gets_what_metrics_jsonl_holds(tmp_path, monkeypatch, seed):
    uri = offline_env(tmp_path, monkeypatch)
    trackers.check("tensorboard,wandb,mlflow")
    run_dir = tmp_path / f"run{seed}"
    # seed 1: a bucket's run, written in a staging folder of another name, named after the bucket's folder
    where = str(run_dir) if seed == 0 else "gs://bucket/runs/kk3b/"
    name = run_dir.name if seed == 0 else "kk3b"
    config = {**CONFIG, "run_dir": where}
    writer = MetricsWriter(run_dir, enabled=True, loggers="tensorboard,wandb,mlflow", config=config)
    assert writer.loggers == ["tensorboard", "wandb", "mlflow"]
    for step, values in _steps(seed):
        writer.scalars(step, values)
        writer.text(step, "samples", f"reward {values['reward/mean']:.2f}\n\n```\nsample {seed}-{step}\n```")
        writer.histogram(step, "pi_old", np.linspace(0, 1, 5 + step))
    summary = {"summary/minutes": 1.5 + seed, "summary/eval/test_2ppl/greedy_acc": 0.25}
    writer.summary(4, f"finished {seed}", summary)
    writer.close()

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    jsonl = {(r["step"], k): v for r in records for k, v in r.items() if k != "step"}
    assert len(jsonl) == 4 * 3  # NaN and None are not logged
    tensorboard = read_scalars(run_dir)
    wandb = read_wandb(run_dir)
    mlflow = read_mlflow(uri)
    for (step, key), value in jsonl.items():
        safe = key.replace("@", "_")  # TensorBoard's and MLflow's names take no '@'
        assert (step, pytest.approx(value, rel=1e-6)) in tensorboard[safe]
        assert wandb["history"][step][key] == value
        assert (step, value) in mlflow["metrics"][safe]
    assert {k for k in mlflow["metrics"] if not k.startswith("summary/")} == {k.replace("@", "_") for _, k in jsonl}
    # the config
    assert wandb["config"] == config and wandb["name"] == name
    assert mlflow["params"]["train.eval_ks"] == "[1, 4]" and mlflow["params"]["optim.lr"] == "1e-06"
    assert json.loads(mlflow["texts"]["config.json"]) == config
    assert mlflow["name"] == name and mlflow["status"] == "FINISHED" and mlflow["tags"]["run_dir"] == where
    assert json.loads((run_dir / "trackers.json").read_text()) == {
        "wandb": {"id": wandb["id"]}, "mlflow": {"run_id": mlflow["id"], "tracking_uri": uri}}
    # the sample texts, each at its step
    for step, values in _steps(seed):
        text = f"reward {values['reward/mean']:.2f}\n\n```\nsample {seed}-{step}\n```"
        assert wandb["history"][step]["samples"] == [[text]]
        assert mlflow["texts"][f"samples/step_{step:08d}.txt"] == text
        assert wandb["history"][step]["pi_old"]["_type"] == "histogram"
    # the summary
    assert {k: wandb["summary"][k] for k in summary} == summary and wandb["summary"]["summary"] == f"finished {seed}"
    assert mlflow["metrics"]["summary/minutes"] == [(4, 1.5 + seed)] and mlflow["texts"]["summary.txt"] == \
        f"finished {seed}"
    assert tensorboard["summary/minutes"] == [(4, 1.5 + seed)]


def test_only_process_0_logs(tmp_path, monkeypatch):
    offline_env(tmp_path, monkeypatch)
    writer = MetricsWriter(tmp_path / "run", enabled=False, loggers="tensorboard,wandb,mlflow", config=CONFIG)
    writer.scalars(1, {"x": 1.0})
    writer.text(1, "samples", "t")
    writer.summary(1, "s", {"summary/minutes": 1.0})
    writer.close()
    assert writer.loggers == [] and not (tmp_path / "run").exists() and not (tmp_path / "mlruns").exists()


class Failing:
    def __init__(self, run, config):
        raise ConnectionError("server unreachable\nmore of its message")


class FailsLater(trackers.TensorBoard):
    def scalars(self, step, values):
        if step == 2:
            raise OSError("disk full")
        super().scalars(step, values)


class Closing(trackers.TensorBoard):
    closed = []

    def close(self):
        self.closed.append(self)
        super().close()


def test_a_tracker_that_cannot_start_stops_the_run_in_one_line(tmp_path, monkeypatch):
    """Past the start-up check (a server that does not answer): TrackerError, one line naming it; the
    trackers started before it are closed again and no metrics.jsonl is opened."""
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", Closing)
    monkeypatch.setitem(trackers.TRACKERS, "mlflow", Failing)
    with pytest.raises(trackers.TrackerError) as raised:
        MetricsWriter(tmp_path / "run", enabled=True, loggers="tensorboard,mlflow,wandb")
    assert str(raised.value) == "config.train.loggers: the mlflow tracker could not start: server unreachable"
    assert isinstance(raised.value, ValueError)  # a start-up error: the train command prints it
    assert len(Closing.closed) == 1 and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tracker_that_fails_later_is_dropped_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(trackers.TRACKERS, "wandb", FailsLater)
    with caplog.at_level(logging.WARNING, logger="arlopti_jax.store.metrics"):
        writer = MetricsWriter(tmp_path / "run", enabled=True, loggers="tensorboard,wandb")
        for step in range(4):
            writer.scalars(step, {"x": float(step)})
        writer.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["the wandb tracker failed (scalars), the run goes on without it: disk full"]
    assert [json.loads(line)["x"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == \
        [0.0, 1.0, 2.0, 3.0]
    assert read_scalars(tmp_path / "run")["x"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]


def test_a_tracker_that_cannot_start_is_found_at_start_up(tmp_path, monkeypatch):
    offline_env(tmp_path, monkeypatch)
    trackers.check("")  # metrics.jsonl alone
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ValueError, match=r"^config.train.loggers: wandb is not installed \(.*\); "
                                         r"pip install 'arlopti_jax\[wandb\]'$"):
        trackers.check("tensorboard,wandb")
    monkeypatch.undo()
    offline_env(tmp_path, monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ValueError, match="^config.train.loggers: wandb: WANDB_MODE='sometimes': Input should be "
                                         "'online', 'offline'"):
        trackers.check("wandb")
    monkeypatch.delenv("WANDB_MODE")  # online, and no key anywhere
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    with pytest.raises(ValueError, match=r"^config.train.loggers: wandb: no W&B API key \(set WANDB_API_KEY"):
        trackers.check("wandb")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://store")
    with pytest.raises(ValueError, match="^config.train.loggers: mlflow cannot open the tracking store bogus://store "
                                         r"\(MLFLOW_TRACKING_URI\): "):
        trackers.check("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # mlflow 3 refuses its file store unless allowed
    with pytest.raises(ValueError, match="mlflow cannot open the tracking store file:.*MLFLOW_ALLOW_FILE_STORE"):
        trackers.check("mlflow")


@pytest.mark.parametrize("loggers", ["tensorboard,comet", "wandb,wandb", "tensorboard wandb"])
def test_train_loggers_is_validated(loggers):
    c = base_config()
    c.train.loggers = loggers
    with pytest.raises(ConfigError, match=r"^config.train.loggers=.* is invalid: comma-separated names from "
                                          "tensorboard,wandb,mlflow, each once"):
        validate(c)


def test_the_train_command_stops_at_start_up_on_a_tracker_that_cannot_start(start_point, tmp_path):
    from run_fixtures import overrides

    values = overrides(start_point, tmp_path / "run", **{"train.loggers": "tensorboard,wandb"})
    env = {**os.environ, "WANDB_MODE": "sometimes", "ARLOPTI_STARTUP_CHECK": "1"}
    args = [f"--config.{k}={v}" for k, v in values.items()]
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.train", *args], capture_output=True, text=True,
                          timeout=300, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: config.train.loggers: wandb: WANDB_MODE='sometimes'") and \
        "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


LOGGING = """
import os, signal, sys
from arlopti_jax.store.metrics import MetricsWriter

run_dir, first, last, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
writer = MetricsWriter(run_dir, enabled=True, loggers="wandb,mlflow", config={"run_dir": "gs://bucket/runs/kk3b"})
for step in range(first, last):
    writer.scalars(step, {"x": float(step)})
if end == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
writer.close()
"""


def test_a_killed_and_resumed_run_logs_into_the_same_dashboard_runs(tmp_path, monkeypatch):
    """A process logging steps 0-2 is SIGKILLed; the next, over the same records (a resumed run: its
    metrics.jsonl holds the steps up to its checkpoint), logs steps 3-5 into the same W&B run (a
    second offline log with the same id, which ``wandb sync`` uploads into that run) and the same
    MLflow run, named after the bucket's folder, not the staging folder. A run that starts over (its
    records trimmed away) gets new runs of both."""
    uri = offline_env(tmp_path, monkeypatch)
    run_dir = tmp_path / "staging-3f2a"
    script = tmp_path / "log.py"
    script.write_text(LOGGING)

    # each process its own W&B service, as a requeued job's: not one this process started for an earlier
    # test (WANDB_SERVICE), which would still hold the killed process's run ("run ID ... is in use")
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}

    def run(first, last, end):
        return subprocess.run([sys.executable, str(script), str(run_dir), str(first), str(last), end],
                              capture_output=True, text=True, timeout=300, env=env)

    killed = run(0, 3, "kill")
    assert killed.returncode == -9, killed.stderr[-3000:]
    stored = json.loads((run_dir / "trackers.json").read_text())
    resumed = run(3, 6, "close")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "trackers.json").read_text()) == stored
    logs = wandb_logs(run_dir)
    assert len(logs) == 2 and {log.name for log in logs} == {f"run-{stored['wandb']['id']}.wandb"}
    second = read_wandb(run_dir, logs[1])
    assert second["id"] == stored["wandb"]["id"] and second["name"] == "kk3b"
    assert {step: row["x"] for step, row in second["history"].items()} == {3: 3.0, 4: 4.0, 5: 5.0}
    mlflow = read_mlflow(uri)  # the experiment's one run
    assert mlflow["id"] == stored["mlflow"]["run_id"] and mlflow["name"] == "kk3b"
    assert mlflow["metrics"]["x"] == [(step, float(step)) for step in range(6)] and mlflow["status"] == "FINISHED"
    assert mlflow["tags"]["run_dir"] == "gs://bucket/runs/kk3b"

    (run_dir / "metrics.jsonl").write_text("")  # trimmed to nothing: the run starts over from step 0
    assert run(0, 2, "close").returncode == 0
    again = json.loads((run_dir / "trackers.json").read_text())
    assert again["wandb"]["id"] != stored["wandb"]["id"] and again["mlflow"]["run_id"] != stored["mlflow"]["run_id"]
    assert read_wandb(run_dir, wandb_logs(run_dir)[2])["id"] == again["wandb"]["id"]
