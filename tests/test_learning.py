"""A reduced embedded default, fixed seeds, learns: its training reward and its held-out greedy
accuracy rise by stated margins. Asserts learning, not time (about two minutes on 2 cores)."""

import numpy as np
import pytest

from arlopti_jax.start_point import ensure_start_point
from arlopti_jax.trainer import train
from tests.test_train import make_config

# Enough SFT for the warm start to write both answer forms (30% in the <answer> block) and to
# know a little of the logic; the reduced RL run then has to learn the block from the reward.
SIZES = dict(sft_steps=150, sft_rows_per_size=400, train_rows_per_size=100, test_rows_per_size=40)


def test_reduced_default_learns(tmp_path):
    sp = ensure_start_point(tmp_path / "start_point", seed=0, sizes=SIZES)
    config = make_config({
        "run_dir": str(tmp_path / "run"), "model.path": str(sp / "model"),
        "data.train_files": str(sp / "data" / "train.parquet"),
        "data.test_files": ",".join(str(sp / "data" / f"test_{n}ppl.parquet") for n in (2, 3)),
        "train.max_steps": 12, "train.eval_every": 12, "train.save_every": 100, "train.eval_n": 1,
        "train.export_at_end": False, "train.samples_every": 100})
    summary = train(config)

    rewards = summary["rewards"]
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    # the start point's greedy answers are sentences (format failure, -3 each); samples use the
    # block about 30% of the time. Learning the block lifts the batch reward by well over 1 point.
    assert first < -1.5, rewards
    assert last - first > 1.0, rewards
    before, after = summary["before"], summary["after"]
    assert before["eval/avg/greedy_acc"] == 0.0  # no greedy answer in the block: none scores
    assert after["eval/avg/greedy_acc"] >= 0.15, after  # chance is 0.1875; 0.0 before
