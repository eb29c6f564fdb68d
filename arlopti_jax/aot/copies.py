"""The copies of the policy one RL step makes for the sampler, for ``check``: their programs, on which
mesh, and what each mesh holds because of them (``rl/pipeline.py`` runs them; ``rl/copy_programs.py``,
``pipeline.fingerprint_program`` and ``sharding.whole_program`` are the programs' one definition).

At step t the trainer copies version t (its trained parameters: with LoRA the adapters) for the
sampler, before the update donates them, and keeps one copy per version still needed: those that
sample the batches in flight, which a checkpoint holds too (``pipeline.checkpoint_versions``: k of
them), and the new one, so k + 1 through the step, k = ``rollout.max_staleness``:

- colocated (``rollout.devices=0``), k >= 1: ``sampler_copy`` on the trainer's mesh, the copy in the
  parameters' own dtype and sharding, resident beside the training state. The update's programs are
  dispatched between the sampler's (``pipeline.run_together``), so on the shared devices the log-prob
  passes run while the sampler holds its copy of the weights and its first decode loop's state (its
  KV cache), the update's programs while it holds its second loop's (``overlap``); those count in
  their peaks.
- colocated, k = 0: no copy (the sampler reads the trainer's arrays before the update).
- the sampler on its own mesh (``rollout.devices``), any k: the weight sync. ``sampler_cast`` casts the
  trained part to the sampler's compute dtype on the trainer's devices (``pipeline.sync_dtype``; none
  where the dtypes agree, or with LoRA); with several processes ``whole_on_own_mesh`` then gathers each
  array whole on the trainer's mesh (``sharding.transfer``), and the transfer copies it onto the
  sampler's mesh (``jax.device_put``, not a program). Nothing waits for a cast copy's transfer before the
  update is dispatched, so its buffers (the cast copy, the whole copy) are counted through the step's
  log-prob and update programs: an upper bound (they go when the transfer ends). The k + 1 copies are
  resident on the sampler's mesh, with a LoRA base copied there once at start-up (with several
  processes by ``whole_on_own_mesh`` too).
- sampler hosts of their own (``rollout.hosts``, ``rl/hosts.py``): the sampler's mesh mirrors the
  trainer's on other processes, so nothing is gathered: ``sampler_cast`` (``sampler_copy`` where the
  dtypes agree) on the trainer's mesh, whose output the trainer keeps (a checkpoint holds the versions
  in flight: k + 1 copies resident there too), the cross-process ``jax.device_put`` of each shard to
  its mirror device (not a program), and the checksums on each side.

Every copy is checked: ``fingerprint`` of what the trainer sent (on its devices) and of the copy (on
the sampler's), a program each (the run makes two, alike where the two trees are).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np

from arlopti_jax.aot.compiler import SAMPLER_WEIGHTS, Compiler, like, shard_bytes
from arlopti_jax.models import lora, param_shardings
from arlopti_jax.rl import copy_programs, pipeline
from arlopti_jax.runtime import sharding as shd

IN_FLIGHT = "the weight sync's buffers in flight"  # ``Compiler.beside``'s names
FIRST_DECODE = "the rollout's first decode state"
SECOND_DECODE = "the rollout's second decode state (the largest it can be)"


@dataclasses.dataclass
class Plan:
    """What a run's copies are (``plan``)."""

    k: int
    own_mesh: bool  # the sampler on devices of its own
    processes: int  # the trainer mesh's: with several, each array is gathered whole before its transfer
    versions: int  # copies of the trained part alive through a step (0: the sampler reads the trainer's arrays)
    trained: Any  # the trained part of the trainer's parameters (abstract, its shardings)
    base: Any  # their frozen part (LoRA's base), else {}
    copy: Any  # one version's copy, where the sampler reads it (abstract; the trainer's mesh when colocated)
    frozen: Any  # the frozen part the sampler reads beside it: ``base``, or on its own mesh a copy of it
    cast: Any  # the weight sync's dtype (``pipeline.sync_dtype``), None: none
    mirrored: bool = False  # sampler hosts of their own: the trainer keeps its copies too, nothing is gathered

    @property
    def copy_bytes(self) -> int:
        return shard_bytes(self.copy)

    @property
    def copies(self) -> str:
        """The name of the copies' part of a mesh's resident bytes."""
        return f"copies of {self.versions} policy versions"

    def resident(self) -> tuple[dict[str, int], dict[str, int]]:
        """The named bytes per device the copies keep resident: on the trainer's mesh, on the sampler's."""
        held = {self.copies: self.versions * self.copy_bytes} if self.versions else {}
        if not self.own_mesh:
            return held, {}
        return held if self.mirrored else {}, {**held, **({"the LoRA base": shard_bytes(self.frozen)}
                                                          if self.frozen else {})}

    def rollout_params(self, params):
        """The parameters the rollouts read: the trainer's own (colocated at k = 0), else a version's copy
        with the frozen part beside it."""
        return params if not self.versions else lora.whole(self.copy, self.frozen)

    def sync_bytes(self) -> tuple[int, int]:
        """(bytes one weight sync moves in all, bytes into each sampler device)."""
        total = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(self.copy))
        return int(total), self.copy_bytes


def plan(run, params, mirrored: bool = False) -> Plan:
    """The copies ``run`` makes of ``params`` (abstract, the trainer's) each step (module docstring);
    ``mirrored``: the sampler on hosts of its own (``rollout.hosts``)."""
    cfg, k = run.model_cfg, run.config.rollout.max_staleness
    trained, base = lora.trainable(cfg, params)
    own = run.rollout_sampler is not run.sampler
    processes = len({d.process_index for d in run.mesh.devices.flat})
    # the versions a checkpoint of a step holds, and the one the step's copy makes; colocated at k = 0 the
    # sampler reads the trainer's arrays (``Pipeline.copies``)
    versions = len(pipeline.checkpoint_versions(k + 1, k)) + 1 if k > 0 or own else 0
    if not own:
        return Plan(k, False, processes, versions, trained, base, like(trained), base, None)
    cast = pipeline.sync_dtype(cfg)
    sh_trained, sh_frozen = lora.trainable(cfg, param_shardings(cfg, run.rollout_sampler.mesh))
    return Plan(k, True, processes, versions, trained, base, like(trained, cast, sh_trained),
                like(base, shardings=sh_frozen), cast, mirrored)


def compile_sync(p: Plan, trainer: Compiler, sampler: Compiler | None) -> list[dict]:
    """Compile the copies' programs, in the order a run makes them, on ``trainer`` (the trainer's mesh)
    and ``sampler`` (its own, or None); returns the transfers (not programs) as records: what moves
    where."""
    trainer.group = "sync"
    if not p.versions:
        return []
    if not p.own_mesh:  # the snapshot: k copies there before it, its output the step's
        parts = trainer.resident
        trainer.resident = {**parts, p.copies: parts[p.copies] - p.copy_bytes}
        _compile(trainer, "sampler_copy", ["the version's copy"], copy_programs.copy_program(p.trained), p.trained)
        trainer.resident = parts
        for runs, tree in ((["what the trainer sent"], p.trained), (["the sampler's copy"], p.copy)):
            _compile(trainer, "fingerprint", runs, pipeline.fingerprint_program(tree), tree)
        return []
    sampler.group = "sync"
    if p.mirrored:
        return _mirrored_sync(p, trainer, sampler)
    gathered = p.processes > 1  # each array whole on the trainer's mesh, then its parts copied across
    if gathered and p.frozen:  # the LoRA base, once at start-up
        _gather(trainer, p.base, ["the LoRA base, once at start-up"])
    sent = p.trained
    if p.cast is not None:
        sent = _compile(trainer, "sampler_cast", ["the trained part in the sampler's dtype"],
                        copy_programs.cast_program(p.trained, p.cast), p.trained)
    whole = _gather(trainer, sent, ["each weight sync", "a resumed run's restored copies"]) if gathered else []
    # the transfer of a cast copy is not waited for: the whole copy is alive beside the checksums of the cast one
    with _beside(trainer, {IN_FLIGHT: shard_bytes(whole) if p.cast is not None else 0}):
        _compile(trainer, "fingerprint", ["what the trainer sent"], pipeline.fingerprint_program(sent), sent)
    _compile(sampler, "fingerprint", ["the sampler's copy"], pipeline.fingerprint_program(p.copy), p.copy)
    total, per_device = p.sync_bytes()
    return [{"name": "transfer (jax.device_put)", "bytes": total, "bytes_per_sampler_device": per_device,
             "from": "each array whole on a trainer device" if gathered else "the trainer's shards"}]


def _mirrored_sync(p: Plan, trainer: Compiler, sampler: Compiler) -> list[dict]:
    """The sync between sampler hosts and trainer hosts (``hosts.TrainerSide``, ``SamplerSide``)."""
    parts = trainer.resident  # the trainer keeps the version's copy: k copies there before it, its output the step's
    trainer.resident = {**parts, p.copies: parts[p.copies] - p.copy_bytes}
    if p.cast is not None:
        sent = _compile(trainer, "sampler_cast", ["the trained part in the sampler's dtype, kept"],
                        copy_programs.cast_program(p.trained, p.cast), p.trained)
    else:
        sent = _compile(trainer, "sampler_copy", ["the version's copy, kept"], copy_programs.copy_program(p.trained),
                        p.trained)
    trainer.resident = parts
    trainer.resident_leaves |= {id(x) for x in jax.tree.leaves(sent)}
    _compile(trainer, "fingerprint", ["what the trainer sent"], pipeline.fingerprint_program(sent), sent)
    _compile(sampler, "fingerprint", ["the sampler's copy"], pipeline.fingerprint_program(p.copy), p.copy)
    total, per_device = p.sync_bytes()
    return [{"name": "transfer (cross-process jax.device_put)", "bytes": total, "bytes_per_sampler_device": per_device,
             "from": "each trainer device's shard, to its mirror device on a sampler host"}]


def _gather(compiler: Compiler, tree, runs: list[str]):
    """``sharding.transfer``'s first program with several processes, for ``tree``: its outputs ([] when
    every leaf is whole already)."""
    leaves = jax.tree.leaves(tree)
    split, gather = shd.whole_program(leaves)
    return _compile(compiler, "whole_on_own_mesh", runs, gather, [leaves[i] for i in split]) if split else []


class _beside:
    """``compiler.beside`` updated with ``parts`` inside the block, and back after."""

    def __init__(self, compiler: Compiler, parts: dict[str, int]):
        self.compiler, self.parts = compiler, parts

    def __enter__(self):
        self.was = self.compiler.beside
        self.compiler.beside = {**self.was, **self.parts}

    def __exit__(self, *exc):
        self.compiler.beside = self.was


def _compile(compiler: Compiler, name: str, runs: list[str], jitted, *args):
    compiler.runs = runs
    try:
        return compiler(name, jitted, *args)
    finally:
        compiler.runs = []


def in_flight(p: Plan, programs: list) -> dict[str, int]:
    """The weight sync's buffers counted beside the trainer's log-prob and update programs (module
    docstring): the cast copy, and with several processes the whole copy, as their programs made them."""
    if not p.own_mesh or p.cast is None or p.mirrored:  # kept (mirrored): resident, not in flight
        return {}
    made = {q.name: q for q in programs if q.group == "sync" and q.mesh == "trainer"}
    held = made["sampler_cast"].memory["output"] if "sampler_cast" in made else 0
    if "whole_on_own_mesh" in made:
        held += made["whole_on_own_mesh"].memory["output"]
    return {IN_FLIGHT: held}


def overlap(p: Plan, programs: list) -> tuple[dict[str, int], dict[str, int]]:
    """What the sampler holds on the shared devices (colocated, k >= 1) while the log-prob passes run,
    and while the update's programs run: ``run_together(sampler, update)`` dispatches the sampler's
    first turn (up to its first decode loop), the log-prob passes, its second turn (the compactions
    or growth after the first loop, and the second loop), then the update's programs, so those run
    beside its copy of the weights and the first loop's state, and beside the weights and the second
    loop's state: the largest such loop's (fewer rows in the first phase, or any rows in the second;
    none where one loop is the whole rollout, which has ended by then). As the rollout's programs made
    them; ({}, {}) where nothing overlaps or the rollouts were not compiled. Tool episodes (``env.name``)
    yield after each decode loop and each ``resume`` (the host's answers fed), so their second turn
    may also end at the first loop's resume, its state the first loop's size."""
    if p.own_mesh or not p.k:
        return {}, {}
    rollout = [q for q in programs if q.group == "rollout"]
    weights = next((q.memory["output"] for q in rollout if q.name == "sampling weights"), 0)
    loops = [(int(m.group(1)), int(m.group(2)), q.memory["output"]) for q in rollout
             if (m := re.fullmatch(r"(?:episode )?decode rows=(\d+) slots=(\d+)", q.name))]
    if not loops:
        return {}, {}
    rows, slots, first = loops[0]
    phases = sorted({s for _, s, _ in loops})
    second = [out for r, s, out in loops[1:] if (s == slots and r < rows) or (len(phases) > 1 and s == phases[1])]
    # tool episodes: the second turn may be the first loop's resume (the observations fed), as large as the first
    second += [q.memory["output"] for q in rollout if q.name == f"episode resume rows={rows} slots={slots}"]
    during_update = {SAMPLER_WEIGHTS: weights, SECOND_DECODE: max(second)} if second else {}
    return {SAMPLER_WEIGHTS: weights, FIRST_DECODE: first}, during_update
