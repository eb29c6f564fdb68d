"""Rollout throughput: our jitted sampler vs transformers' ``generate`` on the same random model.

    python bench/rollout.py --shape tiny --batch 16 --prompt-len 64 --gen-len 64
    python bench/rollout.py --shape 1.5b --batch 64 --prompt-len 256 --gen-len 512 --dtype bfloat16
    python bench/rollout.py --shape 7b --layers 2 --vocab 32768 --batch 8 --gen-len 32   # CPU, real widths

Both sides generate exactly --gen-len tokens per sequence (ours: no EOS ids; transformers:
min_new_tokens = max_new_tokens) by sampling at temperature 1 from the full distribution
(or --greedy). Tokens/s counts generated tokens only, prompts prefilled included in the time.
On a GPU it also prints the decode steps' fraction of the memory-bandwidth roofline:
bytes per decode step = parameter bytes + the KV cache bytes a step must read (the
average context, prompt + gen/2, per sequence), over the measured decode-step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory for torch
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's spinning threads starve XLA's on a shared CPU
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from arlopti_jax import sharding as shd  # noqa: E402
from arlopti_jax.models import load_pretrained  # noqa: E402
from arlopti_jax.rollout import Sampler, SamplingConfig  # noqa: E402
from shapes import SHAPES, hf_model  # noqa: E402  (Qwen2.5-0.5B ... 7B dimensions)
# Peak HBM bandwidth, bytes/s, matched against jax's device_kind (first match wins).
PEAK_BANDWIDTH = (
    ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12), ("A100 80GB", 1.935e12), ("A100", 1.555e12),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="preset dimensions")
    for name in ("hidden", "layers", "heads", "kv-heads", "vocab", "intermediate"):
        p.add_argument(f"--{name}", type=int, help="override the preset")
    p.add_argument("--batch", type=int, default=16, help="generated sequences per call")
    p.add_argument("--group", type=int, default=1, help="samples per prompt (batch / group prompts)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--greedy", action="store_true", help="argmax decoding on both sides")
    p.add_argument("--iters", type=int, default=3, help="timed calls (after one warm-up)")
    p.add_argument("--peak-bw", type=float, help="peak memory bandwidth in GB/s (default: table by device)")
    p.add_argument("--skip-hf", action="store_true", help="time ours only")
    p.add_argument("--hf-device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dims = dict(SHAPES[args.shape])
    for name in ("hidden", "layers", "heads", "kv_heads", "vocab", "intermediate"):
        if getattr(args, name) is not None:
            dims[name] = getattr(args, name)
    if args.batch % args.group:
        p.error(f"--batch={args.batch} must be a multiple of --group={args.group}")
    if dims["heads"] % dims["kv_heads"] or dims["hidden"] % dims["heads"]:
        p.error("--heads must divide --hidden and be a multiple of --kv-heads")
    on_cpu = jax.default_backend() == "cpu"
    args.dtype = ("float32" if on_cpu else "bfloat16") if args.dtype == "auto" else args.dtype
    return args, dims


def build_hf_model(dims: dict, dtype: str, seed: int):
    return hf_model(dims, dtype, seed).eval()


def time_ours(folder: Path, args, prompts: list[list[int]]):
    mesh = shd.make_mesh({"fsdp": -1})
    cfg, params = load_pretrained(folder, mesh=mesh, dtype=args.dtype, param_dtype=args.dtype)
    sampler = Sampler(cfg, mesh)
    sampling = SamplingConfig(max_response_len=args.gen_len, greedy=args.greedy, eos_ids=(),
                              prompt_bucket=max(64, args.prompt_len), batch_bucket=len(prompts))
    key = jax.random.key(args.seed)

    t0 = time.perf_counter()
    roll = sampler.generate(params, prompts, args.group, key, sampling)  # compiles
    compile_s = time.perf_counter() - t0
    assert roll.response_ids.shape == (args.batch, args.gen_len) and roll.lengths.min() == args.gen_len

    batch = sampler.pad_prompts(prompts, sampling)
    totals, prefills = [], []
    for i in range(args.iters):
        k = jax.random.fold_in(key, i + 1)
        t0 = time.perf_counter()
        state = sampler.start(params, batch, args.group, k, sampling)
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        state = sampler.decode(params, state, k, sampling)
        np.asarray(state.tokens)
        t2 = time.perf_counter()
        prefills.append(t1 - t0)
        totals.append(t2 - t0)
    total, prefill = statistics.median(totals), statistics.median(prefills)
    step = (total - prefill) / max(1, args.gen_len - 1)
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    return dict(cfg=cfg, total=total, prefill=prefill, step=step, compile=compile_s, param_bytes=param_bytes,
                device=jax.devices()[0])


def time_hf(model, args, prompts: list[list[int]]):
    import torch

    device = args.hf_device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device)
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=args.gen_len, min_new_tokens=args.gen_len, pad_token_id=0,
              eos_token_id=2, num_return_sequences=args.group)
    kw.update(dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0))

    def run(n_new=None):
        extra = dict(max_new_tokens=n_new, min_new_tokens=n_new) if n_new else {}
        with torch.no_grad():
            out = model.generate(ids, **{**kw, **extra})
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    run(n_new=4)  # warm-up
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    assert out.shape == (args.batch, args.prompt_len + args.gen_len), out.shape
    return dict(total=statistics.median(times), device=device)


def peak_bandwidth(device, flag_gbs):
    if flag_gbs:
        return flag_gbs * 1e9
    kind = getattr(device, "device_kind", "")
    return next((bw for name, bw in PEAK_BANDWIDTH if name in kind), None)


def main(argv=None):
    args, dims = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, dims["vocab"], size=(args.batch // args.group, args.prompt_len)).tolist()
    model = build_hf_model(dims, args.dtype, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        ours = time_ours(Path(tmp), args, prompts)
    cfg, dev = ours["cfg"], ours["device"]
    generated = args.batch * args.gen_len
    print(f"model: hidden={dims['hidden']} layers={dims['layers']} heads={dims['heads']} "
          f"kv_heads={dims['kv_heads']} intermediate={dims['intermediate']} vocab={dims['vocab']} "
          f"params={cfg.num_params() / 1e6:.1f}M dtype={args.dtype}")
    print(f"run: batch={args.batch} ({args.batch // args.group} prompts x {args.group}) prompt_len={args.prompt_len} "
          f"gen_len={args.gen_len} {'greedy' if args.greedy else 'sampling T=1'} device={dev.device_kind} "
          f"x{jax.device_count()}")
    ours_tps = generated / ours["total"]
    print(f"ours (jax):        {ours_tps:10.1f} tok/s  generate {ours['total'] * 1e3:.1f} ms "
          f"(prefill+first token {ours['prefill'] * 1e3:.1f} ms, decode step {ours['step'] * 1e3:.2f} ms; "
          f"compile {ours['compile']:.1f} s)")
    if dev.platform == "cpu":
        print("roofline: skipped on CPU")
    else:
        itemsize = np.dtype(cfg.compute_dtype).itemsize
        ctx = args.prompt_len + args.gen_len / 2
        kv_bytes = 2 * cfg.num_layers * args.batch * ctx * cfg.num_kv_heads * cfg.head_dim * itemsize
        step_bytes = ours["param_bytes"] + kv_bytes
        achieved = step_bytes / ours["step"]
        peak = peak_bandwidth(dev, args.peak_bw)
        frac = f"{achieved / peak:.1%} of {peak / 1e9:.0f} GB/s" if peak else "peak unknown (pass --peak-bw)"
        print(f"roofline: {step_bytes / 1e6:.1f} MB/decode step (params {ours['param_bytes'] / 1e6:.1f} MB + "
              f"KV {kv_bytes / 1e6:.1f} MB) -> {achieved / 1e9:.0f} GB/s = {frac}")
    if args.skip_hf:
        return
    hf = time_hf(model, args, prompts)
    hf_tps = generated / hf["total"]
    print(f"transformers ({hf['device']}): {hf_tps:10.1f} tok/s  generate {hf['total'] * 1e3:.1f} ms")
    print(f"ratio ours/transformers: {ours_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
