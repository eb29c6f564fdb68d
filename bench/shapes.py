"""Qwen2.5-shaped model presets for the benchmarks (random weights) and the memory plan.

    from shapes import SHAPES, model_config, hf_model
    cfg = model_config("3b", layers=2)          # real widths, fewer layers (CPU)

The Qwen2.5 sizes are ``arlopti_jax.aot.shapes.QWEN25`` (their config.json values: hidden,
intermediate, layers, attention heads, kv heads, vocabulary 151936 up to 3B and 152064 for 7B,
tied input/output embeddings for 0.5B-3B, untied for 7B); ``tiny`` is a small model of the same
architecture for quick runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arlopti_jax.aot.shapes import QWEN25  # noqa: E402

SHAPES = {"tiny": dict(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2, vocab=8192, tied=True)}
SHAPES.update({name: dict(hidden=q["hidden_size"], intermediate=q["intermediate_size"], layers=q["num_hidden_layers"],
                          heads=q["num_attention_heads"], kv_heads=q["num_key_value_heads"], vocab=q["vocab_size"],
                          tied=q["tie_word_embeddings"]) for name, q in QWEN25.items()})
DIM_FLAGS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")


def dims(shape: str, **overrides) -> dict:
    """A preset's dimensions with the non-None ``overrides`` applied."""
    out = dict(SHAPES[shape])
    out.update({k: v for k, v in overrides.items() if v is not None})
    if out["heads"] % out["kv_heads"] or out["hidden"] % out["heads"]:
        raise ValueError(f"heads={out['heads']} must divide hidden={out['hidden']} and be a multiple of "
                         f"kv_heads={out['kv_heads']}")
    return out


def add_shape_flags(parser, default: str = "tiny") -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default=default, help="Qwen2.5-shaped preset")
    for name in DIM_FLAGS:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, help="override the preset")


def model_config(shape: str | dict, dtype: str = "float32", param_dtype: str | None = None, remat: bool = False,
                 **overrides):
    """arlopti_jax ModelConfig of a preset (Qwen2 architecture: qkv biases, rope theta 1e6)."""
    from arlopti_jax.models import ModelConfig

    d = dims(shape, **overrides) if isinstance(shape, str) else shape
    return ModelConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["intermediate"],
                       num_layers=d["layers"], num_heads=d["heads"], num_kv_heads=d["kv_heads"],
                       head_dim=d["hidden"] // d["heads"], tie_word_embeddings=d["tied"], qkv_bias=True,
                       rope_theta=1_000_000.0, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat)


def hf_model(d: dict, dtype: str = "float32", seed: int = 0):
    """A randomly initialised transformers Qwen2ForCausalLM of the same dimensions."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["intermediate"],
        num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv_heads"],
        tie_word_embeddings=d["tied"], max_position_embeddings=32768, rope_theta=1_000_000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.Qwen2ForCausalLM(config).to(getattr(torch, dtype))
