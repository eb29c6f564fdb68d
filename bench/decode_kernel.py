"""The decode step's attention for one layer: the Pallas kernel (``models/decode_attention.py``) checked
against a float32 reference and timed against XLA's attention (the decoder's own path), on a GPU.

    python bench/decode_kernel.py                                # on a GPU: 1.5B's heads, rows 64/256 x slots 1536/4608
    python bench/decode_kernel.py --shapes 64x1536 --sweep       # also every kernel setting of --configs
    JAX_PLATFORMS=cpu python bench/decode_kernel.py --quick      # this script's own check on a CPU (interpret mode)

Per shape (rows x cache slots; Qwen2.5-1.5B's 12 query and 2 kv heads of 128, bfloat16): each row's
prompt starts at a random slot of the first quarter (left padding) and this step's token is the
last slot, so a row's live run is 75-100% of the cache. Inputs are fresh random draws for every
check.

- check: the kernel's output against ``decode_attention.reference`` computed in float32 from the
  same bfloat16 inputs, as ||out - ref|| / ||ref|| (bfloat16 outputs: under 1e-2), the written cache
  slot against the reference's, every other slot unchanged, no NaN; in float32 too (under 1e-3: on a
  GPU Triton's float32 dot runs in TF32, about 3e-4, as XLA's default float32 dot does there);
- time: ``--iters`` dependent calls as one straight-line program (each call's cache is the last
  one's; XLA:GPU launches it as one command buffer, as the decode step), after a warm-up, median of
  ``--repeats``; XLA's path is ``decode.cached_attention`` after the bias and
  RoPE, as ``Attention`` runs it; bytes are the live slots' keys and values read once plus the
  inputs; the fraction is of the GPU's datasheet HBM bandwidth (``aot.targets.hbm_bandwidth``).

Prints one table; ``--json`` writes the records.
"""

from __future__ import annotations

import argparse
import math
import sys

import common


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64x1536,64x4608,256x1536,256x4608", help="rows x cache slots, comma-separated")
    ap.add_argument("--heads", default="12/2", help="query heads / kv heads (default: Qwen2.5-1.5B's)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--configs", default="128:0:4:2,128:0:4:3,64:0:4:2,64:0:4:3,128:1:4:2,128:-2:4:2,128:-2:4:3",
                    help="with --sweep: kernel settings block_k:splits:num_warps:num_stages (splits 0: the kernel's "
                         "choice; -2: twice it)")
    common.add_kernel_flags(ap, 20, "each with the last one's cache")
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.heads, args.head_dim, args.iters, args.repeats = "4x96", "4/2", 32, 2, 1
        args.configs = "32:0:4:2,32:2:4:2"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from arlopti_jax.models import decode_attention as da
    from arlopti_jax.models import decode, rope

    n, kv = (int(x) for x in args.heads.split("/"))
    g, h = n // kv, args.head_dim
    device, interpret, bandwidth = common.kernel_device(f"heads {n}/{kv} of {h}")
    freq = 1.0 / (1e6 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    scale = 1.0 / math.sqrt(h)

    def inputs(rows, slots, dtype, seed):
        rng = np.random.default_rng(seed)
        r = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
        prompt = slots // 4
        start = jnp.asarray(rng.integers(0, prompt, rows), jnp.int32)
        positions = slots - 1 - start
        return dict(qkv=r(rows, kv, g + 2, h), bias=r(kv, g + 2, h) * 0.1, positions=positions, inv_freq=freq,
                    k_cache=r(rows, kv, slots, h), v_cache=r(rows, kv, slots, h), start=start,
                    pos=jnp.int32(slots - 1))

    def kernel(x, block_k=da.BLOCK_K, splits=0, warps=4, stages=2):
        return da.decode_attention(x["qkv"], x["bias"], x["positions"], x["inv_freq"], x["k_cache"], x["v_cache"],
                                   x["start"], x["pos"], scale=scale, block_k=block_k, splits=splits,
                                   num_warps=warps, num_stages=stages, interpret=interpret)

    def xla(x):  # Attention's XLA path for one decode step over a buffer per layer
        qkv = x["qkv"] + x["bias"]
        rows = qkv.shape[0]
        q = rope.apply_rope(qkv[:, None, :, :g].reshape(rows, 1, n, h), x["positions"][:, None], x["inv_freq"])
        k = rope.apply_rope(qkv[:, None, :, g], x["positions"][:, None], x["inv_freq"])
        slots = jnp.arange(x["k_cache"].shape[2])
        live = (slots[None, :] >= x["start"][:, None]) & (slots[None, :] <= x["pos"])
        out, cache = decode.cached_attention(q, k, qkv[:, None, :, g + 1], live[:, None, None, :], scale,
                                              {"k": (x["k_cache"],), "v": (x["v_cache"],)}, 0, x["pos"])
        return out[:, 0], cache["k"][0], cache["v"][0]

    def check(rows, slots, dtype, seed, **kw):
        x = inputs(rows, slots, dtype, seed)
        ref = da.reference(*(x[k].astype(jnp.float32) if x[k].dtype == dtype else x[k] for k in
                             ("qkv", "bias", "positions", "inv_freq", "k_cache", "v_cache", "start", "pos")),
                           scale=scale)
        before = np.asarray(x["k_cache"].astype(jnp.float32)), np.asarray(x["v_cache"].astype(jnp.float32))
        out, kc, vc = jax.jit(lambda x: kernel(x, **kw))(x)
        out, kc, vc = (np.asarray(a.astype(jnp.float32)) for a in (out, kc, vc))
        want = np.asarray(ref[0])
        rel = float(np.linalg.norm(out - want) / np.linalg.norm(want))
        slot = slots - 1
        cache_err = max(float(np.max(np.abs(kc[:, :, slot] - np.asarray(ref[1])[:, :, slot]))),
                        float(np.max(np.abs(vc[:, :, slot] - np.asarray(ref[2])[:, :, slot]))))
        untouched = (np.array_equal(np.delete(kc, slot, axis=2), np.delete(before[0], slot, axis=2))
                     and np.array_equal(np.delete(vc, slot, axis=2), np.delete(before[1], slot, axis=2)))
        return rel, cache_err, untouched and not np.isnan(out).any()

    def timed(fn, x) -> float:
        """Seconds per call: --iters dependent calls (each call's caches the last one's) in one program."""
        def calls(x):
            kc, vc, acc = x["k_cache"], x["v_cache"], jnp.float32(0)
            for _ in range(args.iters):
                out, kc, vc = fn({**x, "k_cache": kc, "v_cache": vc})
                acc = acc + out[0, 0, 0].astype(jnp.float32)
            return kc, vc, acc

        return common.program_seconds(jax.jit(calls), x, args.iters, args.repeats)

    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    records, failed = [], False
    lines = ["| rows x slots | attention | block_k:splits:warps:stages | us per layer | live GB/s | of HBM | "
             "vs XLA | rel. error bf16 / f32 | cache slot, others |", "|---" * 9 + "|"]
    for shape in args.shapes.split(","):
        rows, slots = (int(v) for v in shape.split("x"))
        x = inputs(rows, slots, jnp.bfloat16, 1)
        live = int(jnp.sum(x["pos"] + 1 - x["start"]))
        moved = 2 * live * kv * h * 2 + rows * kv * (g + 2) * h * 2 * 2  # keys and values read; qkv in, out
        base = timed(xla, x)
        frac = lambda s: f"{moved / s / bandwidth:.0%}" if bandwidth else "-"
        lines.append(f"| {rows} x {slots} | XLA | - | {base * 1e6:.1f} | {moved / base / 1e9:.0f} | {frac(base)} | "
                     f"1.00x | - | - |")
        records.append(dict(rows=rows, slots=slots, impl="xla", seconds=base, live_bytes=moved))
        for i, (block_k, splits, warps, stages) in enumerate(configs if args.sweep or args.quick else configs[:1]):
            splits = 2 * da.splits_for(rows, kv, slots, block_k) if splits == -2 else splits
            kw = dict(block_k=block_k, splits=splits, warps=warps, stages=stages)
            try:
                rel16, slot16, ok16 = check(rows, slots, jnp.bfloat16, 10 + i, **kw)
                rel32, slot32, ok32 = check(rows, slots, jnp.float32, 20 + i, **kw)
                seconds = timed(lambda x: kernel(x, **kw), x)
            except Exception as err:  # a setting Triton rejects (shared memory...): its row says so
                lines.append(f"| {rows} x {slots} | Pallas | {block_k}:{splits}:{warps}:{stages} | "
                             f"{common.failed_row(err, 120)} | | | | | |")
                failed = True
                continue
            good = rel16 < 1e-2 and rel32 < 1e-3 and ok16 and ok32 and slot32 < 1e-3 and slot16 < 0.07
            failed |= not good
            lines.append(f"| {rows} x {slots} | Pallas | {block_k}:{splits or 'auto'}:{warps}:{stages} | "
                         f"{seconds * 1e6:.1f} | {moved / seconds / 1e9:.0f} | {frac(seconds)} | "
                         f"{base / seconds:.2f}x | {rel16:.1e} / {rel32:.1e} | {slot16:.1e}, "
                         f"{'unchanged' if ok16 and ok32 else 'CHANGED or NaN'}{'' if good else ' FAILED'} |")
            records.append(dict(rows=rows, slots=slots, impl="pallas", block_k=block_k, splits=splits, warps=warps,
                                stages=stages, seconds=seconds, live_bytes=moved, rel_error_bf16=rel16,
                                rel_error_f32=rel32, slot_error_bf16=slot16, ok=good))
        print("\n".join(lines[-(1 + (len(configs) if args.sweep or args.quick else 1)):]), flush=True)
    print("\n" + "\n".join(lines))
    common.write_records(args.json, device, records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
