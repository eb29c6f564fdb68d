"""The sampler's semantics without a KV cache or a decode loop, for tests to compare against.

Each response position runs the whole sequence so far through the model (``models.logits``:
the training passes' forward, with ``unroll_layers`` straight-line layers) and draws with
``sample_tokens``, the noise of global row r = i * n + j at position t: the tokens and
log-probs ``Sampler.generate`` must give, dense or length-aware, on any mesh.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax.models import logits as model_logits
from arlopti_jax.rollout import SamplingConfig, bucket, sample_tokens


@functools.partial(jax.jit, static_argnums=0)
def _next_logits(cfg, params, ids, mask, index):
    return model_logits(cfg, params, ids, mask)[:, index]


def reference_generate(cfg, params, prompts, n: int, key, sampling: SamplingConfig, stop_at=None):
    """(tokens, log-probs, response mask) [len(prompts) * n, R] as numpy arrays."""
    cfg = dataclasses.replace(cfg, unroll_layers=True)
    r = sampling.max_response_len
    width = bucket(max(map(len, prompts)), sampling.prompt_bucket)
    rows = len(prompts) * n
    ids = np.full((rows, width + r), sampling.pad_id, np.int32)
    mask = np.ones((rows, width + r), np.int32)  # the response slots all count, as in the sampler's cache
    for i, p in enumerate(prompts):
        ids[i * n:(i + 1) * n, width - len(p):width] = p
        mask[i * n:(i + 1) * n, :width - len(p)] = 0
    stop_at = np.full(rows, r + 1) if stop_at is None else np.asarray(stop_at)
    logprobs, out_mask = np.zeros((rows, r), np.float32), np.zeros((rows, r), np.int32)
    finished = np.zeros(rows, bool)
    temperature, top_p = jnp.float32(sampling.temperature), jnp.float32(sampling.top_p)
    for t in range(r):
        logits = _next_logits(cfg, params, jnp.asarray(ids), jnp.asarray(mask), width + t - 1)
        forced = jnp.asarray(np.where(t + 1 >= stop_at, sampling.eos_ids[0] if sampling.eos_ids else -1, -1))
        tok, lp = sample_tokens(logits, key, t, jnp.arange(rows, dtype=jnp.int32), temperature, top_p,
                                top_k=sampling.top_k, use_top_p=sampling.top_p < 1.0, greedy=sampling.greedy,
                                forced=forced)
        tok, lp = np.asarray(tok), np.asarray(lp)
        ids[:, width + t] = np.where(finished, sampling.pad_id, tok)
        logprobs[:, t] = np.where(finished, 0.0, lp)
        out_mask[:, t] = ~finished
        finished |= np.isin(tok, sampling.eos_ids) & ~finished
    return ids[:, width:], logprobs, out_mask
