"""docs/reference/memory.md's layouts compiled: the compiler's per-device peak beside memory_plan.py's estimate.

    python bench/memory_compiled.py                          # every row (resumes: rows in --json are kept)
    python bench/memory_compiled.py --model 7b --hardware v5p-8
    python bench/memory_compiled.py --table                  # the markdown table of what --json holds

Each row is the paper's K&K run (``configs/kk.py:MODEL,grpo_ar_lopti``: 64 prompts x 8, prompt
400 (448 slots) + response 4096, KL to the reference on) in the row's mesh layout and weight dtype,
compiled by ``arlopti_jax.aot`` for the row's hardware (8xH100-80GB: ``h100x8``; ``v5p-8``;
``v5e-16``: 4 hosts, one process each). The rollout compiles with compaction off
(``rollout.min_rows`` above the batch): the schedule of a batch whose every response runs to the
longest length, the rollout's memory peak. Compiler figures for the target, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TARGETS = {"8xH100-80GB": "h100x8", "v5p-8": "v5p-8", "v5e-16": "v5e-16"}
ROWS = [(model, hw, layout, "float32") for model in ("3b", "7b") for hw, spec in
        {"8xH100-80GB": ("fsdp=8", "fsdp=4,tensor=2", "data=2,fsdp=4"),
         "v5p-8": ("fsdp=4", "fsdp=2,tensor=2", "data=2,fsdp=2"),
         "v5e-16": ("fsdp=16", "fsdp=8,tensor=2", "data=2,fsdp=8", "fsdp=4,tensor=4")}.items() for layout in spec]
ROWS += [(model, "v5e-16", layout, "bfloat16") for model in ("3b", "7b")
         for layout in ("fsdp=16", "fsdp=8,tensor=2", "data=2,fsdp=8", "fsdp=4,tensor=4")]
GIB = 2 ** 30


def row_config(model: str, layout: str, param_dtype: str):
    from memory_plan import parse_layout

    from arlopti_jax.config import apply_layout, load_config_file

    config = load_config_file(ROOT / "configs" / "kk.py", f"{model},grpo_ar_lopti")
    config = apply_layout(config, **parse_layout(layout), param_dtype=param_dtype)
    config.rollout.min_rows = 1 << 20  # no compaction: every response to the longest length
    return config


def estimate(model: str, hw: str, layout: str, param_dtype: str) -> float:
    """memory_plan's step peak with remat, bytes per device."""
    from common import model_config
    from memory_plan import parse_layout, plan

    p = plan(model_config(model), parse_layout(layout), param_dtype=param_dtype)
    return max(p["rollout_peak"], p["update_peak_remat"])


def key(row) -> str:
    return "/".join(row)


def run(args) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from arlopti_jax.aot import targets

    targets.prepare_environment()
    from arlopti_jax.aot.check import DoesNotFit, check

    path = Path(args.json)
    records = json.loads(path.read_text()) if path.is_file() else {}
    for row in ROWS:
        model, hw, layout, dtype = row
        if (args.model and model != args.model) or (args.hardware and hw != args.hardware) or key(row) in records:
            continue
        start = time.time()
        entry = {"model": model, "hardware": hw, "layout": layout, "param_dtype": dtype,
                 "estimate_bytes": estimate(*row), "date": time.strftime("%Y-%m-%d")}
        try:
            record = check(row_config(model, layout, dtype), targets.get(TARGETS[hw]))
            entry.update(compiled_bytes=record["peak_bytes_per_device"], peak_program=record["peak_program"],
                         resident_bytes=record["resident_bytes_per_device"], fits=record["fits"],
                         usable_bytes=record["usable_bytes_per_device"], compile_s=record["compile_s"],
                         programs={p["name"]: p["peak_bytes_per_device"] for p in record["programs"]})
        except DoesNotFit as err:  # XLA's RESOURCE_EXHAUSTED: over the chip's memory
            entry.update(compiled_bytes=None, fits=False, error=str(err))
        records[key(row)] = entry
        path.write_text(json.dumps(records, indent=1))
        shown = f"{entry['compiled_bytes'] / GIB:.1f}" if entry["compiled_bytes"] else "over"
        print(f"{key(row)}: estimate {entry['estimate_bytes'] / GIB:.1f} GiB, compiler {shown} GiB, fits "
              f"{entry['fits']} ({time.time() - start:.0f} s)", flush=True)


def table(path: Path) -> str:
    records = json.loads(path.read_text())
    lines = ["| model | hardware | layout | weights | estimate GiB | compiler GiB | compiler / estimate | peak program "
             "| "
             "fits (compiler) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        e = records.get(key(row))
        if e is None:  # not compiled yet (the run resumes): the estimate alone
            model, hw, layout, dtype = row
            lines.append(f"| {model} | {hw} | {layout} | {dtype} | {estimate(*row) / GIB:.1f} | not compiled yet | - | "
                         "- | - |")
            continue
        est = e["estimate_bytes"] / GIB
        if e["compiled_bytes"] is None:
            comp, ratio, peak = "over (RESOURCE_EXHAUSTED)", "-", e["error"].split("'")[1] if "'" in e["error"] else "-"
        else:
            comp, ratio, peak = f"{e['compiled_bytes'] / GIB:.1f}", f"{e['compiled_bytes'] / GIB / est:.2f}", \
                e["peak_program"]
        lines.append(f"| {e['model']} | {e['hardware']} | {e['layout']} | {e['param_dtype']} | {est:.1f} | {comp} | "
                     f"{ratio} | {peak} | {'yes' if e['fits'] else 'no'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=str(ROOT / "docs" / "measurements" / "aot" / "memory.json"),
                    help="records (read to resume, written per row)")
    ap.add_argument("--model", choices=("3b", "7b"))
    ap.add_argument("--hardware", choices=sorted(TARGETS))
    ap.add_argument("--table", action="store_true", help="print the markdown table of --json and exit")
    args = ap.parse_args()
    if args.table:
        print(table(Path(args.json)))
        return
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
