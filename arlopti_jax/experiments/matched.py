"""The step-matched protocol behind ``python -m arlopti_jax.reproduce --matched``.

Two sweeps (``sweep.Sweep``, so each is resumable run by run) in one output folder OUT:

1. the learning-rate grid, in ``OUT/grid``: every method at every rate of ``--lr-grid`` (its runs
   are named ``METHOD@lrRATE``), ``--grid-seeds`` seeds each, evaluated on a validation split of
   the training problems: ``--val-prompts`` of them drawn once (seed 0) from the start point's
   ``train.parquet`` into ``OUT/matched_data/val.parquet``; the test set is never read;
2. the comparison, in ``OUT``: every method at its chosen rate, ``--seeds`` seeds each, evaluated
   on the test set.

Both train on the other training problems (``OUT/matched_data/train.parquet``), so the rates are
chosen on the data the comparison trains on. What is matched across methods: the start point, the
training problems and their order per seed, the RL steps, the rollout batch, and the number of
optimizer steps per RL step, the most any method of ``sweep.MATCHED_METHODS`` makes at the
scale's mini-batch (Lopti's two passes; a scale config's ``train.ppo_epochs`` multiplies every
method's alike): a single-pass method's mini-batch is divided to make as
many (``sweep.run_config(optimizer_steps=...)``; ``grpo_2x_steps`` made general). What is not:
the learning rate, each method's best on validation (mean final sampled accuracy over the grid
seeds; ties: greedy accuracy, then the lower rate), since the methods scale the gradient
differently (TR-GRPO's weights are at most 1; GSPO's clip and CISPO's weights bind elsewhere).

A method whose best rate is at an end of the grid is not known to have its best there: it gets
the next rate beyond that end (the grid's spacing continued, to one significant figure: 1e-5 after
3e-6 and 1e-5 gives 3e-5), and again while its best stays at the end, at most ``--grid-extend``
times (``grid_extensions``); a rate still at an end after that is marked so in the report.

``--lr METHOD=RATE,...`` fixes a method's rate and skips its grid: every comparison run's
record holds that command for its cell (``command``), which reproduces it from nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from arlopti_jax.experiments.matched_report import grid_table, mean_se, write_matched_report
from arlopti_jax.experiments.sweep import MATCHED_METHODS, MATCHED_VARIANTS, Sweep, base_config, run_config

LR_GRID = "1e-6,3e-6,1e-5"
GRID_EXTEND = 2  # a best at an end after one step past it gets one more (on SmolLM2 one was enough)
GRID_SEEDS = "100,101"  # not the comparison's seeds: the choice is made on other samples
COMPARISON_SEEDS = "0,1,2,3,4"
VAL_PROMPTS = 128
SELECT_BY = "eval/avg/sampled_acc"  # sampled accuracy separates the methods; greedy sits near its ceiling


def grid_name(method: str, lr: float) -> str:
    return f"{method}@lr{lr:g}"


def parse_name(variant: str) -> tuple[str, float | None]:
    """``METHOD@lrRATE`` -> (METHOD, RATE); a plain method -> (method, None)."""
    method, _, lr = variant.partition("@lr")
    return method, float(lr) if lr else None


def parse_lrs(text: str) -> dict[str, float]:
    """``METHOD=RATE,...`` -> {method: rate}; ValueError, one line naming what is wrong, otherwise."""
    out = {}
    for item in filter(None, text.split(",")):
        method, _, value = item.partition("=")
        if method not in MATCHED_VARIANTS:
            raise ValueError(f"--lr {item}: {method!r} is not one of {list(MATCHED_VARIANTS)}")
        try:
            out[method] = float(value)
        except ValueError:
            raise ValueError(f"--lr {item}: expected METHOD=RATE, e.g. grpo=3e-6") from None
        if not out[method] > 0:
            raise ValueError(f"--lr {item}: the rate must be > 0")
    return out


def parse_rates(args) -> tuple[dict[str, float], list[float], list[int]]:
    """(--lr's fixed rates, --lr-grid's rates in order, --grid-seeds) of reproduce's parsed flags;
    ValueError, one line naming the flag, where one does not fit (``reproduce`` calls this at
    start-up)."""
    fixed = parse_lrs(args.lr or "")
    try:
        grid_lrs = sorted({float(x) for x in args.lr_grid.split(",")})
        grid_seeds = [int(s) for s in args.grid_seeds.split(",")]
    except ValueError:
        raise ValueError(f"--lr-grid {args.lr_grid} / --grid-seeds {args.grid_seeds}: expected "
                         "comma-separated numbers") from None
    if (len(grid_lrs) < 3 or min(grid_lrs) <= 0) and any(m not in fixed for m in args.variants.split(",")):
        raise ValueError(f"--lr-grid {args.lr_grid}: give at least 3 distinct rates, each > 0")
    return fixed, grid_lrs, grid_seeds


def split_train(start_point: Path, folder: Path, val_prompts: int) -> tuple[Path, Path]:
    """(train, validation) parquet files in ``folder``: ``val_prompts`` rows of the start point's
    training problems drawn once (seed 0), and the others in their order. Reused when there; a
    folder split at another size is refused."""
    import pyarrow.parquet as pq

    train, val = folder / "train.parquet", folder / "val.parquet"
    if train.is_file() and val.is_file():
        have = pq.read_metadata(val).num_rows
        if have != val_prompts:
            raise SystemExit(f"error: {folder} holds a validation split of {have} problems, not --val-prompts "
                             f"{val_prompts}: use another output folder")
        return train, val
    table = pq.read_table(start_point / "data" / "train.parquet")
    if not 0 < val_prompts < table.num_rows:
        raise SystemExit(f"error: --val-prompts {val_prompts}: the training set has {table.num_rows} problems")
    order = np.random.default_rng(0).permutation(table.num_rows)
    folder.mkdir(parents=True, exist_ok=True)
    for path, rows in ((train, np.sort(order[val_prompts:])), (val, np.sort(order[:val_prompts]))):
        tmp = path.with_name(f"{path.stem}.{id(rows)}.tmp")  # several --jobs workers may write it at once
        pq.write_table(table.take(rows), tmp)
        tmp.replace(path)
    return train, val


def matched_optimizer_steps(base, scale: str) -> int:
    """Optimizer steps per RL step of every matched run: the most a method of MATCHED_METHODS makes
    at the scale's own mini-batch."""
    from arlopti_jax.rl.run_setup import optimizer_steps_per_rl_step

    return max(optimizer_steps_per_rl_step(run_config(base, m, 0, Path("run"), Path("start_point"), 1, 0, 0, False,
                                                      scale)) for m in MATCHED_METHODS)


class MatchedSweep(Sweep):
    """A sweep of the protocol: runs at ``optimizer_steps`` per RL step on the split's data, each at
    its name's rate (the grid) or its method's in ``lrs`` (the comparison); ``test`` names the
    evaluation files ('val': the split's; 'test': the start point's). ``command(method, seed, lr)``
    is the record's command for a cell."""

    def __init__(self, *args, optimizer_steps: int, lrs: dict[str, float], test: str, val_prompts: int,
                 command=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer_steps, self.lrs, self.test, self.val_prompts = optimizer_steps, lrs, test, val_prompts
        self.command = command
        self.data: tuple[str, str] | None = None
        # SmolLM2's state is 1.4 GB a run: 88 runs would not fit; a finished run's record suffices
        self.drop_checkpoints = True

    def start_point(self) -> Path:
        folder = super().start_point()
        train, val = split_train(folder, self.start_point_dir.parent / "matched_data", self.val_prompts)
        tests = [val] if self.test == "val" else sorted((folder / "data").glob("test_*.parquet"))
        self.data = (str(train), ",".join(str(p) for p in tests))
        return folder

    def lr_of(self, variant: str) -> float:
        method, lr = parse_name(variant)
        return lr if lr is not None else self.lrs[method]

    def run_config(self, base, variant, seed, run_dir, start_point, eval_before, dtype):
        c = run_config(base, parse_name(variant)[0], seed, run_dir, start_point, self.steps, self.eval_prompts,
                       self.diagnostics_every, eval_before, self.scale, dtype, optimizer_steps=self.optimizer_steps,
                       lr=self.lr_of(variant), data=self.data)
        c.train.diagnostics_rows = -1  # the quartile norms on the whole batch: methods' mini-batches differ
        c.train.isolation_experiment = False  # run_config turns it on; this report does not read it
        return c

    def describe(self, name, config) -> dict:
        out = super().describe(name, config)
        variant, seed = name.split("/seed")
        if self.command is not None:
            out["command"] = self.command(parse_name(variant)[0], int(seed), self.lr_of(variant))
        return out


def choose_lrs(grid: dict, rates: dict[str, list[float]], seeds: list[int]) -> dict:
    """{method: {"lr": chosen, "scores": {rate: {"sampled": [mean, se, n], "greedy": [...]}}, "edge": bool}}
    from the grid's records (their last evaluation) of each method's ``rates``; SystemExit if a run of
    the grid is missing."""
    runs = grid["runs"]
    missing = [f"{grid_name(m, lr)}/seed{s}" for m, lrs in rates.items() for lr in lrs for s in seeds
               if not runs.get(f"{grid_name(m, lr)}/seed{s}", {}).get("finished")]
    if missing:
        raise SystemExit(f"the learning-rate grid is missing {len(missing)} runs ({missing[0]}, ...): run the "
                         "same command again to resume it")
    out = {}
    for m, lrs in rates.items():
        scores = {}
        for lr in lrs:
            finals = [runs[f"{grid_name(m, lr)}/seed{s}"]["evals"][-1] for s in seeds]
            scores[f"{lr:g}"] = {"sampled": mean_se([e[SELECT_BY] for e in finals]),
                                 "greedy": mean_se([e["eval/avg/greedy_acc"] for e in finals])}
        best = max(lrs, key=lambda lr: (scores[f"{lr:g}"]["sampled"][0], scores[f"{lr:g}"]["greedy"][0], -lr))
        out[m] = {"lr": best, "scores": scores, "edge": best in (min(lrs), max(lrs))}
    return out


def next_rate(lrs: list[float], best: float) -> float:
    """The rate beyond ``best``, an end of ``lrs`` (at least 2 rates): the spacing of that end's two
    rates continued, to one significant figure."""
    lrs = sorted(lrs)
    inner = lrs[-2] if best == lrs[-1] else lrs[1]
    return float(f"{best * best / inner:.0e}")


def grid_extensions(rates: dict[str, list[float]], choice: dict) -> dict[str, float]:
    """{method: the next rate to try} for each method whose chosen rate is an end of its rates."""
    return {m: next_rate(rates[m], c["lr"]) for m, c in choice.items() if c["edge"]}


def worker_args(args, phase: str, grid_variants: list[str] | None = None) -> list[str]:
    """The command line of a --jobs worker of ``phase`` (``reproduce`` adds ``--worker K``); a grid
    worker is given the runs of the grid's current extension (``grid_variants``)."""
    out = ["--matched", "--phase", phase, "--out", args.out, "--scale", args.scale, "--variants", args.variants,
           "--seeds", args.seeds, "--steps", str(args.steps), "--eval-prompts", str(args.eval_prompts),
           "--diagnostics-every", str(args.diagnostics_every), "--lr-grid", args.lr_grid, "--grid-seeds",
           args.grid_seeds, "--val-prompts", str(args.val_prompts)]
    out += ["--grid-extend", str(args.grid_extend)] + (["--grid-variants", ",".join(grid_variants)]
                                                      if grid_variants else [])
    return out + (["--lr", args.lr] if args.lr else []) + (["--quick"] if args.quick else [])


def cell_command(args):
    """The command that reproduces one comparison cell from nothing: its method at its rate, one seed."""
    def command(method: str, seed: int, lr: float) -> str:
        return (f"python -m arlopti_jax.reproduce --matched --scale {args.scale} --out OUT --variants {method} "
                f"--seeds {seed} --lr {method}={lr:g} --steps {args.steps} --eval-prompts {args.eval_prompts} "
                f"--diagnostics-every {args.diagnostics_every} --val-prompts {args.val_prompts}"
                + (" --quick" if args.quick else ""))
    return command


def run(args, sizes: dict | None) -> int:
    """``reproduce --matched``: the grid for the methods without a ``--lr``, the choice, then the
    comparison and its report (``matched_report``). ``args``: reproduce's parsed flags, resolved
    (variants, seeds, steps and eval prompts filled in)."""
    out = Path(args.out)
    methods = args.variants.split(",")
    fixed, grid_lrs, grid_seeds = parse_rates(args)  # checked at start-up
    base = base_config(args.scale)
    steps = matched_optimizer_steps(base, args.scale)
    common = dict(sizes=sizes, scale=args.scale, worker=args.worker, start_point_dir=out / "start_point",
                  optimizer_steps=steps, val_prompts=args.val_prompts)
    searched = [m for m in methods if m not in fixed]

    def grid_sweep(variants: list[str]) -> MatchedSweep:
        return MatchedSweep(out / "grid", variants, grid_seeds, args.steps, args.val_prompts, diagnostics_every=0,
                            lrs={}, test="val", **common)

    if args.worker is not None and args.phase == "grid":
        grid_sweep(args.grid_variants.split(",")).run()
        return 0
    rates = {m: list(grid_lrs) for m in searched}
    choice: dict = {}
    for extension in range(args.grid_extend + 1):  # the grid, then rates beyond its ends where the best is there
        grid = grid_sweep([grid_name(m, lr) for m in searched for lr in rates[m]])
        if searched and args.worker is None:
            print(f"learning-rate grid: {len(grid.variants) * len(grid_seeds)} runs in {out / 'grid'}", file=sys.stderr)
            if args.jobs > 1:
                grid.run_jobs(args.jobs, worker_args(args, "grid", grid.variants))
            else:
                grid.run()
            if grid.problems:
                raise SystemExit("\n".join(grid.problems) + "\nrun the same command again to resume")
        choice = choose_lrs(grid.results, rates, grid_seeds) if searched else {}
        beyond = grid_extensions(rates, choice)
        if not beyond or extension == args.grid_extend:
            break
        print("best rate at an end of the grid, trying beyond it: " + ", ".join(
            f"{m} {lr:g}" for m, lr in beyond.items()), file=sys.stderr)
        for m, lr in beyond.items():
            rates[m] = sorted(rates[m] + [lr])
    lrs = {**{m: c["lr"] for m, c in choice.items()}, **fixed}
    if args.grid_only:
        print(grid_table(choice))
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    comparison = MatchedSweep(out, methods, seeds, args.steps, args.eval_prompts,
                              diagnostics_every=args.diagnostics_every, lrs=lrs, test="test",
                              command=cell_command(args), **common)
    if args.worker is not None:
        comparison.run()
        return 0
    comparison.results["matched"] = {
        "optimizer_steps_per_rl_step": steps, "lr": lrs, "fixed_lr": fixed, "lr_grid": grid_lrs,
        "grid_extend": args.grid_extend, "grid_seeds": grid_seeds, "val_prompts": args.val_prompts,
        "select_by": SELECT_BY, "choice": choice}
    results = comparison.run_jobs(args.jobs, worker_args(args, "final")) if args.jobs > 1 else comparison.run()
    if any(r.get("finished") for r in results["runs"].values()):
        command = "python -m arlopti_jax.reproduce " + " ".join(args.argv)
        print(f"\nwrote {write_matched_report(results, grid.results, out, command)}")
    if comparison.problems:
        raise SystemExit("\n".join(comparison.problems) + "\nrun the same command again to resume")
    return 0


def add_arguments(ap) -> None:
    """reproduce's flags of the protocol."""
    ap.add_argument("--matched", action="store_true",
                    help="the step-matched protocol (arlopti_jax/experiments/matched.py): "
                         "every method makes the same optimizer "
                         "steps per RL step and runs at its best learning rate of --lr-grid on a validation split of "
                         "the training problems; default variants: " + ",".join(MATCHED_METHODS) + ", seeds "
                         + COMPARISON_SEEDS + "; writes OUT/matched.md")
    ap.add_argument("--lr", default="",
                    help="with --matched: METHOD=RATE,... fixed learning rates (no grid for them)")
    ap.add_argument("--lr-grid", default=LR_GRID,
                    help="with --matched: the learning rates tried (default: %(default)s)")
    ap.add_argument("--grid-extend", type=int, default=GRID_EXTEND,
                    help="with --matched: a method whose best rate is an end of --lr-grid gets the next rate beyond "
                         "it (the grid's spacing continued, e.g. 3e-5 after 3e-6,1e-5), at most this many times "
                         "(default: %(default)s; 0: the grid as given)")
    ap.add_argument("--grid-seeds", default=GRID_SEEDS, help="with --matched: the grid's seeds (default: %(default)s)")
    ap.add_argument("--val-prompts", type=int, default=VAL_PROMPTS,
                    help="with --matched: training problems held out to choose the rates (default: %(default)s)")
    ap.add_argument("--grid-only", action="store_true", help="with --matched: stop after the grid and its choice")
    ap.add_argument("--phase", choices=("grid", "final"), default=None, help=argparse.SUPPRESS)  # a worker's sweep
    ap.add_argument("--grid-variants", default="", help=argparse.SUPPRESS)  # a grid worker's runs


def check_arguments(ap, args) -> None:
    """One-line errors for flags of the protocol that do not fit."""
    if args.grid_extend < 0:
        ap.error(f"--grid-extend {args.grid_extend}: must be >= 0")
    if not args.matched:
        used = [f for f, v in (("--lr", args.lr), ("--grid-only", args.grid_only)) if v]
        if used:
            ap.error(f"{used[0]} needs --matched")
        return
    others = [v for v in args.variants.split(",") if v not in MATCHED_VARIANTS]
    if others:
        ap.error(f"--matched compares {list(MATCHED_VARIANTS)}, not {others} (it matches every method's optimizer "
                 "steps itself)")
