"""What the embedded start point knows: its accuracy with its answers forced into the answer block.

    python -m arlopti_jax.warm_start runs/start_point [--rows 200]

The start point writes most of its answers as sentences (``start_point.sft_target``), so its
greedy accuracy under the reward's format check is 0 whatever logic it learnt. Here each
held-out puzzle's prompt is extended with the opening of a block answer (``ANSWER_OPENING``),
the model completes it greedily, and the K&K reward scores prompt and completion together, as
evaluation does: the greedy accuracy RL can reach by teaching the format alone. The puzzles
are fresh (their own seed) and none of them is among the start point's SFT, training or test
puzzles. Prints one line per people count, and returns the accuracies.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a command: its own process's settings before JAX loads (runtime/process.py)
    from arlopti_jax.runtime import process

    process.prepare()

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax

from arlopti_jax.runtime.chips import start_backend
from arlopti_jax.embedded.start_point import ANSWER_OPENING, SCALE_FILE, compact_rows
from arlopti_jax.tasks.kk import write_parquet

HELD_OUT_SEED = 40  # + the start point's seed + people count; SFT uses 20, test 10, train -1


def held_out_rows(folder: Path, rows: int) -> dict[int, list[dict]]:
    """Per people count, ``rows`` fresh puzzles (fewer if some are among the start point's own)."""
    built = json.loads((folder / SCALE_FILE).read_text())
    seed, sizes = built["seed"], built["sizes"]
    out = {}
    for n in sizes["people"]:
        seen = {r["quiz"] for r in compact_rows(n, sizes["sft_rows_per_size"], seed + 20 + n)}
        seen |= {r["quiz"] for r in compact_rows(n, sizes["train_rows_per_size"], seed + n - 1)}
        seen |= {r["quiz"] for r in compact_rows(n, sizes["test_rows_per_size"], seed + 10 + n)}
        out[n] = [r for r in compact_rows(n, rows, seed + HELD_OUT_SEED + n) if r["quiz"] not in seen]
    return out


def forced_accuracy(folder: str | Path, rows: int = 200) -> dict[int, tuple[float, int]]:
    """(greedy accuracy, puzzles) per people count of the start point in ``folder``, its answers
    forced into the block."""
    from arlopti_jax.rl import run_setup
    from arlopti_jax.embedded.default import get_config
    from arlopti_jax.rl.evaluation import Evaluator
    from arlopti_jax.tasks import load_reward_fn

    folder = Path(folder)
    sets = held_out_rows(folder, rows)
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for n, puzzles in sets.items():
            for r in puzzles:
                r["prompt"] = [{"role": "user", "content": r["prompt"][0]["content"] + ANSWER_OPENING}]
            files[n] = write_parquet(puzzles, Path(tmp) / f"forced_{n}ppl.parquet")
        config = get_config()  # the default's sampler settings; no sampled evaluation beyond one
        config.run_dir = tmp
        mesh = run_setup.make_mesh(config)
        policy = run_setup.load_policy(config, mesh, folder / "model")
        data = {n: run_setup.prompt_dataset(config, [f], policy.tokenizer) for n, f in files.items()}
        run = run_setup.assemble(config, mesh, policy.model_cfg, eos_ids=run_setup.eos_ids(policy),
                                 pad_id=run_setup.pad_id(policy), total_steps=max(1, config.train.max_steps))
        evaluator = Evaluator(config, run, policy.tokenizer, data, load_reward_fn(None))
        results = evaluator.run(policy.params, jax.random.key(0))
    return {n: (results[f"eval/{n}/greedy_acc"], len(sets[n])) for n in sets}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arlopti_jax.warm_start", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a start point folder (runs/start_point)")
    parser.add_argument("--rows", type=int, default=200, help="puzzles generated per people count (default 200)")
    args = parser.parse_args(argv)
    if not (Path(args.folder) / SCALE_FILE).is_file():
        parser.error(f"{args.folder}: not a start point folder (no {SCALE_FILE}; the default builds runs/start_point)")
    start_backend()  # JAX's platform choice, without the plugins' load lines (runtime/process.py)
    for n, (acc, count) in forced_accuracy(args.folder, args.rows).items():
        print(f"{n} people: forced-block greedy accuracy {acc:.3f} on {count} held-out puzzles "
              f"(guessing {0.5 ** n:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
