"""Policy loss: PPO clipped surrogate with dual clip (token- or sequence-level ratio) or CISPO,
KL to a frozen reference, entropy bonus.

Per response token t (all [B, T], aligned with ``input_ids``), ``mode='ppo'``:

    ratio_t   = exp(logp_t - old_logp_t)
    pg_t      = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    pg_t      = min(pg_t, -A_t * c)                 only where A_t < 0 (dual clip)
    loss_t    = pg_t + kl_coef * kl_t * m_t - entropy_coef * H_t * m_t

``ratio_level='sequence'`` (GSPO, Zheng et al. 2025, arXiv 2507.18071) replaces ratio_t by the
sequence's ratio s_i = exp(mean over the response tokens u of sequence i of (logp_u - old_logp_u))
in the value, in GSPO-token's form s_{i,t} = sg[s_i] * pi(o_t) / sg[pi(o_t)]: its value is s_i, its
gradient s_i * grad logp_t. With a per-sequence advantage A_i and ``agg='seq-mean-token-mean'``
the gradient is exactly GSPO's, (1 / G) sum_i [s_i unclipped] A_i s_i (1 / |o_i|) sum_t grad
logp_t (the clip and dual clip act on s_i); token-level advantages (AR, TR, Lopti's and the
entropy selection's zeros) give GSPO-token, as that paper defines it. A sequence never spans two
micro-batches (``packing``), so s_i is computed inside one, from each target's ``sequence_id``.

``mode='cispo'`` (MiniMax-M1, arXiv 2506.13585): REINFORCE with the clipped importance weight
under a stop-gradient, so no token's gradient is dropped:

    pg_t      = -sg[min(ratio_t, cispo_max_weight)] * A_t * logp_t

(no lower bound on the weight, as the paper; eps_low, eps_high and the dual clip are unused).

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
LOSS_MODES = ("ppo", "cispo")
RATIO_LEVELS = ("token", "sequence")


def loss_mode_conflict(mode: str, ratio_level: str) -> str | None:
    """Why ``mode`` and ``ratio_level`` cannot go together, or None (config validation and
    ``LossConfig`` both ask this)."""
    if mode == "cispo" and ratio_level == "sequence":
        return "'sequence' is GSPO's clipped sequence ratio and loss.mode='cispo' weights each token: choose one"
    return None


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
    log-probs are those of the sampled distribution. mode: ``ppo`` or ``cispo``; ratio_level:
    ``token`` or ``sequence`` (GSPO, ppo mode only); cispo_max_weight: CISPO's upper bound on the
    importance weight, 1 + eps_high^IS (5, ScaleRL's value: arXiv 2510.13786)."""

    clip_low: float = 0.2
    clip_high: float = 0.24
    dual_clip: float = 10.0
    kl_coef: float = 0.001
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    agg: str = "token-mean"
    temperature: float = 1.0
    mode: str = "ppo"
    ratio_level: str = "token"
    cispo_max_weight: float = 5.0

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
        if self.mode not in LOSS_MODES:
            raise ValueError(f"LossConfig.mode={self.mode!r}: allowed {list(LOSS_MODES)}")
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"LossConfig.ratio_level={self.ratio_level!r}: allowed {list(RATIO_LEVELS)}")
        if self.cispo_max_weight < 1:
            raise ValueError(f"LossConfig.cispo_max_weight={self.cispo_max_weight}: must be >= 1")
        conflict = loss_mode_conflict(self.mode, self.ratio_level)
        if conflict:
            raise ValueError(f"LossConfig.ratio_level={self.ratio_level!r}: {conflict}")

    @property
    def use_kl(self) -> bool:
        return self.kl_coef != 0.0

    @property
    def target_keys(self) -> tuple[str, ...]:
        """The per-target arrays ``policy_loss`` reads besides the always-present ones."""
        return (("ref_logprobs",) if self.use_kl else ()) + (("sequence_id",) if self.ratio_level == "sequence" else ())


def kl_penalty(logp: Array, ref_logp: Array, kind: str) -> Array:
    return KL_ESTIMATORS[kind](logp, ref_logp)


def ppo_clipped_loss(logp: Array, old_logp: Array, advantages: Array, clip_low: float,
                     clip_high: float, dual_clip: float) -> tuple[Array, dict[str, Array]]:
    """Per-token dual-clip PPO loss and, per token, where each clip binds:
    ``clip_low``: A < 0 and ratio < 1 - eps_low (the clipped branch is the max);
    ``clip_high``: A > 0 and ratio > 1 + eps_high (idem); ``dual_clip``: A < 0 and the
    dual bound -A * c is the min. Tokens with A = 0 never count as clipped."""
    return clipped_surrogate(jnp.exp(logp - old_logp), advantages, clip_low, clip_high, dual_clip)


def clipped_surrogate(ratio: Array, advantages: Array, clip_low: float, clip_high: float,
                      dual_clip: float) -> tuple[Array, dict[str, Array]]:
    """``ppo_clipped_loss`` of a given ratio (a token's, or GSPO's sequence ratio per token)."""
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


def cispo_loss(logp: Array, log_ratio: Array, advantages: Array,
               max_weight: float) -> tuple[Array, dict[str, Array]]:
    """Per-token CISPO loss -sg[min(ratio, max_weight)] * A * logp; ``clip_high`` marks the tokens
    (A != 0) whose weight the bound caps."""
    ratio = jnp.exp(log_ratio)
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, max_weight))
    none = jnp.zeros(ratio.shape, bool)
    info = {"ratio": ratio, "clip_low": none, "clip_high": (ratio > max_weight) & (advantages != 0), "dual_clip": none}
    return -weight * advantages * logp, info


def sequence_mean(values: Array, sequence_id: Array, mask: Array) -> Array:
    """Per token, the mean of ``values`` over the ``mask``ed tokens with its ``sequence_id`` (any
    shape; ids need not be contiguous or sorted). Sequences are numbered locally by ``unique`` so
    the segment count is static: at most one per token."""
    shape, n = values.shape, values.size
    _, local = jnp.unique(sequence_id.reshape(-1), size=n, fill_value=0, return_inverse=True)
    local = local.reshape(-1)
    m = mask.reshape(-1).astype(jnp.float32)
    sums = jax.ops.segment_sum(values.reshape(-1) * m, local, num_segments=n)
    counts = jax.ops.segment_sum(m, local, num_segments=n)
    return (sums / jnp.maximum(counts, 1.0))[local].reshape(shape)


def sequence_ids(shape) -> np.ndarray:
    """The dense ``sequence_id`` array of a [B, T] batch: row b's tokens carry b + 1."""
    return np.broadcast_to(np.arange(1, shape[0] + 1, dtype=np.int32)[:, None], shape)


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


def policy_loss(cfg: LossConfig, logp: Array, entropy: Array,
                batch: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
    """The weighted sum of the per-token loss over these tokens (a micro-batch's share of the
    mini-batch loss), and metric SUMS over its valid response tokens (the train step divides
    them by the mini-batch token count). Any shape, all arrays alike.

    batch: ``advantages``, ``old_logprobs``, ``response_mask`` (valid tokens), ``loss_mask``
    (the pass's tokens: KL and entropy apply there), ``agg_weight`` (``aggregation_weights``
    of the mini-batch), ``ref_logprobs`` when ``cfg.kl_coef != 0``, and ``sequence_id`` (equal
    on one sequence's tokens, ``sequence_ids``) when ``cfg.ratio_level == 'sequence'``.
    """
    mask = batch["response_mask"].astype(jnp.float32)
    weight = batch["agg_weight"].astype(jnp.float32) * mask
    kl_weight = batch["loss_mask"].astype(jnp.float32) * weight
    log_ratio = logp - batch["old_logprobs"]
    if cfg.ratio_level == "sequence":  # GSPO-token: value s_i, gradient s_i * grad logp_t
        seq = sequence_mean(log_ratio, batch["sequence_id"], mask)
        log_ratio = (logp - jax.lax.stop_gradient(logp)) + jax.lax.stop_gradient(seq)
    if cfg.mode == "cispo":
        pg, info = cispo_loss(logp, log_ratio, batch["advantages"], cfg.cispo_max_weight)
    else:
        pg, info = clipped_surrogate(jnp.exp(log_ratio), batch["advantages"], cfg.clip_low, cfg.clip_high,
                                     cfg.dual_clip)
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
