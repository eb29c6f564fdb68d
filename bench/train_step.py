"""Train-step throughput and compile count on a small random policy.

    python bench/train_step.py                      # CPU, 1 device
    python bench/train_step.py --devices 8 --mesh fsdp=4,tensor=2
    python bench/train_step.py --layers 8 --hidden 512 --batch 64 --seq 512   # on an accelerator

Runs ``--steps`` train steps on one mini-batch shape and one Lopti rollout-batch update
(``update_on_batch``: 2 passes x 2 mini-batches), prints tokens/s (all tokens through the
forward and backward pass; response tokens separately) and counts XLA compilations with
``jax_log_compiles``: after the warm-up step, and after the first rollout batch, there must
be none (asserted).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=0, help="fake CPU devices (0 = the platform's own)")
    ap.add_argument("--mesh", default="fsdp=-1", help="mesh axes, e.g. fsdp=4,tensor=2")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="mini-batch rows")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per mini-batch")
    ap.add_argument("--seq", type=int, default=256, help="prompt + response tokens")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    return ap.parse_args()


class CompileCounter(logging.Handler):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation of "):
            self.names.append(msg.split(" of ", 1)[1].split(" in ")[0])

    def since(self, start: int) -> list[str]:
        return self.names[start:]


def main():
    args = parse_args()
    if args.devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from arlopti_jax import algos
    from arlopti_jax import sharding as shd
    from arlopti_jax.models import ModelConfig, init_params

    jax.config.update("jax_log_compiles", True)
    counter = CompileCounter()
    logging.getLogger("jax").addHandler(counter)
    logging.getLogger("jax").propagate = False  # count, do not print

    mesh = shd.make_mesh({k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))})
    head_dim = args.hidden // args.heads
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=head_dim,
                      dtype=args.dtype)
    params = init_params(cfg, jax.random.key(0), mesh)
    optimizer = algos.make_optimizer(algos.OptimConfig(lr=1e-5))
    opt_state = algos.init_opt_state(optimizer, cfg, params, mesh)
    loss_cfg = algos.LossConfig(kl_coef=0.001)
    step = algos.make_train_step(cfg, loss_cfg, optimizer, mesh, num_micro_batches=args.micro)
    logprobs = algos.make_compute_logprobs(cfg, mesh, num_micro_batches=args.micro)

    rows, t = 2 * args.batch, args.seq  # a rollout batch of two mini-batches
    rng = np.random.default_rng(0)
    prompt = t // 4
    resp_len = rng.integers(t // 8, t - prompt + 1, rows)
    ids = rng.integers(3, args.vocab, (rows, t)).astype(np.int32)
    attn = (np.arange(t)[None] < prompt + resp_len[:, None]).astype(np.int32)
    resp = ((np.arange(t)[None] >= prompt) & (attn > 0)).astype(np.float32)
    rollout = {"input_ids": ids, "attention_mask": attn, "response_mask": resp}
    rollout["old_logprobs"] = np.asarray(logprobs(params, rollout)) * resp
    rollout["ref_logprobs"] = rollout["old_logprobs"]
    rewards = rng.choice([-1.0, 3.0], rows).astype(np.float32)
    group_ids = np.repeat(np.arange(rows // 8), 8).astype(np.int32)

    adv_cfg, weights = algos.AdvantageConfig("grpo"), algos.TokenWeightConfig("ar", alpha=0.3)
    (adv, mask), = algos.prepare_updates(adv_cfg, weights, algos.LoptiConfig(), rewards, group_ids, resp,
                                         rollout["old_logprobs"])
    mini = {k: np.asarray(v)[:args.batch] for k, v in {**rollout, "advantages": adv, "loss_mask": mask}.items()}
    tokens, response_tokens = int(mini["attention_mask"].sum()), int(mini["response_mask"].sum())

    print(f"devices {jax.device_count()} ({jax.devices()[0].platform}), mesh {dict(mesh.shape)}, "
          f"params {cfg.num_params() / 1e6:.2f}M, mini-batch {args.batch}x{t} in {args.micro} micro-batches")
    start = time.perf_counter()
    params, opt_state, metrics = step(params, opt_state, mini)
    jax.block_until_ready(metrics)
    print(f"first step (trace + compile): {time.perf_counter() - start:.2f}s, "
          f"compilations so far: {len(counter.names)}")

    mark = len(counter.names)
    start = time.perf_counter()
    for _ in range(args.steps):
        params, opt_state, metrics = step(params, opt_state, mini)
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - start
    steady = counter.since(mark)
    print(f"{args.steps} steps: {elapsed / args.steps * 1e3:.1f} ms/step, {tokens * args.steps / elapsed:,.0f} tokens/s "
          f"({response_tokens * args.steps / elapsed:,.0f} response tokens/s), loss {float(metrics['loss']):.4f}")
    print(f"compilations during the {args.steps} steps: {len(steady)}; "
          f"train-step cache size: {step.num_compilations()}")
    assert not steady and step.num_compilations() == 1, f"recompiled per step: {steady}"

    lopti = algos.LoptiConfig(True, 0.5)
    for attempt in ("first", "second"):
        mark = len(counter.names)
        passes = algos.prepare_updates(adv_cfg, weights, lopti, rewards, group_ids, resp, rollout["old_logprobs"])
        start = time.perf_counter()
        params, opt_state, pass_metrics = algos.update_on_batch(step, params, opt_state, rollout, passes, args.batch)
        elapsed = time.perf_counter() - start
        steps = sum(int(m["optimizer_steps"]) for m in pass_metrics)
        print(f"{attempt} Lopti rollout batch ({rows} rows): {len(passes)} passes, {steps} optimizer steps, "
              f"{elapsed:.2f}s, compilations: {len(counter.since(mark))} {counter.since(mark)}")
    assert not counter.since(mark), "a second rollout batch of the same shape recompiled"
    assert step.num_compilations() == 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
