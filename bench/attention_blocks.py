"""The trainer's CPU/TPU attention (``decoder._causal_blocks``: causal query blocks with a written
gradient) against autodiff through the same blocks (the implementation it replaced), forward +
backward, interleaved in one process on this machine.

    python bench/attention_blocks.py                 # attention alone, a few packed shapes
    python bench/attention_blocks.py --model DIR     # also a whole model's forward + backward
                                                     # (an HF folder's config.json, random weights)

Attention alone: float32 (bfloat16 with --dtype), packed rows holding two segments and padding,
the loss a fixed random projection of the output; prints compile seconds and the best of 5 runs
for each side, and each side's largest gradient error (relative to the largest gradient) against
autodiff through the same blocks at float32's highest matmul precision (tests/models/test_model.py holds
both to a plain softmax and to float64 numpy). Model: the hidden states' squared sum
through ``packed_hidden_states``, the whole layer stack with each side's attention swapped in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def autodiff_blocks(q, k, v, mask, scale):
    """The blocks as they were before their gradient was written: the same query blocks, a
    float32 softmax per block, and autodiff's backward (float32 probabilities saved)."""
    import jax
    import jax.numpy as jnp

    from arlopti_jax.models.decoder import _edges

    b, t, n, h = q.shape
    kv = k.shape[2]
    qh = q.transpose(0, 2, 1, 3).reshape(b, kv, n // kv, t, h)
    edges = _edges(t)
    outs = []
    for lo, hi in zip(edges, edges[1:]):
        scores = jnp.einsum("bkgth,bskh->bkgts", qh[:, :, :, lo:hi], k[:, :hi], preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, :, None, lo:hi, :hi], scores * scale, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkgts,bskh->bkgth", probs, v[:, :hi]))
    return jnp.concatenate(outs, axis=3).reshape(b, n, t, h).transpose(0, 2, 1, 3)


def timed(fn, *args, repeats=5):
    import jax

    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    out = jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return out, compile_s, best


def attention_alone(dtype_name: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from arlopti_jax.models.decoder import _causal_blocks, segment_mask

    dtype = jnp.dtype(dtype_name)
    rng = np.random.default_rng(0)
    print(f"attention alone, {dtype_name}: rows x slots, heads / kv heads x head dim; compile s and best of 5 ms")
    for b, t, n, kv, h in [(8, 192, 9, 3, 64), (8, 320, 9, 3, 64), (1, 768, 9, 3, 64), (2, 960, 9, 3, 64),
                           (1, 1536, 9, 3, 64), (2, 640, 4, 2, 32)]:
        seg = np.zeros((b, t), np.int32)
        seg[:, : t // 3], seg[:, t // 3: t - 20] = 1, 2
        mask = segment_mask(jnp.asarray(seg))
        q, k, v = (jnp.asarray(rng.normal(size=(b, t, x, h)), dtype) for x in (n, kv, kv))
        w = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)

        def grad_of(f):
            return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, mask, 0.125).astype(jnp.float32) * w),
                                    argnums=(0, 1, 2)))

        with jax.default_matmul_precision("highest"):
            ref = grad_of(autodiff_blocks)(*(x.astype(jnp.float32) for x in (q, k, v)))
        line = f"{b} x {t}, {n}/{kv} x {h}:"
        for name, f in (("autodiff", autodiff_blocks), ("written", _causal_blocks)):
            grads, compile_s, best = timed(grad_of(f), q, k, v)
            err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / float(jnp.max(jnp.abs(r))))
                      for g, r in zip(grads, ref))
            line += f"  {name} {compile_s:.2f} s, {best * 1e3:.1f} ms (grad error {err:.1e})"
        print(line)


def whole_model(folder: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import ModelConfig, decoder, init_params
    from arlopti_jax.models.policy import packed_hidden_states

    cfg = ModelConfig.from_hf_dict(json.loads((Path(folder) / "config.json").read_text()), dtype="float32",
                                   param_dtype="float32")
    mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    with shd.activate(mesh):
        params = init_params(cfg, jax.random.key(0), mesh)
    written = decoder._causal_blocks
    rng = np.random.default_rng(0)
    print(f"whole model ({cfg.num_layers} layers, hidden {cfg.hidden_size}), forward + backward, float32: "
          f"best of 3 ms, two rounds interleaved")
    try:
        for b, t in [(8, 320), (2, 960), (1, 768)]:
            tokens = jnp.asarray(rng.integers(0, 1000, (b, t)), jnp.int32)
            seg = np.zeros((b, t), np.int32)
            seg[:, : t // 2], seg[:, t // 2: t - 10] = 1, 2
            pos = jnp.asarray(np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None].repeat(b, 0), jnp.int32)
            best = {}
            for _ in range(2):
                for name, f in (("autodiff", autodiff_blocks), ("written", written)):
                    decoder._causal_blocks = f
                    fn = jax.jit(jax.grad(lambda p: jnp.sum(
                        packed_hidden_states(cfg, p, tokens, pos, jnp.asarray(seg)) ** 2)))
                    with shd.activate(mesh):
                        _, _, ms = timed(fn, params, repeats=3)
                    best[name] = min(best.get(name, float("inf")), ms)
            print(f"{b} x {t}: autodiff {best['autodiff'] * 1e3:.0f} ms, written {best['written'] * 1e3:.0f} ms "
                  f"(autodiff / written {best['autodiff'] / best['written']:.2f})")
    finally:
        decoder._causal_blocks = written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--model", default="", help="an HF model folder: also time its whole layer stack")
    args = ap.parse_args()
    attention_alone(args.dtype)
    if args.model:
        whole_model(args.model)


if __name__ == "__main__":
    main()
