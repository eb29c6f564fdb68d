"""Sampler hosts of their own (``rollout.hosts`` = H): whole processes sample, the others train.

Of P processes the first P - H train on all their devices and the last H sample on all theirs (on a
v5p-16 with ``rollout.hosts=2``: hosts 0-1 train, 2-3 sample; on two 8-GPU nodes with one process
each, ``rollout.hosts=1``: one node each). Each side launches only its own programs: the update's on
the trainer's mesh, the rollouts' on the sampler's, so the two compute at once with k =
``rollout.max_staleness`` >= 1, one version apart. What crosses between them, in this order each
step, every process taking part:

1. the weight sync: version t's trained parameters, cast to the sampler's compute dtype, by JAX's
   cross-process ``jax.device_put`` from the trainer's mesh to the sampler's, with the checksums of
   what was sent (``pipeline.fingerprint_program``): the sampler's side compares them with those of
   what arrived;
2. the batch of step t: its metadata (shapes, prompts, scores, the schedule's stamps) by a gather
   among all processes, then its arrays by ``jax.device_put`` from the sampler's mesh to the trainer's;
3. one agreement among all processes at the step's end (``agree``): a stop signal, a sync that
   delivered other weights, or a batch too far from pi_old stops every process at the same step.

JAX moves an array across processes by ``device_put`` between shardings of the same number of devices
and the same shard shapes (its multi-process guide, "Transferring data across processes"), over the
interconnect (ICI, NVLink, InfiniBand) where the backend has it and over sockets otherwise (the CPU,
``jax_cross_host_transfer_socket_address``, set by ``distributed.initialize``). So the sampler's mesh
mirrors the trainer's: the same axes (``mesh.*``) over the sampler hosts' devices, process i + P - H
in the place of process i, and the two sides must hold as many devices (H = P / 2 on hosts of equal
devices). Nothing is gathered whole: each sampler device receives its counterpart's shard.

Inside each side, batches are split and gathered among that side's processes alone
(``distributed.set_group``); the agreement points above are everyone's. Checkpoints are the trainer's
processes' (orbax over those processes): they hold the versions in flight, which the trainer keeps
(one cast copy per version, as the colocated loop's sampler copies), and a resumed run sends them to
the sampler again, with the step, the key and the data position.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from arlopti_jax.rl import copy_programs
from arlopti_jax.rl import pipeline as sampling_loop
from arlopti_jax.rl.pipeline import Pipeline, Sampled, Snapshot
from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime.startup import ConfigError

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class Roles:
    """The trainer's processes and the sampler's (``rollout.hosts``)."""

    trainers: tuple[int, ...]
    samplers: tuple[int, ...]

    @property
    def mine(self) -> str:
        return "sampler" if jax.process_index() in self.samplers else "trainer"


def roles(config, processes: int | None = None) -> Roles | None:
    """The split of ``rollout.hosts``, or None without one; ConfigError for one that cannot be."""
    hosts = config.rollout.get("hosts", 0)
    if not hosts:
        return None
    processes = jax.process_count() if processes is None else processes
    if config.rollout.devices:
        raise ConfigError(f"config.rollout.hosts={hosts} is invalid beside rollout.devices={config.rollout.devices}: "
                          "the sampler either has hosts of its own or devices of every host, not both")
    if 2 * hosts != processes:
        raise ConfigError(f"config.rollout.hosts={hosts} is invalid for {processes} processes: the sampler hosts must "
                          f"hold as many devices as the trainer's (JAX moves arrays across processes between meshes of "
                          f"one shape), so rollout.hosts = processes / 2 = {processes / 2:g} on hosts of equal devices")
    return Roles(tuple(range(processes - hosts)), tuple(range(processes - hosts, processes)))


def trainer_devices(roles: Roles, devices) -> list:
    return [d for d in devices if d.process_index in roles.trainers]


def mirror_mesh(mesh: Mesh, roles: Roles, devices) -> Mesh:
    """The sampler's mesh: ``mesh``'s axes, each trainer device's place taken by the device of the same
    local index on the sampler process opposite its process."""
    by_process: dict[int, list] = {}
    for d in sorted(devices, key=lambda d: d.id):
        by_process.setdefault(d.process_index, []).append(d)
    shift = len(roles.trainers)
    if any(len(by_process.get(p + shift, [])) != len(by_process[p]) for p in roles.trainers):
        counts = {p: len(ds) for p, ds in by_process.items()}
        raise ConfigError(f"config.rollout.hosts={len(roles.samplers)}: the processes hold {counts} devices; each "
                          "sampler host must hold as many as the trainer host opposite it")
    opposite = lambda d: by_process[d.process_index + shift][by_process[d.process_index].index(d)]
    return Mesh(np.vectorize(opposite, otypes=[object])(mesh.devices), mesh.axis_names, axis_types=mesh.axis_types)


def placeholders(tree):
    """Arrays of ``tree``'s shapes, dtypes and shardings with no data on this process: what a process
    passes to a cross-process ``device_put`` whose source lies on the other side."""
    return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(x.shape, x.sharding, [], dtype=x.dtype),
                        tree)


def _cast_abstract(tree, dtype):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype,
        sharding=x.sharding), tree)


def _mirrored(shardings, mesh: Mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings)


class _Exchange:
    """The batch's crossing from the sampler's mesh to the trainer's: ``send`` on the sampler's side,
    ``receive`` on the trainer's, at the same point of every process's program."""

    ARRAYS = ("input_ids", "attention_mask", "response_mask", "old_logprobs")

    def __init__(self, trainer_mesh: Mesh, sampler_mesh: Mesh):
        self.trainer_mesh, self.sampler_mesh = trainer_mesh, sampler_mesh

    @staticmethod
    def _spec(ndim: int):
        from jax.sharding import PartitionSpec as P

        from arlopti_jax.runtime import sharding as shd

        return P(shd.BATCH_AXES, *([None] * (ndim - 1)))

    def send(self, sampled: Sampled) -> None:
        sb = sampled.step_batch
        arrays = {**{k: sb.batch[k] for k in self.ARRAYS}, "rewards": sb.rewards, "group_ids": sb.group_ids}
        put = {k: v if isinstance(v, jax.Array) else jax.device_put(np.asarray(v), NamedSharding(
            self.sampler_mesh, self._spec(np.ndim(v)))) for k, v in arrays.items()}
        meta = {"arrays": {k: [list(v.shape), str(v.dtype)] for k, v in put.items()}, "sampled": _meta(sampled)}
        dist.gather_json(meta if dist.group_index() == 0 else None, everyone=True)
        jax.device_put(put, {k: NamedSharding(self.trainer_mesh, self._spec(v.ndim)) for k, v in put.items()})

    def receive(self) -> Sampled:
        meta = next(m for m in dist.gather_json(None, everyone=True) if m is not None)
        source = {k: jax.make_array_from_single_device_arrays(
            tuple(shape), NamedSharding(self.sampler_mesh, self._spec(len(shape))), [], dtype=jnp.dtype(dtype))
            for k, (shape, dtype) in meta["arrays"].items()}
        got = jax.device_put(source, {k: NamedSharding(self.trainer_mesh, self._spec(v.ndim))
                                      for k, v in source.items()})
        return _unmeta(meta["sampled"], got)


def _plain(value):
    """JSON-ready: numpy arrays and scalars as lists and numbers."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _meta(sampled: Sampled) -> dict:
    sb = sampled.step_batch
    return {"batch": sampled.batch, "version": sampled.version, "data_before": _plain(sampled.data_before),
            "data_after": _plain(sampled.data_after), "busy_s": sampled.busy_s, "span_s": sampled.span_s,
            "timings": sampled.timings, "rows": _plain(list(sb.rows)), "scores": _plain(sb.scores),
            "correct": _plain(np.asarray(sb.correct)), "lengths": _plain(sb.lengths),
            "truncated": _plain(np.asarray(sb.truncated)), "sample_text": sb.sample_text,
            "sample_score": float(sb.sample_score), "stats": _plain(sb.stats)}


def _unmeta(meta: dict, arrays: dict) -> Sampled:
    from arlopti_jax.rl.collect import StepBatch

    batch = {k: arrays[k] for k in _Exchange.ARRAYS}
    step_batch = StepBatch(batch, arrays["rewards"], arrays["group_ids"], meta["rows"],
                           np.asarray(meta["scores"], np.float32), np.asarray(meta["correct"], bool),
                           np.asarray(meta["lengths"], np.int32), np.asarray(meta["truncated"], bool),
                           meta["sample_text"], meta["sample_score"], meta["stats"])
    return Sampled(meta["batch"], meta["version"], step_batch, meta["data_before"], meta["data_after"],
                   meta["busy_s"], meta["span_s"], meta["timings"])


class TrainerSide:
    """The sampling loop as the trainer's processes run it: versions sent, batches received. The
    schedule's checks (the version stamp) are the sampler side's, which holds the jobs."""

    def __init__(self, trained_abstract, k: int, steps: int, sampler_mesh: Mesh, trainer_mesh: Mesh, dtype, key):
        self.k, self.steps, self.dtype, self.key, self.frozen = k, steps, dtype, key, {}
        self.snapshots: dict[int, Snapshot] = {}
        self.target = _mirrored(jax.tree.map(lambda x: x.sharding, trained_abstract), sampler_mesh)
        self.exchange = _Exchange(trainer_mesh, sampler_mesh)
        self.sampler_mesh = sampler_mesh
        self._copy = self._sent_fp = None
        self.synced = {"seconds": 0.0, "bytes": 0}

    def snapshot(self, version: int, trained) -> Snapshot:
        """Version ``version``'s copy, cast to the sampler's dtype (kept here: a checkpoint holds the
        versions in flight), sent to the sampler's processes with its checksums."""
        if self._copy is None:
            self._copy = (copy_programs.cast_program(trained, self.dtype) if self.dtype is not None
                          else copy_programs.copy_program(trained))
        copy = jax.block_until_ready(self._copy(trained))  # made before the update donates ``trained``
        return self._send(version, copy)

    def adopt(self, version: int, trained) -> None:
        """A checkpoint's copy of ``version`` (already cast), sent again."""
        self._send(version, trained)

    def _send(self, version: int, copy) -> Snapshot:
        import time

        began = time.perf_counter()
        if self._sent_fp is None:
            self._sent_fp = sampling_loop.fingerprint_program(copy)
        sent = self._sent_fp(copy)
        jax.device_put(copy, self.target)  # the sampler's processes receive it (SamplerSide.snapshot)
        jax.device_put(sent, NamedSharding(self.sampler_mesh, jax.sharding.PartitionSpec()))
        self.synced = {"seconds": time.perf_counter() - began, "bytes": sum(x.nbytes for x in jax.tree.leaves(copy))}
        self.snapshots[version] = snap = Snapshot(version, copy)
        return snap

    def start(self, step: int) -> None:
        pass

    def advance(self, step: int, trained) -> None:
        if step not in self.snapshots:
            self.snapshot(step, trained)

    def take(self, step: int) -> Sampled:
        return self.exchange.receive()

    def ahead(self, step: int):
        return None

    def verify(self, step: int, names: list[str]) -> None:
        pass  # the sampler's side compares what arrived with what was sent

    def checkpoint_params(self, step: int) -> tuple:
        return tuple(self.snapshots[v].params for v in sampling_loop.checkpoint_versions(step, self.k))

    def release(self, step: int) -> None:
        keep = set(sampling_loop.checkpoint_versions(step, self.k))
        for version in [v for v in self.snapshots if v not in keep]:
            del self.snapshots[version]

    def close(self) -> None:
        pass


class SamplerSide(Pipeline):
    """The sampling loop as the sampler's processes run it: each version received from the trainer's
    (its checksums too), every batch sampled here and sent on. ``key``: the run's key, as the
    trainer's process 0 sent it (``share_start``)."""

    def __init__(self, collect, timer, iterator, key, k: int, steps: int, frozen: dict, trained_abstract,
                 trainer_mesh: Mesh, sampler_mesh: Mesh, dtype):
        super().__init__(collect, timer, iterator, key, k, steps, frozen)
        from arlopti_jax.runtime import sharding as shd

        self.copies = True
        self.shardings = _mirrored(jax.tree.map(lambda x: x.sharding, trained_abstract), sampler_mesh)
        self.key = jax.random.wrap_key_data(shd.put(np.asarray(jax.random.key_data(key)), shd.replicated(sampler_mesh)),
                                            impl=jax.random.key_impl(key))
        self.source = _cast_abstract(trained_abstract, dtype)  # what the trainer's processes send
        self.checksums = jax.ShapeDtypeStruct((len(jax.tree.leaves(self.source)), 2), jnp.uint32,
                                              sharding=NamedSharding(trainer_mesh, jax.sharding.PartitionSpec()))
        self.exchange = _Exchange(trainer_mesh, sampler_mesh)
        self.sampler_mesh = sampler_mesh
        self._got_fp = None

    def snapshot(self, version: int, trained=None) -> Snapshot:
        """Version ``version``, received (``TrainerSide._send``), with the checksums of what was sent and
        of what arrived."""
        import time

        began = time.perf_counter()
        copy = jax.device_put(placeholders(self.source), self.shardings)
        sent = jax.device_put(placeholders(self.checksums), NamedSharding(self.sampler_mesh,
                                                                           jax.sharding.PartitionSpec()))
        if self._got_fp is None:
            self._got_fp = sampling_loop.fingerprint_program(copy)
        self.synced = {"seconds": time.perf_counter() - began, "bytes": sum(x.nbytes for x in jax.tree.leaves(copy))}
        snap = Snapshot(version, copy, sent, self._got_fp(copy))
        self.snapshots[version] = snap
        return snap

    def sync(self, version: int, trained, cast: bool = True) -> Snapshot:
        return self.snapshot(version)

    def adopt(self, version: int, trained=None) -> None:
        self.snapshot(version)

    def take(self, step: int) -> Sampled:
        sampled = super().take(step)
        self.exchange.send(sampled)
        return sampled

    def checkpoint_params(self, step: int) -> tuple:
        return ()  # the trainer's processes checkpoint the versions in flight


def start_info(trainer, restored) -> dict[str, Any]:
    """What the sampler's processes need to start or resume (the trainer's process 0 sends it): the
    first step, the run's key, the data position, and the versions the trainer will send first."""
    versions = ([trainer.start_step] if restored is None or not trainer.k else
                sampling_loop.checkpoint_versions(trainer.start_step, trainer.k))
    if jax.process_index() != 0:
        return {}
    return {"start_step": trainer.start_step, "key": np.asarray(jax.random.key_data(trainer.key)).tolist(),
            "data": _plain(trainer.inputs.iterator.state_dict()), "versions": versions}


def share_start(info: dict) -> dict:
    """Every process's copy of process 0's ``start_info`` (a gather among all processes)."""
    return next(i for i in dist.gather_json(info, everyone=True) if i)


def agree(step: int, error: str | None) -> str | None:
    """The step's end, among all processes: the first error any process found (None: none)."""
    errors = [e for e in dist.gather_json(error, everyone=True) if e]
    return errors[0] if errors else None
