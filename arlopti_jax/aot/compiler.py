"""Compiling one program for a compile-only target and reading what the compiler says (``Compiler``),
with the memory the rest of the step keeps on the program's mesh while it runs.

A program's peak per device is its own arguments, outputs and temporaries (the compiler's), plus what
stays resident on its mesh through the step (``Compiler.resident``: named parts, such as the
parameters, the AdamW state, the copies of the policy versions in flight) less the resident arrays
it takes as arguments (counted once), plus what is alive beside it (``Compiler.beside``: named parts
the caller sets for the programs it compiles next, such as the sampler's state while the update runs
between its programs, or a weight sync's buffers in flight), plus, in the rollout's programs, the
sampler's copy of the weights, which a ``generate`` holds from its first program to its last.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import time
from pathlib import Path

import jax
import numpy as np

from arlopti_jax.aot import hlo
from arlopti_jax.aot.targets import GIB, Target
from arlopti_jax.rollout.sampler import SAMPLING_WEIGHTS

SAMPLER_WEIGHTS = "the sampler's weights"  # ``beside``'s name of the copy a generate holds


class DoesNotFit(RuntimeError):
    """A program needs more memory per device than the chip has (one line: which, how much, what to change)."""


@dataclasses.dataclass
class Program:
    name: str
    group: str  # sync | rollout | logprobs | update | eval
    mesh: str  # trainer | sampler: the devices it runs on
    compile_s: float
    memory: dict[str, int]  # argument, output, temp, alias (bytes per device)
    resident: int  # bytes per device resident on its mesh while it runs (``Compiler.resident``)
    resident_args: int  # of those, the bytes its arguments hold (counted once)
    beside: dict[str, int]  # bytes per device alive beside it, by what they are
    flops: float | None  # XLA:TPU's cost analysis (a loop's body counted once: see loop_free)
    bytes_accessed: float | None  # likewise
    estimate_s: float | None  # XLA:TPU's time estimate, loop-free programs only
    hlo_bytes: float  # the optimized HLO's memory traffic, loops with a known trip count multiplied
    hlo_flops: float  # the optimized HLO's matrix FLOPs (``hlo.Module.flops``), likewise: a GPU's only count
    loop_free: bool
    collectives: dict
    runs: list[str] = dataclasses.field(default_factory=list)  # what it computes where one program serves several
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


def like(tree, dtype=None, shardings=None):
    """Abstract arrays shaped as ``tree``'s, distinct from them: in ``dtype`` where a leaf is floating
    (None: its own), in ``shardings`` (a matching tree; None: each leaf's own)."""
    shardings = jax.tree.map(lambda x: x.sharding, tree) if shardings is None else shardings
    cast = lambda x: dtype if dtype is not None and np.issubdtype(x.dtype, np.floating) else x.dtype
    return jax.tree.map(lambda x, sh: abstract(x.shape, cast(x), sh), tree, shardings)


def advice(group: str, resident_dominates: bool = False, program: str = "") -> str:
    """What to change when ``program`` (of ``group``) does not fit."""
    if program.startswith(("grow", "compact")) and not resident_dominates:
        return (f"'{program}' holds two KV caches at once (the old and the one it copies into): decode in one phase "
                "without compaction (rollout.phase_tokens=rollout.max_response_length, rollout.min_rows=the rows "
                "per batch shard, as configs/layouts/v5e16.py does for 7B), or fewer train.batch_prompts or "
                "rollout.n per step, or more batch shards (mesh.data x mesh.fsdp)")
    if resident_dominates:
        return ("the resident state dominates (parameters, AdamW moments, the reference policy, the copies of the "
                "policy versions in flight): shard it over more devices (mesh.fsdp), or model.param_dtype=bfloat16, "
                "or loss.kl_coef=0 (no reference copy), or a smaller rollout.max_staleness (one copy per version)")
    if group == "sync":
        return ("the weight sync's buffers dominate (with several processes every array is gathered whole on a "
                "trainer device before it crosses): more trainer devices per process, or a sampler mesh as large")
    if group in ("rollout", "eval"):
        return ("the rollout's KV cache dominates: fewer train.batch_prompts or rollout.n per step, a shorter "
                "rollout.max_response_length, more batch shards (mesh.data x mesh.fsdp), or mesh.tensor up to the "
                "kv-head count")
    return ("the update's activations dominate: a smaller train.max_tokens_per_micro_batch (or train.micro_batch), "
            "model.remat=True, or mesh.tensor=2")


class Compiler:
    """Compiles programs for a target on one mesh (``mesh``: trainer or sampler), recording a
    ``Program`` each in ``programs`` (``verbose``: a line each). ``resident``: the named bytes per
    device resident on the mesh; ``resident_leaves``: the ids of the abstract arrays that hold them;
    ``group``, ``beside`` and ``runs``: set by the caller for the programs it compiles next."""

    def __init__(self, target: Target, resident: dict[str, int], verbose: bool, dump: Path | None,
                 mesh: str = "trainer", programs: list | None = None):
        self.target, self.resident, self.verbose, self.dump, self.mesh = target, dict(resident), verbose, dump, mesh
        self.programs: list[Program] = [] if programs is None else programs
        self.group = ""
        self.beside: dict[str, int] = {}
        self.runs: list[str] = []
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
        beside = {k: v for k, v in self.beside.items() if v}
        # the sampler's copy of the weights stays alive through its group's programs (``generate``), an
        # argument of some (prefill, decode) and not of the others (start, compact, grow, scatter)
        group, held, held_bytes = self.held
        if group == self.group:
            beside[SAMPLER_WEIGHTS] = held_bytes - sum(shard_bytes(leaf) for leaf in jax.tree.leaves(args)
                                                       if id(leaf) in held)
        text = compiled.as_text()
        module = hlo.Module(text)
        cost = compiled.cost_analysis() or {}
        if isinstance(cost, (list, tuple)):  # older JAX: one dict per device
            cost = cost[0] if cost else {}
        loop_free = not module.loops()
        estimate = cost.get("optimal_seconds")
        total = sum(self.resident.values())
        program = Program(
            name=name, group=self.group, mesh=self.mesh, compile_s=round(seconds, 2), memory=memory, resident=total,
            resident_args=resident, beside={k: v for k, v in beside.items() if v}, flops=cost.get("flops"),
            bytes_accessed=cost.get("bytes accessed"),
            estimate_s=hlo.tpu_estimate(estimate, text) if loop_free else None, hlo_bytes=module.bytes(),
            hlo_flops=module.flops(), loop_free=loop_free,
            collectives={k: v for k, v in module.collectives().items() if v["count"]}, runs=list(self.runs))
        program.peak = (total - resident + sum(program.beside.values()) + memory["argument"] + memory["output"]
                        - memory["alias"] + memory["temp"])
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
