"""The paper's comparison at small scale, in one command: five variants x several seeds.

    python -m arlopti_jax.reproduce                       # the full sweep (see docs/reproduction.md)
    python -m arlopti_jax.reproduce --quick               # a smoke test of the whole pipeline (minutes)
    python -m arlopti_jax.reproduce --out runs/repro --seeds 0,1,2 --variants grpo,grpo_ar_lopti
    python -m arlopti_jax.reproduce --scale gpu --jobs 5  # on one GPU: 3-5 people, a 24M model, 5 runs at once

Every run trains the embedded default's start point (``start_point.py``, built once in
``OUT/start_point``) on the same data with the same budget (``default_config.py``, steps set
by ``--steps``), varying only the method and the seed (the sampling seed and the data order):

    grpo            GRPO
    grpo_ar         GRPO + AR (alpha 0.2)
    grpo_lopti      GRPO + Lopti (eta 0.4)
    grpo_ar_lopti   GRPO + AR + Lopti (alpha 0.3, eta 0.5)
    tr_grpo         TR-GRPO (token weights of ``algos/token_weights.py``)

``--scale`` picks the start point (``start_point.SCALES``) and the run settings that go with it
(``SCALE_RUNS``): ``cpu`` (the default) is the embedded default's (2 and 3 people, a 0.85M-parameter
model, 30 RL steps); ``gpu`` is for one accelerator (3, 4 and 5 people, a 24M-parameter model
computing in bfloat16, longer prompts and responses, a larger batch, more steps). A start point
folder built at another scale is refused, naming both.

``--jobs N`` runs the sweep's runs in N worker processes at once (a small model leaves a GPU
mostly idle, so several runs share it): the start point is built first, by one process; then
each worker takes the next run no other has taken (every variant's first seed first), writes
its records to ``OUT/workers/worker<K>.json`` and its output to ``OUT/logs/worker<K>.log``, and
the main process merges the records into ``results.json`` and writes the report once. Each
worker gets 0.9 / N of the GPU's memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless set; no
effect on CPU). A failed worker is reported with the runs it had and its log. SIGTERM (as
``timeout`` sends) or Ctrl-C stops the workers as the trainer stops (a checkpoint, then exit),
and the report covers the runs that finished.

Outputs in OUT: ``results.json`` (every run's evaluations and timings), ``reproduction.md``
(the paper's table: held-out greedy accuracy per people count and the average, mean ± std over
seeds; the mechanism figures), ``curves.png`` (evaluation accuracy and training reward per
variant), ``mechanism.png`` (gradient norm per pi_old quartile during training, and the
isolation experiment). Each run lives in ``OUT/runs/<variant>/seed<k>`` with its own
checkpoints: a killed sweep, started again with the same command, skips finished runs and
resumes the interrupted ones from their last checkpoint. One progress bar covers the sweep.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
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
# Per start point scale: RL steps per run (None: the default config's) and the default config's
# fields that change; the compute dtype is the start point's (start_point.SCALES). gpu: 5-person
# prompts are at most 178 tokens and the longest SFT target (a 5-person answer block) 43 tokens
# + EOS with start_point's tokenizer (over the 48k SFT and 300 test rows); 16 prompts x 8
# responses per step, 2 optimizer steps of 64 (4 with Lopti); a lower learning rate for the 30x
# larger model; layers as a loop and the dense sampler (one decode program per batch shape
# instead of one per phase and row count: on CPU with these settings, 3 decode programs instead
# of 12 decode and 6 resize programs, and a first step and evaluation compiled in 24 s less),
# since compiles, not the few sampled tokens, are what a short sweep on an accelerator spends
# its time on.
SCALE_RUNS = {
    "cpu": dict(steps=None, config={}),
    "gpu": dict(steps=60, config={
        "model.unroll_layers": False, "rollout.length_aware": False, "data.max_prompt_length": 256,
        "rollout.max_response_length": 64, "train.batch_prompts": 16, "train.mini_batch": 64,
        "train.micro_batch": 64, "optim.lr": 2e-4, "optim.warmup_steps": 8, "train.eval_every": 20,
        "train.save_every": 20, "train.keep_checkpoints": 2, "train.samples_every": 20}),
}
# --quick: a tiny start point at any scale (the cpu scale's model, float32, few rows and SFT steps)
QUICK = dict(steps=1, seeds="0", eval_prompts=8, sizes=dict(
    sft_rows_per_size=64, sft_steps=8, train_rows_per_size=64, test_rows_per_size=8, hidden_size=128,
    intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, dtype="float32"))


def run_config(base, variant: str, seed: int, run_dir: Path, start_point: Path, steps: int, eval_prompts: int,
               diagnostics_every: int, eval_before: bool, scale: str = "cpu", dtype: str = "float32"):
    """The default config with the scale's changes, one variant's method, a seed, the shared start
    point (computing in ``dtype``, as its warm start did) and the budget."""
    _, weighting, alpha, eta = VARIANTS[variant]
    c = base.copy_and_resolve_references()
    for field, value in SCALE_RUNS[scale]["config"].items():
        section, name = field.split(".")
        c[section][name] = value
    c.model.dtype = dtype
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


def run_names(variants: list[str], seeds: list[int]) -> list[str]:
    return [f"{v}/seed{s}" for v in variants for s in seeds]


def claim(out: Path, name: str, worker: int) -> bool:
    """Take ``name`` (a run, or the start point's evaluation) for ``worker``; False if another
    worker of this invocation took it first."""
    path = out / "workers" / "claims" / name.replace("/", ".")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(worker).encode())
    os.close(fd)
    return True


def worker_records(out: Path, worker: int) -> Path:
    return out / "workers" / f"worker{worker}.json"


class Sweep:
    """Runs, records and resumes the sweep in ``out``. As worker ``worker`` of a --jobs sweep it runs
    the runs it claims, reads ``out/results.json`` but writes only its own records file."""

    def __init__(self, out: Path, variants: list[str], seeds: list[int], steps: int, eval_prompts: int,
                 sizes: dict | None, diagnostics_every: int, scale: str = "cpu", worker: int | None = None):
        self.out, self.variants, self.seeds, self.steps = out, variants, seeds, steps
        self.eval_prompts, self.sizes, self.diagnostics_every = eval_prompts, sizes, diagnostics_every
        self.scale, self.worker = scale, worker
        self.results_path = out / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.is_file() else {"runs": {}}
        if self.results["runs"] and self.results.get("scale", "cpu") != scale:
            raise SystemExit(f"{self.results_path} holds runs of scale {self.results.get('scale', 'cpu')!r}, "
                             f"not {scale!r}: use another output folder")
        self.results.update(steps=steps, variants=variants, seeds=seeds, eval_prompts=eval_prompts,
                            diagnostics_every=diagnostics_every, scale=scale)
        self.problems: list[str] = []  # of a --jobs sweep: a stop or failed workers, after the report
        # what this process writes: the whole results, or (a worker) its own records
        self.written = self.results if worker is None else {"runs": {}}
        if worker is not None:
            self.results_path = worker_records(out, worker)

    def save(self) -> None:
        tmp = self.results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.written, indent=1))
        tmp.replace(self.results_path)

    def start_point(self) -> Path:
        from arlopti_jax.start_point import ensure_start_point

        t0 = time.time()
        folder = ensure_start_point(self.out / "start_point", seed=0, sizes=self.sizes, scale=self.scale)
        self.results.setdefault("start_point_s", time.time() - t0)
        return folder

    def run(self) -> dict:
        from tqdm.auto import tqdm

        from arlopti_jax.config import validate
        from arlopti_jax.default_config import get_config
        from arlopti_jax.start_point import scale_sizes
        from arlopti_jax.trainer import train

        started = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        import jax

        if not jax.config.jax_compilation_cache_dir:  # runs 2..N reuse the first run's compiled programs
            jax.config.update("jax_compilation_cache_dir", str(self.out / "jax_cache"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        start_point = self.start_point()
        self.results["model_params"] = model_params(start_point)
        dtype = scale_sizes(self.scale, self.sizes)["dtype"]
        base = get_config()
        todo = run_names(self.variants, self.seeds)
        if self.worker is not None:  # every variant's seed 0 first: a stopped --jobs sweep leaves whole seeds
            todo = sorted(todo, key=lambda name: int(name.split("/seed")[1]))  # stable: variants in order
        bar = tqdm(total=len(todo) * self.steps, desc="sweep", unit="step", position=0)
        for name in todo:
            variant, seed = name.split("/")[0], int(name.split("/seed")[1])
            record = self.results["runs"].get(name)
            if record and record.get("finished"):
                bar.update(self.steps)
                continue
            if self.worker is not None and not claim(self.out, name, self.worker):
                continue
            bar.set_postfix_str(name)
            run_dir = self.out / "runs" / variant / f"seed{seed}"
            # the start point is evaluated once (in a --jobs sweep, by the worker that claims it)
            eval_before = "start_eval" not in self.results and (
                self.worker is None or claim(self.out, "start_eval", self.worker))
            config = run_config(base, variant, seed, run_dir, start_point, self.steps, self.eval_prompts,
                                self.diagnostics_every, eval_before, self.scale, dtype)
            validate(config)
            t = time.time()
            summary = train(config)
            metrics = read_jsonl(run_dir / "metrics.jsonl")
            evals = read_jsonl(run_dir / "eval.jsonl")
            if evals and evals[0]["step"] == 0:
                self.results["start_eval"] = self.written["start_eval"] = evals[0]
            self.results["runs"][name] = self.written["runs"][name] = {
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
        if self.worker is None:
            self.results["sweep_s"] = self.results.get("sweep_s", 0.0) + time.time() - started
        self.save()
        return self.results

    def run_jobs(self, jobs: int, worker_args: list[str]) -> dict:
        """The sweep in ``jobs`` worker processes (``python -m arlopti_jax.reproduce WORKER_ARGS
        --worker K``); this process builds nothing on a device, polls the runs' metrics for the one
        progress bar, and merges the workers' records into results.json. SIGTERM or SIGINT stops the
        workers as the trainer stops (a checkpoint, then exit); failed workers and a stop are left
        in ``self.problems`` for after the report of the finished runs."""
        from tqdm.auto import tqdm

        from arlopti_jax.start_point import check_start_point

        started = time.time()
        command = [sys.executable, "-m", "arlopti_jax.reproduce", *worker_args]
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.merge_workers()  # records of an interrupted --jobs sweep
        folder = self.out / "start_point"
        if not check_start_point(folder, self.scale, 0, self.sizes):  # built by one process, on the whole device
            t0 = time.time()
            proc = subprocess.run(command + ["--start-point-only"])
            if proc.returncode != 0:
                raise SystemExit(f"building the start point in {folder} failed (exit code {proc.returncode}); "
                                 "its output is above")
            self.results.setdefault("start_point_s", time.time() - t0)
        self.results["model_params"] = model_params(folder)
        shutil.rmtree(self.out / "workers" / "claims", ignore_errors=True)
        (self.out / "workers" / "claims").mkdir(parents=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / jobs:.3f}")  # GPUs only; CPU ignores it
        todo = run_names(self.variants, self.seeds)
        workers, stopped = [], []

        def stop(signum, frame):  # stop the workers as the trainer stops (checkpoint, then exit), then report
            stopped.append(signal.Signals(signum).name)
            for sig, handler in previous.items():  # a second signal stops at once
                signal.signal(sig, handler)
            for _, _, p in workers:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for k in range(jobs):
                log_path = self.out / "logs" / f"worker{k}.log"
                with open(log_path, "w") as log_file:
                    workers.append((k, log_path, subprocess.Popen(command + ["--worker", str(k)], env=env,
                                                                  stdout=log_file, stderr=subprocess.STDOUT)))
            bar = tqdm(total=len(todo) * self.steps, desc=f"sweep ({jobs} jobs)", unit="step")
            while True:
                running = [p for _, _, p in workers if p.poll() is None]
                done = sum(self.steps_done(name) for name in todo)
                if done != bar.n:
                    bar.update(done - bar.n)
                if not running:
                    break
                time.sleep(2.0)
            bar.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for _, _, p in workers:  # this process stopped early: stop the workers too
                if p.poll() is None:
                    p.terminate()
                    p.wait()
        self.merge_workers()
        self.results["runs"] = {**{n: self.results["runs"][n] for n in todo if n in self.results["runs"]},
                                **self.results["runs"]}  # in the sweep's order
        self.results["sweep_s"] = self.results.get("sweep_s", 0.0) + time.time() - started
        self.save()
        finished = sum(bool(self.results["runs"].get(n, {}).get("finished")) for n in todo)
        if stopped:
            self.problems.append(f"stopped by {stopped[0]}: {finished} of {len(todo)} runs finished")
        else:
            claims = self.out / "workers" / "claims"
            for k, log_path, p in workers:
                if p.returncode != 0:
                    had = sorted(c.name.replace(".seed", "/seed") for c in claims.iterdir()
                                 if c.read_text() == str(k) and c.name != "start_eval")
                    self.problems.append(f"worker {k} failed (exit code {p.returncode}) with runs {had}: "
                                         f"see {log_path}")
        return self.results

    def steps_done(self, name: str) -> int:
        """RL steps a run has done: all if recorded finished, else the last step of its metrics."""
        record = self.results["runs"].get(name)
        if record and record.get("finished"):
            return self.steps
        variant, seed = name.split("/")
        path = self.out / "runs" / variant / seed / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        for line in reversed(lines):
            try:
                return min(self.steps, int(json.loads(line)["step"]))
            except (ValueError, KeyError):  # a line being written
                continue
        return 0

    def merge_workers(self) -> None:
        """Move the workers' records into results.json (a finished record is never replaced)."""
        parts = sorted((self.out / "workers").glob("worker*.json"))
        for path in parts:
            part = json.loads(path.read_text())
            for name, record in part["runs"].items():
                if not self.results["runs"].get(name, {}).get("finished"):
                    self.results["runs"][name] = record
            if "start_eval" in part:
                self.results.setdefault("start_eval", part["start_eval"])
        self.save()
        for path in parts:
            path.unlink()


def model_params(start_point: Path) -> int:
    from arlopti_jax.models import ModelConfig

    return ModelConfig.from_pretrained(start_point / "model").num_params()


def scale_line(results: dict) -> str:
    """The start point in words: its scale, people counts (from the test sets) and model size."""
    people = [c.split("_")[-1].removesuffix("ppl") for c in test_set_columns(results)]
    size = f", a {results['model_params'] / 1e6:.2f}M-parameter model" if results.get("model_params") else ""
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
                  "only the highest-quartile tokens, and the change of every quartile's mean probability.", "",
                  mechanism_table(results), "", f"![mechanism]({figure.name})", ""]
    path = out / "reproduction.md"
    path.write_text("\n".join(lines))
    return path


def quiet_progress_bars() -> None:
    """No progress bars in this process (a --jobs worker: the main process shows the sweep's);
    the trainer asks for its bar with an explicit ``disable``, which TQDM_DISABLE would not override."""
    import tqdm.auto

    class Quiet(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    tqdm.auto.tqdm = Quiet


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arlopti_jax.reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/reproduce", help="output folder (default: %(default)s)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: %(default)s)")
    ap.add_argument("--scale", default="cpu", choices=list(SCALE_RUNS),
                    help="start point and run settings: cpu (2-3 people, 0.85M model) or gpu (3-5 people, "
                         "24M model, bfloat16); default: %(default)s")
    ap.add_argument("--steps", type=int, default=0,
                    help="RL steps per run (default: the scale's: " + ", ".join(
                        f"{k} {v['steps'] or 'the default config'}" for k, v in SCALE_RUNS.items()) + ")")
    ap.add_argument("--eval-prompts", type=int, default=0,
                    help="test prompts per test set (default: the default config's)")
    ap.add_argument("--diagnostics-every", type=int, default=5,
                    help="log the gradient norm per pi_old quartile every this many steps (0 = off)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, each in its own worker process (default: %(default)s)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: a tiny start point (at any scale), 1 seed, 1 step per variant, "
                         "8 test prompts")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # a --jobs worker's index
    ap.add_argument("--start-point-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}: choose from {list(VARIANTS)}")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: must be >= 1")
    if args.worker is not None:
        quiet_progress_bars()
    from arlopti_jax.default_config import get_config

    steps = args.steps or (QUICK["steps"] if args.quick else SCALE_RUNS[args.scale]["steps"]
                           or get_config().train.max_steps)
    seeds = [int(s) for s in (QUICK["seeds"] if args.quick and args.seeds == "0,1,2" else args.seeds).split(",")]
    eval_prompts = args.eval_prompts or (QUICK["eval_prompts"] if args.quick else 0)
    out = Path(args.out)
    sweep = Sweep(out, args.variants.split(","), seeds, steps, eval_prompts, QUICK["sizes"] if args.quick else None,
                  args.diagnostics_every, args.scale, args.worker)
    from arlopti_jax.start_point import StartPointMismatch

    try:
        if args.start_point_only:
            sweep.start_point()
            return 0
        if args.worker is not None:
            sweep.run()
            return 0
        if args.jobs > 1:
            worker_args = ["--out", str(out), "--scale", args.scale, "--variants", args.variants,
                           "--seeds", ",".join(map(str, seeds)), "--steps", str(steps), "--eval-prompts",
                           str(eval_prompts), "--diagnostics-every", str(args.diagnostics_every)]
            results = sweep.run_jobs(args.jobs, worker_args + (["--quick"] if args.quick else []))
        else:
            results = sweep.run()
    except StartPointMismatch as err:
        raise SystemExit(f"error: {err}") from None
    if any(r.get("finished") for r in results["runs"].values()):
        command = "python -m arlopti_jax.reproduce " + " ".join(sys.argv[1:] if argv is None else argv)
        report = write_report(results, out, command.strip())
        figures = f"{out / 'curves.png'}" + (f" and {out / 'mechanism.png'}" if mechanism(results) else "")
        print(f"\n{summary_table(results)}\n\n{mechanism_table(results)}\n\nwrote {report}, {figures}")
    if sweep.problems:
        raise SystemExit("\n".join(sweep.problems) + "\nrun the same command again to resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
