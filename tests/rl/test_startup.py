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
