"""Train-step throughput, MFU and compile count on a random policy; optionally the same workload
through transformers (PyTorch).

    python bench/train_step.py                      # CPU, a small custom model
    python bench/train_step.py --devices 8 --mesh fsdp=4,tensor=2
    python bench/train_step.py --shape 3b --layers 2 --batch 4 --seq 256 --micro 2 --hf   # CPU, real widths
    python bench/train_step.py --shape 7b --batch 64 --seq 4608 --micro 8 --remat --dtype bfloat16  # accelerator

Runs ``--steps`` train steps on one mini-batch shape and one Lopti rollout-batch update
(``update_on_batch``: 2 passes x 2 mini-batches), prints tokens/s (all tokens through the
forward and backward pass; response tokens separately), achieved FLOP/s = 6 x params x tokens /
time and MFU = that / (peak x devices) (peak: the device's bf16 peak from the chip table, or
--peak-tflops; on CPU, the measured float32 matmul rate of ``common.matmul_peak``: a practical peak,
not the datasheet one, and noisy on a shared machine), and counts XLA compilations with ``jax_log_compiles``: after the
warm-up step, and after the first rollout batch, there must be none (asserted).

--hf times the same mini-batch step in transformers: Qwen2ForCausalLM of the same dimensions,
the same micro-batches, token log-probs from the full logits, the PPO clipped loss with the k3
KL term, backward, gradient clipping and torch.optim.AdamW.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's spinning threads starve XLA's on a shared CPU

import common  # noqa: E402

SMALL = dict(hidden=128, intermediate=512, layers=4, heads=4, kv_heads=2, vocab=2048, tied=False)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=0, help="fake CPU devices (0 = the platform's own)")
    ap.add_argument("--mesh", default="fsdp=-1", help="mesh axes, e.g. fsdp=4,tensor=2")
    common.add_shape_flags(ap, default=None)
    ap.add_argument("--batch", type=int, default=16, help="mini-batch rows")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per mini-batch")
    ap.add_argument("--seq", type=int, default=256, help="prompt + response tokens")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--remat", action="store_true", help="rematerialise each layer (model.remat)")
    ap.add_argument("--peak-tflops", type=float, help="peak FLOP/s per device for MFU (default: table by device)")
    ap.add_argument("--hf", action="store_true", help="also time the step in transformers (PyTorch)")
    ap.add_argument("--hf-steps", type=int, default=3)
    ap.add_argument("--skip-rollout-batch", action="store_true",
                    help="skip the Lopti rollout-batch update (and its no-recompilation check)")
    return ap.parse_args()


def throughput_line(name: str, seconds: float, tokens: int, response_tokens: int, num_params: int, peak) -> str:
    flops = 6.0 * num_params * tokens / seconds
    util = f"MFU {flops / peak:.1%}"
    return (f"{name}: {seconds * 1e3:.1f} ms/step, {tokens / seconds:,.0f} tokens/s "
            f"({response_tokens / seconds:,.0f} response tokens/s), {flops / 1e12:.3f} TFLOP/s, {util}")


def time_torch(d: dict, mini: dict, micro: int, steps: int, dtype: str):
    """Seconds per mini-batch step of the same workload in transformers."""
    import torch

    model = common.hf_model(d, dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    t = common.torch_batch(mini)
    step = lambda: common.torch_minibatch_step(model, opt, t, micro)
    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps, torch.get_num_threads()


def main():
    args = parse_args()
    if args.devices:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from arlopti_jax import algos
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import init_params

    counter = common.count_compiles()
    mesh = shd.make_mesh(common.mesh_axes(args.mesh))
    d = common.shape_dims(args, SMALL)
    cfg = common.model_config(d, dtype=args.dtype, param_dtype="float32", remat=args.remat)
    params = init_params(cfg, jax.random.key(0), mesh)
    optimizer = algos.make_optimizer(algos.OptimConfig(lr=1e-5))
    opt_state = algos.init_opt_state(optimizer, cfg, params, mesh)
    loss_cfg = algos.LossConfig(kl_coef=0.001)
    rows = max(1, args.batch // args.micro // shd.batch_divisor(mesh))  # a dense micro-batch's rows per device
    tokens = common.packed_budget(rows, args.seq)  # packed tokens per device and micro-batch
    shapes = algos.packing.shapes_for(tokens, args.seq)  # the trainer's shape set (rl/run_setup.pack_shapes)
    step = algos.make_train_step(cfg, loss_cfg, optimizer, mesh, tokens_per_device=tokens, shapes=shapes)
    logprobs = algos.make_compute_logprobs(cfg, mesh, tokens_per_device=tokens, shapes=shapes)

    rows, t = 2 * args.batch, args.seq  # a rollout batch of two mini-batches
    rng = np.random.default_rng(0)
    prompt = t // 4
    resp_len = rng.integers(t // 8, t - prompt + 1, rows)
    ids = rng.integers(3, d["vocab"], (rows, t)).astype(np.int32)
    attn = (np.arange(t)[None] < prompt + resp_len[:, None]).astype(np.int32)
    resp = ((np.arange(t)[None] >= prompt) & (attn > 0)).astype(np.float32)
    rollout = {"input_ids": ids, "attention_mask": attn, "response_mask": resp}
    rollout["old_logprobs"] = logprobs(params, rollout)
    rollout["ref_logprobs"] = rollout["old_logprobs"]
    rewards = rng.choice([-1.0, 3.0], rows).astype(np.float32)
    group_ids = np.repeat(np.arange(rows // 8), 8).astype(np.int32)

    adv_cfg, weights = algos.AdvantageConfig("grpo"), algos.TokenWeightConfig("ar", alpha=0.3)
    (adv, mask), = algos.prepare_updates(adv_cfg, weights, algos.LoptiConfig(), rewards, group_ids, resp,
                                         rollout["old_logprobs"])
    mini = {k: np.asarray(v)[:args.batch] for k, v in {**rollout, "advantages": adv, "loss_mask": mask}.items()}
    tokens, response_tokens = int(mini["attention_mask"].sum()), int(mini["response_mask"].sum())
    per_device, source = common.device_peak(args.peak_tflops)
    peak = per_device * jax.device_count()

    print(f"jax {jax.__version__}, devices {jax.device_count()} ({jax.devices()[0].device_kind}), "
          f"mesh {dict(mesh.shape)}; peak {per_device / 1e12:.3f} TFLOP/s per device ({source})")
    print(f"model: hidden={d['hidden']} intermediate={d['intermediate']} layers={d['layers']} heads={d['heads']} "
          f"kv_heads={d['kv_heads']} vocab={d['vocab']} tied={d['tied']} params {cfg.num_params() / 1e6:.1f}M, "
          f"dtype {args.dtype}, remat {args.remat}; mini-batch {args.batch}x{t} in {args.micro} micro-batches "
          f"({tokens} tokens)")
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
    elapsed = (time.perf_counter() - start) / args.steps
    steady = counter.since(mark)
    print(throughput_line(f"ours (jax), {args.steps} steps", elapsed, tokens, response_tokens, cfg.num_params(), peak)
          + f", loss {float(metrics['loss']):.4f}")
    print(f"compilations during the {args.steps} steps: {len(steady)}; "
          f"train-step cache size: {step.num_compilations()}")
    assert not steady, f"recompiled per step: {steady}"

    lopti = algos.LoptiConfig(True, 0.5)
    for attempt in () if args.skip_rollout_batch else ("first", "second"):
        mark = len(counter.names)
        passes = algos.prepare_updates(adv_cfg, weights, lopti, rewards, group_ids, resp, rollout["old_logprobs"])
        start = time.perf_counter()
        params, opt_state, pass_metrics = algos.update_on_batch(step, params, opt_state, rollout, passes, args.batch)
        elapsed = time.perf_counter() - start
        steps = sum(int(m["optimizer_steps"]) for m in pass_metrics)
        print(f"{attempt} Lopti rollout batch ({rows} rows): {len(passes)} passes, {steps} optimizer steps, "
              f"{elapsed:.2f}s, compilations: {len(counter.since(mark))} {counter.since(mark)}")
        assert attempt == "first" or not counter.since(mark), "a second rollout batch of the same shape recompiled"

    if args.hf:
        del params, opt_state
        seconds, threads = time_torch(d, mini, args.micro, args.hf_steps, args.dtype)
        print(throughput_line(f"transformers (torch {threads} threads), {args.hf_steps} steps", seconds, tokens,
                              response_tokens, cfg.num_params(), per_device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
