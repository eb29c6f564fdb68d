"""The paper's token-probability diagnostic: response tokens in four quartiles of pi_old.

Quartile edges are the 25/50/75% quantiles (linear interpolation, as ``numpy.quantile``)
of pi_old = exp(old_logprob) over the valid response tokens of the batch; quartile q holds
the tokens with edge[q-1] <= pi_old < edge[q] (edge[-1] = -inf, edge[3] = +inf).

``probability_quartiles``: per quartile the token count, mean pi_old and mean |A~| (the
weighted advantage the update uses). ``make_quartile_grad_norms``: per quartile the global
L2 norm of the gradient of the loss restricted to that quartile's tokens (advantages and
KL/entropy masked to them, the denominator still every valid token, as a Lopti pass), the
paper's evidence that low-probability tokens dominate the update. It costs four backward
passes: a diagnostic, not for every step. ``quartile_grad_norm_metrics`` is the trainer's
``train.diagnostics_every``: on the step's first mini-batch (or the rows ``train.diagnostics_rows``
names: the whole batch, for methods whose mini-batches differ), the full weighted advantages
(every Lopti pass together) and loss_mask = response_mask, quartile edges from the whole
batch, so the numbers compare across variants (with Lopti they describe the update before
its split into passes).

``isolation_experiment``: the paper's Figure 1 (right). From one state and one batch, one
optimizer step on only the lowest-quartile tokens, then (from the same state) one on only
the highest-quartile tokens; after each, the change of every quartile's mean pi, measured
by teacher-forced passes at the loss temperature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax.runtime import distributed as dist
from arlopti_jax.algos.train_step import BATCH_KEYS, TrainStep, update_on_batch

Array = jax.Array


def quartile_edges(old_logprobs: Array, response_mask: Array) -> Array:
    p = jnp.exp(old_logprobs.astype(jnp.float32))
    return jnp.nanquantile(jnp.where(response_mask > 0, p, jnp.nan), jnp.array([0.25, 0.5, 0.75]))


def quartile_masks(old_logprobs: Array, response_mask: Array, edges: Array | None = None) -> Array:
    """[4, B, T] float masks partitioning the response tokens by pi_old quartile (of this
    batch, or by the given ``edges``)."""
    p = jnp.exp(old_logprobs.astype(jnp.float32))
    q = jnp.digitize(p, quartile_edges(old_logprobs, response_mask) if edges is None else edges)
    return (q[None] == jnp.arange(4)[:, None, None]).astype(jnp.float32) * (response_mask > 0)


_quartile_masks = jax.jit(quartile_masks)  # one program, not one per primitive (a resumed run compiles it late)


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
    """``fn(params, batch, edges=None) -> [4]`` gradient norms per pi_old quartile of the train
    step ``step``'s loss; ``batch`` a dense mini-batch as the step's; quartiles of this batch,
    or by ``edges`` [3]. Params are read, not donated."""

    def quartile_grad_norms(params, batch, edges=None) -> np.ndarray:
        host = {k: dist.to_host(v) for k, v in batch.items()}
        masks = np.asarray(_quartile_masks(host["old_logprobs"], host["response_mask"], edges))
        norms = []
        for mask in masks:
            restricted = {**host, "advantages": host["advantages"] * mask, "loss_mask": host["loss_mask"] * mask}
            norms.append(float(step.gradient(params, restricted)[1]))
        return np.asarray(norms, np.float32)

    return quartile_grad_norms


def quartile_grad_norm_metrics(grad_norms_fn, params, batch: dict, passes, rows: int) -> dict[str, float]:
    """``quartile/q{1..4}_grad_norm`` of the batch's first ``rows`` rows (the trainer's default: the
    update's first mini-batch) with the full weighted advantages (the passes' sum) and loss_mask =
    response_mask, quartiles by the whole batch's pi_old edges. ``batch`` holds ref_logprobs when
    the KL is on."""
    host = {k: dist.to_host(v) for k, v in batch.items() if k in BATCH_KEYS + ("ref_logprobs",) and k in batch}
    host["advantages"] = sum(dist.to_host(a) for a, _ in passes)
    host["loss_mask"] = host["response_mask"].astype(np.float32)
    edges = np.asarray(quartile_edges(host["old_logprobs"], host["response_mask"]))
    norms = grad_norms_fn(params, {k: v[:rows] for k, v in host.items()}, edges)
    return {f"quartile/q{i + 1}_grad_norm": float(norms[i]) for i in range(4)}


def isolation_experiment(step: TrainStep, logprobs_fn, init_opt_state, params, batch: dict) -> np.ndarray:
    """[2, 4]: row 0 updates only the lowest pi_old quartile's tokens, row 1 only the highest's;
    column q is the change of the mean pi (teacher-forced by ``logprobs_fn``, a
    ``make_compute_logprobs`` at the loss temperature) of quartile q + 1's tokens after ONE
    optimizer step of ``step`` on the whole batch from ``params`` and a fresh optimizer state
    (``init_opt_state(params)``). ``batch``: [B, T] input_ids, attention_mask, response_mask,
    old_logprobs, advantages (token-level, weighted), and ref_logprobs when the KL is on. The
    updated tokens keep their advantages and the KL/entropy terms (loss_mask = their mask);
    the denominator counts every response token, as a Lopti pass. ``params`` are not modified.
    """
    host = {k: dist.to_host(v) for k, v in batch.items()}
    rows = host["input_ids"].shape[0]
    masks = np.asarray(quartile_masks(host["old_logprobs"], host["response_mask"]))
    counts = np.maximum(masks.sum((1, 2)), 1.0)

    def mean_probs(p) -> np.ndarray:
        probs = np.exp(logprobs_fn(p, host))
        return (masks * probs[None]).sum((1, 2)) / counts

    before = mean_probs(params)
    out = []
    for q in (0, 3):
        fresh = jax.tree.map(lambda x: x.copy(), params)  # the step donates its inputs
        updated, _, _ = update_on_batch(step, fresh, init_opt_state(fresh), host,
                                        [(host["advantages"] * masks[q], masks[q])], rows)
        out.append(mean_probs(updated) - before)
    return np.stack(out)
