"""A reduced embedded default, fixed seeds, learns: its training reward and its held-out greedy
accuracy rise by stated margins. Asserts learning, not time. It runs in a subprocess on one CPU
device (the suite's 8 fake devices make every step several times slower on 2 cores)."""

import json
import os
import subprocess
import sys

import pytest

# Enough SFT for the warm start to write both answer forms (30% in the <answer> block) and to
# know a little of the logic; the reduced RL run then has to learn the block from the reward.
SCRIPT = """
import json, sys
from pathlib import Path
from arlopti_jax.default_config import get_config
from arlopti_jax.start_point import ensure_start_point
from arlopti_jax.trainer import train
out = Path(sys.argv[1])
sp = ensure_start_point(out / "start_point", seed=0, sizes=dict(
    sft_steps=200, sft_rows_per_size=400, train_rows_per_size=100, test_rows_per_size=40))
c = get_config()
c.run_dir = str(out / "run")
c.model.path = str(sp / "model")
c.data.train_files = str(sp / "data" / "train.parquet")
c.data.test_files = ",".join(str(sp / "data" / f"test_{n}ppl.parquet") for n in (2, 3))
c.train.max_steps, c.train.eval_every, c.train.save_every, c.train.samples_every = 20, 20, 100, 100
c.train.export_at_end = False
s = train(c)
print("SUMMARY " + json.dumps({"rewards": s["rewards"], "before": s["before"], "after": s["after"]}))
"""


@pytest.mark.slow
def test_reduced_default_learns(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("SUMMARY ")][-1]
    summary = json.loads(line[len("SUMMARY "):])
    rewards = summary["rewards"]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # the start point's greedy answers are sentences (format failure, -3 each); samples use the
    # block about 30% of the time. Learning the block lifts the batch reward by well over 1 point.
    assert first < -1.0, rewards
    assert last - first > 1.0, rewards
    assert summary["before"]["eval/avg/greedy_acc"] == 0.0  # no greedy answer in the block
    assert summary["after"]["eval/avg/greedy_acc"] >= 0.15, summary["after"]  # chance: 0.1875
