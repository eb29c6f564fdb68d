"""A config end to end (the embedded default unless ``--config``), this checkout against another,
interleaved: wall time, programs compiled, compile seconds, programs compiled after the first RL step,
and the greedy accuracy before and after training.

    python bench/default_run.py --before a0c05ac --rounds 1      # about 10 minutes on 2 CPU cores
    python bench/default_run.py --before 737254d --config configs/smollm2.py:cpu \
        --set model.path=$PWD/models/smollm2-135m --set data.train_files=$PWD/data/arith/train.parquet \
        --set data.test_files=$PWD/data/arith/test.parquet     # about an hour: each side about 30 minutes

Each run is ``python -m arlopti_jax.train`` with a fresh run folder (the default's start point
built in it, as a new user's) and a fresh, empty compilation cache, with ``JAX_LOG_COMPILES=1``;
``--config`` names the config as each checkout has it (its own file at that commit), and each ``--set
KEY=VALUE`` is passed to both sides as ``--config.KEY=VALUE`` (use absolute paths: each side runs in its
own checkout). The other commit runs from a git worktree of it (``--before``; ``none`` runs this checkout alone).
Programs are JAX's "Finished XLA compilation of" lines; "after step 1" counts those written after
the progress bar first shows a finished step. Rounds alternate which side goes first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parents[1]
FIRST_STEP = re.compile(r"rl:[^\r\n]*\| 1/\d+")


def worktree(commit: str, where: Path) -> Path:
    path = where / f"checkout_{commit}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)
    return path


def figures(log: str, run_dir: Path) -> dict:
    first = FIRST_STEP.search(log)
    compiled = common.compile_log_figures(log, after=first.end() if first else 0)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()] \
        if (run_dir / "eval.jsonl").is_file() else []
    names = [k for e in evals for k in e if k.endswith("/greedy_acc")]  # the average over test sets, or the one
    key = "eval/avg/greedy_acc" if "eval/avg/greedy_acc" in names else next(iter(names), None)
    greedy = [e.get(key) for e in evals if key in e]
    return {"programs": compiled["programs"], "compile_s": compiled["compile_s"],
            "after_step_1": len(compiled["late"]) if first else None, "late_names": sorted(set(compiled["late"])),
            "greedy_before": greedy[0] if greedy else None, "greedy_after": greedy[-1] if greedy else None}


def run_default(checkout: Path, work: Path, tag: str, config: str | None = None, sets: tuple = ()) -> dict:
    run_dir = work / tag / "run"
    cache = work / tag / "cache"
    env = {**os.environ, "JAX_LOG_COMPILES": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-m", "arlopti_jax.train", *([f"--config={config}"] if config else []),
           f"--config.run_dir={run_dir}", f"--config.compile_cache_dir={cache}",
           *(f"--config.{kv}" for kv in sets)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (work / tag).mkdir(parents=True, exist_ok=True)
    (work / tag / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"error: {tag} exited {proc.returncode}; its log: {work / tag / 'log.txt'}")
    return {"wall_s": wall, **figures(proc.stdout + proc.stderr, run_dir)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="none", help="the commit to compare with (a git worktree of it), or none")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--config", help="the config each side runs, from its own checkout (default: the embedded one)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for both sides (repeatable), e.g. model.path=/abs/models/smollm2-135m")
    ap.add_argument("--work", help="folder for the runs (default: a new one in /tmp)")
    ap.add_argument("--json", help="also write every run's figures here")
    args = ap.parse_args(argv)
    bad = [kv for kv in args.set if "=" not in kv]
    if bad:
        ap.error(f"--set {bad[0]}: expected KEY=VALUE")
    work = Path(args.work or tempfile.mkdtemp(prefix="default_run_")).absolute()
    sides = {"after": ROOT}
    if args.before != "none":
        sides["before"] = worktree(args.before, work)
    results = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            fig = run_default(sides[side], work, f"{side}_{r}", args.config, tuple(args.set))
            results[side].append(fig)
            print(f"round {r + 1} {side}: {json.dumps(fig)}", flush=True)
    print("\n| side | wall s | programs | compile s | after step 1 | greedy before -> after |")
    print("|---|---|---|---|---|---|")
    for side, figs in results.items():
        for f in figs:
            greedy = f"{f['greedy_before']:.3f} -> {f['greedy_after']:.3f}" if f["greedy_after"] is not None else "-"
            print(f"| {side} | {f['wall_s']:.0f} | {f['programs']} | {f['compile_s']:.1f} | {f['after_step_1']} | "
                  f"{greedy} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
