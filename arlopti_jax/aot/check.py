"""Compile one RL step's programs for a compile-only target and read what the compiler says.

``check(config, target)`` builds the run exactly as ``train`` does (``run_setup.assemble``) on
a mesh of the target's compile-only devices, with abstract parameters, optimizer state and
batches (``jax.ShapeDtypeStruct``s in the trainer's shardings; nothing is allocated), then
lowers and compiles every program one RL step runs:

- rollout: the sampler's prefill, start and decode loop(s), and with ``rollout.length_aware``
  every compaction, growth and scatter its schedule can reach (``Sampler.schedule``, which
  ``train``'s warm-up compiles too);
- log-probs: the packed teacher-forced pass (the reference policy's, and pi_old's with
  ``rollout.recompute_old_logprobs``), when the config runs it;
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
``ConcatBitcast`` call), and the collectives in the optimized HLO.
The step's per-device peak adds what stays resident across programs (parameters, optimizer
state, the reference policy; in a rollout's programs also the sampler's copy of the weights,
which a ``generate`` holds from its first program to its last) to each program's own arguments,
outputs and temporaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax.models import lora
from arlopti_jax.rl import run_setup
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.aot import hlo, targets
from arlopti_jax.aot.targets import GIB, Target
from arlopti_jax.rollout.sampler import SAMPLING_WEIGHTS
from arlopti_jax.rollout.sampling import bucket

HEADROOM = 0.95  # of the chip's memory a program may use (XLA reserves some; fragmentation)


class DoesNotFit(RuntimeError):
    """A program needs more memory per device than the chip has (one line: which, how much, what to change)."""


@dataclasses.dataclass
class Program:
    name: str
    group: str  # rollout | logprobs | update
    compile_s: float
    memory: dict[str, int]  # argument, output, temp, alias (bytes per device)
    resident_args: int  # bytes per device of the arguments that stay resident (params, optimizer state)
    flops: float | None  # XLA:TPU's cost analysis (a loop's body counted once: see loop_free)
    bytes_accessed: float | None  # likewise
    estimate_s: float | None  # XLA:TPU's time estimate, loop-free programs only
    hlo_bytes: float  # the optimized HLO's memory traffic, loops with a known trip count multiplied
    hlo_flops: float  # the optimized HLO's matrix FLOPs (``hlo.Module.flops``), likewise: a GPU's only count
    loop_free: bool
    collectives: dict
    peak: int = 0  # bytes per device while this program runs (resident state included)
    gpu: dict | None = None  # GPU: launches per loop body (``hlo.launches``)

    def record(self) -> dict:
        out = dataclasses.asdict(self)
        out["peak_bytes_per_device"] = out.pop("peak")
        return out


def shard_bytes(tree) -> int:
    """Per-device bytes of a tree of sharded abstract arrays (the largest shard of each leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return int(total)


def abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


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


class Compiler:
    """Compiles programs for a target, recording a ``Program`` each (``verbose``: a line each)."""

    def __init__(self, target: Target, resident: int, verbose: bool, dump: Path | None):
        self.target, self.resident, self.verbose, self.dump = target, resident, verbose, dump
        self.programs: list[Program] = []
        self.group = ""
        self.resident_leaves: set[int] = set()
        self.held: tuple[str, set[int], int] = ("", set(), 0)  # (group, leaves, bytes): the sampler's weights

    def __call__(self, name: str, jitted, *args, **kwargs):
        options = {}
        if self.dump is not None:  # XLA:GPU's thunk sequence: the launches (kernels, command buffers)
            folder = self.dump / f"{len(self.programs):03d}"
            options = {"xla_dump_to": str(folder), "xla_dump_hlo_pass_re": "^$"}
        start = time.perf_counter()
        lowered = jitted.lower(*args, **kwargs)
        try:
            compiled = lowered.compile(compiler_options=options or None)
        except Exception as err:  # XLA reports a program that cannot fit as RESOURCE_EXHAUSTED
            if "RESOURCE_EXHAUSTED" in str(err):
                first = next((line for line in str(err).splitlines() if "RESOURCE_EXHAUSTED" in line), str(err))
                xla = re.sub(r"(\d+(?:\.\d+)?)G\b", r"\1 GiB", first.split("RESOURCE_EXHAUSTED:")[-1].strip())
                raise DoesNotFit(f"{self.target.name}: the {self.group} program '{name}' does not fit "
                                 f"({xla[:240]}): {advice(self.group)}") from None
            raise
        seconds = time.perf_counter() - start
        m = compiled.memory_analysis()
        memory = {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
                  "temp": int(m.temp_size_in_bytes), "alias": int(m.alias_size_in_bytes)}
        resident = sum(shard_bytes(leaf) for leaf in jax.tree.leaves(args) if id(leaf) in self.resident_leaves)
        # the sampler's copy of the weights stays alive through its group's programs (``generate``), an
        # argument of some (prefill, decode) and not of the others (start, compact, grow, scatter)
        group, held, held_bytes = self.held
        held_extra = 0 if group != self.group else held_bytes - sum(
            shard_bytes(leaf) for leaf in jax.tree.leaves(args) if id(leaf) in held)
        text = compiled.as_text()
        module = hlo.Module(text)
        cost = compiled.cost_analysis() or {}
        if isinstance(cost, (list, tuple)):  # older JAX: one dict per device
            cost = cost[0] if cost else {}
        loop_free = not module.loops()
        estimate = cost.get("optimal_seconds")
        program = Program(
            name=name, group=self.group, compile_s=round(seconds, 2), memory=memory, resident_args=resident,
            flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"),
            estimate_s=hlo.tpu_estimate(estimate, text) if loop_free else None,
            hlo_bytes=module.bytes(), hlo_flops=module.flops(), loop_free=loop_free,
            collectives={k: v for k, v in module.collectives().items() if v["count"]})
        program.peak = (self.resident - resident + held_extra + memory["argument"] + memory["output"] - memory["alias"]
                        + memory["temp"])
        if self.dump is not None:
            program.gpu = gpu_launches(folder, jitted)
        self.programs.append(program)
        outs = jax.tree.map(lambda info, sh: abstract(info.shape, info.dtype, sh), lowered.out_info,
                            compiled.output_shardings)
        if name == SAMPLING_WEIGHTS:
            self.held = (self.group, {id(x) for x in jax.tree.leaves(outs)}, shard_bytes(outs))
        if self.verbose:
            print(f"  {self.group:8s} {name:32s} {seconds:6.1f} s  peak {program.peak / GIB:6.2f} GiB", flush=True)
        return outs


def gpu_launches(folder: Path, jitted) -> dict | None:
    """Launches of the program's loop bodies from XLA:GPU's dumped thunk sequence: for each
    while loop (outermost first), kernels launched outside command buffers, command buffers, and
    the kernels inside them, per iteration."""
    name = getattr(jitted, "__name__", None) or getattr(getattr(jitted, "__wrapped__", None), "__name__", "")
    found = sorted(Path(folder).glob("*thunk_sequence_after_thunk_passes.txt"))
    text = found[-1].read_text() if found else None
    shutil.rmtree(folder, ignore_errors=True)
    if text is None:
        return None
    thunks = hlo.parse_thunks(text)
    return {"program": hlo.launches(thunks), "loops": [hlo.launches(body) for body in hlo.while_bodies(thunks)],
            "function": name}


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


GROUPS = ("rollout", "logprobs", "update")


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
    """(mesh, model shape) of ``config`` on ``target``: the config validated for its device count,
    the layout for its hosts (ConfigError: tensor parallelism across hosts, a batch the processes do
    not divide), the model's shape found (FileNotFoundError)."""
    from arlopti_jax.runtime import distributed as dist
    from arlopti_jax.config import validate

    devices = targets.devices(target)
    # the target's platform: cuDNN attention for an H100 compiles here
    validate(config, len(devices), target.platform, shd.slice_count(devices))
    mesh = run_setup.make_mesh(config, devices=list(devices))
    dist.validate(config, mesh)
    return mesh, model_shape(config)


def check(config, target: Target, *, verbose: bool = False, eval_programs: bool = False,
          groups: tuple[str, ...] = GROUPS, all_shapes: bool | None = None) -> dict:
    """Compile one RL step of ``config`` for ``target`` (the programs of ``groups``): the JSON
    record (module docstring). ``all_shapes``: the packed passes for every shape of the run's
    set (``packing.Shapes``), as ``train`` compiles them; else for the peak micro-batch's shape
    alone. Default: all for ``local``, the peak's for a compile-only target."""
    all_shapes = target.name == "local" if all_shapes is None else all_shapes
    mesh, (model_cfg, eos, pad, source) = prepare(config, target)
    sampler_mesh = run_setup.make_sampler_mesh(config, targets.devices(target))
    width = data_prompt_width(config)
    run = run_setup.assemble(config, mesh, model_cfg, eos_ids=eos, pad_id=pad,
                             total_steps=max(1, config.train.max_steps), prompt_width=width,
                             device_memory=None if target.name == "local" else target.hbm_bytes,
                             sampler_mesh=sampler_mesh)
    longest = width or config.data.max_prompt_length
    params, opt_state = run.state["params"], run.state["opt_state"]
    copies = 2 if run.use_reference and not run.model_cfg.lora_rank else 1  # a LoRA reference is the base itself
    resident = shard_bytes(params) * copies + shard_bytes(opt_state)
    dump = Path(tempfile.mkdtemp(prefix="arlopti_aot_")) if target.platform == "gpu" else None
    compiler = Compiler(target, resident, verbose, dump)
    compiler.resident_leaves = {id(x) for x in jax.tree.leaves((params, opt_state))}
    started = time.perf_counter()
    c = config
    compile_only = target.name != "local"
    with contextlib.ExitStack() as cleanup:
        if compile_only:
            cleanup.enter_context(no_persistent_cache())
        if dump is not None:
            cleanup.callback(shutil.rmtree, dump, ignore_errors=True)
        compiler.group = "rollout"
        own = None
        if sampler_mesh is not None:  # the rollouts on the sampler's own devices, with its copies resident there
            own = sampler_side(run, params)
            rollouts = Compiler(target, own["resident"], verbose, dump)
            rollouts.group, rollouts.programs = "rollout", compiler.programs
            rollouts.resident_leaves = {id(x) for x in jax.tree.leaves(own["params"])}
        if "rollout" in groups:
            run.rollout_sampler.programs(params if own is None else own["params"], c.train.batch_prompts, longest,
                                         c.rollout.n, run.sampling(), compiler if own is None else rollouts)
        if eval_programs:
            compiler.group = "eval"
            cap = c.train.batch_prompts * c.rollout.n
            run.sampler.programs(params, cap, longest, 1, run.sampling(greedy=True), compiler)
            run.sampler.programs(params, max(1, cap // c.train.eval_n), longest, c.train.eval_n,
                                 run.sampling(temperature=c.train.eval_temperature), compiler)
        batch, order, plan = worst_case_batch(run)
        step = run.train_step
        shapes = step.accumulate_programs.keys() if all_shapes else [plan[0].token_src.shape]
        arrays = {shape: micro_batch_arrays(run, batch, order, *shape) for shape in shapes}
        row = step.row_sharding
        spec = lambda arrays: {k: abstract(v.shape, v.dtype, row) for k, v in arrays.items()}
        with shd.activate(mesh, step.rules):
            compiler.group = "logprobs"
            for shape, (_, logprob_host) in arrays.items():
                if "logprobs" in groups and (run.use_reference or c.rollout.recompute_old_logprobs):
                    compiler(f"log-probs {_shape(shape)}", run.logprobs.jitted, params, spec(logprob_host))
                if "logprobs" in groups and run.weight_cfg.entropy_top_fraction:  # pi_old's entropies (80/20)
                    compiler(f"log-probs+entropy {_shape(shape)}", run.logprobs.with_entropy_jitted, params,
                             spec(logprob_host))
            compiler.group = "update"
            if "update" in groups:
                trained, frozen = lora.trainable(run.model_cfg, params)  # the adapters and the base with LoRA
                acc = compiler("zeros", step._zeros, trained)
                for shape, (host, _) in arrays.items():
                    compiler(f"accumulate {_shape(shape)}", step._accumulate, trained, frozen, acc, spec(host))
                compiler("apply (clip + AdamW)", step._apply, trained, opt_state, acc,
                         abstract((), jnp.float32, shd.replicated(mesh)))
    record = report(config, target, run, compiler.programs, resident, time.perf_counter() - started, source, plan)
    if own is not None:
        sampler_programs = [p for p in record["programs"] if p["group"] == "rollout"]
        trainer_programs = [p for p in record["programs"] if p["group"] != "rollout"]
        record["sampler"] = {
            "mesh": {k: int(v) for k, v in sampler_mesh.shape.items()},
            "devices": int(sampler_mesh.devices.size), "trainer_devices": int(mesh.devices.size),
            "resident_bytes_per_device": own["resident"], "copies": own["copies"],
            "peak_bytes_per_device": max((p["peak_bytes_per_device"] for p in sampler_programs), default=0),
            "trainer_peak_bytes_per_device": max((p["peak_bytes_per_device"] for p in trainer_programs), default=0),
            "sync_bytes": own["sync_bytes"], "sync_bytes_per_sampler_device": own["sync_bytes_per_device"]}
    return record


def sampler_side(run, params) -> dict:
    """The sampler's own mesh's resident state, as ``train`` holds it (rl/loop.py, rl/pipeline.py): the
    copies of the policy versions in flight, max(1, k) + 1 at most (those a checkpoint holds and the one
    the step's sync makes), the trained part in the sampler's compute dtype (LoRA: the adapters as trained,
    the base once); and the bytes one weight sync moves, in all and into each sampler device."""
    from arlopti_jax.models import param_shardings
    from arlopti_jax.rl.pipeline import sync_dtype

    cfg, mesh = run.model_cfg, run.rollout_sampler.mesh
    shardings = param_shardings(cfg, mesh)
    cast = sync_dtype(cfg)
    moved = lambda x, sh: abstract(x.shape, cast if cast and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sh)
    trained, frozen = lora.trainable(cfg, params)
    sh_trained, sh_frozen = lora.trainable(cfg, shardings)
    copy = jax.tree.map(moved, trained, sh_trained)
    base = jax.tree.map(lambda x, sh: abstract(x.shape, x.dtype, sh), frozen, sh_frozen)
    copies = max(1, run.config.rollout.max_staleness) + 1
    return {"params": lora.whole(copy, base), "copies": copies,
            "resident": shard_bytes(copy) * copies + shard_bytes(base),
            "sync_bytes": int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(copy))),
            "sync_bytes_per_device": shard_bytes(copy)}


def _shape(shape: tuple[int, int]) -> str:
    rows, length = shape
    return f"{rows}x{length}"


def report(config, target: Target, run, programs: list[Program], resident: int, seconds: float, source: str,
           plan: list) -> dict:
    peak = max(programs, key=lambda p: p.peak)
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
        "resident_bytes_per_device": resident,
        "programs": [p.record() for p in programs],
        "peak_program": peak.name,
        "peak_bytes_per_device": peak.peak,
        "device_memory_bytes": target.hbm_bytes,
        "usable_bytes_per_device": usable,
        "fits": peak.peak <= usable,
        "compile_s": round(seconds, 1),
    }


def advice(group: str, resident_dominates: bool = False, program: str = "") -> str:
    """What to change when ``program`` (of ``group``) does not fit."""
    if program.startswith(("grow", "compact")) and not resident_dominates:
        return (f"'{program}' holds two KV caches at once (the old and the one it copies into): decode in one phase "
                "without compaction (rollout.phase_tokens=rollout.max_response_length, rollout.min_rows=the rows "
                "per batch shard, as configs/layouts/v5e16.py does for 7B), or fewer train.batch_prompts or "
                "rollout.n per step, or more batch shards (mesh.data x mesh.fsdp)")
    if resident_dominates:
        return ("the resident state dominates (parameters, AdamW moments, the reference policy): shard it over more "
                "devices (mesh.fsdp), or model.param_dtype=bfloat16, or loss.kl_coef=0 (no reference copy)")
    if group in ("rollout", "eval"):
        return ("the rollout's KV cache dominates: fewer train.batch_prompts or rollout.n per step, a shorter "
                "rollout.max_response_length, more batch shards (mesh.data x mesh.fsdp), or mesh.tensor up to the "
                "kv-head count")
    return ("the update's activations dominate: a smaller train.max_tokens_per_micro_batch (or train.micro_batch), "
            "model.remat=True, or mesh.tensor=2")


def does_not_fit_line(record: dict) -> str:
    peak = next(p for p in record["programs"] if p["name"] == record["peak_program"])
    resident = record["resident_bytes_per_device"]
    return (f"{record['target']}: the {peak['group']} program '{peak['name']}' needs "
            f"{record['peak_bytes_per_device'] / GIB:.1f} GiB per device, more than the "
            f"{record['usable_bytes_per_device'] / GIB:.1f} GiB usable of "
            f"{record['device_memory_bytes'] / GIB:.1f} GiB: "
            f"{advice(peak['group'], resident >= peak['peak_bytes_per_device'] - resident, peak['name'])}")
