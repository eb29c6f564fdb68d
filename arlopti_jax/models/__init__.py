"""The policy model: a Flax Qwen2 / Llama / Qwen3 / Gemma 3 decoder, its functional API and HF checkpoint I/O.

The names load on first use (PEP 562), so that ``python -m arlopti_jax.models.gguf`` runs its own
process settings (``runtime/process.py``) before anything here imports JAX.
"""

import importlib

_HOMES = {
    "ModelConfig": "config", "init_cache": "decode", "Decoder": "decoder", "position_ids": "decoder",
    **{name: "policy" for name in (
        "abstract_params", "hidden_states", "init_params", "logits", "logprobs_from_hidden",
        "packed_hidden_states", "param_logical_specs", "param_shardings", "target_logprobs",
        "token_logprobs", "unembed_matrix")},
    **{name: "hf" for name in ("CheckpointError", "load_params", "load_pretrained", "save_pretrained")},
}

__all__ = [*_HOMES, "lora"]


def __getattr__(name):
    if name == "lora":
        return importlib.import_module("arlopti_jax.models.lora")
    if name in _HOMES:
        value = getattr(importlib.import_module(f"arlopti_jax.models.{_HOMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'arlopti_jax.models' has no attribute {name!r}")
