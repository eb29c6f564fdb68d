"""Qwen2.5-shaped model presets for the benchmarks (random weights) and the memory plan.

    from shapes import SHAPES, model_config, hf_model
    cfg = model_config("3b", layers=2)          # real widths, fewer layers (CPU)

Dimensions are Qwen2.5's config.json values: hidden, intermediate, layers, attention heads,
kv heads, vocabulary 151936, tied input/output embeddings for 0.5B-3B, untied for 7B.
"""

from __future__ import annotations

SHAPES = {
    "tiny": dict(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2, vocab=8192, tied=True),
    "0.5b": dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tied=True),
    "1.5b": dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=151936, tied=True),
    "3b": dict(hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2, vocab=151936, tied=True),
    "7b": dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=151936, tied=False),
}
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
