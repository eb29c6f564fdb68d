"""Does the sampler on its own devices, one policy version ahead, shorten the RL step?

    python bench/overlap.py [--steps 12] [--rounds 2] [--layouts colocated,split0,split1,colocated1]
                            [--config=FILE[:ARG]] [--config.FIELD=VALUE ...]

Runs ``python -m arlopti_jax.train`` (the embedded default, or ``--config``) once per layout and
round, interleaved (layout after layout, round after round, so a slower hour of the machine falls
on every layout alike), on 8 host CPU devices (``colocated4``: 4):

  colocated   today's trainer: sample, then update, on one mesh of the 8 devices (k = 0)
  split0      the sampler on 4 devices, the trainer on the other 4, synchronous (k = 0)
  split1      the same split, the sampler one version ahead (k = 1, tis): the two run at once
  colocated1  one mesh of 8, k = 1: only the host's work (reward scoring) overlaps the devices'
  colocated4  today's trainer on 4 devices alone: the split's trainer mesh, with no sampler beside it

and prints per layout the median over rounds of each run's median step seconds (``time/step``, the
steps after the first and before the last: the first compiles, and at k >= 1 the last
samples nothing), the ratio to ``colocated``, step 1's sampler/trainer KL (``offpolicy/kl_k3`` at
k >= 1, else ``update/ppo_kl``: step 1 samples with the trainer's own weights, so anything above
float rounding means the sampler's decode was wrong, and the layout is named in a warning), and each side's busy share
of the step: the sampler's (``time/sampler_busy``, its rollout and scoring of a batch) and the
trainer's (the step less its wait for the batch, ``time/trainer_wait``). With k = 0 the sampler's
time is the step's rollout and reward phases. The host devices share this machine's cores, so
what overlap can show here is bounded by them: the docstring of the figures' journal entry says
what the cores allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "colocated": [],
    "split0": ["--config.rollout.devices=4"],
    "split1": ["--config.rollout.devices=4", "--config.rollout.max_staleness=1", "--config.rollout.correction=tis"],
    "colocated1": ["--config.rollout.max_staleness=1", "--config.rollout.correction=tis"],
    "colocated4": [],  # on 4 devices: the trainer's mesh of split0 and split1, sampling on it too
}
DEVICES = {"colocated4": 4}  # host devices per layout (default 8)
KL_BROKEN = 0.1  # step 1's sampler/trainer KL above this: the sampler's decode was wrong (float rounding: < 0.01)


def one_run(run_dir: Path, flags: list[str], steps: int, devices: int = 8) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)  # a run folder left from before would be resumed, not run
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    # ml_collections wants --config=FILE before any --config.FIELD override
    first = [f for f in flags if f.startswith("--config=")]
    done = subprocess.run([sys.executable, "-m", "arlopti_jax.train", *first, f"--config.run_dir={run_dir}",
                           f"--config.train.max_steps={steps}", "--config.train.export_at_end=False",
                           "--config.train.eval_before=False", f"--config.train.eval_every={10 * steps}",
                           "--config.data.test_files=", *[f for f in flags if f not in first]], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if line.startswith(("error", "Error", "FATAL"))]
        raise SystemExit(f"error: the run in {run_dir} failed (exit {done.returncode}): "
                         + (errors or done.stderr.strip().splitlines() or ["no output"])[-1])
    recs = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "time/step" in r]
    # the first step compiles; at k >= 1 the last has no batch left to sample, so it is left out too
    later = recs[1:-1] if len(recs) > 2 else recs[1:]
    step = statistics.median(r["time/step"] for r in later)
    sampler = statistics.median(r.get("time/sampler_busy", r.get("time/rollout", 0) + r.get("time/reward", 0))
                                for r in later)
    waited = statistics.median(r.get("time/trainer_wait", r.get("time/rollout", 0) + r.get("time/reward", 0))
                               for r in later)
    sync = statistics.median(r.get("time/weight_sync", 0.0) for r in later)
    # step 1 samples with the weights the trainer holds: the sampler's log-probs must be the trainer's
    first = recs[0]
    kl = first.get("offpolicy/kl_k3", first.get("update/ppo_kl", first.get("update/low/ppo_kl", 0.0)))
    return {"step": step, "sampler_busy": sampler / step, "trainer_busy": (step - waited) / step, "sync": sync,
            "reward": statistics.mean(r["reward/mean"] for r in recs), "kl1": kl}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="RL steps a run (the first is left out)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", default="colocated,split0,split1,colocated1")
    parser.add_argument("--out", default="", help="folder for the runs (default: a new temporary one; the embedded "
                        "start point is built there once, its runs' folders replaced)")
    args, overrides = parser.parse_known_args(argv)
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        print(f"error: --layouts: {unknown[0]} is not one of {','.join(LAYOUTS)}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="overlap_"))
    results: dict[str, list[dict]] = {name: [] for name in layouts}
    for r in range(args.rounds):
        for name in layouts:
            got = one_run(out / f"{name}_{r}", [*overrides, *LAYOUTS[name]], args.steps, DEVICES.get(name, 8))
            results[name].append(got)
            print(f"round {r} {name:11s} {got['step']:7.2f} s a step", flush=True)
    base = statistics.median(g["step"] for g in results[layouts[0]])
    print(f"\n{'layout':11s} {'s/step':>8s} {'x ' + layouts[0]:>14s} {'sampler busy':>13s} {'trainer busy':>13s} "
          f"{'sync s':>7s} {'mean reward':>12s} {'step-1 KL':>10s}")
    broken = []
    for name in layouts:
        med = lambda key: statistics.median(g[key] for g in results[name])
        worst = max(g["kl1"] for g in results[name])
        print(f"{name:11s} {med('step'):8.2f} {base / med('step'):13.2f}x {med('sampler_busy'):13.0%} "
              f"{med('trainer_busy'):13.0%} {med('sync'):7.3f} {med('reward'):12.3f} {worst:10.4f}")
        if worst > KL_BROKEN:
            broken.append(name)
    if broken:
        print(f"warning: {', '.join(broken)}: at step 1 the sampler's log-probs disagree with the trainer's "
              f"(KL > {KL_BROKEN}, where float rounding gives under 0.01): its decode was wrong, so its "
              "responses and seconds are not the model's. Seen on XLA:CPU with several host devices "
              "(docs/measurements/journal.md, 2026-12-06)")
    print(f"(medians over {args.rounds} rounds of each run's median step, steps 2-{max(2, args.steps - 1)}; "
          f"runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
