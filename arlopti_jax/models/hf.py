"""Hugging Face checkpoint folders <-> sharded Flax parameters.

Import reads safetensors with the numpy API (no torch at run time) and builds every
parameter with ``jax.make_array_from_callback``: each device receives only its own
shard, read from one layer's tensor at a time, so no full copy of the model is ever
materialised on one device (or in float32 on the host).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import hub
from arlopti_jax.models import variants
from arlopti_jax.models.config import ModelConfig
from arlopti_jax.models.hf_config import TEXT_MODELS, ModelFolderError
from arlopti_jax.models.policy import abstract_params, param_shardings

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "generation_config.json", "chat_template.jinja", "tokenizer.model",
)


class CheckpointError(ModelFolderError):
    """A checkpoint folder whose tensors do not match its config, or whose weight files are cut short
    or damaged: the message names the file and the tensor."""


def _name_map(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[str, callable, callable]]:
    """Our parameter path -> (HF name, HF->ours transform, ours->HF transform).

    Names under ``layers`` contain ``{i}`` for the layer index; their arrays gain a
    leading layers axis on our side.
    """
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = (lambda w: w, lambda p: p)
    transpose = (lambda w: w.T, lambda p: p.T)

    def in_proj(heads):
        return (lambda w: w.T.reshape(d, heads, h), lambda p: p.reshape(d, heads * h).T)

    def bias(heads):
        return (lambda b: b.reshape(heads, h), lambda p: p.reshape(heads * h))

    pre = "model.layers.{i}."
    # Gemma's post_attention_layernorm normalises the attention's output; its pre_feedforward_layernorm
    # is the norm before the MLP, our post_attn_norm in every family
    sandwich = variants.sandwich_norms(cfg)
    table = {
        ("embedding",): ("model.embed_tokens.weight", *ident),
        ("final_norm", "scale"): ("model.norm.weight", *ident),
        ("layers", "input_norm", "scale"): (pre + "input_layernorm.weight", *ident),
        ("layers", "post_attn_norm", "scale"): (pre + ("pre_feedforward_layernorm.weight" if sandwich else
                                                       "post_attention_layernorm.weight"), *ident),
        ("layers", "attn", "q_kernel"): (pre + "self_attn.q_proj.weight", *in_proj(n)),
        ("layers", "attn", "k_kernel"): (pre + "self_attn.k_proj.weight", *in_proj(k)),
        ("layers", "attn", "v_kernel"): (pre + "self_attn.v_proj.weight", *in_proj(k)),
        ("layers", "attn", "o_kernel"): (pre + "self_attn.o_proj.weight",
                                         lambda w: w.T.reshape(n, h, d), lambda p: p.reshape(n * h, d).T),
        ("layers", "mlp", "gate_kernel"): (pre + "mlp.gate_proj.weight", *transpose),
        ("layers", "mlp", "up_kernel"): (pre + "mlp.up_proj.weight", *transpose),
        ("layers", "mlp", "down_kernel"): (pre + "mlp.down_proj.weight", *transpose),
    }
    if cfg.qkv_bias:
        table[("layers", "attn", "q_bias")] = (pre + "self_attn.q_proj.bias", *bias(n))
        table[("layers", "attn", "k_bias")] = (pre + "self_attn.k_proj.bias", *bias(k))
        table[("layers", "attn", "v_bias")] = (pre + "self_attn.v_proj.bias", *bias(k))
    if sandwich:
        table[("layers", "attn_out_norm", "scale")] = (pre + "post_attention_layernorm.weight", *ident)
        table[("layers", "mlp_out_norm", "scale")] = (pre + "post_feedforward_layernorm.weight", *ident)
    if cfg.qk_norm:
        table[("layers", "attn", "q_norm", "scale")] = (pre + "self_attn.q_norm.weight", *ident)
        table[("layers", "attn", "k_norm", "scale")] = (pre + "self_attn.k_norm.weight", *ident)
    if not cfg.tie_word_embeddings:
        table[("lm_head",)] = ("lm_head.weight", *transpose)
    return table


def _hf_names(cfg: ModelConfig, name: str) -> list[str]:
    return [name.format(i=i) for i in range(cfg.num_layers)] if "{i}" in name else [name]


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from a safetensors file's header alone (no tensor is read). safetensors
    checks there that the header is whole and that the data it describes fills the file: a file cut
    anywhere is refused here."""
    try:
        with safe_open(path, framework="numpy") as st:
            return {name: tuple(st.get_slice(name).get_shape()) for name in st.keys()}
    except SafetensorError as err:
        raise CheckpointError(f"{path}: not a whole safetensors file, cut short or damaged ({err})") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None


def _tensor_index(folder: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """HF tensor name -> (the safetensors file that holds it, its name there, its shape), from the
    files' headers. An image-text model's folder (``hf_config.TEXT_MODELS``) gives its text model's
    tensors alone, their names without the text model's prefix."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a weight_map of tensor "
                                  f"names to files: {type(err).__name__} {err})") from None
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shard files that do not exist: {missing}")
        headers = {f: _header(folder / f) for f in files}
        absent = sorted(name for name, f in weight_map.items() if name not in headers[f])
        if absent:
            raise CheckpointError(f"{index}: names tensors its shard files do not hold: {absent[:8]}"
                                  f"{' ...' if len(absent) > 8 else ''}")
        stored = {name: (folder / f, headers[f][name]) for name, f in weight_map.items()}
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors files (and no model.safetensors.index.json)")
        stored = {name: (f, shape) for f in files for name, shape in _header(f).items()}
    prefix = ""
    if (folder / "config.json").is_file():
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or [""]
        prefix = TEXT_MODELS.get(archs[0], ("", ""))[1]
    return {name[len(prefix):]: (f, name, shape) for name, (f, shape) in stored.items() if name.startswith(prefix)}


def check_weights(folder: str | Path, cfg: ModelConfig) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """The folder's tensor index (``_tensor_index``) once every tensor ``cfg`` needs is there, with the
    shape ``cfg`` gives it, and nothing else is: from the files' headers, reading no tensor (a
    command's start-up calls it). CheckpointError naming the folder, file or tensor otherwise."""
    folder = Path(folder)
    where = _tensor_index(folder)
    table = _name_map(cfg)
    wanted = {hf for name, *_ in table.values() for hf in _hf_names(cfg, name)}
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(wanted - set(where))
    extra = sorted(n for n in set(where) - wanted - ignorable if not n.endswith("rotary_emb.inv_freq"))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if extra:
            parts.append(f"unexpected tensors {extra[:8]}{' ...' if len(extra) > 8 else ''}")
        raise CheckpointError(f"{folder}: " + "; ".join(parts) + f" (config: {cfg.architecture}, "
                              f"{cfg.num_layers} layers, tie_word_embeddings={cfg.tie_word_embeddings})")
    expected = abstract_params(cfg)
    for path, (name, _, from_ours) in table.items():
        leaf = functools.reduce(lambda t, key: t[key], path, expected)
        per_layer = leaf.shape[1:] if "{i}" in name else leaf.shape
        want = tuple(jax.eval_shape(from_ours, jax.ShapeDtypeStruct(per_layer, np.float32)).shape)
        for hf in _hf_names(cfg, name):
            f, _, got = where[hf]
            if got != want:
                raise CheckpointError(f"{f}: tensor {hf} has shape {list(got)}, expected {list(want)} from "
                                      f"{folder / 'config.json'}")
    return where


def load_params(folder: str | Path, cfg: ModelConfig, mesh, rules=shd.DEFAULT_RULES):
    """Read a checkpoint folder's tensors into sharded arrays of ``cfg.param_dtype``."""
    folder = Path(folder)
    where = check_weights(folder, cfg)
    table = _name_map(cfg)
    expected = abstract_params(cfg)
    shardings = param_shardings(cfg, mesh, rules)
    dtype = cfg.weight_dtype

    @functools.lru_cache(maxsize=4)
    def read(hf_name: str) -> np.ndarray:
        path, stored, _ = where[hf_name]
        with safe_open(path, framework="numpy") as st:
            return st.get_tensor(stored)

    def build(path, name, to_ours, from_ours):
        leaf = functools.reduce(lambda t, key: t[key], path, expected)
        stacked = "{i}" in name

        def one(hf, idx):
            return np.asarray(to_ours(read(hf))[idx]).astype(dtype)

        def callback(index):
            if not stacked:
                return one(name, index)
            layers = range(cfg.num_layers)[index[0]]
            return np.stack([one(name.format(i=i), index[1:]) for i in layers])

        sharding = functools.reduce(lambda t, key: t[key], path, shardings)
        return jax.make_array_from_callback(leaf.shape, sharding, callback)

    params: dict = {}
    for path, (name, to_ours, from_ours) in table.items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = build(path, name, to_ours, from_ours)
    return params


def load_pretrained(folder: str | Path, mesh=None, rules=shd.DEFAULT_RULES, **config_overrides):
    """Load ``(ModelConfig, params)`` from a Hugging Face folder onto ``mesh`` (default: all devices, fsdp)."""
    cfg = ModelConfig.from_pretrained(folder, **config_overrides)
    mesh = mesh if mesh is not None else shd.make_mesh({"fsdp": -1})
    return cfg, load_params(folder, cfg, mesh, rules)


def _to_host(x) -> np.ndarray:
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


PEFT_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def save_adapter(cfg: ModelConfig, params, out_dir: str | Path, base_model: str) -> Path:
    """Write the LoRA adapters of ``params`` as a PEFT adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``), the layout PEFT's ``PeftModel.from_pretrained`` and vLLM's
    ``LoRARequest`` read, for the Hugging Face model ``base_model`` (a folder or Hub id; a pinned
    ``ORG/NAME@REVISION`` is written as PEFT's ``base_model_name_or_path`` and ``revision``).

    PEFT's A is [r, in_features] and B [out_features, r] per layer, with the weight's input and
    output features flattened as the Hugging Face weight orders them (``_name_map``); ours are
    A [layers, contracted..., r] and B [layers, r, kept...]. Only process 0 writes; every process
    must call it."""
    if not cfg.lora_rank:
        raise ValueError("save_adapter: the model has no LoRA adapters (model.lora_rank is 0)")
    layers = params["layers"]
    tensors = {}
    for target in cfg.lora_targets:
        group = "mlp" if target in ("gate", "up", "down") else "attn"
        a, b = _to_host(layers[group][f"{target}_lora_a"]), _to_host(layers[group][f"{target}_lora_b"])
        for i in range(cfg.num_layers):
            name = f"base_model.model.model.layers.{i}.{PEFT_MODULES[target]}"
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, cfg.lora_rank).T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(cfg.lora_rank, -1).T)
    out = Path(out_dir)
    if jax.process_index() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    base, revision = str(base_model), None
    if not Path(base).is_dir() and hub.HUB_ID.fullmatch(base) and "@" in base:  # ORG/NAME@REV: PEFT's two fields
        base, revision = base.split("@", 1)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": revision,
              "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(PEFT_MODULES[t].split(".")[-1] for t in cfg.lora_targets),
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
              "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
              "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    log.info("wrote PEFT adapter to %s (%d tensors, rank %d)", out, len(tensors), cfg.lora_rank)
    return out


def save_pretrained(cfg: ModelConfig, params, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                    max_shard_bytes: int = 4 << 30) -> Path:
    """Write params as a Hugging Face folder (config.json, safetensors, tokenizer files).

    Only process 0 writes; every process must call it (gathering shards is collective).
    """
    out = Path(out_dir)
    tensors: dict[str, np.ndarray] = {}
    for path, (name, _, from_ours) in _name_map(cfg).items():
        arr = _to_host(functools.reduce(lambda t, key: t[key], path, params))
        if "{i}" in name:
            for i in range(cfg.num_layers):
                tensors[name.format(i=i)] = np.ascontiguousarray(from_ours(arr[i]))
        else:
            tensors[name] = np.ascontiguousarray(from_ours(arr))
    if jax.process_index() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for j, shard in enumerate(shards):
            fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata=meta)
            weight_map.update({n: fname for n in shard})
        total = sum(t.nbytes for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        for fname in TOKENIZER_FILES:
            if (src / fname).is_file() and src.resolve() != out.resolve():
                shutil.copy2(src / fname, out / fname)
    log.info("wrote Hugging Face checkpoint to %s (%d tensors, %d files)", out, len(tensors), len(shards))
    return out
