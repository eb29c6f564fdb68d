"""The RL trainer: sample -> reward -> advantage -> token weights -> (Lopti) updates.

    python -m arlopti_jax.train                                   # the embedded default (CPU, GPU or TPU)
    python -m arlopti_jax.train --config=configs/kk.py:3b,grpo_ar_lopti \\
        --config.model.path=/ckpt/Qwen2.5-3B-Instruct --config.data.train_files=data/kk/3ppl/train.parquet

Each step: draw ``rollout.n`` responses for ``train.batch_prompts`` prompts (optionally
dropping zero-advantage groups and drawing more: ``algo.filter_groups``), score them,
compute advantages and token weights, update the policy (twice with Lopti), log to
TensorBoard, checkpoint, evaluate. SIGTERM saves a checkpoint and exits with code 75 (0 when
finished, 2 for a bad input); ``resume=auto`` continues from the newest good checkpoint with the
same data order and RNG.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a command: its own process's settings before JAX loads (runtime/process.py)
    from arlopti_jax.runtime import process

    process.prepare()

import logging
import sys

import jax

from arlopti_jax.runtime import chips, faults
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.rl import run_setup
from arlopti_jax.config.cli import Command, startup_done
from arlopti_jax.config import DEFAULT_CONFIG, ConfigError, validate
from arlopti_jax.rl.loop import STOPPED_EXIT_CODE, train
from arlopti_jax.rl.pipeline import SyncError
from arlopti_jax.rl.update import MismatchError
from arlopti_jax.store.checkpoint import CheckpointMismatch, CheckpointUnreadable
from arlopti_jax.store.trackers import TrackerError

COMMAND = Command(
    name="arlopti_jax.train", doc=__doc__, default_file=DEFAULT_CONFIG,
    examples=(
        "python -m arlopti_jax.train   # the embedded default: builds its start point, trains on a laptop CPU",
        "python -m arlopti_jax.train --config=configs/kk.py:3b,grpo_ar_lopti "
        "--config.model.path=/models/Qwen2.5-3B-Instruct --config.run_dir=runs/kk3b",
        "python -m arlopti_jax.train --config.algo.filter_groups=True --config.algo.overlong_buffer=16 "
        "--config.train.eval_n=8 --config.train.eval_ks=1,4,8 --config.train.diagnostics_every=5",
        "python -m arlopti_jax.train --help --config=configs/kk.py:7b,grpo   # this help with that file's values",
    ))


def main(argv) -> int:
    from absl import flags

    config = flags.FLAGS.config
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("absl", "jax._src.xla_bridge", "fsspec", "gcsfs"):  # orbax per-save, jax probing, bucket I/O
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        dist.initialize(config)  # before any JAX computation; a no-op for a single process
        if jax.process_index() != 0:  # process 0 alone prints
            logging.getLogger().setLevel(logging.WARNING)
        chips.print_backend()  # what it runs on, before anything is built
        validate(config, jax.device_count(), jax.default_backend(), shd.slice_count(jax.devices()))
        layout = run_setup.make_layout(config)  # a split the devices or processes cannot hold stops here
        dist.validate(config, layout.mesh)
        # a missing path, a resume setting run_dir contradicts, unreadable data or a training set that
        # cannot fill one batch stops here, in one line
        inputs = run_setup.prepare_inputs(config, layout)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    startup_done(COMMAND.name)
    try:
        summary = train(config, inputs)
    # found as the checkpoint is read; a tracker that cannot start (store/metrics.py: TrackerError)
    except (CheckpointMismatch, CheckpointUnreadable, TrackerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (SyncError, MismatchError) as err:  # the sampler holds other weights, or computes other log-probs
        print(f"error: {err}", file=sys.stderr)
        return 1
    faults.point("exit")
    return STOPPED_EXIT_CODE if summary["preempted"] else 0  # 75: a stop signal ended it, resume me


def _cli():
    from arlopti_jax.config.cli import define_config_file, parse_command_line

    sys.exit(main(parse_command_line(sys.argv, COMMAND, define_config_file)))


if __name__ == "__main__":
    _cli()
