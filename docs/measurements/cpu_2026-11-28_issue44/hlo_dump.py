"""The sampler's decode loop (or, with argv[4] = prefill, its prefill) compiled on the CPU with
the metadata stripped, written to argv[1]; argv[2]: tiny | smollm2 (SmolLM2-135M's widths, random
weights); argv[3]: dense | aware (``length_aware``). Runs against the package before and after
``greedy`` became a settings value of its own (a0c05ac and later)."""

import re
import sys

import jax
import numpy as np

jax.config.update("jax_platforms", "cpu")

from arlopti_jax.models import ModelConfig, init_params  # noqa: E402
from arlopti_jax.rollout import Sampler, SamplingConfig  # noqa: E402
from arlopti_jax.runtime import sharding as shd  # noqa: E402

SHAPES = {"tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4,
                       num_kv_heads=2),
          "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3)}
cfg = ModelConfig(**SHAPES[sys.argv[2]], head_dim=64, tie_word_embeddings=True)
mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
params = init_params(cfg, jax.random.key(0), mesh)
sampler = Sampler(cfg, mesh)
sampling = SamplingConfig(max_response_len=48, length_aware=sys.argv[3] == "aware")
batch = sampler.pad_prompts([[1, 2, 3, 4] * 16] * 32, sampling)
if sys.argv[4:] == ["prefill"]:
    program = sampler._prefill.lower(params, batch.ids, batch.mask)
else:
    state = sampler.start(params, batch, 1, jax.random.key(1), sampling)
    settings, kw = list(sampler._traced_settings(sampling)), {"kernel": sampling.kernel_key}
    if len(settings) == 4:  # (temperature, top_p, eos, greedy) since 396579d; three values before
        kw["greedy"] = settings.pop()
    program = sampler._decode.lower(params, state, jax.random.key(1), *settings, np.int32(0), **kw)
text = program.compile().as_text()
text = re.sub(r", metadata=\{[^}]*\}", "", text)
text = re.sub(r"(frontend_attributes|backend_config)=\{[^}]*\}", "", text)
open(sys.argv[1], "w").write(text)
