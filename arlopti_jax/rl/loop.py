"""The RL trainer's loop, ``train(config)``. The command line is ``arlopti_jax.train``;
``arlopti_jax.reproduce`` calls ``train`` for each run of its sweep.

Each step, in the order the code below reads:

1. **take** the step's batch from the sampling loop (``rl/pipeline.py``): prompts, ``rollout.n``
   responses each and their rewards, sampled by policy version max(0, step - k) with
   k = ``rollout.max_staleness`` (k = 0: sampled now, with the current policy);
2. **sync** the current version to the sampler (its own copy; on its own devices, the weight sync),
   for the batch k steps ahead;
3. **update** and **sample ahead** in turns (``run_together``): the update's programs (pi_old and
   the reference's log-probs, advantages, AR / TR weights, the Lopti split, the update passes:
   ``rl/update.py``) and the sampler's programs for the batch k steps ahead, each dispatched without
   waiting on the other, so the two overlap; then wait for the update;
4. **verify** the step's weight copy (checksums on both sides) and the sampler / trainer log-prob gap;
5. **record** the step's metrics (metrics.jsonl and the trackers);
6. **evaluate** and **save** (an orbax checkpoint, asynchronously) when due.

A stop signal (SIGTERM) saves a checkpoint and exits 75; ``resume=auto`` continues from the newest
good checkpoint with the same data order and RNG.
"""

from __future__ import annotations

import json
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax import algos
from arlopti_jax.rl import pipeline as sampling_loop
from arlopti_jax.rl import hosts, resume, run_setup, warm_up
from arlopti_jax.rl.collect import make_collector
from arlopti_jax.rl.evaluation import Evaluator, append_jsonl, format_table, trim_jsonl
from arlopti_jax.rl.pipeline import Task, run_together
from arlopti_jax.rl.summary import chance_levels, summarize
from arlopti_jax.rl.update import MismatchError, Updater, recompute_old_logprobs
from arlopti_jax.runtime import compiles, paths
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.runtime.chips import mfu
from arlopti_jax.store.checkpoint import PreemptionFlag
from arlopti_jax.store.metrics import MetricsWriter, Timer
from arlopti_jax.models import lora, param_shardings, save_pretrained
from arlopti_jax.tasks import load_reward_fn

log = logging.getLogger("arlopti_jax.train")
STOPPED_EXIT_CODE = 75  # EX_TEMPFAIL: a run a stop signal ended after its checkpoint; schedulers requeue it


def rollout_metrics(rows, scores, correct, lengths, truncated, n: int) -> dict[str, float]:
    """Reward, accuracy and length metrics of a whole (global) batch: ``rows`` its prompts,
    the arrays one value per response (``correct``: ``evaluation.is_correct``'s)."""
    sources = [rows[i // n]["data_source"] for i in range(len(scores))]
    correct = np.asarray(correct, np.float32)
    out = {"reward/mean": scores.mean(), "reward/std": scores.std(), "acc/all": correct.mean(),
           "response/length_mean": lengths.mean(), "response/length_max": lengths.max(),
           "response/truncated": truncated.mean()}
    for source in sorted(set(sources)):
        pick = np.array([s == source for s in sources])
        out[f"acc/{source}"] = correct[pick].mean()
        out[f"reward/{source}"] = scores[pick].mean()
    return out


def copy_tree(tree):
    """A copy of every array of ``tree``, in its sharding, by one program (an eager copy compiles one
    per leaf shape)."""
    def copy_tree(t):  # named: the compile log shows it
        return jax.tree.map(jnp.copy, t)

    return jax.jit(copy_tree, out_shardings=jax.tree.map(lambda x: x.sharding, tree))(tree)


def train(config, inputs: run_setup.Inputs | None = None) -> dict:
    """Run training per ``config``; returns the final summary (also printed). ``inputs``: the
    run's ``run_setup.prepare_inputs(config)``, when start-up has made them already."""
    compile_log = compiles.watch()
    try:
        return Trainer(config, inputs, compile_log).train()
    finally:
        compile_log.warm(False)  # the warm-up is this run's: a later run in this process warms up again


class Trainer:
    """One run: its objects built from the config (``__init__``), then its steps (``run``)."""

    def __init__(self, config, inputs: run_setup.Inputs | None, compile_log: compiles.CompileLog):
        self.config, self.compile_log = config, compile_log
        self.started = time.time()
        self.compiled_before = compile_log.programs, compile_log.seconds  # this process may have compiled before
        self.folder = paths.RunFolder(config.run_dir)  # a bucket's run folder: its records staged on this host
        self.run_dir = self.folder.local  # the records, TensorBoard and generations are written here
        layout = run_setup.make_layout(config) if inputs is None else inputs.layout
        self.inputs = run_setup.prepare_inputs(config, layout) if inputs is None else inputs
        # with sampler hosts of their own (rl/hosts.py) a process trains or samples; otherwise both
        self.roles = layout.roles
        self.role = self.roles.mine if self.roles else "both"
        if self.roles:  # each side splits and gathers among its own processes
            dist.set_group(self.roles.samplers if self.role == "sampler" else self.roles.trainers)
        self.trains, self.samples = self.role in ("trainer", "both"), self.role in ("sampler", "both")
        policy = (run_setup.load_policy(config, layout.mesh, self.inputs.model_path, self.inputs.tokenizer)
                  if self.trains else run_setup.Policy(run_setup.model_config(config, self.inputs.model_path), None,
                                                       self.inputs.tokenizer, self.inputs.model_path))
        self.model_cfg, self.tokenizer = policy.model_cfg, policy.tokenizer
        self.steps = run_setup.total_steps(config, self.inputs.iterator)
        self.run = run = run_setup.assemble(
            config, layout.mesh, self.model_cfg, eos_ids=run_setup.eos_ids(policy), pad_id=run_setup.pad_id(policy),
            total_steps=self.steps, prompt_width=self.inputs.longest_prompt, sampler_mesh=layout.sampler_mesh)
        self.k = config.rollout.max_staleness
        self.sampler_mesh = layout.sampler_mesh
        self.sync_dtype = sampling_loop.sync_dtype(self.model_cfg) if self.sampler_mesh is not None else None
        self.ckpt = resume.checkpointer(config, set(self.roles.trainers) if self.roles else None) if self.trains \
            else None
        self._restore(policy)
        self.timer = Timer()
        self.preempted = PreemptionFlag()
        reward_fn = load_reward_fn(config.reward.fn or None)
        self.evaluator = Evaluator(config, run, self.tokenizer, self.inputs.test_sets, reward_fn) if self.trains \
            else None
        self.loop = self._sampling_loop(reward_fn)
        grad_norms = algos.make_quartile_grad_norms(run.train_step) if config.train.diagnostics_every else None
        self.recompute = recompute_old_logprobs(config, self.model_cfg, self.sampler_mesh)
        self.updater = Updater(run, config, self.ref_params, self.recompute, self.timer, grad_norms) \
            if self.trains else None
        trained = lora.trainable(self.model_cfg, run.state["params"])[0]
        self.leaf_names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(trained)]
        self.history = {"before": None, "after": None, "reward": [],
                        "eval_settings": self.evaluator.settings if self.evaluator else {}}
        self.saved = {"step": self.start_step, "time": time.monotonic()}
        self.last = {"reward/mean": float("nan"), "acc/all": float("nan")}  # the last step's metrics

    # ---- building ----

    def _restore(self, policy) -> None:
        """The trained state: a checkpoint's (``resume``) or the folder's weights with fresh AdamW
        state; the frozen reference policy (the KL term) beside it. A sampler host restores nothing:
        the trainer's process 0 sends it the step, the key and the data position (``hosts.share_start``)."""
        config, model_cfg, run = self.config, self.model_cfg, self.run
        self.params = self.opt_state = self.ref_params = self.restored = None
        if not self.trains:
            info = hosts.share_start({})
            self.start_step, self.start_versions = info["start_step"], info["versions"]
            self.key = jax.random.wrap_key_data(np.asarray(info["key"], np.uint32))
            self.inputs.iterator.load_state_dict(info["data"])
            return
        target = resume.saved_state(model_cfg, run.state)
        if self.k:  # the versions that sample the batches in flight (pipeline.checkpoint_versions)
            held = target["params"] if self.sync_dtype is None else jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, self.sync_dtype if jnp.issubdtype(x.dtype, jnp.floating)
                                               else x.dtype, sharding=x.sharding), target["params"])
            target["sampler_params"] = (held,) * self.k
        self.restored = resume.restore_from(config, self.ckpt, target)
        if run.use_reference:  # frozen: never donated; with LoRA the base itself, adapters off (no copy)
            self.ref_params = lora.adapters_off(policy.params) if model_cfg.lora_rank else policy.params
        if self.restored is None:
            self.start_step, self.key = 0, jax.random.key(config.seed)
            self.params = (copy_tree(policy.params) if self.ref_params is not None and not model_cfg.lora_rank
                           else policy.params)
            self.opt_state = algos.init_opt_state(run.optimizer, model_cfg, self.params, run.mesh)
        else:
            self.start_step, state, meta = self.restored
            self.params, self.opt_state = state["params"], state["opt_state"]
            self.key = jax.random.wrap_key_data(state["rng"])
            if model_cfg.lora_rank:  # the checkpoint's adapters on the folder's base (its hash checked at start-up)
                self.params = lora.combine(lora.split(policy.params)[0], self.params)
            self.inputs.iterator.load_state_dict(meta["data"])
            log.info("resumed from %s/%d", self.ckpt.directory, self.start_step)
        policy.params = None  # the trainer owns params from here (donated each step)
        if self.roles:
            hosts.share_start(hosts.start_info(self, self.restored))

    def _sampling_loop(self, reward_fn):
        """The sampling loop (``rl/pipeline.py``; with sampler hosts, its side of ``rl/hosts.py``), its
        copies of the versions in flight made or restored."""
        config, run, model_cfg = self.config, self.run, self.model_cfg
        timer = Timer()  # the sampler's own: paused while the main thread works for the update
        trained_abstract, frozen_abstract = lora.trainable(model_cfg, run.state["params"])
        if self.role == "trainer":
            loop = hosts.TrainerSide(trained_abstract, self.k, self.steps, self.sampler_mesh, run.mesh,
                                     self.sync_dtype, self.key)
        else:
            frozen, shardings = {}, None
            if self.sampler_mesh is not None:  # the trained part's shardings there; a LoRA base copied there once
                shardings, frozen_shardings = lora.trainable(model_cfg, param_shardings(model_cfg, self.sampler_mesh))
                if self.role == "sampler":  # the base read from the model folder onto the sampler's mesh
                    frozen = lora.trainable(model_cfg, run_setup.load_policy(
                        config, self.sampler_mesh, self.inputs.model_path, self.tokenizer).params)[1]
                else:
                    frozen = shd.transfer(lora.trainable(model_cfg, self.params)[1], frozen_shardings)
            elif self.params is not None:
                frozen = lora.trainable(model_cfg, self.params)[1]
            mesh = self.sampler_mesh if self.role == "sampler" else run.mesh  # where the batch's arrays go
            collect = make_collector(config, run.rollout_sampler, run.sampling(), reward_fn, self.tokenizer, mesh,
                                     timer)
            if self.role == "sampler":
                loop = hosts.SamplerSide(collect, timer, self.inputs.iterator, self.key, self.k, self.steps, frozen,
                                         trained_abstract, run.mesh, self.sampler_mesh, self.sync_dtype)
            else:
                loop = sampling_loop.Pipeline(collect, timer, self.inputs.iterator, self.key, self.k, self.steps,
                                              frozen=frozen, shardings=shardings, dtype=self.sync_dtype)
        trained = lora.trainable(model_cfg, self.params)[0] if self.params is not None else None
        if self.role == "sampler":
            for version in self.start_versions:  # as the trainer's processes send them
                loop.adopt(version)
        elif self.restored is None or not self.k:  # the version that samples the first batch
            loop.snapshot(self.start_step, trained)
        else:
            for version, copy in zip(sampling_loop.checkpoint_versions(self.start_step, self.k),
                                     self.restored[1]["sampler_params"]):
                loop.adopt(version, copy)
        return loop

    # ---- the run ----

    def train(self) -> dict:
        config, loop = self.config, self.loop
        own = {}  # the rollouts' programs on the sampler's own mesh: for its copy and its key
        if self.sampler_mesh is not None and self.samples:
            first = loop.snapshots[sampling_loop.sampling_version(self.start_step, self.k)]
            own = {"rollout_params": lora.whole(first.params, loop.frozen),
                   "rollout_key": jax.random.fold_in(loop.key, self.start_step)}
        warm_up.compile_rollouts(self.run, self.evaluator, self.params, jax.random.fold_in(self.key, self.start_step),
                                 **own, with_rollouts=self.samples)  # before step 1
        loop.start(self.start_step)
        if jax.process_index() == 0:
            self.folder.fetch()  # a bucket's records, as the run that wrote them left them
        for name in ("metrics.jsonl", "eval.jsonl"):  # the steps after the checkpoint are written again
            moved = trim_jsonl(self.run_dir / name, self.start_step if self.restored is not None else -1)
            if moved:
                log.warning("%d records of %s after step %d moved to %s.replaced: this run writes those steps again",
                            moved, self.run_dir / name, self.start_step, name)
        self.writer = MetricsWriter(self.run_dir, loggers=config.train.loggers,
                                    config=json.loads(config.to_json_best_effort()))
        test_sets = self.inputs.test_sets if self.trains else {}  # the trainer's hosts evaluate
        if test_sets and config.train.eval_before and self.start_step == 0:
            self.history["before"] = self.evaluate(0)
            log.info("before training:\n%s", format_table(self.history["before"], self.evaluator.settings))
        elif test_sets and self.restored is not None and self.restored[2].get("eval_pending"):  # saved on a stop
            self.history["after"] = self.evaluate(self.start_step)

        from tqdm.auto import tqdm

        bar = tqdm(range(self.start_step, self.steps), initial=self.start_step, total=self.steps, desc="rl",
                   disable=jax.process_index() != 0)
        stopped = False
        try:
            for step in bar:
                stopped = self.step(step)
                bar.set_postfix(reward=f"{self.last['reward/mean']:.3f}", acc=f"{self.last['acc/all']:.3f}")
                if stopped:
                    break
        finally:
            loop.close()
        return self.finish(stopped)

    def step(self, step: int) -> bool:
        """One RL step (the module docstring's 1-6); True when a stop signal ended the run here. With
        sampler hosts of their own each process runs its side of it (``self.trains``, ``self.samples``),
        every process through the same agreements."""
        config, loop, began = self.config, self.loop, time.perf_counter()
        # 1-2. this step's batch (sampled k versions ago, or now at k = 0); version `step` to the sampler
        loop.advance(step, lora.trainable(self.model_cfg, self.params)[0] if self.trains else None)
        sampled = loop.take(step)
        if self.stop_now(step, sampled.data_before):  # before the update: the stop's save comes sooner
            return True
        # 3. the update and the sampler's batch k steps ahead, in turns; then the update's results
        update = None
        if self.trains:
            diagnose = bool(config.train.diagnostics_every) and step % config.train.diagnostics_every == 0
            update = Task("update", self.updater.steps(self.params, self.opt_state, sampled.step_batch, step,
                                                       diagnose), self.timer)
        run_together(loop.ahead(step), update)  # the sampler first: its decode gets to the devices before the
        # update's passes, so the scoring (the host's) can begin sooner and run beside the update
        self.timer.resume()
        error = None
        if update is not None:
            done = update.value
            self.params, self.opt_state = done.params, done.opt_state
            update_metrics = done.finish(self.updater)
        # 4. the step's weight copy and the sampler / trainer gap checked (one error line each): with sampler
        # hosts each side checks its own and all processes stop together
        try:
            loop.verify(step, self.leaf_names)
            if update is not None:
                self.check_mismatch(step, update_metrics)
        except (sampling_loop.SyncError, MismatchError) as err:
            if not self.roles:
                raise
            error = f"{type(err).__name__}:{err}"
        if self.roles and (error := hosts.agree(step, error)):
            kind, _, message = error.partition(":")
            raise (sampling_loop.SyncError if kind == "SyncError" else MismatchError)(message)
        loop.release(step + 1)  # the copies no batch in flight or checkpoint of step + 1 needs
        # 5. records
        if update is not None:
            self.record(step, sampled, done, update_metrics, time.perf_counter() - began)
        if step == self.start_step:  # the first step (and the evaluation before it) compiled the run's programs
            self.history["warm"] = self.compile_log.programs
            self.compile_log.warm()
        # 6. evaluation, then the checkpoint (asynchronous): evaluating first, a checkpoint's evaluation is
        # recorded before it exists, so a crash mid-evaluation resumes from the checkpoint before
        finished = step + 1
        stop = dist.any_process(bool(self.preempted), everyone=True)  # every host saves the same step
        due = bool(self.inputs.test_sets) and (finished % config.train.eval_every == 0 or finished == self.steps)
        if due and not stop:
            if self.trains:
                self.history["after"] = self.evaluate(finished)
            due = False  # done: not left to a resumed run
            stop = dist.any_process(bool(self.preempted), everyone=True)  # an evaluation can be long: asked again
        every_s = config.train.save_every_s  # a checkpoint every so many seconds too (the hosts agree)
        timely = bool(every_s) and dist.any_process(time.monotonic() - self.saved["time"] >= every_s, everyone=True)
        if finished % config.train.save_every == 0 or finished == self.steps or timely or stop:
            self.save(finished, eval_pending=due and stop, data_state=sampled.data_after, stopping=stop)
        if stop:
            self.stopped_at(finished)
        return stop

    def check_mismatch(self, step: int, metrics: dict) -> None:
        """MismatchError where the sampler's log-probs of the batch are farther from pi_old than
        ``rollout.max_kl``: a decode that computes wrong log-probs shows there first."""
        bound, kl = self.config.rollout.max_kl, metrics.get("offpolicy/kl_k3")
        if bound and kl is not None and not kl <= bound:
            raise MismatchError(f"step {step}: the sampler's log-probs of its batch are {kl:.4g} (KL, k3 estimate "
                                f"per token) from the trainer's pi_old, above rollout.max_kl={bound:g}: the sampler "
                                "computes other log-probs than the trainer (a wrong decode, or weights it did not "
                                "receive), or the policy moved further in max_staleness steps than the bound allows")

    def record(self, step: int, sampled, done, update_metrics: dict, seconds_so_far: float) -> None:
        """The step's scalars, the pi_old histogram and a sample to the trackers (recorded at step + 1)."""
        config, run, batch = self.config, self.run, done.batch
        step_batch = sampled.step_batch
        seconds = self.timer.pop()
        for phase, value in sampled.timings.items():  # the sampler's phases on this batch (rollout, reward)
            seconds[phase] = seconds.get(phase, 0.0) + value
        schedule = {}
        if self.k or self.sampler_mesh is not None:
            schedule = {"sampler/version": float(sampled.version), "sampler/lag": float(step - sampled.version),
                        "time/sampler_busy": sampled.busy_s, "time/sampler_span": sampled.span_s}
        if self.sampler_mesh is not None:  # this step's weight sync (version step, at advance)
            schedule.update({"time/weight_sync": self.loop.synced["seconds"],
                             "sync/bytes": float(self.loop.synced["bytes"])})
        generated = int(step_batch.lengths.sum())
        epochs = config.train.ppo_epochs
        trained = int(batch["attention_mask"].sum()) * len(done.passes) * epochs
        packed = run.train_step.processed_since(done.mark)  # what the passes forwarded: a shared prompt once per row
        compiled = self.compile_log.programs - self.compiled_before[0]
        metrics = {**rollout_metrics(step_batch.rows, step_batch.scores, step_batch.correct, step_batch.lengths,
                                     step_batch.truncated, config.rollout.n),
                   **step_batch.stats, **schedule, **update_metrics,
                   **{f"time/{k}": v for k, v in seconds.items()},
                   "throughput/rollout_tokens_per_s": generated / max(seconds.get("rollout", 0.0), 1e-9),
                   "throughput/train_tokens_per_s": trained / max(seconds.get("update", 0.0), 1e-9),
                   "throughput/update_padding": packed.padding,
                   "update/forwarded_tokens": float(packed.real_tokens),
                   # every program this run has compiled (or loaded from the persistent cache) so far:
                   # a shape not seen before compiles inside its phase's time
                   "compile/programs": float(compiled),
                   "compile/seconds": self.compile_log.seconds - self.compiled_before[1],
                   "train/epoch": sampled.data_after["epoch"]}
        metrics["time/step"] = seconds_so_far  # the step's wall time, its records aside
        util = mfu(self.model_cfg.num_params(), packed.real_tokens, seconds.get("update", 0.0))
        if util is not None:
            metrics["throughput/train_mfu"] = util
        writer = self.writer
        writer.scalars(step + 1, metrics)
        valid = batch["response_mask"].astype(bool)
        writer.histogram(step + 1, "pi_old", np.exp(batch["old_logprobs"][valid]))
        if step % config.train.samples_every == 0:
            writer.text(step + 1, "samples", f"reward {step_batch.sample_score:.2f}\n\n```\n"
                                             f"{step_batch.sample_text}\n```")
        self.history["reward"].append(float(step_batch.scores.mean()))
        self.last = metrics

    def evaluate(self, step: int) -> dict:
        config = self.config
        with self.timer("eval"):
            generations = self.run_dir / "generations" / f"step_{step}" if config.train.save_generations else None
            results = self.evaluator.run(self.params, jax.random.fold_in(self.key, 10**9 + step), generations)
        self.writer.scalars(step, results)
        append_jsonl(self.run_dir / "eval.jsonl", {"step": step, **self.evaluator.settings, **results})
        return results

    # ---- checkpoints and stop signals ----

    def save(self, step: int, eval_pending: bool = False, data_state=None, stopping: bool = False) -> None:
        """Checkpoint ``step`` (asynchronous; waited for when ``stopping``), after the records up to
        it reach a bucket's run folder. ``eval_pending``: the step's evaluation is left to the
        resumed run; ``data_state``: the data position (default: the iterator's now)."""
        config, iterator = self.config, self.inputs.iterator
        if not self.trains:  # the trainer's hosts checkpoint (they hold the versions in flight too)
            self.saved.update(step=step, time=time.monotonic())
            return
        if jax.process_index() == 0:
            self.writer.flush()
            self.folder.sync()
        state = {"params": self.params, "opt_state": self.opt_state,
                 "rng": dist.replicated(jax.random.key_data(self.key), self.run.mesh)}
        if self.k:  # with the trained part of the versions that sample the batches in flight
            state["sampler_params"] = self.loop.checkpoint_params(step)
        if self.roles and dist.group_count() == 1:  # one trainer host of several processes: orbax saves its
            state = jax.device_get(state)  # arrays as host arrays only (it refuses one process's in a multi-host job)
        began = time.monotonic()
        data = iterator.state_dict() if data_state is None else data_state
        self.ckpt.save(step, resume.saved_state(self.model_cfg, state),
                       resume.checkpoint_record(config, step, data, self.inputs.model_path, self.inputs.base_sha256,
                                                eval_pending))
        if stopping:  # inside the grace period: the save is complete before the process exits
            self.ckpt.wait()
            self.saved["seconds"] = time.monotonic() - began
        self.saved.update(step=step, time=time.monotonic(), began=began)

    def stopped_at(self, step: int) -> None:
        seconds = self.saved.get("seconds")
        grace = self.config.train.grace_s
        log.warning("received %s: checkpoint %d saved%s, exiting (exit code %d: resume me)",
                    self.preempted.signal_name or "a stop signal on another process", step,
                    "" if seconds is None else f" in {seconds:.1f} s (train.grace_s={grace:g}"
                    + (": over it" if seconds > grace else "") + ")", STOPPED_EXIT_CODE)

    def stop_now(self, step: int, data_state) -> bool:
        """Whether any process has a stop signal (every process asks at the same points, so all stop
        at the same step); if so, checkpoint ``step`` unless it is saved already."""
        if not dist.any_process(bool(self.preempted), everyone=True):
            return False
        if self.saved["step"] < step:
            self.save(step, data_state=data_state, stopping=True)
        elif "began" in self.saved and self.ckpt is not None:  # saved at this step's end, perhaps still being
            # written: the exit waits for it
            self.ckpt.wait()
            self.saved["seconds"] = time.monotonic() - self.saved["began"]
        self.stopped_at(step)
        return True

    def finish(self, stopped: bool) -> dict:
        """The run's end: the checkpoints written, the export, the summary, the records synced."""
        config, history, compile_log = self.config, self.history, self.compile_log
        if self.ckpt is not None:
            self.ckpt.close()
        self.preempted.close(stopping=stopped)
        history["compile"] = (compile_log.programs - self.compiled_before[0],
                              compile_log.seconds - self.compiled_before[1],
                              compile_log.programs - history.get("warm", compile_log.programs))
        compile_log.warm(False)  # training is over: the export's programs (a LoRA merge) are not late compiles
        export_dir = None
        if not stopped and config.train.export_at_end and self.trains:
            export_dir = save_pretrained(*lora.plain(self.model_cfg, self.params), self.run_dir / "export",
                                         tokenizer_dir=self.inputs.model_path)
            if self.folder.remote is not None:
                export_dir = self.folder.remote / "export"  # copied up with the records below
        summary = summarize(config, history, self.started, export_dir, preempted=stopped,
                            chance=chance_levels(self.inputs.test_sets))
        self.writer.summary(self.start_step + len(history["reward"]), summary["text"], summary["scalars"])
        self.writer.close()
        if jax.process_index() == 0:
            self.folder.sync()  # the last steps' records, TensorBoard's events and the export, to a bucket's run folder
        dist.barrier("arlopti_end", everyone=True)  # the other processes leave once process 0 has written everything
        return summary
