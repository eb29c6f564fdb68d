"""Does the sampling loop's overlap shorten the RL step?

    python bench/overlap.py [--steps 12] [--rounds 2] [--layouts cpu1,cpu1k1,cpu2,cpu2k1]
                            [--config=FILE[:ARG]] [--config.FIELD=VALUE ...]

Runs ``python -m arlopti_jax.train`` (the embedded default, or ``--config``) once per layout and
round, interleaved (layout after layout, round after round, so a slower hour of the machine falls
on every layout alike), on host CPU devices:

  cpu1        1 process, 2 host devices: the sampler on 1, the trainer on the other, k = 0, and a
              reward that waits 12 ms a response (bench/slow_reward.py: host time to hide)
  cpu1k1      the same, k = 1: the update, the sampler's decode and the scoring overlap
  cpu2, cpu2k1  the same on 2 processes (launch/local.sh 2 --devices 2: each gives 1 of its 2)
  colocated   sample, then update, on one mesh of 8 devices (k = 0)
  split0      the sampler on 4 devices, the trainer on the other 4, synchronous (k = 0)
  split1      the same split, the sampler one version ahead (k = 1, tis)
  colocated1  one mesh of 8, k = 1: only the host's work overlaps the devices'
  colocated4  the trainer on 4 devices alone: the split's trainer mesh, with no sampler beside it

and prints per layout the median over rounds of each run's median step seconds (``time/step`` from
step 3 on, before the last: the first steps compile, and at k >= 1 the last samples nothing), the
ratio to the first layout, and the two sides' busy seconds: the sampler's (``time/sampler_busy``: the
host's seconds on its decode and scoring, the update's turns left out; at k = 0 the step's rollout
and reward phases) and the update's (``time/logprobs`` + ``time/update``: dispatching its passes and
waiting for them), with ``max(sampler, update)``, the step an ideal overlap would give. Step 1's
sampler/trainer KL (``offpolicy/kl_k3``, else ``update/ppo_kl``) checks the decode: step 1 samples
with the trainer's own weights, so anything above float rounding means the sampler's decode was
wrong, and the layout is named in a warning. The host devices share this machine's cores: two
programs on two host devices overlap only as far as the cores allow.
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

SLOW = ["--config.reward.fn=slow_reward:slow_score"]
LAYOUTS = {
    "cpu1": ["--config.rollout.devices=1", *SLOW],
    "cpu1k1": ["--config.rollout.devices=1", "--config.rollout.max_staleness=1", *SLOW],
    "cpu2": ["--config.rollout.devices=2", *SLOW],
    "cpu2k1": ["--config.rollout.devices=2", "--config.rollout.max_staleness=1", *SLOW],
    "colocated": [],
    "split0": ["--config.rollout.devices=4"],
    "split1": ["--config.rollout.devices=4", "--config.rollout.max_staleness=1", "--config.rollout.correction=tis"],
    "colocated1": ["--config.rollout.max_staleness=1", "--config.rollout.correction=tis"],
    "colocated4": [],  # on 4 devices: the trainer's mesh of split0 and split1, sampling on it too
}
DEVICES = {"colocated4": 4, "cpu1": 2, "cpu1k1": 2, "cpu2": 2, "cpu2k1": 2}  # host devices per process (default 8)
PROCESSES = {"cpu2": 2, "cpu2k1": 2}  # launch/local.sh processes (default 1)
KL_BROKEN = 0.1  # step 1's sampler/trainer KL above this: the sampler's decode was wrong (float rounding: < 0.01)
BENCH = Path(__file__).resolve().parent


def one_run(run_dir: Path, flags: list[str], steps: int, devices: int = 8, processes: int = 1) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)  # a run folder left from before would be resumed, not run
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")]), "PYTHON": sys.executable}
    # ml_collections wants --config=FILE before any --config.FIELD override
    first = [f for f in flags if f.startswith("--config=")]
    args = [*first, f"--config.run_dir={run_dir}", f"--config.train.max_steps={steps}",
            "--config.train.export_at_end=False", "--config.train.eval_before=False",
            f"--config.train.eval_every={10 * steps}", "--config.data.test_files=",
            *[f for f in flags if f not in first]]
    if processes > 1:
        env.pop("XLA_FLAGS")  # launch/local.sh gives each process its devices
        cmd = ["bash", str(BENCH.parent / "launch" / "local.sh"), str(processes), "--devices", str(devices),
               "--logs", str(run_dir.with_name(run_dir.name + "_logs")), "--", *args]
    else:
        cmd = [sys.executable, "-m", "arlopti_jax.train", *args]
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if line.startswith(("error", "Error", "FATAL"))]
        raise SystemExit(f"error: the run in {run_dir} failed (exit {done.returncode}): "
                         + (errors or done.stderr.strip().splitlines() or ["no output"])[-1])
    recs = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "time/step" in r]
    # the first steps compile; at k >= 1 the last has no batch left to sample, so it is left out too
    later = recs[2:-1] if len(recs) > 3 else recs[1:]
    med = lambda f: statistics.median(f(r) for r in later)
    sampler = lambda r: r.get("time/sampler_busy", r.get("time/rollout", 0) + r.get("time/reward", 0))
    update = lambda r: r.get("time/logprobs", 0.0) + r.get("time/update", 0.0)
    # step 1 samples with the weights the trainer holds: the sampler's log-probs must be the trainer's
    head = recs[0]
    kl = head.get("offpolicy/kl_k3", head.get("update/ppo_kl", head.get("update/low/ppo_kl", 0.0)))
    return {"step": med(lambda r: r["time/step"]), "sampler": med(sampler), "update": med(update),
            "ideal": med(lambda r: max(sampler(r), update(r))), "sync": med(lambda r: r.get("time/weight_sync", 0.0)),
            "reward": statistics.mean(r["reward/mean"] for r in recs), "kl1": kl}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="RL steps a run (the first is left out)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", default="cpu1,cpu1k1,cpu2,cpu2k1")
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
            got = one_run(out / f"{name}_{r}", [*overrides, *LAYOUTS[name]], args.steps, DEVICES.get(name, 8),
                          PROCESSES.get(name, 1))
            results[name].append(got)
            print(f"round {r} {name:11s} {got['step']:7.2f} s a step", flush=True)
    base = statistics.median(g["step"] for g in results[layouts[0]])
    print(f"\n{'layout':11s} {'s/step':>8s} {'/ ' + layouts[0]:>10s} {'sampler s':>10s} {'update s':>9s} "
          f"{'max s':>7s} {'step/max':>9s} {'sync s':>7s} {'reward':>8s} {'step-1 KL':>10s}")
    broken = []
    for name in layouts:
        med = lambda key: statistics.median(g[key] for g in results[name])
        worst = max(g["kl1"] for g in results[name])
        print(f"{name:11s} {med('step'):8.2f} {med('step') / base:9.2f}x {med('sampler'):10.2f} {med('update'):9.2f} "
              f"{med('ideal'):7.2f} {med('step') / med('ideal'):8.2f}x {med('sync'):7.3f} {med('reward'):8.3f} "
              f"{worst:10.2g}")
        if worst > KL_BROKEN:
            broken.append(name)
    if broken:
        print(f"warning: {', '.join(broken)}: at step 1 the sampler's log-probs disagree with the trainer's "
              f"(KL > {KL_BROKEN}, where float rounding gives under 0.01): its decode was wrong, so its "
              "responses and seconds are not the model's. Seen on XLA:CPU with several host devices "
              "(docs/measurements/journal.md, 2026-12-06)")
    print(f"(medians over {args.rounds} rounds of each run's median step, steps 3-{max(3, args.steps - 1)}; "
          f"runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
