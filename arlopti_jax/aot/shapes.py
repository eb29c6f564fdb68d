"""The model's shape for a compile-only check, without its weights.

``for_config`` reads ``config.model.path``'s config.json when the folder is here (and its
tokenizer's end and pad ids, when its files are). A pod job's model folder is often not on the
machine that checks it, so a folder (or Hub id) named after a published size (``PRESETS``:
``models/Qwen2.5-7B-Instruct-1M``, as ``configs/kk.py`` names them, ``Qwen/Qwen3-8B``,
``google/gemma-3-4b-it``) uses that size's published config.json values instead, and says so.
With no model path (the embedded default) it is the start point's shape.
"""

from __future__ import annotations

import re
from pathlib import Path

from arlopti_jax.models import ModelConfig, hub

# Qwen2.5's config.json values: hidden, intermediate, layers, attention heads, kv heads, vocabulary
# (151936 up to 3B, 152064 from 7B), tied embeddings up to 3B; rope theta 1e6, qkv biases.
QWEN25 = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
# Qwen3's (dense): head_dim 128 at every size (not hidden / heads below 8B), 8 kv heads, vocabulary
# 151936, tied embeddings up to 4B, rope theta 1e6, q/k norms, no biases.
QWEN3 = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                tie_word_embeddings=False),
}
# Gemma 3's text models (from 4B up, the text part of the image-text checkpoint, whose text config
# these are): head_dim 256 (128 at 27B, with query_pre_attn_scalar 168), five sliding layers of 512
# (1B) or 1,024 slots to each global one, global RoPE linearly scaled x8 from 4B up, tied embeddings.
GEMMA3 = {
    "1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
               num_key_value_heads=1, vocab_size=262144, sliding_window=512, max_position_embeddings=32768),
    "4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
               num_key_value_heads=4, vocab_size=262208, sliding_window=1024, rope_scaling={
                   "rope_type": "linear", "factor": 8.0}),
    "12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=262208, sliding_window=1024, rope_scaling={
                    "rope_type": "linear", "factor": 8.0}),
    "27b": dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168, vocab_size=262208,
                sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0}),
}
QWEN_EOS, QWEN_PAD = (151643, 151645), 151643  # <|endoftext|>, <|im_end|> (Qwen2.5's and Qwen3's tokenizer)
GEMMA_EOS, GEMMA_PAD = (1, 106), 0  # <eos>, <end_of_turn>; <pad>


def qwen25(size: str) -> dict:
    """A Qwen2.5 size's config.json as a dict (``ModelConfig.from_hf_dict`` reads it)."""
    return {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "eos_token_id": QWEN_PAD, **QWEN25[size]}


def qwen3(size: str) -> dict:
    """A Qwen3 size's config.json as a dict."""
    return {"architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu", "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "head_dim": 128, "num_key_value_heads": 8,
            "vocab_size": 151936, "bos_token_id": QWEN_EOS[0], "eos_token_id": QWEN_EOS[1], **QWEN3[size]}


def gemma3(size: str) -> dict:
    """A Gemma 3 size's text config as a Gemma3ForCausalLM config.json dict (transformers' defaults for
    the rest: rope theta 1e6 global and 1e4 local, query_pre_attn_scalar 256, every sixth layer global)."""
    return {"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh", "head_dim": 256,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "sliding_window_pattern": 6,
            "bos_token_id": 2, "eos_token_id": list(GEMMA_EOS), **GEMMA3[size]}


# (name pattern, family label, sizes, config.json of a size, EOS ids, pad id)
PRESETS = ((re.compile(r"qwen2\.5.*?(\d+(?:\.\d+)?)b"), "Qwen2.5", QWEN25, qwen25, QWEN_EOS, QWEN_PAD),
           (re.compile(r"qwen3.*?(\d+(?:\.\d+)?)b"), "Qwen3", QWEN3, qwen3, QWEN_EOS, QWEN_PAD),
           (re.compile(r"gemma-?3.*?(\d+(?:\.\d+)?)b"), "Gemma-3", GEMMA3, gemma3, GEMMA_EOS, GEMMA_PAD))


def preset(name: str):
    """(label, config.json dict, EOS ids, pad id) of the published size a folder or Hub id's last part
    names (``qwen2.5-7b-instruct``, ``qwen3-8b``, ``gemma-3-4b-it``), or None."""
    for pattern, family, sizes, hf_dict, eos, pad in PRESETS:
        m = pattern.search(name.lower())
        if m and f"{m.group(1)}b" in sizes:
            return f"{family}-{m.group(1).upper()}B", hf_dict(f"{m.group(1)}b"), eos, pad
    return None


def _names() -> str:
    return "; ".join(f"{family} {', '.join(sizes)}" for _, family, sizes, *_ in PRESETS)


def for_config(config) -> tuple[ModelConfig, tuple[int, ...], int, str]:
    """(ModelConfig with the config's numerics and LoRA settings, EOS ids, pad id, where the shape
    came from)."""
    from arlopti_jax.rl import run_setup

    m = config.model
    numerics = run_setup.model_settings(config)  # LoRA's fields too
    if not m.path:  # the embedded start point: its own folder once built, as train reads it
        try:
            path = run_setup.resolve_paths(config, need_train=False, build=False)[0]
        except FileNotFoundError:
            from arlopti_jax.embedded.start_point import SCALES, model_config

            cfg = model_config(SCALES["cpu"], SCALES["cpu"]["vocab_size"]).replace(**numerics)
            return cfg, (2,), 0, "the embedded start point's shape before it is built (vocabulary 1024)"
    else:
        path = Path(m.path)
        try:  # a Hub id: its config and tokenizer from the Hub cache (or the Hub), not its weights
            path = hub.resolve(m.path, weights=False)
        except FileNotFoundError:  # none in reach: a published size in its name still gives the shape
            pass
    if (path / "config.json").is_file():
        try:
            cfg = run_setup.model_config(config, path)
        except ValueError as err:
            raise ValueError(f"config.model.path={m.path}: {err}") from None
        eos, pad = cfg.eos_token_id, 0
        eos = tuple(eos) if isinstance(eos, (tuple, list)) else ((eos,) if eos is not None else (0,))
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            policy = run_setup.Policy(cfg, None, AutoTokenizer.from_pretrained(str(path)), path)
            eos, pad = run_setup.eos_ids(policy), run_setup.pad_id(policy)
        return cfg, eos, pad, f"{path}/config.json"
    found = preset(path.name)
    if found is None:
        raise FileNotFoundError(f"config.model.path={m.path}: no config.json there, and the name is not a published "
                                f"size ({_names()}): point model.path at a folder holding the model's config.json "
                                "(its weights are not read)")
    label, hf_dict, eos, pad = found
    return (ModelConfig.from_hf_dict(hf_dict, **numerics), eos, pad,
            f"{label}'s published config.json (no {path}/config.json here)")
