"""Multi-process runs: joining the processes, each one's share of a batch, small collectives.

Every process runs the same command (``launch/``). ``initialize`` joins them with
``jax.distributed.initialize`` before any JAX computation, taking the coordinator address,
process count and process id from ``config.distributed.*``, else from JAX's own detection: of
SLURM's ``srun`` tasks (GPU clusters; the devices each task drives are chosen here, where JAX's
choice is wrong) or of a Cloud TPU pod. After that ``jax.devices()`` lists
every process's devices and a jitted program runs on all of them (each process launching
it on its own).

How a training step splits (docs/design.md, "One training step, as data", per process):
- the data iterator is deterministic and the same everywhere; process p takes block p of
  each global batch of prompts (``block``), so a prompt's whole group of responses stays on
  one process (GRPO statistics need the group);
- the sampler assembles global arrays from process-local rows
  (``jax.make_array_from_process_local_data``) and returns this process's responses, which
  this process decodes and scores;
- ``global_rows`` assembles the process-local rewards and token arrays into global arrays
  for the advantages and the update (``update_on_batch`` then moves mini-batch rows between
  devices inside jit);
- metrics are computed from ``gather``-ed per-response values, so process 0 logs global
  numbers; the preemption flag is agreed with ``any_process`` so every host saves the same
  step.
Each process must hold whole batch rows: ``process_contiguous`` arranges the mesh so that
process p's devices hold one contiguous block of the batch (tensor parallelism stays inside
a process). With one process every helper here is the identity: single-process runs are
unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.runtime.startup import ConfigError

log = logging.getLogger(__name__)


# what JAX's own SLURM detection reads (jax/_src/clusters/slurm_cluster.py): present in every srun task
SLURM_TASK_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def slurm_tasks_per_node(value: str) -> list[int]:
    """SLURM's tasks-per-node list, one count per node of the step: '4(x2),2' -> [4, 4, 2]."""
    counts = []
    for part in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ConfigError(f"SLURM's tasks per node {value!r}: expected N or N(xK), comma-separated")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _slurm_tasks_on_this_node(environ: Mapping[str, str]) -> int:
    """The tasks of this node: its entry (``SLURM_NODEID``, the node's place in the step) of
    SLURM_STEP_TASKS_PER_NODE (SLURM_TASKS_PER_NODE outside a step): '4(x2),2' is 2 on node 2."""
    counts = slurm_tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
                                  or "1")
    node = int(environ.get("SLURM_NODEID", "0"))
    if not 0 <= node < len(counts):
        raise ConfigError(f"SLURM_NODEID={node} names no node of SLURM's tasks per node {counts}")
    return counts[node]


def _slurm_local_devices(environ: Mapping[str, str]) -> list[int]:
    """The GPUs this task drives, as ``jax.distributed.initialize``'s ``local_device_ids`` ([]: every
    device it sees). JAX's own SLURM detection gives each task [SLURM_LOCALID] alone, which is wrong
    twice: one task per node would drive one of its 8 GPUs, and a task SLURM bound to its own GPU
    (``--gpus-per-task``: CUDA_VISIBLE_DEVICES one id, seen as device 0) would ask for device
    SLURM_LOCALID. Here: one task on the node, or one visible GPU, drive what they see; N tasks that
    all see the node's G GPUs (CUDA_VISIBLE_DEVICES listing them, or SLURM_GPUS_ON_NODE) take G / N
    each, in order of SLURM_LOCALID (one each where the count is unknown)."""
    tasks = _slurm_tasks_on_this_node(environ)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if tasks == 1 or (visible is not None and "," not in visible):
        return []
    local = int(environ["SLURM_LOCALID"])
    gpus = len(visible.split(",")) if visible else int(environ.get("SLURM_GPUS_ON_NODE") or 0)
    share = max(1, gpus // tasks)
    return list(range(local * share, (local + 1) * share))


def _on_tpu_vm() -> bool:
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        return False
    return os.path.exists("/dev/accel0") or os.path.isdir("/dev/vfio") and any(
        name.isdigit() for name in os.listdir("/dev/vfio"))


def cluster_settings(config, environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Keyword arguments for ``jax.distributed.initialize``, or None for a single process.

    Under ``srun`` (``SLURM_TASK_VARS``) JAX's own SLURM detection (``cluster_detection_method=
    "slurm"``) finds the coordinator (the step's first node, on a port from the job id, or
    ``JAX_COORDINATOR_PORT``), the process count and this process's id; ``config.distributed``'s
    fields, where set, replace its values, and the devices each task drives are this module's
    (``_slurm_local_devices``). Elsewhere the three come from ``config.distributed``, with JAX's
    detection off. ``coordinator='auto'`` (or a Cloud TPU VM with nothing set) leaves everything to
    JAX's detection (TPU pods). One SLURM task, or nothing set, is a single process.
    """
    env = os.environ if environ is None else environ
    d = config.distributed
    if d.coordinator == "auto":
        return {}
    coordinator = d.coordinator or None
    num = d.num_processes if d.num_processes > 0 else None
    pid = d.process_id if d.process_id >= 0 else None
    if all(var in env for var in SLURM_TASK_VARS):
        tasks = num if num is not None else int(env["SLURM_NTASKS"])
        if tasks == 1 and not coordinator:
            return None
        _check(coordinator, tasks, pid if pid is not None else int(env["SLURM_PROCID"]), coordinator is not None)
        out = dict(cluster_detection_method="slurm", local_device_ids=_slurm_local_devices(env))
        given = dict(coordinator_address=coordinator, num_processes=num, process_id=pid)
        return {**out, **{k: v for k, v in given.items() if v is not None}}
    if coordinator is None and num is None and pid is None:
        return {} if _on_tpu_vm() else None
    if num is not None and num == 1 and not coordinator:
        return None
    _check(coordinator, num, pid, True)
    return dict(coordinator_address=coordinator, num_processes=num, process_id=pid,
                cluster_detection_method="deactivate")


def _check(coordinator, num, pid, need_coordinator: bool) -> None:
    """ConfigError naming the field for a coordinator, process count or id a run cannot start with."""
    for field, value, ok in (("distributed.coordinator", coordinator,
                              not need_coordinator or (bool(coordinator) and ":" in str(coordinator))),
                             ("distributed.num_processes", num, num is not None and num >= 1),
                             ("distributed.process_id", pid, pid is not None and 0 <= pid < (num or 0))):
        if not ok:
            raise ConfigError(f"config.{field}={value!r} is invalid: a multi-process run needs "
                              "distributed.coordinator=HOST:PORT, distributed.num_processes >= 1 and "
                              "0 <= distributed.process_id < num_processes (or SLURM's srun variables)")


TRANSFER_PORT_OFFSET = 1000  # the CPU's socket transfers listen on the coordinator's port + this + process id


def _socket_transfers(settings: dict) -> None:
    """With sampler hosts of their own (``rollout.hosts``, rl/hosts.py) on the CPU, which has no
    interconnect of its own, JAX's cross-process ``device_put`` goes over sockets: each process listens
    on the coordinator's host at the coordinator's port + ``TRANSFER_PORT_OFFSET`` + its id. A value the
    user set is kept."""
    if jax.config.values.get("jax_cross_host_transfer_socket_address") or not settings.get("coordinator_address"):
        return
    host, _, port = settings["coordinator_address"].rpartition(":")
    jax.config.update("jax_cross_host_transfer_socket_address",
                      f"{host}:{int(port) + TRANSFER_PORT_OFFSET + int(settings.get('process_id') or 0)}")


def initialize(config) -> bool:
    """Join the other processes (before any JAX computation), then start JAX's backend without the
    compile-only plugins' driver lines (``chips.start_backend``); True when this is a multi-process run."""
    from arlopti_jax.runtime.chips import start_backend

    settings = cluster_settings(config)
    if settings is not None:
        if "cpu" in (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "").split(","):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            if config.get("rollout", {}).get("hosts", 0):
                _socket_transfers(settings)
        jax.distributed.initialize(**settings, heartbeat_timeout_seconds=int(config.distributed.heartbeat_timeout_s))
    start_backend()
    if settings is None:
        return False
    log.info("process %d of %d: %d local devices of %d", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return jax.process_count() > 1


# ---- the processes this one computes with ----
# Every process computes with all the others, except in the sampler hosts' layout (``rollout.hosts``,
# rl/hosts.py), where the trainer's processes and the sampler's each form a group: a batch is split
# over, and a gather or an agreement taken among, the processes of this one's group (its block,
# ``global_rows``, ``gather``, ``any_process``), and ``everyone=True`` takes it among all of them.
_GROUP: tuple[int, ...] | None = None


def set_group(processes) -> None:
    """The processes this one computes with (None: every process)."""
    global _GROUP
    _GROUP = None if processes is None else tuple(sorted(processes))
    if _GROUP is not None and jax.process_index() not in _GROUP:
        raise ValueError(f"set_group: process {jax.process_index()} is not in its group {_GROUP}")


def group() -> tuple[int, ...]:
    return tuple(range(jax.process_count())) if _GROUP is None else _GROUP


def group_index() -> int:
    """This process's place in its group (``jax.process_index()`` outside the sampler hosts' layout)."""
    return group().index(jax.process_index())


def group_count() -> int:
    return len(group())


def block(total: int, index: int | None = None, count: int | None = None) -> slice:
    """Process ``index``'s contiguous block of ``total`` items (sizes as ``np.array_split``): by default
    this process's, of its group."""
    index = group_index() if index is None else index
    count = group_count() if count is None else count
    size, extra = divmod(total, count)
    start = index * size + min(index, extra)
    return slice(start, start + size + (index < extra))


# ---- the mesh: whole batch rows per process ----

def _row_blocks(mesh: Mesh) -> dict[int, set[int]]:
    rows = shd.batch_divisor(mesh)
    out: dict[int, set[int]] = {}
    for device, index in shd.batch_sharding(mesh, 1).devices_indices_map((rows,)).items():
        out.setdefault(device.process_index, set()).update(range(*index[0].indices(rows)))
    return out


def mesh_processes(mesh: Mesh) -> int:
    """How many processes hold ``mesh``'s devices (a compile-only pod topology's hosts included)."""
    return len({d.process_index for d in mesh.devices.flat})


def _rows_contiguous(mesh: Mesh) -> bool:
    per = shd.batch_divisor(mesh) / mesh_processes(mesh)
    return all(len(r) == per and max(r) - min(r) + 1 == per for r in _row_blocks(mesh).values())


def process_contiguous(mesh: Mesh) -> Mesh:
    """``mesh``, or the same axes over a process-major device order, so that each process's
    devices hold one contiguous block of the batch rows. ConfigError if no order can (tensor
    parallelism across processes, or a data x fsdp size the processes do not divide). Over several
    slices the devices are reordered within each slice's positions: a slice stays where the
    multislice mesh put it."""
    processes = mesh_processes(mesh)
    if processes == 1 or _rows_contiguous(mesh):
        return mesh
    grid = mesh.devices.copy()
    slice_of = np.zeros(grid.shape, int)
    if shd.slice_count(list(grid.flat)) > 1:  # TPU slices (a GPU's slice_index, its host, is no block here)
        slice_of = np.vectorize(lambda d: d.slice_index, otypes=[int])(grid)
    for index in np.unique(slice_of):
        where = slice_of == index  # one slice's positions, in the mesh's order
        grid[where] = np.array(sorted(grid[where], key=lambda d: d.process_index), dtype=object)  # stable sort
    reordered = Mesh(grid, mesh.axis_names, axis_types=mesh.axis_types)
    if not _rows_contiguous(reordered):
        raise ConfigError(f"config.mesh={dict(mesh.shape)} is invalid for {processes} processes of "
                          f"{mesh.devices.size // processes} devices: each process must hold whole batch rows, so "
                          "data x fsdp must be a multiple of the process count and tensor must divide the "
                          "devices of one process")
    log.info("mesh devices reordered process-major so each process holds a contiguous block of the batch")
    return reordered


def validate(config, mesh: Mesh) -> None:
    """Multi-process constraints, as ConfigError naming the field."""
    count = mesh_processes(mesh)
    if count == 1:
        return
    process_contiguous(mesh)
    if config.train.batch_prompts % count:
        raise ConfigError(f"config.train.batch_prompts={config.train.batch_prompts} is invalid: must be a "
                          f"multiple of the process count {count} (each process samples and scores its own "
                          "prompts)")


# ---- host <-> global arrays ----

def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in row order (all rows with one process)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    pieces = {}
    for shard in x.addressable_shards:
        start = shard.index[0].indices(x.shape[0])[0] if x.ndim else 0
        pieces.setdefault(start, shard.data)  # replicas (tensor axis) hold the same rows
    starts = sorted(pieces)
    out = np.concatenate([np.asarray(pieces[s]) for s in starts]) if x.ndim else np.asarray(pieces[0])
    if x.ndim and starts[0] + out.shape[0] != starts[-1] + pieces[starts[-1]].shape[0]:
        raise ValueError(f"this process's rows of an array sharded as {x.sharding} are not contiguous")
    return out


def to_host(x) -> np.ndarray:
    """The whole value of ``x`` on every process (a collective when it is spread over processes)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def global_rows(tree, mesh: Mesh):
    """Process-local host arrays (rows of this process) -> global arrays sharded over the batch
    axes, their rows the processes' rows in mesh order. With one process: ``tree`` unchanged."""
    if group_count() == 1:
        return tree

    def put(x):
        x = np.asarray(x)
        sharding = NamedSharding(mesh, P(shd.BATCH_AXES, *([None] * (x.ndim - 1))))
        return jax.make_array_from_process_local_data(sharding, x, (x.shape[0] * group_count(),) + x.shape[1:])

    return jax.tree_util.tree_map(put, tree)


def replicated(x, mesh: Mesh):
    """A small host value that every process holds -> a global array replicated over ``mesh``
    (orbax saves only global arrays in a multi-process run). With one process: ``x`` unchanged."""
    if jax.process_count() == 1:
        return x
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, shd.replicated(mesh), lambda index: x[index])


_GATHERS: dict[tuple[int, ...], int] = {}  # per group: the host gathers made so far (the same count on each member)
GATHER_TIMEOUT_S = 3600  # a gather waits this long for the slowest member (one evaluating, say)


def _exchange(data: bytes, everyone: bool = False) -> list[bytes]:
    """Every process's ``data`` among this one's group (``everyone``: all), in process order. Through
    the coordination service's key-value store (jax.distributed's, as orbax's barriers use it), not a
    device program: a host value neither compiles a program per shape nor runs beside the devices' own
    collectives. On XLA:CPU a gather over all host devices (2 per process, ``process_allgather``) that
    ran while a collective over one device per process was in flight mixed their messages in gloo and
    killed both processes ("Received data size doesn't match expected size"; jax 0.10.2, 2026-12-06:
    the sampling loop's overlap on 2 processes x (1 + 1))."""
    members = tuple(range(jax.process_count())) if everyone or _GROUP is None else _GROUP
    if len(members) == 1:
        return [data]
    from orbax.checkpoint import multihost

    client = multihost.get_jax_distributed_client()
    n = _GATHERS[members] = _GATHERS.get(members, 0) + 1
    key = lambda i, p: f"arlopti_gather/{'-'.join(map(str, members))}/{i}/{p}"
    client.key_value_set_bytes(key(n, jax.process_index()), data)
    parts = [client.blocking_key_value_get_bytes(key(n, p), GATHER_TIMEOUT_S * 1000) for p in members]
    if n > 1:  # every member has set gather n's value, so each has read all of gather n - 1's
        client.key_value_delete(key(n - 1, jax.process_index()))
    return parts


def _arrays_bytes(arrays) -> bytes:
    import io

    out = io.BytesIO()
    np.savez(out, *[np.asarray(a) for a in arrays])
    return out.getvalue()


def _bytes_arrays(data: bytes) -> list[np.ndarray]:
    import io

    with np.load(io.BytesIO(data), allow_pickle=False) as got:
        return [got[f"arr_{i}"] for i in range(len(got.files))]


def _allgather(x: np.ndarray, everyone: bool = False) -> np.ndarray:
    """[processes, ...]: ``x`` (one shape on every process) of each process of the group, stacked."""
    return np.stack([_bytes_arrays(part)[0] for part in _exchange(_arrays_bytes([x]), everyone)])


def gather(*arrays: np.ndarray, everyone: bool = False) -> tuple[np.ndarray, ...]:
    """Every process's rows of each host array, concatenated in process order (any number of
    rows per process), among this process's group (``everyone``: all processes). With one
    process: the arrays unchanged."""
    if (jax.process_count() if everyone else group_count()) == 1:
        return arrays
    parts = [_bytes_arrays(part) for part in _exchange(_arrays_bytes(arrays), everyone)]  # per process
    return tuple(np.concatenate([p[i] for p in parts]).astype(np.asarray(a).dtype) for i, a in enumerate(arrays))


def gather_json(value: Any, everyone: bool = False) -> list:
    """Every process's JSON-serialisable ``value`` (names of metrics a process found, say), in
    process order, among this process's group (``everyone``: all). With one process: ``[value]``."""
    if (jax.process_count() if everyone else group_count()) == 1:
        return [value]
    return [json.loads(part) for part in _exchange(json.dumps(value).encode(), everyone)]


def any_process(flag: bool, everyone: bool = False) -> bool:
    """True on every process of the group (``everyone``: on all) when ``flag`` is true on any of them
    (e.g. SIGTERM reached one host)."""
    if (jax.process_count() if everyone else group_count()) == 1:
        return bool(flag)
    return bool(_allgather(np.array([int(bool(flag))], np.int32), everyone).max())


def barrier(name: str, timeout_s: int = 3600, everyone: bool = False) -> None:
    """Wait until every process of this one's group (``everyone``: every process) reaches ``name``
    (no-op with one process)."""
    if (jax.process_count() if everyone else group_count()) > 1:
        from orbax.checkpoint import multihost

        processes = None if everyone or _GROUP is None else set(_GROUP)
        multihost.sync_global_processes(name, timeout=timeout_s, processes=processes)


SHARED_MARK = ".arlopti_shared"  # the file ``check_shared_folder`` writes in a run folder


def check_shared_folder(folder, field: str) -> None:
    """ValueError on every process, one line naming ``field``, unless every process sees the same
    ``folder`` (a local path or an ``epath`` bucket path): process 0 writes a mark holding a fresh
    token there, and after a barrier each process reads it back. Several hosts that each see their
    own disk under one relative path (``runs/run``) would otherwise each write their own shards of
    one checkpoint. No-op with one process."""
    if jax.process_count() == 1:
        return
    import secrets

    from jax.experimental import multihost_utils

    token = np.frombuffer(secrets.token_bytes(16), np.uint8) if jax.process_index() == 0 else np.zeros(16, np.uint8)
    token = bytes(np.asarray(multihost_utils.broadcast_one_to_all(token)).astype(np.uint8)).hex()
    mark = folder / SHARED_MARK
    if jax.process_index() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        mark.write_text(token)
    barrier(f"arlopti_shared_{token[:8]}")
    try:
        seen = mark.read_text().strip()
    except OSError:
        seen = None
    blind = gather(np.array([seen != token], bool))[0]
    if blind.any():
        who = ", ".join(str(int(i)) for i in np.flatnonzero(blind))
        raise ValueError(f"{field}={folder}: process{'es' if blind.sum() > 1 else ''} {who} of {jax.process_count()} "
                         "do not see the folder process 0 writes to: on several hosts it must be one folder every "
                         "host sees (a shared filesystem, or a gs:// bucket)")
