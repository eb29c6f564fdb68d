"""Advantage estimators for outcome rewards, picked by name from the config.

Every estimator maps one scalar reward per response to token-level advantages:

    rewards        [B]     float  verifiable reward r_i of response i
    group_ids      [B]     int    responses of the same prompt share an id (any ids, any order)
    response_mask  [B, T]  0/1    1 on the response tokens of row i (aligned with input_ids); in a
                                  tool episode the action mask, with holes at the observations
    ->             [B, T]  float  advantages, 0 outside the response mask

Group statistics use a [B, B] equality matrix of ``group_ids`` (no assumption that a
group is contiguous or of size G). A row with no response token is batch padding: it is
left out of every group statistic and of the REINFORCE++ whitening, and gets 0.

Estimators (see docs/paper.md, "Advantage estimators"):
  grpo                 A_i = (r_i - mean(r_g)) / (std(r_g) + eps), std unbiased (ddof=1);
                       a group of size 1 gets mean 0 and std 1 (so A_i = r_i / (1 + eps)).
  dr_grpo              A_i = r_i - mean(r_g), no std division (size-1 group: mean 0, as grpo);
                       Dr. GRPO's advantage only: pair it with agg='seq-mean-token-sum'.
  rloo                 A_i = r_i - mean_{j in g, j != i} r_j (size-1 group: 0).
  reinforce_plus_plus  token reward r_i on the last response token, per-token discounted
                       return G_t = sum_{s >= t} gamma^(s-t) r_s over the response (s and t
                       counting the masked-in tokens: a tool episode's observations are
                       skipped), then
                       whitened over all valid tokens of the batch:
                       (G - mean) * rsqrt(var + 1e-8), var unbiased (as verl's masked_whiten).

Register a new estimator with ``@register_advantage_estimator("name")``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
AdvantageFn = Callable[["AdvantageConfig", Array, Array, Array], Array]

_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_advantage_estimator(name: str):
    """Decorator: make ``fn(cfg, rewards, group_ids, response_mask) -> [B, T]`` selectable
    as ``AdvantageConfig(estimator=name)``."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = fn
        return fn

    return deco


def advantage_estimators() -> list[str]:
    return sorted(_ESTIMATORS)


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """estimator: a registered name (``advantage_estimators()``); eps: GRPO's std epsilon;
    gamma: REINFORCE++ discount (1.0 in the paper)."""

    estimator: str = "grpo"
    eps: float = 1e-6
    gamma: float = 1.0

    def __post_init__(self):
        if self.estimator not in _ESTIMATORS:
            raise ValueError(f"AdvantageConfig.estimator={self.estimator!r}: allowed {advantage_estimators()}")
        if self.eps < 0:
            raise ValueError(f"AdvantageConfig.eps={self.eps}: must be >= 0")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"AdvantageConfig.gamma={self.gamma}: must be in [0, 1]")


@functools.partial(jax.jit, static_argnums=0)
def compute_advantages(cfg: AdvantageConfig, rewards: Array, group_ids: Array, response_mask: Array) -> Array:
    """Token-level advantages [B, T] (float32) of the configured estimator."""
    mask = response_mask.astype(jnp.float32)
    adv = _ESTIMATORS[cfg.estimator](cfg, rewards.astype(jnp.float32), group_ids, mask)
    return adv * mask


def _group_stats(rewards: Array, group_ids: Array, mask: Array):
    """Per-row (group size n_i, group sum s_i, group sum of squared deviations from the mean,
    membership matrix) over the non-padding rows of each row's group."""
    real = (mask.sum(-1) > 0).astype(jnp.float32)  # rows with at least one response token
    same = (group_ids[:, None] == group_ids[None, :]).astype(jnp.float32) * real[None, :]
    n = same.sum(-1)
    total = same @ rewards
    mean = total / jnp.maximum(n, 1.0)
    sq = (same * (rewards[None, :] - mean[:, None]) ** 2).sum(-1)
    return n, total, mean, sq


def _broadcast(per_row: Array, mask: Array) -> Array:
    return per_row[:, None] * mask


@register_advantage_estimator("grpo")
def grpo_advantages(cfg, rewards, group_ids, mask):
    n, _, mean, sq = _group_stats(rewards, group_ids, mask)
    single = n <= 1
    mean = jnp.where(single, 0.0, mean)
    std = jnp.where(single, 1.0, jnp.sqrt(sq / jnp.maximum(n - 1.0, 1.0)))
    return _broadcast((rewards - mean) / (std + cfg.eps), mask)


@register_advantage_estimator("dr_grpo")
def dr_grpo_advantages(cfg, rewards, group_ids, mask):
    n, _, mean, _ = _group_stats(rewards, group_ids, mask)
    return _broadcast(rewards - jnp.where(n <= 1, 0.0, mean), mask)


@register_advantage_estimator("rloo")
def rloo_advantages(cfg, rewards, group_ids, mask):
    n, total, _, _ = _group_stats(rewards, group_ids, mask)
    others = (total - rewards) / jnp.maximum(n - 1.0, 1.0)
    return _broadcast(jnp.where(n <= 1, 0.0, rewards - others), mask)


def last_token_rewards(rewards: Array, mask: Array) -> Array:
    """[B, T] token-level rewards: r_i on the last response token of row i, 0 elsewhere."""
    t = mask.shape[1]
    last = t - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=1)
    onehot = jax.nn.one_hot(last, t, dtype=jnp.float32) * (mask.sum(-1, keepdims=True) > 0)
    return onehot * rewards[:, None]


def discounted_returns(token_rewards: Array, mask: Array, gamma: float) -> Array:
    """G_t = m_t * (r_t + gamma * G_{t+1}), scanned right to left over the sequence, where G_{t+1} is
    the return of the next masked-in token: a hole in the mask (a tool episode's observation, which
    is not the policy's) passes the return through unchanged and costs no discount step, so each
    of the policy's tokens gets the return of the policy's tokens after it."""

    def body(nxt, xs):
        r, m = xs
        g = m * (r + gamma * nxt)
        return jnp.where(m > 0, g, nxt), g

    _, out = jax.lax.scan(body, jnp.zeros(token_rewards.shape[0], jnp.float32),
                          (token_rewards.T, mask.T), reverse=True)
    return out.T


def masked_whiten(x: Array, mask: Array, eps: float = 1e-8) -> Array:
    n = mask.sum()
    mean = (x * mask).sum() / jnp.maximum(n, 1.0)
    var = (((x - mean) * mask) ** 2).sum() / jnp.maximum(n - 1.0, 1.0)
    return (x - mean) * jax.lax.rsqrt(var + eps)


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(cfg, rewards, group_ids, mask):
    del group_ids  # the baseline is the batch-wide whitening, not the group
    returns = discounted_returns(last_token_rewards(rewards, mask), mask, cfg.gamma)
    return masked_whiten(returns, mask)
