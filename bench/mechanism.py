"""The paper's Figure 1 on any model and task: one RL step with the diagnostics on, as a table.

    python bench/mechanism.py --config=configs/smollm2.py:cpu,grpo --responses=128 --out=runs/mechanism
    python bench/mechanism.py --responses=64                     # the embedded default's start point

It runs the trainer for one step on ``--responses`` of the policy's own samples (prompts x
rollout.n, all in one mini-batch), with ``train.diagnostics_every=1`` and no evaluation, then
reads the step's metrics: per pi_old quartile of the batch's response tokens, the token count,
mean pi_old, mean |A~|, the gradient norm of the loss restricted to the quartile's tokens
(``quartile/q*_grad_norm``), and the isolation experiment (``isolation/{low,high}_q*``: the
change of each quartile's mean pi after one optimizer step on only the lowest, or only the
highest, quartile's tokens, from the same start). Any ``--config.<field>=<value>`` override
applies, as for the trainer. Prints a markdown table and writes it to ``OUT/mechanism.md``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def table(metrics: dict) -> str:
    q = range(1, 5)
    rows = [("tokens", "quartile/q{}_tokens", "{:.0f}"), ("mean pi_old", "quartile/q{}_mean_prob", "{:.3f}"),
            ("mean abs(A~)", "quartile/q{}_mean_abs_adv", "{:.3f}"),
            ("gradient norm", "quartile/q{}_grad_norm", "{:.3g}"),
            ("change of mean pi, update q1 only", "isolation/low_q{}", "{:+.3g}"),
            ("change of mean pi, update q4 only", "isolation/high_q{}", "{:+.3g}")]
    lines = ["| measure | q1 (lowest pi_old) | q2 | q3 | q4 (highest) |", "|---|---|---|---|---|"]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(metrics[key.format(i)]) for i in q) + " |")
    return "\n".join(lines)


def main(argv) -> int:
    from absl import flags

    from arlopti_jax.config import validate
    from arlopti_jax.trainer import train

    config = flags.FLAGS.config
    responses = flags.FLAGS.responses
    if responses % config.rollout.n:
        print(f"error: --responses={responses} is not a multiple of rollout.n={config.rollout.n}", file=sys.stderr)
        return 2
    out = Path(flags.FLAGS.out)
    with config.unlocked():
        config.run_dir = str(out)
        config.resume = "none"
        config.train.batch_prompts = responses // config.rollout.n
        config.train.mini_batch = responses
        config.train.max_steps = 1
        config.train.diagnostics_every = 1
        config.train.eval_before = False
        config.train.eval_every = 10**6
        config.data.test_files = ""
        config.train.export_at_end = False
        config.train.save_every = 10**6
    if out.exists():
        if not (out / "metrics.jsonl").is_file():
            print(f"error: --out={out} exists and is not an earlier run of this script", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    validate(config)
    train(config)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = next(m for m in lines if "isolation/low_q1" in m)
    text = (f"{responses} responses (reward mean {metrics['reward/mean']:.3f}, std {metrics['reward/std']:.3f}), "
            f"one optimizer step at lr {config.optim.lr:g} for the isolation experiment\n\n{table(metrics)}\n")
    (out / "mechanism.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    from arlopti_jax.config import DEFAULT_CONFIG

    config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Python config file (see configs/).")
    flags.DEFINE_integer("responses", 128, "responses of the one step (prompts x rollout.n)")
    flags.DEFINE_string("out", "runs/mechanism", "run folder (an earlier run of this script there is replaced)")
    app.run(main)
