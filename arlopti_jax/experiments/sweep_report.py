"""The reproduction's report from a sweep's ``results.json`` records: the paper's table
(held-out greedy accuracy per test set, mean ± std over seeds), the training curves, and the
mechanism (gradient norm per pi_old quartile, the isolation experiment) as tables and figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from arlopti_jax.experiments.sweep import PRETRAINED, VARIANTS, run_names


def test_set_columns(results: dict) -> list[str]:
    """Test-set names of the evaluations (e.g. test_2ppl, test_3ppl), in people order."""
    names = set()
    for run in results["runs"].values():
        for record in run["evals"]:
            names |= {k.split("/")[1] for k in record if k.startswith("eval/") and k.endswith("/greedy_acc")}
    names.discard("avg")
    return sorted(names)


def summary_table(results: dict) -> str:
    """The paper's layout: rows = the start point and each variant; columns = the test sets and
    their average; cells = final held-out greedy accuracy, mean ± std over seeds."""
    cols = test_set_columns(results)
    head = "| method | " + " | ".join(cols) + " | avg |\n|---" * 1 + "|---" * (len(cols) + 1) + "|"
    lines = [head]
    runs = results["runs"]
    start = results.get("start_eval")
    if start:
        cells = [f"{start[f'eval/{c}/greedy_acc']:.3f}" for c in cols + ["avg"]]
        lines.append("| start point (before RL) | " + " | ".join(cells) + " |")
    for variant, (label, *_) in VARIANTS.items():
        finals = [r["evals"][-1] for k, r in runs.items() if r["variant"] == variant and r.get("finished")]
        if not finals:
            continue
        cells = []
        for c in cols + ["avg"]:
            values = [e[f"eval/{c}/greedy_acc"] for e in finals]
            cells.append(f"{np.mean(values):.3f} ± {np.std(values):.3f}")
        lines.append(f"| + {label} (n={len(finals)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, (label, *_) in VARIANTS.items():
        runs = [r for r in results["runs"].values() if r["variant"] == variant and r["evals"]]
        if not runs:
            continue
        start = [results["start_eval"]] if results.get("start_eval") else []
        evals = [start + [e for e in r["evals"] if e["step"] > 0] for r in runs]
        steps = sorted({e["step"] for ev in evals for e in ev})
        mean = [np.mean([e["eval/avg/greedy_acc"] for ev in evals for e in ev if e["step"] == s]) for s in steps]
        axes[0].plot(steps, mean, marker="o", label=label)
        rewards = [np.asarray(r["rewards"], float) for r in runs if r["rewards"]]
        if rewards:
            width = min(len(x) for x in rewards)
            curve = np.mean([x[:width] for x in rewards], axis=0)
            k = max(1, width // 10)
            smooth = np.convolve(curve, np.ones(k) / k, mode="valid")
            axes[1].plot(np.arange(len(smooth)) + k, smooth, label=label)
    axes[0].set(title="held-out greedy accuracy (mean over test sets and seeds)", xlabel="RL step")
    axes[1].set(title="training reward (mean over seeds, moving average)", xlabel="RL step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def mechanism(results: dict) -> dict:
    """The paper's Figure 1 from the sweep's runs: per variant the mean gradient norm of each
    pi_old quartile (over logged steps and seeds), and the isolation experiment (first batch of
    each run, mean over runs of the variant): the change of each quartile's mean probability
    after a step on only the lowest ('low') or only the highest ('high') quartile's tokens."""
    out = {}
    for variant in VARIANTS:
        runs = [r for r in results["runs"].values() if r["variant"] == variant]
        norms = [row[1:] for r in runs for row in r.get("quartile_grad_norms", [])]
        isolation = [r["isolation"] for r in runs if r.get("isolation")]
        if norms or isolation:
            out[variant] = {"grad_norms": np.mean(norms, axis=0).tolist() if norms else None,
                            "isolation": np.mean(isolation, axis=0).tolist() if isolation else None}
    return out


def plot_mechanism(results: dict, out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mech = mechanism(results)
    if not mech:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    quartiles = np.arange(4)
    shown = [v for v in VARIANTS if v in mech and mech[v]["grad_norms"]]
    width = 0.8 / max(len(shown), 1)
    for j, variant in enumerate(shown):
        axes[0].bar(quartiles + j * width, mech[variant]["grad_norms"], width, label=VARIANTS[variant][0])
    axes[0].set(title="gradient norm per pi_old quartile (mean over steps and seeds)",
                xticks=quartiles + 0.4 - width / 2, xticklabels=["q1 (lowest)", "q2", "q3", "q4 (highest)"])
    grpo = (mech.get("grpo", {}).get("isolation")
            or next((m["isolation"] for m in mech.values() if m["isolation"]), None))
    if grpo is not None:
        for i, case in enumerate(("update q1 only", "update q4 only")):
            axes[1].bar(quartiles + i * 0.4, grpo[i], 0.4, label=case)
        axes[1].axhline(0, color="black", lw=0.6)
        axes[1].set(title="isolation (GRPO, first batch): change of mean pi per quartile",
                    xticks=quartiles + 0.2, xticklabels=["q1 (lowest)", "q2", "q3", "q4 (highest)"])
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "mechanism.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def mechanism_table(results: dict) -> str:
    mech = mechanism(results)
    fmt = lambda xs: " | ".join(f"{x:.3g}" for x in xs) if xs else " | ".join(["-"] * 4)
    lines = ["| variant | measure | q1 (lowest pi_old) | q2 | q3 | q4 (highest) |", "|---|---|---|---|---|---|"]
    for variant, m in mech.items():
        label = VARIANTS[variant][0]
        lines.append(f"| {label} | gradient norm | {fmt(m['grad_norms'])} |")
        if m["isolation"]:
            lines.append(f"| {label} | change of mean pi, update q1 only | {fmt(m['isolation'][0])} |")
            lines.append(f"| {label} | change of mean pi, update q4 only | {fmt(m['isolation'][1])} |")
    return "\n".join(lines)


def scale_line(results: dict) -> str:
    """The start point in words: its scale, people counts (from the test sets) and model size."""
    people = [c.split("_")[-1].removesuffix("ppl") for c in test_set_columns(results)]
    size = f", a {results['model_params'] / 1e6:.2f}M-parameter model" if results.get("model_params") else ""
    if results.get("scale") in PRETRAINED:
        return f"pretrained model of scale {results['scale']!r} ({PRETRAINED[results['scale']]['config']}{size})"
    return (f"embedded start point of scale {results.get('scale', 'cpu')!r} "
            f"({' / '.join(people) or '?'} people{size})")


def write_report(results: dict, out: Path, command: str) -> Path:
    curves = plot_curves(results, out / "curves.png")
    seconds = [r["seconds"] for r in results["runs"].values()]
    names = run_names(results["variants"], results["seeds"])
    finished = sum(bool(results["runs"].get(n, {}).get("finished")) for n in names)
    runs = f"{len(names)} runs" if finished == len(names) else f"{finished} of {len(names)} runs finished"
    lines = [
        "# Reproduction at small scale", "",
        f"Command: `{command}`", "",
        f"{runs} ({len(results['variants'])} variants x {len(results['seeds'])} seeds), "
        f"{results['steps']} RL steps each, on the {scale_line(results)}. Start point built in "
        f"{results.get('start_point_s', 0) / 60:.1f} min; runs took {np.mean(seconds) / 60:.1f} min on average; "
        f"the sweep took {results.get('sweep_s', 0) / 60:.1f} min in all.", "",
        "Held-out greedy accuracy at the end of training (mean ± std over seeds):", "",
        summary_table(results), "",
        f"![curves]({curves.name})", "",
    ]
    figure = plot_mechanism(results, out)
    if figure is not None:
        lines += ["## The mechanism (the paper's Figure 1)", "",
                  "Gradient norm of the loss restricted to each pi_old quartile's tokens (logged every "
                  f"{results.get('diagnostics_every', '?')} steps), and the isolation experiment: from the start "
                  "point and each run's first batch, one optimizer step on only the lowest-quartile tokens, or "
                  "only the highest-quartile tokens, and the change of every quartile's mean probability. "
                  "That step is a fresh AdamW one (about lr x sign(gradient) for every weight), so it understates "
                  "the effect: `analysis/mechanism.py` measures it with SGD (docs/results/real_model.md, "
                  "section 4).", "",
                  mechanism_table(results), "", f"![mechanism]({figure.name})", ""]
    path = out / "reproduction.md"
    path.write_text("\n".join(lines))
    return path
