"""The report of ``reproduce --matched`` (``OUT/matched.md``), from the comparison's and the grid's
records: what was matched, the learning rates chosen on validation, held-out accuracy per method
(mean ± standard error over seeds), each method's difference from GRPO paired by seed (mean ±
standard error of the per-seed differences), and the training-time gradient norm per pi_old
quartile (``train.diagnostics_every``) with the lowest quartile's share of it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from arlopti_jax.experiments.sweep import MATCHED_VARIANTS, VARIANTS

BASELINE = "grpo"


def mean_se(values) -> tuple[float | None, float | None, int]:
    """Mean, standard error (sample std / sqrt(n)) and n; None where n is too small (JSON-safe)."""
    x = np.asarray(values, np.float64)
    se = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None
    return (float(x.mean()) if len(x) else None), se, len(x)


def cell(stats, form: str = ".3f", paired: bool = False) -> str:
    """``mean ± se`` (a paired difference: ``+mean (se)``); ``mean (n=1)`` for one value."""
    mean, se, n = stats
    if n == 0:
        return "-"
    sign = "+" if paired else ""
    if n == 1:
        return f"{mean:{sign}{form}} (n=1)"
    return f"{mean:{sign}{form}} ({se:{form}})" if paired else f"{mean:{form}} ± {se:{form}}"


def methods_of(results: dict) -> list[str]:
    present = {r["variant"] for r in results["runs"].values() if r.get("finished")}
    return [m for m in MATCHED_VARIANTS if m in present]


def finals(results: dict, method: str) -> dict[int, dict]:
    """{seed: the last evaluation} of the method's finished runs."""
    return {r["seed"]: r["evals"][-1] for r in results["runs"].values()
            if r["variant"] == method and r.get("finished") and r["evals"]}


def metrics(results: dict) -> list[tuple[str, str]]:
    """(column, eval key): greedy and sampled accuracy, and pass@k at the largest k evaluated."""
    keys = {k for r in results["runs"].values() for e in r["evals"] for k in e}
    ks = sorted(int(k.rsplit("@", 1)[1]) for k in keys if k.startswith("eval/avg/pass@"))
    out = [("greedy", "eval/avg/greedy_acc"), ("sampled", "eval/avg/sampled_acc")]
    return out + ([(f"pass@{ks[-1]}", f"eval/avg/pass@{ks[-1]}")] if ks else [])


def accuracy_table(results: dict) -> str:
    cols = metrics(results)
    lines = ["| method | lr | n | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 3) + "|"]
    start = results.get("start_eval")
    if start:
        lines.append("| start point (before RL) | | | " + " | ".join(f"{start[k]:.3f}" for _, k in cols) + " |")
    for m in methods_of(results):
        runs = finals(results, m)
        lr = results.get("matched", {}).get("lr", {}).get(m)
        stats = [cell(mean_se([e[k] for e in runs.values()])) for _, k in cols]
        rate = "" if lr is None else f"{lr:g}"
        lines.append(f"| {VARIANTS[m][0]} | {rate} | {len(runs)} | " + " | ".join(stats) + " |")
    return "\n".join(lines)


def paired_difference(results: dict, method: str, key: str) -> tuple[float | None, float | None, int]:
    """``mean_se`` of the method's final ``key`` minus GRPO's, over the seeds both finished."""
    base, runs = finals(results, BASELINE), finals(results, method)
    return mean_se([runs[s][key] - base[s][key] for s in sorted(set(runs) & set(base))])


def q1_share(norms: np.ndarray) -> tuple[float | None, float | None, int]:
    """``mean_se`` over runs of the lowest quartile's share of the summed per-quartile norms; a run
    whose highest quartile has no gradient (all its advantages 0) is left out."""
    live = norms[norms[:, 3] > 0]
    return mean_se(live[:, 0] / live.sum(1))


def paired_table(results: dict) -> str:
    """Each method minus GRPO on the same seed, over the seeds both finished."""
    cols = metrics(results)
    base = finals(results, BASELINE)
    if not base:
        return "(no finished GRPO run: no paired differences)"
    lines = ["| method - GRPO | seeds | " + " | ".join(c for c, _ in cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for m in methods_of(results):
        if m == BASELINE:
            continue
        stats = [paired_difference(results, m, k) for _, k in cols]
        diffs = [cell(s, paired=True) for s in stats]
        lines.append(f"| {VARIANTS[m][0]} | {stats[0][2]} | " + " | ".join(diffs) + " |")
    return "\n".join(lines)


def quartile_norms(results: dict, method: str) -> np.ndarray:
    """[runs, 4]: each finished run's gradient norm per pi_old quartile, mean over its logged steps."""
    rows = [np.mean([row[1:] for row in r["quartile_grad_norms"]], axis=0) for r in results["runs"].values()
            if r["variant"] == method and r.get("finished") and r.get("quartile_grad_norms")]
    return np.asarray(rows, np.float64).reshape(-1, 4)


def quartile_table(results: dict) -> str:
    lines = ["| method | n | q1 (lowest pi_old) | q2 | q3 | q4 (highest) | q1 / q4 | q1 share of the sum |",
             "|---|---|---|---|---|---|---|---|"]
    for m in methods_of(results):
        norms = quartile_norms(results, m)
        if not len(norms):
            continue
        cells = [cell(mean_se(norms[:, q]), ".3g") for q in range(4)]  # norms span decades
        live = norms[:, 3] > 0  # a batch whose advantages are all 0 has no gradient, and no ratio
        ratio = cell(mean_se(norms[live, 0] / norms[live, 3]), ".1f")
        share = cell(q1_share(norms))
        lines.append(f"| {VARIANTS[m][0]} | {len(norms)} | " + " | ".join(cells) + f" | {ratio} | {share} |")
    return "\n".join(lines)


def grid_table(choice: dict) -> str:
    """Validation sampled accuracy per method and rate (mean ± standard error over the grid seeds;
    "-" where a method did not run a rate: another method's extension of the grid)."""
    lrs = sorted({float(r) for c in choice.values() for r in c["scores"]})
    lines = ["| method | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |", "|---" * (len(lrs) + 2) + "|"]
    for m, c in choice.items():
        cells = [cell(c["scores"][f"{lr:g}"]["sampled"]) if f"{lr:g}" in c["scores"] else "-" for lr in lrs]
        edge = " (edge of the grid)" if c["edge"] else ""
        lines.append(f"| {VARIANTS[m][0]} | " + " | ".join(cells) + f" | {c['lr']:g}{edge} |")
    return "\n".join(lines)


def protocol(results: dict) -> list[str]:
    matched = results.get("matched", {})
    runs = [r for r in results["runs"].values() if r.get("finished")]
    batches = sorted({(VARIANTS[r["variant"]][0], r.get("mini_batch"), r.get("optimizer_steps_per_rl_step"))
                      for r in runs}, key=lambda x: [VARIANTS[m][0] for m in MATCHED_VARIANTS].index(x[0]))
    per_method = "; ".join(f"{label}: mini-batch {mb}" for label, mb, _ in batches)
    steps = {s for _, _, s in batches}
    epochs = sorted({r.get("ppo_epochs", 1) for r in runs})  # records before train.ppo_epochs: 1
    per_epoch = "" if epochs == [1] else f", in each of {'/'.join(map(str, epochs))} epochs over a rollout batch"
    grid = matched.get("lr_grid", [])
    extend = matched.get("grid_extend", 0)
    beyond = (f" (where the best was an end of it, up to {extend} more rate{'s' if extend > 1 else ''} beyond that "
              "end)" if extend else "")
    unmatched = "" if len(steps) <= 1 else f" (NOT MATCHED: {sorted(steps)})"
    planned = len(results["variants"]) * len(results["seeds"])
    partial = [] if len(runs) >= planned else [
        f"**Runs: {len(runs)} of {planned} finished** (a sweep stopped part-way): a mean is over the seeds its "
        "method has finished, a difference over the seeds both methods have.", ""]
    metric = matched.get("select_by", "eval/avg/sampled_acc").rsplit("/", 1)[1].replace("_acc", " accuracy")
    return partial + [
        f"**What was matched.** Every run made {matched.get('optimizer_steps_per_rl_step')} optimizer steps per RL "
        f"step{unmatched} ({per_method}; Lopti's two passes each step once per mini-batch{per_epoch}), "
        f"{results['steps']} RL steps, from the same start point, on the same training problems (the start point's, "
        f"less {matched.get('val_prompts')} held out for validation) in the same order per seed, seeds "
        f"{results['seeds']}. Held-out evaluation on at most {results.get('eval_prompts') or 'all'} test problems "
        "per test set.",
        "",
        f"**What was not.** Each method's learning rate is its best of the grid {[f'{x:g}' for x in grid]}{beyond} "
        f"by final validation {metric} (mean over grid seeds {matched.get('grid_seeds')}; "
        "ties: greedy accuracy, then the "
        "lower rate), on the validation split, never the test set"
        + (f"; fixed by --lr: {matched['fixed_lr']}" if matched.get("fixed_lr") else "") + ".",
    ]


def write_matched_report(results: dict, grid: dict, out: Path, command: str) -> Path:
    matched = results.get("matched", {})
    lines = ["# The step-matched comparison", "", f"Command: `{command}`", "", *protocol(results), ""]
    if matched.get("choice"):
        lines += ["## Learning rates chosen on validation", "",
                  f"Final validation sampled accuracy (mean ± standard error over the grid seeds; {len(grid['runs'])} "
                  "grid runs):", "", grid_table(matched["choice"]), ""]
    lines += ["## Held-out accuracy", "",
              "Final evaluation, mean ± standard error over seeds (sample std / sqrt(n)):", "",
              accuracy_table(results), "",
              "Each method minus GRPO on the same seed: mean difference (its standard error):", "",
              paired_table(results), ""]
    from arlopti_jax.experiments.sweep_report import plot_curves

    curves = plot_curves(results, out / "curves.png")
    lines += [f"![curves]({curves.name})", ""]
    table = quartile_table(results)
    if table.count("\n") > 1:
        lines += ["## Gradient norm per pi_old quartile during training", "",
                  f"Norm of the gradient of the method's own loss restricted to each pi_old quartile's tokens, on "
                  f"the step's whole rollout batch before its update (every {results.get('diagnostics_every')} RL "
                  "steps; mean over those steps per run, then mean ± standard error over seeds). Does a method "
                  "change how much the lowest quartile dominates? At pi = pi_old CISPO's weights are 1 and GSPO's "
                  "ratio is 1, so their norms differ from GRPO's only through the batches their training led to "
                  "and, for GSPO, its per-sequence mean.", "", table, ""]
    path = out / "matched.md"
    path.write_text("\n".join(lines))
    return path
