"""The LoRA rollout: the sampler applying the adapters unmerged (two thin products beside each
adapted projection, what ``train`` does) against merged weights (``lora.merge`` once per rollout,
then the plain model), interleaved round by round on one random model.

    python bench/lora_sampler.py                                   # SmolLM2-135M's shape, rank 16, every projection
    python bench/lora_sampler.py --shape 1.5b --dtype bfloat16 --batch 64 --gen-len 512   # on a GPU

Prints seconds per rollout (median over rounds; the merged side includes its merge) and the
ratio. Random weights and adapters (B drawn, so the adapters change the tokens); both sides
sample the same tokens up to float rounding, which the script reports as the share of equal
tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from common import add_shape_flags, describe, model_config, shape_dims

SHAPES_EXTRA = {"smollm2": dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, vocab=49152,
                                tied=True, head_dim=64)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_flags(p, default=None)
    p.add_argument("--batch", type=int, default=32, help="sequences per rollout (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=48)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    from arlopti_jax.models import init_params, lora
    from arlopti_jax.rollout import Sampler, SamplingConfig
    from arlopti_jax.runtime import sharding as shd

    dims = shape_dims(args, fallback=SHAPES_EXTRA["smollm2"])
    mesh = shd.make_mesh({"fsdp": -1})
    base_cfg = model_config(dims, dtype=args.dtype, param_dtype=args.dtype)
    cfg = base_cfg.replace(lora_rank=args.rank, lora_alpha=2.0 * args.rank, lora_targets=tuple(args.targets.split(",")))
    print(f"{describe(dims)}; LoRA rank {args.rank} on {args.targets}; {args.batch} x ({args.prompt_len} + "
          f"{args.gen_len}) tokens, {args.dtype}, {jax.devices()[0].platform}", flush=True)
    keys = iter(jax.random.split(jax.random.key(1), 256))
    adapters = jax.tree.map(lambda x: 0.02 * jax.random.normal(next(keys), x.shape, x.dtype),
                            lora.init_adapters(cfg, jax.random.key(2), mesh))
    params = lora.combine(init_params(base_cfg, jax.random.key(0), mesh), adapters)
    sampling = SamplingConfig(max_response_len=args.gen_len, eos_ids=(), prompt_bucket=args.prompt_len,
                              batch_bucket=args.batch, length_aware=False)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, dims["vocab"], args.prompt_len)) for _ in range(args.batch)]
    unmerged, merged = Sampler(cfg, mesh), Sampler(base_cfg, mesh)
    key = jax.random.key(3)

    def run_unmerged():
        return np.asarray(unmerged.generate(params, prompts, 1, key, sampling).response_ids)

    def run_merged():
        return np.asarray(merged.generate(lora.merge(cfg, params), prompts, 1, key, sampling).response_ids)

    sides = {"unmerged": run_unmerged, "merged": run_merged}
    tokens = {name: fn() for name, fn in sides.items()}  # compiles
    times = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {name: float(np.median(t)) for name, t in times.items()}
    same = float((tokens["unmerged"] == tokens["merged"]).mean())
    print("| sampler | s per rollout (median) | rounds |\n|---|---|---|")
    for name in sides:
        print(f"| {name} | {med[name]:.3f} | {', '.join(f'{t:.3f}' for t in times[name])} |")
    print(f"merged / unmerged: {med['merged'] / med['unmerged']:.2f}x; equal tokens {same:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
