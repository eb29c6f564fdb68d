"""The jitted, sharded policy update: one optimizer step per mini-batch, on packed rows.

    opt = make_optimizer(OptimConfig(lr=1e-6))
    opt_state = init_opt_state(opt, model_cfg, params, mesh)
    shapes = packing.shapes_for(4096, longest=1024)  # sequences of at most 1024 tokens
    step = make_train_step(model_cfg, LossConfig(), opt, mesh, tokens_per_device=4096, shapes=shapes)
    params, opt_state, metrics = step(params, opt_state, mini_batch)

``mini_batch`` is a dict of dense [M, T] host arrays aligned with ``input_ids`` (see
``BATCH_KEYS``): input_ids, attention_mask (each row's tokens contiguous: a left-padded prompt
and a right-padded response), response_mask (1 on response tokens), old_logprobs,
advantages (token-level: estimator, weighting and Lopti mask already applied), loss_mask (the
pass's tokens, where KL/entropy apply; the response mask without Lopti), and ref_logprobs
when ``loss_cfg.kl_coef != 0`` (``make_compute_logprobs`` with the reference params, once per
rollout batch).

Cost follows the real tokens (``packing``): the mini-batch's sequences are packed into
micro-batches of ``tokens_per_device`` tokens per data x fsdp device, in rows of the lengths
``shapes`` allows (the trainer's, ``rl/run_setup.pack_shapes``: up to twice the longest possible
sequence; without ``shapes``, up to the whole budget, which costs attention over long rows); the
model runs on the packed rows (attention within each sequence) and the loss only at response
positions. With ``shared_prefix`` (the
default; ``train.shared_prefix``) the responses of one prompt that share a row share one copy of
the prompt: a GRPO group of n costs P + n x R tokens instead of n x (P + R), with the same
log-probs and gradients to float rounding (``packing``'s docstring). For each micro-batch a jitted
function adds its gradient to an accumulator
(donated, sharded like the params); a second one clips, applies AdamW and reports the
metrics. Each token's loss carries its mini-batch aggregation weight
(``losses.aggregation_weights``), so the accumulated gradient is exactly the whole
mini-batch's, however its sequences were packed. The functions compile once per packed shape of
the run's ``packing.Shapes`` (row lengths x row counts, fixed by the config before the first
step: ``shapes.all()``), whatever the lengths of the responses.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from arlopti_jax.runtime import compiles
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.algos import packing
from arlopti_jax.algos.losses import LossConfig, aggregation_weights, policy_loss, sequence_ids
from arlopti_jax.models import lora
from arlopti_jax.models import ModelConfig, abstract_params, packed_hidden_states, param_shardings, target_logprobs
from arlopti_jax.models.policy import unembed_matrix

Array = jax.Array
BATCH_KEYS = ("input_ids", "attention_mask", "response_mask", "old_logprobs", "advantages", "loss_mask")
TARGET_KEYS = ("old_logprobs", "advantages", "loss_mask", "response_mask", "agg_weight")  # + ref_logprobs
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


_tree_norm = jax.jit(optax.tree.norm)  # the diagnostics' global norm: one program, not one per leaf op


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
    abstract = jax.eval_shape(optimizer.init, lora.trainable(model_cfg, abstract_params(model_cfg))[0])
    shardings = lora.trainable(model_cfg, param_shardings(model_cfg, mesh, rules))[0]
    out = []

    def traced():  # optax runs ``init`` on placeholders: traced here, its schedule compiles no eager programs
        out.append(optax.tree_map_params(optimizer, lambda _, sh: sh, abstract, shardings,
                                         transform_non_params=lambda _: shd.replicated(mesh)))
        return 0

    jax.eval_shape(traced)
    return out[0]


@functools.lru_cache(maxsize=16)
def _jitted_init(optimizer, model_cfg, mesh, rules):
    return jax.jit(optimizer.init, out_shardings=opt_state_shardings(optimizer, model_cfg, mesh, rules))


def init_opt_state(optimizer: optax.GradientTransformation, model_cfg: ModelConfig, params, mesh,
                   rules=shd.DEFAULT_RULES):
    """A fresh optimizer state created directly in its shardings, for the trained part of ``params``
    (the adapters alone with LoRA)."""
    return _jitted_init(optimizer, model_cfg, mesh, rules)(lora.trainable(model_cfg, params)[0])


def _dense_host(batch: dict[str, Any], keys: Sequence[str]) -> dict[str, np.ndarray]:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"train batch is missing {missing} (needs {list(keys)})")
    return {k: dist.to_host(batch[k]) for k in keys}


class PackedModel:
    """Forward passes of one packed micro-batch (``packing.gather`` arrays on device):
    per-target log-probs and entropies [D, K] (each device's target list)."""

    def __init__(self, model_cfg: ModelConfig, temperature: float, chunk_size: int):
        self.cfg, self.temperature, self.chunk_size = model_cfg, temperature, chunk_size

    def __call__(self, params, mb: dict[str, Array], entropy_grad: bool = True):
        hidden = packed_hidden_states(self.cfg, params, mb["input_ids"], mb["positions"], mb["segment_ids"],
                                      mb.get("prefix_ids"))
        return target_logprobs(unembed_matrix(self.cfg, params), hidden, mb["target_pos"], mb["target_ids"],
                               mb["target_mask"], self.temperature, self.chunk_size, entropy_grad=entropy_grad,
                               softcap=self.cfg.final_logit_softcapping)


class PackedPrograms:
    """One packed pass's compiled programs, one per shape of the run's ``packing.Shapes``.

    ``programs(*args, arrays)`` runs ``jitted`` on a packed micro-batch's ``arrays`` (the last
    argument). Its first call compiles the pass for every shape of the set at once, from the
    arguments it was given (their shapes, dtypes and shardings) and ``empty_arrays`` of each shape
    (gathered from the call's ``tokens`` and ``targets`` like a real one): lowered one after another, and
    compiled in parallel threads (XLA compiles outside Python's lock) or loaded from the persistent
    compilation cache. Later calls dispatch to those executables by shape, so no batch compiles a
    program, whatever the lengths of its responses; a shape outside the set would go through
    ``jitted`` (and be logged by ``runtime.compiles`` after the warm-up)."""

    def __init__(self, jitted, shapes: packing.Shapes, num_devices: int, row_sharding):
        self.jitted, self.shapes, self.num_devices, self.row_sharding = jitted, shapes, num_devices, row_sharding
        self.compiled: dict[tuple, Any] = {}

    def keys(self) -> list[tuple[int, int]]:
        """The [rows, length] of every micro-batch shape (all devices' rows)."""
        return [(rows * self.num_devices, length) for length, rows in self.shapes.all()]

    def empty_arrays(self, rows: int, length: int, tokens: dict, targets: dict) -> dict[str, np.ndarray]:
        """The host arrays of an empty micro-batch of ``rows`` (all devices) x ``length``, gathered
        from the dense ``tokens`` and ``targets`` as a real one is: what each shape compiles from
        (``aot`` compiles from them too)."""
        return packing.gather(packing.empty(length, rows, self.num_devices), tokens, targets)

    def warm_up(self, args: tuple, tokens: dict, targets: dict) -> None:
        spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
        fixed = jax.tree.map(spec, args)
        log, name = compiles.watch(), f"jit({self.jitted.__name__})"
        lowered = {}
        for rows, length in self.keys():
            arrays = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.row_sharding)
                      for k, v in self.empty_arrays(rows, length, tokens, targets).items()}
            lowered[(rows, length)] = (self.jitted.lower(*fixed, arrays), log.lowered(name))

        def compile_one(item):
            low, shapes = item
            with log.compiling(shapes):  # compiled on another thread, in any order: named by its shapes
                return low.compile()

        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
            done = dict(zip(lowered, pool.map(compile_one, lowered.values())))
        self.compiled.update(done)

    def __call__(self, *args, tokens: dict, targets: dict):
        """``tokens`` and ``targets``: the dense host arrays ``arrays`` was gathered from."""
        *fixed, arrays = args
        if not self.compiled:
            self.warm_up(tuple(fixed), tokens, targets)
        program = self.compiled.get(tuple(arrays["input_ids"].shape), self.jitted)
        return program(*fixed, arrays)


def _stat_names(use_kl: bool) -> tuple[str, ...]:
    names = ("loss", "pg_loss", "entropy_loss", "entropy_sum", "ppo_kl_sum", "ratio_sum", "ratio_max",
             "clipfrac_low_sum", "clipfrac_high_sum", "dual_clipfrac_sum")
    return names + (("kl_loss", "kl_sum") if use_kl else ())


def _finish_metrics(stats: dict[str, Array], n_tok: Array, use_kl: bool) -> dict[str, Array]:
    metrics = {n: stats[n] for n in ("loss", "pg_loss", "entropy_loss", "ratio_max")}
    for name in ("entropy", "ppo_kl", "clipfrac_low", "clipfrac_high", "dual_clipfrac"):
        metrics[name] = stats[f"{name}_sum"] / n_tok
    metrics["ratio_mean"] = stats["ratio_sum"] / n_tok
    if use_kl:
        metrics["kl_loss"] = stats["kl_loss"]
        metrics["kl"] = stats["kl_sum"] / n_tok
    metrics["n_tokens"] = n_tok
    return metrics


class TrainStep:
    """``step(params, opt_state, mini_batch) -> (params, opt_state, metrics)``; see the module
    docstring. The caller's ``params``/``opt_state`` are donated (invalid after the call).
    ``tokens_per_device`` (per micro-batch) must hold the longest prompt + response.
    ``shared_prefix``: responses of one prompt share its tokens in the packed rows."""

    def __init__(self, model_cfg: ModelConfig, loss_cfg: LossConfig, optimizer: optax.GradientTransformation,
                 mesh, rules=shd.DEFAULT_RULES, *, tokens_per_device: int, chunk_size: int = 256,
                 shared_prefix: bool = True, shapes: packing.Shapes | None = None):
        if tokens_per_device < 2:
            raise ValueError(f"tokens_per_device={tokens_per_device}: must be >= 2")
        self.mesh, self.rules, self.loss_cfg = mesh, rules, loss_cfg
        self.tokens_per_device, self.num_devices = tokens_per_device, shd.batch_divisor(mesh)
        self.shapes = packing.shapes_for(tokens_per_device) if shapes is None else shapes
        self.shared_prefix = shared_prefix
        self.attention_cost = model_cfg.attention_cost_per_key()
        self.keys = BATCH_KEYS + (("ref_logprobs",) if loss_cfg.use_kl else ())
        self.row_sharding = shd.batch_sharding(mesh, 2)
        self.model = PackedModel(model_cfg, loss_cfg.temperature, chunk_size)
        self.processed: list[packing.Summary] = []  # what each call packed (trainer.py and the benchmarks read it)
        use_kl, entropy_grad = loss_cfg.use_kl, loss_cfg.entropy_coef != 0
        names = _stat_names(use_kl)
        self.model_cfg = model_cfg
        # the trained part (the adapters with LoRA, else every parameter) and the frozen one (the
        # base with LoRA: read by every program, never donated, no gradient or optimizer state)
        p_sh, f_sh = lora.trainable(model_cfg, param_shardings(model_cfg, mesh, rules))
        o_sh = opt_state_shardings(optimizer, model_cfg, mesh, rules)
        rep = shd.replicated(mesh)
        acc_sh = (p_sh, {n: rep for n in names})

        def micro_loss(params, frozen, mb):
            logp, ent = self.model(lora.whole(params, frozen), mb, entropy_grad)
            targets = {k: mb[k] for k in TARGET_KEYS + loss_cfg.target_keys}
            return policy_loss(loss_cfg, logp, ent, targets)

        def zeros(params):
            grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            return grads, {n: jnp.full((), -jnp.inf if n == "ratio_max" else 0.0, jnp.float32) for n in names}

        def accumulate(params, frozen, acc, mb):
            (_, stats), g = jax.value_and_grad(micro_loss, has_aux=True)(params, frozen, mb)
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc[0], g)
            merged = {n: jnp.maximum(acc[1][n], v) if n == "ratio_max" else acc[1][n] + v for n, v in stats.items()}
            return grads, merged

        def apply(params, opt_state, acc, n_tok):
            grads, stats = acc
            metrics = _finish_metrics(stats, n_tok, use_kl)
            metrics["grad_norm"] = optax.tree.norm(grads)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            metrics["lr"] = current_lr(opt_state)
            return params, opt_state, metrics

        self._zeros = jax.jit(zeros, in_shardings=(p_sh,), out_shardings=acc_sh)
        self._accumulate = jax.jit(accumulate, donate_argnums=(2,),
                                   in_shardings=(p_sh, f_sh, acc_sh, self.row_sharding), out_shardings=acc_sh)
        self.accumulate_programs = PackedPrograms(self._accumulate, self.shapes, self.num_devices, self.row_sharding)
        self._apply = jax.jit(apply, donate_argnums=(0, 1), in_shardings=(p_sh, o_sh, acc_sh, rep),
                              out_shardings=(p_sh, o_sh, rep))

    def plan(self, batch: dict[str, np.ndarray], rows) -> list[packing.MicroBatch]:
        return packing.plan_micro_batches(batch["attention_mask"], batch["response_mask"], rows,
                                          tokens_per_device=self.tokens_per_device, num_devices=self.num_devices,
                                          attention_cost=self.attention_cost,
                                          input_ids=batch["input_ids"] if self.shared_prefix else None,
                                          shapes=self.shapes)

    def targets(self, batch: dict[str, np.ndarray], rows) -> dict[str, np.ndarray]:
        """The dense [B, T] arrays ``packing.gather`` takes per target for the ``rows`` of a
        mini-batch: what ``_accumulate`` receives beside the packed tokens (``aot`` builds its
        abstract micro-batch from this too, so it compiles what the update runs)."""
        weight = np.zeros(batch["response_mask"].shape, np.float32)
        weight[rows] = aggregation_weights(batch["response_mask"][rows], self.loss_cfg.agg)
        targets = {k: batch[k] for k in TARGET_KEYS[:-1] + (("ref_logprobs",) if self.loss_cfg.use_kl else ())}
        targets.update(agg_weight=weight, target_ids=batch["input_ids"])
        if self.loss_cfg.ratio_level == "sequence":  # GSPO's ratio: each target's sequence
            targets["sequence_id"] = sequence_ids(weight.shape)
        return targets

    def _accumulated(self, params, batch: dict[str, np.ndarray], rows, micro_batches: list[packing.MicroBatch]):
        """(gradient accumulator, n_tokens) of the dense host ``batch``'s ``rows``, packed as ``micro_batches``."""
        rows = np.asarray(rows)
        targets = self.targets(batch, rows)
        n_tok = np.float32(max(float(batch["response_mask"][rows].sum()), 1.0))
        self.processed.append(packing.summary(micro_batches))
        tokens = {"input_ids": batch["input_ids"]}
        trained, frozen = lora.trainable(self.model_cfg, params)
        with shd.activate(self.mesh, self.rules):
            acc = self._zeros(trained)
            for mb in micro_batches:
                arrays = packing.gather(mb, tokens, targets)
                arrays = {k: shd.put(v, self.row_sharding) for k, v in arrays.items()}
                acc = self.accumulate_programs(trained, frozen, acc, arrays, tokens=tokens, targets=targets)
        return acc, n_tok

    def run(self, params, opt_state, batch: dict[str, np.ndarray], rows, micro_batches: list[packing.MicroBatch]):
        """One optimizer step on the dense host ``batch``'s ``rows``, packed as ``micro_batches``:
        the trained part of ``params`` and ``opt_state`` are donated, a LoRA base is not."""
        acc, n_tok = self._accumulated(params, batch, rows, micro_batches)
        trained, frozen = lora.trainable(self.model_cfg, params)
        with shd.activate(self.mesh, self.rules):
            trained, opt_state, metrics = self._apply(trained, opt_state, acc, n_tok)
        return lora.whole(trained, frozen), opt_state, metrics

    def gradient(self, params, batch: dict[str, Any]):
        """(gradient tree float32 of the trained part, its global norm) of the mini-batch loss;
        params are read, not donated."""
        batch = _dense_host(batch, self.keys)
        rows = np.arange(batch["input_ids"].shape[0])
        (grads, _), _ = self._accumulated(params, batch, rows, self.plan(batch, rows))
        return grads, _tree_norm(grads)

    def __call__(self, params, opt_state, batch: dict[str, Any]):
        batch = _dense_host(batch, self.keys)
        rows = np.arange(batch["input_ids"].shape[0])
        return self.run(params, opt_state, batch, rows, self.plan(batch, rows))

    def processed_since(self, mark: int) -> packing.Summary:
        """What the calls after the first ``mark`` packed, summed: ``len(self.processed)`` marks now."""
        return sum(self.processed[mark:], packing.Summary())



def make_train_step(model_cfg: ModelConfig, loss_cfg: LossConfig, optimizer: optax.GradientTransformation,
                    mesh, rules=shd.DEFAULT_RULES, *, tokens_per_device: int, chunk_size: int = 256,
                    shared_prefix: bool = True, shapes: packing.Shapes | None = None) -> TrainStep:
    return TrainStep(model_cfg, loss_cfg, optimizer, mesh, rules, tokens_per_device=tokens_per_device,
                     chunk_size=chunk_size, shared_prefix=shared_prefix, shapes=shapes)


def make_compute_logprobs(model_cfg: ModelConfig, mesh, rules=shd.DEFAULT_RULES, *, temperature: float = 1.0,
                          tokens_per_device: int, chunk_size: int = 256, shared_prefix: bool = True,
                          shapes: packing.Shapes | None = None):
    """``compute_logprobs(params, batch) -> logp`` [B, T] host float32: log pi(input_ids[:, t] |
    input_ids[:, :t]) at the response positions (``batch['response_mask']``), 0 elsewhere, from
    ``input_ids`` and ``attention_mask``, on packed rows. Use it with the reference params for
    ``ref_logprobs`` (only when kl_coef != 0) and with the policy params to recompute
    ``old_logprobs``. ``shared_prefix``: as ``TrainStep``'s. ``compute_logprobs(params, batch,
    with_entropy=True)`` returns ``(logp, entropy)``, the entropy of the temperature-scaled
    next-token distribution at each response position (pi_old's, for ``algo.entropy_top_fraction``)."""
    model = PackedModel(model_cfg, temperature, chunk_size)
    row_sharding = shd.batch_sharding(mesh, 2)
    in_shardings = (param_shardings(model_cfg, mesh, rules), row_sharding)
    def logprobs(params, mb):  # named: JAX's compile log and runtime.compiles show the name
        return model(params, mb, entropy_grad=False)[0]

    def logprobs_and_entropy(params, mb):
        return model(params, mb, entropy_grad=False)

    jitted = jax.jit(logprobs, in_shardings=in_shardings, out_shardings=shd.replicated(mesh))
    with_entropy_jitted = jax.jit(logprobs_and_entropy, in_shardings=in_shardings,
                                  out_shardings=(shd.replicated(mesh),) * 2)

    num_devices = shd.batch_divisor(mesh)
    shapes = packing.shapes_for(tokens_per_device) if shapes is None else shapes
    programs = {False: PackedPrograms(jitted, shapes, num_devices, row_sharding),
                True: PackedPrograms(with_entropy_jitted, shapes, num_devices, row_sharding)}

    def compute_logprobs(params, batch: dict[str, Any], with_entropy: bool = False):
        return dispatch(params, batch, with_entropy)()

    def dispatch(params, batch: dict[str, Any], with_entropy: bool = False):
        """``compute_logprobs`` in two halves: this dispatches the passes and returns a function that
        waits for them and gives the result, so that other programs can be dispatched between."""
        dense = _dense_host(batch, ("input_ids", "attention_mask", "response_mask"))
        ids, targets = {"input_ids": dense["input_ids"]}, {"target_ids": dense["input_ids"]}
        shape = dense["input_ids"].shape
        plan = packing.plan_micro_batches(dense["attention_mask"], dense["response_mask"], np.arange(shape[0]),
                                          tokens_per_device=tokens_per_device, num_devices=shd.batch_divisor(mesh),
                                          attention_cost=model_cfg.attention_cost_per_key(),
                                          input_ids=dense["input_ids"] if shared_prefix else None,
                                          shapes=shapes)
        compute_logprobs.processed.append(packing.summary(plan))
        values = []
        with shd.activate(mesh, rules):
            for mb in plan:
                arrays = packing.gather(mb, ids, targets)
                arrays = {k: shd.put(v, row_sharding) for k, v in arrays.items()}
                values.append(programs[with_entropy](params, arrays, tokens=ids, targets=targets))

        def result():
            got = jax.device_get(values)
            if with_entropy:
                return tuple(packing.scatter_targets(plan, [np.asarray(v[i]) for v in got], shape) for i in (0, 1))
            return packing.scatter_targets(plan, [np.asarray(v) for v in got], shape)

        return result

    compute_logprobs.dispatch = dispatch
    compute_logprobs.jitted, compute_logprobs.with_entropy_jitted = jitted, with_entropy_jitted  # aot compiles them
    compute_logprobs.processed = []  # what each call packed, as ``TrainStep.processed``
    compute_logprobs.shapes, compute_logprobs.programs = shapes, programs
    return compute_logprobs


# ---- one rollout batch: every pass over every mini-batch ----

def _reduce_metrics(per_step: list[dict[str, Any]]) -> dict[str, float]:
    out = {}
    for name in per_step[0]:
        values = np.asarray([m[name] for m in per_step], np.float64)
        out[name] = float(values.max() if name == "ratio_max" else values.mean())
    out["optimizer_steps"] = float(len(per_step))
    return out


def update_on_batch(step: TrainStep, params, opt_state, batch: dict[str, Any],
                    passes: Sequence[tuple[Array, Array]], mini_batch_size: int, *, epochs: int = 1,
                    shuffle_key=None, wait: bool = True):
    """Update on one rollout batch: ``epochs`` times (the GRPO paper's mu, ``train.ppo_epochs``),
    each pass of ``prepare_updates`` (1, or 2 with Lopti: low then high in every epoch), in
    order, one optimizer step per mini-batch over the whole batch. pi_old
    (``batch['old_logprobs']``) is the sampling policy's throughout: not recomputed between
    passes or epochs, so later epochs' ratios measure how far the policy has moved and the PPO
    clip bounds them. Mini-batches are taken in row order (the same mini-batches in every epoch,
    as verl's default ``actor.shuffle=False``), or in a permutation drawn from
    ``fold_in(shuffle_key, epoch x len(passes) + pass_index)``. Each mini-batch is packed once;
    the passes and epochs reuse the packing.

    batch: [B, T] rollout arrays ``input_ids``, ``attention_mask``, ``response_mask``,
    ``old_logprobs`` (+ ``ref_logprobs`` when the KL is on); host arrays, or global arrays
    (gathered to every process here). B a multiple of mini_batch_size.
    Returns ``(params, opt_state, metrics)``: one dict per (epoch, pass), epoch-major (epoch 0's
    passes, then epoch 1's, ...), each the mean over that pass's optimizer steps (``ratio_max``:
    the max), as Python floats.
    With ``wait=False`` nothing waits for the devices: ``metrics`` is then a function that
    waits for the passes and returns that list (the sampling loop dispatches the sampler's programs
    before calling it).
    """
    if epochs < 1:
        raise ValueError(f"epochs={epochs}: must be >= 1")
    base = _dense_host(batch, tuple(k for k in step.keys if k not in ("advantages", "loss_mask")))
    rows = base["input_ids"].shape[0]
    if rows % mini_batch_size:
        raise ValueError(f"rollout batch of {rows} rows is not a multiple of mini_batch_size={mini_batch_size}")
    fulls = [{**base, "advantages": dist.to_host(advantages), "loss_mask": dist.to_host(loss_mask)}
             for advantages, loss_mask in passes]
    plans: dict[tuple, list] = {}
    per_pass = []
    for epoch in range(epochs):
        for i, full in enumerate(fulls):
            order = np.arange(rows) if shuffle_key is None else np.asarray(
                jax.random.permutation(jax.random.fold_in(shuffle_key, epoch * len(fulls) + i), rows))
            per_step = []
            for j in range(rows // mini_batch_size):
                mini = order[j * mini_batch_size:(j + 1) * mini_batch_size]
                key = tuple(mini.tolist())
                if key not in plans:
                    plans[key] = step.plan(full, mini)
                params, opt_state, metrics = step.run(params, opt_state, full, mini, plans[key])
                per_step.append(metrics)
            per_pass.append(per_step)
    if not wait:
        return params, opt_state, lambda: [_reduce_metrics(jax.device_get(p)) for p in per_pass]
    return params, opt_state, [_reduce_metrics(jax.device_get(p)) for p in per_pass]

