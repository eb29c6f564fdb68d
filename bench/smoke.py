"""The first thing to run when a GPU is lent (``bash bench/gpu.sh smoke``: one H100 or H200, no
network, at most 8 minutes by its runs' limits, 490 s in all): does the README's
default run, how much of its time is compiling, and what does a realistic RL step cost?

    python bench/smoke.py --logs gpu_logs                     # on the GPU (gpu.sh passes its log folder)
    JAX_PLATFORMS=cpu python bench/smoke.py --quick --logs /tmp/smoke   # this script's own check, on a CPU

Three runs, one after the other, each in its own process group with ``JAX_LOG_COMPILES=1`` and its
own time limit (a run over it is stopped, and its row says so):

  default, cold   ``python -m arlopti_jax.train`` (the embedded default, this machine's numerics) with a
                  fresh, empty ``--config.compile_cache_dir``: it builds its start point, then trains
  default, warm   the same with a fresh ``run_dir`` beside the first (its start point is reused) and the
                  same cache: what a second run of the default costs
  realistic 1.5B  ``bench/realistic.py``'s RL step at 1.5B in bfloat16 (8 prompts x 8 responses, prompts
                  of 235-344 tokens, up to 1,024 generated), one warm-up step and one timed

Per run, one row of ONE table, printed at the end and written to ``<logs>/smoke.md``: wall seconds
(the process, end to end), programs (JAX's "Finished XLA compilation of" log lines: a program
compiled, or loaded from the persistent cache, which also logs "Persistent compilation cache hit":
the hits column), compile seconds (the sum of those lines' seconds: tracing and lowering not
included; programs compiled at once on several threads each count, so it can exceed the wall), the
programs the trainer counted after its first step (its "compiled: ..." summary line), and
the steady step: for the default, the median over the steps after the first of the step's phases in
``metrics.jsonl`` (every ``time/*`` but the evaluation's); for realistic.py its timed step (its
worker keeps JAX's log to itself: its own count of programs and seconds). Each run's whole output
is in ``<logs>/smoke_<run>.log``.

``--quick`` (a CPU check of this script): the default for 3 steps with small evaluations, on a
small start point built first (the default's own takes minutes on a CPU), and realistic.py on its
``bench`` shape with 32-token prompts and responses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parents[1]
REALISTIC = ["--before", "none", "--skip-tiny", "--rounds", "1", "--steps", "1"]
REALISTIC_1_5B = ["--shape", "1.5b", "--dtype", "bfloat16", "--prompts", "8", "--n", "8", "--prompt-min", "235",
                  "--prompt-len", "344", "--gen-len", "1024", "--mini-batch", "32", "--micro", "8"]
REALISTIC_QUICK = ["--shape", "bench", "--prompts", "2", "--n", "4", "--prompt-len", "32", "--gen-len", "32",
                   "--mini-batch", "8", "--micro", "4"]
# the default for 3 steps: evaluations before and after on 4 prompts per test set, no checkpoint in between
TRAIN_QUICK = ["--config.train.max_steps=3", "--config.train.eval_every=100", "--config.train.eval_max_prompts=4",
               "--config.train.save_every=100"]
QUICK_START_POINT = dict(sft_steps=3, sft_rows_per_size=24, train_rows_per_size=40, test_rows_per_size=6)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--logs", default=os.environ.get("OUT", "gpu_logs"),
                    help="folder for the table (smoke.md) and each run's log (default: $OUT, else gpu_logs)")
    ap.add_argument("--work", help="folder for the runs and the compilation cache (default: a new one in /tmp)")
    ap.add_argument("--quick", action="store_true", help="a CPU check of this script: 3 steps, small shapes")
    ap.add_argument("--limits", default="180,90,220",
                    help="seconds allowed to the cold default, the warm default and realistic.py (default %(default)s: "
                         "490 in all, inside gpu.sh's 520; the cold default's target is 3 minutes)")
    ap.add_argument("--runs", default="cold,warm,realistic",
                    help="which of the three to run, comma-separated (default %(default)s)")
    ap.add_argument("--xla-flags", default="",
                    help="appended to XLA_FLAGS for every run, e.g. --xla_gpu_autotune_level=0 (a row per setting "
                         "measures XLA:GPU's autotuning against its compile seconds)")
    args = ap.parse_args(argv)
    try:
        args.limits = [float(x) for x in args.limits.split(",")]
        assert len(args.limits) == 3 and min(args.limits) > 0
    except (ValueError, AssertionError):
        ap.error(f"--limits {args.limits!r}: three positive seconds, e.g. 180,90,220")
    args.runs = args.runs.split(",")
    if not args.runs or set(args.runs) - {"cold", "warm", "realistic"}:
        ap.error(f"--runs {','.join(args.runs)!r}: a comma-separated subset of cold,warm,realistic")
    return args


def run(cmd: list[str], log: Path, limit: float, env: dict) -> tuple[float, str]:
    """Run ``cmd`` (its own process group, output to ``log``) for at most ``limit`` seconds;
    (wall seconds, "exit N" or "timeout")."""
    print(f"smoke: {' '.join(cmd)}  (limit {limit:.0f} s, log {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            status = f"exit {proc.wait(timeout=limit)}"
        except subprocess.TimeoutExpired:
            status = "timeout"
            os.killpg(proc.pid, signal.SIGTERM)  # the trainer saves a checkpoint and stops
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.perf_counter() - start
    print(f"smoke: {status} after {wall:.1f} s", flush=True)
    return wall, status


def steady_step(metrics: Path) -> float | None:
    """Median over the RL steps after the first of the step's phases (``time/*`` of metrics.jsonl but
    the evaluation's, which lands in the step after it), or None with fewer than two steps."""
    if not metrics.is_file():
        return None
    steps = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "time/update" in record:  # a step's record (evaluations write their own)
            steps[record["step"]] = sum(v for k, v in record.items() if k.startswith("time/")
                                        and k not in ("time/eval", "time/update_new_programs"))
    later = [t for s, t in sorted(steps.items())[1:]]
    return statistics.median(later) if later else None


def realistic_figures(text: str) -> dict:
    """realistic.py's timed step and its worker's own compile count (its log has no JAX lines)."""
    step = re.search(r"round 1 after: step ([0-9.]+) ?s", text)
    compiled = re.search(r"round 1 after: (\d+) programs compiled in ([0-9.]+) s", text)
    return {"step": float(step.group(1)) if step else None,
            "programs": int(compiled.group(1)) if compiled else None,
            "compile_s": float(compiled.group(2)) if compiled else None, "hits": None}


def table(rows: list[dict], backend: str) -> str:
    cell = lambda v, fmt: "-" if v is None else format(v, fmt)
    lines = [f"smoke: {backend}", "",
             "| what | wall s | programs | cache hits | compile s | after step 1 | steady step s | end |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['wall']:.1f} | {cell(r['programs'], 'd')} | {cell(r['hits'], 'd')} | "
                     f"{cell(r['compile_s'], '.1f')} | {cell(r['after'], 'd')} | {cell(r['step'], '.3f')} | "
                     f"{r['status']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    logs = Path(args.logs).absolute()
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).absolute() if args.work else Path(tempfile.mkdtemp(prefix="arlopti_smoke_"))
    cache = work / "compile_cache"  # fresh and empty: the cold run compiles everything
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JAX_LOG_COMPILES": "1", "PYTHONUNBUFFERED": "1"}
    if args.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    train = [sys.executable, "-m", "arlopti_jax.train", f"--config.compile_cache_dir={cache}"]
    if args.quick:
        sp = work / "quick_start_point"
        code = ("import sys; from arlopti_jax.embedded.start_point import ensure_start_point; "
                f"ensure_start_point(sys.argv[1], seed=0, sizes={QUICK_START_POINT!r})")
        subprocess.run([sys.executable, "-c", code, str(sp)], check=True, env=os.environ, cwd=ROOT)
        tests = ",".join(str(sp / "data" / f"test_{n}ppl.parquet") for n in (2, 3))
        train += [f"--config.model.path={sp / 'model'}", f"--config.data.train_files={sp / 'data' / 'train.parquet'}",
                  f"--config.data.test_files={tests}", *TRAIN_QUICK]
    rows, backend = [], "backend: not printed"
    for what, run_dir, limit in (("default, cold", work / "default" / "cold", args.limits[0]),
                                 ("default, warm", work / "default" / "warm", args.limits[1])):
        if what.split(", ")[1] not in args.runs:
            continue
        log = logs / f"smoke_{what.split(', ')[1]}.log"
        wall, status = run([*train, f"--config.run_dir={run_dir}"], log, limit, env)
        text = log.read_text(errors="replace")
        backend = next((line for line in text.splitlines() if line.startswith("backend: ")), backend)
        late = re.search(r"compiled: \d+ programs in [0-9.]+ s, (\d+) of them after the first step", text)
        rows.append({"what": f"`train` {what}{' ' + args.xla_flags if args.xla_flags else ''}", "wall": wall,
                     "status": status, **common.compile_log_figures(text),
                     "after": int(late.group(1)) if late else None,
                     "step": steady_step(run_dir / "metrics.jsonl")})
    if "realistic" in args.runs:
        rows.append(realistic_row(args, logs, env))
    out = table(rows, backend)
    (logs / "smoke.md").write_text(out + "\n")
    print("\n" + out + f"\n\n(table in {logs / 'smoke.md'}; runs in {work})", flush=True)
    return 0 if all(r["status"] == "exit 0" for r in rows) else 1


def realistic_row(args, logs: Path, env: dict) -> dict:
    shape = REALISTIC_QUICK if args.quick else REALISTIC_1_5B
    log = logs / "smoke_realistic.log"
    wall, status = run([sys.executable, str(ROOT / "bench" / "realistic.py"), *REALISTIC, *shape], log, args.limits[2],
                       env)
    return {"what": f"`realistic.py` {'bench shape' if args.quick else '1.5B'}", "wall": wall, "status": status,
            **realistic_figures(log.read_text(errors="replace")), "after": None}


if __name__ == "__main__":
    sys.exit(main())
