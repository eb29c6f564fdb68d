"""A Hugging Face ``config.json`` <-> ``ModelConfig``'s fields, per family.

Read: transformers 5's layout (``rope_parameters``, per layer type for Gemma 3; ``layer_types``)
and the older one the Hub's folders still hold (``rope_theta``, ``rope_scaling``, Gemma 3's
``rope_local_base_freq`` and ``sliding_window_pattern``), with transformers' defaults for keys a
file leaves out. A value this project does not implement (another activation, a rope type,
biases it has no place for, bidirectional attention), a value missing, of the wrong type or out of range
and keys that contradict one another are a ModelFolderError (a start-up error: one line) naming the
file and the key.
Gemma 3 from 4B up is published as an image-text model (``Gemma3ForConditionalGeneration``): its
``text_config`` is read as the text model's (``TEXT_MODELS``), whose tensors sit under
``language_model.`` in its files (``hf.load_params``); the vision tower is not read, and the model
this project trains and exports is the text model, a ``Gemma3ForCausalLM``.
Written: the older layout plus ``layer_types``, which transformers 4.5x and 5 both read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from arlopti_jax.runtime.startup import StartupError

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
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names of a layer's attention
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ModelFolderError(StartupError):
    """A model folder that cannot serve: the message names the file and the key, tensor or file at fault."""


_REQUIRED = object()


def _int(hf: dict, key: str, default=_REQUIRED, low: int = 1) -> int | None:
    """``hf[key]`` as an integer >= ``low``; ``default`` where the file leaves it out (or null)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{key} is missing (an integer >= {low})")
        return default
    if type(value) is not int or value < low:  # bool is not int here: true is no size
        raise ValueError(f"{key}={json.dumps(value)}: expected an integer >= {low}")
    return value


def _number(hf: dict, key: str, default: float | None) -> float | None:
    """``hf[key]`` as a finite number > 0; ``default`` where the file leaves it out (or null)."""
    value = hf.get(key)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key}={json.dumps(value)}: expected a number > 0")
    return float(value)


def _dict(hf: dict, key: str) -> dict:
    value = hf.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{key}={json.dumps(value)}: expected an object")
    return dict(value)


def _rope_scaling(rope: dict, key: str) -> tuple | None:
    """A rope_parameters / rope_scaling dict (under ``key``) -> ``ModelConfig.rope_scaling`` (None: plain RoPE)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "llama3":
        values = {k: _number(rope, k, None) for k in _LLAMA3_KEYS}
        absent = [k for k, v in values.items() if v is None]
        if absent:
            raise ValueError(f"{key}: rope_type 'llama3' needs {', '.join(absent)}")
        return (("rope_type", "llama3"),) + tuple((k, rope[k]) for k in _LLAMA3_KEYS)
    if kind == "linear":
        factor = _number(rope, "factor", None)
        if factor is None:
            raise ValueError(f"{key}: rope_type 'linear' needs factor")
        return (("rope_type", "linear"), ("factor", factor))
    raise ValueError(f"{key} type {kind!r}: only 'default', 'linear' and 'llama3' are supported")


def _rope(hf: dict, family: str) -> dict:
    """rope_theta, rope_scaling and (Gemma 3) rope_local_theta."""
    params = _dict(hf, "rope_parameters")
    if family == "gemma3":
        full = _dict(params, "full_attention") or _dict(hf, "rope_scaling")
        local = _dict(params, "sliding_attention")
        if _rope_scaling(local, "rope_parameters.sliding_attention") is not None:
            raise ValueError("rope_parameters.sliding_attention: only plain RoPE ('default') is supported "
                             "on Gemma 3's sliding layers")
        return dict(rope_theta=_number(full, "rope_theta", _number(hf, "rope_theta", GEMMA3_DEFAULTS["rope_theta"])),
                    rope_local_theta=_number(local, "rope_theta", _number(hf, "rope_local_base_freq",
                                                                          GEMMA3_DEFAULTS["rope_local_theta"])),
                    rope_scaling=_rope_scaling(full, "rope_scaling"))
    rope = params or _dict(hf, "rope_scaling")
    return dict(rope_theta=_number(hf, "rope_theta", _number(rope, "rope_theta", 10000.0)),
                rope_scaling=_rope_scaling(rope, "rope_parameters" if params else "rope_scaling"))


def _gemma3(hf: dict, layers: int) -> dict:
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true: only causal attention is supported")
    types = hf.get("layer_types")
    if types is None:  # the older files: every pattern-th layer global, as transformers reads them
        pattern = _int(hf, "sliding_window_pattern", GEMMA3_DEFAULTS["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif not (isinstance(types, list) and len(types) == layers and set(types) <= set(LAYER_TYPES)):
        raise ValueError(f"layer_types={json.dumps(types)}: expected one of {list(LAYER_TYPES)} for each of the "
                         f"num_hidden_layers={layers} layers")
    return dict(qk_norm=True, layer_types=tuple(types),
                sliding_window=_int(hf, "sliding_window", None) if "sliding_window" in hf
                else GEMMA3_DEFAULTS["sliding_window"],
                query_pre_attn_scalar=_number(hf, "query_pre_attn_scalar", GEMMA3_DEFAULTS["query_pre_attn_scalar"]),
                attn_logit_softcapping=_number(hf, "attn_logit_softcapping", None),
                final_logit_softcapping=_number(hf, "final_logit_softcapping", None))


def text_model(hf: dict[str, Any]) -> dict[str, Any]:
    """An image-text config.json's text model as its own config.json dict (``TEXT_MODELS``); any other
    config as it is."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not archs or archs[0] not in TEXT_MODELS:
        return hf
    text = _dict(hf, "text_config")
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):  # kept at the top level by some files
        if key not in text and key in hf:
            text[key] = hf[key]
    return {**text, "architectures": [TEXT_MODELS[archs[0]][0]]}


def _architecture(hf: dict) -> str:
    """The decoder's architecture: ``architectures[0]``, else the one of ``model_type``; checked against
    ``model_type`` where the file gives both."""
    archs, model_type = hf.get("architectures"), hf.get("model_type")
    by_type = {t: a for a, f in SUPPORTED_ARCHITECTURES.items() for t in (MODEL_TYPES[f],)}
    if archs is None:
        if model_type not in by_type:
            raise ValueError(f"model_type={json.dumps(model_type)} (and no architectures): unsupported; supported: "
                             f"{sorted(by_type)}")
        return by_type[model_type]
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)):
        raise ValueError(f"architectures={json.dumps(archs)}: expected a list of architecture names")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architectures={archs}: unsupported; supported: {sorted(SUPPORTED_ARCHITECTURES)} (and the "
                         f"text model of {sorted(TEXT_MODELS)})")
    want = MODEL_TYPES[SUPPORTED_ARCHITECTURES[arch]]
    if model_type is not None and model_type != want:
        raise ValueError(f"model_type={json.dumps(model_type)} contradicts architectures={archs} (whose model_type "
                         f"is {want!r})")
    return arch


def _token_ids(hf: dict, key: str, vocab: int):
    """bos_token_id / eos_token_id: null, an id or a list of ids, each a token of the vocabulary."""
    value = hf.get(key)
    ids = value if isinstance(value, list) else [value]
    if value is None or value == []:
        return None
    if not all(type(i) is int and 0 <= i < vocab for i in ids):
        raise ValueError(f"{key}={json.dumps(value)}: not token ids of the vocabulary (vocab_size={vocab})")
    return tuple(value) if isinstance(value, list) else value


def read_hf_dict(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """``ModelConfig``'s fields from a config.json dict (an image-text model's: its text model's).
    ModelFolderError, one line beginning with ``source`` and naming the key, for a value that is
    missing, of the wrong type or out of range, for keys that contradict one another, and for what
    this project does not implement."""
    try:
        return _read(hf)
    except ValueError as err:
        raise ModelFolderError(f"{source}: {err}") from None


def _read(hf: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(hf, dict):
        raise ValueError(f"expected a JSON object, found {type(hf).__name__}")
    hf = text_model(hf)
    arch = _architecture(hf)
    if arch == "Gemma3ForCausalLM":
        hf = {**GEMMA3_TEXT_DEFAULTS, **hf}
    family = SUPPORTED_ARCHITECTURES[arch]
    gemma = family == "gemma3"
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = hf.get(act_key) or hf.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    want = "gelu_pytorch_tanh" if gemma else "silu"
    if act != want:
        raise ValueError(f"{act_key}={act!r}: only {want!r} is supported for {arch}")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true: sliding-window attention is not supported for " + arch)
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if family in ("qwen3", "gemma3") and hf.get("attention_bias"):
        raise ValueError(f"attention_bias=true: not supported for {arch}")
    vocab, hidden = _int(hf, "vocab_size"), _int(hf, "hidden_size")
    num_heads, layers = _int(hf, "num_attention_heads"), _int(hf, "num_hidden_layers")
    kv_heads = _int(hf, "num_key_value_heads", num_heads)
    if num_heads % kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={kv_heads}")
    head_dim = _int(hf, "head_dim", None)
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads={num_heads} (and no "
                             "head_dim says the heads' width)")
        head_dim = hidden // num_heads
    for key in ("tie_word_embeddings", "attention_bias"):
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            raise ValueError(f"{key}={json.dumps(hf[key])}: expected true or false")
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_int(hf, "intermediate_size"),
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_number(hf, "rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        max_position_embeddings=_int(hf, "max_position_embeddings",
                                     GEMMA3_DEFAULTS["max_position_embeddings"] if gemma else 32768),
        architecture=arch,
        bos_token_id=_token_ids(hf, "bos_token_id", vocab),
        eos_token_id=_token_ids(hf, "eos_token_id", vocab),
        **_rope(hf, family),
    )
    if family == "qwen3":
        kwargs["qk_norm"] = True
    if gemma:
        kwargs.update(_gemma3(hf, layers))
    return kwargs


def read_folder(folder: str | Path) -> dict[str, Any]:
    """``ModelConfig``'s fields from a model folder's config.json: FileNotFoundError where there is
    none, ModelFolderError naming the file (and the key) where it is not JSON or ``read_hf_dict``
    refuses it."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the checkpoint folder")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelFolderError(f"{path}: not a readable JSON file ({err})") from None
    return read_hf_dict(hf, str(path))


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
