"""train.loggers: the run's config, scalars, sample texts and summary reach TensorBoard, W&B (offline)
and MLflow (a local file store), read back with the trackers' own formats and clients and compared
with metrics.jsonl; a tracker that cannot start is one line at start-up, or (failing later) a warning
that leaves the run going; only process 0 logs."""

import json
import logging
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from tracker_readers import offline_env, read_mlflow, read_wandb

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
    writer = MetricsWriter(run_dir, enabled=True, loggers="tensorboard,wandb,mlflow", config=CONFIG)
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
    assert wandb["config"] == {k: v for k, v in CONFIG.items()} and wandb["name"] == run_dir.name
    assert mlflow["params"]["train.eval_ks"] == "[1, 4]" and mlflow["params"]["optim.lr"] == "1e-06"
    assert json.loads(mlflow["texts"]["config.json"]) == CONFIG
    assert mlflow["name"] == run_dir.name and mlflow["status"] == "FINISHED"
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
    def __init__(self, run_dir, config):
        raise ConnectionError("server unreachable")


class FailsLater(trackers.TensorBoard):
    def scalars(self, step, values):
        if step == 2:
            raise OSError("disk full")
        super().scalars(step, values)


def test_a_tracker_that_fails_is_dropped_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(trackers.TRACKERS, "mlflow", Failing)
    monkeypatch.setitem(trackers.TRACKERS, "wandb", FailsLater)
    with caplog.at_level(logging.WARNING, logger="arlopti_jax.store.metrics"):
        writer = MetricsWriter(tmp_path / "run", enabled=True, loggers="tensorboard,mlflow,wandb")
        for step in range(4):
            writer.scalars(step, {"x": float(step)})
        writer.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["the mlflow tracker could not start, the run goes on without it: server unreachable",
                     "the wandb tracker failed (scalars), the run goes on without it: disk full"]
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
