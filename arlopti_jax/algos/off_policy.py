"""Off-policy correction: the gap between pi_old and the behaviour policy that sampled the batch.

With ``rollout.max_staleness`` = k >= 1 the batch an update consumes was sampled k policy versions
earlier (``rl/pipeline.py``), so two policies are in play at step t:

    pi_beh(o_t)   the behaviour policy: the sampler's log-probs, recorded as it drew the tokens
    pi_old(o_t)   the trainer's policy before the update, recomputed by one teacher-forced pass

pi_old is the paper's: AR's weight, Lopti's split at eta, TR-GRPO's weight and the PPO ratio all
read it (``prepare_updates`` is given the recomputed log-probs). The correction reweights the
policy-gradient term alone by a per-token constant c_t (no gradient through it):

    none      c_t = 1
    tis       c_t = min(pi_old(o_t) / pi_beh(o_t), C)       token-level truncated importance sampling
    seq_mask  c_t = 1[1/B <= g_i <= B] for every token t of response i,
              g_i = exp(mean over i's response tokens of (log pi_old - log pi_beh))   (geometric mean ratio)

C is ``rollout.tis_cap``, B ``rollout.seq_mask_bound``. For the record, from those projects' own docs and
configs (read 2026-12): verl's rollout correction caps token or sequence IS weights at
``rollout_is_threshold`` (2.0 by default) and offers rejection by a "geometric" sequence metric between
``rollout_rs_threshold_lower`` and ``rollout_rs_threshold``; SkyRL's ``off_policy_correction`` masks
sequences by a geometric-mean ratio between ``geo_mask_low`` and ``geo_mask_high`` (0.99 and 1.01 in its
fully asynchronous example). Here the bound is one field, symmetric in log space: |log g_i| <= log B.

Because c_t >= 0 is a constant, c_t * pg_t equals the loss of the advantage c_t * A_t in every loss
mode (the PPO clip, its dual clip, GSPO's sequence ratio and CISPO are all linear in A for a fixed
ratio): ``correct_passes`` folds c into each update pass's advantages, so the KL and entropy terms are
untouched and the train step's programs are the same. Masked or zero-weight tokens stay in the
token-mean denominator (as Lopti's excluded tokens), and never count as clipped.

Mismatch metrics (``mismatch_metrics``), over the valid response tokens of the batch:
    offpolicy/kl_k3        mean of r - 1 - log r, r = pi_old / pi_beh: the k3 estimate of
                           KL(pi_beh || pi_old) from the behaviour policy's own samples (>= 0, unclamped)
    offpolicy/ratio_mean   mean of r
    offpolicy/tis_clipped  share of tokens whose r exceeds C (tis)
    offpolicy/seq_masked   share of tokens in masked responses (seq_mask)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array
CORRECTIONS = ("none", "tis", "seq_mask")


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """kind: one of ``CORRECTIONS``; tis_cap: C (>= 1); seq_mask_bound: B (> 1)."""

    kind: str = "none"
    tis_cap: float = 2.0
    seq_mask_bound: float = 1.01

    def __post_init__(self):
        if self.kind not in CORRECTIONS:
            raise ValueError(f"CorrectionConfig.kind={self.kind!r}: allowed {list(CORRECTIONS)}")
        if not self.tis_cap >= 1:
            raise ValueError(f"CorrectionConfig.tis_cap={self.tis_cap}: must be >= 1")
        if not self.seq_mask_bound > 1:
            raise ValueError(f"CorrectionConfig.seq_mask_bound={self.seq_mask_bound}: must be > 1")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


def _log_ratio(old_logprobs: Array, behaviour_logprobs: Array, mask: Array) -> Array:
    return (jnp.asarray(old_logprobs, jnp.float32) - jnp.asarray(behaviour_logprobs, jnp.float32)) * mask


def sequence_log_ratio(old_logprobs: Array, behaviour_logprobs: Array, response_mask: Array) -> Array:
    """[B]: per response (row), the mean over its response tokens of log pi_old - log pi_beh
    (0 for a row without response tokens): log g_i."""
    mask = jnp.asarray(response_mask, jnp.float32)
    total = _log_ratio(old_logprobs, behaviour_logprobs, mask).sum(-1)
    return total / jnp.maximum(mask.sum(-1), 1.0)


def correction_weights(cfg: CorrectionConfig, old_logprobs: Array, behaviour_logprobs: Array,
                       response_mask: Array) -> Array:
    """[B, T] float32: c_t on the response tokens (the module docstring), 0 elsewhere."""
    mask = jnp.asarray(response_mask, jnp.float32)
    if cfg.kind == "tis":
        return jnp.minimum(jnp.exp(_log_ratio(old_logprobs, behaviour_logprobs, mask)), cfg.tis_cap) * mask
    if cfg.kind == "seq_mask":
        keep = jnp.abs(sequence_log_ratio(old_logprobs, behaviour_logprobs, mask)) <= jnp.log(cfg.seq_mask_bound)
        return keep.astype(jnp.float32)[:, None] * mask
    return mask


def correct_passes(passes, weights: Array):
    """Each update pass ``(advantages, loss_mask)`` with its advantages times ``weights`` (the
    policy-gradient term's correction; the loss mask, and so KL and entropy, unchanged)."""
    return tuple((advantages * weights, loss_mask) for advantages, loss_mask in passes)


def mismatch_metrics(cfg: CorrectionConfig, old_logprobs: Array, behaviour_logprobs: Array,
                     response_mask: Array) -> dict[str, float]:
    """``offpolicy/*`` (the module docstring) as Python floats."""
    mask = jnp.asarray(response_mask, jnp.float32)
    n = jnp.maximum(mask.sum(), 1.0)
    log_r = _log_ratio(old_logprobs, behaviour_logprobs, mask)
    r = jnp.exp(log_r)
    out = {"offpolicy/kl_k3": ((r - 1.0 - log_r) * mask).sum() / n, "offpolicy/ratio_mean": (r * mask).sum() / n}
    if cfg.kind == "tis":
        out["offpolicy/tis_clipped"] = ((r > cfg.tis_cap) * mask).sum() / n
    if cfg.kind == "seq_mask":
        kept = correction_weights(cfg, old_logprobs, behaviour_logprobs, mask)
        out["offpolicy/seq_masked"] = ((1.0 - kept) * mask).sum() / n
    return {k: float(v) for k, v in out.items()}
