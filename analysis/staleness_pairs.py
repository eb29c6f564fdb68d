"""Paired by seed: what one step of staleness costs each method, from a sweep's results.json.

    python analysis/staleness_pairs.py OUT/results.json

For each method M of ``grpo`` and ``grpo_ar_lopti`` and each of its staleness variants (``M_k1``,
``M_k1_tis``; ``python -m arlopti_jax.reproduce --variants ...``), the final evaluation's average
greedy accuracy, sampled accuracy and pass@4 of the variant minus M's, seed by seed: their mean,
the standard error of that mean over the seeds, and each seed's difference; then whether AR + Lopti
changes that cost (``grpo_ar_lopti``'s difference minus ``grpo``'s, seed by seed); then each
variant's mean and standard deviation. Only finished runs count.
"""

import json
import math
import sys

import numpy as np

KEYS = ("eval/avg/greedy_acc", "eval/avg/sampled_acc", "eval/avg/pass@4")


def main(path: str) -> int:
    runs = json.load(open(path))["runs"]
    seeds = sorted({run["seed"] for run in runs.values()})
    variants = sorted({run["variant"] for run in runs.values()})

    def final(variant, seed, key):
        run = runs.get(f"{variant}/seed{seed}")
        return run["evals"][-1][key] if run and run.get("finished") else None

    def cost(base, variant, seed, key):  # the variant's final figure minus its method's at k = 0
        a, b = final(variant, seed, key), final(base, seed, key)
        return None if a is None or b is None else a - b

    for key in KEYS:
        print(key)
        for base in ("grpo", "grpo_ar_lopti"):
            for other in (f"{base}_k1", f"{base}_k1_tis"):
                d = [c for c in (cost(base, other, s, key) for s in seeds) if c is not None]
                if d:
                    se = np.std(d, ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
                    print(f"  {other:22s} - {base:14s} {np.mean(d):+.3f} ({se:.3f}), n={len(d)}, by seed "
                          + " ".join(f"{x:+.3f}" for x in d))
        for k in ("k1", "k1_tis"):
            pairs = [(cost("grpo_ar_lopti", f"grpo_ar_lopti_{k}", s, key), cost("grpo", f"grpo_{k}", s, key))
                     for s in seeds]
            d = [a - b for a, b in pairs if a is not None and b is not None]
            if d:
                se = np.std(d, ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
                print(f"  AR + Lopti's cost of {k} minus GRPO's {np.mean(d):+.3f} ({se:.3f}), n={len(d)}")
        for v in variants:
            vals = [x for x in (final(v, s, key) for s in seeds) if x is not None]
            sd = np.std(vals, ddof=1) if len(vals) > 1 else float("nan")
            print(f"  {v:22s} {np.mean(vals):.3f} (sd {sd:.3f}), n={len(vals)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
