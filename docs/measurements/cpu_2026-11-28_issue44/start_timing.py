"""The sampler's prefill program and ``Sampler.start`` (prefill + first token) at SmolLM2's widths
on the CPU, 32 prompts of 64 tokens: median of 6 calls after 2. Run it in each tree, as ab.sh does:
``cd TREE && PYTHONPATH=TREE python start_timing.py``."""

import statistics
import time

import jax
import numpy as np

jax.config.update("jax_platforms", "cpu")

from arlopti_jax.models import ModelConfig, init_params  # noqa: E402
from arlopti_jax.rollout import Sampler, SamplingConfig  # noqa: E402
from arlopti_jax.runtime import sharding as shd  # noqa: E402

cfg = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                  num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
params = init_params(cfg, jax.random.key(0), mesh)
sampler, sampling = Sampler(cfg, mesh), SamplingConfig(max_response_len=48)
rng = np.random.default_rng(0)
prompts = [list(rng.integers(3, 1000, 64)) for _ in range(32)]
batch = sampler.pad_prompts(prompts, sampling)
prefill, start = [], []
for i in range(8):
    t = time.perf_counter()
    jax.block_until_ready(sampler._prefill(params, batch.ids, batch.mask))
    prefill.append(time.perf_counter() - t)
    t = time.perf_counter()
    jax.block_until_ready(sampler.start(params, sampler.pad_prompts(prompts, sampling), 1, jax.random.key(i), sampling))
    start.append(time.perf_counter() - t)
print(f"prefill {statistics.median(prefill[2:]) * 1e3:.0f} ms, "
      f"start (prefill + first token) {statistics.median(start[2:]) * 1e3:.0f} ms")
