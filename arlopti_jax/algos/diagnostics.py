"""The paper's token-probability diagnostic: response tokens in four quartiles of pi_old.

Quartile edges are the 25/50/75% quantiles (linear interpolation, as ``numpy.quantile``)
of pi_old = exp(old_logprob) over the valid response tokens of the batch; quartile q holds
the tokens with edge[q-1] <= pi_old < edge[q] (edge[-1] = -inf, edge[3] = +inf).

``probability_quartiles``: per quartile the token count, mean pi_old and mean |A~| (the
weighted advantage the update uses). ``make_quartile_grad_norms``: per quartile the global
L2 norm of the gradient of the loss restricted to that quartile's tokens (advantages and
KL/entropy masked to them, the denominator still every valid token, as a Lopti pass), the
paper's evidence that low-probability tokens dominate the update. It costs four backward
passes: a diagnostic, not for every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax import distributed as dist
from arlopti_jax.algos.train_step import TrainStep

Array = jax.Array


def quartile_edges(old_logprobs: Array, response_mask: Array) -> Array:
    p = jnp.exp(old_logprobs.astype(jnp.float32))
    return jnp.nanquantile(jnp.where(response_mask > 0, p, jnp.nan), jnp.array([0.25, 0.5, 0.75]))


def quartile_masks(old_logprobs: Array, response_mask: Array) -> Array:
    """[4, B, T] float masks partitioning the response tokens by pi_old quartile."""
    p = jnp.exp(old_logprobs.astype(jnp.float32))
    q = jnp.digitize(p, quartile_edges(old_logprobs, response_mask))
    return (q[None] == jnp.arange(4)[:, None, None]).astype(jnp.float32) * (response_mask > 0)


@jax.jit
def probability_quartiles(old_logprobs: Array, advantages: Array, response_mask: Array) -> dict[str, Array]:
    """{'edges': [3], 'count': [4], 'mean_prob': [4], 'mean_abs_adv': [4]}."""
    masks = quartile_masks(old_logprobs, response_mask)
    p = jnp.exp(old_logprobs.astype(jnp.float32))
    count = masks.sum((1, 2))
    safe = jnp.maximum(count, 1.0)
    return {
        "edges": quartile_edges(old_logprobs, response_mask),
        "count": count,
        "mean_prob": (masks * p).sum((1, 2)) / safe,
        "mean_abs_adv": (masks * jnp.abs(advantages)).sum((1, 2)) / safe,
    }


def make_quartile_grad_norms(step: TrainStep):
    """``fn(params, batch) -> [4]`` gradient norms per pi_old quartile of the train step
    ``step``'s loss; ``batch`` a dense mini-batch as the step's. Params are read, not donated."""

    def quartile_grad_norms(params, batch) -> np.ndarray:
        masks = np.asarray(quartile_masks(dist.to_host(batch["old_logprobs"]), dist.to_host(batch["response_mask"])))
        norms = []
        for mask in masks:
            restricted = {**batch, "advantages": dist.to_host(batch["advantages"]) * mask,
                          "loss_mask": dist.to_host(batch["loss_mask"]) * mask}
            norms.append(float(step.gradient(params, restricted)[1]))
        return np.asarray(norms, np.float32)

    return quartile_grad_norms
