"""A decode step's four weight products, each with its fused neighbours: the Pallas kernel
(``models/decode_matmul.py``) checked against a float32 reference and timed against XLA's products
(the decoder's own path: XLA fuses the norms, adds and silu x up as it does in the step), on a GPU.

    python bench/decode_matmul.py                       # on a GPU: 1.5B's products at 64 and 256 rows
    python bench/decode_matmul.py --rows 64 --sweep     # also every kernel setting of --configs
    JAX_PLATFORMS=cpu python bench/decode_matmul.py --quick   # this script's own check on a CPU (interpret mode)

The products (Qwen2.5-1.5B's widths, bfloat16): ``qkv`` norm + [1536, 2048]; ``o`` [1536, 1536] +
residual; ``gate_up`` norm + [1536, 8960] x 2 + silu x up; ``down`` [8960, 1536] + residual.

- check: ||out - ref|| / ||ref|| against ``decode_matmul.reference`` in float32 from the same
  bfloat16 inputs (bfloat16 outputs: under 1e-2);
- time: ``--iters`` calls in one program, each with a weight of its own (a layer's weights are read
  once per step: one weight called again would be read from the 50 MB L2), median of ``--repeats``;
  bytes are the weights, the rows in and out, and the residual; the fraction is of the GPU's
  datasheet HBM bandwidth (``aot.targets.hbm_bandwidth``).

Prints one table; ``--json`` writes the records.
"""

from __future__ import annotations

import argparse
import sys

import common

PRODUCTS = {"qkv": (1536, 2048, ("norm",)), "o": (1536, 1536, ("residual",)),
            "gate_up": (1536, 8960, ("norm", "up")), "down": (8960, 1536, ("residual",))}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256", help="rows per step, comma-separated")
    ap.add_argument("--products", default=",".join(PRODUCTS), help=f"of {', '.join(PRODUCTS)}")
    ap.add_argument("--configs", default="0:64:128:0:4:3,0:16:128:1:4:3,0:32:128:0:4:3,0:64:64:0:4:4,0:128:128:0:4:3,"
                                         "0:64:256:0:8:2,0:64:128:1:4:3,16:64:128:0:4:3,0:64:128:-2:4:3",
                    help="with --sweep: kernel settings block_m:block_n:block_k:splits:num_warps:num_stages "
                         "(block_m 0 and splits 0: the kernel's choice; splits 1: none, -2: twice the choice)")
    common.add_kernel_flags(ap, 16, "each with its own weights")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.iters, args.repeats, args.configs = "5", 2, 1, "0:16:32:0:4:3,16:32:64:1:4:3"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from arlopti_jax.models import decode_matmul as dm

    device, interpret, bandwidth = common.kernel_device()
    shrink = 16 if args.quick else 1

    def inputs(product, rows, dtype, seed, weights=1):
        k, n, fused = PRODUCTS[product]
        k, n = k // shrink, n // shrink
        rng = np.random.default_rng(seed)
        r = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, dtype)
        extra = {"norm": lambda: 1.0 + r(k, scale=0.1), "residual": lambda: r(rows, n)}
        x = dict(x=r(rows, k), **{name: extra[name]() for name in fused if name in extra})
        x["w"] = tuple(r(k, n, scale=k ** -0.5) for _ in range(weights))
        if "up" in fused:
            x["up"] = tuple(r(k, n, scale=k ** -0.5) for _ in range(weights))
        return x

    def call(fn, x, i):
        return fn(x["x"], x["w"][i], **{name: (v[i] if name == "up" else v) for name, v in x.items()
                                          if name not in ("x", "w")})

    def timed(fn, x) -> float:
        return common.program_seconds(jax.jit(lambda x: tuple(call(fn, x, i) for i in range(args.iters))), x,
                                      args.iters, args.repeats)

    def kernel(rows, k, n, block_m, block_n, block_k, splits, warps, stages):
        if splits == -2:
            splits = 2 * dm.grid_for(rows, n, k, block_m, block_n, block_k)[2]
        return lambda x, w, **kw: dm.fused_matmul(x, w, **kw, block_m=block_m, block_n=block_n, block_k=block_k,
                                                  splits=splits, num_warps=warps, num_stages=stages,
                                                  interpret=interpret)

    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    records, failed = [], False
    lines = ["| product | rows | path | block_m:n:k:splits:warps:stages | us | GB/s | of HBM | vs XLA | rel. error |",
             "|---" * 9 + "|"]
    print("\n".join(lines), flush=True)

    def add(line):  # each row as it comes: a run cut by its time limit keeps what it measured
        lines.append(line)
        print(line, flush=True)

    for product in args.products.split(","):
        for rows in (int(v) for v in args.rows.split(",")):
            x = inputs(product, rows, jnp.bfloat16, 1, weights=args.iters)
            once = [v[0] if isinstance(v, tuple) else v for v in x.values()]  # one call's operands
            moved = sum(a.size * a.dtype.itemsize for a in once) + rows * x["w"][0].shape[1] * 2  # and its output
            base = timed(dm.reference, x)
            frac = lambda s: f"{moved / s / bandwidth:.0%}" if bandwidth else "-"
            add(f"| {product} | {rows} | XLA | - | {base * 1e6:.1f} | {moved / base / 1e9:.0f} | {frac(base)} "
                "| 1.00x | - |")
            records.append(dict(product=product, rows=rows, impl="xla", seconds=base, bytes=moved))
            for setting in configs if args.sweep or args.quick else configs[:1]:
                fn = kernel(rows, *x["w"][0].shape, *setting)
                label = ":".join(map(str, setting))
                try:
                    check = inputs(product, rows, jnp.bfloat16, 7)
                    got = np.asarray(call(jax.jit(fn), check, 0), np.float32)
                    want = np.asarray(call(dm.reference, jax.tree.map(lambda a: a.astype(jnp.float32), check), 0))
                    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                    seconds = timed(fn, x)
                except Exception as err:  # a setting Triton rejects (shared memory...): its row says so
                    add(f"| {product} | {rows} | Pallas | {label} | {common.failed_row(err, 80)} | | | | |")
                    continue
                failed |= not rel < 1e-2
                add(f"| {product} | {rows} | Pallas | {label} | {seconds * 1e6:.1f} | "
                    f"{moved / seconds / 1e9:.0f} | {frac(seconds)} | {base / seconds:.2f}x | {rel:.1e} |")
                records.append(dict(product=product, rows=rows, impl="pallas", setting=label, seconds=seconds,
                                    bytes=moved, rel_error=rel))
    print("\n" + "\n".join(lines))
    common.write_records(args.json, device, records)
    if failed:
        print("error: a kernel's output is off the reference by 1e-2 or more (see rel. error)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
