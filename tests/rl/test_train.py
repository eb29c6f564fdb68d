"""End to end: training, kill + resume=auto, SIGTERM, damaged checkpoints, config errors, export, eval."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.rl import run_setup
from arlopti_jax.runtime import compiles, faults
from arlopti_jax.store.checkpoint import Checkpointer
from arlopti_jax.train import train

from run_fixtures import (TIMING, assert_nothing_compiled_late, cli, kill_after_checkpoint,  # noqa: F401
                          make_config, overrides, step_metrics, wait_for)


@pytest.mark.slow  # end to end, about a minute on 2 cores; CI runs the slow tests
def test_kill_then_resume_equals_uninterrupted(start_point, tmp_path):
    """With two epochs over each rollout batch (train.ppo_epochs; the other resume tests run one)."""
    # A: uninterrupted, in this process (8 fake devices: the mesh is fsdp=8)
    summary = train(make_config(overrides(start_point, tmp_path / "a", **{"train.ppo_epochs": 2})))
    assert len(summary["rewards"]) == 4
    want = step_metrics(tmp_path / "a")
    assert set(want) == {1, 2, 3, 4}
    assert "update/low/pg_loss" in want[1] and "update/high/pg_loss" in want[1]  # Lopti's two passes
    # in each of the two epochs (16 responses, mini-batches of 8): 2 optimizer steps per pass and epoch
    assert want[1]["update/epoch2/high/optimizer_steps"] == 2 and want[1]["update/low/optimizer_steps"] == 4
    assert want[1]["update/epoch2/low/ppo_kl"] != want[1]["update/epoch1/low/ppo_kl"]
    assert "quartile/q1_mean_prob" in want[1]
    assert not compiles.watch().is_warm  # the warm-up ended with the run: a later one in this process warms up again
    assert_nothing_compiled_late(summary)

    # B: a separate process, SIGKILLed once checkpoint 2 is complete, then resume=auto
    values = overrides(start_point, tmp_path / "b", **{"train.ppo_epochs": 2})
    kill_after_checkpoint(values)
    assert_nothing_compiled_late(train(make_config({**values, "resume": "auto"})))  # its first evaluation at step 4
    got = step_metrics(tmp_path / "b")
    for step in (1, 2, 3, 4):
        assert got[step] == want[step], f"step {step} differs after resume"
    # the steps after checkpoint 2 that the killed process had logged were dropped, not repeated
    steps = lambda run: [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps(tmp_path / "b") == steps(tmp_path / "a")


@pytest.mark.slow  # three runs, about 2 minutes on 2 cores; CI runs the slow tests
def test_dynamic_sampling_diagnostics_and_pass_at_k_resume_exactly(start_point, tmp_path, capsys):
    """filter_groups + diagnostics_every=1 + pass@k evaluation: the metrics are logged, and a
    kill + resume=auto reproduces the uninterrupted run."""
    values = overrides(start_point, tmp_path / "a", **{
        "algo.filter_groups": True, "algo.max_sample_rounds": 3, "train.diagnostics_every": 1,
        "reward.fn": "reward_fixtures:half_constant_reward", "reward.workers": 0, "train.isolation_experiment": True,
        "data.max_prompt_length": 128,  # one prompt-length bucket: fewer compilations
        "data.test_files": str(start_point / "data" / "test_2ppl.parquet"), "train.eval_every": 4,
        "train.eval_n": 4, "train.eval_ks": (1, 2, 4), "train.eval_temperature": 0.9, "train.eval_max_prompts": 4})
    assert_nothing_compiled_late(train(make_config(values)))  # A: uninterrupted, in this process
    out = capsys.readouterr().out
    want = step_metrics(tmp_path / "a")
    assert set(want) == {0, 1, 2, 3, 4}
    for step in (1, 2, 3, 4):
        m = want[step]
        assert 1 <= m["dynamic/rounds"] <= 3 and 0 <= m["dynamic/dropped_share"] <= 1
        assert all(m[f"quartile/q{q}_grad_norm"] > 0 for q in range(1, 5))
    assert any(want[s]["dynamic/rounds"] > 1 for s in (1, 2, 3, 4))  # even-index prompts' groups were dropped
    isolation = [f"isolation/{c}_q{q}" for c in ("low", "high") for q in range(1, 5)]
    assert all(np.isfinite(want[1][k]) for k in isolation)  # the isolation experiment: once, at the first step
    assert want[1]["isolation/low_q1"] != 0 and want[1]["isolation/high_q4"] != 0  # a real step, even at lr 0
    assert not any(k in want[s] for s in (2, 3, 4) for k in isolation)
    evals = [json.loads(line) for line in (tmp_path / "a" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals] == [0, 4] and all(r["eval_temperature"] == 0.9 for r in evals)
    for r in evals:  # unbiased pass@1 and mean@eval_n are both the sampled accuracy
        acc = r["eval/test_2ppl/sampled_acc"]
        assert r["eval/test_2ppl/pass@1"] == pytest.approx(acc) and r["eval/test_2ppl/mean@4"] == pytest.approx(acc)
        assert acc <= r["eval/test_2ppl/pass@2"] <= r["eval/test_2ppl/pass@4"] <= 1
        assert {"eval/test_2ppl/maj@1", "eval/test_2ppl/maj@4", "eval/avg/pass@4"} <= set(r)
    assert "pass@4" in out and "temperature 0.9" in out  # the end-of-run summary

    # C: without the isolation experiment, every other value of every step is the same
    train(make_config({**values, "run_dir": str(tmp_path / "c"), "train.isolation_experiment": False}))
    without = step_metrics(tmp_path / "c")
    assert without == {s: {k: v for k, v in m.items() if k not in isolation} for s, m in want.items()}

    # B: a separate process, SIGKILLed once checkpoint 2 is complete, then resume=auto
    values["run_dir"] = str(tmp_path / "b")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "helpers"),
                                                        os.environ.get("PYTHONPATH", "")])}
    kill_after_checkpoint(values, env=env)
    assert_nothing_compiled_late(train(make_config({**values, "resume": "auto"})))
    got = step_metrics(tmp_path / "b")
    for step in (0, 1, 2, 3, 4):
        assert got[step] == want[step], f"step {step} differs after resume"


def test_sigterm_leaves_a_loadable_checkpoint(start_point, tmp_path):
    """SIGTERM: a checkpoint of the last step, waited for and timed, and exit code 75, kept through a
    second SIGTERM as the process leaves (``srun --kill-on-bad-exit`` sends one to the tasks still
    leaving when the first has exited); with ``train.save_every_s`` a checkpoint at every step's end,
    though ``save_every`` is never due."""
    values = overrides(start_point, tmp_path / "t", **{"train.max_steps": 50, "train.save_every": 100,
                                                       "train.save_every_s": 1e-6})
    env = {**os.environ, faults.ENV: "exit:1", faults.SIGNAL_ENV: "SIGTERM"}
    proc = subprocess.Popen(cli(values), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    metrics = tmp_path / "t" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]  # stopped, resume me (a finished run exits 0)
    assert re.search(r"received SIGTERM: checkpoint \d+ saved in [0-9.]+ s \(train.grace_s=30\), exiting "
                     r"\(exit code 75",out), out[-3000:]
    last = max(step_metrics(tmp_path / "t"))
    ckpt = Checkpointer(tmp_path / "t" / "checkpoints")
    assert ckpt.steps() == list(range(max(1, last - 2), last + 1))  # every step's, the newest 3 kept
    config = make_config(values)
    policy = run_setup.load_policy(config, run_setup.make_mesh(config), start_point / "model")
    optimizer = run_setup.make_optimizer(config, 50)
    state, meta = ckpt.restore(last, run_setup.abstract_state(policy.model_cfg, optimizer, run_setup.make_mesh(config)))
    assert meta["step"] == last and meta["data"]["index"] == 4 * last
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state["params"]))


def test_damaged_checkpoint_is_skipped_with_warning(tmp_path, caplog):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    state = lambda v: {"w": jax.device_put(jnp.full((8, 4), v, jnp.float32), sharding)}
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    ckpt.save(1, state(1.0), {"step": 1})
    ckpt.save(2, state(2.0), {"step": 2})
    ckpt.close()
    for f in (tmp_path / "ck" / "2" / "state").rglob("*"):  # truncate every data file of step 2
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    ckpt = Checkpointer(tmp_path / "ck")
    step, restored, meta = ckpt.restore_latest(state(0.0))
    assert step == 1 and meta == {"step": 1}
    np.testing.assert_array_equal(restored["w"], np.ones((8, 4)))
    assert any("checkpoint" in r.message and "unreadable" in r.message for r in caplog.records)


@pytest.mark.parametrize("args,expected", [
    (["--config.algo.lopti_etaa=0.5"],
     "error: config.algo.lopti_etaa is not a config field; did you mean config.algo.lopti_eta?"),
    (["--config.algo.lopti_eta=1.5"], "error: config.algo.lopti_eta=1.5 is invalid: must be in [-1, 1]"),
    (["--config.train.micro_batch=4"],
     "error: config.train.micro_batch=4 is invalid: must be divisible by the mesh's data x fsdp = 8"),
    (["--config.algo.weighting=arr"],
     "error: config.algo.weighting='arr' is invalid: allowed values are ['ar', 'none', 'tr']"),
])
def test_invalid_config_fails_with_one_line(args, expected):
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.train", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(expected), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("module,field", [("arlopti_jax.eval", "test_files"), ("arlopti_jax.train", "train_files"),
                                          ("arlopti_jax.eval", "model.path")])
def test_a_missing_path_is_one_error_line(start_point, tmp_path, module, field):
    missing = tmp_path / "nowhere" / "test.parquet"
    values = overrides(start_point, tmp_path / "run",
                       **{"data.test_files": str(start_point / "data" / "test_2ppl.parquet")})
    values["model.path" if field == "model.path" else f"data.{field}"] = str(missing)
    proc = subprocess.run([sys.executable, "-m", module, *[f"--config.{k}={v}" for k, v in values.items()]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(missing) in lines[0], proc.stderr[-2000:]


@pytest.mark.slow  # about a minute on 2 cores; CI runs the slow tests
def test_export_and_eval_clis(start_point, tmp_path, monkeypatch):
    from tracker_readers import offline_env, read_mlflow, read_wandb

    uri = offline_env(tmp_path, monkeypatch)  # W&B offline, MLflow's file store
    values = overrides(start_point, tmp_path / "e", **{"train.max_steps": 2, "data.test_files":
                                                      str(start_point / "data" / "test_2ppl.parquet"),
                                                      "train.loggers": "tensorboard,wandb,mlflow"})
    summary = train(make_config(values))
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.export", "--checkpoint",
                           str(tmp_path / "e" / "checkpoints" / "2"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("Alice says Bob is a knave.", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape[-1] >= len(tok)
    evaluated = tmp_path / "e" / "eval.jsonl"
    records = [json.loads(l) for l in evaluated.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2]  # before training and at the end
    assert "eval/test_2ppl/greedy_acc" in records[0]
    # every evaluation kept its responses: one line per (prompt, mode, sample), scores as in eval.jsonl
    for step, record in ((0, records[0]), (2, records[1])):
        kept = [json.loads(l) for l in (tmp_path / "e" / "generations" / f"step_{step}" / "test_2ppl.jsonl")
                .read_text().splitlines()]
        assert len(kept) == 2 * 6 and {r["mode"] for r in kept} == {"greedy", "sampled"}
        greedy = [r for r in kept if r["mode"] == "greedy"]
        assert sorted(r["row"] for r in greedy) == list(range(6))
        assert np.mean([r["correct"] for r in greedy]) == pytest.approx(record["eval/test_2ppl/greedy_acc"])
        assert np.mean([r["score"] for r in greedy]) == pytest.approx(record["eval/test_2ppl/greedy_reward"])
        assert all(r["response"] and (r["answer"] is None) == (r["score"] <= -1.0) for r in kept)

    # evaluation needs no training files, and keeps its responses too
    standalone = {**values, "data.train_files": ""}
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.eval",
                           *[f"--config.{k}={v}" for k, v in standalone.items()],
                           f"--checkpoint={tmp_path / 'e' / 'checkpoints' / '2'}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test_2ppl" in proc.stdout
    [folder] = [p for p in (tmp_path / "e" / "generations").iterdir() if p.name.startswith("eval-")]
    assert len((folder / "test_2ppl.jsonl").read_text().splitlines()) == 12
    # the standalone evaluation of the final checkpoint reproduces the in-training one
    last = json.loads(evaluated.read_text().splitlines()[-1])
    assert last["eval/test_2ppl/greedy_acc"] == records[-1]["eval/test_2ppl/greedy_acc"]

    # the TensorBoard event file holds the same scalars as metrics.jsonl, and renders to PNG
    from arlopti_jax.plot import plot, read_scalars

    scalars = read_scalars(tmp_path / "e")
    jsonl = step_metrics(tmp_path / "e")
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2]
    for step, value in scalars["reward/mean"]:
        assert value == pytest.approx(jsonl[step]["reward/mean"], rel=1e-6)
    png = plot(tmp_path / "e", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # W&B and MLflow hold the run's config, every scalar of metrics.jsonl, its samples and its summary
    wandb, mlflow = read_wandb(tmp_path / "e"), read_mlflow(uri)
    for line in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        for key, value in record.items():
            assert wandb["history"][step][key] == value, key
            assert (step, value) in mlflow["metrics"][key.replace("@", "_")], key
    assert wandb["config"]["train"]["loggers"] == "tensorboard,wandb,mlflow" and wandb["config"]["rollout"]["n"] == 4
    assert mlflow["params"]["rollout.n"] == "4" and json.loads(mlflow["texts"]["config.json"])["run_dir"] == \
        str(tmp_path / "e")
    for step in (1, 2):  # train.samples_every = 1
        [[sample]] = wandb["history"][step]["samples"]
        assert sample.startswith("reward ") and mlflow["texts"][f"samples/step_{step:08d}.txt"] == sample
    assert summary["scalars"]["summary/eval/test_2ppl/greedy_acc"] == records[-1]["eval/test_2ppl/greedy_acc"]
    for key, value in summary["scalars"].items():
        assert wandb["summary"][key] == pytest.approx(value)
        assert mlflow["metrics"][key.replace("@", "_")] == [(2, pytest.approx(value))]
    assert wandb["summary"]["summary"] == summary["text"] == mlflow["texts"]["summary.txt"]
    assert "evaluation before -> after" in summary["text"] and mlflow["status"] == "FINISHED"


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint(tmp_path):
    """The records of steps after the restored checkpoint (written before a crash) are dropped,
    so the resumed run writes each step once; a restart from scratch (-1) drops them all."""
    from arlopti_jax.rl.evaluation import trim_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 2, 3, 4)))
    trim_jsonl(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 2]
    trim_jsonl(path, -1)
    assert path.read_text() == ""
    trim_jsonl(tmp_path / "absent.jsonl", 3)  # nothing to trim
    assert not (tmp_path / "absent.jsonl").exists()
