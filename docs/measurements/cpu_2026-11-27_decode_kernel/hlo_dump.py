import sys, re, jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_platforms", "cpu")
from arlopti_jax.models import ModelConfig, init_params
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.rollout import Sampler, SamplingConfig
cfg = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
mesh = shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
params = init_params(cfg, jax.random.key(0), mesh)
s = Sampler(cfg, mesh)
sc = SamplingConfig(max_response_len=128, length_aware=False)
batch = s.pad_prompts([[1, 2, 3, 4]] * 32, sc)
state = s.start(params, batch, 1, jax.random.key(1), sc)
t, tp, eos, g = s._traced_settings(sc)
txt = s._decode.lower(params, state, jax.random.key(1), t, tp, eos, np.int32(0), kernel=sc.kernel_key, greedy=g).compile().as_text()
txt = re.sub(r", metadata=\{[^}]*\}", "", txt)
txt = re.sub(r"(frontend_attributes|backend_config)=\{[^}]*\}", "", txt)
open(sys.argv[1], "w").write(txt)
print(len(txt))
