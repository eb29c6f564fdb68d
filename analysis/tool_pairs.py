"""Paired by seed: what the tool gives each method, and what AR + Lopti gives over GRPO with and
without it, from the two arms' step-matched sweeps (``reproduce --matched --scale smollm2-calc-tool``
and ``--scale smollm2-calc-notool``).

    python analysis/tool_pairs.py OUT_TOOL/results.json [OUT_NOTOOL/results.json]

For each arm: greedy and sampled accuracy on the test problems before RL (the warm start's, evaluated
once per sweep: ``start_eval``) and, per method (``grpo``, ``grpo_ar_lopti``), after it (the last
evaluation), mean and standard deviation over the seeds; and the training reward averaged over the RL
steps (how fast a run gets there, which still tells runs apart when both end at the ceiling). Then,
seed by seed (the same seed: the same problems in the same order): the tool arm minus the baseline for
each method, and AR + Lopti minus GRPO in each arm, as the mean, the standard error of that mean, and
each seed's difference. Only finished runs count. Without the baseline's file, the tool arm alone.
First, the tool arm's episodes: tool calls, tool errors and turns per episode at the first and last step.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np

KEYS = ("eval/avg/greedy_acc", "eval/avg/sampled_acc", "train reward, mean over steps")
METHODS = ("grpo", "grpo_ar_lopti")


def load(path: str) -> tuple[dict, dict]:
    results = json.load(open(path))
    return ({name: run for name, run in results["runs"].items() if run.get("finished")},
            results.get("start_eval") or {})


def figure(runs: dict, method: str, seed: int, key: str):
    run = runs.get(f"{method}/seed{seed}")
    if run is None:
        return None
    if key.startswith("train reward"):
        return float(np.mean(run["rewards"])) if run.get("rewards") else None
    return run["evals"][-1][key] if run.get("evals") else None


def episode_lines(path: str, arm: str, runs: dict) -> None:
    """Per method: tool calls and tool errors per episode and turns per episode at the first and the last
    RL step (the runs' ``metrics.jsonl``, beside results.json), means over the seeds."""
    folder = Path(path).parent / "runs"
    for method in METHODS:
        first, last = [], []
        for run in (r for r in runs.values() if r["variant"] == method):
            rows = [json.loads(x) for x in (folder / method / f"seed{run['seed']}" / "metrics.jsonl").open()]
            rows = [r for r in rows if "episode/tool_calls" in r]
            if rows:
                first.append(rows[0])
                last.append(rows[-1])
        if first:
            cells = [f"{key.split('/')[1]} {np.mean([r[key] for r in first]):.2f} -> "
                     f"{np.mean([r[key] for r in last]):.2f}"
                     for key in ("episode/tool_calls", "episode/tool_errors", "episode/turns")]
            print(f"  {arm:8s} {method:14s} per episode, first -> last step: {', '.join(cells)}, n={len(first)}")


def line(label: str, values: list[float]) -> str:
    se = np.std(values, ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return (f"  {label:34s} {np.mean(values):+.3f} ({se:.3f}), n={len(values)}, by seed "
            + " ".join(f"{x:+.3f}" for x in values))


def main(tool_path: str, notool_path: str | None = None) -> int:
    arms = {"tool": load(tool_path)}
    if notool_path:
        arms["no tool"] = load(notool_path)
    seeds = sorted({run["seed"] for runs, _ in arms.values() for run in runs.values()})
    print("episodes")
    episode_lines(tool_path, "tool", arms["tool"][0])
    for key in KEYS:
        print(key)
        for arm, (runs, start) in arms.items():
            if key in start:
                print(f"  {arm:8s} {'warm start':14s} before {start[key]:.3f}")
            for method in METHODS:
                values = [v for v in (figure(runs, method, s, key) for s in seeds) if v is not None]
                if values:
                    sd = np.std(values, ddof=1) if len(values) > 1 else float("nan")
                    when = "steps" if key.startswith("train") else "after"
                    print(f"  {arm:8s} {method:14s} {when:6s} {np.mean(values):.3f} (sd {sd:.3f}), n={len(values)}")
        if "no tool" in arms:
            for method in METHODS:
                pairs = [(figure(arms["tool"][0], method, s, key), figure(arms["no tool"][0], method, s, key))
                         for s in seeds]
                d = [a - b for a, b in pairs if a is not None and b is not None]
                if d:
                    print(line(f"{method}: tool - no tool", d))
        for arm, (runs, _) in arms.items():
            pairs = [(figure(runs, "grpo_ar_lopti", s, key), figure(runs, "grpo", s, key)) for s in seeds]
            d = [a - b for a, b in pairs if a is not None and b is not None]
            if d:
                print(line(f"{arm}: AR + Lopti - GRPO", d))
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
