"""The workload shared by tests/rollout/test_length_aware.py and its multi-process check
(tests/helpers/multiprocess_sampler.py): a small random model, prompts and forced EOS lengths."""

import numpy as np

from arlopti_jax.models import ModelConfig
from arlopti_jax.rollout import SamplingConfig

MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, qkv_bias=True)
NUM_PROMPTS, N, R = 6, 4, 16


def prompts() -> list:
    rng = np.random.default_rng(0)
    return [rng.integers(3, MODEL.vocab_size, size=int(k)).tolist() for k in rng.integers(2, 12, NUM_PROMPTS)]


def stops() -> np.ndarray:
    return np.random.default_rng(1).integers(1, R + 4, NUM_PROMPTS * N)


def sampling(length_aware: bool) -> SamplingConfig:
    return SamplingConfig(max_response_len=R, temperature=0.9, eos_ids=(2,), length_aware=length_aware,
                          phase_tokens=4, min_rows=1)
