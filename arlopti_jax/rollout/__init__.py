"""The sampler: jitted, sharded KV-cache prefill + ``while_loop`` decode of response groups."""

from arlopti_jax.rollout.output import Rollout
from arlopti_jax.rollout.sampler import Decoded, DecodeState, PromptBatch, Sampler
from arlopti_jax.rollout.sampling import SamplingConfig, bucket, gumbel_noise, sample_tokens

__all__ = ["Decoded", "DecodeState", "PromptBatch", "Rollout", "Sampler", "SamplingConfig", "bucket",
           "gumbel_noise", "sample_tokens"]
