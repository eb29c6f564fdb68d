"""Model configuration, read from and written to a Hugging Face ``config.json`` (``hf_config.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from arlopti_jax.models.hf_config import LAYER_TYPES, SUPPORTED_ARCHITECTURES, read_folder, read_hf_dict, write_hf_dict
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


ATTENTION_IMPLS = ("auto", "xla", "cudnn")  # training / prefill attention (decode reads the KV cache itself)
DECODE_ATTENTION_IMPLS = ("auto", "xla", "pallas")  # the sampler's decode steps on a GPU
DECODE_MATMUL_IMPLS = ("xla", "pallas")  # the decode steps' weight products on a GPU (models/decode_matmul.py)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections LoRA can adapt


def cudnn_attention_takes(head_dim: int) -> bool:
    """Whether JAX's cuDNN fused attention takes heads of ``head_dim`` (at most 128, a multiple of 8:
    Gemma 3's 256 it refuses)."""
    return head_dim <= 128 and head_dim % 8 == 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Qwen2, Llama, Qwen3 (dense) or Gemma 3 (text) decoder.

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
    # Qwen3 and Gemma 3: an RMS norm over each query and key head, before RoPE
    qk_norm: bool = False
    # per layer, "full_attention" or "sliding_attention" (None: all full); a sliding layer's query sees the
    # sliding_window latest slots, its own included, as transformers' sliding-window mask
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None  # the sliding layers' RoPE theta (Gemma 3's rope_local_base_freq)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power (None: head_dim's)
    attn_logit_softcapping: float | None = None  # attention scores s -> cap tanh(s / cap) (None: off)
    final_logit_softcapping: float | None = None  # logits z -> cap tanh(z / cap), before any temperature

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
        self._check_architecture()

    def _check_architecture(self):
        """What the architecture's own fields allow, and which settings cannot serve it."""
        types = self.layer_types
        if types is not None and (len(types) != self.num_layers or not set(types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types={list(types)}: one of {list(LAYER_TYPES)} for each of the "
                             f"{self.num_layers} layers")
        if any(self.sliding_layers) and not (self.sliding_window or 0) >= 1:
            raise ValueError(f"sliding_window={self.sliding_window}: sliding-attention layers need a window >= 1")
        if self.qk_norm and self.qkv_bias:
            raise ValueError("qk_norm with qkv_bias (attention_bias=true): not supported")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value}: must be > 0 (or null: off)")
        arch = f"{self.architecture} with attn_logit_softcapping={self.attn_logit_softcapping}"
        if self.attention == "cudnn" and not cudnn_attention_takes(self.head_dim):
            raise ValueError(f"model.attention='cudnn': cuDNN's fused attention takes heads of at most 128 (a "
                             f"multiple of 8), and {self.architecture}'s are {self.head_dim}; use 'auto' or 'xla'")
        if self.attn_logit_softcapping and self.attention == "cudnn":
            raise ValueError(f"model.attention='cudnn': cuDNN's fused attention does not cap attention scores "
                             f"({arch}); use 'auto' or 'xla'")
        if self.attn_logit_softcapping and self.decode_attention == "pallas":
            raise ValueError(f"model.decode_attention='pallas': the Pallas decode kernel does not cap attention "
                             f"scores ({arch}); use 'auto' or 'xla'")
        if self.family == "gemma3" and self.decode_matmul == "pallas":
            raise ValueError("model.decode_matmul='pallas': the fused decode products take a pre-norm SwiGLU layer, "
                             "and Gemma 3 normalises each sublayer's output and gates with GELU; use 'xla'")

    def fallbacks(self, platform: str) -> list[str]:
        """What an 'auto' setting runs instead of its usual kernel for this architecture on ``platform``:
        one start-up line each (``rl/run_setup.resolve_paths`` logs them)."""
        if platform != "gpu":
            return []
        lines = []
        if self.attn_logit_softcapping and self.decode_attention == "auto":
            lines.append(f"model.decode_attention=auto: XLA's decode attention, not the Pallas kernel, which does "
                         f"not cap attention scores ({self.architecture}: attn_logit_softcapping="
                         f"{self.attn_logit_softcapping})")
        if self.attention == "auto" and self.dtype in ("bfloat16", "float16"):
            if self.attn_logit_softcapping:
                lines.append("model.attention=auto: the causal-block attention, not cuDNN's fused kernel, which does "
                             "not cap attention scores")
            elif not cudnn_attention_takes(self.head_dim):
                lines.append(f"model.attention=auto: XLA's attention, not cuDNN's fused kernel, which takes heads of "
                             f"at most 128 ({self.architecture}: head_dim {self.head_dim})")
        return lines

    @property
    def family(self) -> str:
        """"qwen2", "llama", "qwen3" or "gemma3" (``SUPPORTED_ARCHITECTURES``)."""
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it attends through the sliding window (all False without sliding layers)."""
        return tuple(t == "sliding_attention" for t in self.layer_types or ()) or (False,) * self.num_layers

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by: 1 / sqrt(query_pre_attn_scalar or head_dim)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        attn += 2 * h if self.qk_norm else 0
        norms = 4 if self.family == "gemma3" else 2  # Gemma 3 also normalises each sublayer's output
        layer = attn + 3 * d * f + norms * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + d

    def attention_cost_per_key(self) -> float:
        """FLOPs of one attended key per token (scores and values, 4 * heads * head_dim) over
        the token's matmul FLOPs in a layer (2 per weight): what packing weighs row length by."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        weights = d * h * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * d * f
        return 4 * self.num_heads * h / (2 * weights)

    # ---- Hugging Face config.json (hf_config.py) ----
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
        return cls(**{**read_hf_dict(hf), **overrides})

    @classmethod
    def from_pretrained(cls, folder: str | Path, **overrides) -> "ModelConfig":
        return cls(**{**read_folder(folder), **overrides})

    def to_hf_dict(self) -> dict[str, Any]:
        return write_hf_dict(self)
