"""The sampler: jitted, sharded KV-cache prefill + ``while_loop`` decode of response groups."""

from arlopti_jax.rollout.output import Rollout
from arlopti_jax.rollout.sampler import CACHE_AXES, DecodeState, PromptBatch, Sampler
from arlopti_jax.rollout.sampling import SamplingConfig, bucket, sample_tokens

__all__ = ["CACHE_AXES", "DecodeState", "PromptBatch", "Rollout", "Sampler", "SamplingConfig", "bucket",
           "sample_tokens"]
