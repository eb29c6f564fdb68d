"""Does this checkout leave a run's records as an earlier commit left them?

    python bench/same_records.py --before COMMIT [--out DIR] [--config.FIELD=VALUE ...]

Runs ``python -m arlopti_jax.train`` (the embedded default, with any ``--config.`` overrides) once
with an earlier commit's package (a ``git worktree`` of ``--before``, on PYTHONPATH) and once with
this checkout's, in two run folders beside one another (so both read the same embedded start
point, built once), then compares their ``metrics.jsonl`` and ``eval.jsonl`` record by record
with the wall-time values left out (``time/``, ``throughput/``, ``compile/``: what the machine
and this process's compilation cache did, not what was computed). Every other value must be
equal as written, to the last digit. Exit status 0 when they are, 1 with the first difference.
Issue 66 used it for ``rollout.max_staleness=0``: today's trainer, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMING = ("time/", "throughput/", "compile/")


def records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    if not path.exists():
        return []
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
            for line in path.read_text().splitlines()]


def run(package_root: Path, run_dir: Path, overrides: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    began = time.time()
    subprocess.run([sys.executable, "-m", "arlopti_jax.train", f"--config.run_dir={run_dir}",
                    "--config.train.export_at_end=False", *overrides], env=env, check=True, cwd=run_dir.parent)
    return time.time() - began


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--out", default="", help="folder for the two runs (default: a new temporary one)")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        print(f"error: {bad[0]}: only --config.FIELD=VALUE overrides are passed on", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="same_records_"))
    out.mkdir(parents=True, exist_ok=True)
    before = out / "before_tree"
    if not before.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(before), args.before], check=True)
    try:
        seconds = {name: run(root, out / name, overrides) for name, root in (("before", before), ("after", REPO))}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], check=False)
    print(f"runs: before {seconds['before']:.0f} s, after {seconds['after']:.0f} s ({out})")
    for name in ("metrics.jsonl", "eval.jsonl"):
        a, b = records(out / "before", name), records(out / "after", name)
        if len(a) != len(b):
            print(f"{name}: {len(a)} records before, {len(b)} after")
            return 1
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
                print(f"{name}: record {i} (step {x.get('step')}) differs in {keys[:5]}")
                return 1
        print(f"{name}: {len(a)} records, equal ({sum(len(r) for r in a)} values)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
