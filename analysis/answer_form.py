"""What form the comparison's test responses take: how many box an answer, how many end.

    python analysis/answer_form.py [FOLDER] [--mode sampled|greedy]

FOLDER (default: the records in docs/results/matched_smollm2) holds
runs/METHOD/seedK/generations_step_S.jsonl.gz, as ``matched_sync.py``
writes them. For each method and seed, over the final evaluation's responses (128 test problems;
4 samples each at temperature 1, or the greedy one): the share that is correct, that holds a
'\\boxed{...}' answer, and that ends with '<|im_end|>' within the 48-token limit. A run with few
boxed answers has not learned the answer's form; one with many boxed but wrong answers has
learned the form and not the sum. The start point's row is the first evaluation before training
(step 0) found in FOLDER.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

RECORDS = Path(__file__).resolve().parents[1] / "docs" / "results" / "matched_smollm2"
METHODS = ("grpo", "grpo_ar", "grpo_lopti", "grpo_ar_lopti", "tr_grpo", "gspo", "cispo", "top_entropy")


def form(path: Path, mode: str) -> tuple[int, float, float, float]:
    with gzip.open(path, "rt") as f:
        rows = [r for r in map(json.loads, f) if r["mode"] == mode]
    n = len(rows)
    return (n, sum(r["correct"] for r in rows) / n, sum("\\boxed{" in r["response"] for r in rows) / n,
            sum(r["response"].endswith("<|im_end|>") for r in rows) / n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, nargs="?", default=RECORDS)
    ap.add_argument("--mode", choices=("sampled", "greedy"), default="sampled")
    args = ap.parse_args(argv)
    runs = args.folder / "runs"
    print(f"| method | seed | {args.mode} responses | correct | boxed answer | ended |")
    print("|---|---|---|---|---|---|")
    start = sorted(runs.glob("*/seed*/generations_step_0.jsonl.gz"))
    if start:
        n, acc, boxed, ended = form(start[0], args.mode)
        print(f"| start point | | {n} | {acc:.3f} | {boxed:.3f} | {ended:.3f} |")
    for method in METHODS:
        for path in sorted((runs / method).glob("seed*/generations_step_*.jsonl.gz")):
            if path.name == "generations_step_0.jsonl.gz":
                continue
            n, acc, boxed, ended = form(path, args.mode)
            print(f"| {method} | {path.parent.name[4:]} | {n} | {acc:.3f} | {boxed:.3f} | {ended:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
