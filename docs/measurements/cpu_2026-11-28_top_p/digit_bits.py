"""nucleus_floor on the CPU at [64, 49152] (top_p 0.9, logits normal x 3 / 0.7): 4, 2 or 1 bits a
pass, the reduction over the middle axis of [N, V, settings] ("mid", the code's form) or over the
last of [N, settings, V] ("minor"). All give the same floor (checked). Median of 5 calls, after one.
Run: ``python digit_bits.py``."""

import time

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_platforms", "cpu")

from arlopti_jax.rollout.sampling import _ordered, nucleus_floor  # noqa: E402


def floor_minor(scaled, lse, top_p, digit_bits):
    key = _ordered(scaled)
    p = jnp.exp(scaled - lse[:, None])
    floor = jnp.zeros(scaled.shape[:1], jnp.uint32)
    digits = jnp.arange(1, 1 << digit_bits, dtype=jnp.uint32)
    for shift in range(32 - digit_bits, -1, -digit_bits):
        settings = floor[:, None] | (digits << shift)[None, :]
        mass = jnp.sum(jnp.where(key[:, None, :] >= settings[:, :, None], p[:, None, :], 0.0), axis=-1)
        floor = floor | (jnp.sum(mass >= top_p, axis=-1).astype(jnp.uint32) << shift)
    return floor


V, N = 49152, 64
logits = jax.random.normal(jax.random.key(0), (N, V)) * 3 / 0.7
lse, P = jax.nn.logsumexp(logits, axis=-1), jnp.float32(0.9)
progs = {f"{form}{bits}": jax.jit(lambda x, lg, f=fn, b=bits: f(x, lg, P, b))
         for form, fn in (("mid", nucleus_floor), ("minor", floor_minor)) for bits in (4, 2, 1)}
ref = np.asarray(progs["mid4"](logits, lse))
for name, f in progs.items():
    assert (np.asarray(f(logits, lse)) == ref).all(), name
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(logits, lse))
        ts.append(time.perf_counter() - t0)
    print(name, f"{np.median(ts) * 1e3:.1f} ms", flush=True)
