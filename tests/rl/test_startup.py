"""The trainer's inputs are checked at start-up: a resume setting the run folder contradicts, a resume
path that is not a checkpoint step folder, and a training set that cannot fill one batch each stop
``python -m arlopti_jax.train`` with one ``error:`` line naming the field (exit 2, no traceback),
and do so under ARLOPTI_STARTUP_CHECK=1 as well, before the start-up check passes."""

import os
import subprocess

import jax.numpy as jnp
import pytest

from arlopti_jax.config.cli import STARTUP_CHECK_ENV
from arlopti_jax.store.checkpoint import Checkpointer

from run_fixtures import cli, overrides


def error_line(values: dict, check: bool) -> str:
    env = {**os.environ, STARTUP_CHECK_ENV: "1" if check else "0"}
    proc = subprocess.run(cli(values), capture_output=True, text=True, env=env, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "start-up check passed" not in proc.stdout
    return errors[0]


@pytest.mark.parametrize("check", [False, True], ids=["run", "startup_check"])
def test_bad_resume_and_a_batch_the_data_cannot_fill_stop_at_start_up(start_point, tmp_path, check):
    run = tmp_path / "run"
    ckpt = Checkpointer(run / "checkpoints", async_save=False)
    ckpt.save(2, {"x": jnp.zeros(2)}, {"step": 2})
    ckpt.close()

    line = error_line(overrides(start_point, run, resume="none"), check)
    assert "config.resume='none'" in line and str(run / "checkpoints") in line and "[2]" in line

    missing = tmp_path / "elsewhere" / "checkpoints" / "7"
    line = error_line(overrides(start_point, tmp_path / "fresh", resume=str(missing)), check)
    assert line.startswith(f"error: config.resume='{missing}'") and "not a checkpoint step folder" in line

    # the start point's training file holds 80 prompts (40 per people count): 1000 cannot be filled
    line = error_line(overrides(start_point, tmp_path / "big", **{"train.batch_prompts": 1000}), check)
    assert "config.train.batch_prompts=1000" in line and str(start_point / "data" / "train.parquet") in line
    assert "cannot fill a batch of 1000" in line
    assert not (tmp_path / "big" / "checkpoints").exists()  # nothing ran


def test_what_assemble_and_the_loop_would_refuse_is_refused_by_prepare_inputs(start_point, tmp_path):
    """A schedule the run's steps cannot span, a reward function that does not import, and a model
    folder with pickled weights alone: ValueError or FileNotFoundError at start-up (the commands'
    one ``error:`` line), before any weights load."""
    from arlopti_jax.rl import run_setup
    from run_fixtures import make_config

    short = overrides(start_point, tmp_path / "a", **{"train.max_steps": 1, "optim.schedule": "warmup_cosine",
                                                      "optim.warmup_steps": 4})
    with pytest.raises(ValueError, match=r"config.optim.warmup_steps=4: the warmup_cosine schedule needs more "
                                         r"optimizer steps than its warm-up, and this run has 4 \(1 RL steps x 4\)"):
        run_setup.prepare_inputs(make_config(short))
    run_setup.prepare_inputs(make_config({**short, "train.max_steps": 2}))  # 8 optimizer steps span it

    for spec, needle in (("no_such_reward_module:score", "cannot import module 'no_such_reward_module'"),
                         ("arlopti_jax.tasks.registry:no_such_function", "has no attribute 'no_such_function'")):
        with pytest.raises(ValueError, match=f"config.reward.fn='{spec}': .*{needle}"):
            run_setup.prepare_inputs(make_config(overrides(start_point, tmp_path / "b", **{"reward.fn": spec})))

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for f in (start_point / "model").iterdir():
        target = pickled / (f.stem + ".bin" if f.suffix == ".safetensors" else f.name)
        target.write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights in .*pickled \(only model.bin: pickled"):
        run_setup.prepare_inputs(make_config(overrides(start_point, tmp_path / "c", **{"model.path": str(pickled)})))


def test_eval_reads_its_test_files_before_the_start_up_check_passes(start_point, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "no_prompt.parquet"
    pq.write_table(pa.table({"question": ["1 + 1?"], "answer": ["2"]}), bad)
    values = overrides(start_point, tmp_path / "run", **{"data.train_files": "", "data.test_files": str(bad),
                                                         "train.max_steps": -1})
    proc = subprocess.run([*cli(values)[:2], "arlopti_jax.eval", *cli(values)[3:]], capture_output=True, text=True,
                          env={**os.environ, STARTUP_CHECK_ENV: "1"}, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert errors[0].startswith("error: config.data.test_files:") and str(bad) in errors[0]
    assert "start-up check passed" not in proc.stdout
