"""The sampling loop: batches sampled up to k policy versions ahead of the update (``rollout.max_staleness``).

The schedule is fixed, so a run reproduces whatever the timing. Policy version v is the parameters
after v updates (version 0: the initial policy). Batch b is the one step b's update consumes; it
is sampled by version

    sampling_version(b, k) = max(0, b - k)

so the initial policy samples batches 0 to k, and from step k on every update consumes a batch k
versions old (the lag, ``sampler/lag``, is min(b, k)). The sampler never runs ahead of that: the job
for batch b + k is handed version b only when step b begins, so it waits for the version, and
every batch it starts is finished and consumed (none dropped, none reordered). Each batch carries
the version that sampled it, stamped from the parameters the job was given, and ``take`` refuses a
batch whose version is not the schedule's: a wrong lag is an error, never silent staleness. DAPO's
refill rounds (``algo.filter_groups``) are the ``Collector``'s, so they run here with the batch's
own version. Keys and prompts are those of the synchronous loop: batch b draws
``fold_in(key, b)`` and the iterator's next prompts, in batch order.

Where (``in_thread``): with the sampler on its own accelerators (``rollout.devices``) and one
process, its jobs run in a worker thread, one after another, so sampling and the host's reward
scoring of the next batches overlap the update. Otherwise they run in the main thread at the point
each batch is handed over: several processes must launch their programs in the same order, which a
second thread per process would not keep; and on the CPU (jax 0.10.2) the sampler's decode loop
computes wrong log-probs while another thread runs any XLA program, a bare matmul included
(``bench/cpu_thread_race.py``), under the XLA:CPU fusions the package sets for one host device
(``arlopti_jax/__init__.py``; with YNNPACK's the same script is exact, 2026-12-06). There, on
2026-12-03, SmolLM2's k = 1 run at a learning rate of 1e-12
(every version the same policy) measured a pi_old / pi_behaviour KL of 1.8-2.2 at step 2 with its
rollouts beside the update on one device, 0.21 with the sampler on a device of its own, and 0 with
them in the main thread; on the tests' small model the thread changed nothing. The thread has not
run on a GPU or TPU. The schedule is the same either way, so the records are too.

The sampler reads its own copy of the trained parameters (``snapshot``: one program copies them,
with LoRA the adapters alone; the frozen base is shared), since the update donates the trainer's.
The copies of the versions still needed are kept: those of the batches in flight, which a
checkpoint of step s also holds (``checkpoint_versions``: the k versions max(0, s + j - k), j < k,
that sample batches s to s + k - 1), so a resumed run samples those batches again exactly, from
the same data position (the batch's ``data_before``) with the same keys.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from arlopti_jax.models import lora
from arlopti_jax.runtime import sharding as shd


def sampling_version(batch: int, k: int) -> int:
    """The policy version that samples batch ``batch`` under staleness ``k``."""
    return max(0, batch - k)


def in_thread(processes: int, sampler_mesh) -> bool:
    """Whether the loop's jobs run in a worker thread (the module docstring): one process, the sampler
    on its own mesh, and not the CPU."""
    return processes == 1 and sampler_mesh is not None and sampler_mesh.devices.flat[0].platform != "cpu"


def sync_dtype(cfg):
    """The dtype the weight sync casts the trained parameters to on their way to the sampler's own
    mesh: the compute dtype where the weights are stored in another, else None (kept); LoRA's
    adapters are kept as trained (the sampler merges them in its own dtype)."""
    return cfg.compute_dtype if not cfg.lora_rank and cfg.compute_dtype != cfg.weight_dtype else None


def checkpoint_versions(step: int, k: int) -> list[int]:
    """The versions a checkpoint of ``step`` holds: one per batch in flight, step to step + k - 1."""
    return [sampling_version(step + j, k) for j in range(k)]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A policy version's trained parameters, the sampler's own copy."""

    version: int
    params: Any


@dataclasses.dataclass
class Sampled:
    """One scheduled batch: ``step_batch`` (``collect.StepBatch``) sampled by policy ``version``.

    data_before, data_after  the iterator's position before and after its prompts
    busy_s       the sampler's seconds on it;  wait_s  the sampler's idle seconds before it started
    timings      the collector's phases (rollout, reward) on it
    """

    batch: int
    version: int
    step_batch: Any
    data_before: dict
    data_after: dict
    busy_s: float
    wait_s: float
    timings: dict[str, float]


class _Inline:
    """An executor that runs each job when it is submitted (several processes)."""

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # raised again by take(), as the thread's would be
            future.set_exception(err)
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        pass


class Pipeline:
    """The schedule above for staleness ``k``. ``collect(params, iterator, key)``: a ``Collector`` with
    its own timer (``timer``, popped after each batch); ``frozen``: the parameters the update never
    changes (a LoRA base, on the sampler's devices; ``{}`` otherwise); ``background``: jobs in a
    worker thread (one process) or at hand-over (several). ``shardings``: the sampler's own mesh's
    shardings of the trained parameters, where it has one (``rollout.devices``): each version is then
    synced there (``sync``; k = 0 runs the synchronous schedule on the two meshes), cast first to
    ``dtype`` (the sampler's compute dtype; None: kept), else copied on the trainer's mesh."""

    def __init__(self, collect: Callable, timer, iterator, key, k: int, steps: int, frozen: dict,
                 background: bool, shardings=None, dtype=None):
        if k < 0 or (k == 0 and shardings is None):
            raise ValueError(f"Pipeline: max_staleness={k}: must be >= 1, or 0 with the sampler's own mesh "
                             "(0 colocated is the synchronous loop)")
        self.collect, self.timer, self.iterator, self.key = collect, timer, iterator, key
        self.k, self.steps, self.frozen = k, steps, frozen
        self.shardings, self.dtype = shardings, dtype
        if shardings is not None:  # the sampler's programs take their key on its mesh
            on = shd.replicated(jax.tree.leaves(shardings)[0].mesh)
            self.key = jax.random.wrap_key_data(shd.transfer(jax.random.key_data(key), on),
                                                impl=jax.random.key_impl(key))
        self.snapshots: dict[int, Snapshot] = {}
        self.pending: collections.deque = collections.deque()  # (batch, future), in batch order
        self.next_batch = None  # the next batch to hand over
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "sampler") if background else _Inline()
        self._free_since = time.perf_counter()
        self._copy = None
        self.synced = {"seconds": 0.0, "bytes": 0}  # the last sync's

    def snapshot(self, version: int, trained) -> Snapshot:
        """``trained`` (the trained part of version ``version``'s parameters) copied by one program, onto
        the sampler's mesh where it has one (``sync``)."""
        if self.shardings is not None:
            return self.sync(version, trained)
        if self._copy is None:
            shardings = jax.tree.map(lambda x: x.sharding, trained)

            def sampler_copy(tree):  # named: the compile log shows it
                return jax.tree.map(jnp.copy, tree)

            self._copy = jax.jit(sampler_copy, out_shardings=shardings)
        snap = Snapshot(version, self._copy(trained))
        self.snapshots[version] = snap
        return snap

    def sync(self, version: int, trained, cast: bool = True) -> Snapshot:
        """The weight sync: version ``version``'s trained parameters, in the sampler's compute dtype, onto
        the sampler's mesh (``shd.transfer``; the trainer's arrays are read, never donated), waited for:
        the update that follows donates them. Its seconds and bytes are ``synced``."""
        began = time.perf_counter()
        if cast and self.dtype is not None:
            if self._copy is None:
                def sampler_cast(tree, dtype=self.dtype):  # named: the compile log shows it
                    return jax.tree.map(lambda w: w.astype(dtype) if jnp.issubdtype(w.dtype, jnp.floating) else w,
                                        tree)

                self._copy = jax.jit(sampler_cast, out_shardings=jax.tree.map(lambda x: x.sharding, trained))
            trained = self._copy(trained)
        params = jax.block_until_ready(shd.transfer(trained, self.shardings))
        self.synced = {"seconds": time.perf_counter() - began,
                       "bytes": sum(x.nbytes for x in jax.tree.leaves(params))}
        snap = Snapshot(version, params)
        self.snapshots[version] = snap
        return snap

    def adopt(self, version: int, trained) -> None:
        """Take ``trained`` as version ``version``'s copy (a checkpoint's arrays, restored: already in the
        sampler's dtype), moved to the sampler's mesh where it has one."""
        if self.shardings is not None:
            self.sync(version, trained, cast=False)
        else:
            self.snapshots[version] = Snapshot(version, trained)

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
        self.pending.append((batch, self._executor.submit(self._job, batch, snap)))
        self.next_batch = batch + 1

    def _job(self, batch: int, snap: Snapshot) -> Sampled:
        started = time.perf_counter()
        wait = started - self._free_since
        data_before = self.iterator.state_dict()
        params = lora.whole(snap.params, self.frozen)
        step_batch = self.collect(params, self.iterator, jax.random.fold_in(self.key, batch))
        data_after = self.iterator.state_dict()
        timings = self.timer.pop()
        self._free_since = done = time.perf_counter()
        return Sampled(batch, snap.version, step_batch, data_before, data_after, done - started, wait, timings)

    def take(self, step: int) -> tuple[Sampled, float]:
        """(batch ``step``, the seconds the trainer waited for it), after checking its stamped
        version against the schedule (RuntimeError otherwise)."""
        if not self.pending or self.pending[0][0] != step:
            raise RuntimeError(f"sampling loop: step {step} has no batch in flight "
                               f"(in flight: {[b for b, _ in self.pending]})")
        began = time.perf_counter()
        sampled = self.pending.popleft()[1].result()
        waited = time.perf_counter() - began
        want = sampling_version(step, self.k)
        if sampled.batch != step or sampled.version != want:
            raise RuntimeError(f"sampling loop: step {step} got batch {sampled.batch} sampled by policy version "
                               f"{sampled.version}, and max_staleness={self.k} schedules version {want} "
                               f"(lag {step - sampled.version}, not {step - want})")
        return sampled, waited

    def checkpoint_params(self, step: int) -> tuple:
        """The trained parameters of ``checkpoint_versions(step, k)``, for a checkpoint of ``step``."""
        return tuple(self.snapshots[v].params for v in checkpoint_versions(step, self.k))

    def release(self, step: int) -> None:
        """Drop the copies that neither a batch from ``step`` on nor a checkpoint of ``step`` needs."""
        keep = set(checkpoint_versions(step, self.k))
        for version in [v for v in self.snapshots if v not in keep]:
            del self.snapshots[version]

    def close(self) -> None:
        """Stop: batches not started are cancelled, a running one finishes."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.pending.clear()
