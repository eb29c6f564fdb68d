"""pi_old from the sampler or from a teacher-forced pass: how far apart are they, and does it matter?

    JAX_PLATFORMS=cuda python bench/logprob_gap.py --shape 1.5b --dtype bfloat16      # GPU
    python bench/logprob_gap.py --shape 0.5b --layers 2 --batch 8 --gen-len 32        # CPU smoke run

The sampler records log pi_old of each drawn token from its decode step (a KV-cache read, one
query); ``rollout.recompute_old_logprobs`` replaces them with a teacher-forced pass over the
whole sequence (the update's own computation). In float32 the two agree to rounding; in
bfloat16 the different reduction orders can move them apart, and the PPO ratio of the first
mini-batch, exp(logp - old_logp), then starts away from 1 for some tokens and clips them before
the policy has moved. This script measures that, on the paper's settings (rollout temperature
0.7, clip 0.2 / 0.24, KL 0.001, lr 1e-6):

  gap         over the response tokens: log-prob difference (teacher-forced - sampler), mean
              and max |.|, the ratio exp(difference) mean, min and max, and the share of tokens
              whose ratio already lies outside [1 - 0.2, 1 + 0.24];
  first step  the train step on the first mini-batch (GRPO advantages of random rewards), with
              pi_old from the sampler (recompute off) and from the teacher-forced pass (recompute
              on): ratio_mean, ratio_max and the clipped share (clipfrac_low + clipfrac_high).

The policy is random (``common.SHAPES``), with float32 master weights and the ``--dtype``
compute. A random model of this width is near-uniform over its 151,936 tokens (about 11.9 nats
of entropy per token), unlike a trained one; ``--logit-scale`` multiplies the tied embedding
(so the logits, as the residual stream is dominated by it) to give sharper distributions: the
script prints the sampled tokens' mean entropy at each scale, and measures each scale given.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from arlopti_jax import algos  # noqa: E402
from arlopti_jax.models import init_params  # noqa: E402
from arlopti_jax.rollout import Sampler, SamplingConfig  # noqa: E402
from arlopti_jax.runtime import sharding as shd  # noqa: E402
from common import add_shape_flags, model_config, shape_dims  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_flags(ap, default="1.5b")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="compute dtype")
    ap.add_argument("--batch", type=int, default=64, help="responses (prompts x --group)")
    ap.add_argument("--group", type=int, default=8, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=512, help="response tokens (no EOS: every row runs to it)")
    ap.add_argument("--mini-batch", type=int, default=32, help="rows of the first mini-batch")
    ap.add_argument("--micro-tokens", type=int, default=8192, help="token budget of a packed micro-batch")
    ap.add_argument("--temperature", type=float, default=0.7, help="rollout temperature (the paper's K&K: 0.7)")
    ap.add_argument("--logit-scale", default="1,8", help="comma-separated multipliers of the tied embedding")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def scale_embedding(params, factor: float):
    """``params`` with the token embedding (tied: also the output projection) multiplied."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x * factor if "embedding" in jax.tree_util.keystr(path) else x, params)


def gap_stats(tf: np.ndarray, sampled: np.ndarray, mask: np.ndarray, clip_low: float, clip_high: float) -> dict:
    m = mask > 0
    diff = (tf - sampled)[m].astype(np.float64)
    ratio = np.exp(diff)
    return {"tokens": int(m.sum()), "mean_abs": float(np.abs(diff).mean()), "max_abs": float(np.abs(diff).max()),
            "ratio_mean": float(ratio.mean()), "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
            "outside_clip": float(((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).mean())}


def main(argv=None) -> int:
    args = parse_args(argv)
    d = shape_dims(args)
    if not d["tied"]:
        raise SystemExit(f"--shape {args.shape} has untied embeddings: --logit-scale scales the tied one only")
    if args.batch % args.group or args.mini_batch % args.group or args.batch < args.mini_batch:
        raise SystemExit("--batch and --mini-batch must be multiples of --group, --mini-batch <= --batch")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.device_count()} devices, {dev.platform}); model {args.shape} {d}, "
          f"compute {args.dtype}, params float32; {args.batch} responses ({args.group} per prompt) of "
          f"{args.gen_len} tokens after {args.prompt_len}-token prompts, temperature {args.temperature}", flush=True)
    cfg = model_config(d, dtype=args.dtype, param_dtype="float32").replace(eos_token_id=None)
    mesh = shd.make_mesh({"fsdp": -1})
    loss_cfg = algos.LossConfig(kl_coef=0.001, temperature=args.temperature)
    optimizer = algos.make_optimizer(algos.OptimConfig(lr=1e-6))
    tokens = max(args.micro_tokens, -(-(args.prompt_len + args.gen_len) // 64) * 64)
    shapes = algos.packing.shapes_for(tokens, args.prompt_len + args.gen_len)  # the trainer's (run_setup.pack_shapes)
    step_fn = algos.make_train_step(cfg, loss_cfg, optimizer, mesh, tokens_per_device=tokens, shapes=shapes)
    logprobs_fn = algos.make_compute_logprobs(cfg, mesh, temperature=args.temperature, tokens_per_device=tokens,
                                              shapes=shapes)
    sampler = Sampler(cfg, mesh)
    sampling = SamplingConfig(max_response_len=args.gen_len, temperature=args.temperature, eos_ids=(),
                              prompt_bucket=args.prompt_len, batch_bucket=args.batch // args.group,
                              length_aware=False)  # fixed lengths: one decode program (same tokens)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, d["vocab"], args.prompt_len).tolist() for _ in range(args.batch // args.group)]
    base = init_params(cfg, jax.random.key(args.seed), mesh)
    rows = []
    for factor in (float(f) for f in args.logit_scale.split(",")):
        params = scale_embedding(base, factor)
        t = time.perf_counter()
        rollout = sampler.generate(params, prompts, args.group, jax.random.key(args.seed + 1), sampling)
        batch = rollout.train_batch()
        t_roll = time.perf_counter() - t
        t = time.perf_counter()
        tf = np.asarray(logprobs_fn(params, batch))
        t_tf = time.perf_counter() - t
        mask = batch["response_mask"]
        gap = gap_stats(tf, batch["old_logprobs"], mask, loss_cfg.clip_low, loss_cfg.clip_high)
        # entropy proxy: minus the mean log-prob of the sampled tokens (an unbiased estimate of H)
        gap["entropy"] = float(-(batch["old_logprobs"] * mask).sum() / mask.sum())
        first = slice(0, args.mini_batch)
        rewards = rng.choice([-1.0, 3.0], args.mini_batch).astype(np.float32)
        for recompute in (False, True):
            mb = {k: v[first] for k, v in batch.items()}
            mb["old_logprobs"] = tf[first] if recompute else batch["old_logprobs"][first]
            mb["ref_logprobs"] = tf[first]
            passes = algos.prepare_updates(algos.AdvantageConfig("grpo"), algos.TokenWeightConfig("none"),
                                           algos.LoptiConfig(False), rewards, rollout.group_ids[first],
                                           mb["response_mask"], mb["old_logprobs"])
            p = jax.tree.map(jnp.copy, params)  # the step donates its inputs
            opt_state = algos.init_opt_state(optimizer, cfg, p, mesh)
            _, _, (metrics,) = algos.update_on_batch(step_fn, p, opt_state, mb, passes, args.mini_batch)
            gap["recompute_on" if recompute else "recompute_off"] = {
                "ratio_mean": metrics["ratio_mean"], "ratio_max": metrics["ratio_max"],
                "clipfrac": metrics["clipfrac_low"] + metrics["clipfrac_high"]}
        gap.update(scale=factor, rollout_s=t_roll, teacher_forced_s=t_tf)
        rows.append(gap)
        print(f"scale {factor:g}: entropy {gap['entropy']:.2f} nats; |logp_tf - logp_sampler| mean "
              f"{gap['mean_abs']:.2e} max {gap['max_abs']:.2e}; ratio mean {gap['ratio_mean']:.5f} min "
              f"{gap['ratio_min']:.4f} max {gap['ratio_max']:.4f}; outside the clip range {gap['outside_clip']:.3%} "
              f"of {gap['tokens']} tokens (rollout {t_roll:.1f}s, teacher-forced {t_tf:.1f}s, compiles included)",
              flush=True)
    print("\n| logit scale | entropy (nats) | mean abs gap | max abs gap | ratio mean | ratio max | outside clip "
          "| first step, recompute off: ratio mean / max / clipped | recompute on: ratio mean / max / clipped |")
    print("|---" * 9 + "|")
    for g in rows:
        off, on = g["recompute_off"], g["recompute_on"]
        print(f"| {g['scale']:g} | {g['entropy']:.2f} | {g['mean_abs']:.2e} | {g['max_abs']:.2e} | "
              f"{g['ratio_mean']:.5f} | {g['ratio_max']:.4f} | {g['outside_clip']:.3%} | "
              f"{off['ratio_mean']:.5f} / {off['ratio_max']:.4f} / {off['clipfrac']:.3%} | "
              f"{on['ratio_mean']:.5f} / {on['ratio_max']:.4f} / {on['clipfrac']:.3%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
