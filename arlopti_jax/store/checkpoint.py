"""Saving and restoring the whole training state with orbax.

A checkpoint is one step folder holding ``state`` (params, optimizer state, RNG key:
sharded arrays, written by every host) and ``meta`` (JSON: step, data-iterator position,
config). Orbax writes into a temporary folder and renames it when complete, so a crash
mid-save leaves nothing that looks finished; a finished folder that was damaged
afterwards (truncated files) fails to restore and is skipped with a warning in favour of
the previous one.
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

from arlopti_jax.runtime import faults

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


class Checkpointer:
    def __init__(self, directory: str | Path, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True,
                temporary_path_class=_fault_injecting_rename() if _checkpoint_fault() else None),
        )

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start saving (asynchronously); returns once device buffers are safe to donate."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        faults.point("checkpoint_write")  # the step folder is being written

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore ``step`` into the shapes/dtypes/shardings of ``abstract_state``."""
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """The newest checkpoint that restores cleanly; damaged ones are skipped with a warning."""
        for step in reversed(self.steps()):
            try:
                state, meta = self.restore(step, abstract_state)
            except Exception as err:  # orbax/tensorstore raise many types for damaged files
                log.warning("checkpoint %s/%d is unreadable (%s: %s); trying the previous one",
                            self.directory, step, type(err).__name__, str(err).splitlines()[0][:200])
                continue
            return step, state, meta
        return None

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


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

    def close(self) -> None:
        """Put back the handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()
