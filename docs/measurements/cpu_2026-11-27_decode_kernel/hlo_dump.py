"""The sampler's dense decode loop for the tiny shape, compiled on the CPU, written to argv[1] with
the metadata stripped (compare two trees' outputs instruction by instruction)."""

import re
import sys

import jax
import numpy as np

jax.config.update("jax_platforms", "cpu")

from arlopti_jax.models import ModelConfig, init_params  # noqa: E402
from arlopti_jax.rollout import Sampler, SamplingConfig  # noqa: E402
from arlopti_jax.runtime import sharding as shd  # noqa: E402

cfg = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
params = init_params(cfg, jax.random.key(0), mesh)
sampler = Sampler(cfg, mesh)
sampling = SamplingConfig(max_response_len=128, length_aware=False)
state = sampler.start(params, sampler.pad_prompts([[1, 2, 3, 4]] * 32, sampling), 1, jax.random.key(1), sampling)
temperature, top_p, eos, greedy = sampler._traced_settings(sampling)
text = sampler._decode.lower(params, state, jax.random.key(1), temperature, top_p, eos, np.int32(0),
                             kernel=sampling.kernel_key, greedy=greedy).compile().as_text()
text = re.sub(r", metadata=\{[^}]*\}", "", text)
text = re.sub(r"(frontend_attributes|backend_config)=\{[^}]*\}", "", text)
open(sys.argv[1], "w").write(text)
