"""The model's shape for a compile-only check, without its weights.

``for_config`` reads ``config.model.path``'s config.json when the folder is here (and its
tokenizer's end and pad ids, when its files are). A pod job's model folder is often not on the
machine that checks it, so a folder named after a Qwen2.5 size (``models/Qwen2.5-7B-Instruct-1M``,
as ``configs/kk.py`` names them) uses that size's published config.json values instead, and
says so. With no model path (the embedded default) it is the start point's shape.
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
QWEN_EOS, QWEN_PAD = (151643, 151645), 151643  # <|endoftext|>, <|im_end|>


def qwen25(size: str) -> dict:
    """A Qwen2.5 size's config.json as a dict (``ModelConfig.from_hf_dict`` reads it)."""
    return {"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "eos_token_id": QWEN_PAD, **QWEN25[size]}


def _size_in_name(name: str) -> str | None:
    m = re.search(r"qwen2\.5.*?(\d+(?:\.\d+)?)b", name.lower())
    return f"{m.group(1)}b" if m and f"{m.group(1)}b" in QWEN25 else None


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
        except FileNotFoundError:  # none in reach: a Qwen2.5 size in its name still gives the shape
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
    size = _size_in_name(path.name)
    if size is None:
        raise FileNotFoundError(f"config.model.path={m.path}: no config.json there, and the name is not a Qwen2.5 size "
                                f"({', '.join(QWEN25)}): point model.path at a folder holding the model's config.json "
                                "(its weights are not read)")
    return (ModelConfig.from_hf_dict(qwen25(size), **numerics), QWEN_EOS, QWEN_PAD,
            f"Qwen2.5-{size.upper()}'s published config.json (no {path}/config.json here)")
