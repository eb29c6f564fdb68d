"""Supervised fine-tuning on (prompt, response) pairs: the warm start before RL.

    python -m arlopti_jax.sft --config.model.path=CKPT --config.data.files=pairs.jsonl \\
        --config.out_dir=runs/sft
    python -m arlopti_jax.sft --config.tiny=True --config.out_dir=runs/start_point

Rows hold ``prompt`` (a string or chat messages, rendered as the RL loader does) and
``response`` (the target text; the tokenizer's EOS is appended). The loss is the mean
negative log-likelihood of response tokens (``arlopti_jax.finetune.supervised``); batches group rows of
similar length, so trimming each to its longest row leaves little padding. ``tiny=True``
builds the embedded default's start point instead: a tokenizer trained on generated K&K
text and a small random Qwen2 model, warm-started on generated K&K worked solutions (see
``start_point``). The result is a Hugging Face folder that ``arlopti_jax.train`` loads as
``model.path``.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a command: its own process's settings before JAX loads (runtime/process.py)
    from arlopti_jax.runtime import process

    process.prepare()

import logging
import sys
from pathlib import Path

import ml_collections

from arlopti_jax.config.cli import Command, startup_done
from arlopti_jax.config import base_config

log = logging.getLogger(__name__)


def sft_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.tiny = False  # build the embedded default's start point (ignores model.path / data.files)
    c.out_dir = "runs/sft"
    c.seed = 0
    c.compile_cache_dir = base_config().compile_cache_dir  # the trainer's: SFT and RL share compiled programs
    c.model = ml_collections.ConfigDict({"path": "", "dtype": "float32", "param_dtype": "float32", "remat": False})
    c.data = ml_collections.ConfigDict({"files": "", "max_length": 1024})
    c.train = ml_collections.ConfigDict({"steps": 300, "batch": 16, "lr": 1e-3, "warmup": 20,
                                         "weight_decay": 0.0, "grad_clip": 1.0})
    return c


SFT_FIELD_DOCS = {
    "tiny": "build the embedded default's start point in `out_dir` (ignores model.path and data.files)",
    "out_dir": "the Hugging Face folder to write",
    "seed": "data order seed (and the start point's, with `tiny`)",
    "compile_cache_dir": "JAX's persistent compilation cache (`\"\"` = off), as the trainer's field",
    "model.path": "local Hugging Face folder to fine-tune, or a Hub id `ORG/NAME[@REVISION]` (the Hugging Face cache)",
    "model.dtype": "activation dtype (`float32`, `bfloat16`)",
    "model.param_dtype": "weight dtype",
    "model.remat": "rematerialise each layer in the backward pass",
    "data.files": "comma-separated parquet/jsonl files or folders with `prompt` and `response` columns",
    "data.max_length": "prompt + response tokens kept per row (longer rows are cut)",
    "train.steps": "optimizer steps",
    "train.batch": "rows per step",
    "train.lr": "peak learning rate (linear warm-up, cosine decay to a tenth)",
    "train.warmup": "warm-up steps",
    "train.weight_decay": "AdamW weight decay",
    "train.grad_clip": "global gradient-norm clip",
}
COMMAND = Command(
    name="arlopti_jax.sft", doc=__doc__, default_config=sft_config, docs=SFT_FIELD_DOCS,
    examples=(
        "python -m arlopti_jax.sft --config.model.path=/models/Qwen2.5-0.5B-Instruct "
        "--config.data.files=pairs.jsonl --config.out_dir=runs/sft",
        "python -m arlopti_jax.tasks.kk sft --people 3 --count 1000 --seed 0 --out kk3_sft.jsonl"
        "   # K&K worked solutions as pairs",
        "python -m arlopti_jax.sft --config.tiny=True --config.out_dir=runs/start_point   # the default's start point",
    ))


def main(argv) -> int:
    from absl import flags

    from arlopti_jax.runtime import chips
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import ModelConfig, hub, load_pretrained, save_pretrained
    from arlopti_jax.models.hf import check_weights
    from arlopti_jax.models.tokenizer import load_tokenizer
    from arlopti_jax.finetune.supervised import batch_schedule, read_pairs, tokenize_pairs, train_sft
    from arlopti_jax.tasks.data import resolve_data_files

    cfg = flags.FLAGS.config
    out = Path(cfg.out_dir)
    if cfg.tiny:
        from arlopti_jax.embedded.start_point import ensure_start_point

        chips.print_backend()
        startup_done(COMMAND.name)
        ensure_start_point(out, seed=cfg.seed)
        print(f"start point written to {out}")
        return 0
    if not cfg.model.path or not cfg.data.files:
        print("error: set --config.model.path and --config.data.files (or --config.tiny=True)", file=sys.stderr)
        return 2
    try:
        model_path = hub.resolve(cfg.model.path)  # a folder, or a Hub id's snapshot
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not (model_path / "config.json").is_file():
        print(f"error: config.model.path={cfg.model.path}: not a Hugging Face model folder (no config.json)",
              file=sys.stderr)
        return 2
    try:
        # an architecture this project does not implement, or weights config.json does not describe, stop here
        check_weights(model_path, ModelConfig.from_pretrained(model_path))
    except ValueError as err:
        print(f"error: config.model.path={cfg.model.path}: {err}", file=sys.stderr)
        return 2
    try:  # none there, unreadable, or more tokens than the model has rows
        tokenizer = load_tokenizer(model_path)
    except ValueError as err:
        print(f"error: config.model.path={cfg.model.path}: {err}", file=sys.stderr)
        return 2
    # the data is read, tokenized and scheduled at start-up: a missing file or column, a prompt that
    # cannot be rendered or too few rows for one batch stops here, in one line
    try:
        data = tokenize_pairs(read_pairs(resolve_data_files(cfg.data.files.split(","))), tokenizer,
                              cfg.data.max_length)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: config.data.files: {err}", file=sys.stderr)
        return 2
    try:
        schedule = batch_schedule(data["attention_mask"].sum(1), cfg.train.batch, cfg.train.steps, cfg.seed)
    except ValueError as err:
        print(f"error: config.train.batch={cfg.train.batch}: config.data.files ({cfg.data.files}): {err}",
              file=sys.stderr)
        return 2
    chips.print_backend()
    startup_done(COMMAND.name)
    mesh = shd.make_mesh({"fsdp": -1})
    model_cfg, params = load_pretrained(model_path, mesh=mesh, dtype=cfg.model.dtype,
                                        param_dtype=cfg.model.param_dtype, remat=cfg.model.remat)
    params, losses = train_sft(model_cfg, params, data, schedule, lr=cfg.train.lr, warmup=cfg.train.warmup,
                               weight_decay=cfg.train.weight_decay, grad_clip=cfg.train.grad_clip, mesh=mesh)
    save_pretrained(model_cfg, params, out, tokenizer_dir=model_path)
    print(f"sft: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; wrote {out}")
    return 0


def _cli():
    from ml_collections import config_flags

    from arlopti_jax.config.cli import parse_command_line

    define = lambda: config_flags.DEFINE_config_dict("config", sft_config(), lock_config=True)
    argv = parse_command_line(sys.argv, COMMAND, define)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main(argv))


if __name__ == "__main__":
    _cli()
