"""The sampling loop: batches sampled up to k policy versions ahead of the update (``rollout.max_staleness``).

The schedule is fixed, so a run reproduces whatever the timing. Policy version v is the parameters
after v updates (version 0: the initial policy). Batch b is the one step b's update consumes; it
is sampled by version

    sampling_version(b, k) = max(0, b - k)

so the initial policy samples batches 0 to k, and from step k on every update consumes a batch k
versions old (the lag, ``sampler/lag``, is min(b, k)). The sampler never runs ahead of that: the job
for batch b + k is handed version b only when step b begins, and every batch it starts is finished
and consumed (none dropped, none reordered). Each batch carries the version that sampled it, stamped
from the parameters the job was given, and ``take`` refuses a batch whose version is not the
schedule's: a wrong lag is an error, never silent staleness. DAPO's refill rounds
(``algo.filter_groups``) are the ``Collector``'s, so they run here with the batch's own version. Keys
and prompts are those of the synchronous loop: batch b draws ``fold_in(key, b)`` and the iterator's
next prompts, in batch order.

How it overlaps: one thread per process dispatches every program, in the same order on every process.
At step t the main thread dispatches the update's programs (``rl/update.py``) and, in turns with it,
the sampler's programs for the batches up to t + k (``run_together``): each side runs until it would
wait for a device value, then the other goes. JAX dispatches asynchronously, so the update computes on
the trainer's devices while the sampler's decode loops are dispatched to theirs and the host scores
finished responses; the host waits only for the values the next dispatch needs (a decode loop's two
numbers, the log-prob passes before the update is packed, the update's metrics at the step's end).
With the sampler on devices of its own (``rollout.devices``) the two compute at once; colocated, the
devices run the programs one after another in dispatch order, and what overlaps is the host's work
with the devices'. The order of turns is fixed, so every process dispatches the same programs in the
same order, and the schedule is the same as without the overlap, so are the records.

The sampler reads its own copy of each version's trained parameters (``snapshot``: one program copies
them, with LoRA the adapters alone; the frozen base is shared), since the update donates the
trainer's. With its own mesh the copy is the weight sync: the trained parameters cast to the sampler's
compute dtype and copied onto its mesh (``sync``). Every copy is verified: a checksum of each leaf's
bits, computed on the trainer's devices from what it sent and on the sampler's from what arrived
(``fingerprint``), must agree exactly, or ``verify`` stops the run naming the step and the leaf. The
copies of the versions still needed are kept: those of the batches in flight, which a checkpoint of
step s also holds (``checkpoint_versions``: the k versions max(0, s + j - k), j < k, that sample
batches s to s + k - 1), so a resumed run samples those batches again exactly, from the same data
position (the batch's ``data_before``) with the same keys.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Generator

import jax
import jax.numpy as jnp
import numpy as np

from arlopti_jax.models import lora
from arlopti_jax.rl import copy_programs
from arlopti_jax.runtime import sharding as shd


class SyncError(RuntimeError):
    """A weight sync delivered other parameters than the trainer's (``Pipeline.verify``)."""


def sampling_version(batch: int, k: int) -> int:
    """The policy version that samples batch ``batch`` under staleness ``k``."""
    return max(0, batch - k)


def sync_dtype(cfg):
    """The dtype the weight sync casts the trained parameters to on their way to the sampler's own
    mesh: the compute dtype where the weights are stored in another, else None (kept); LoRA's
    adapters are kept as trained (the sampler merges them in its own dtype)."""
    return cfg.compute_dtype if not cfg.lora_rank and cfg.compute_dtype != cfg.weight_dtype else None


def checkpoint_versions(step: int, k: int) -> list[int]:
    """The versions a checkpoint of ``step`` holds: one per batch in flight, step to step + k - 1."""
    return [sampling_version(step + j, k) for j in range(k)]


# ---- taking turns ----

class Task:
    """A generator run in turns by ``run_together``: each ``next()`` runs it until it would wait for a
    device value (its ``yield``). ``value`` is what it returns; ``timer`` (a ``metrics.Timer``), when
    given, is paused while the other tasks run."""

    def __init__(self, name: str, steps: Generator, timer=None):
        self.name, self.steps, self.timer = name, steps, timer
        self.value, self.done, self.turns = None, False, 0

    def turn(self) -> None:
        if self.timer is not None:
            self.timer.resume()
        try:
            next(self.steps)
            self.turns += 1
        except StopIteration as end:
            self.value, self.done = end.value, True
        finally:
            if self.timer is not None:
                self.timer.pause()


def run_together(*tasks: Task | None, on_turn: Callable[[Task], None] | None = None) -> None:
    """Run ``tasks`` (None: left out) in turns, one step each in the given order, until all are done:
    the same order on every process. ``on_turn(task)`` is called before each turn (tests record the
    order of dispatches and waits with it)."""
    active = [t for t in tasks if t is not None]
    while active:
        for task in list(active):
            if on_turn is not None:
                on_turn(task)
            task.turn()
            if task.done:
                active.remove(task)


# ---- checksums of a copy ----

def _leaf_checksum(x):
    """Two uint32 sums over ``x``'s bits, wrapping: of the bits, and of the bits times a hash of each
    element's position. Integer sums do not depend on the order of addition, so any sharding of the
    same values gives the same two numbers, and a changed, moved or missing element changes them."""
    bits = x.dtype.itemsize * 8
    if bits not in (8, 16, 32):
        x = x.astype(jnp.float32)  # float64 (never a parameter here): its float32 rounding
        bits = 32
    word = jax.lax.bitcast_convert_type(x, {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]).astype(jnp.uint32)
    position = jnp.zeros(x.shape, jnp.uint32)
    for axis in range(x.ndim):
        position = position * jnp.uint32(x.shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis)
    weight = position * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)
    return jnp.stack([jnp.sum(word, dtype=jnp.uint32), jnp.sum(word * weight, dtype=jnp.uint32)])


def fingerprint_program(tree) -> Callable:
    """A jitted function of trees shaped like ``tree``: every leaf's two checksums, [leaves, 2]
    uint32, on the devices the leaves lie on (replicated there)."""
    sharding = jax.tree.leaves(tree)[0].sharding

    def fingerprint(t):  # named: the compile log shows it
        return jnp.stack([_leaf_checksum(x) for x in jax.tree.leaves(t)])

    if not hasattr(sharding, "mesh"):  # one device's arrays
        return jax.jit(fingerprint)
    return jax.jit(fingerprint, out_shardings=shd.replicated(sharding.mesh))


# ---- the schedule ----

@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A policy version's trained parameters, the sampler's own copy; ``sent`` and ``got``: the
    checksums of what the trainer sent and of what the copy holds (``fingerprint_program``)."""

    version: int
    params: Any
    sent: Any = None
    got: Any = None


@dataclasses.dataclass
class Sampled:
    """One scheduled batch: ``step_batch`` (``collect.StepBatch``) sampled by policy ``version``.

    data_before, data_after  the iterator's position before and after its prompts
    busy_s       the main thread's seconds on its work (dispatches, waits for the sampler's devices,
                 scoring), the update's turns left out
    span_s       seconds from its first dispatch to its last result, the update's turns included
    timings      the collector's phases (rollout, reward) on it, counted as busy_s is
    """

    batch: int
    version: int
    step_batch: Any
    data_before: dict
    data_after: dict
    busy_s: float
    span_s: float
    timings: dict[str, float]


@dataclasses.dataclass
class _Job:
    batch: int
    snapshot: Snapshot
    result: Sampled | None = None


class Pipeline:
    """The schedule above for staleness ``k``. ``collect``: a ``Collector``, whose ``steps(params,
    iterator, key)`` yields where it waits for the sampler's devices, with its own ``timer`` (popped
    after each batch); ``frozen``: the parameters the update never changes (a LoRA base, on the
    sampler's devices; ``{}`` otherwise). ``shardings``: the sampler's own mesh's shardings of the
    trained parameters, where it has one (``rollout.devices``): each version is then synced there
    (``sync``; k = 0 runs the synchronous schedule on the two meshes), cast first to ``dtype`` (the
    sampler's compute dtype; None: kept), else copied on the trainer's mesh; at k = 0 without a mesh
    of its own the sampler reads the trainer's arrays (the synchronous loop)."""

    def __init__(self, collect, timer, iterator, key, k: int, steps: int, frozen: dict, shardings=None, dtype=None):
        if k < 0:
            raise ValueError(f"Pipeline: max_staleness={k}: must be >= 0")
        # k = 0 colocated: the synchronous loop, each batch sampled at its step's start from the
        # trainer's own arrays, which the update donates only after: no copy
        self.copies = k > 0 or shardings is not None
        self.collect, self.timer, self.iterator, self.key = collect, timer, iterator, key
        self.k, self.steps, self.frozen = k, steps, frozen
        self.shardings, self.dtype = shardings, dtype
        if shardings is not None:  # the sampler's programs take their key on its mesh
            on = shd.replicated(jax.tree.leaves(shardings)[0].mesh)
            self.key = jax.random.wrap_key_data(shd.transfer(jax.random.key_data(key), on),
                                                impl=jax.random.key_impl(key))
        self.snapshots: dict[int, Snapshot] = {}
        self.jobs: collections.deque[_Job] = collections.deque()  # handed over, in batch order
        self.next_batch = None  # the next batch to hand over
        self._copy = self._sent_fp = self._got_fp = None
        self.synced = {"seconds": 0.0, "bytes": 0}  # the last sync's

    # -- the versions' copies --

    def snapshot(self, version: int, trained) -> Snapshot:
        """``trained`` (the trained part of version ``version``'s parameters) copied by one program, onto
        the sampler's mesh where it has one (``sync``), with both sides' checksums dispatched."""
        if self.shardings is not None:
            return self.sync(version, trained)
        if not self.copies:
            self.snapshots[version] = snap = Snapshot(version, trained)
            return snap
        if self._copy is None:
            self._copy = copy_programs.copy_program(trained)
        copy = jax.block_until_ready(self._copy(trained))  # made before the update donates ``trained``
        return self._keep(version, trained, copy)

    def sync(self, version: int, trained, cast: bool = True) -> Snapshot:
        """The weight sync: version ``version``'s trained parameters, in the sampler's compute dtype, onto
        the sampler's mesh (``shd.transfer``; the trainer's arrays are read, never donated). Its
        seconds (the host's: dispatch, and with several processes the copies' assembly) and bytes are
        ``synced``."""
        began = time.perf_counter()
        if cast and self.dtype is not None:
            if self._copy is None:
                self._copy = copy_programs.cast_program(trained, self.dtype)
            trained = jax.block_until_ready(self._copy(trained))  # made before the update donates the source
            params = shd.transfer(trained, self.shardings)  # dispatched: the update goes on beside it
        else:  # the trainer's own arrays are read: copied before the update donates them
            params = jax.block_until_ready(shd.transfer(trained, self.shardings))
        self.synced = {"seconds": time.perf_counter() - began,
                       "bytes": sum(x.nbytes for x in jax.tree.leaves(params))}
        return self._keep(version, trained, params)

    def _keep(self, version: int, sent, copy) -> Snapshot:
        if self._sent_fp is None:
            self._sent_fp, self._got_fp = fingerprint_program(sent), fingerprint_program(copy)
        snap = Snapshot(version, copy, self._sent_fp(sent), self._got_fp(copy))
        self.snapshots[version] = snap
        return snap

    def adopt(self, version: int, trained) -> None:
        """Take ``trained`` as version ``version``'s copy (a checkpoint's arrays, restored: already in the
        sampler's dtype), moved to the sampler's mesh where it has one."""
        if self.shardings is not None:
            self.sync(version, trained, cast=False)
        else:
            self.snapshots[version] = Snapshot(version, trained)

    def verify(self, step: int, names: list[str]) -> None:
        """SyncError, one line naming ``step``, the version and the first leaf (``names``, in tree
        order) whose checksums differ, where a copy made at ``step`` holds other bits than the trainer
        sent: a sync that delivered stale, partial or perturbed weights stops the run."""
        snap = self.snapshots.get(step)
        if snap is None or snap.sent is None:
            return
        sent, got = np.asarray(jax.device_get(snap.sent)), np.asarray(jax.device_get(snap.got))
        differ = np.flatnonzero((sent != got).any(axis=1))
        if differ.size:
            i = int(differ[0])
            where = "weight sync" if self.shardings is not None else "sampler's copy"
            raise SyncError(f"step {step}: the {where} of policy version {snap.version} does not hold the trainer's "
                            f"parameters: {len(differ)} of {len(sent)} arrays differ, the first {names[i]} "
                            f"(checksums {got[i].tolist()} against the trainer's {sent[i].tolist()})")

    def checkpoint_params(self, step: int) -> tuple:
        """The trained parameters of ``checkpoint_versions(step, k)``, for a checkpoint of ``step``."""
        return tuple(self.snapshots[v].params for v in checkpoint_versions(step, self.k))

    def release(self, step: int) -> None:
        """Drop the copies that neither a batch from ``step`` on nor a checkpoint of ``step`` needs."""
        keep = set(checkpoint_versions(step, self.k)) | {job.snapshot.version for job in self.jobs}
        for version in [v for v in self.snapshots if v not in keep]:
            del self.snapshots[version]

    # -- the batches --

    def start(self, step: int) -> None:
        """Hand over the batches ``step`` to ``step + k - 1`` (those before the first ``advance``),
        each with its version's copy (``snapshot`` or ``adopt`` made them)."""
        self.next_batch = step
        for batch in range(step, min(step + self.k, self.steps)):
            self._hand_over(batch, self.snapshots[sampling_version(batch, self.k)])

    def advance(self, step: int, trained) -> None:
        """At the start of ``step`` (before its update): copy version ``step``'s trained parameters
        ``trained`` and hand over batch ``step + k``, which it samples. The copy is made at the last k
        steps too, where that batch lies past the run's end: a checkpoint of step + 1 holds it, for
        a run resumed with more steps."""
        snap = self.snapshots.get(step) or self.snapshot(step, trained)
        batch = step + self.k
        if batch < self.steps:
            self._hand_over(batch, snap)

    def _hand_over(self, batch: int, snap: Snapshot) -> None:
        if batch != self.next_batch:
            raise RuntimeError(f"sampling loop: batch {batch} handed over out of order (expected {self.next_batch})")
        self.jobs.append(_Job(batch, snap))
        self.next_batch = batch + 1

    def ahead(self, step: int) -> Task | None:
        """The task that samples every handed-over batch not sampled yet, up to ``step + k``, in batch
        order (one batch once the loop runs: ``step + k``; at the first step, the k batches after it),
        to run in turns with step ``step``'s update; None when there is none."""
        todo = [job for job in self.jobs if job.result is None and step < job.batch <= step + self.k]
        if not todo:
            return None

        def sample_ahead():
            for job in todo:
                yield from self._run(job)

        return Task("sampler", sample_ahead(), self.timer)

    def _run(self, job: _Job):
        began = time.perf_counter()
        self.timer.pop()  # phases of this job only
        with self.timer("sampler_busy"):
            data_before = self.iterator.state_dict()
            params = lora.whole(job.snapshot.params, self.frozen)
            step_batch = yield from self.collect.steps(params, self.iterator, jax.random.fold_in(self.key, job.batch))
            data_after = self.iterator.state_dict()
        timings = self.timer.pop()
        busy = timings.pop("sampler_busy")
        job.result = Sampled(job.batch, job.snapshot.version, step_batch, data_before, data_after, busy,
                             time.perf_counter() - began, timings)

    def take(self, step: int) -> Sampled:
        """Batch ``step`` (sampled now, in the main thread, if no earlier step sampled it ahead: the
        first step's, and every batch at k = 0), after checking its stamped version against the
        schedule (RuntimeError otherwise)."""
        if not self.jobs or self.jobs[0].batch != step:
            raise RuntimeError(f"sampling loop: step {step} has no batch in flight "
                               f"(in flight: {[job.batch for job in self.jobs]})")
        job = self.jobs.popleft()
        if job.result is None:
            task = Task("sampler", self._run(job), self.timer)
            run_together(task)
        sampled = job.result
        want = sampling_version(step, self.k)
        if sampled.batch != step or sampled.version != want:
            raise RuntimeError(f"sampling loop: step {step} got batch {sampled.batch} sampled by policy version "
                               f"{sampled.version}, and max_staleness={self.k} schedules version {want} "
                               f"(lag {step - sampled.version}, not {step - want})")
        return sampled

    def close(self) -> None:
        """Drop the batches not consumed (a stop signal's checkpoint samples them again on resume)."""
        self.jobs.clear()
