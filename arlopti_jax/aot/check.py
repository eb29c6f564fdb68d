"""Compile one RL step's programs for a compile-only target and read what the compiler says.

``check(config, target)`` builds the run exactly as ``train`` does (``run_setup.assemble``) on
a mesh of the target's compile-only devices (the trainer's and, with ``rollout.devices``, the
sampler's own), with abstract parameters, optimizer state and batches (``jax.ShapeDtypeStruct``s in
the run's shardings; nothing is allocated), then lowers and compiles every program one RL step runs:

- sync: the sampler's copy of the step's policy version and its checksums, or the weight sync onto
  the sampler's own mesh (``aot/copies.py``: which programs, on which mesh, what they keep resident);
- rollout: the sampler's prefill, start and decode loop(s), and with ``rollout.length_aware``
  every compaction, growth and scatter its schedule can reach (``Sampler.schedule``, which
  ``train``'s warm-up compiles too), reading the copy the sampler reads; with tool episodes
  (``env.name``) the episodes' programs instead (``EpisodeSampler.schedule``, the warm-up's list
  too: the prefill, ``episode start``, and per row bucket and phase a decode loop, a ``resume``
  that feeds the observations, a compaction, a growth and a scatter; none depends on the number
  of turns);
- log-probs: the packed teacher-forced pass, for pi_old wherever the trainer recomputes it
  (``update.recompute_old_logprobs``) and for the reference policy's (the KL term), one program for
  both (``runs`` says which), and pi_old's entropies where the token selection reads them;
- update: the gradient accumulator's zeros, the accumulate of a packed micro-batch and the
  optimizer step.

The packed passes (log-probs, accumulate) compile for every shape of the run's set
(``packing.Shapes``: what ``train`` compiles with its first batch) on ``local``, or for the
shape of the step's memory peak alone on a compile-only target unless ``all_shapes``.

The sampler's prompt width is the run's: that of the longest prompt of the config's data when the
model's tokenizer and the data files are on this machine (``data_prompt_width``), as ``train``
pads every batch; else ``data.max_prompt_length``. Batches are the worst case: every prompt at
``data.max_prompt_length`` and every response at ``rollout.max_response_length``, packed by the
trainer's own packer (the micro-batch shape of the step's memory peak; shorter sequences pack
into the same budget or a smaller shape).

Per program: compile seconds, the compiler's per-device memory (arguments, outputs,
temporaries, aliased), flops and bytes accessed (XLA:TPU's cost analysis; on a GPU, which reports
none, the matrix FLOPs and the bytes are counted from the optimized HLO, ``hlo.Module``, layer
loops multiplied), the compiler's time estimate (TPU; only for
programs without loops, where it is meaningful; ``hlo.tpu_estimate`` removes libtpu's -1 s per
``ConcatBitcast`` call), and the collectives in the optimized HLO. Its peak per device
(``aot/compiler.py``) adds what stays resident on its mesh (parameters, optimizer state, the
reference policy, the copies of the policy versions in flight) and what is alive beside it (the
sampler's copy of the weights through a rollout; colocated at k >= 1 the sampler's state while the
log-prob passes and the update run between its programs; a weight sync's buffers in flight) to its
own arguments, outputs and temporaries. Each mesh's peak is the largest of its programs'.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax.aot import copies, targets
from arlopti_jax.aot.compiler import Compiler, DoesNotFit, Program, abstract, advice, shard_bytes
from arlopti_jax.aot.targets import GIB, Target
from arlopti_jax.models import lora
from arlopti_jax.rl import run_setup
from arlopti_jax.rl.episode_host import rollout_programs
from arlopti_jax.rl.update import recompute_old_logprobs
from arlopti_jax.rollout.sampling import bucket
from arlopti_jax.runtime import sharding as shd

__all__ = ["DoesNotFit", "advice", "check", "does_not_fit_line", "prepare"]

HEADROOM = 0.95  # of the chip's memory a program may use (XLA reserves some; fragmentation)


def worst_case_batch(run: run_setup.Run) -> tuple[dict, np.ndarray, list]:
    """A mini-batch whose every sequence has the longest prompt and response (dense host arrays),
    its rows, and its packing plan (the first micro-batch is the step's memory peak)."""
    c = run.config
    width = bucket(c.data.max_prompt_length, c.rollout.prompt_bucket)
    r = c.rollout.max_response_length
    rows = c.train.mini_batch
    attention = np.zeros((rows, width + r), np.int32)
    attention[:, width - c.data.max_prompt_length:] = 1
    response = np.zeros_like(attention)
    response[:, width:] = 1
    ids = np.zeros_like(attention)
    ids[:, :width] = 1 + np.arange(rows)[:, None] // c.rollout.n  # a prompt per group of n, as sampled
    order = np.arange(rows)
    plan = run.train_step.plan({"attention_mask": attention, "response_mask": response, "input_ids": ids}, order)
    floats = np.zeros(attention.shape, np.float32)
    batch = {"input_ids": ids, "attention_mask": attention, "response_mask": response, "old_logprobs": floats,
             "advantages": floats, "loss_mask": response, "ref_logprobs": floats}
    return batch, order, plan


def micro_batch_arrays(run: run_setup.Run, batch: dict, order: np.ndarray, rows: int, length: int) -> tuple[dict, dict]:
    """The host arrays of a packed micro-batch of ``rows`` x ``length`` (all devices): the update's
    and the log-prob pass's, as the trainer gathers them."""
    step, ids = run.train_step, {"input_ids": batch["input_ids"]}
    empty = step.accumulate_programs.empty_arrays
    return (empty(rows, length, ids, step.targets(batch, order)),
            empty(rows, length, ids, {"target_ids": ids["input_ids"]}))


@contextlib.contextmanager
def no_persistent_cache():
    """JAX's persistent compilation cache off for the programs compiled inside, and back as it was
    after (JAX decides once per process unless its cache state is reset): the executables of
    compile-only devices cannot be serialized into it, and an entry of one cannot be read back."""
    from jax._src import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()


def model_shape(config) -> tuple:
    """(ModelConfig, eos ids, pad id) without weights: the model folder's config.json (and its
    tokenizer's special ids when present), a Qwen2.5 preset for a known folder name that is not
    here, or the embedded start point's shape."""
    from arlopti_jax.aot import shapes

    return shapes.for_config(config)


GROUPS = ("sync", "rollout", "logprobs", "update")


def data_prompt_width(config) -> int:
    """The longest prompt of the config's training and test data, as ``train`` finds it (the model's
    tokenizer, ``data.max_prompt_length``'s filter), or 0 when the model folder (the embedded start
    point's too: it is not built here) or the data are not on this machine."""
    try:
        model_path, train_files, test_files = run_setup.resolve_paths(config, build=False)
        tokenizer = run_setup.load_tokenizer(model_path)
        return run_setup.longest_prompt(run_setup.prompt_dataset(config, files, tokenizer)
                                        for files in [train_files, *([f] for f in test_files)])
    except (FileNotFoundError, ValueError, OSError):
        return 0


def prepare(config, target: Target):
    """(``run_setup.Layout``: the trainer's mesh, the sampler's own, the hosts' roles; model shape) of
    ``config`` on ``target``: the config validated for its device count, the layout for its hosts
    (ConfigError: tensor parallelism across hosts, a batch the processes do not divide, sampler hosts
    the job cannot hold), the model's shape found (FileNotFoundError)."""
    from arlopti_jax.runtime import distributed as dist
    from arlopti_jax.config import validate

    devices = targets.devices(target)
    # the target's platform: cuDNN attention for an H100 compiles here
    validate(config, len(devices), target.platform, shd.slice_count(devices))
    layout = run_setup.make_layout(config, devices=list(devices))
    dist.validate(config, layout.mesh)
    return layout, model_shape(config)


def check(config, target: Target, *, verbose: bool = False, eval_programs: bool = False,
          groups: tuple[str, ...] = GROUPS, all_shapes: bool | None = None) -> dict:
    """Compile one RL step of ``config`` for ``target`` (the programs of ``groups``): the JSON
    record (module docstring). ``all_shapes``: the packed passes for every shape of the run's
    set (``packing.Shapes``), as ``train`` compiles them; else for the peak micro-batch's shape
    alone. Default: all for ``local``, the peak's for a compile-only target."""
    all_shapes = target.name == "local" if all_shapes is None else all_shapes
    layout, (model_cfg, eos, pad, source) = prepare(config, target)
    mesh, sampler_mesh = layout.mesh, layout.sampler_mesh
    width = data_prompt_width(config)
    run = run_setup.assemble(config, mesh, model_cfg, eos_ids=eos, pad_id=pad,
                             total_steps=max(1, config.train.max_steps), prompt_width=width,
                             device_memory=None if target.name == "local" else target.hbm_bytes,
                             sampler_mesh=sampler_mesh)
    longest = width or config.data.max_prompt_length
    params, opt_state = run.state["params"], run.state["opt_state"]
    plan = copies.plan(run, params, mirrored=layout.roles is not None)
    trainer_copies, sampler_resident = plan.resident()
    state = {"parameters": shard_bytes(params), "AdamW state": shard_bytes(opt_state)}
    if run.use_reference and not run.model_cfg.lora_rank:  # a LoRA reference is the base itself
        state["the reference policy"] = shard_bytes(params)
    dump = Path(tempfile.mkdtemp(prefix="arlopti_aot_")) if target.platform == "gpu" else None
    compiler = Compiler(target, {**state, **trainer_copies}, verbose, dump)
    compiler.resident_leaves = {id(x) for x in jax.tree.leaves((params, opt_state))}
    rollouts = compiler
    if plan.own_mesh:  # the rollouts on the sampler's own devices, with its copies resident there
        rollouts = Compiler(target, sampler_resident, verbose, dump, mesh="sampler", programs=compiler.programs)
        rollouts.resident_leaves = {id(x) for x in jax.tree.leaves((plan.copy, plan.frozen))}
    elif plan.versions:  # colocated at k >= 1: the rollouts read a version's copy, resident beside the state
        compiler.resident_leaves |= {id(x) for x in jax.tree.leaves(plan.copy)}
    started = time.perf_counter()
    c = config
    recompute = recompute_old_logprobs(c, run.model_cfg, sampler_mesh)
    transfers = []
    with contextlib.ExitStack() as cleanup:
        if target.name != "local":
            cleanup.enter_context(no_persistent_cache())
        if dump is not None:
            cleanup.callback(shutil.rmtree, dump, ignore_errors=True)
        if "sync" in groups:
            transfers = copies.compile_sync(plan, compiler, rollouts if plan.own_mesh else None)
        rollouts.group = "rollout"
        if "rollout" in groups:  # with env.name, the episodes' programs (the warm-up's list)
            rollout_programs(c, run.rollout_sampler).programs(plan.rollout_params(params), c.train.batch_prompts,
                                                              longest, c.rollout.n, run.sampling(), rollouts)
        if eval_programs:
            compiler.group = "eval"
            cap = c.train.batch_prompts * c.rollout.n
            evaluations = rollout_programs(c, run.sampler)
            evaluations.programs(params, cap, longest, 1, run.sampling(greedy=True), compiler)
            evaluations.programs(params, max(1, cap // c.train.eval_n), longest, c.train.eval_n,
                                 run.sampling(temperature=c.train.eval_temperature), compiler)
        batch, order, packing = worst_case_batch(run)
        step = run.train_step
        shapes = step.accumulate_programs.keys() if all_shapes else [packing[0].token_src.shape]
        arrays = {shape: micro_batch_arrays(run, batch, order, *shape) for shape in shapes}
        row = step.row_sharding
        spec = lambda arrays: {k: abstract(v.shape, v.dtype, row) for k, v in arrays.items()}
        entropy = bool(run.weight_cfg.entropy_top_fraction)  # pi_old's entropies (80/20): with pi_old's pass
        plain = ["the reference policy"] * run.use_reference + ["pi_old"] * (recompute and not entropy)
        beside_logprobs, beside_update = copies.overlap(plan, compiler.programs)
        with shd.activate(mesh, step.rules):
            compiler.group = "logprobs"
            compiler.beside = {**copies.in_flight(plan, compiler.programs), **beside_logprobs}
            for shape, (_, logprob_host) in arrays.items():
                compiler.runs = plain
                if "logprobs" in groups and plain:
                    compiler(f"log-probs {_shape(shape)}", run.logprobs.jitted, params, spec(logprob_host))
                compiler.runs = ["pi_old and its entropies" if recompute else "pi_old's entropies"]
                if "logprobs" in groups and entropy:
                    compiler(f"log-probs+entropy {_shape(shape)}", run.logprobs.with_entropy_jitted, params,
                             spec(logprob_host))
            compiler.group, compiler.runs = "update", []
            compiler.beside = {**copies.in_flight(plan, compiler.programs), **beside_update}
            if "update" in groups:
                trained, frozen = lora.trainable(run.model_cfg, params)  # the adapters and the base with LoRA
                acc = compiler("zeros", step._zeros, trained)
                for shape, (host, _) in arrays.items():
                    compiler(f"accumulate {_shape(shape)}", step._accumulate, trained, frozen, acc, spec(host))
                compiler("apply (clip + AdamW)", step._apply, trained, opt_state, acc,
                         abstract((), jnp.float32, shd.replicated(mesh)))
    record = report(config, target, run, compiler.programs, time.perf_counter() - started, source, packing)
    meshes = {"trainer": (mesh, {**state, **trainer_copies})}
    if plan.own_mesh:
        meshes["sampler"] = (sampler_mesh, sampler_resident)
    record["meshes"] = {name: mesh_record(m, parts, [p for p in compiler.programs if p.mesh == name])
                        for name, (m, parts) in meshes.items()}
    record["resident_bytes_per_device"] = record["meshes"]["trainer"]["resident_bytes_per_device"]
    record["copies"] = {"max_staleness": plan.k, "versions": plan.versions, "own_mesh": plan.own_mesh,
                        "sampler_hosts": plan.mirrored,
                        "bytes_per_device": plan.copy_bytes if plan.versions else 0,
                        "dtype": str(jax.tree.leaves(plan.copy)[0].dtype) if plan.versions else None,
                        "recompute_old_logprobs": recompute, "transfers": transfers}
    return record


def mesh_record(mesh, resident: dict[str, int], programs: list[Program]) -> dict:
    """One mesh's devices, its resident state by part, and its peak (the largest of its programs')."""
    peak = max(programs, key=lambda p: p.peak, default=None)
    return {"mesh": {k: int(v) for k, v in mesh.shape.items()}, "devices": int(mesh.devices.size),
            "processes": len({d.process_index for d in mesh.devices.flat}), "resident": resident,
            "resident_bytes_per_device": sum(resident.values()),
            "peak_program": None if peak is None else f"{peak.group} {peak.name}",
            "peak_bytes_per_device": 0 if peak is None else peak.peak}


def _shape(shape: tuple[int, int]) -> str:
    rows, length = shape
    return f"{rows}x{length}"


def report(config, target: Target, run, programs: list[Program], seconds: float, source: str, plan: list) -> dict:
    at = max(range(len(programs)), key=lambda i: programs[i].peak, default=None)
    peak = programs[at] if programs else Program("", "", "trainer", 0.0, {}, 0, 0, {}, None, None, None, 0.0, 0.0,
                                                 True, {})
    usable = int(target.hbm_bytes * HEADROOM)
    c = config
    slices = shd.slice_count(run.mesh.devices.flat)
    return {
        "target": target.name,
        "target_label": target.label,
        "platform": target.platform,
        "jax": jax.__version__,
        "model": source,
        "model_params": run.model_cfg.num_params(),
        "mesh": {k: int(v) for k, v in run.mesh.shape.items()},
        "processes": len({d.process_index for d in run.mesh.devices.flat}),
        "slices": slices,
        "dcn_data": shd.resolve_layout(dict(c.mesh), run.mesh.devices.size, slices)[1]["data"],
        "batch": {"prompts": c.train.batch_prompts, "n": c.rollout.n,
                  "prompt_slots": run.sampling().width(run.prompt_width or c.data.max_prompt_length),
                  "response": c.rollout.max_response_length, "mini_batch": c.train.mini_batch,
                  "tokens_per_device": run.tokens_per_device, "micro_batches_per_mini_batch": len(plan),
                  "optimizer_steps_per_rl_step": run_setup.optimizer_steps_per_rl_step(c)},
        "programs": [p.record() for p in programs],
        "peak_program": peak.name,
        "peak_index": at,  # in programs: a name can be on both meshes (fingerprint)
        "peak_bytes_per_device": peak.peak,
        "device_memory_bytes": target.hbm_bytes,
        "usable_bytes_per_device": usable,
        "fits": peak.peak <= usable,
        "compile_s": round(seconds, 1),
    }


def does_not_fit_line(record: dict) -> str:
    peak = record["programs"][record["peak_index"]]
    resident = peak["resident"]
    on = f" on the sampler's {record['meshes']['sampler']['devices']} devices" if peak["mesh"] == "sampler" else ""
    return (f"{record['target']}: the {peak['group']} program '{peak['name']}'{on} needs "
            f"{record['peak_bytes_per_device'] / GIB:.1f} GiB per device, more than the "
            f"{record['usable_bytes_per_device'] / GIB:.1f} GiB usable of "
            f"{record['device_memory_bytes'] / GIB:.1f} GiB: "
            f"{advice(peak['group'], resident >= peak['peak_bytes_per_device'] - resident, peak['name'])}")
