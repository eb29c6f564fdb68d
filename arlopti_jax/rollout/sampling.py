"""Sampling configuration, shape buckets and the per-step token sampler.

The log-prob recorded for a sampled token is always taken from the FULL
temperature-scaled distribution, ``log_softmax(logits / temperature)``, before any
top-k / top-p truncation: that is ``pi_old`` in PAPER.md when sampler and trainer share
weights, and it is what ``arlopti_jax.models.token_logprobs(..., temperature=T)``
recomputes. Greedy decoding records the same quantity at the configured temperature
(the default 1.0 gives the model's plain log-probs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How responses are drawn.

    max_response_len  response tokens per sample (R), the EOS token included.
    temperature       logits are divided by it before sampling (and for the log-probs).
    top_p             nucleus sampling: keep the smallest set of most likely tokens whose
                      probability reaches top_p (1.0 = off).
    top_k             keep the k most likely tokens (0 = off). Applied before top_p.
    greedy            argmax decoding (top_p / top_k are then irrelevant); the recorded
                      log-probs are still log_softmax(logits / temperature).
    eos_ids           a sample finishes at the first of these tokens (kept, mask 1);
                      () never stops early (fixed-length generation, for benchmarks).
    pad_id            written after a sample finishes (mask 0) and used for prompt padding.
    prompt_bucket     prompt length is padded to min(next power of two, next multiple
                      of prompt_bucket): one compiled shape per bucket, not per batch.
    batch_bucket      the number of prompts is padded likewise (then to a multiple of
                      the mesh's data x fsdp size); padding rows are dropped from the output.
    """

    max_response_len: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_bucket: int = 64
    batch_bucket: int = 8

    def __post_init__(self):
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        checks = {
            "max_response_len": self.max_response_len >= 1,
            "temperature": self.temperature > 0,
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "pad_id": self.pad_id >= 0,
            "prompt_bucket": self.prompt_bucket >= 1,
            "batch_bucket": self.batch_bucket >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SamplingConfig.{name}={getattr(self, name)!r} is out of range")
        if any(e < 0 for e in self.eos_ids):
            raise ValueError(f"SamplingConfig.eos_ids={self.eos_ids!r}: token ids must be >= 0")

    @property
    def kernel_key(self) -> tuple:
        """The settings that change the compiled program (the rest are traced values)."""
        return (self.top_k, self.top_p < 1.0, self.greedy, self.pad_id)


def bucket(n: int, step: int) -> int:
    """min(next power of two >= n, next multiple of step >= n): few shapes at every scale."""
    pow2 = 1 << max(0, (n - 1).bit_length())
    return min(pow2, -(-n // step) * step)


def sample_tokens(logits: Array, key: Array, temperature: Array, top_p: Array, *,
                  top_k: int, use_top_p: bool, greedy: bool) -> tuple[Array, Array]:
    """Draw one token per row from float32 ``logits`` [N, V].

    Returns (tokens [N] int32, log_softmax(logits / temperature)[token] [N] float32).
    ``temperature`` and ``top_p`` are traced scalars; the rest choose the program.
    """
    scaled = logits.astype(jnp.float32) / temperature
    if greedy:
        tokens = jnp.argmax(logits, axis=-1)
    elif top_k or use_top_p:
        k = top_k if top_k else scaled.shape[-1]
        vals, idx = jax.lax.top_k(scaled, k)  # sorted, most likely first
        if use_top_p:
            probs = jax.nn.softmax(vals, axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            vals = jnp.where(mass_before < top_p, vals, -jnp.inf)  # the first is always kept
        choice = jax.random.categorical(key, vals, axis=-1)
        tokens = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]
    else:
        tokens = jax.random.categorical(key, scaled, axis=-1)
    tokens = tokens.astype(jnp.int32)
    lse = jax.nn.logsumexp(scaled, axis=-1)
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
    return tokens, picked - lse
