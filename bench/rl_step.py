"""A full RL step, split by phase, on a random Qwen2.5-shaped policy; optionally the same workload
through transformers (PyTorch).

    python bench/rl_step.py --shape tiny
    python bench/rl_step.py --shape 0.5b --layers 2 --prompts 2 --n 4 --prompt-len 32 --gen-len 32 --hf   # CPU
    python bench/rl_step.py --shape 7b --prompts 64 --n 8 --prompt-len 448 --gen-len 4096 --mini-batch 256 \
        --micro 8 --dtype bfloat16 --remat                                                                   # GPU/TPU

The phases are train.py's step without data loading (GRPO + AR + Lopti, KL on):
  rollout       sampler.generate: prefill, then --gen-len decode steps (no EOS: fixed length)
  reward        host scoring of every response: a synthetic verifiable reward on the token ids
                (3 when most tokens are even, else -1), standing in for K&K / math grading
  ref_logprobs  teacher-forced log-probs under the frozen reference policy
  advantages    prepare_updates: GRPO advantages, AR weights, the Lopti split
  update        update_on_batch: two Lopti passes x (responses / mini-batch) AdamW steps
A warm-up step compiles; --steps more are timed (median per phase). Reported: seconds and share
of the step per phase, rollout tokens/s (generated tokens), update tokens/s (tokens through
forward + backward, both passes) with MFU = 6 x params x tokens / time / peak, and the step's
overall model FLOP rate. --hf runs the same phases in transformers: generate with sampling
(log-probs of the drawn tokens from its logits), the reference forward, the same advantage
arithmetic, and the same micro-batched PPO + KL mini-batch steps with torch.optim.AdamW.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory for torch
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's spinning threads starve XLA's on a shared CPU
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("rollout", "reward", "ref_logprobs", "advantages", "update")


def parse_args(argv=None):
    from shapes import add_shape_flags

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_flags(ap)
    ap.add_argument("--mesh", default="fsdp=-1")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--mini-batch", type=int, default=0, help="responses per optimizer step (0: all)")
    ap.add_argument("--micro", type=int, default=1, help="micro-batches per mini-batch")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step")
    ap.add_argument("--peak-tflops", type=float, help="peak FLOP/s per device (default: table / measured on CPU)")
    ap.add_argument("--hf", action="store_true", help="also run the step in transformers (PyTorch)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.mini_batch = args.mini_batch or args.prompts * args.n
    if (args.prompts * args.n) % args.mini_batch or args.mini_batch % args.micro:
        ap.error("--mini-batch must divide prompts x n, and --micro the mini-batch")
    return args


def synthetic_reward(response_ids) -> float:
    """A verifiable reward computed on the host from one response's token ids."""
    return 3.0 if (sum(1 for t in response_ids if t % 2 == 0) * 2 > len(response_ids)) else -1.0


def report(name: str, times: dict[str, list[float]], gen_tokens: int, train_tokens: int, ref_tokens: int,
           prefill_tokens: int, num_params: int, peak: float) -> None:
    med = {p: statistics.median(times[p]) for p in PHASES}
    total = sum(med.values())
    print(f"{name}: RL step {total:.2f} s")
    for p in PHASES:
        print(f"  {p:<13} {med[p]:9.3f} s  {med[p] / total:6.1%}")
    update_flops = 6.0 * num_params * train_tokens
    step_flops = 2.0 * num_params * (gen_tokens + prefill_tokens + ref_tokens) + update_flops
    print(f"  rollout {gen_tokens / med['rollout']:,.0f} generated tokens/s; update {train_tokens / med['update']:,.0f} "
          f"tokens/s, {update_flops / med['update'] / 1e12:.3f} TFLOP/s, MFU {update_flops / med['update'] / peak:.1%}; "
          f"whole step {step_flops / total / 1e12:.3f} TFLOP/s ({step_flops / total / peak:.1%} of peak)")


def run_jax(args, d, prompts):
    import jax
    import numpy as np

    from arlopti_jax import algos
    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import init_params
    from arlopti_jax.rollout import Sampler, SamplingConfig
    from shapes import model_config

    mesh = shd.make_mesh({k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))})
    cfg = model_config(d, dtype=args.dtype, param_dtype="float32", remat=args.remat)
    params = init_params(cfg, jax.random.key(args.seed), mesh)
    ref_params = jax.tree.map(lambda x: x.copy(), params)
    optimizer = algos.make_optimizer(algos.OptimConfig(lr=1e-6))
    opt_state = algos.init_opt_state(optimizer, cfg, params, mesh)
    loss_cfg = algos.LossConfig(kl_coef=0.001)
    rows = max(1, args.mini_batch // args.micro // shd.batch_divisor(mesh))  # a dense micro-batch's rows per device
    tokens = -(-rows * (args.prompt_len + args.gen_len) // 64) * 64  # packed tokens per device and micro-batch
    train_step = algos.make_train_step(cfg, loss_cfg, optimizer, mesh, tokens_per_device=tokens)
    logprobs_fn = algos.make_compute_logprobs(cfg, mesh, tokens_per_device=tokens)
    sampler = Sampler(cfg, mesh)
    sampling = SamplingConfig(max_response_len=args.gen_len, eos_ids=(), prompt_bucket=args.prompt_len,
                              batch_bucket=args.prompts)
    adv_cfg, weights = algos.AdvantageConfig("grpo"), algos.TokenWeightConfig("ar", alpha=0.3)
    lopti = algos.LoptiConfig(True, 0.5)
    times = {p: [] for p in PHASES}
    counts = {}
    for step in range(args.steps + 1):
        t = {}
        start = time.perf_counter()
        rollout = sampler.generate(params, prompts, args.n, jax.random.fold_in(jax.random.key(args.seed), step),
                                   sampling)
        t["rollout"] = time.perf_counter() - start
        start = time.perf_counter()
        scores = np.array([synthetic_reward(r) for r in rollout.responses()], np.float32)
        t["reward"] = time.perf_counter() - start
        batch = rollout.train_batch()
        start = time.perf_counter()
        batch["ref_logprobs"] = jax.block_until_ready(logprobs_fn(ref_params, batch))
        t["ref_logprobs"] = time.perf_counter() - start
        start = time.perf_counter()
        passes = jax.block_until_ready(algos.prepare_updates(adv_cfg, weights, lopti, scores, rollout.group_ids,
                                                             batch["response_mask"], batch["old_logprobs"]))
        t["advantages"] = time.perf_counter() - start
        start = time.perf_counter()
        params, opt_state, metrics = algos.update_on_batch(train_step, params, opt_state, batch, passes,
                                                           args.mini_batch)
        t["update"] = time.perf_counter() - start
        label = "warm-up (compiles)" if step == 0 else f"step {step}"
        print(f"  ours {label}: " + ", ".join(f"{p} {t[p]:.2f}s" for p in PHASES))
        if step:
            for p in PHASES:
                times[p].append(t[p])
        counts = dict(gen=int(rollout.lengths.sum()), train=int(batch["attention_mask"].sum()) * len(passes),
                      ref=int(batch["attention_mask"].sum()), prefill=len(prompts) * args.prompt_len)
    return times, counts, cfg.num_params(), metrics


def run_torch(args, d, prompts):
    import torch

    from shapes import hf_model
    from train_step import torch_minibatch_step, torch_token_logprobs

    model = hf_model(d, args.dtype, args.seed)
    ref = hf_model(d, args.dtype, args.seed).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    ids = torch.tensor(prompts, dtype=torch.long)
    rows = args.prompts * args.n
    times = {p: [] for p in PHASES}
    for step in range(args.steps + 1):
        t = {}
        torch.manual_seed(args.seed + step)
        start = time.perf_counter()
        model.eval()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=args.gen_len, min_new_tokens=args.gen_len,
                                 num_return_sequences=args.n, pad_token_id=0, eos_token_id=2,
                                 return_dict_in_generate=True, output_logits=True)
            resp = out.sequences[:, ids.shape[1]:]
            logits = torch.stack(out.logits, 1).float()
            old = torch.log_softmax(logits, -1).gather(-1, resp[..., None])[..., 0]
        t["rollout"] = time.perf_counter() - start
        start = time.perf_counter()
        scores = torch.tensor([synthetic_reward(r) for r in resp.tolist()])
        t["reward"] = time.perf_counter() - start
        seq = out.sequences
        zeros = torch.zeros(rows, ids.shape[1])
        batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq),
                 "response_mask": torch.cat([zeros, torch.ones_like(old)], 1),
                 "old_logprobs": torch.cat([zeros, old], 1)}
        start = time.perf_counter()
        with torch.no_grad():
            chunks = [torch_token_logprobs(ref, batch["input_ids"][r], batch["attention_mask"][r])
                      for r in torch.arange(rows).chunk(rows // args.mini_batch * args.micro)]
        batch["ref_logprobs"] = torch.cat([torch.zeros(rows, 1), torch.cat(chunks)], 1)
        t["ref_logprobs"] = time.perf_counter() - start
        start = time.perf_counter()
        g = scores.view(args.prompts, args.n)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(rows, 1)
        p_old = batch["old_logprobs"].exp()
        adv = adv * (0.3 * p_old + 0.7) * batch["response_mask"]  # AR, alpha 0.3
        low = (p_old < 0.5).float() * batch["response_mask"]
        passes = [(adv * low, low), (adv * (batch["response_mask"] - low), batch["response_mask"] - low)]
        t["advantages"] = time.perf_counter() - start
        start = time.perf_counter()
        model.train()
        for a, m in passes:
            for chunk in torch.arange(rows).chunk(rows // args.mini_batch):
                mini = {k: v[chunk] for k, v in {**batch, "advantages": a, "loss_mask": m}.items()}
                torch_minibatch_step(model, opt, mini, args.micro)
        t["update"] = time.perf_counter() - start
        label = "warm-up" if step == 0 else f"step {step}"
        print(f"  transformers {label}: " + ", ".join(f"{p} {t[p]:.2f}s" for p in PHASES))
        if step:
            for p in PHASES:
                times[p].append(t[p])
    return times, torch.get_num_threads()


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np

    from shapes import DIM_FLAGS, dims
    from train_step import device_peak

    d = dims(args.shape, **{k: getattr(args, k) for k in DIM_FLAGS})
    prompts = np.random.default_rng(args.seed).integers(3, d["vocab"], (args.prompts, args.prompt_len)).tolist()
    per_device, source = device_peak(args.peak_tflops)
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, peak "
          f"{per_device / 1e12:.3f} TFLOP/s per device ({source})")
    print(f"model: {args.shape} dims hidden={d['hidden']} intermediate={d['intermediate']} layers={d['layers']} "
          f"heads={d['heads']}/{d['kv_heads']} vocab={d['vocab']} tied={d['tied']}, dtype {args.dtype}, "
          f"remat {args.remat}; step: {args.prompts} prompts x {args.n}, prompt {args.prompt_len} + "
          f"response {args.gen_len} tokens, mini-batch {args.mini_batch} in {args.micro} micro-batches, Lopti 2 passes")
    times, counts, num_params, metrics = run_jax(args, d, prompts)
    print(f"params {num_params / 1e6:.1f}M; last update loss {metrics[-1]['loss']:.4f}")
    report("ours (jax)", times, counts["gen"], counts["train"], counts["ref"], counts["prefill"], num_params,
           per_device * jax.device_count())
    if args.hf:
        hf_times, threads = run_torch(args, d, prompts)
        report(f"transformers (torch, {threads} threads)", hf_times, counts["gen"], counts["train"], counts["ref"],
               counts["prefill"], num_params, per_device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
