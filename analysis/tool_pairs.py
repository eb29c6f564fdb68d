"""Paired by seed: what the tool gives each method, and what AR + Lopti gives over GRPO with and
without it, from the two arms' step-matched sweeps (``reproduce --matched --scale smollm2-calc-tool``
and ``--scale smollm2-calc-notool``).

    python analysis/tool_pairs.py OUT_TOOL/results.json [OUT_NOTOOL/results.json]

For each arm and method (``grpo``, ``grpo_ar_lopti``): greedy and sampled accuracy before (the
warm start, step 0) and after (the last evaluation), mean and standard deviation over the seeds.
Then, seed by seed (the same seed: the same problems in the same order): the tool arm minus the
baseline for each method, and AR + Lopti minus GRPO in each arm, as the mean, the standard error of
that mean, and each seed's difference. Only finished runs count. Without the baseline's file, the
tool arm alone (no tool - baseline difference).
"""

import json
import math
import sys

import numpy as np

KEYS = ("eval/avg/greedy_acc", "eval/avg/sampled_acc")
METHODS = ("grpo", "grpo_ar_lopti")


def load(path: str) -> dict:
    return {name: run for name, run in json.load(open(path))["runs"].items() if run.get("finished")}


def figure(runs: dict, method: str, seed: int, key: str, which: int):
    run = runs.get(f"{method}/seed{seed}")
    return None if run is None or not run.get("evals") else run["evals"][which][key]


def line(label: str, values: list[float]) -> str:
    se = np.std(values, ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return (f"  {label:34s} {np.mean(values):+.3f} ({se:.3f}), n={len(values)}, by seed "
            + " ".join(f"{x:+.3f}" for x in values))


def main(tool_path: str, notool_path: str | None = None) -> int:
    arms = {"tool": load(tool_path), "no tool": load(notool_path) if notool_path else {}}
    seeds = sorted({run["seed"] for runs in arms.values() for run in runs.values()})
    for key in KEYS:
        print(key)
        for arm, runs in arms.items():
            for method in METHODS:
                for which, when in ((0, "before"), (-1, "after")):
                    values = [v for v in (figure(runs, method, s, key, which) for s in seeds) if v is not None]
                    if values:
                        sd = np.std(values, ddof=1) if len(values) > 1 else float("nan")
                        print(f"  {arm:8s} {method:14s} {when:6s} {np.mean(values):.3f} (sd {sd:.3f}), "
                              f"n={len(values)}")
        for method in METHODS:
            pairs = [(figure(arms["tool"], method, s, key, -1), figure(arms["no tool"], method, s, key, -1))
                     for s in seeds]
            d = [a - b for a, b in pairs if a is not None and b is not None]
            if d:
                print(line(f"{method}: tool - no tool", d))
        for arm, runs in arms.items():
            pairs = [(figure(runs, "grpo_ar_lopti", s, key, -1), figure(runs, "grpo", s, key, -1)) for s in seeds]
            d = [a - b for a, b in pairs if a is not None and b is not None]
            if d:
                print(line(f"{arm}: AR + Lopti - GRPO", d))
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
