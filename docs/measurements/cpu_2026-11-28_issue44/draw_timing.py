"""The per-step draw alone on the CPU at SmolLM2's vocabulary (49,152), greedy as a traced flag:
the elementwise select of a83b881 (``_draw`` with the flag traced) against the conditional that
``sample_tokens`` uses on the CPU since then, and the static greedy program of a0c05ac's kind.
Milliseconds per call, median of 30 calls, 5 rounds interleaved. Run: ``python draw_timing.py``."""

import time

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_platforms", "cpu")

from arlopti_jax.rollout.sampling import _draw, sample_tokens  # noqa: E402

V = 49152
for N in (16, 64):
    logits = jax.random.normal(jax.random.key(0), (N, V)) * 3
    key, rows, T, P = jax.random.key(1), jnp.arange(N), jnp.float32(0.7), jnp.float32(1.0)
    kw = dict(top_k=0, use_top_p=False)
    programs = {
        "static greedy": jax.jit(lambda lg, s, g: sample_tokens(lg, key, s, rows, T, P, greedy=True, **kw)),
        "select": jax.jit(lambda lg, s, g: _draw(lg, key, s, rows, T, P, greedy=g, forced=None, **kw)),
        "conditional": jax.jit(lambda lg, s, g: sample_tokens(lg, key, s, rows, T, P, greedy=g, **kw)),
    }
    res = {}
    for _ in range(5):
        for name, fn in programs.items():
            for greedy in (True, False) if name != "static greedy" else (True,):
                jax.block_until_ready(fn(logits, 3, greedy))
                ts = []
                for _ in range(30):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(logits, 3, greedy))
                    ts.append(time.perf_counter() - t0)
                res.setdefault((name, greedy), []).append(np.median(ts) * 1e3)
    for (name, greedy), v in res.items():
        print(f"N={N} {name:14s} greedy={greedy!s:5s} ms: " + " ".join(f"{x:.1f}" for x in v)
              + f"  median {np.median(v):.1f}")
