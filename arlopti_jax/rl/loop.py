"""The RL trainer's loop, ``train(config)``: sample -> reward -> advantage -> token weights ->
(Lopti) updates, logging, checkpoints, evaluations, and the end-of-run summary. The command
line is ``arlopti_jax.train``; ``arlopti_jax.reproduce`` calls ``train`` for each run of its sweep.

Each step: draw ``rollout.n`` responses for ``train.batch_prompts`` prompts (optionally
dropping zero-advantage groups and drawing more: ``algo.filter_groups``), score them,
compute advantages and token weights, update the policy (twice with Lopti), log to
TensorBoard, checkpoint, evaluate. SIGTERM saves a checkpoint and exits; ``resume=auto``
continues from the newest good checkpoint with the same data order and RNG.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax import algos
from arlopti_jax.rl import pipeline as sampling_loop
from arlopti_jax.rl import resume, run_setup, warm_up
from arlopti_jax.runtime import compiles, paths
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.store.checkpoint import PreemptionFlag
from arlopti_jax.rl.collect import Collector
from arlopti_jax.rl.evaluation import Evaluator, append_jsonl, compare_table, format_table, trim_jsonl
from arlopti_jax.runtime.chips import mfu
from arlopti_jax.store.metrics import MetricsWriter, Timer
from arlopti_jax.models import lora, param_shardings, save_pretrained
from arlopti_jax.tasks import load_reward_fn
from arlopti_jax.tasks.kk import guess_accuracy

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


def copy_tree(tree):
    """A copy of every array of ``tree``, in its sharding, by one program (an eager copy compiles one
    per leaf shape)."""
    def copy_tree(t):  # named: the compile log shows it
        return jax.tree.map(jnp.copy, t)

    return jax.jit(copy_tree, out_shardings=jax.tree.map(lambda x: x.sharding, tree))(tree)


def quartile_metrics(batch, advantages) -> dict[str, float]:
    q = jax.tree.map(dist.to_host, algos.probability_quartiles(batch["old_logprobs"], advantages,
                                                               batch["response_mask"]))
    out = {}
    for i in range(4):
        out[f"quartile/q{i + 1}_mean_prob"] = q["mean_prob"][i]
        out[f"quartile/q{i + 1}_mean_abs_adv"] = q["mean_abs_adv"][i]
        out[f"quartile/q{i + 1}_tokens"] = q["count"][i]
    return out


def train(config, inputs: run_setup.Inputs | None = None) -> dict:
    """Run training per ``config``; returns the final summary (also printed). ``inputs``: the
    run's ``run_setup.prepare_inputs(config)``, when start-up has made them already."""
    compile_log = compiles.watch()
    closing = []  # what the run started and must stop however it ends (the sampling loop's thread)
    try:
        return _train(config, inputs, compile_log, closing)
    finally:
        for close in closing:
            close()
        compile_log.warm(False)  # the warm-up is this run's: a later run in this process warms up again


def _train(config, inputs: run_setup.Inputs | None, compile_log: compiles.CompileLog, closing: list) -> dict:
    started = time.time()
    compiled_before = compile_log.programs, compile_log.seconds  # this process may have compiled before the run
    folder = paths.RunFolder(config.run_dir)  # a bucket's run folder: its records staged on this host
    run_dir = folder.local  # the records, TensorBoard and generations are written here
    mesh = run_setup.make_mesh(config)
    inputs = run_setup.prepare_inputs(config) if inputs is None else inputs
    model_path, iterator, test_sets = inputs.model_path, inputs.iterator, inputs.test_sets
    policy = run_setup.load_policy(config, mesh, model_path, inputs.tokenizer)
    model_cfg, tokenizer = policy.model_cfg, policy.tokenizer

    steps = run_setup.total_steps(config, iterator)
    run = run_setup.assemble(config, mesh, model_cfg, eos_ids=run_setup.eos_ids(policy),
                             pad_id=run_setup.pad_id(policy), total_steps=steps, prompt_width=inputs.longest_prompt,
                             sampler_mesh=run_setup.make_sampler_mesh(config))
    train_step = run.train_step

    staleness = config.rollout.max_staleness  # k >= 1: batches sampled up to k versions ahead (rl/pipeline.py)
    recompute = config.rollout.recompute_old_logprobs or staleness >= 1  # pi_old: the trainer's own pass
    correction = run_setup.correction_config(config)
    ckpt = resume.checkpointer(config)
    target = resume.saved_state(model_cfg, run.state)
    sampler_mesh = run.rollout_sampler.mesh if run.rollout_sampler is not run.sampler else None
    # the sampler's own mesh: its copies in its compute dtype (the LoRA adapters as trained: merged there)
    sync_dtype = sampling_loop.sync_dtype(model_cfg) if sampler_mesh is not None else None
    if staleness:  # the versions that sample the batches in flight (pipeline.checkpoint_versions)
        held = target["params"] if sync_dtype is None else jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, sync_dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype,
                                           sharding=x.sharding), target["params"])
        target["sampler_params"] = (held,) * staleness
    restored = resume.restore_from(config, ckpt, target)
    ref_params = None
    if run.use_reference:  # frozen: never donated; with LoRA the base itself, adapters off (no copy)
        ref_params = lora.adapters_off(policy.params) if model_cfg.lora_rank else policy.params
    if restored is None:
        start_step, key = 0, jax.random.key(config.seed)
        params = copy_tree(policy.params) if ref_params is not None and not model_cfg.lora_rank else policy.params
        opt_state = algos.init_opt_state(run.optimizer, model_cfg, params, mesh)
    else:
        start_step, state, meta = restored
        params, opt_state, key = state["params"], state["opt_state"], jax.random.wrap_key_data(state["rng"])
        if model_cfg.lora_rank:  # the checkpoint's adapters on the folder's base (its hash checked at start-up)
            params = lora.combine(lora.split(policy.params)[0], params)
        iterator.load_state_dict(meta["data"])
        log.info("resumed from %s/%d", ckpt.directory, start_step)
    policy.params = None  # the trainer owns params from here (donated each step)
    if jax.process_index() == 0:
        folder.fetch()  # a bucket's records, as the run that wrote them left them
    for name in ("metrics.jsonl", "eval.jsonl"):  # the steps after the checkpoint are written again
        moved = trim_jsonl(run_dir / name, start_step if restored is not None else -1)
        if moved:
            log.warning("%d records of %s after step %d moved to %s.replaced: this run writes those steps again",
                        moved, run_dir / name, start_step, name)

    diagnose_every = config.train.diagnostics_every
    grad_norms_fn = algos.make_quartile_grad_norms(train_step) if diagnose_every else None
    reward_fn = load_reward_fn(config.reward.fn or None)
    evaluator = Evaluator(config, run, tokenizer, test_sets, reward_fn)
    writer = MetricsWriter(run_dir, loggers=config.train.loggers, config=json.loads(config.to_json_best_effort()))
    preempted = PreemptionFlag()
    timer = Timer()
    n = config.rollout.n
    collect = Collector(config, run.sampler, run.sampling(), reward_fn, tokenizer, mesh, timer)
    history = {"before": None, "after": None, "reward": [], "eval_settings": evaluator.settings}
    loop = None
    if staleness or sampler_mesh is not None:  # the sampler's own collector and timer: its jobs may run in a thread
        sampler_timer = Timer()
        trained_now, frozen = lora.trainable(model_cfg, params)
        shardings = None
        if sampler_mesh is not None:  # the trained part's shardings there; a LoRA base copied there once
            shardings, frozen_shardings = lora.trainable(model_cfg, param_shardings(model_cfg, sampler_mesh))
            frozen = shd.transfer(frozen, frozen_shardings)
        loop = sampling_loop.Pipeline(
            Collector(config, run.rollout_sampler, run.sampling(), reward_fn, tokenizer, mesh, sampler_timer),
            sampler_timer, iterator, key, staleness, steps, frozen=frozen,
            background=sampling_loop.in_thread(jax.process_count(), sampler_mesh), shardings=shardings,
            dtype=sync_dtype)
        closing.append(loop.close)
        if restored is None or not staleness:  # the version that samples the first batch
            loop.snapshot(start_step, trained_now)
        else:
            for version, trained in zip(sampling_loop.checkpoint_versions(start_step, staleness),
                                        restored[1]["sampler_params"]):
                loop.adopt(version, trained)
    own = {}  # the rollouts' programs on the sampler's own mesh: for its copy and its key
    if sampler_mesh is not None:
        own = {"rollout_params": lora.whole(loop.snapshots[sampling_loop.sampling_version(start_step, staleness)]
                                            .params, loop.frozen),
               "rollout_key": jax.random.fold_in(loop.key, start_step)}
    warm_up.compile_rollouts(run, evaluator, params, jax.random.fold_in(key, start_step), **own)  # before step 1
    if loop is not None:
        loop.start(start_step)

    def evaluate(step):
        with timer("eval"):
            generations = run_dir / "generations" / f"step_{step}" if config.train.save_generations else None
            results = evaluator.run(params, jax.random.fold_in(key, 10**9 + step), generations)
        writer.scalars(step, results)
        append_jsonl(run_dir / "eval.jsonl", {"step": step, **evaluator.settings, **results})
        return results

    saved = {"step": start_step, "time": time.monotonic()}

    def save(step, eval_pending=False, data_state=None, stopping=False):
        """Checkpoint ``step`` (asynchronous; waited for when ``stopping``), after the records up to
        it reach a bucket's run folder. ``eval_pending``: the step's evaluation is left to the
        resumed run; ``data_state``: the data position (default: the iterator's now)."""
        if jax.process_index() == 0:
            writer.flush()
            folder.sync()
        state = {"params": params, "opt_state": opt_state, "rng": dist.replicated(jax.random.key_data(key), mesh)}
        if staleness:  # with the trained part of the versions that sample the batches in flight
            state["sampler_params"] = loop.checkpoint_params(step)
        began = time.monotonic()
        ckpt.save(step, resume.saved_state(model_cfg, state),
                  resume.checkpoint_record(config, step, iterator.state_dict() if data_state is None else data_state,
                                           model_path, inputs.base_sha256, eval_pending))
        if stopping:  # inside the grace period: the save is complete before the process exits
            ckpt.wait()
            saved["seconds"] = time.monotonic() - began
        saved.update(step=step, time=time.monotonic(), began=began)

    def stopped_at(step):
        seconds = saved.get("seconds")
        log.warning("received %s: checkpoint %d saved%s, exiting (exit code %d: resume me)",
                    preempted.signal_name or "a stop signal on another process", step,
                    "" if seconds is None else f" in {seconds:.1f} s (train.grace_s={config.train.grace_s:g}"
                    + (": over it" if seconds > config.train.grace_s else "") + ")", STOPPED_EXIT_CODE)

    def stop_now(step, data_state) -> bool:
        """Whether any process has a stop signal (every process asks at the same points, so all stop
        at the same step); if so, checkpoint ``step`` unless it is saved already."""
        if not dist.any_process(bool(preempted)):
            return False
        if saved["step"] < step:
            save(step, data_state=data_state, stopping=True)
        elif "began" in saved:  # saved at this step's end, perhaps still being written: the exit waits for it
            ckpt.wait()
            saved["seconds"] = time.monotonic() - saved["began"]
        stopped_at(step)
        return True

    if test_sets and config.train.eval_before and start_step == 0:
        history["before"] = evaluate(0)
        log.info("before training:\n%s", format_table(history["before"], evaluator.settings))
    elif test_sets and restored is not None and restored[2].get("eval_pending"):  # saved on a stop signal
        history["after"] = evaluate(start_step)

    from tqdm.auto import tqdm

    bar = tqdm(range(start_step, steps), initial=start_step, total=steps, desc="rl", disable=jax.process_index() != 0)
    stopped = False
    for step in bar:
        step_began = time.perf_counter()
        # 1-2. sample G responses per prompt with the current policy (each process its block of
        # the prompts) and score them on host; with filter_groups, more rounds replace zero-advantage
        # groups. The global batch then goes to every process's host (the update packs it there).
        # With max_staleness k >= 1 the sampling loop made this step's batch with version step - k,
        # and is handed this version now for batch step + k.
        schedule = {}
        if loop is None:
            step_key = jax.random.fold_in(key, step)
            data_before = iterator.state_dict()  # where a checkpoint of this step's start resumes the data
            sampled = collect(params, iterator, step_key)
            data_after = None  # the iterator's own position
        else:
            loop.advance(step, lora.trainable(model_cfg, params)[0])
            scheduled, waited = loop.take(step)
            sampled, data_before, data_after = scheduled.step_batch, scheduled.data_before, scheduled.data_after
            for phase, seconds in scheduled.timings.items():
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + seconds
            schedule = {"sampler/version": float(scheduled.version), "sampler/lag": float(step - scheduled.version),
                        "time/sampler_busy": scheduled.busy_s, "time/sampler_wait": scheduled.wait_s,
                        "time/trainer_wait": waited}
            if sampler_mesh is not None:  # this step's weight sync (version step, at advance)
                schedule.update({"time/weight_sync": loop.synced["seconds"],
                                 "sync/bytes": float(loop.synced["bytes"])})
        if stop_now(step, data_before):  # before the update: the stop's save comes sooner
            stopped = True
            break
        batch = {k: dist.to_host(v) for k, v in sampled.batch.items()}
        rewards, group_ids = dist.to_host(sampled.rewards), dist.to_host(sampled.group_ids)
        behaviour = batch["old_logprobs"]  # the sampler's log-probs
        entropies = None  # pi_old's, for the high-entropy selection (algo.entropy_top_fraction)
        if run.weight_cfg.entropy_top_fraction:
            old, entropies = run.logprobs(params, batch, with_entropy=True)
            if recompute:
                batch["old_logprobs"] = old
        elif recompute:
            batch["old_logprobs"] = run.logprobs(params, batch)
        # 3-4. advantages, token weights (AR / TR, the entropy selection) and the Lopti split, as update
        # passes: all read pi_old; then the off-policy correction of the policy-gradient term
        passes = algos.prepare_updates(run.adv_cfg, run.weight_cfg, run.lopti_cfg, rewards, group_ids,
                                       batch["response_mask"], batch["old_logprobs"], entropies)
        offpolicy = {}
        if recompute:
            offpolicy = algos.mismatch_metrics(correction, batch["old_logprobs"], behaviour, batch["response_mask"])
            if correction.enabled:
                passes = algos.correct_passes(passes, algos.correction_weights(
                    correction, batch["old_logprobs"], behaviour, batch["response_mask"]))
        if run.use_reference:
            batch["ref_logprobs"] = run.logprobs(ref_params, batch)
        diagnostics = {}
        if diagnose_every and step % diagnose_every == 0:  # the paper's Figure 1, before the update
            with timer("diagnostics"):
                rows = config.train.get("diagnostics_rows", 0)  # 0: the first mini-batch; -1: every row
                rows = config.train.mini_batch if rows == 0 else len(batch["input_ids"]) if rows < 0 else rows
                diagnostics = algos.quartile_grad_norm_metrics(grad_norms_fn, params, batch, passes, rows)
                if step == 0 and config.train.isolation_experiment:  # and once, on the first batch
                    diagnostics.update(isolation_metrics(run, params, batch, passes))
        # 5. policy update(s): one pass, or Lopti's low- then high-probability pass, train.ppo_epochs
        # times over the batch (pi_old the sampler's throughout)
        mark = len(train_step.processed)
        epochs = config.train.ppo_epochs
        with timer("update"):
            params, opt_state, pass_metrics = algos.update_on_batch(
                train_step, params, opt_state, batch, passes, config.train.mini_batch, epochs=epochs)
        if loop is not None:
            loop.release(step + 1)  # the copies no batch in flight or checkpoint of step + 1 needs
        # 6. metrics
        seconds = timer.pop()
        generated = int(sampled.lengths.sum())
        trained = int(batch["attention_mask"].sum()) * len(passes) * epochs
        packed = train_step.processed_since(mark)  # what the passes forwarded: a shared prompt once per row
        metrics = {**rollout_metrics(sampled.rows, sampled.scores, sampled.correct, sampled.lengths,
                                     sampled.truncated, n),
                   **sampled.stats, **diagnostics, **schedule, **offpolicy,
                   **update_metrics(pass_metrics, run.lopti_cfg, epochs),
                   **quartile_metrics(batch, sum(dist.to_host(a) for a, _ in passes)),
                   **{f"time/{k}": v for k, v in seconds.items()},
                   "throughput/rollout_tokens_per_s": generated / max(seconds["rollout"], 1e-9),
                   "throughput/train_tokens_per_s": trained / max(seconds["update"], 1e-9),
                   "throughput/update_padding": packed.padding,
                   "update/forwarded_tokens": float(packed.real_tokens),
                   # every program this run has compiled (or loaded from the persistent cache) so far:
                   # a shape not seen before compiles inside its phase's time
                   "compile/programs": float(compile_log.programs - compiled_before[0]),
                   "compile/seconds": compile_log.seconds - compiled_before[1],
                   "train/epoch": iterator.epoch if data_after is None else data_after["epoch"]}
        metrics["time/step"] = time.perf_counter() - step_began  # the step's wall time, its records aside
        util = mfu(model_cfg.num_params(), packed.real_tokens, seconds["update"])
        if util is not None:
            metrics["throughput/train_mfu"] = util
        writer.scalars(step + 1, metrics)
        valid = batch["response_mask"].astype(bool)
        writer.histogram(step + 1, "pi_old", np.exp(batch["old_logprobs"][valid]))
        if step % config.train.samples_every == 0:
            writer.text(step + 1, "samples", f"reward {sampled.sample_score:.2f}\n\n```\n{sampled.sample_text}\n```")
        history["reward"].append(float(sampled.scores.mean()))
        if step == start_step:  # the first step (and the evaluation before it) compiled the run's programs
            history["warm"] = compile_log.programs
            compile_log.warm()
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics['acc/all']:.3f}")
        # 7. evaluation, 8. checkpoint (asynchronous): evaluating first, a checkpoint's evaluation is
        # recorded before it exists, so a crash mid-evaluation resumes from the checkpoint before
        done = step + 1
        stop = dist.any_process(bool(preempted))  # every host saves the same step
        due = bool(test_sets) and (done % config.train.eval_every == 0 or done == steps)
        if due and not stop:
            history["after"] = evaluate(done)
            due = False  # done: not left to a resumed run
            stop = dist.any_process(bool(preempted))  # an evaluation can be long: asked again after it
        every_s = config.train.save_every_s  # a checkpoint every so many seconds too (the hosts agree)
        timely = bool(every_s) and dist.any_process(time.monotonic() - saved["time"] >= every_s)
        if done % config.train.save_every == 0 or done == steps or timely or stop:
            save(done, eval_pending=due and stop, data_state=data_after, stopping=stop)
        if stop:
            stopped_at(done)
            stopped = True
            break

    ckpt.close()
    preempted.close(stopping=stopped)
    finished = not stopped
    history["compile"] = (compile_log.programs - compiled_before[0], compile_log.seconds - compiled_before[1],
                          compile_log.programs - history.get("warm", compile_log.programs))
    compile_log.warm(False)  # training is over: the export's programs (a LoRA merge) are not late compiles
    export_dir = None
    if finished and config.train.export_at_end:
        export_dir = save_pretrained(*lora.plain(model_cfg, params), run_dir / "export", tokenizer_dir=model_path)
        if folder.remote is not None:
            export_dir = folder.remote / "export"  # copied up with the records below
    summary = summarize(config, history, started, export_dir, preempted=not finished,
                        chance=chance_levels(test_sets))
    writer.summary(start_step + len(history["reward"]), summary["text"], summary["scalars"])
    writer.close()
    if jax.process_index() == 0:
        folder.sync()  # the last steps' records, TensorBoard's events and the export, to a bucket's run folder
    dist.barrier("arlopti_end")  # the other processes leave once process 0 has written everything
    return summary


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


def chance_levels(test_sets: dict) -> dict[str, float | None]:
    """Per test set, the accuracy of guessing (mean over its rows; None where a row's data
    source does not define one)."""
    out = {}
    for name, data in test_sets.items():
        levels = [guess_accuracy(r["data_source"]) for r in data.rows]
        out[name] = float(np.mean(levels)) if levels and None not in levels else None
    return out


def reward_trend(rewards: list[float]) -> tuple[float, float, float] | None:
    """(first-quarter mean, last-quarter mean, their difference in standard errors of the
    difference) of the per-step training reward; None with fewer than 8 steps."""
    k = len(rewards) // 4
    if k < 2:
        return None
    first, last = np.asarray(rewards[:k]), np.asarray(rewards[-k:])
    se = np.sqrt(first.var(ddof=1) / k + last.var(ddof=1) / k)
    return float(first.mean()), float(last.mean()), float((last.mean() - first.mean()) / se) if se > 0 else 0.0


def summarize(config, history, started, export_dir, preempted, chance: dict | None = None) -> dict:
    minutes = (time.time() - started) / 60
    lines = ["", "=" * 72, f"arlopti_jax: {'stopped (preempted)' if preempted else 'finished'} in {minutes:.1f} min",
             f"run folder: {config.run_dir}   tensorboard --logdir {config.run_dir}"]
    rewards = history["reward"]
    trend = reward_trend(rewards)
    if trend:
        lines.append(f"train reward: first quarter {trend[0]:.3f} -> last quarter {trend[1]:.3f} "
                     f"({trend[2]:+.1f} standard errors, {len(rewards)} steps)")
    elif rewards:
        lines.append(f"train reward: mean {np.mean(rewards):.3f} over {len(rewards)} steps")
    before, after = history["before"], history["after"]
    if before and after:
        lines.append("evaluation before -> after:")
        lines.append(compare_table(before, after, history["eval_settings"], chance))
    elif after:
        lines.append(format_table(after, history["eval_settings"]))
    if "compile" in history:
        programs, seconds, late = history["compile"]
        lines.append(f"compiled: {programs} programs in {seconds:.1f} s, {late} of them after the first step"
                     + (" (each logged as a warning)" if late else ""))
    if export_dir:
        lines.append(f"exported policy: {export_dir}")
    lines.append("=" * 72)
    if jax.process_index() == 0:
        print("\n".join(lines))
    scalars = {"summary/minutes": minutes, "summary/steps": float(len(rewards)), "summary/preempted": float(preempted),
               **{f"summary/{k}": v for k, v in (after or {}).items()}}
    if trend:
        scalars.update(zip(("summary/reward_first_quarter", "summary/reward_last_quarter", "summary/reward_trend_se"),
                           trend))
    if "compile" in history:
        scalars.update(zip(("summary/compiled_programs", "summary/compile_seconds", "summary/late_compiles"),
                           map(float, history["compile"])))
    return {"minutes": minutes, "before": before, "after": after, "rewards": rewards, "preempted": preempted,
            "reward_trend": trend, "chance": chance, "compile": history.get("compile"),
            "text": "\n".join(lines).strip("\n="), "scalars": scalars}
