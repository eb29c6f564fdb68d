import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from arlopti_jax.aot import targets, hlo
targets.prepare_environment()
import jax, jax.numpy as jnp
t = targets.get(sys.argv[1])
dev = targets.devices(t)[:1]
mesh = jax.sharding.Mesh(dev, ("x",))
sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
x = jax.ShapeDtypeStruct((64, 151936), jnp.float32, sharding=sh)
for k in (1, 8, 16, 64, 256, 1024, 151936):
    c = jax.jit(lambda x: jax.lax.top_k(x, k)).lower(x).compile()
    text = c.as_text()
    by = hlo.Module(text).bytes() if t.platform == "gpu" else (c.cost_analysis() or {}).get("bytes accessed")
    n = text.count("custom_call_target=") ; sorts = text.count(" sort(")
    fus = sum(1 for l in text.splitlines() if l.strip().startswith("ROOT") is False and " fusion(" in l)
    print(f"k={k:6d} bytes {by/1e6:8.1f} MB  custom calls {n} sorts {sorts} fusions {fus}", flush=True)
