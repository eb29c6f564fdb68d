"""Advantage Reweighting (AR), TR-GRPO token weights and Lopti: the paper's method.

Read next to docs/paper.md. Notation: A_t is the (already normalised) token-level advantage of
an advantage estimator, p_t = pi_old(o_t) = exp(old_logprob_t) the probability the sampling
policy gave token o_t (at the sampling temperature). p_t is data, a constant: no gradient
flows through it. All functions are pure array functions over [B, T] batches aligned with
``input_ids``; tokens outside ``response_mask`` always get 0.

Token weightings (``TokenWeightConfig.weighting``), applied as A~_t = w_t * A_t to positive
and negative advantages alike:

  none  w_t = 1
  ar    Advantage Reweighting:  w_t = alpha * p_t + (1 - alpha).
        alpha = 0 is plain GRPO; the paper uses alpha = 0.2 (AR alone), 0.3 (AR + Lopti).
  tr    TR-GRPO probability shaping:  w_t = clip(a * (sigmoid(p_t / tau) - mu), L, U).

High-entropy token selection (``TokenWeightConfig.entropy_top_fraction`` = rho > 0; Wang et al.
2025, "Beyond the 80/20 rule", arXiv 2506.01939): the policy gradient only on the top rho of the
batch's tokens by entropy, A~_t = I[H_t >= tau_rho] * w_t * A_t, where H_t is the entropy of
pi_old's (temperature-scaled) next-token distribution at t and tau_rho the (1 - rho)-quantile
(linear interpolation, as ``numpy.quantile``) of H over the valid response tokens of the WHOLE
rollout batch: the paper's "top rho of tokens in batch B", decided once before the update, the
same for every mini-batch and Lopti pass. (The paper takes H from the policy being trained, and
TRL's ``top_entropy_quantile`` per loss call; before the first optimizer step that is pi_old.)
Unselected tokens keep their place in the loss's denominator, as in the paper's
1 / sum_i |o_i|, and the KL and entropy terms still apply to them.

Low-Probability Token Isolation (``LoptiConfig``): split the response tokens by p_t with a
threshold eta (low = p_t < eta, high = p_t >= eta) and run two complete updates over the
rollout batch, low pass first. Pass k keeps A~_t only on its tokens (0 elsewhere) and masks
the KL and entropy terms to its tokens; excluded tokens stay in the token-mean denominator.
A negative eta means high pass first with threshold |eta| (as the reference code); with
``quantile=True`` the threshold is the |eta|-quantile of p over the valid response tokens
of the batch instead of |eta| itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from arlopti_jax.algos.advantages import AdvantageConfig, compute_advantages

Array = jax.Array
WeightFn = Callable[["TokenWeightConfig", Array], Array]

_WEIGHTINGS: dict[str, WeightFn] = {}


def register_token_weighting(name: str):
    """Decorator: make ``fn(cfg, p_old[B, T]) -> w[B, T]`` selectable as
    ``TokenWeightConfig(weighting=name)``."""

    def deco(fn: WeightFn) -> WeightFn:
        if name in _WEIGHTINGS:
            raise ValueError(f"token weighting {name!r} is already registered")
        _WEIGHTINGS[name] = fn
        return fn

    return deco


def token_weightings() -> list[str]:
    return sorted(_WEIGHTINGS)


@dataclasses.dataclass(frozen=True)
class TokenWeightConfig:
    """Which weighting multiplies the advantage, and its constants.

    AR: ``alpha`` in [0, 1] (paper: 0.2 alone, 0.3 with Lopti).

    entropy_top_fraction: rho of the high-entropy selection (module docstring); 0 = every token.

    TR-GRPO: w = clip(tr_scale * (sigmoid(p / tr_tau) - tr_mu), tr_min, tr_max). The
    paper's constants were not available (docs/paper.md, "TR-GRPO"); these defaults are our choice:
      * tr_mu = 0.5 = sigmoid(0): the unclipped weight is 0 at p = 0, and since sigmoid is
        increasing, w is increasing in p for any tau > 0.
      * tr_tau = 0.25: sigmoid(p / tau) saturates only as p -> 1 (sigmoid(4) = 0.982), so w
        keeps rising over the whole [0, 1] range instead of flattening early; near p = 0
        the slope is a / (4 tau) = 2, i.e. w ~ 2p for rare tokens.
      * tr_scale = 2: with mu = 0.5 the shaped value a * (sigmoid(1/tau) - 0.5) = 0.964 at
        p = 1, so confident tokens keep ~ their GRPO weight (w(0.5) = 0.76, w(0.25) = 0.46,
        w(0.1) = 0.20).
      * tr_min = 0.1: a floor so that very rare tokens still carry 10% of their signal
        (TR-GRPO down-weights, it does not drop); tr_max = 1.0: never amplify beyond GRPO.
    """

    weighting: str = "none"
    alpha: float = 0.2
    entropy_top_fraction: float = 0.0
    tr_scale: float = 2.0
    tr_tau: float = 0.25
    tr_mu: float = 0.5
    tr_min: float = 0.1
    tr_max: float = 1.0

    def __post_init__(self):
        if self.weighting not in _WEIGHTINGS:
            raise ValueError(f"TokenWeightConfig.weighting={self.weighting!r}: allowed {token_weightings()}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"TokenWeightConfig.alpha={self.alpha}: must be in [0, 1]")
        if self.tr_tau <= 0:
            raise ValueError(f"TokenWeightConfig.tr_tau={self.tr_tau}: must be > 0")
        if self.tr_scale <= 0:
            raise ValueError(f"TokenWeightConfig.tr_scale={self.tr_scale}: must be > 0 (weight increasing in p)")
        if self.tr_min > self.tr_max:
            raise ValueError(f"TokenWeightConfig.tr_min={self.tr_min} > tr_max={self.tr_max}")
        if not 0.0 <= self.entropy_top_fraction < 1.0:
            raise ValueError(f"TokenWeightConfig.entropy_top_fraction={self.entropy_top_fraction}: must be in "
                             "[0, 1) (0 = off)")


@register_token_weighting("none")
def no_weights(cfg: TokenWeightConfig, p: Array) -> Array:
    return jnp.ones_like(p)


@register_token_weighting("ar")
def ar_weights(cfg: TokenWeightConfig, p: Array) -> Array:
    """Advantage Reweighting: w_t = alpha * pi_old(o_t) + (1 - alpha)."""
    return cfg.alpha * p + (1.0 - cfg.alpha)


@register_token_weighting("tr")
def tr_weights(cfg: TokenWeightConfig, p: Array) -> Array:
    """TR-GRPO: w_t = clip(a * (sigmoid(pi_old(o_t) / tau) - mu), L, U)."""
    return jnp.clip(cfg.tr_scale * (jax.nn.sigmoid(p / cfg.tr_tau) - cfg.tr_mu), cfg.tr_min, cfg.tr_max)


def weight_advantages(cfg: TokenWeightConfig, advantages: Array, old_logprobs: Array,
                      response_mask: Array) -> Array:
    """A~_t = w(pi_old(o_t)) * A_t on response tokens (pi_old detached), 0 elsewhere."""
    p = jax.lax.stop_gradient(jnp.exp(old_logprobs.astype(jnp.float32)))
    return _WEIGHTINGS[cfg.weighting](cfg, p) * advantages * response_mask.astype(jnp.float32)


def entropy_top_mask(fraction: float, entropies: Array, response_mask: Array) -> Array:
    """[B, T] float32: 1 on the valid response tokens whose entropy is at least the
    (1 - fraction)-quantile of the valid tokens' entropies (ties at the threshold are kept)."""
    mask = response_mask > 0
    h = entropies.astype(jnp.float32)
    threshold = jnp.nanquantile(jnp.where(mask, h, jnp.nan), 1.0 - fraction)
    return ((h >= threshold) & mask).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class LoptiConfig:
    """enabled: run the two-pass Lopti update. eta: threshold on pi_old (paper: 0.4 alone,
    0.5 with AR); eta < 0 runs the high-probability pass first with threshold |eta|.
    quantile: use the |eta|-quantile of pi_old over the batch's valid response tokens as the
    threshold (|eta| is then a quantile level in (0, 1))."""

    enabled: bool = False
    eta: float = 0.5
    quantile: bool = False

    def __post_init__(self):
        if not self.enabled:
            return
        if self.eta == 0 or abs(self.eta) > 1:
            raise ValueError(f"LoptiConfig.eta={self.eta}: need 0 < |eta| <= 1 "
                             "(negative: high-probability pass first)")
        if self.quantile and abs(self.eta) >= 1:
            raise ValueError(f"LoptiConfig.eta={self.eta}: with quantile=True |eta| is a quantile level in (0, 1)")

    @property
    def low_first(self) -> bool:
        return self.eta > 0


def lopti_threshold(cfg: LoptiConfig, old_logprobs: Array, response_mask: Array) -> Array:
    """The probability threshold: |eta|, or the |eta|-quantile (linear interpolation, as
    ``numpy.quantile``) of pi_old over the valid response tokens."""
    if not cfg.quantile:
        return jnp.asarray(abs(cfg.eta), jnp.float32)
    p = jnp.exp(old_logprobs.astype(jnp.float32))
    return jnp.nanquantile(jnp.where(response_mask > 0, p, jnp.nan), abs(cfg.eta))


def lopti_masks(cfg: LoptiConfig, old_logprobs: Array, response_mask: Array) -> tuple[Array, Array]:
    """The two passes' token masks [B, T] (float32), in update order. They partition the
    response tokens: low = pi_old < threshold, high = pi_old >= threshold."""
    mask = response_mask.astype(jnp.float32)
    p = jnp.exp(old_logprobs.astype(jnp.float32))
    low = (p < lopti_threshold(cfg, old_logprobs, response_mask)).astype(jnp.float32) * mask
    high = mask - low
    return (low, high) if cfg.low_first else (high, low)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def prepare_updates(adv_cfg: AdvantageConfig, weight_cfg: TokenWeightConfig, lopti_cfg: LoptiConfig,
                    rewards: Array, group_ids: Array, response_mask: Array,
                    old_logprobs: Array, entropies: Array | None = None) -> tuple[tuple[Array, Array], ...]:
    """A rollout batch's update passes: ``((advantages, loss_mask), ...)``, [B, T] each.

    advantages = w(pi_old) * A (estimator, then weighting), times the high-entropy selection
    when ``weight_cfg.entropy_top_fraction`` > 0 (``entropies``: pi_old's per-token entropy,
    needed then), zeroed outside the pass's tokens; loss_mask = the pass's tokens (where KL and
    entropy apply). One pass without Lopti (loss_mask = response_mask), two with it, in update order.
    """
    mask = response_mask.astype(jnp.float32)
    adv = compute_advantages(adv_cfg, rewards, group_ids, mask)
    adv = weight_advantages(weight_cfg, adv, old_logprobs, mask)
    if weight_cfg.entropy_top_fraction > 0:
        if entropies is None:
            raise ValueError("TokenWeightConfig.entropy_top_fraction > 0 needs the batch's entropies")
        adv = adv * entropy_top_mask(weight_cfg.entropy_top_fraction, entropies, mask)
    if not lopti_cfg.enabled:
        return ((adv, mask),)
    return tuple((adv * m, m) for m in lopti_masks(lopti_cfg, old_logprobs, mask))
