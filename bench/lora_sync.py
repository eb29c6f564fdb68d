"""The weight sync of a LoRA run with the sampler on its own devices: the adapters alone (as the trainer
does it: the sampler merges them into its copy of the base for each rollout) against the merged weights
(the trainer merges, the sampler gets a plain model).

    python bench/lora_sync.py [--shape smollm2] [--rank 16] [--split 4,4] [--repeats 5]

On host CPU devices (``--split T,S``: T for the trainer, S for the sampler; this sets
``--xla_force_host_platform_device_count``), each mesh laid out as the config's defaults lay it out,
random weights of the shape (``smollm2``: SmolLM2-135M's widths in the Qwen2 blocks of
``common.model_config``), LoRA on every projection, B non-zero. Each way's parts are timed after a
warm-up call, medians of ``--repeats`` interleaved calls:

  adapters  sync: the adapters to the sampler's mesh (``shd.transfer``); then the sampler merges them into
            its own copy of the base (``lora.merge``, on the sampler's devices)
  merged    the trainer merges on its own devices; sync: the merged weights to the sampler's mesh

It prints the bytes each sync moves (one copy, and all it writes: the sampler's default mesh holds the
weights whole on each of its devices), each part's seconds, and what lands on the trainer's critical
path (with split meshes the trainer waits for the sync; a merge on its devices delays its next update
too). The two ways' merged weights are checked equal (float tolerance) before any figure is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

SMOLLM2 = dict(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, vocab=49152, tied=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2", help="smollm2, or a preset of bench/common.py (random weights)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha 16, every projection adapted)")
    ap.add_argument("--split", default="4,4", help="host devices of the trainer and of the sampler, T,S")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        trainer_n, sampler_n = (int(x) for x in args.split.split(","))
    except ValueError:
        ap.error(f"--split {args.split}: expected two device counts, e.g. 4,4")
    if min(trainer_n, sampler_n) < 1 or args.rank < 1 or args.repeats < 1:
        ap.error("--split counts, --rank and --repeats must be >= 1")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={trainer_n + sampler_n}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import numpy as np

    import common
    from arlopti_jax.config import base_config
    from arlopti_jax.models import lora, param_shardings
    from arlopti_jax.models.policy import init_params
    from arlopti_jax.runtime import sharding as shd

    if args.shape != "smollm2" and args.shape not in common.SHAPES:
        ap.error(f"--shape {args.shape}: expected smollm2 or one of {sorted(common.SHAPES)}")
    cfg = common.model_config(SMOLLM2 if args.shape == "smollm2" else args.shape).replace(
        lora_rank=args.rank, lora_alpha=16.0)
    devices = jax.devices()
    defaults = base_config()  # the trainer's mesh (fsdp over its devices) and the sampler's (data: replicated)
    trainer = shd.make_mesh(dict(defaults.mesh), devices[:trainer_n])
    sampler = shd.make_mesh(dict(defaults.rollout.mesh), devices[trainer_n:])

    params = init_params(cfg, jax.random.key(0), trainer)
    base, adapters = lora.split(params)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda a: (a + 0.01 * jax.random.normal(next(keys), a.shape, a.dtype)).astype(a.dtype),
                            adapters)  # B non-zero, so the merge changes every adapted weight
    params = lora.combine(base, adapters)
    base_sh, adapter_sh = lora.split(param_shardings(cfg, sampler))
    plain_sh = param_shardings(cfg.replace(lora_rank=0), sampler)
    base_on_sampler = jax.block_until_ready(shd.transfer(base, base_sh))  # copied once, at the start of a run

    def run_adapters():
        t0 = time.perf_counter()
        moved = jax.block_until_ready(shd.transfer(adapters, adapter_sh))
        t1 = time.perf_counter()
        merged = jax.block_until_ready(lora.merge(cfg, lora.combine(base_on_sampler, moved)))
        return {"sync": t1 - t0, "sampler merge": time.perf_counter() - t1}, moved, merged

    def run_merged():
        t0 = time.perf_counter()
        merged = jax.block_until_ready(lora.merge(cfg, params))
        t1 = time.perf_counter()
        moved = jax.block_until_ready(shd.transfer(merged, plain_sh))
        return {"trainer merge": t1 - t0, "sync": time.perf_counter() - t1}, moved, moved

    ways = {"adapters": run_adapters, "merged": run_merged}
    results, outputs = {}, {}
    for name, fn in ways.items():  # the warm-up compiles; its outputs are the ones checked
        _, moved, outputs[name] = fn()
        results[name] = {"bytes": sum(x.nbytes for x in jax.tree.leaves(moved)), "times": [],
                         "written": sum(s.data.nbytes for x in jax.tree.leaves(moved) for s in x.addressable_shards)}
    for a, b in zip(jax.tree.leaves(outputs["adapters"]), jax.tree.leaves(outputs["merged"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    for _ in range(args.repeats):  # interleaved
        for name, fn in ways.items():
            results[name]["times"].append(fn()[0])

    shape = SMOLLM2 if args.shape == "smollm2" else common.dims(args.shape)
    print(f"{common.backend_line()}; {args.shape}: {common.describe(shape)}, LoRA rank {args.rank}; "
          f"trainer {trainer_n} + sampler {sampler_n} host devices; medians of {args.repeats}")
    print("\n| way | sync MB (one copy) | MB written on the sampler's devices | sync s | trainer merge s "
          "| sampler merge s | on the trainer's path s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        med = {k: statistics.median(t[k] for t in r["times"]) for k in r["times"][0]}
        merge_t, merge_s = med.get("trainer merge", 0.0), med.get("sampler merge", 0.0)
        print(f"| {name} | {r['bytes'] / 2**20:.1f} | {r['written'] / 2**20:.1f} | {med['sync']:.4f} | "
              f"{merge_t:.4f} | {merge_s:.4f} | {med['sync'] + merge_t:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
