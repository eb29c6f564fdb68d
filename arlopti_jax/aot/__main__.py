"""Compile every program of one RL step for a TPU slice or H100s that this machine does not have.

    python -m arlopti_jax.aot --config=configs/layouts/v5p8.py:7b,grpo_ar_lopti --target=v5p-8
    python -m arlopti_jax.aot --config=configs/kk.py:3b,grpo_ar_lopti --target=v5e-16,h100x8 --json=aot.json

The config is read as ``train`` reads it (the same file, the same ``--config.<field>=<value>``
overrides) and the run is assembled as ``train`` assembles it, on a mesh of the target's
compile-only devices: the programs compiled are the ones ``train`` would run there, for the
worst case of the config's shapes (every prompt and response at its longest). No weights are
read and nothing is allocated; the model's shape comes from ``model.path``'s config.json (the
embedded default's: its start point's, once ``train`` has built it; before that, its declared
shape), or, when that folder is not on this machine, from its Qwen2.5 size
(``arlopti_jax/aot/shapes.py``). The sampler's prompt width is the longest prompt of the data,
as ``train`` pads it, when the data and the tokenizer are here; else ``data.max_prompt_length``.

With tool episodes (``env.name``) the rollout's programs are the episodes' (``rollout/episodes.py``,
the list ``train``'s warm-up compiles): the prefill, ``episode start``, and per row bucket and phase
the decode loop, the ``resume`` that feeds the host's observations, the compaction, growth and scatter;
their shapes do not depend on the number of turns, so one set serves every episode.

The step's programs include the copies of the policy it makes for the sampler: at
``rollout.max_staleness`` k >= 1 the colocated snapshot and its checksums; with the sampler on its
own devices (``rollout.devices``) the weight sync (the cast, with several processes the gather of
each array whole on the trainer's mesh, the transfer's bytes, the checksums on each side). Per
program (``T`` / ``S``: on the trainer's or the sampler's mesh) it prints the compile time, the
per-device memory the compiler assigned (arguments, outputs, temporaries, aliased), its peak with
what its mesh holds then (the training state, the k + 1 copies of the policy in flight, what is
alive beside it, named below it), flops and bytes accessed, the compiler's time estimate where it
gives one (TPU, programs without loops), and the collectives of the optimized HLO; then each mesh's
peak and resident state. It exits 0 when the step
fits every target, 1 when a target's peak is over its memory (one line each: which program, how
much, what to change), 2 on a bad command line or config. Every figure is the compiler's, for
the real target, not a measurement of a run.

Targets: v5e-1, v5e-8, v5e-16, v5e-256, v5p-8, v5p-16, v5p-32, v5p-64, v4-32 (multi-host slices as their pods run
them: one process per host), ``NxNAME`` (N of those slices joined by the data-center network, a
multislice job: ``2xv5e-16``; collectives between slices are listed as ``dcn all-reduce``, ...),
h100, h100x8 (one node), and ``local``: this machine's own devices (the CPU, or a lent GPU),
compiled through the persistent compilation cache. Needs ``pip install -e ".[aot]"``.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a command: its own process's settings before JAX loads (runtime/process.py)
    from arlopti_jax.runtime import process

    process.prepare()

import json
import sys

from arlopti_jax.aot import targets
from arlopti_jax.config.cli import Command, startup_done
from arlopti_jax.config import DEFAULT_CONFIG, ConfigError

COMMAND = Command(
    name="arlopti_jax.aot", doc=__doc__, default_file=DEFAULT_CONFIG,
    flags=(("--target=NAME[,NAME...]", f"compile-only targets: {', '.join(targets.TARGETS)}; NxNAME (N TPU "
            "slices, multislice: 2xv5e-16); or local (this machine's devices: compile times here, through the "
            "persistent compilation cache)"),
           ("--json=PATH", "also write the records (one per target) as JSON"),
           ("--eval", "also compile the evaluation's sampler programs (greedy and sampled)"),
           ("--all-shapes", "the packed passes for every shape of the run's set, as train compiles them (the "
            "default for local); else, on a compile-only target, for the shape of the step's memory peak"),
           ("--verbose", "a line per program as it compiles")),
    examples=(
        "python -m arlopti_jax.aot --config=configs/layouts/v5p8.py:7b,grpo_ar_lopti --target=v5p-8",
        "python -m arlopti_jax.aot --config=configs/layouts/gpu8x80.py:3b,grpo_ar_lopti --target=h100x8 "
        "--json=runs/aot_h100x8.json",
        "python -m arlopti_jax.aot --target=v5e-8,h100   # the embedded default's programs",
    ))


def format_record(record: dict) -> str:
    """The table ``aot`` prints for one target."""
    gib = lambda b: f"{b / targets.GIB:7.2f}"
    lines = [f"{record['target_label']}: {record['model']}, {record['model_params'] / 1e9:.2f}B parameters, mesh "
             + " x ".join(f"{k}={v}" for k, v in record["mesh"].items() if v > 1 or k == "fsdp")
             + f", {record['processes']} process(es)"
             + (f" over {record['slices']} slices (data across slices: dcn_data={record['dcn_data']})"
                if record.get("slices", 1) > 1 else "") + f", jax {record['jax']}",
             f"{'program':40s} {'compile s':>9s} {'args':>7s} {'out':>7s} {'temp':>7s} {'alias':>7s} {'peak':>7s} "
             f"{'TFLOP':>8s} {'GB read+written':>15s} {'estimate ms':>11s}  collectives (count, GB)"]
    split = "sampler" in record["meshes"]
    for p in record["programs"]:
        m = p["memory"]
        if p["flops"] and p["loop_free"]:  # XLA:TPU's cost analysis
            flops = f"{p['flops'] / 1e12:8.2f}"
        elif p["flops"] is None and p.get("hlo_flops"):  # a GPU: the HLO's matrix FLOPs
            flops = f"{p['hlo_flops'] / 1e12:7.2f}*"
        else:
            flops = f"{'-':>8s}"
        moved = f"{p['hlo_bytes'] / 1e9:15.2f}"
        estimate = f"{p['estimate_s'] * 1e3:11.2f}" if p["estimate_s"] else f"{'-':>11s}"
        coll = ", ".join(f"{k} {v['count']} ({v['bytes'] / 1e9:.2f})" for k, v in p["collectives"].items()) or "-"
        where = ("S " if p["mesh"] == "sampler" else "T ") if split else ""
        lines.append(f"{(where + p['group'] + ' ' + p['name'])[:40]:40s} {p['compile_s']:9.1f} {gib(m['argument'])} "
                     f"{gib(m['output'])} {gib(m['temp'])} {gib(m['alias'])} {gib(p['peak_bytes_per_device'])} "
                     f"{flops} {moved} {estimate}  {coll}")
        notes = ([f"runs: {', '.join(p['runs'])}"] if p["runs"] else []) + [
            f"{name} {size / targets.GIB:.2f} GiB beside" for name, size in p["beside"].items()]
        if notes:
            lines.append(f"    ({'; '.join(notes)})")
    fits = "fits" if record["fits"] else "DOES NOT FIT"
    lines.append(f"peak {record['peak_bytes_per_device'] / targets.GIB:.2f} GiB per device ({record['peak_program']}) "
                 f"of {record['device_memory_bytes'] / targets.GIB:.1f} GiB: {fits}; {len(record['programs'])} "
                 f"programs compiled in {record['compile_s']:.1f} s")
    for name, mesh in record["meshes"].items():
        parts = ", ".join(f"{part} {size / targets.GIB:.2f}" for part, size in mesh["resident"].items())
        lines.append(f"{'T' if name == 'trainer' else 'S'}: the {name}'s mesh, {mesh['devices']} devices ("
                     + " x ".join(f"{k}={v}" for k, v in mesh["mesh"].items()) + f", {mesh['processes']} process(es)): "
                     f"peak {mesh['peak_bytes_per_device'] / targets.GIB:.2f} GiB per device ({mesh['peak_program']}); "
                     f"resident {mesh['resident_bytes_per_device'] / targets.GIB:.2f} GiB ({parts})")
    copies = record["copies"]
    each = copies["bytes_per_device"] / targets.GIB
    where = ("each mesh" if copies["sampler_hosts"] else "the sampler's mesh" if copies["own_mesh"]
             else "the trainer's mesh")
    held = (f"{copies['versions']} copies of the policy ({copies['dtype']}, {each:.2f} GiB per device each) on {where}"
            if copies["versions"] else "the sampler reads the trainer's parameters (no copy)")
    old = "recomputed by the trainer" if copies["recompute_old_logprobs"] else "the sampler's log-probs"
    lines.append(f"max_staleness {copies['max_staleness']}: {held}; pi_old {old}")
    for t in copies["transfers"]:
        lines.append(f"one weight sync moves {t['bytes'] / 1e9:.2f} GB, {t['bytes_per_sampler_device'] / 1e9:.2f} GB "
                     f"into each sampler device, from {t['from']} ({t['name']})")
    lines.append("(compiler figures for the target, not a run: GiB and GB per device; TFLOP and the estimate from "
                 "XLA's cost analysis, for programs without loops; TFLOP* (GPU, which has no cost analysis) the matrix "
                 "FLOPs and GB read+written counted from the optimized HLO, layer loops multiplied, a decode loop's "
                 "body once: one decode step)")
    return "\n".join(lines)


def main(argv) -> int:
    from absl import flags

    from arlopti_jax.aot.check import DoesNotFit, check, does_not_fit_line, prepare
    from arlopti_jax.runtime.chips import start_backend

    start_backend()  # this machine's own backend, without the compile-only plugins' driver lines
    config = flags.FLAGS.config
    names = [t for t in flags.FLAGS.target.split(",") if t]
    try:  # start-up: every target's compiler, the config on its mesh, the model's shape
        if not names:
            raise targets.TargetError(f"--target is required: one or more of {', '.join(targets.TARGETS)}, local")
        chosen = [targets.get(name) for name in names]
        for target in chosen:
            prepare(config, target)
    except targets.TargetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"error: {target.name}: {err}", file=sys.stderr)
        return 2
    startup_done(COMMAND.name)
    records, status = [], 0
    for target in chosen:
        try:
            record = check(config, target, verbose=flags.FLAGS.verbose, eval_programs=flags.FLAGS.eval,
                           all_shapes=True if flags.FLAGS.all_shapes else None)
        except DoesNotFit as err:
            print(f"error: {err}", file=sys.stderr)
            status = max(status, 1)
            continue
        records.append(record)
        print(format_record(record), flush=True)
        if not record["fits"]:
            print(f"error: {does_not_fit_line(record)}", file=sys.stderr)
            status = max(status, 1)
    if flags.FLAGS.json and records:
        with open(flags.FLAGS.json, "w") as f:
            json.dump(records if len(records) > 1 else records[0], f, indent=1)
    return status


def _cli():
    targets.prepare_environment()  # the compile-only compilers need no TPU metadata server, no CUDA driver check
    from absl import flags

    from arlopti_jax.config.cli import define_config_file, parse_command_line

    def define():
        flags.DEFINE_string("target", "", "compile-only target(s), comma-separated")
        flags.DEFINE_string("json", "", "write the records as JSON to this file")
        flags.DEFINE_bool("eval", False, "also compile the evaluation's sampler programs")
        flags.DEFINE_bool("all_shapes", False, "the packed passes for every shape of the run's set")
        flags.DEFINE_bool("verbose", False, "a line per program as it compiles")
        define_config_file()

    sys.exit(main(parse_command_line(sys.argv, COMMAND, define)))


if __name__ == "__main__":
    _cli()
