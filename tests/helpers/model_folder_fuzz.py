"""Damaged Hugging Face model folders (``fixed_cases``, ``random_cases``): what a user's download, copy
or edit can leave of a good folder, each with the file and key its one ``error:`` line must name.

Fixed cases: config.json missing, cut, not an object; each required size missing; values of the wrong
type, zero or negative; fields that contradict one another (heads that do not divide the width, key /
value heads that do not divide the heads, a vocabulary smaller or larger than the embedding's rows, a
model_type that is not the architecture's, an EOS id outside the vocabulary, more layers than the
weights hold); safetensors files cut in the header, in the data, or emptied; the tokenizer's files
gone or cut. Random cases: a config.json key set to a value drawn from a pool of bad ones, a weights
file cut at a random byte. Deterministic in ``seed``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
from pathlib import Path
from typing import Callable

from arlopti_jax.models.tokenizer import VOCABULARY_FILES

SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
BAD_SIZES = (0, -1, -64, 2.5, "64", None, True, [64], {"n": 64})  # None: the key present as null
TOKENIZER_FILES = sorted({name for group in VOCABULARY_FILES for name in group} | {"tokenizer_config.json",
                                                                                     "special_tokens_map.json"})


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    damage: Callable[[Path], None]  # applied to a copy of a good folder
    names: tuple[str, ...]  # what the error line must contain, besides the folder ("{folder}" filled in)


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _set(**values) -> Callable[[Path], None]:
    """config.json with ``values`` replacing its own (a value of ``DELETE``: the key removed)."""
    def damage(folder: Path) -> None:
        cfg = _config(folder)
        for key, value in values.items():
            if value is DELETE:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        (folder / "config.json").write_text(json.dumps(cfg))
    return damage


DELETE = object()


def _weights(folder: Path) -> Path:
    [path] = sorted(folder.glob("*.safetensors"))
    return path


def _cut(at: Callable[[int, int], int]) -> Callable[[Path], None]:
    """The weights file cut to ``at(header_end, size)`` bytes."""
    def damage(folder: Path) -> None:
        path = _weights(folder)
        data = path.read_bytes()
        header_end = 8 + struct.unpack("<Q", data[:8])[0]
        path.write_bytes(data[:at(header_end, len(data))])
    return damage


def _remove(*names: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        for name in names:
            (folder / name).unlink(missing_ok=True)
    return damage


def _rewrite(name: str, text: Callable[[str], str]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name).write_text(text((folder / name).read_text()))
    return damage


def fixed_cases(folder: Path) -> list[Case]:
    """The damages the issue lists, for a copy of the good folder ``folder`` (its own values set the
    contradictions: its width, heads and vocabulary)."""
    cfg = _config(folder)
    heads, vocab = cfg["num_attention_heads"], cfg["vocab_size"]
    c = "config.json"
    cases = [
        Case("config_missing", _remove(c), (c,)),
        Case("config_cut", _rewrite(c, lambda t: t[: len(t) // 2]), (c, "not a readable JSON file")),
        Case("config_a_list", _rewrite(c, lambda t: "[" + t + "]"), (c, "expected a JSON object")),
        Case("config_empty", _rewrite(c, lambda t: ""), (c, "not a readable JSON file")),
        *(Case(f"no_{key}", _set(**{key: DELETE}), (c, f"{key} is missing")) for key in SIZES),
        Case("hidden_size_text", _set(hidden_size=str(cfg["hidden_size"])), (c, "hidden_size=")),
        Case("layers_fraction", _set(num_hidden_layers=1.5), (c, "num_hidden_layers=1.5")),
        Case("heads_true", _set(num_attention_heads=True), (c, "num_attention_heads=true")),
        Case("tied_text", _set(tie_word_embeddings="yes"), (c, "tie_word_embeddings=\"yes\"")),
        Case("rope_theta_text", _set(rope_theta="big"), (c, "rope_theta=\"big\"")),
        Case("architectures_a_string", _set(architectures="Qwen2ForCausalLM"), (c, "architectures=")),
        Case("hidden_negative", _set(hidden_size=-cfg["hidden_size"]), (c, "hidden_size=-")),
        Case("intermediate_zero", _set(intermediate_size=0), (c, "intermediate_size=0")),
        Case("kv_heads_negative", _set(num_key_value_heads=-2), (c, "num_key_value_heads=-2")),
        Case("vocab_zero", _set(vocab_size=0), (c, "vocab_size=0")),
        Case("positions_negative", _set(max_position_embeddings=-1), (c, "max_position_embeddings=-1")),
        Case("eps_negative", _set(rms_norm_eps=-1e-6), (c, "rms_norm_eps=")),
        Case("width_not_divisible", _set(num_attention_heads=heads + 1, num_key_value_heads=1, head_dim=DELETE),
             (c, f"hidden_size={cfg['hidden_size']} is not a multiple of num_attention_heads={heads + 1}")),
        Case("kv_heads_not_dividing", _set(num_key_value_heads=heads - 1),
             (c, f"num_attention_heads={heads} is not a multiple of num_key_value_heads={heads - 1}")),
        Case("vocab_below_embedding", _set(vocab_size=vocab - 64), ("model.embed_tokens.weight", c)),
        Case("vocab_above_embedding", _set(vocab_size=vocab + 64), ("model.embed_tokens.weight", c)),
        Case("model_type_unknown", _set(model_type="qwen9"), (c, "model_type=\"qwen9\" contradicts")),
        Case("model_type_alone_unknown", _set(architectures=DELETE, model_type="qwen9"),
             (c, "model_type=\"qwen9\" (and no architectures): unsupported")),
        Case("architecture_unknown", _set(architectures=["MistralForCausalLM"]), (c, "MistralForCausalLM")),
        Case("eos_outside_vocab", _set(eos_token_id=vocab), (c, f"eos_token_id={vocab}")),
        Case("more_layers_than_weights", _set(num_hidden_layers=cfg["num_hidden_layers"] + 1),
             ("missing tensors", f"model.layers.{cfg['num_hidden_layers']}.")),
        Case("weights_cut_in_header", _cut(lambda header_end, size: header_end // 2),
             ("model.safetensors", "cut short or damaged")),
        Case("weights_cut_in_data", _cut(lambda header_end, size: (header_end + size) // 2),
             ("model.safetensors", "cut short or damaged")),
        Case("weights_cut_at_the_length", _cut(lambda header_end, size: 8), ("model.safetensors", "cut short")),
        Case("weights_empty", _cut(lambda header_end, size: 0), ("model.safetensors", "cut short")),
        Case("weights_missing", _remove("model.safetensors"), ("no *.safetensors",)),
        Case("tokenizer_missing", _remove(*TOKENIZER_FILES), ("no tokenizer", "tokenizer.json", "vocab.json")),
        Case("tokenizer_cut", _rewrite("tokenizer.json", lambda t: t[: len(t) // 2]),
             ("the tokenizer cannot be read",)),
        Case("tokenizer_config_cut", _rewrite("tokenizer_config.json", lambda t: t[: len(t) // 3]),
             ("the tokenizer cannot be read",)),
    ]
    return cases


def random_cases(folder: Path, seed: int, count: int) -> list[Case]:
    """``count`` damages drawn with ``seed``: a size key of config.json set to a value of ``BAD_SIZES``,
    or the weights file cut at a random byte."""
    rng = random.Random(seed)
    size = _weights(folder).stat().st_size
    out = []
    for i in range(count):
        if rng.random() < 0.7:
            key = rng.choice(SIZES + ("num_key_value_heads", "max_position_embeddings"))
            value = rng.choice([v for v in BAD_SIZES if v is not None or key in SIZES])  # null: a default, if any
            out.append(Case(f"random{seed}_{i}_{key}", _set(**{key: value}), ("config.json", key)))
        else:
            at = rng.randrange(size)
            out.append(Case(f"random{seed}_{i}_cut_at_{at}", _cut(lambda header_end, total, at=at: at),
                            ("model.safetensors", "cut short")))
    return out
