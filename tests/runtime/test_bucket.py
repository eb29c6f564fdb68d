"""A run folder, a model and data in a bucket (``gs://``), against a GCS emulator on localhost: the
checkpoints go to the bucket through orbax, the records through ``paths.RunFolder``, the model and
data are read from one copy per host; a killed run resumes from the bucket's checkpoint to the
uninterrupted run's records, on another host (staging folder) into the same W&B and MLflow runs."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from gcs_fixtures import emulator, make_bucket, upload
from run_fixtures import kill_after_checkpoint, make_config, overrides, step_metrics
from tracker_readers import offline_env, read_mlflow, read_wandb, wandb_logs

from arlopti_jax.runtime import paths
from arlopti_jax.store.checkpoint import Checkpointer


@pytest.fixture(scope="module")
def gcs():
    with emulator() as env:
        yield env


@pytest.mark.parametrize("value,field,needle", [
    ("s3://bucket/run", "config.run_dir", "config.run_dir=s3://bucket/run: the scheme s3:// is not supported"),
    ("hdfs://x/y", "config.model.path", "config.model.path=hdfs://x/y: the scheme hdfs://"),
])
def test_a_scheme_nothing_here_reads_is_one_line(value, field, needle):
    with pytest.raises(ValueError, match=needle):
        paths.path(value, field)
    assert paths.path("runs/x") == paths.path("runs/x").absolute() and not paths.is_remote("runs/x")


def test_checkpoints_records_and_copies_go_through_the_bucket(gcs, tmp_path, monkeypatch):
    monkeypatch.setenv("ARLOPTI_STAGING", str(tmp_path / "host"))
    bucket = make_bucket("roundtrip")
    ckpt = Checkpointer(f"{bucket}/run/checkpoints", async_save=False)
    ckpt.save(1, {"w": jnp.ones((4, 2))}, {"step": 1})
    ckpt.save(2, {"w": jnp.full((4, 2), 2.0)}, {"step": 2})
    ckpt.close()
    ckpt = Checkpointer(f"{bucket}/run/checkpoints")
    step, state, meta = ckpt.restore_latest({"w": jnp.zeros((4, 2))})
    assert (step, meta) == (2, {"step": 2}) and np.all(np.asarray(state["w"]) == 2.0)
    ckpt.close()

    folder = paths.RunFolder(f"{bucket}/run")  # the records: staged on this host, copied up whole
    assert folder.remote is not None and str(folder.local).startswith(str(tmp_path / "host"))
    (folder.local / "metrics.jsonl").write_text('{"step": 1}\n')
    folder.sync()
    (folder.local / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    folder.sync()
    assert paths.path(f"{bucket}/run/metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    (folder.local / "metrics.jsonl").write_text("stale\n")  # another host's leftovers: fetch replaces them
    folder.fetch()
    assert (folder.local / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'

    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"a": 1}))
    remote = upload(src, f"{bucket}/models/m")
    copy = paths.local_copy(remote, "config.model.path")
    assert json.loads((copy / "config.json").read_text()) == {"a": 1}
    assert paths.local_copy(remote) == copy  # made once per host
    with pytest.raises(FileNotFoundError, match="config.data.train_files=gs://roundtrip/none.parquet: nothing"):
        paths.local_copy(f"{bucket}/none.parquet", "config.data.train_files")


@pytest.mark.slow  # three tiny runs against the emulator, a few minutes on 2 cores; CI runs the slow tests
def test_a_run_in_a_bucket_killed_and_resumed_equals_the_uninterrupted_one(gcs, start_point, tmp_path, monkeypatch):
    from arlopti_jax.rl.loop import train

    monkeypatch.setenv("ARLOPTI_STAGING", str(tmp_path / "host"))
    bucket = make_bucket("runs")
    model = upload(start_point / "model", f"{bucket}/models/start")
    data = upload(start_point / "data" / "train.parquet", f"{bucket}/data/train.parquet")
    values = lambda run: overrides(start_point, f"{bucket}/{run}", **{"model.path": model, "data.train_files": data})
    train(make_config(values("a")))
    want = step_metrics(f"{bucket}/a")
    assert set(want) == {1, 2, 3, 4}
    assert paths.path(f"{bucket}/a/checkpoints/4").is_dir() and paths.path(f"{bucket}/a/tb").is_dir()

    # b: with W&B (offline) and MLflow (a local store), killed on one host and resumed on another
    b = {**values("b"), "train.loggers": "wandb,mlflow"}
    uri = offline_env(tmp_path, monkeypatch)
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}  # its own W&B service, as a new job's
    kill_after_checkpoint(b, env=env)  # a separate process: its own copies of the model and data
    first_host = paths.RunFolder(f"{bucket}/b").local
    monkeypatch.setenv("ARLOPTI_STAGING", str(tmp_path / "other_host"))  # the records, trackers.json among them,
    train(make_config({**b, "resume": "auto"}))                          # come from the bucket
    got = step_metrics(f"{bucket}/b")
    for step in (1, 2, 3, 4):
        assert got[step] == want[step], f"step {step} differs after resume"
    lines = lambda run: [json.loads(x)["step"]
                         for x in paths.path(f"{bucket}/{run}/metrics.jsonl").read_text().splitlines()]
    assert lines("b") == lines("a")
    # one dashboard run each, named after the bucket's folder, not a host's staging folder
    second_host = paths.RunFolder(f"{bucket}/b").local
    assert second_host != first_host and first_host.name != "b"
    [killed], [resumed] = wandb_logs(first_host), wandb_logs(second_host)
    assert killed.name == resumed.name and read_wandb(second_host, resumed)["name"] == "b"
    assert sorted(read_wandb(second_host, resumed)["history"]) == [3, 4]  # after checkpoint 2
    mlflow = read_mlflow(uri)
    assert mlflow["name"] == "b" and mlflow["status"] == "FINISHED" and mlflow["tags"]["run_dir"] == f"{bucket}/b"
    assert mlflow["metrics"]["reward/mean"][-2:] == [(3, want[3]["reward/mean"]), (4, want[4]["reward/mean"])]
