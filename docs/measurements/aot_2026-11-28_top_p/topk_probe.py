"""lax.top_k on [64, 151936] float32 logits, compiled for a target (compile-only): bytes, custom
calls (XLA:GPU's TopK kernel) and sorts, for k from 1 to the whole vocabulary.

    python docs/measurements/aot_2026-11-28_top_p/topk_probe.py h100
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from arlopti_jax.aot import hlo, targets  # noqa: E402

targets.prepare_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

target = targets.get(sys.argv[1])
mesh = jax.sharding.Mesh(targets.devices(target)[:1], ("x",))
logits = jax.ShapeDtypeStruct((64, 151936), jnp.float32,
                              sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
for k in (1, 8, 16, 64, 256, 1024, 151936):
    compiled = jax.jit(lambda x, k=k: jax.lax.top_k(x, k)).lower(logits).compile()
    text = compiled.as_text()
    moved = (hlo.Module(text).bytes() if target.platform == "gpu"
             else (compiled.cost_analysis() or {}).get("bytes accessed"))
    fusions = sum(1 for line in text.splitlines() if " fusion(" in line and not line.strip().startswith("ROOT"))
    print(f"k={k:6d} bytes {moved / 1e6:8.1f} MB  custom calls {text.count('custom_call_target=')} "
          f"sorts {text.count(' sort(')} fusions {fusions}", flush=True)
