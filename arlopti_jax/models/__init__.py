"""The policy model: a Flax Qwen2 / Llama / Qwen3 / Gemma 3 decoder, its functional API and HF checkpoint I/O."""

from arlopti_jax.models.config import ModelConfig
from arlopti_jax.models.decode import init_cache
from arlopti_jax.models.decoder import Decoder, position_ids
from arlopti_jax.models.policy import (
    abstract_params,
    hidden_states,
    init_params,
    logits,
    logprobs_from_hidden,
    packed_hidden_states,
    param_logical_specs,
    param_shardings,
    target_logprobs,
    token_logprobs,
    unembed_matrix,
)
from arlopti_jax.models.hf import CheckpointError, load_params, load_pretrained, save_pretrained
from arlopti_jax.models import lora

__all__ = [
    "ModelConfig", "Decoder", "init_cache", "position_ids", "abstract_params", "hidden_states",
    "init_params", "logits", "logprobs_from_hidden", "packed_hidden_states", "param_logical_specs",
    "param_shardings", "target_logprobs", "token_logprobs", "unembed_matrix", "CheckpointError", "load_params",
    "load_pretrained",
    "save_pretrained", "lora",
]
