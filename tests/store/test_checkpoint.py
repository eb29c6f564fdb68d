"""Checkpointer: a mismatch is told apart from damage; damage is set aside, never restarted over."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.store.checkpoint import (Checkpointer, CheckpointMismatch, CheckpointUnreadable, leaves,
                                          restore_subtree)


def _sharded(shape, value):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    return jax.device_put(jnp.full(shape, value, jnp.float32), sharding)


def _state(value, rows=8, cols=4):
    return {"params": {"w": _sharded((rows, cols), value)}, "opt_state": ({"mu": _sharded((rows, cols), -value)},),
            "rng": jnp.arange(2, dtype=jnp.uint32)}


def _truncate(folder):
    for f in (folder / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def test_a_checkpoint_of_other_shapes_is_a_mismatch_not_damage(tmp_path):
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    ckpt.save(1, _state(1.0), {"step": 1})
    ckpt.save(2, _state(2.0), {"step": 2})
    for other, needle in ((_state(0.0, cols=8), "params/w is float32\\[8, 4\\] there, float32\\[8, 8\\] here"),
                          ({**_state(0.0), "extra": _sharded((8,), 0.0)}, "no array extra"),
                          ({k: v for k, v in _state(0.0).items() if k != "rng"}, "an array rng this run")):
        with pytest.raises(CheckpointMismatch, match=needle):
            ckpt.restore_latest(other)
    assert ckpt.steps() == [1, 2] and not list((tmp_path / "ck").glob("*.unreadable"))  # nothing set aside
    step, restored, meta = ckpt.restore_latest(_state(0.0))
    assert step == 2 and meta == {"step": 2}
    np.testing.assert_array_equal(restored["opt_state"][0]["mu"], np.full((8, 4), -2.0))
    ckpt.close()


def test_damaged_checkpoints_are_set_aside_and_a_folder_of_only_damaged_ones_is_refused(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    for step in (1, 2, 3):
        ckpt.save(step, _state(float(step)), {"step": step})
    ckpt.close()
    _truncate(tmp_path / "ck" / "3")
    (tmp_path / "ck" / "2" / "state" / "_METADATA").write_text("{not json")  # unreadable metadata
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    step, restored, _ = ckpt.restore_latest(_state(0.0))
    assert step == 1
    np.testing.assert_array_equal(restored["params"]["w"], np.ones((8, 4)))
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if "unreadable" in p.name) == [
        "2.unreadable", "3.unreadable"]
    assert sum("unreadable" in r.getMessage() for r in caplog.records) == 2
    assert ckpt.steps() == [1]
    ckpt.save(2, _state(5.0), {"step": 2})  # the resumed run saves step 2 again, over nothing
    ckpt.close()

    _truncate(tmp_path / "ck" / "1")
    _truncate(tmp_path / "ck" / "2")
    ckpt = Checkpointer(tmp_path / "ck")
    with pytest.raises(CheckpointUnreadable, match=r"none of the checkpoints \[1, 2\]"):
        ckpt.restore_latest(_state(0.0))
    ckpt.close()


def test_the_parameters_alone_restore_on_another_mesh(tmp_path):
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    ckpt.save(4, _state(3.0), {"step": 4})
    ckpt.close()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=one)}}
    got = restore_subtree(tmp_path / "ck" / "4", target)
    assert set(got) == {"params"} and got["params"]["w"].sharding == one
    np.testing.assert_array_equal(got["params"]["w"], np.full((8, 4), 3.0))
    with pytest.raises(CheckpointMismatch, match="params/w is float32\\[8, 4\\] there, bfloat16\\[8, 4\\] here"):
        restore_subtree(tmp_path / "ck" / "4", {"params": {"w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16,
                                                                                    sharding=one)}})


def test_leaves_names_tuples_and_lists_alike():
    tree = {"a": ({"b": jnp.zeros((2, 3))}, None), "c": [jnp.ones(4, jnp.int32)]}
    assert leaves(tree) == {"a/0/b": ((2, 3), "float32"), "c/0": ((4,), "int32")}


_SECOND_SIGNAL = """
import os, signal, sys, time
from arlopti_jax.store.checkpoint import PreemptionFlag
flag = PreemptionFlag()
os.kill(os.getpid(), signal.SIGTERM)  # the stop: caught, the run saves and leaves
time.sleep(0.2)
assert flag
flag.close(stopping=sys.argv[1] == "stopping")
os.kill(os.getpid(), signal.SIGTERM)  # srun --kill-on-bad-exit's, once another task has exited with 75
time.sleep(0.2)
sys.exit(75)
"""


@pytest.mark.parametrize("stopping, status", [(True, 75), (False, -15)])
def test_a_stopping_run_keeps_its_exit_status_through_a_second_stop_signal(stopping, status):
    """A run that a stop signal ended ignores the next one (it would turn exit status 75, the one
    launch/slurm_gpu.sh requeues, into 143); a run closed otherwise gets the handler it had before."""
    mode = "stopping" if stopping else "finished"
    proc = subprocess.run([sys.executable, "-c", _SECOND_SIGNAL, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr[-2000:]

