"""Policy loss: PPO clipped surrogate with dual clip, KL to a frozen reference, entropy bonus.

Per response token t (all [B, T], aligned with ``input_ids``):

    ratio_t   = exp(logp_t - old_logp_t)
    pg_t      = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    pg_t      = min(pg_t, -A_t * c)                 only where A_t < 0 (dual clip)
    loss_t    = pg_t + kl_coef * kl_t * m_t - entropy_coef * H_t * m_t

where m_t is the pass's ``loss_mask`` (Lopti masks KL and entropy to its tokens; without
Lopti it equals the response mask) and kl_t one of the estimators in ``KL_ESTIMATORS``:
    k1 (alias kl)          logp - ref_logp
    k2 (alias mse)         0.5 * (logp - ref_logp)^2
    k3 (alias low_var_kl)  d = clamp(ref_logp - logp, -5, 5);  clamp(exp(d) - d - 1, -10, 10)

Aggregation over the valid response tokens (``response_mask``; Lopti leaves it unchanged, so
excluded tokens still count in it) of a WHOLE mini-batch:
    token-mean           sum_{b,t} loss_bt / N_tokens
    seq-mean-token-mean  sum_b (sum_t loss_bt / n_b) / N_seqs
    seq-mean-token-sum   sum_b (sum_t loss_bt) / N_seqs
N_tokens / N_seqs count the valid tokens / the rows with at least one valid token (rows
without response tokens are batch padding and never counted). Each is a weighted sum
sum_{b,t} w_bt * loss_bt with per-token weights ``aggregation_weights`` (1/N_tokens,
1/(n_b N_seqs), 1/N_seqs) computed once per mini-batch; the loss takes them per token, so
a micro-batch's contribution is its weighted sum, whatever rows or packed sequences it
holds, and the accumulated loss and gradient are exactly those of the whole mini-batch.
The reference (verl's dp_actor) instead averages per-micro-batch token means, which
weights tokens unequally when micro-batches hold different numbers of tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _k1(logp, ref):
    return logp - ref


def _k2(logp, ref):
    return 0.5 * jnp.square(logp - ref)


def _k3(logp, ref):
    d = jnp.clip(ref - logp, -5.0, 5.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Array, Array], Array]] = {
    "k1": _k1, "kl": _k1, "k2": _k2, "mse": _k2, "k3": _k3, "low_var_kl": _k3,
}


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """clip_low/clip_high: eps_low/eps_high of the ratio clip; dual_clip: c (> 1), applied
    where A < 0; kl_coef: weight of the KL to the reference (0 disables it and the need for
    ``ref_logprobs``); kl_type: a key of ``KL_ESTIMATORS``; entropy_coef: loss -= coef * H;
    agg: one of ``AGG_MODES``; temperature: logits are divided by it, as in the sampler, so
    log-probs are those of the sampled distribution."""

    clip_low: float = 0.2
    clip_high: float = 0.24
    dual_clip: float = 10.0
    kl_coef: float = 0.001
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    temperature: float = 1.0

    def __post_init__(self):
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"LossConfig.clip_low={self.clip_low}: must be in [0, 1)")
        if self.clip_high < 0:
            raise ValueError(f"LossConfig.clip_high={self.clip_high}: must be >= 0")
        if self.dual_clip <= 1.0:
            raise ValueError(f"LossConfig.dual_clip={self.dual_clip}: must be > 1")
        if self.kl_type not in KL_ESTIMATORS:
            raise ValueError(f"LossConfig.kl_type={self.kl_type!r}: allowed {sorted(KL_ESTIMATORS)}")
        if self.kl_coef < 0:
            raise ValueError(f"LossConfig.kl_coef={self.kl_coef}: must be >= 0")
        if self.agg not in AGG_MODES:
            raise ValueError(f"LossConfig.agg={self.agg!r}: allowed {list(AGG_MODES)}")
        if self.temperature <= 0:
            raise ValueError(f"LossConfig.temperature={self.temperature}: must be > 0")

    @property
    def use_kl(self) -> bool:
        return self.kl_coef != 0.0


def kl_penalty(logp: Array, ref_logp: Array, kind: str) -> Array:
    return KL_ESTIMATORS[kind](logp, ref_logp)


def ppo_clipped_loss(logp: Array, old_logp: Array, advantages: Array, clip_low: float,
                     clip_high: float, dual_clip: float) -> tuple[Array, dict[str, Array]]:
    """Per-token dual-clip PPO loss and, per token, where each clip binds:
    ``clip_low``: A < 0 and ratio < 1 - eps_low (the clipped branch is the max);
    ``clip_high``: A > 0 and ratio > 1 + eps_high (idem); ``dual_clip``: A < 0 and the
    dual bound -A * c is the min. Tokens with A = 0 never count as clipped."""
    ratio = jnp.exp(logp - old_logp)
    pg = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg1 = jnp.maximum(pg, clipped)
    dual = -advantages * dual_clip
    neg = advantages < 0
    loss = jnp.where(neg, jnp.minimum(pg1, dual), pg1)
    clip_active = clipped > pg
    info = {
        "ratio": ratio,
        "clip_low": clip_active & neg,
        "clip_high": clip_active & (advantages > 0),
        "dual_clip": neg & (pg1 > dual),
    }
    return loss, info


def aggregation_weights(response_mask, agg: str) -> np.ndarray:
    """Per-token weights [B, T] (float32) of a whole mini-batch: sum(w * loss) is its ``agg``
    aggregate of the per-token loss (see the module docstring)."""
    mask = np.asarray(response_mask, np.float32)
    if agg == "token-mean":
        return mask / max(float(mask.sum()), 1.0)
    n_seqs = max(float((mask.sum(-1) > 0).sum()), 1.0)
    if agg == "seq-mean-token-mean":
        return mask / np.maximum(mask.sum(-1, keepdims=True), 1.0) / n_seqs
    if agg == "seq-mean-token-sum":
        return mask / n_seqs
    raise ValueError(f"unknown aggregation {agg!r}: allowed {list(AGG_MODES)}")


def policy_loss(cfg: LossConfig, logp: Array, entropy: Array, batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
    """The weighted sum of the per-token loss over these tokens (a micro-batch's share of the
    mini-batch loss), and metric SUMS over its valid response tokens (the train step divides
    them by the mini-batch token count). Any shape, all arrays alike.

    batch: ``advantages``, ``old_logprobs``, ``response_mask`` (valid tokens), ``loss_mask``
    (the pass's tokens: KL and entropy apply there), ``agg_weight`` (``aggregation_weights``
    of the mini-batch), and ``ref_logprobs`` when ``cfg.kl_coef != 0``.
    """
    mask = batch["response_mask"].astype(jnp.float32)
    weight = batch["agg_weight"].astype(jnp.float32) * mask
    kl_weight = batch["loss_mask"].astype(jnp.float32) * weight
    pg, info = ppo_clipped_loss(logp, batch["old_logprobs"], batch["advantages"],
                                cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    pg_loss = (pg * weight).sum()
    entropy_loss = (entropy * kl_weight).sum()
    loss = pg_loss - cfg.entropy_coef * entropy_loss
    stats = {
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "entropy_sum": (entropy * mask).sum(),
        "ppo_kl_sum": ((batch["old_logprobs"] - logp) * mask).sum(),
        "ratio_sum": (info["ratio"] * mask).sum(),
        "ratio_max": jnp.max(jnp.where(mask > 0, info["ratio"], -jnp.inf)),
        "clipfrac_low_sum": (info["clip_low"] * mask).sum(),
        "clipfrac_high_sum": (info["clip_high"] * mask).sum(),
        "dual_clipfrac_sum": (info["dual_clip"] * mask).sum(),
    }
    if cfg.use_kl:
        kl = kl_penalty(logp, batch["ref_logprobs"], cfg.kl_type)
        kl_loss = (kl * kl_weight).sum()
        loss = loss + cfg.kl_coef * kl_loss
        stats.update(kl_loss=kl_loss, kl_sum=(kl * mask).sum())
    stats["loss"] = loss
    return loss, stats
