"""One layer's attention on a TPU, forward + backward, compiled in compile-only mode: the
trainer's attention (``decoder._causal_blocks``: causal query blocks with a written gradient),
XLA's lowering of a plain softmax attention over all T x T scores, and Pallas splash attention
(causal within packed segments, the query heads of each KV head as one MQA call).

    python bench/splash_probe.py [--target v5e-1] [--tokens 4608]

Qwen2.5-3B's attention shape (16 query heads, 2 KV heads, head dim 128), bfloat16, one packed
row of --tokens (a multiple of splash's 128-token blocks) holding 4 segments. Prints XLA:TPU's
flops, bytes and time estimate for each. Compiler figures, not runs: XLA:TPU's cost model does
not cost Pallas (Mosaic) kernels, so splash's estimate leaves its kernels out; what the probe
shows is that the kernel compiles for the target and what the XLA lowering costs.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="v5e-1")
    ap.add_argument("--tokens", type=int, default=4608)
    args = ap.parse_args()
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from arlopti_jax.aot import hlo, targets

    targets.prepare_environment()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    from arlopti_jax.runtime import sharding as shd
    from arlopti_jax.models import decoder

    target = targets.get(args.target)
    mesh = shd.make_mesh({"fsdp": 1}, devices=list(targets.devices(target))[:1])
    rep = shd.replicated(mesh)
    T, N, K, H = args.tokens, 16, 2, 128
    G = N // K
    kernel = splash_lib.make_splash_mqa(mask_lib.MultiHeadMask([mask_lib.CausalMask((T, T))] * G),
                                        head_shards=1, q_seq_shards=1)

    def splash(q, k, v, seg):  # q [N, T, H]: K groups of G query heads; k, v [K, T, H]
        ids = splash_lib.SegmentIds(q=seg, kv=seg)
        return jax.vmap(kernel, in_axes=(0, 0, 0, None))(q.reshape(K, G, T, H), k, v, ids).reshape(N, T, H)

    def xla(q, k, v, seg):
        s = jnp.einsum("kgth,ksh->kgts", q.reshape(K, G, T, H).astype(jnp.float32), k.astype(jnp.float32))
        allowed = (seg[:, None] == seg[None, :]) & (jnp.arange(T)[:, None] >= jnp.arange(T)[None, :])
        p = jax.nn.softmax(jnp.where(allowed, s / np.sqrt(H), -1e30), axis=-1).astype(jnp.bfloat16)
        return jnp.einsum("kgts,ksh->kgth", p, v).reshape(N, T, H)

    def blocks(q, k, v, seg):  # the trainer's layout: q [1, T, N, H], k and v [1, T, K, H]
        out = decoder._causal_blocks(q.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None],
                                     v.transpose(1, 0, 2)[None], decoder.segment_mask(seg[None]), 1 / np.sqrt(H))
        return out[0].transpose(1, 0, 2)

    def loss(f, q, k, v, seg):
        return jnp.sum(f(q, k, v, seg).astype(jnp.float32) ** 2)

    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rep)
    inputs = (spec((N, T, H), jnp.bfloat16), spec((K, T, H), jnp.bfloat16), spec((K, T, H), jnp.bfloat16),
              spec((T,), jnp.int32))
    causal = 4 * N * H * T * T / 2 * 3.5  # QK and PV over half the pairs; the backward's five products: 3.5x
    print(f"jax {jax.__version__}; {target.label}; attention of 16 heads (2 KV) x {T} tokens, forward + backward: "
          f"{causal / 1e12:.2f} TFLOP causal; compiler figures (compile-only), not runs")
    for name, f in (("blocks", blocks), ("xla", xla), ("splash", splash)):
        grad = jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1, 2)))
        start = time.perf_counter()
        with shd.activate(mesh):
            compiled = grad.lower(*inputs).compile()
        seconds = time.perf_counter() - start
        cost, text = compiled.cost_analysis() or {}, compiled.as_text()
        estimate = hlo.tpu_estimate(cost.get("optimal_seconds"), text)
        kernels = text.count('custom_call_target="tpu_custom_call"')
        print(f"{name:6s}: compiled in {seconds:.1f} s; {cost.get('flops', 0) / 1e12:.2f} TFLOP and "
              f"{cost.get('bytes accessed', 0) / 1e9:.2f} GB costed; estimate "
              + (f"{estimate * 1e3:.2f} ms ({causal / estimate / target.peak_flops:.0%} of peak for the causal FLOPs)"
                 if estimate else "none") + f"; Pallas kernels {kernels}" + (" (not costed)" if kernels else ""))


if __name__ == "__main__":
    main()
