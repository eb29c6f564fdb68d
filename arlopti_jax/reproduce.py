"""The paper's comparison at small scale, in one command: five variants x several seeds.

    python -m arlopti_jax.reproduce                       # the full sweep (see docs/reproduction.md)
    python -m arlopti_jax.reproduce --quick               # a smoke test of the whole pipeline (minutes)
    python -m arlopti_jax.reproduce --out runs/repro --seeds 0,1,2 --variants grpo,grpo_ar_lopti

Every run trains the embedded default's start point (``start_point.py``, built once in
``OUT/start_point``) on the same data with the same budget (``default_config.py``, steps set
by ``--steps``), varying only the method and the seed (the sampling seed and the data order):

    grpo            GRPO
    grpo_ar         GRPO + AR (alpha 0.2)
    grpo_lopti      GRPO + Lopti (eta 0.4)
    grpo_ar_lopti   GRPO + AR + Lopti (alpha 0.3, eta 0.5)
    tr_grpo         TR-GRPO (token weights of ``algos/token_weights.py``)

Outputs in OUT: ``results.json`` (every run's evaluations and timings), ``reproduction.md``
(the paper's table: held-out greedy accuracy per people count and the average, mean ± std over
seeds; the mechanism figures), ``curves.png`` (evaluation accuracy and training reward per
variant), ``mechanism.png`` (gradient norm per pi_old quartile during training, and the
isolation experiment). Each run lives in ``OUT/runs/<variant>/seed<k>`` with its own
checkpoints: a killed sweep, started again with the same command, skips finished runs and
resumes the interrupted one from its last checkpoint. One progress bar covers the sweep.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("arlopti_jax.reproduce")

VARIANTS = {  # name: (label, weighting, ar alpha, lopti eta)
    "grpo": ("GRPO", "none", 0.0, 0.0),
    "grpo_ar": ("GRPO + AR", "ar", 0.2, 0.0),
    "grpo_lopti": ("GRPO + Lopti", "none", 0.0, 0.4),
    "grpo_ar_lopti": ("GRPO + AR + Lopti", "ar", 0.3, 0.5),
    "tr_grpo": ("TR-GRPO", "tr", 0.0, 0.0),
}
QUICK = dict(steps=1, seeds="0", eval_prompts=8, sizes=dict(sft_rows_per_size=64, sft_steps=8,
                                                             train_rows_per_size=64, test_rows_per_size=8))


def run_config(base, variant: str, seed: int, run_dir: Path, start_point: Path, steps: int, eval_prompts: int,
               diagnostics_every: int, eval_before: bool):
    """The default config with one variant's method, a seed, the shared start point and the budget."""
    _, weighting, alpha, eta = VARIANTS[variant]
    c = base.copy_and_resolve_references()
    c.run_dir = str(run_dir)
    c.seed = seed
    c.data.shuffle_seed = seed
    c.model.path = str(start_point / "model")
    c.data.train_files = str(start_point / "data" / "train.parquet")
    c.data.test_files = ",".join(str(p) for p in sorted((start_point / "data").glob("test_*.parquet")))
    c.algo.weighting, c.algo.ar_alpha, c.algo.lopti_eta = weighting, alpha, eta
    c.train.max_steps = steps
    c.train.eval_every = max(1, min(c.train.eval_every, steps))
    c.train.save_every = max(1, min(c.train.save_every, steps))
    c.train.export_at_end = False
    c.train.eval_before = eval_before
    from arlopti_jax.run_setup import optimizer_steps_per_rl_step

    total = steps * optimizer_steps_per_rl_step(c)  # a short budget (--quick) keeps a warm-up shorter than it
    c.optim.warmup_steps = min(c.optim.warmup_steps, total // 2)
    if eval_prompts > 0:
        c.train.eval_max_prompts = eval_prompts
    if diagnostics_every and "diagnostics_every" in c.train:
        c.train.diagnostics_every = diagnostics_every
    return c


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
    grpo = mech.get("grpo", {}).get("isolation") or next((m["isolation"] for m in mech.values() if m["isolation"]), None)
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


class Sweep:
    """Runs, records and resumes the sweep in ``out``."""

    def __init__(self, out: Path, variants: list[str], seeds: list[int], steps: int, eval_prompts: int,
                 sizes: dict | None, diagnostics_every: int):
        self.out, self.variants, self.seeds, self.steps = out, variants, seeds, steps
        self.eval_prompts, self.sizes, self.diagnostics_every = eval_prompts, sizes, diagnostics_every
        self.results_path = out / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.is_file() else {"runs": {}}
        self.results.update(steps=steps, variants=variants, seeds=seeds, eval_prompts=eval_prompts,
                            diagnostics_every=diagnostics_every)

    def save(self) -> None:
        tmp = self.results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1))
        tmp.replace(self.results_path)

    def run(self) -> dict:
        from tqdm.auto import tqdm

        from arlopti_jax.config import validate
        from arlopti_jax.default_config import get_config
        from arlopti_jax.start_point import ensure_start_point
        from arlopti_jax.trainer import train

        started = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        import jax

        if not jax.config.jax_compilation_cache_dir:  # runs 2..N reuse the first run's compiled programs
            jax.config.update("jax_compilation_cache_dir", str(self.out / "jax_cache"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        t0 = time.time()
        start_point = ensure_start_point(self.out / "start_point", seed=0, sizes=self.sizes)
        self.results.setdefault("start_point_s", time.time() - t0)
        base = get_config()
        todo = [(v, s) for v in self.variants for s in self.seeds]
        bar = tqdm(total=len(todo) * self.steps, desc="sweep", unit="step", position=0)
        for variant, seed in todo:
            name = f"{variant}/seed{seed}"
            record = self.results["runs"].get(name)
            if record and record.get("finished"):
                bar.update(self.steps)
                continue
            bar.set_postfix_str(name)
            run_dir = self.out / "runs" / variant / f"seed{seed}"
            eval_before = "start_eval" not in self.results  # the start point is evaluated once
            config = run_config(base, variant, seed, run_dir, start_point, self.steps, self.eval_prompts,
                                self.diagnostics_every, eval_before)
            validate(config)
            t = time.time()
            summary = train(config)
            metrics = read_jsonl(run_dir / "metrics.jsonl")
            evals = read_jsonl(run_dir / "eval.jsonl")
            if evals and evals[0]["step"] == 0:
                self.results["start_eval"] = evals[0]
            self.results["runs"][name] = {
                "variant": variant, "seed": seed, "finished": not summary["preempted"],
                "seconds": time.time() - t + (record or {}).get("seconds", 0.0),
                "evals": [e for e in evals if e["step"] > 0],
                "rewards": [m["reward/mean"] for m in metrics if "reward/mean" in m],
                "quartile_grad_norms": [[m["step"]] + [m[f"quartile/q{i}_grad_norm"] for i in range(1, 5)]
                                        for m in metrics if "quartile/q1_grad_norm" in m],
                "isolation": next(([[m[f"isolation/{c}_q{i}"] for i in range(1, 5)] for c in ("low", "high")]
                                   for m in metrics if "isolation/low_q1" in m), None),
            }
            self.save()
            if summary["preempted"]:
                raise SystemExit(f"{name} was stopped; run the same command again to resume")
            bar.update(self.steps)
        bar.close()
        self.results["sweep_s"] = self.results.get("sweep_s", 0.0) + time.time() - started
        self.save()
        return self.results


def write_report(results: dict, out: Path, command: str) -> Path:
    curves = plot_curves(results, out / "curves.png")
    seconds = [r["seconds"] for r in results["runs"].values()]
    lines = [
        "# Reproduction at small scale", "",
        f"Command: `{command}`", "",
        f"{len(results['runs'])} runs ({len(results['variants'])} variants x {len(results['seeds'])} seeds), "
        f"{results['steps']} RL steps each, on the embedded default's start point. Start point built in "
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
                  "only the highest-quartile tokens, and the change of every quartile's mean probability.", "",
                  mechanism_table(results), "", f"![mechanism]({figure.name})", ""]
    path = out / "reproduction.md"
    path.write_text("\n".join(lines))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arlopti_jax.reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/reproduce", help="output folder (default: %(default)s)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=0, help="RL steps per run (default: the default config's)")
    ap.add_argument("--eval-prompts", type=int, default=0,
                    help="test prompts per test set (default: the default config's)")
    ap.add_argument("--diagnostics-every", type=int, default=5,
                    help="log the gradient norm per pi_old quartile every this many steps (0 = off)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: a tiny start point, 1 seed, 1 step per variant, 8 test prompts")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}: choose from {list(VARIANTS)}")
    from arlopti_jax.default_config import get_config

    steps = args.steps or (QUICK["steps"] if args.quick else get_config().train.max_steps)
    seeds = [int(s) for s in (QUICK["seeds"] if args.quick and args.seeds == "0,1,2" else args.seeds).split(",")]
    eval_prompts = args.eval_prompts or (QUICK["eval_prompts"] if args.quick else 0)
    out = Path(args.out)
    sweep = Sweep(out, args.variants.split(","), seeds, steps, eval_prompts, QUICK["sizes"] if args.quick else None,
                  args.diagnostics_every)
    results = sweep.run()
    command = "python -m arlopti_jax.reproduce " + " ".join(sys.argv[1:] if argv is None else argv)
    report = write_report(results, out, command.strip())
    print(f"\n{summary_table(results)}\n\n{mechanism_table(results)}\n\nwrote {report}, {out / 'curves.png'} "
          f"and {out / 'mechanism.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
