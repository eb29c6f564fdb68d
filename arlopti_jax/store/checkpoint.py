"""Saving and restoring the whole training state with orbax.

A checkpoint is one step folder holding ``state`` (params, optimizer state, RNG key:
sharded arrays, written by every host) and ``meta`` (JSON: step, data-iterator position,
config). Orbax writes into a temporary folder and renames it when complete, so a crash
mid-save leaves nothing that looks finished. Two kinds of failure are told apart:

- a checkpoint whose arrays do not have the shapes and dtypes the run expects (another model,
  LoRA rank or dtype) is a *mismatch*: ``CheckpointMismatch``, naming the first array that
  differs; nothing is skipped or deleted;
- a finished folder that was damaged afterwards (truncated files, unreadable metadata) is
  *unreadable*: ``restore_latest`` sets it aside (``<step>.unreadable``) with a warning and
  takes the previous one.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from arlopti_jax.runtime import distributed as dist
from arlopti_jax.runtime import faults, paths

log = logging.getLogger(__name__)

# A replicated array (a norm's weights over fsdp, every weight over mesh.data) is written by one
# replica, not in slices by each: orbax's slicing compiles a program per array and replica at the
# first save (32 for the test model on 8 devices), after the run's warm-up (rl/warm_up.py). Orbax
# already writes so on GPUs; the arrays replicated under the fsdp layouts are small. Orbax warns of
# every override of its registry (through absl's logger): this one is meant, so not at start-up.
_absl, _level = logging.getLogger("absl"), logging.getLogger("absl").level
_absl.setLevel(logging.ERROR)
try:
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
                                            override=True)
finally:
    _absl.setLevel(_level)


class CheckpointMismatch(ValueError):
    """A checkpoint whose arrays differ in structure, shape or dtype from what the run expects."""


class CheckpointUnreadable(ValueError):
    """No checkpoint of a folder that holds some could be read."""


def leaves(tree) -> dict[str, tuple]:
    """``{"params/layers/attn/q": (shape, dtype)}`` of an array tree or orbax's metadata tree
    (which stores tuples as lists: both are numbered the same)."""
    def name(key):
        return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(name(k) for k in path): (tuple(leaf.shape), str(jax.numpy.dtype(leaf.dtype)))
            for path, leaf in flat if leaf is not None}


def compare_trees(saved: dict[str, tuple], wanted: dict[str, tuple], where: str) -> None:
    """CheckpointMismatch, one line naming the first difference, unless every array ``wanted``
    names is in ``saved`` with its shape and dtype and ``saved`` holds no other."""
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    if missing or extra:
        first = f"no array {missing[0]}" if missing else f"an array {extra[0]} this run does not have"
        raise CheckpointMismatch(f"{where} does not match this run: it has {first} ({len(missing)} missing, "
                                 f"{len(extra)} extra of {len(wanted)})")
    for name in sorted(wanted, key=lambda n: (not n.startswith("params"), n)):  # the parameters first
        if saved[name] != wanted[name]:
            (s_shape, s_dtype), (w_shape, w_dtype) = saved[name], wanted[name]
            raise CheckpointMismatch(f"{where} does not match this run: {name} is {s_dtype}{list(s_shape)} "
                                     f"there, {w_dtype}{list(w_shape)} here")


class Checkpointer:
    """A run's orbax checkpoints. ``processes``: the processes that save and restore them together
    (None: every process; the sampler hosts' layout gives the trainer's alone, rl/hosts.py)."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 3, async_save: bool = True,
                 processes: set[int] | None = None):
        self.directory = paths.path(directory)  # local, or a bucket's gs:// folder (orbax writes there directly)
        together = ocp.options.MultiprocessingOptions()
        if processes is not None:  # orbax creates the folder only for every process: made here, by each of them
            together = ocp.options.MultiprocessingOptions(primary_host=min(processes), active_processes=set(processes))
            self.directory.mkdir(parents=True, exist_ok=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=processes is None,
                temporary_path_class=_fault_injecting_rename() if _checkpoint_fault() else None,
                multiprocessing_options=together),
        )

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start saving (asynchronously); returns once device buffers are safe to donate."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        faults.point("checkpoint_write")  # the step folder is being written

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def check(self, step: int, abstract_state: Any) -> None:
        """CheckpointMismatch unless ``step``'s arrays have the structure, shapes and dtypes of
        ``abstract_state``; whatever orbax raises where its metadata cannot be read."""
        compare_trees(leaves(array_metadata(self.directory / str(step))), leaves(abstract_state),
                      f"checkpoint {self.directory}/{step}")

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore ``step`` into the shapes/dtypes/shardings of ``abstract_state``, after ``check``."""
        self.check(step, abstract_state)
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """The newest checkpoint that restores cleanly (None where the folder holds none). An
        unreadable one is set aside as ``<step>.unreadable`` with a warning, so the step can be
        saved again, and the previous one is tried; a mismatch (``CheckpointMismatch``) is raised,
        as is ``CheckpointUnreadable`` when not one of them can be read."""
        steps = self.steps()
        for step in reversed(steps):
            try:
                state, meta = self.restore(step, abstract_state)
            except CheckpointMismatch:
                raise
            except Exception as err:  # orbax/tensorstore raise many types for damaged files
                log.warning("checkpoint %s/%d is unreadable (%s: %s); set aside as %d.unreadable, trying the "
                            "previous one", self.directory, step, type(err).__name__,
                            str(err).splitlines()[0][:200] if str(err) else "", step)
                self._set_aside(step)
                continue
            return step, state, meta
        if steps:
            raise CheckpointUnreadable(f"none of the checkpoints {steps} in {self.directory} can be read (set aside "
                                       "as <step>.unreadable): move them away, or use another run_dir")
        return None

    def _set_aside(self, step: int) -> None:
        """Rename step folder ``step`` to ``<step>.unreadable`` (process 0; every process waits)."""
        if jax.process_index() == 0:
            folder = self.directory / str(step)
            target = folder.with_name(f"{step}.unreadable")
            n = 1
            while target.exists():
                target, n = folder.with_name(f"{step}.unreadable.{n}"), n + 1
            folder.rename(target)
        dist.barrier(f"checkpoint_set_aside_{step}")
        self._manager.reload()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def array_metadata(step_folder: str | Path):
    """The tree of orbax's array metadata (shape, dtype) of a step folder's ``state``, read without
    loading any array."""
    return ocp.PyTreeCheckpointHandler().metadata(epath.Path(str(step_folder)) / "state").tree


def restore_subtree(step_folder: str | Path, abstract: dict) -> dict:
    """The arrays of ``abstract``'s keys alone (``{"params": ...}``: no optimizer state) from a step
    folder's ``state``, in ``abstract``'s shardings (any mesh: orbax reshards), after checking them
    against the saved metadata (``CheckpointMismatch``)."""
    folder = paths.path(step_folder)
    saved = leaves(array_metadata(folder))
    wanted = leaves(abstract)
    compare_trees({k: v for k, v in saved.items() if k.split("/")[0] in abstract}, wanted, f"checkpoint {folder}")
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, abstract)
    return ocp.PyTreeCheckpointer().restore(folder / "state", args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))


def _checkpoint_fault() -> bool:
    return os.environ.get(faults.ENV, "").startswith("checkpoint_commit")


def _fault_injecting_rename():
    """Orbax's atomic rename (its protocol on a local disk) with the fault sites just before and
    just after the commit. Used only when ARLOPTI_FAULT names one of them: otherwise orbax
    chooses the protocol for the storage (a commit file on GCS)."""
    from orbax.checkpoint._src.path.atomicity import AtomicRenameTemporaryPath

    class FaultInjectingRename(AtomicRenameTemporaryPath):
        async def finalize(self, *args, **kwargs):
            step = self.get_final().name.isdigit()  # the step folder's commit, not one of its items'
            if step:
                faults.point("checkpoint_commit")
            await super().finalize(*args, **kwargs)
            if step:
                faults.point("checkpoint_committed")

    return FaultInjectingRename


class PreemptionFlag:
    """Set by SIGTERM (or SIGINT): the loop saves a checkpoint and exits at the next step boundary."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self._event = threading.Event()
        self.signal_name = ""
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def close(self, stopping: bool = False) -> None:
        """Put back the handlers that were installed before; while ``stopping`` (a stop signal ended the
        run), ignore those signals instead. A run that stops is already leaving with its checkpoint saved,
        and a second signal would turn its exit status 75 into death by that signal: ``srun
        --kill-on-bad-exit`` sends SIGTERM to the tasks still leaving once the first has exited with 75,
        and launch/slurm_gpu.sh requeues only a 75."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if stopping else handler)
        self._previous = {}

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()
