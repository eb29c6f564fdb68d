"""Each method against GRPO on both tasks of the step-matched comparison, from their records.

    python analysis/cross_task.py [--one FOLDER] [--harder FOLDER]

Two tables (markdown):

1. On the test problems, each method minus GRPO, paired by seed (mean of the per-seed differences,
   its standard error in brackets), greedy and sampled accuracy, on the one-step task (section 6
   of docs/results/real_model.md) and the harder one (section 9); and the lowest pi_old
   quartile's share of the summed per-quartile gradient norms (mean ± standard error over seeds).
2. On the harder task's validation split, each method minus GRPO at the same learning rate,
   paired by grid seed: the learning-rate grid holds every method at every rate, so this
   compares the methods without the choice of rate. Only runs the records mark finished count.
3. With ``--same-rate FOLDER`` (default: ``same_rate`` beside the harder task's folder, where present):
   test runs of a method at another rate than its validated one (``reproduce --matched --lr
   METHOD=RATE``), each metric minus GRPO's on the harder task, paired by seed, beside the same
   method at its validated rate; and both runs' lowest-quartile gradient share.

FOLDER holds a sweep's results.json (and grid/results.json), as ``matched_sync.py`` writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from arlopti_jax.experiments.matched_report import (BASELINE, cell, finals, mean_se, metrics, paired_difference,
                                                     q1_share, quartile_norms)
from arlopti_jax.experiments.sweep import MATCHED_METHODS, VARIANTS

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
GREEDY, SAMPLED = "eval/avg/greedy_acc", "eval/avg/sampled_acc"


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        sys.exit(f"error: {path}: not a sweep's records ({err})")


def paired(results: dict, method: str, key: str) -> str:
    return cell(paired_difference(results, method, key), paired=True)


def share(results: dict, method: str) -> str:
    return cell(q1_share(quartile_norms(results, method)))


def cross_task(one: dict, two: dict) -> list[str]:
    lines = ["| method | one-step: greedy - GRPO | harder: greedy - GRPO | one-step: sampled - GRPO "
             "| harder: sampled - GRPO | one-step: q1 share | harder: q1 share |", "|---|---|---|---|---|---|---|"]
    for m in MATCHED_METHODS:
        if not finals(two, m):
            continue
        diffs = [paired(r, m, key) if m != BASELINE else "-" for key in (GREEDY, SAMPLED) for r in (one, two)]
        lines.append(f"| {VARIANTS[m][0]} | " + " | ".join(diffs) + f" | {share(one, m)} | {share(two, m)} |")
    return lines


def same_rate(grid: dict) -> list[str]:
    last = {}
    for r in grid["runs"].values():
        if r.get("finished") and r["evals"]:
            method, _, rate = r["variant"].partition("@lr")
            last[method, rate, r["seed"]] = r["evals"][-1]
    rates = sorted({rate for m, rate, _ in last if m == BASELINE}, key=float)
    lines = ["| method - GRPO | " + " | ".join(f"lr {r}: greedy / sampled" for r in rates)
             + " | every pair: greedy / sampled |", "|---|" + "---|" * (len(rates) + 1)]
    for m in MATCHED_METHODS:
        if m == BASELINE or not any(k[0] == m for k in last):
            continue
        cells, every = [], {GREEDY: [], SAMPLED: []}
        for rate in rates:
            seeds = sorted(s for mm, rr, s in last if mm == m and rr == rate and (BASELINE, rate, s) in last)
            diffs = {k: [last[m, rate, s][k] - last[BASELINE, rate, s][k] for s in seeds] for k in every}
            for k in every:
                every[k] += diffs[k]
            cells.append(" / ".join(f"{np.mean(diffs[k]):+.3f}" for k in every) if seeds else "-")
        cells.append(" / ".join(cell(mean_se(every[k]), paired=True) for k in every))
        lines.append(f"| {VARIANTS[m][0]} | " + " | ".join(cells) + " |")
    return lines


def other_rate(two: dict, extra: dict) -> list[str]:
    """Each method of ``extra`` (test runs at one other rate) and the same method of ``two`` at its
    validated rate, minus GRPO of ``two``, paired by seed."""
    cols = metrics(two)
    lines = ["| method | lr | seeds | " + " | ".join(f"{c} - GRPO" for c, _ in cols) + " | q1 share |",
             "|---" * (len(cols) + 4) + "|"]
    grpo = {k: r for k, r in two["runs"].items() if r["variant"] == BASELINE}
    for m in MATCHED_METHODS:
        if m == BASELINE or not finals(extra, m):
            continue
        for runs in (two, extra):
            own = {k: r for k, r in runs["runs"].items() if r["variant"] == m}
            merged = {"runs": {**{f"grpo:{k}": r for k, r in grpo.items()}, **{f"m:{k}": r for k, r in own.items()}}}
            stats = [paired_difference(merged, m, key) for _, key in cols]
            rates = sorted({r["lr"] for r in own.values() if r.get("finished")})
            lines.append(f"| {VARIANTS[m][0]} | {', '.join(f'{x:g}' for x in rates)} | {stats[0][2]} | "
                         + " | ".join(cell(st, paired=True) for st in stats) + f" | {share(runs, m)} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", type=Path, default=RESULTS / "matched_smollm2",
                    help="the one-step task's records (default: %(default)s)")
    ap.add_argument("--harder", type=Path, default=RESULTS / "harder_task" / "matched",
                    help="the harder task's records (default: %(default)s)")
    ap.add_argument("--same-rate", type=Path, default=None,
                    help="test runs of a method at another rate (default: same_rate beside --harder, where present)")
    args = ap.parse_args(argv)
    one, two = load(args.one / "results.json"), load(args.harder / "results.json")
    print("\n".join(cross_task(one, two)))
    print()
    print("\n".join(same_rate(load(args.harder / "grid" / "results.json"))))
    extra = args.same_rate or args.harder.parent / "same_rate"  # beside the harder task's records
    if args.same_rate or (extra / "results.json").is_file():
        print()
        print("\n".join(other_rate(two, load(extra / "results.json"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
