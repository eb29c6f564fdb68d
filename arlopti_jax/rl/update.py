"""Steps 3-5 of an RL step, as a task of the sampling loop's turns: a sampled batch -> pi_old and the
reference's log-probs -> advantages, token weights and the Lopti split -> the update's programs,
dispatched.

    updater = Updater(run, config, ref_params, recompute, timer)
    task = Task("update", updater.steps(params, opt_state, step_batch, step), timer)
    run_together(task, sampling_loop.ahead(step))        # the sampler's programs between the update's
    update = task.value; params, opt_state = update.params, update.opt_state
    metrics = update.finish()                              # waits for the update, then its records

``steps`` yields once: after dispatching the log-prob passes (pi_old recomputed by the trainer, the
frozen reference's for the KL), before reading them back to pack the update, so that the sampler's
first programs go to its devices meanwhile. Everything after is dispatched without waiting: the
update's metrics are read by ``finish``, at the step's end.

pi_old is the trainer's own teacher-forced pass (``recompute``) wherever the sampler's log-probs can
differ from it: the batch sampled by an older version (``rollout.max_staleness`` >= 1), the sampler on
devices of its own or reading weights in another dtype than the trainer's, or
``rollout.recompute_old_logprobs``. The sampler's log-probs are then the behaviour policy's: the
off-policy correction (``rollout.correction``) reweights by their ratio, and ``offpolicy/*`` records
how far apart the two are (``algos/off_policy.py``), checked against ``rollout.max_kl``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from arlopti_jax import algos
from arlopti_jax.rl import run_setup
from arlopti_jax.runtime import distributed as dist


class MismatchError(RuntimeError):
    """The sampler's log-probs are farther from the trainer's pi_old than ``rollout.max_kl`` allows."""


def recompute_old_logprobs(config, model_cfg, sampler_mesh) -> bool:
    """Whether pi_old is the trainer's own pass rather than the sampler's log-probs (module docstring)."""
    cast = not model_cfg.lora_rank and model_cfg.compute_dtype != model_cfg.weight_dtype
    return bool(config.rollout.recompute_old_logprobs or config.rollout.max_staleness >= 1
                or sampler_mesh is not None or cast)


def update_metrics(pass_metrics: list[dict], lopti: algos.LoptiConfig, epochs: int = 1) -> dict[str, float]:
    """``update/[low/|high/]NAME`` per pass (in the passes' order: a negative eta runs high first)
    over every epoch: the mean over its optimizer steps, ``ratio_max`` the max, ``optimizer_steps``
    the sum; with ``epochs`` > 1 also each epoch's, ``update/epochK/[low/|high/]NAME`` (K from 1).
    ``pass_metrics``: ``update_on_batch``'s, epoch-major."""
    names = (("low", "high") if lopti.low_first else ("high", "low")) if lopti.enabled else ("",)
    out = {}
    for i, name in enumerate(names):
        per_epoch = pass_metrics[i::len(names)]
        part = f"{name}/" if name else ""
        if epochs > 1:
            for k, metrics in enumerate(per_epoch, 1):
                out.update({f"update/epoch{k}/{part}{m}": v for m, v in metrics.items()})
            reduce = {"ratio_max": max, "optimizer_steps": sum}
            merged = {m: float(reduce.get(m, np.mean)([e[m] for e in per_epoch])) for m in per_epoch[0]}
        else:
            merged = per_epoch[0]
        out.update({f"update/{part}{m}": v for m, v in merged.items()})
    return out


def quartile_metrics(batch, advantages) -> dict[str, float]:
    q = {k: np.asarray(v) for k, v in algos.probability_quartiles(batch["old_logprobs"], advantages,
                                                                   batch["response_mask"]).items()}
    out = {}
    for i in range(4):
        out[f"quartile/q{i + 1}_mean_prob"] = float(q["mean_prob"][i])
        out[f"quartile/q{i + 1}_mean_abs_adv"] = float(q["mean_abs_adv"][i])
        out[f"quartile/q{i + 1}_tokens"] = float(q["count"][i])
    return out


@dataclasses.dataclass
class Update:
    """One step's update, dispatched (``Updater.steps``). ``params``, ``opt_state``: the updated state
    (arrays still being computed); ``batch``: the host arrays it trained on (pi_old the trainer's where
    recomputed); ``behaviour``: the sampler's log-probs; ``passes``: the update passes
    (advantages, loss mask); ``pending``: waits for the update and gives its per-pass metrics."""

    params: object
    opt_state: object
    batch: dict
    behaviour: np.ndarray
    passes: tuple
    pending: Callable[[], list]
    diagnostics: dict
    mark: int  # the train step's ``processed`` count before this update (what it packed: ``processed_since``)

    def finish(self, updater: "Updater") -> dict[str, float]:
        """Wait for the update; its metrics (``update/*``, ``offpolicy/*``, ``quartile/*``), as floats.
        MismatchError where the behaviour policy is farther from pi_old than ``rollout.max_kl``."""
        with updater.timer("update"):
            per_pass = self.pending()
        out = {**update_metrics(per_pass, updater.run.lopti_cfg, updater.config.train.ppo_epochs),
               **quartile_metrics(self.batch, sum(np.asarray(dist.to_host(a)) for a, _ in self.passes)),
               **self.diagnostics}
        if updater.recompute:
            mismatch = algos.mismatch_metrics(updater.correction, self.batch["old_logprobs"], self.behaviour,
                                              self.batch["response_mask"])
            out.update(mismatch)
        return out


class Updater:
    """Steps 3-5 for ``run`` (``run_setup.Run``): ``ref_params`` the frozen reference policy's
    (None without the KL), ``recompute`` whether pi_old is the trainer's pass
    (``recompute_old_logprobs``), ``timer`` the loop's (phases ``logprobs``, ``diagnostics``,
    ``update``)."""

    def __init__(self, run, config, ref_params, recompute: bool, timer, grad_norms_fn=None):
        self.run, self.config, self.ref_params, self.recompute, self.timer = run, config, ref_params, recompute, timer
        self.correction = algos.CorrectionConfig(kind=config.rollout.correction, tis_cap=config.rollout.tis_cap,
                                                 seq_mask_bound=config.rollout.seq_mask_bound)
        self.grad_norms_fn = grad_norms_fn

    def steps(self, params, opt_state, step_batch, step: int, diagnose: bool = False):
        """The update of ``step_batch`` (``collect.StepBatch``) dispatched; a generator that yields once,
        after the log-prob passes are dispatched, and returns the ``Update``. ``diagnose``: the paper's
        Figure-1 gradient norms on this batch, before the update (``train.diagnostics_every``)."""
        run, config = self.run, self.config
        batch = {k: dist.to_host(v) for k, v in step_batch.batch.items()}
        rewards, group_ids = dist.to_host(step_batch.rewards), dist.to_host(step_batch.group_ids)
        behaviour = batch["old_logprobs"]  # the sampler's log-probs
        entropy = bool(run.weight_cfg.entropy_top_fraction)  # pi_old's entropy, for the high-entropy selection
        with self.timer("logprobs"):
            old = run.logprobs.dispatch(params, batch, with_entropy=entropy) if self.recompute or entropy else None
            ref = run.logprobs.dispatch(self.ref_params, batch) if run.use_reference else None
        yield  # the passes are dispatched: the sampler's programs go next
        entropies = None
        with self.timer("logprobs"):
            if old is not None:
                got = old()
                old_logprobs, entropies = got if entropy else (got, None)
                if self.recompute:
                    batch["old_logprobs"] = old_logprobs
            if ref is not None:
                batch["ref_logprobs"] = ref()
        # advantages, token weights (AR / TR, the entropy selection) and the Lopti split, as update
        # passes: all read pi_old; then the off-policy correction of the policy-gradient term
        passes = algos.prepare_updates(run.adv_cfg, run.weight_cfg, run.lopti_cfg, rewards, group_ids,
                                       batch["response_mask"], batch["old_logprobs"], entropies)
        if self.recompute and self.correction.enabled:
            passes = algos.correct_passes(passes, algos.correction_weights(
                self.correction, batch["old_logprobs"], behaviour, batch["response_mask"]))
        diagnostics = {}
        if diagnose:  # the paper's Figure 1, before the update
            with self.timer("diagnostics"):
                rows = config.train.get("diagnostics_rows", 0)  # 0: the first mini-batch; -1: every row
                rows = config.train.mini_batch if rows == 0 else len(batch["input_ids"]) if rows < 0 else rows
                diagnostics = algos.quartile_grad_norm_metrics(self.grad_norms_fn, params, batch, passes, rows)
                if step == 0 and config.train.isolation_experiment:  # and once, on the first batch
                    diagnostics.update(isolation_metrics(run, params, batch, passes))
        # the policy update(s): one pass, or Lopti's low- then high-probability pass, train.ppo_epochs
        # times over the batch (pi_old the same throughout), dispatched without waiting
        mark = len(run.train_step.processed)
        with self.timer("update"):
            params, opt_state, pending = algos.update_on_batch(
                run.train_step, params, opt_state, batch, passes, config.train.mini_batch,
                epochs=config.train.ppo_epochs, wait=False)
        return Update(params, opt_state, batch, behaviour, passes, pending, diagnostics, mark)


def isolation_metrics(run: run_setup.Run, params, batch, passes) -> dict:
    """``isolation/{low,high}_q{1..4}``: the change of each pi_old quartile's mean probability
    after one optimizer step (fresh AdamW state at the configured peak learning rate: a
    schedule's first step may be 0) on only the lowest (low) or only the highest (high)
    quartile's tokens of ``batch``, with the step's full weighted advantages."""
    peak = dataclasses.replace(run_setup.optim_config(run.config, run.total_steps), schedule="constant",
                               warmup_steps=0)
    optimizer = algos.make_optimizer(peak)
    step = algos.make_train_step(run.model_cfg, run.loss_cfg, optimizer, run.mesh,
                                 tokens_per_device=run.tokens_per_device, chunk_size=run.config.model.logprob_chunk,
                                 shared_prefix=run.train_step.shared_prefix)
    full = {**batch, "advantages": sum(dist.to_host(a) for a, _ in passes)}
    change = algos.isolation_experiment(
        step, run.logprobs, lambda p: algos.init_opt_state(optimizer, run.model_cfg, p, run.mesh), params, full)
    return {f"isolation/{case}_q{q + 1}": float(change[i, q]) for i, case in enumerate(("low", "high"))
            for q in range(4)}
