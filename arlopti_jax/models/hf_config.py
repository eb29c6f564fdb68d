"""A Hugging Face ``config.json`` <-> ``ModelConfig``'s fields, per family.

Read: transformers 5's layout (``rope_parameters``, per layer type for Gemma 3; ``layer_types``)
and the older one the Hub's folders still hold (``rope_theta``, ``rope_scaling``, Gemma 3's
``rope_local_base_freq`` and ``sliding_window_pattern``), with transformers' defaults for keys a
file leaves out. A value this project does not implement (another activation, a rope type,
biases it has no place for, bidirectional attention) is a ValueError naming the key.
Gemma 3 from 4B up is published as an image-text model (``Gemma3ForConditionalGeneration``): its
``text_config`` is read as the text model's (``TEXT_MODELS``), whose tensors sit under
``language_model.`` in its files (``hf.load_params``); the vision tower is not read, and the model
this project trains and exports is the text model, a ``Gemma3ForCausalLM``.
Written: the older layout plus ``layer_types``, which transformers 4.5x and 5 both read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# architecture -> family: what the decoder builds (``variants.py`` holds where the families differ)
SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
                           "Gemma3ForCausalLM": "gemma3"}
MODEL_TYPES = {"qwen2": "qwen2", "llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}
# an image-text architecture -> (its text model's architecture, the prefix of the text model's tensors)
TEXT_MODELS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "language_model.")}
GEMMA3_DEFAULTS = dict(rope_theta=1_000_000.0, rope_local_theta=10_000.0, query_pre_attn_scalar=256,
                       sliding_window=4096, sliding_window_pattern=6, max_position_embeddings=131_072)
# transformers' Gemma3TextConfig defaults for the keys a file may leave out (the Hub's image-text
# configs list only what differs from them)
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256, bos_token_id=2, eos_token_id=1,
                            tie_word_embeddings=True)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_scaling(rope: dict) -> tuple | None:
    """A rope_parameters / rope_scaling dict -> ``ModelConfig.rope_scaling`` (None: plain RoPE)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "llama3":
        return (("rope_type", "llama3"),) + tuple((k, rope[k]) for k in _LLAMA3_KEYS)
    if kind == "linear":
        return (("rope_type", "linear"), ("factor", float(rope["factor"])))
    raise ValueError(f"config.json rope_scaling type {kind!r}: only 'default', 'linear' and 'llama3' are supported")


def _rope(hf: dict, family: str) -> dict:
    """rope_theta, rope_scaling and (Gemma 3) rope_local_theta."""
    params = dict(hf.get("rope_parameters") or {})
    if family == "gemma3":
        full = dict(params.get("full_attention") or hf.get("rope_scaling") or {})
        local = dict(params.get("sliding_attention") or {})
        if _rope_scaling(local) is not None:
            raise ValueError("config.json rope_parameters.sliding_attention: only plain RoPE ('default') is supported "
                             "on Gemma 3's sliding layers")
        return dict(rope_theta=float(full.get("rope_theta", hf.get("rope_theta", GEMMA3_DEFAULTS["rope_theta"]))),
                    rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq",
                                                                           GEMMA3_DEFAULTS["rope_local_theta"]))),
                    rope_scaling=_rope_scaling(full))
    rope = params or dict(hf.get("rope_scaling") or {})
    return dict(rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(rope))


def _gemma3(hf: dict, layers: int) -> dict:
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true: only causal attention is supported")
    types = hf.get("layer_types")
    if types is None:  # the older files: every pattern-th layer global, as transformers reads them
        pattern = int(hf.get("sliding_window_pattern") or GEMMA3_DEFAULTS["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    window = hf.get("sliding_window", GEMMA3_DEFAULTS["sliding_window"])
    return dict(qk_norm=True, layer_types=tuple(types), sliding_window=None if window is None else int(window),
                query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", GEMMA3_DEFAULTS["query_pre_attn_scalar"])),
                attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                final_logit_softcapping=hf.get("final_logit_softcapping"))


def text_model(hf: dict[str, Any]) -> dict[str, Any]:
    """An image-text config.json's text model as its own config.json dict (``TEXT_MODELS``); any other
    config as it is."""
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in TEXT_MODELS:
        return hf
    text = dict(hf.get("text_config") or {})
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):  # kept at the top level by some files
        if key not in text and key in hf:
            text[key] = hf[key]
    return {**text, "architectures": [TEXT_MODELS[archs[0]][0]]}


def read_hf_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig``'s fields from a config.json dict (an image-text model's: its text model's)."""
    hf = text_model(hf)
    archs = hf.get("architectures") or [hf.get("model_type", "?")]
    arch = archs[0]
    if arch == "Gemma3ForCausalLM":
        hf = {**GEMMA3_TEXT_DEFAULTS, **hf}
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"config.json architectures={archs}: unsupported; "
                         f"supported: {sorted(SUPPORTED_ARCHITECTURES)} (and the text model of {sorted(TEXT_MODELS)})")
    family = SUPPORTED_ARCHITECTURES[arch]
    gemma = family == "gemma3"
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = hf.get(act_key) or hf.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    want = "gelu_pytorch_tanh" if gemma else "silu"
    if act != want:
        raise ValueError(f"config.json {act_key}={act!r}: only {want!r} is supported for {arch}")
    if hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true: sliding-window attention is not supported for " + arch)
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported")
    if family in ("qwen3", "gemma3") and hf.get("attention_bias"):
        raise ValueError(f"config.json attention_bias=true: not supported for {arch}")
    num_heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    layers = hf["num_hidden_layers"]
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        max_position_embeddings=hf.get("max_position_embeddings",
                                       GEMMA3_DEFAULTS["max_position_embeddings"] if gemma else 32768),
        architecture=arch,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        **_rope(hf, family),
    )
    if family == "qwen3":
        kwargs["qk_norm"] = True
    if gemma:
        kwargs.update(_gemma3(hf, layers))
    return kwargs


def read_folder(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the checkpoint folder")
    return read_hf_dict(json.loads(path.read_text()))


def write_hf_dict(cfg) -> dict[str, Any]:
    """The config.json of a ``ModelConfig`` (what ``hf.save_pretrained`` writes; this module reads
    no ``ModelConfig`` itself, so that ``config.py`` can import it)."""
    family = cfg.family
    gemma = family == "gemma3"
    out = {
        "architectures": [cfg.architecture],
        "model_type": MODEL_TYPES[family],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        ("hidden_activation" if gemma else "hidden_act"): "gelu_pytorch_tanh" if gemma else "silu",
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "torch_dtype": cfg.param_dtype,
        "use_cache": True,
    }
    if family != "qwen2":
        out["attention_bias"] = cfg.qkv_bias
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if gemma:
        scalar = cfg.query_pre_attn_scalar  # transformers 5 checks that it is an int
        out.update(rope_local_base_freq=cfg.rope_local_theta,
                   query_pre_attn_scalar=int(scalar) if scalar is not None and float(scalar).is_integer() else scalar,
                   sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types or ()),
                   attn_logit_softcapping=cfg.attn_logit_softcapping,
                   final_logit_softcapping=cfg.final_logit_softcapping)
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        eos = cfg.eos_token_id
        out["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
    return out
