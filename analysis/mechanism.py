"""The paper's Figure 1 on any model and task: the policy's own samples, split into pi_old quartiles.

    python analysis/mechanism.py --config=configs/smollm2.py:cpu,grpo --responses=128
    python analysis/mechanism.py --responses=64                     # the embedded default's start point

From one batch of ``--responses`` samples (the config's training prompts, rollout.n each, at
the rollout temperature), scored and turned into the config's advantages and token weights,
it prints per pi_old quartile of the response tokens:

- the token count, mean pi_old and mean |A~|;
- the gradient norm of the loss restricted to the quartile's tokens (the trainer's
  ``quartile/q*_grad_norm``), the evidence that low-probability tokens dominate the gradient;
- the isolation experiment (the trainer's ``isolation/*``): the change of each quartile's mean
  pi after one optimizer step on only the lowest (q1) or only the highest (q4) quartile's
  tokens, from the same start. Twice: with the config's AdamW (fresh state: its first step is
  about lr x sign(gradient) for every weight, so it hides how large each gradient is), and with
  plain SGD, whose step follows the gradient's size; the SGD learning rate makes a step on
  every token move the weights as far as that AdamW step does (lr x sqrt(weights) / |gradient|).

Any ``--config.<field>=<value>`` override applies, as for the trainer. Writes the table to
``--out`` (markdown) and prints it.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import numpy as np


def measure(config, responses: int) -> dict:
    import jax
    import optax

    from arlopti_jax import algos
    from arlopti_jax.rl import run_setup
    from arlopti_jax.rl.collect import Collector
    from arlopti_jax.store.metrics import Timer
    from arlopti_jax.tasks import load_reward_fn

    config.train.batch_prompts = responses // config.rollout.n
    mesh = run_setup.make_mesh(config)
    model_path, train_files, _ = run_setup.resolve_paths(config)
    policy = run_setup.load_policy(config, mesh, model_path)
    cfg, params = policy.model_cfg, policy.params
    iterator = run_setup.train_iterator(config, run_setup.prompt_dataset(config, train_files, policy.tokenizer))
    run = run_setup.assemble(config, mesh, cfg, eos_ids=run_setup.eos_ids(policy), pad_id=run_setup.pad_id(policy),
                             total_steps=1)
    collect = Collector(config, run.sampler, run.sampling(), load_reward_fn(config.reward.fn or None),
                        policy.tokenizer, mesh, Timer())
    sampled = collect(params, iterator, jax.random.key(config.seed))
    batch = {k: np.asarray(v) for k, v in sampled.batch.items()}
    passes = algos.prepare_updates(run.adv_cfg, run.weight_cfg, run.lopti_cfg, np.asarray(sampled.rewards),
                                   np.asarray(sampled.group_ids), batch["response_mask"], batch["old_logprobs"])
    advantages = sum(np.asarray(a) for a, _ in passes)
    logprobs_fn = run.logprobs
    if run.use_reference:
        batch["ref_logprobs"] = logprobs_fn(params, batch)
    o = config.optim
    adam = algos.make_optimizer(algos.OptimConfig(lr=o.lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay,
                                                  eps=o.eps, grad_clip=o.grad_clip, schedule="constant"))
    step = lambda optimizer: algos.make_train_step(cfg, run.loss_cfg, optimizer, mesh,
                                                   tokens_per_device=run.tokens_per_device,
                                                   chunk_size=config.model.logprob_chunk)
    adam_step = step(adam)
    full = {**batch, "advantages": advantages, "loss_mask": batch["response_mask"].astype(np.float32)}
    norms = algos.make_quartile_grad_norms(adam_step)(params, full)
    whole = float(adam_step.gradient(params, full)[1])
    sgd_lr = o.lr * np.sqrt(cfg.num_params()) / whole
    fresh = lambda optimizer: (lambda p: algos.init_opt_state(optimizer, cfg, p, mesh))
    isolation = {name: algos.isolation_experiment(step(opt), logprobs_fn, fresh(opt), params, full)
                 for name, opt in (("adamw", adam), ("sgd", optax.sgd(sgd_lr)))}
    q = {k: np.asarray(v) for k, v in algos.probability_quartiles(batch["old_logprobs"], advantages,
                                                                     batch["response_mask"]).items()}
    return {"responses": len(sampled.scores), "reward_mean": float(sampled.scores.mean()),
            "reward_std": float(sampled.scores.std()), "quartiles": q, "grad_norms": norms, "grad_norm_all": whole,
            "isolation": isolation, "sgd_lr": float(sgd_lr), "lr": o.lr,
            "temperature": config.rollout.temperature}


def table(m: dict) -> str:
    q = m["quartiles"]
    rows = [("tokens", q["count"], "{:.0f}"), ("mean pi_old", q["mean_prob"], "{:.3f}"),
            ("mean abs(A~)", q["mean_abs_adv"], "{:.3f}"), ("gradient norm", m["grad_norms"], "{:.3g}")]
    for name, label in (("adamw", "AdamW"), ("sgd", "SGD")):
        rows += [(f"change of mean pi, {label} step on q1 only", m["isolation"][name][0], "{:+.2e}"),
                 (f"change of mean pi, {label} step on q4 only", m["isolation"][name][1], "{:+.2e}")]
    lines = ["| measure | q1 (lowest pi_old) | q2 | q3 | q4 (highest) |", "|---|---|---|---|---|"]
    lines += [f"| {label} | " + " | ".join(fmt.format(v) for v in values) + " |" for label, values, fmt in rows]
    return "\n".join(lines)


def main(argv) -> int:
    from absl import flags

    from arlopti_jax.rl import run_setup
    from arlopti_jax.config.cli import startup_done
    from arlopti_jax.config import validate

    config = flags.FLAGS.config
    responses = flags.FLAGS.responses
    if responses % config.rollout.n:
        print(f"error: --responses={responses} is not a multiple of rollout.n={config.rollout.n}", file=sys.stderr)
        return 2
    logging.getLogger("absl").setLevel(logging.WARNING)
    validate(config)
    try:
        run_setup.resolve_paths(config)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    startup_done("analysis/mechanism.py")
    start = time.time()
    with config.unlocked():
        m = measure(config, responses)
    text = (f"{m['responses']} responses at temperature {m['temperature']:g} (reward mean {m['reward_mean']:.3f}, "
            f"std {m['reward_std']:.3f}); gradient norm over every token {m['grad_norm_all']:.3g}; one step at "
            f"AdamW lr {m['lr']:g} or SGD lr {m['sgd_lr']:.3g}; {time.time() - start:.0f} s\n\n{table(m)}\n")
    out = Path(flags.FLAGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


def _cli():
    from absl import flags
    from ml_collections import config_flags

    from arlopti_jax.config.cli import Command, parse_command_line
    from arlopti_jax.config import DEFAULT_CONFIG

    command = Command(
        name="analysis/mechanism.py", doc=__doc__, default_file=DEFAULT_CONFIG,
        flags=(("--responses=128", "responses of the batch (prompts x rollout.n)"),
               ("--out=runs/mechanism.md", "markdown file for the table")),
        examples=("python analysis/mechanism.py --config=configs/smollm2.py:cpu,grpo --responses=128",))

    def define():
        flags.DEFINE_integer("responses", 128, "responses of the batch (prompts x rollout.n)")
        flags.DEFINE_string("out", "runs/mechanism.md", "markdown file for the table")
        config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Python config file (see configs/).")

    sys.exit(main(parse_command_line(sys.argv, command, define)))


if __name__ == "__main__":
    _cli()
