"""Evaluate a Hugging Face folder or a training checkpoint on test sets.

    python -m arlopti_jax.eval --config=configs/kk.py:3b,grpo --config.model.path=DIR \\
        --config.data.test_files=data/kk/3ppl/test.parquet [--checkpoint=RUN/checkpoints/120]

Without ``--checkpoint`` the model in ``config.model.path`` is evaluated. Per test file: greedy
accuracy and reward, and from ``train.eval_n`` samples per prompt (at
``train.eval_temperature``) the sampled accuracy and pass@k, maj@k and mean@k for k in
``train.eval_ks`` (definitions in ``arlopti_jax.rl.evaluation``). Results print as a table and
are appended to ``<run_dir>/eval.jsonl``; every response, with its extracted answer and score, is
kept in ``<run_dir>/generations/eval-<time>/<test set>.jsonl`` (``train.save_generations``).
No training files are needed.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a command: its own process's settings before JAX loads (runtime/process.py)
    from arlopti_jax.runtime import process

    process.prepare()

import sys
import time
from pathlib import Path

import jax

from arlopti_jax.runtime import chips, paths
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import lora
from arlopti_jax.rl import episode_host, resume, run_setup
from arlopti_jax.config.cli import Command, startup_done
from arlopti_jax.config import DEFAULT_CONFIG
from arlopti_jax.rl.evaluation import Evaluator, append_jsonl, format_table
from arlopti_jax.store.checkpoint import restore_subtree
from arlopti_jax.tasks import load_reward_fn

COMMAND = Command(
    name="arlopti_jax.eval", doc=__doc__, default_file=DEFAULT_CONFIG,
    flags=(("--checkpoint=RUN/checkpoints/STEP", "a training checkpoint step folder to evaluate instead of "
            "config.model.path's weights (the model folder still supplies the architecture and tokenizer)"),),
    examples=(
        "python -m arlopti_jax.eval --config=configs/kk.py:3b,grpo --config.model.path=/models/Qwen2.5-3B-Instruct"
        "   # a base model",
        "python -m arlopti_jax.eval --config=configs/kk.py:3b,grpo_ar_lopti"
        " --config.model.path=/models/Qwen2.5-3B-Instruct"
        " --checkpoint=runs/kk_3b_grpo_ar_lopti/checkpoints/120",
        "python -m arlopti_jax.eval --config.train.eval_n=8 --config.train.eval_ks=1,4,8"
        "   # the embedded default's start point: pass@k, maj@k, mean@k",
    ))


def adopt_checkpoint_settings(config, folder: Path) -> None:
    """Evaluate a checkpoint as it was trained: the model fields that shape or scale its parameters
    (``resume.PARAM_FIELDS``: LoRA rank, alpha and targets, the parameter dtype) are taken from the
    run config it records, with one line for each that differs from this command's."""
    meta = resume.checkpoint_meta(folder)
    if meta is None:
        raise ValueError(f"--checkpoint={folder}: no meta/metadata: not a complete arlopti_jax checkpoint")
    saved = resume.stored_config(meta)
    if "model" not in saved:
        return
    theirs, ours = resume.model_settings(saved), resume.model_settings(config)
    for name in resume.PARAM_FIELDS:
        if theirs[name] != ours[name]:
            value = ",".join(theirs[name]) if name == "lora_targets" else theirs[name]
            if jax.process_index() == 0:
                print(f"note: model.{name}={value} from the checkpoint {folder} (this command's is "
                      f"{','.join(ours[name]) if name == 'lora_targets' else ours[name]})")
            config.model[name] = value


def main(argv) -> int:
    from absl import flags

    from arlopti_jax.config import ConfigError, validate

    config = flags.FLAGS.config
    try:
        dist.initialize(config)  # several processes: every one runs this command
        chips.print_backend()
        validate(config, jax.device_count(), jax.default_backend(), shd.slice_count(jax.devices()))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    mesh = run_setup.make_mesh(config)
    checkpoint = flags.FLAGS.checkpoint
    try:
        paths.check_writable(config.run_dir, "config.run_dir")  # eval.jsonl and the responses go there
        model_path, _, test_files = run_setup.resolve_paths(config, need_train=False)
        if not test_files:
            raise ValueError("config.data.test_files is empty: nothing to evaluate")
        folder = paths.path(checkpoint, "--checkpoint") if checkpoint else None
        if folder is not None:
            if not (folder.is_dir() and folder.name.isdigit()):
                raise ValueError(f"--checkpoint={checkpoint}: not a checkpoint step folder (…/checkpoints/<step>)")
            adopt_checkpoint_settings(config, folder)
            # a LoRA checkpoint's adapters go with the base they were trained on; its arrays with the model's shapes
            resume.check_checkpoint_base(folder, model_path, config.model.lora_rank)
            resume.check_checkpoint(config, run_setup.model_config(config, model_path), folder=folder, resuming=False)
        tokenizer = run_setup.load_tokenizer(model_path)
        if config.env.name:  # episodes as training runs them: a format the chat template cannot give stops here
            episode_host.check_episodes(config, tokenizer)
        sets = {}
        for f in test_files:
            try:
                sets[run_setup.eval_set_name(f)] = run_setup.prompt_dataset(config, [f], tokenizer)
            except ValueError as err:
                raise ValueError(f"config.data.test_files: {err}") from None
        reward_fn = load_reward_fn(config.reward.fn or None)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    startup_done(COMMAND.name)
    policy = run_setup.load_policy(config, mesh, model_path, tokenizer)
    run = run_setup.assemble(config, mesh, policy.model_cfg, eos_ids=run_setup.eos_ids(policy),
                             pad_id=run_setup.pad_id(policy), total_steps=None,
                             prompt_width=run_setup.longest_prompt(sets.values()))
    params, label = policy.params, str(model_path)
    if folder is not None:  # its parameters alone, not the optimizer state beside them
        params = restore_subtree(folder, {"params": resume.saved_state(policy.model_cfg, run.state)["params"]})
        params, label = params["params"], str(folder)
        if policy.model_cfg.lora_rank:  # adapter-only: on the folder's base
            params = lora.combine(lora.split(policy.params)[0], params)
    evaluator = Evaluator(config, run, policy.tokenizer, sets, reward_fn)
    start = time.time()
    generations = None
    records = paths.RunFolder(config.run_dir)  # a bucket's: written on this host, then copied up
    if jax.process_index() == 0:
        records.fetch()
    if config.train.save_generations:
        generations = records.local / "generations" / time.strftime("eval-%Y%m%d-%H%M%S")
    results = evaluator.run(params, jax.random.key(config.seed), generations)
    append_jsonl(records.local / "eval.jsonl", {"model": label, "time": time.time(), **evaluator.settings, **results})
    if jax.process_index() == 0:
        records.sync()
    if jax.process_index() == 0:
        print(format_table(results, evaluator.settings))
        print(f"evaluated {label} in {time.time() - start:.1f}s"
              + (f"; responses in {generations}/" if generations else ""))
    return 0


def _cli():
    from absl import flags

    from arlopti_jax.config.cli import define_config_file, parse_command_line

    def define():
        flags.DEFINE_string("checkpoint", "", "A checkpoint step folder (…/checkpoints/<step>) to evaluate.")
        define_config_file()

    sys.exit(main(parse_command_line(sys.argv, COMMAND, define)))


if __name__ == "__main__":
    _cli()
