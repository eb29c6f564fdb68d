"""Greedy and sampled rollouts at SmolLM2's widths on the CPU (random weights, 16 prompts of 40-63
tokens x 4 samples, 32 new tokens, T = 1), seconds per rollout for ``rounds`` rounds in one process
(the first compiles), and the last round's tokens and log-probs saved for a bitwise comparison
between trees. Run in each tree: ``PYTHONPATH=TREE python greedy_rollout.py OUT.npz 3``."""

import sys
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
sampler = Sampler(cfg, mesh)
rng = np.random.default_rng(0)
prompts = [list(rng.integers(3, 1000, int(rng.integers(40, 64)))) for _ in range(16)]
out, times = {}, {"greedy": [], "sampled": []}
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
    for mode in ("greedy", "sampled"):
        sampling = SamplingConfig(max_response_len=32, greedy=mode == "greedy", temperature=1.0)
        t = time.perf_counter()
        roll = sampler.generate(params, prompts, 4, jax.random.key(7), sampling)
        times[mode].append(time.perf_counter() - t)
        out[mode + "_ids"], out[mode + "_lp"] = roll.response_ids, roll.logprobs
np.savez(sys.argv[1], **out)
print("seconds per rollout", {m: [round(x, 2) for x in v] for m, v in times.items()})
