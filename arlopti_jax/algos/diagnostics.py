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
``train.diagnostics_every``: on the step's first mini-batch, the full weighted advantages
(every Lopti pass together) and loss_mask = response_mask, quartile edges from the whole
batch, so the numbers compare across variants (with Lopti they describe the update before
its split into passes).

``isolation_experiment``: the paper's Figure 1 (right). From one state and one batch, one
optimizer step on only the lowest-quartile tokens, then (from the same state) one on only
the highest-quartile tokens; after each, the change of every quartile's mean pi, measured
by teacher-forced passes at the loss temperature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax import sharding as shd
from arlopti_jax.algos.losses import LossConfig
from arlopti_jax.algos.train_step import (BATCH_KEYS, check_batch, init_opt_state, make_compute_logprobs,
                                          make_grad_fn, make_train_step, update_on_batch)
from arlopti_jax.models import ModelConfig, param_shardings

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


def make_quartile_grad_norms(model_cfg: ModelConfig, loss_cfg: LossConfig, mesh, rules=shd.DEFAULT_RULES,
                             num_micro_batches: int = 1, chunk_size: int = 256):
    """``fn(params, batch, edges=None) -> [4]`` gradient norms per pi_old quartile; ``batch``
    as the train step's (a mini-batch); quartiles of this batch, or by ``edges`` [3]. Params
    are read, not donated."""
    grads_fn = make_grad_fn(model_cfg, loss_cfg, mesh, rules, num_micro_batches, chunk_size)
    keys = BATCH_KEYS + (("ref_logprobs",) if loss_cfg.use_kl else ())
    b_sh = shd.batch_sharding(mesh, 2)

    def fn(params, batch, edges):
        masks = quartile_masks(batch["old_logprobs"], batch["response_mask"], edges)

        def one(mask):
            restricted = {**batch, "advantages": batch["advantages"] * mask, "loss_mask": batch["loss_mask"] * mask}
            return grads_fn(params, restricted)[1]["grad_norm"]

        return jax.lax.map(one, masks)

    jitted = jax.jit(fn, in_shardings=(param_shardings(model_cfg, mesh, rules), b_sh, shd.replicated(mesh)),
                     out_shardings=shd.replicated(mesh))

    def quartile_grad_norms(params, batch, edges=None) -> Array:
        rows = num_micro_batches * shd.batch_divisor(mesh)
        batch = jax.device_put(check_batch(batch, keys, rows), b_sh)
        if edges is None:
            edges = quartile_edges(batch["old_logprobs"], batch["response_mask"])
        with shd.activate(mesh, rules):
            return jitted(params, batch, edges)

    return quartile_grad_norms


@functools.lru_cache(maxsize=8)
def _first_rows(rows: int, sharding):
    return jax.jit(lambda tree: jax.tree.map(lambda x: x[:rows], tree), out_shardings=sharding)


def quartile_grad_norm_metrics(grad_norms_fn, params, batch: dict, passes, mini_batch: int, mesh) -> dict[str, float]:
    """``quartile/q{1..4}_grad_norm`` of the first mini-batch (rows [0, mini_batch), the update's
    first) with the full weighted advantages (the passes' sum) and loss_mask = response_mask,
    quartiles by the whole batch's pi_old edges. ``batch`` holds ref_logprobs when the KL is on."""
    full = {**batch, "advantages": sum(a for a, _ in passes), "loss_mask": batch["response_mask"]}
    full = {k: v for k, v in full.items() if k in BATCH_KEYS + ("ref_logprobs",)}
    edges = jax.jit(quartile_edges, out_shardings=shd.replicated(mesh))(batch["old_logprobs"], batch["response_mask"])
    mini = _first_rows(mini_batch, shd.batch_sharding(mesh, 2))(full)
    norms = np.asarray(jax.device_get(grad_norms_fn(params, mini, edges)))
    return {f"quartile/q{i + 1}_grad_norm": float(norms[i]) for i in range(4)}


def isolation_experiment(model_cfg: ModelConfig, loss_cfg: LossConfig, optimizer, mesh, params, batch: dict, *,
                         rules=shd.DEFAULT_RULES, num_micro_batches: int = 1, chunk_size: int = 256) -> np.ndarray:
    """[2, 4]: row 0 updates only the lowest pi_old quartile's tokens, row 1 only the highest's;
    column q is the change of the mean pi (teacher-forced, at ``loss_cfg.temperature``) of
    quartile q + 1's tokens after ONE optimizer step on the whole batch from ``params`` and a
    fresh optimizer state. ``batch``: [B, T] input_ids, attention_mask, response_mask,
    old_logprobs, advantages (token-level, weighted), and ref_logprobs when the KL is on. The
    updated tokens keep their advantages and the KL/entropy terms (loss_mask = their mask);
    the denominator counts every response token, as a Lopti pass. ``params`` are not modified.
    """
    rows = batch["input_ids"].shape[0]
    logprobs = make_compute_logprobs(model_cfg, mesh, rules, temperature=loss_cfg.temperature,
                                     num_micro_batches=num_micro_batches, chunk_size=chunk_size)
    masks = quartile_masks(batch["old_logprobs"], batch["response_mask"])

    def mean_probs(p) -> np.ndarray:
        probs = jnp.exp(logprobs(p, batch))
        return np.asarray(jax.device_get((masks * probs[None]).sum((1, 2)) / jnp.maximum(masks.sum((1, 2)), 1.0)))

    before = mean_probs(params)
    step = make_train_step(model_cfg, loss_cfg, optimizer, mesh, rules, num_micro_batches, chunk_size)
    out = []
    for q in (0, 3):
        fresh = jax.tree.map(lambda x: x.copy(), params)  # the step donates its inputs
        opt_state = init_opt_state(optimizer, model_cfg, fresh, mesh, rules)
        updated, _, _ = update_on_batch(step, fresh, opt_state, batch, [(batch["advantages"] * masks[q], masks[q])],
                                        rows)
        out.append(mean_probs(updated) - before)
    return np.stack(out)
