"""Ahead-of-time compile time of every sampler program and of the update, at Qwen2.5 shapes.

    python bench/compile_time.py                                   # 0.5B, 1.5B, 7B; 64 prompts x 8, 512 + 4096
    python bench/compile_time.py --shapes 1.5b --only sampler
    python bench/compile_time.py --cache-dir /tmp/jaxcache         # run twice: the second run reads the cache

Nothing is allocated: each program is lowered from abstract shapes (``jax.ShapeDtypeStruct``
with the mesh's shardings: the parameters', the KV cache's, the batch's) and compiled for
this machine's backend (``jax.jit(...).lower(...).compile()``). The programs:

- sampler, dense (``length_aware=False``): prefill, start, one decode loop over all P + R
  slots and rows;
- sampler, length-aware: start at the first phase, one decode loop per (rows per device,
  cache phase) the schedule can reach (row buckets from the batch's rows per device down to
  ``min_rows``, x the phases of ``SamplingConfig.phase_ends``), the compaction of each to
  the next bucket, the growth of each to the next phase, and the final scatter of each
  bucket below the batch's. The prefill is the dense path's (the same program);
- update: the gradient accumulator's zeros, one accumulate of the dense micro-batch's
  packed shape (``micro`` rows of P + R tokens; the packing ladder adds one such program
  per row length met), the optimizer step, and the teacher-forced log-prob pass of the same
  shape (reference and recomputed pi_old).

It prints seconds per program (lowering, i.e. tracing to StableHLO, and XLA compilation),
the number of programs and the totals per shape. ``--cache-dir`` turns on JAX's persistent
compilation cache (``arlopti_jax.compile_cache``) in that folder: a second run then reads
the compiled programs back (``/jax/compilation_cache/cache_hits`` counts them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.5b,1.5b,7b", help="comma-separated presets of bench/shapes.py")
    ap.add_argument("--layers", type=int, help="override the presets' layer count")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per batch")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt slots (a bucket)")
    ap.add_argument("--response", type=int, default=4096, help="max_response_len R")
    ap.add_argument("--min-rows", type=int, default=16, help="SamplingConfig.min_rows (default: its default)")
    ap.add_argument("--phase-tokens", type=int, default=0, help="SamplingConfig.phase_tokens")
    ap.add_argument("--micro", type=int, default=8, help="rows of the update's dense micro-batch")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="compute dtype")
    ap.add_argument("--unroll", action="store_true", help="model.unroll_layers (straight-line layers)")
    ap.add_argument("--devices", type=int, default=8,
                    help="fake CPU devices of the fsdp mesh (8: 64 rows per device, as on 8 accelerators)")
    ap.add_argument("--only", choices=("sampler", "dense", "length_aware", "update"), help="one group of programs")
    ap.add_argument("--cache-dir", default="", help="JAX's persistent compilation cache folder ('' = off)")
    ap.add_argument("--verbose", action="store_true", help="one line per program as it compiles")
    return ap.parse_args()


@dataclasses.dataclass
class Timer:
    """Lowers and compiles programs, recording (group, name, lower s, compile s)."""

    verbose: bool
    rows: list = dataclasses.field(default_factory=list)

    def compile(self, group: str, name: str, jitted, *args, **kwargs):
        """Compile ``jitted`` for ``args``; returns its outputs as sharded abstract values."""
        import jax

        start = time.perf_counter()
        lowered = jitted.lower(*args, **kwargs)
        mid = time.perf_counter()
        compiled = lowered.compile()
        end = time.perf_counter()
        self.rows.append((group, name, mid - start, end - mid))
        if self.verbose:
            print(f"  {group:13s} {name:40s} lower {mid - start:6.2f} s  compile {end - mid:6.2f} s", flush=True)
        return jax.tree.map(lambda info, sh: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sh),
                            lowered.out_info, compiled.output_shardings)


def abstract(shape, dtype, sharding):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def sampler_programs(cfg, mesh, args, timer: Timer, groups: set) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from arlopti_jax import sharding as shd
    from arlopti_jax.models import abstract_params, param_shardings
    from arlopti_jax.rollout import Sampler, SamplingConfig
    from arlopti_jax.rollout.programs import row_fields
    from arlopti_jax.rollout.sampling import bucket

    sampler = Sampler(cfg, mesh)
    devices = sampler.devices
    params = jax.tree.map(lambda a, sh: abstract(a.shape, a.dtype, sh), abstract_params(cfg), param_shardings(cfg, mesh))
    b = -(-bucket(args.prompts, 8) // devices) * devices
    p, r, n = args.prompt_len, args.response, args.n
    rows2, rows1 = shd.batch_sharding(mesh, 2), shd.batch_sharding(mesh, 1)
    ids = abstract((b, p), jnp.int32, rows2)
    live, stops = abstract((b,), jnp.bool_, rows1), abstract((b * n,), jnp.int32, rows1)
    key = jax.random.key(0)
    temperature, top_p, eos = jnp.float32(0.7), jnp.float32(1.0), jnp.full((8,), -1, jnp.int32)
    decoded = set()
    with shd.activate(mesh):
        cache, logits = timer.compile("sampler", "prefill", sampler._prefill, params, ids, ids)
        for length_aware in (False, True):
            group = "length_aware" if length_aware else "dense"
            if group not in groups:
                continue
            sampling = SamplingConfig(max_response_len=r, temperature=0.7, length_aware=length_aware,
                                      phase_tokens=args.phase_tokens, min_rows=args.min_rows)
            ends, kernel = sampling.phase_ends(), sampling.kernel_key
            start = timer.compile(group, "start", sampler._start, cache, logits, ids, live, stops, key, temperature,
                                  top_p, eos, n=n, max_len=r, slots=p + ends[0], kernel=kernel)

            def decode(state, rows):
                slots = state.kv_mask.shape[1]
                if (rows, slots) not in decoded:  # the dense loop is the length-aware one at (all rows, P + R)
                    decoded.add((rows, slots))
                    timer.compile(group, f"decode rows={rows} slots={slots}", sampler._decode, params, state, key,
                                  temperature, top_p, eos, np.int32(0), kernel=kernel)

            first = b * n // devices
            if not length_aware:
                decode(start, first)
                continue
            # rows per device: the batch's, then the powers of two below it down to min_rows
            buckets = [first] + [1 << i for i in reversed(range((first - 1).bit_length())) if 1 << i >= args.min_rows]
            full = {k: getattr(start, k) for k in ("tokens", "logprobs", "mask", "finished")}
            states = {(first, 0): start}
            for phase in range(len(ends)):  # states in the order decode meets them: phases up, rows down
                for i, rows in enumerate(buckets):
                    state = states.get((rows, phase))
                    if state is None:
                        continue
                    decode(state, rows)
                    slots = p + ends[phase]
                    if rows != first and phase == 0:  # the final scatter reads only the rows' outputs
                        timer.compile(group, f"scatter rows={rows}", sampler._scatter, full, row_fields(state))
                    if i + 1 < len(buckets):  # nothing compacted yet (out None) while the batch is whole
                        states[(buckets[i + 1], phase)], _ = timer.compile(
                            group, f"compact rows={rows} slots={slots}", sampler._compact, state,
                            None if rows == first else full, rows=buckets[i + 1])
                    if phase + 1 < len(ends):
                        states[(rows, phase + 1)] = timer.compile(group, f"grow rows={rows} slots={slots}",
                                                                  sampler._grow, state, slots=p + ends[phase + 1])


def update_programs(cfg, mesh, args, timer: Timer) -> None:
    import jax
    import jax.numpy as jnp

    from arlopti_jax import algos
    from arlopti_jax import sharding as shd
    from arlopti_jax.algos import packing
    from arlopti_jax.models import abstract_params, param_shardings

    params = jax.tree.map(lambda a, sh: abstract(a.shape, a.dtype, sh), abstract_params(cfg), param_shardings(cfg, mesh))
    devices = shd.batch_divisor(mesh)
    seq = args.prompt_len + args.response
    rows = max(args.micro, devices)
    tokens_per_device = rows // devices * seq
    optimizer = algos.make_optimizer(algos.OptimConfig())
    step = algos.make_train_step(cfg, algos.LossConfig(kl_coef=0.001, temperature=0.7), optimizer, mesh,
                                 tokens_per_device=tokens_per_device)
    k = next(w for w in packing.target_widths(tokens_per_device) if w >= rows // devices * args.response)
    row, tgt = shd.batch_sharding(mesh, 2), step.row_sharding
    ints = {name: abstract((rows, seq), jnp.int32, row) for name in ("input_ids", "positions", "segment_ids")}
    targets = {name: abstract((devices, k), jnp.int32, tgt) for name in ("target_pos", "target_ids", "target_mask")}
    floats = {name: abstract((devices, k), jnp.float32, tgt)
              for name in ("old_logprobs", "advantages", "agg_weight", "ref_logprobs")}
    masks = {name: abstract((devices, k), jnp.int32, tgt) for name in ("loss_mask", "response_mask")}
    opt_state = jax.tree.map(lambda a, sh: abstract(a.shape, a.dtype, sh), jax.eval_shape(optimizer.init, params),
                             algos.opt_state_shardings(optimizer, cfg, mesh))
    logprobs = algos.make_compute_logprobs(cfg, mesh, temperature=0.7, tokens_per_device=tokens_per_device)
    with shd.activate(mesh):
        acc = timer.compile("update", "zeros", step._zeros, params)
        acc = timer.compile("update", f"accumulate {rows}x{seq}", step._accumulate, params, acc,
                            {**ints, **targets, **floats, **masks})
        timer.compile("update", "apply (clip + AdamW)", step._apply, params, opt_state, acc, jnp.float32(1))
        timer.compile("update", f"log-probs {rows}x{seq}", logprobs.jitted, params, {**ints, **targets})


def report(shape: str, timer: Timer, hits: list) -> None:
    groups = {}
    for group, name, lower, comp in timer.rows:
        groups.setdefault(group, []).append((name, lower, comp))
    print(f"\n{shape}: program, lower s, compile s")
    for group, items in groups.items():
        for name, lower, comp in items:
            print(f"  {group:13s} {name:40s} {lower:7.2f} {comp:7.2f}")
    print(f"\n{shape} totals (lower + compile = s; the prefill serves both samplers):")
    for group, items in groups.items():
        lower, comp = sum(x[1] for x in items), sum(x[2] for x in items)
        print(f"  {group:13s} {len(items):4d} programs  {lower:7.1f} + {comp:7.1f} = {lower + comp:7.1f} s")
    sampler = [x for g in ("sampler", "dense", "length_aware") for x in groups.get(g, [])]
    if sampler:
        lower, comp = sum(x[1] for x in sampler), sum(x[2] for x in sampler)
        print(f"  {'all sampler':13s} {len(sampler):4d} programs  {lower:7.1f} + {comp:7.1f} = {lower + comp:7.1f} s")
    if hits:
        print(f"  persistent cache: {hits[0]} hits, {hits[1]} misses (written)")


def main():
    args = parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from arlopti_jax import sharding as shd
    from shapes import model_config

    counts = {"hits": 0, "misses": 0}
    if args.cache_dir:
        from arlopti_jax import compile_cache

        compile_cache.enable(args.cache_dir)
        events = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}

        def listen(event, **_):
            if event in events:
                counts[events[event]] += 1

        jax.monitoring.register_event_listener(listen)
    groups = {"sampler": {"dense", "length_aware"}, "dense": {"dense"}, "length_aware": {"length_aware"},
              "update": set(), None: {"dense", "length_aware"}}[args.only]
    mesh = shd.make_mesh({"fsdp": -1}, devices=jax.devices()[:args.devices])
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({args.devices} device(s)), {os.cpu_count()} CPU "
          f"cores; {args.prompts} prompts x {args.n}, prompt {args.prompt_len}, response {args.response}, "
          f"{args.dtype}, unroll_layers={args.unroll}, cache {args.cache_dir or 'off'}", flush=True)
    for shape in args.shapes.split(","):
        cfg = model_config(shape, dtype=args.dtype, param_dtype="float32", remat=True, layers=args.layers)
        cfg = dataclasses.replace(cfg, unroll_layers=args.unroll)
        timer = Timer(args.verbose)
        before = dict(counts)
        start = time.perf_counter()
        if groups:
            sampler_programs(cfg, mesh, args, timer, groups)
        if args.only in (None, "update"):
            update_programs(cfg, mesh, args, timer)
        hits = [counts["hits"] - before["hits"], counts["misses"] - before["misses"]] if args.cache_dir else []
        report(f"{shape} ({cfg.num_layers} layers)", timer, hits)
        print(f"  wall {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
