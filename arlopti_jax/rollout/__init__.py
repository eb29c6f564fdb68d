"""The sampler: jitted, sharded KV-cache prefill + ``while_loop`` decode of response groups."""

from arlopti_jax.rollout.output import Rollout
from arlopti_jax.rollout.sampler import Decoded, DecodeState, PromptBatch, Sampler
from arlopti_jax.rollout.stop import apply_stops, cut_texts, find_stop
from arlopti_jax.rollout.sampling import SamplingConfig, bucket, gumbel_noise, sample_tokens

__all__ = ["Decoded", "DecodeState", "PromptBatch", "Rollout", "Sampler", "SamplingConfig", "apply_stops",
           "bucket", "cut_texts", "find_stop", "gumbel_noise", "sample_tokens"]
