"""Model configuration, read from and written to a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


ATTENTION_IMPLS = ("auto", "xla", "cudnn")  # training / prefill attention (decode reads the KV cache itself)
DECODE_ATTENTION_IMPLS = ("auto", "xla", "pallas")  # the sampler's decode steps on a GPU
DECODE_MATMUL_IMPLS = ("xla", "pallas")  # the decode steps' weight products on a GPU (models/decode_matmul.py)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections LoRA can adapt


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Qwen2/Llama decoder.

    ``dtype`` is the activation/compute dtype and ``param_dtype`` the storage dtype of the
    weights. Log-probs, softmax and losses are always computed in float32. ``remat``
    recomputes each layer in the backward pass; ``unroll_layers`` compiles the layer stack as
    straight-line code instead of a loop (parameters keep their stacked layout): on CPU the
    loop's stacked activations cost a fifth of a small model's step, while on accelerators
    with deep models the loop compiles much faster.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = True
    # Llama 3 style rope scaling as a sorted tuple of (key, value) pairs, or None.
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 32768
    architecture: str = "Qwen2ForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | tuple | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    unroll_layers: bool = False  # straight-line layers instead of a loop: faster steps, longer compiles
    attention: str = "auto"  # one of ATTENTION_IMPLS: "auto" = cuDNN's fused kernel on GPUs at 16-bit, else XLA
    # one of DECODE_ATTENTION_IMPLS: "pallas" = models/decode_attention.py's kernel in the sampler's decode steps
    # on a GPU (interpret mode elsewhere: tests), "xla" = XLA's ops, "auto" = the kernel on a GPU
    decode_attention: str = "auto"
    # one of DECODE_MATMUL_IMPLS: "pallas" = models/decode_matmul.py's products, with the norms, residual adds
    # and silu x up fused in, in decode steps that run the Pallas attention; "xla" = XLA's (the default: on an
    # H200 the fused products made the 1.5B rollout 0.71x as fast, docs/measurements/gpu_2026-11-28)
    decode_matmul: str = "xla"
    # LoRA: each target projection W gets W + (lora_alpha / lora_rank) B A, A of rank lora_rank (0 = off)
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: allowed {sorted(_DTYPES)}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention={self.attention!r}: allowed {list(ATTENTION_IMPLS)}")
        if self.decode_attention not in DECODE_ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.decode_attention={self.decode_attention!r}: allowed "
                             f"{list(DECODE_ATTENTION_IMPLS)}")
        if self.decode_matmul not in DECODE_MATMUL_IMPLS:
            raise ValueError(f"ModelConfig.decode_matmul={self.decode_matmul!r}: allowed {list(DECODE_MATMUL_IMPLS)}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.architecture={self.architecture!r} is not supported: "
                f"allowed {sorted(SUPPORTED_ARCHITECTURES)}")
        if self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank={self.lora_rank}: must be >= 0 (0 = no LoRA)")
        if self.lora_rank and not self.lora_alpha > 0:
            raise ValueError(f"ModelConfig.lora_alpha={self.lora_alpha}: must be > 0")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or (self.lora_rank and not self.lora_targets):
            raise ValueError(f"ModelConfig.lora_targets={self.lora_targets!r}: one or more of {list(LORA_TARGETS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def adapts(self, target: str) -> bool:
        """Whether projection ``target`` (one of LORA_TARGETS) carries a LoRA adapter."""
        return bool(self.lora_rank) and target in self.lora_targets

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return _DTYPES[self.param_dtype]

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += h * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * d * f + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + d

    def attention_cost_per_key(self) -> float:
        """FLOPs of one attended key per token (scores and values, 4 * heads * head_dim) over
        the token's matmul FLOPs in a layer (2 per weight): what packing weighs row length by."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        weights = d * h * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * d * f
        return 4 * self.num_heads * h / (2 * weights)

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
        archs = hf.get("architectures") or [hf.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json architectures={archs}: unsupported; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act={act!r}: only 'silu' is supported")
        if hf.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true: sliding-window attention is not supported")
        # transformers >= 5 writes "rope_parameters" (theta inside); older folders "rope_theta" + "rope_scaling".
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("llama3", "default"):
            raise ValueError(f"config.json rope_scaling type {kind!r}: only 'default' and 'llama3' are supported")
        rope_scaling = None
        if kind == "llama3":
            keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            rope_scaling = tuple((k, rope[k]) for k in keys)
        num_heads = hf["num_attention_heads"]
        is_qwen = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
        eos = hf.get("eos_token_id")
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen else bool(hf.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )
        if hf.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported")
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, folder: str | Path, **overrides) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the checkpoint folder")
        return cls.from_hf_dict(json.loads(path.read_text()), **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        qwen = SUPPORTED_ARCHITECTURES[self.architecture] == "qwen2"
        out = {
            "architectures": [self.architecture],
            "model_type": "qwen2" if qwen else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
        }
        if not qwen:
            out["attention_bias"] = self.qkv_bias
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dict(self.rope_scaling)}
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            out["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        return out
