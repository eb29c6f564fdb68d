"""The jitted, sharded policy update: one optimizer step per mini-batch.

    opt = make_optimizer(OptimConfig(lr=1e-6))
    opt_state = init_opt_state(opt, model_cfg, params, mesh)
    step = make_train_step(model_cfg, LossConfig(), opt, mesh, num_micro_batches=4)
    params, opt_state, metrics = step(params, opt_state, mini_batch)

``mini_batch`` is a dict of [M, T] arrays aligned with ``input_ids`` (see ``BATCH_KEYS``):
input_ids int32, attention_mask int32, response_mask (1 on response tokens), old_logprobs
f32, advantages f32 (token-level: estimator, weighting and Lopti mask already applied),
loss_mask f32 (the pass's tokens, where KL/entropy apply; the response mask without
Lopti), and ref_logprobs f32 when ``loss_cfg.kl_coef != 0`` (from ``make_compute_logprobs``
with the reference params, once per rollout batch; never computed otherwise).

Inside one jit (params and optimizer state donated, explicit in/out shardings): the
mini-batch is cut into ``num_micro_batches`` micro-batches (micro-batch j = rows j, j + k,
j + 2k, ...: with the batch sharded over data x fsdp each device keeps its own rows), a
``lax.scan`` accumulates their gradients, each micro-batch's loss being its sum divided by
the mini-batch-global denominator (see ``losses``) so the accumulated gradient is exactly
that of the whole mini-batch. Then global-norm clipping and AdamW. The step compiles once
per mini-batch shape.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from arlopti_jax import sharding as shd
from arlopti_jax.algos.losses import LossConfig, loss_denominator, policy_loss
from arlopti_jax.models import ModelConfig, abstract_params, param_shardings, token_logprobs

Array = jax.Array
BATCH_KEYS = ("input_ids", "attention_mask", "response_mask", "old_logprobs", "advantages", "loss_mask")
SCHEDULES = ("constant", "warmup_cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping (grad_clip <= 0 disables it). schedule: ``constant``
    (linear warm-up from 0 over warmup_steps, then lr) or ``warmup_cosine`` (warm-up, then
    cosine decay to lr * min_lr_ratio at total_steps). Steps count optimizer steps: with
    Lopti there are two per mini-batch. Weight decay applies to every parameter, as
    torch.optim.AdamW in the reference."""

    lr: float = 1e-6
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.01
    eps: float = 1e-8
    grad_clip: float = 1.0
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.lr < 0:
            raise ValueError(f"OptimConfig.lr={self.lr}: must be >= 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimConfig.schedule={self.schedule!r}: allowed {list(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps={self.warmup_steps}: must be >= 0")
        if self.schedule == "warmup_cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"OptimConfig.total_steps={self.total_steps}: warmup_cosine needs "
                             f"total_steps > warmup_steps={self.warmup_steps}")


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup_steps, cfg.total_steps,
                                                  end_value=cfg.lr * cfg.min_lr_ratio)
    if cfg.warmup_steps == 0:
        return optax.constant_schedule(cfg.lr)
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps),
                                 optax.constant_schedule(cfg.lr)], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip_by_global_norm -> AdamW; the learning rate is an injected hyperparameter so the
    step can report it (``current_lr``)."""
    adamw = optax.inject_hyperparams(optax.adamw)(
        learning_rate=make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    return optax.chain(clip, adamw)


def current_lr(opt_state) -> Array:
    """The learning rate of the last update (NaN for an optimizer without injected lr)."""
    kind = optax.InjectStatefulHyperparamsState
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind)):
        if isinstance(s, kind) and "learning_rate" in s.hyperparams:
            return jnp.asarray(s.hyperparams["learning_rate"], jnp.float32)
    return jnp.asarray(jnp.nan, jnp.float32)


def opt_state_shardings(optimizer: optax.GradientTransformation, model_cfg: ModelConfig, mesh,
                        rules=shd.DEFAULT_RULES):
    """Shardings of the optimizer state: moments like their parameter, scalars replicated."""
    abstract = jax.eval_shape(optimizer.init, abstract_params(model_cfg))
    return optax.tree_map_params(optimizer, lambda _, sh: sh, abstract, param_shardings(model_cfg, mesh, rules),
                                 transform_non_params=lambda _: shd.replicated(mesh))


@functools.lru_cache(maxsize=16)
def _jitted_init(optimizer, model_cfg, mesh, rules):
    return jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, model_cfg, mesh, rules))


def init_opt_state(optimizer: optax.GradientTransformation, model_cfg: ModelConfig, params, mesh,
                   rules=shd.DEFAULT_RULES):
    """A fresh optimizer state created directly in its shardings."""
    return _jitted_init(optimizer, model_cfg, mesh, rules)(params)


def split_micro_batches(x: Array, k: int, mesh) -> Array:
    """[M, ...] -> [k, M / k, ...] with micro-batch j = rows j, j + k, ... (device-local)."""
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    spec = P(None, shd.BATCH_AXES, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def merge_micro_batches(x: Array) -> Array:
    """Inverse of ``split_micro_batches``."""
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def check_batch(batch: dict, keys: tuple[str, ...], rows_multiple: int) -> dict:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"train batch is missing {missing} (needs {list(keys)})")
    rows = batch[keys[0]].shape[0]
    if rows % rows_multiple:
        raise ValueError(f"mini-batch of {rows} rows: must be a multiple of {rows_multiple} "
                         "(num_micro_batches x data x fsdp devices)")
    return {k: batch[k] for k in keys}


def make_grad_fn(model_cfg: ModelConfig, loss_cfg: LossConfig, mesh, rules=shd.DEFAULT_RULES,
                 num_micro_batches: int = 1, chunk_size: int = 256):
    """Traceable ``grads(params, batch) -> (grads, metrics)``: the exact mini-batch gradient
    accumulated over micro-batches, and the loss metrics (token means over the mini-batch).
    Call it inside ``jit`` under ``sharding.activate(mesh, rules)``."""
    k = num_micro_batches
    p_sh = param_shardings(model_cfg, mesh, rules)

    def micro_loss(params, mb, denom):
        logp, ent = token_logprobs(model_cfg, params, mb["input_ids"], mb["attention_mask"],
                                   temperature=loss_cfg.temperature, chunk_size=chunk_size)
        return policy_loss(loss_cfg, logp, ent, mb, denom)

    def grads_fn(params, batch):
        denom = loss_denominator(batch["response_mask"], loss_cfg.agg)
        n_tok = jnp.maximum(batch["response_mask"].astype(jnp.float32).sum(), 1.0)
        micro = {name: split_micro_batches(x, k, mesh) for name, x in batch.items()}
        vg = jax.value_and_grad(micro_loss, has_aux=True)
        stats_shape = jax.eval_shape(lambda: micro_loss(params, jax.tree.map(lambda x: x[0], micro), denom)[1])
        init_stats = {n: jnp.full(s.shape, -jnp.inf if n == "ratio_max" else 0.0, s.dtype)
                      for n, s in stats_shape.items()}
        init_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        init = (jax.lax.with_sharding_constraint(init_grads, p_sh), init_stats)

        def body(carry, mb):
            g_acc, s_acc = carry
            (_, stats), g = vg(params, mb, denom)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            s_acc = {n: jnp.maximum(s_acc[n], v) if n == "ratio_max" else s_acc[n] + v for n, v in stats.items()}
            return (jax.lax.with_sharding_constraint(g_acc, p_sh), s_acc), None

        (grads, s), _ = jax.lax.scan(body, init, micro)
        metrics = {n: s[n] for n in ("loss", "pg_loss", "entropy_loss", "ratio_max")}
        for name in ("entropy", "ppo_kl", "clipfrac_low", "clipfrac_high", "dual_clipfrac"):
            metrics[name] = s[f"{name}_sum"] / n_tok
        metrics["ratio_mean"] = s["ratio_sum"] / n_tok
        if loss_cfg.use_kl:
            metrics["kl_loss"] = s["kl_loss"]
            metrics["kl"] = s["kl_sum"] / n_tok
        metrics["n_tokens"] = n_tok
        metrics["grad_norm"] = optax.tree.norm(grads)
        # accumulated in f32; handed to the optimizer in the params' dtype so its state keeps its dtype
        return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), metrics

    return grads_fn


class TrainStep:
    """``step(params, opt_state, batch) -> (params, opt_state, metrics)``; see module doc.
    The caller's ``params``/``opt_state`` are donated (invalid after the call)."""

    def __init__(self, model_cfg: ModelConfig, loss_cfg: LossConfig, optimizer: optax.GradientTransformation,
                 mesh, rules=shd.DEFAULT_RULES, num_micro_batches: int = 1, chunk_size: int = 256):
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches={num_micro_batches}: must be >= 1")
        self.mesh, self.rules, self.loss_cfg = mesh, rules, loss_cfg
        self.num_micro_batches = num_micro_batches
        self.keys = BATCH_KEYS + (("ref_logprobs",) if loss_cfg.use_kl else ())
        self.batch_sharding = shd.batch_sharding(mesh, 2)
        grads_fn = make_grad_fn(model_cfg, loss_cfg, mesh, rules, num_micro_batches, chunk_size)
        p_sh = param_shardings(model_cfg, mesh, rules)
        o_sh = opt_state_shardings(optimizer, model_cfg, mesh, rules)

        def step(params, opt_state, batch):
            grads, metrics = grads_fn(params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            metrics["lr"] = current_lr(opt_state)
            return params, opt_state, metrics

        self._jitted = jax.jit(step, in_shardings=(p_sh, o_sh, self.batch_sharding),
                               out_shardings=(p_sh, o_sh, shd.replicated(mesh)), donate_argnums=(0, 1))

    def __call__(self, params, opt_state, batch: dict[str, Any]):
        rows = self.num_micro_batches * shd.batch_divisor(self.mesh)
        batch = jax.device_put(check_batch(batch, self.keys, rows), self.batch_sharding)
        with shd.activate(self.mesh, self.rules):
            return self._jitted(params, opt_state, batch)

    def num_compilations(self) -> int:
        """How many shapes this step has been compiled for."""
        return self._jitted._cache_size()


def make_train_step(model_cfg: ModelConfig, loss_cfg: LossConfig, optimizer: optax.GradientTransformation,
                    mesh, rules=shd.DEFAULT_RULES, num_micro_batches: int = 1, chunk_size: int = 256) -> TrainStep:
    return TrainStep(model_cfg, loss_cfg, optimizer, mesh, rules, num_micro_batches, chunk_size)


def make_compute_logprobs(model_cfg: ModelConfig, mesh, rules=shd.DEFAULT_RULES, *, temperature: float = 1.0,
                          num_micro_batches: int = 1, chunk_size: int = 256):
    """Jitted ``compute_logprobs(params, batch) -> logp [B, T]`` (f32, aligned with input_ids,
    column 0 = 0) from ``batch['input_ids']`` and ``batch['attention_mask']``, in
    ``num_micro_batches`` sequential pieces. Use it with the reference params for
    ``ref_logprobs`` (only when kl_coef != 0) and with the policy params to recompute
    ``old_logprobs``."""
    p_sh = param_shardings(model_cfg, mesh, rules)
    b_sh = shd.batch_sharding(mesh, 2)
    k = num_micro_batches

    def fn(params, input_ids, attention_mask):
        def one(xs):
            return token_logprobs(model_cfg, params, *xs, temperature=temperature, chunk_size=chunk_size)[0]
        xs = (split_micro_batches(input_ids, k, mesh), split_micro_batches(attention_mask, k, mesh))
        return merge_micro_batches(jax.lax.map(one, xs))

    jitted = jax.jit(fn, in_shardings=(p_sh, b_sh, b_sh), out_shardings=b_sh)

    def compute_logprobs(params, batch: dict[str, Any]) -> Array:
        ids, mask = jax.device_put((batch["input_ids"], batch["attention_mask"]), b_sh)
        if ids.shape[0] % (k * shd.batch_divisor(mesh)):
            raise ValueError(f"batch of {ids.shape[0]} rows: must be a multiple of "
                             f"{k * shd.batch_divisor(mesh)} (num_micro_batches x data x fsdp)")
        with shd.activate(mesh, rules):
            return jitted(params, ids, mask)

    compute_logprobs.jitted = jitted
    return compute_logprobs


# ---- one rollout batch: every pass over every mini-batch ----

@functools.lru_cache(maxsize=8)
def _row_taker(sharding: NamedSharding):
    return jax.jit(lambda tree, idx: jax.tree.map(lambda x: jnp.take(x, idx, axis=0), tree), out_shardings=sharding)


def _reduce_metrics(per_step: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for name in per_step[0]:
        values = np.asarray([m[name] for m in per_step], np.float64)
        out[name] = float(values.max() if name == "ratio_max" else values.mean())
    out["optimizer_steps"] = float(len(per_step))
    return out


def update_on_batch(step: TrainStep, params, opt_state, batch: dict[str, Any],
                    passes: Sequence[tuple[Array, Array]], mini_batch_size: int, *, shuffle_key=None):
    """Update on one rollout batch: for each pass of ``prepare_updates`` (1, or 2 with Lopti),
    in order, one optimizer step per mini-batch over the whole batch. pi_old
    (``batch['old_logprobs']``) is the sampling policy's throughout: not recomputed between
    passes. Mini-batches are taken in row order, or in a permutation drawn from
    ``fold_in(shuffle_key, pass_index)``.

    batch: [B, T] rollout arrays ``input_ids``, ``attention_mask``, ``response_mask``,
    ``old_logprobs`` (+ ``ref_logprobs`` when the KL is on); B a multiple of mini_batch_size.
    Returns ``(params, opt_state, [metrics of pass 0, metrics of pass 1, ...])``, each the mean
    over the pass's optimizer steps (``ratio_max``: the max), as Python floats.
    """
    rows = batch["input_ids"].shape[0]
    if rows % mini_batch_size:
        raise ValueError(f"rollout batch of {rows} rows is not a multiple of mini_batch_size={mini_batch_size}")
    take = _row_taker(step.batch_sharding)
    results = []
    for i, (advantages, loss_mask) in enumerate(passes):
        full = {**batch, "advantages": advantages, "loss_mask": loss_mask}
        full = jax.device_put(check_batch(full, step.keys, 1), step.batch_sharding)
        order = np.arange(rows) if shuffle_key is None else np.asarray(
            jax.random.permutation(jax.random.fold_in(shuffle_key, i), rows))
        per_step = []
        for j in range(rows // mini_batch_size):
            mini = take(full, jnp.asarray(order[j * mini_batch_size:(j + 1) * mini_batch_size]))
            params, opt_state, metrics = step(params, opt_state, mini)
            per_step.append(metrics)
        results.append(_reduce_metrics(jax.device_get(per_step)))
    return params, opt_state, results
