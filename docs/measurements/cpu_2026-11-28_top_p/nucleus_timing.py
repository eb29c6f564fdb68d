"""The per-step draw alone on the CPU with top_p 0.9: the nucleus by a sort over the vocabulary
(``lax.top_k`` over all of it, the path before this change, still taken with top_k = V) against
the nucleus by its floor (``nucleus_floor``: on the CPU 32 passes of one comparison, no sort).
Temperature 0.7, logits normal x 3. Milliseconds per call, median of 5 calls, 5 rounds
interleaved. Run: ``python nucleus_timing.py``."""

import time

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_platforms", "cpu")

from arlopti_jax.rollout.sampling import sample_tokens  # noqa: E402

for V in (49152, 151936):
    for N in (16, 64):
        logits = jax.random.normal(jax.random.key(0), (N, V)) * 3
        key, rows, T, P = jax.random.key(1), jnp.arange(N), jnp.float32(0.7), jnp.float32(0.9)
        draw = lambda k: jax.jit(lambda lg, s: sample_tokens(lg, key, s, rows, T, P, top_k=k, use_top_p=True,
                                                             greedy=False))
        programs = {"sort": draw(V), "floor": draw(0)}
        res = {}
        for _ in range(5):
            for name, fn in programs.items():
                jax.block_until_ready(fn(logits, 3))
                ts = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(logits, 3))
                    ts.append(time.perf_counter() - t0)
                res.setdefault(name, []).append(np.median(ts) * 1e3)
        line = " ".join(f"{name} {np.median(v):.1f} ms ({' '.join(f'{x:.1f}' for x in v)})" for name, v in res.items())
        print(f"V={V} N={N}: {line}; floor / sort time {np.median(res['floor']) / np.median(res['sort']):.2f}",
              flush=True)
