"""Packed-row attention on a GPU: jax.nn.dot_product_attention's XLA lowering against cuDNN's
fused kernel, with the mask the update uses (causal within each packed segment).

    JAX_PLATFORMS=cuda python bench/attention_probe.py [--rows 4] [--tokens 4096] [--segments 4]

Qwen2.5-1.5B's attention shape (12 query heads, 2 KV heads, head dim 128), bfloat16. For each
implementation: forward and forward + backward time (median of --repeats after a warm-up), and
the relative error of the output and of dq, dk, dv against a float32 XLA computation. Prints
why cuDNN was refused when it is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def packed_mask(rows: int, tokens: int, segments: int, seed: int = 0) -> np.ndarray:
    """[rows, 1, T, T] boolean: causal inside each of ``segments`` random-length segments per row."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((rows, tokens), np.int32)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, tokens), segments - 1, replace=False))
        seg[r] = np.searchsorted(cuts, np.arange(tokens), side="right")
    causal = np.tril(np.ones((tokens, tokens), bool))
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    print(f"device {jax.devices()[0].device_kind}; q [{args.rows}, {args.tokens}, {args.heads}, {args.head_dim}], "
          f"kv heads {args.kv_heads}, {args.segments} segments per row, bfloat16")
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (args.rows, args.tokens, args.heads, args.head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (args.rows, args.tokens, args.kv_heads, args.head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (args.rows, args.tokens, args.kv_heads, args.head_dim), jnp.float32)
    g = jax.random.normal(keys[3], q.shape, jnp.float32)
    mask = jnp.asarray(packed_mask(args.rows, args.tokens, args.segments))
    scale = args.head_dim ** -0.5

    def loss(q, k, v, impl):
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=impl)
        return (out.astype(jnp.float32) * g).sum(), out

    ref_out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")
    ref_grads = jax.grad(lambda *a: loss(*a, "xla")[0], argnums=(0, 1, 2))(q, k, v)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    for impl in ("xla", "cudnn"):
        try:
            fwd = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                q, k, v, mask=mask, scale=scale, implementation=impl))
            bwd = jax.jit(jax.grad(lambda q, k, v, impl=impl: loss(q, k, v, impl)[0], argnums=(0, 1, 2)))
            out = fwd(qb, kb, vb)
            grads = bwd(qb, kb, vb)
            t_f = timed(fwd, qb, kb, vb, repeats=args.repeats)
            t_b = timed(bwd, qb, kb, vb, repeats=args.repeats)
        except Exception as e:  # noqa: BLE001 - report why the implementation was refused
            print(f"{impl}: refused: {type(e).__name__}: {str(e)[:300]}")
            continue
        errs = [rel(out, ref_out)] + [rel(a, b) for a, b in zip(grads, ref_grads)]
        print(f"{impl}: forward {t_f * 1e3:.2f} ms, forward+backward {t_b * 1e3:.2f} ms; relative error vs "
              f"float32 XLA: out {errs[0]:.2e}, dq {errs[1]:.2e}, dk {errs[2]:.2e}, dv {errs[3]:.2e}", flush=True)
    model_check()
    return 0


def model_check() -> None:
    """The packed forward and backward of a 2-layer Qwen2.5-1.5B-shaped model, bfloat16 compute:
    model.attention 'cudnn' against 'xla' (loss and every gradient, relative difference)."""
    from arlopti_jax.models import init_params
    from arlopti_jax.models.policy import packed_hidden_states
    from arlopti_jax.runtime import sharding as shd
    from common import model_config

    base = model_config("1.5b", dtype="bfloat16", param_dtype="float32", layers=2, vocab=4096)
    mesh = shd.make_mesh({"fsdp": -1})
    params = init_params(base, jax.random.key(1), mesh)
    rng = np.random.default_rng(1)
    rows, tokens = 2, 2048
    seg = np.zeros((rows, tokens), np.int32)
    pos = np.zeros((rows, tokens), np.int32)
    for r in range(rows):
        at, s = 0, 1
        while at < tokens - 100:  # segments of 100-700 tokens, then a padding tail (segment 0)
            n = int(rng.integers(100, 700))
            n = min(n, tokens - 100 - at)
            seg[r, at:at + n], pos[r, at:at + n] = s, np.arange(n)
            at, s = at + n, s + 1
    ids = jnp.asarray(rng.integers(0, 4096, (rows, tokens)), jnp.int32)
    out = {}
    for impl in ("xla", "cudnn"):
        cfg = base.replace(attention=impl)

        def loss(p):
            h = packed_hidden_states(cfg, p, ids, jnp.asarray(pos), jnp.asarray(seg)).astype(jnp.float32)
            return (h * jnp.where(jnp.asarray(seg)[..., None] > 0, 1.0, 0.0) * jnp.sin(h)).mean()

        out[impl] = jax.jit(jax.value_and_grad(loss))(params)
    (lx, gx), (lc, gc) = out["xla"], out["cudnn"]
    worst = max(rel(a, b) for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gx)))
    finite = all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(gc))
    print(f"model check (2 layers of 1.5B, packed rows with padding): loss xla {float(lx):.6f} cudnn {float(lc):.6f}; "
          f"largest relative gradient difference {worst:.2e}; cudnn gradients finite: {finite}")


if __name__ == "__main__":
    sys.exit(main())
