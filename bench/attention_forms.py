"""The CPU/TPU attention's two gradients at the shapes the project runs, interleaved in one process:
the written-out gradient of ``decoder._blocks`` (recomputes each block's probabilities from the
saved log-sum-exp) against autodiff through the same forward (saves them).

    python bench/attention_forms.py [--reps 15]

Per shape (rows x slots; 4 query heads over 2 key heads of 64, float32, causal): the forward and
backward, median milliseconds of each, after checking both give the same gradients.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from arlopti_jax.models import decoder  # noqa: E402

SHAPES = [(8, 192), (8, 320), (4, 448), (2, 512), (2, 640)]


def autodiff(qh, k, v, mask, scale):
    return decoder._blocks_forward(qh, k, v, mask, scale)[0]


def measure(rows: int, slots: int, reps: int) -> dict:
    n, kv, h = 4, 2, 64
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (rows, slots, n, h))
    k, v = (jax.random.normal(key, (rows, slots, kv, h)) for key in keys[1:3])
    g = jax.random.normal(keys[3], q.shape)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((slots, slots), bool)), (rows, 1, slots, slots))

    def step(blocks):
        def f(q, k, v):
            qh = q.transpose(0, 2, 1, 3).reshape(rows, kv, n // kv, slots, h)
            return blocks(qh, k, v, mask, h ** -0.5).reshape(rows, n, slots, h).transpose(0, 2, 1, 3)
        return jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](g))

    fns = {"written": step(decoder._blocks), "autodiff": step(autodiff)}
    grads = {name: fn(q, k, v) for name, fn in fns.items()}
    for a, b in zip(grads["written"], grads["autodiff"]):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(q, k, v))
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15, help="timed calls of each form per shape (default 15)")
    args = ap.parse_args()
    print(f"jax {jax.__version__}, {jax.default_backend()}")
    print("| rows x slots | blocks | written ms | autodiff ms | autodiff / written |\n|---|---|---|---|---|")
    for rows, slots in SHAPES:
        ms = measure(rows, slots, args.reps)
        print(f"| {rows} x {slots} | {len(decoder._edges(slots)) - 1} | {ms['written']:.1f} | {ms['autodiff']:.1f} | "
              f"{ms['autodiff'] / ms['written']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
