"""The sampler on its own devices (``rollout.devices``): how the devices split, each bad layout's one
``error:`` line, the weight sync (``shd.transfer``), and end to end on 4 + 4 CPU devices: after every
sync the sampler's copy equals the trainer's parameters on the sampler's devices alone, every update
consumes the batch of the schedule's version, a run repeats, a killed run resumes to the
uninterrupted records, k = 0 split comes within float rounding of the colocated run, and 2 processes
x (2 + 2) reproduce 1 process x (4 + 4)."""

import os
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.config import ConfigError, base_config, validate
from arlopti_jax.rl import pipeline, run_setup
from arlopti_jax.runtime import sharding as shd
from arlopti_jax.train import train
from run_fixtures import assert_nothing_compiled_late, kill_after_checkpoint, make_config, overrides, step_metrics


def split_config(devices=4, **fields):
    c = base_config()
    c.rollout.devices = devices
    for key, value in fields.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def fake_devices(processes: int, per: int):
    return [types.SimpleNamespace(id=p * per + i, process_index=p) for p in range(processes) for i in range(per)]


def test_each_process_gives_its_last_devices_to_the_sampler():
    trainer, sampler = run_setup.split_devices(split_config(4), jax.devices())
    assert [d.id for d in trainer] == [0, 1, 2, 3] and [d.id for d in sampler] == [4, 5, 6, 7]
    trainer, sampler = run_setup.split_devices(split_config(2), fake_devices(2, 4))  # 2 processes x 4
    assert [d.id for d in trainer] == [0, 1, 2, 4, 5, 6] and [d.id for d in sampler] == [3, 7]
    trainer, sampler = run_setup.split_devices(split_config(0), fake_devices(2, 4))
    assert len(trainer) == 8 and sampler == []
    mesh, own = run_setup.make_mesh(split_config(3)), run_setup.make_sampler_mesh(split_config(3))
    assert mesh.devices.size == 5 and own.devices.size == 3 and dict(own.shape) == {"data": 3, "fsdp": 1, "tensor": 1}
    assert not {d.id for d in mesh.devices.flat} & {d.id for d in own.devices.flat}
    assert run_setup.make_sampler_mesh(split_config(0)) is None


@pytest.mark.parametrize("n, processes, per, words", [
    (3, 2, 4, "a multiple of 2 below 8"),  # an odd share
    (8, 2, 4, "a multiple of 2 below 8"),  # nothing left for the trainer
    (2, 2, 1, "one process per device"),  # SLURM's one task per GPU
])
def test_a_split_the_processes_cannot_share_is_one_error(n, processes, per, words):
    with pytest.raises(ConfigError, match=words) as err:
        run_setup.split_devices(split_config(n), fake_devices(processes, per))
    assert str(err.value).startswith(f"config.rollout.devices={n} is invalid") and "\n" not in str(err.value)


@pytest.mark.parametrize("fields, starts", [
    ({"rollout.devices": 8}, "config.rollout.devices=8 is invalid: must leave the trainer at least one of the 8"),
    ({"rollout.devices": -1}, "config.rollout.devices=-1 is invalid: must be an integer >= 0"),
    ({"rollout.mesh.tensor": 3}, "config.rollout.mesh={'data': -1, 'fsdp': 1, 'tensor': 3} is invalid for the "
                                 "sampler's rollout.devices=4"),
    ({"mesh.fsdp": 8}, "config.mesh={'data': 1, 'dcn_data': -1, 'fsdp': 8, 'tensor': 1} is invalid for the "
                       "trainer's 4 devices (rollout.devices=4 sample)"),
])
def test_each_bad_layout_is_one_error_naming_its_field(fields, starts):
    c = split_config(**{"rollout.devices": 4, **fields})
    with pytest.raises(ConfigError) as err:
        validate(c, 8, "cpu")
    assert str(err.value).startswith(starts), str(err.value)
    with pytest.raises(ConfigError, match="one TPU slice"):
        validate(split_config(4), 8, "tpu", num_slices=2)


@pytest.mark.parametrize("spec", [(), ("fsdp",), (None, "tensor")])
def test_transfer_copies_onto_the_other_mesh_and_leaves_the_source(spec):
    trainer = shd.make_mesh({"fsdp": 4}, jax.devices()[:4])
    sampler = shd.make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:])
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), shd.NamedSharding(trainer, shd.P("fsdp")))
    target = shd.NamedSharding(sampler, shd.P(*spec))
    y = shd.transfer({"w": x}, {"w": target})["w"]
    assert y.sharding == target and {d.id for d in y.devices()} == {4, 5, 6, 7}
    np.testing.assert_array_equal(np.asarray(y), np.arange(32.0).reshape(8, 4))
    assert not x.is_deleted()


# ---- end to end (slow) ----

def split_values(sp, run_dir, **extra):
    return overrides(sp, run_dir, **{"rollout.devices": 4, "rollout.max_staleness": 1, "rollout.correction": "tis",
                                     "data.max_prompt_length": 128, "reward.fn": "reward_fixtures:length_reward",
                                     "reward.workers": 0, "mesh.fsdp": 4, "train.micro_batch": 4, **extra})


@pytest.fixture(scope="module")
def split_run(start_point, tmp_path_factory):
    """The k = 1 run on 4 + 4 devices, every sync checked: at ``advance(step, trained)`` the copy of
    version ``step`` (made there, or at the start) must equal ``trained``, the trainer's parameters
    of that version, and lie on the sampler's devices alone."""
    run_dir = tmp_path_factory.mktemp("split") / "a"
    checked = []
    advance = pipeline.Pipeline.advance

    def checked_advance(self, step, trained):
        advance(self, step, trained)
        copy = self.snapshots[step].params
        sampler = {d.id for leaf in jax.tree.leaves(copy) for d in leaf.devices()}
        assert sampler == {4, 5, 6, 7}, sampler
        for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(trained), jax.tree.leaves(copy)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"version {step} {path}")
        checked.append(step)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline.Pipeline, "advance", checked_advance)
        summary = train(make_config(split_values(start_point, run_dir)))
    return summary, step_metrics(run_dir), run_dir, checked


@pytest.mark.slow
def test_every_sync_arrives_and_every_update_takes_its_versions_batch(split_run):
    summary, records, _, checked = split_run
    assert checked == [0, 1, 2, 3]
    assert_nothing_compiled_late(summary)
    for step in range(4):
        rec = records[step + 1]
        assert rec["sampler/version"] == max(0, step - 1) and rec["sampler/lag"] == min(step, 1)
        assert rec["sync/bytes"] > 0
    assert all(records[s]["offpolicy/kl_k3"] > 1e-6 for s in (3, 4))  # the policies do differ at lag 1


@pytest.mark.slow
def test_a_split_run_repeats_and_resumes_to_the_same_records(split_run, start_point, tmp_path):
    _, want, _, _ = split_run
    train(make_config(split_values(start_point, tmp_path / "again")))
    assert step_metrics(tmp_path / "again") == want
    values = split_values(start_point, tmp_path / "b")
    helpers = str(Path(__file__).resolve().parents[1] / "helpers")
    kill_after_checkpoint(values, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [helpers, os.environ.get("PYTHONPATH", "")])})
    train(make_config({**values, "resume": "auto"}))
    assert step_metrics(tmp_path / "b") == want


@pytest.mark.slow
def test_k0_on_split_meshes_comes_within_rounding_of_the_colocated_run(start_point, tmp_path):
    """The synchronous schedule on 4 + 4 devices against the colocated trainer on its 4 devices
    (rollout.devices=0 with a 4-device mesh would be a different trainer; here the trainer's mesh is
    the same, fsdp=4 over devices 0-3, and only where the rollouts run differs)."""
    values = split_values(start_point, tmp_path / "split", **{"rollout.max_staleness": 0,
                                                              "rollout.correction": "none"})
    train(make_config(values))
    split = step_metrics(tmp_path / "split")
    with pytest.MonkeyPatch.context() as patch:  # colocated on the same 4 trainer devices
        patch.setattr(jax, "devices", lambda *a: jax.local_devices()[:4])
        train(make_config({**values, "rollout.devices": 0, "run_dir": str(tmp_path / "colocated")}))
    colocated = step_metrics(tmp_path / "colocated")
    assert sorted(split) == sorted(colocated)
    for step in colocated:
        extra = set(split[step]) - set(colocated[step])  # pi_old the trainer's: the gap to the sampler's logged
        assert extra <= {"sync/bytes", "sampler/version", "sampler/lag", "offpolicy/kl_k3",
                         "offpolicy/ratio_mean"}, extra
        assert split[step]["offpolicy/kl_k3"] == pytest.approx(0, abs=1e-5)  # the same policy, two programs
        for key, want in colocated[step].items():
            assert split[step][key] == pytest.approx(want, rel=1e-4, abs=1e-6), (step, key)


@pytest.mark.slow  # two processes: minutes on 2 cores
@pytest.mark.xdist_group("two_processes")  # never beside another two-process test: 4 processes on 2 cores
def test_two_processes_split_reproduce_one_process(split_run, start_point, tmp_path):
    """2 processes x 4 devices, each giving 2 to the sampler (trainer fsdp=4 over 2 + 2, sampler
    data=4 over 2 + 2; the weight sync through each process's own whole copy): the 1-process run's
    records, to float rounding, with its sync bytes and versions."""
    from two_processes import launch_two

    _, want, _, _ = split_run
    values = split_values(start_point, tmp_path / "two")
    proc = launch_two([f"--config.{k}={v}" for k, v in values.items()], tmp_path / "logs", timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    got = step_metrics(tmp_path / "two")
    assert sorted(got) == sorted(want)
    for step in want:
        assert set(got[step]) == set(want[step]), step
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
