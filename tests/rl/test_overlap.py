"""The sampling loop's overlap (rl/pipeline.py) and the sampler hosts of their own (rl/hosts.py), end to
end on the tiny start point: the sampler's programs are dispatched before the host waits for the update,
on 1 process and on 2; the overlap changes no record (at a learning rate of 0 every version is one policy,
so the sampler/trainer KL is float rounding, in both runs); a weight sync that delivers stale or perturbed
weights and a sampler whose log-probs are perturbed each stop the run with one error line; the
2-process sampler-hosts run (process 0 trains, process 1 samples) gives the 1-process split run's records
and resumes after a kill to the uninterrupted records."""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from arlopti_jax.rl import loop, pipeline
from arlopti_jax.rl.pipeline import SyncError
from arlopti_jax.rl.update import MismatchError
from arlopti_jax.train import train
from run_fixtures import make_config, overrides, step_metrics

pytestmark = pytest.mark.slow  # each test trains; CI's slow pass runs them

HELPERS = str(Path(__file__).resolve().parents[1] / "helpers")


def split_values(sp, run_dir, **extra):
    """k = 1 on 1 + 1 devices: the trainer on host device 0, the sampler on device 1 (of the first 2)."""
    return overrides(sp, run_dir, **{"rollout.devices": 1, "rollout.max_staleness": 1, "data.max_prompt_length": 128,
                                     "reward.fn": "reward_fixtures:length_reward", "reward.workers": 0,
                                     "mesh.fsdp": 1, "train.micro_batch": 4, **extra})


@pytest.fixture
def two_devices(monkeypatch):
    """The run's job is the first 2 host devices (the tests' process has 8)."""
    devices = jax.local_devices()[:2]
    monkeypatch.setattr(jax, "devices", lambda *a: devices)
    monkeypatch.setattr(jax, "device_count", lambda *a: len(devices))


def events_of(run):
    import traced_train

    traced_train.EVENTS.clear()
    with pytest.MonkeyPatch.context() as patch:
        traced_train.install(patch)
        run()
    return list(traced_train.EVENTS)


def check_overlap(events, steps: int, k: int = 1):
    """Each step after the first with a batch left to sample ahead (0 < t < steps - k: the first samples
    its own batch before its update): a decode loop of the sampler's goes out before the host first
    waits for the update's results, and the update has begun by then."""
    for step in range(1, steps - k):
        mine = [e for s, e in events if s == step]
        assert "update began" in mine and "update waited for" in mine, (step, mine)
        waited = mine.index("update waited for")
        assert "update began" in mine[:waited] and "sampler dispatched a decode loop" in mine[:waited], (
            f"step {step}: the loop waited for the update before the sampler's next programs went out: {mine}")


def test_the_sampler_goes_out_before_the_update_is_waited_for_and_the_overlap_changes_no_record(
        start_point, tmp_path, two_devices):
    """On 1 + 1 devices at k = 1 with the learning rate 0: the dispatch order above, and the run with the
    sampler's programs dispatched only once the update has finished (``one_after_another``) gives the
    same records, its KL among them, which is float rounding (one policy, two programs); that run fails
    the order check, so the check can fail."""
    import traced_train

    values = split_values(start_point, tmp_path / "overlapped", **{"optim.lr": 0.0})
    events = events_of(lambda: train(make_config(values)))
    check_overlap(events, 4)
    overlapped = step_metrics(tmp_path / "overlapped")
    assert all(abs(overlapped[s]["offpolicy/kl_k3"]) < 1e-6 for s in overlapped), overlapped
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "run_together", traced_train.one_after_another)
        serial = events_of(lambda: train(make_config({**values, "run_dir": str(tmp_path / "serial")})))
    assert step_metrics(tmp_path / "serial") == overlapped
    with pytest.raises(AssertionError, match="waited for the update before the sampler"):
        check_overlap(serial, 4)


@pytest.mark.xdist_group("two_processes")  # never beside another two-process test: 4 processes on 2 cores
def test_on_two_processes_the_sampler_goes_out_before_the_update_is_waited_for(start_point, tmp_path):
    """2 processes x (1 + 1) devices (each gives its last to the sampler; the trainer's mesh fsdp = 2 over
    the two processes' first devices): every process dispatches in the same turns, in the overlap's
    order. (tests/rl/test_split_meshes.py checks such a run's records against one process's.)"""
    from two_processes import launch_two

    values = split_values(start_point, tmp_path / "two", **{"rollout.devices": 2, "mesh.fsdp": -1})
    trace = tmp_path / "trace"
    trace.mkdir()
    proc = launch_two([f"--config.{k}={v}" for k, v in values.items()], tmp_path / "logs", timeout=900,
                      module="traced_train", devices=2, TRACE_DIR=str(trace))
    assert proc.returncode == 0, proc.stdout[-4000:]
    per_process = [json.loads((trace / f"events_{p}.json").read_text()) for p in (0, 1)]
    assert per_process[0] == per_process[1]  # the same dispatches, in the same order, on both
    check_overlap(per_process[0], 4)


def perturbed_sync(leaf: int = 0, stale: bool = False):
    """A ``Pipeline.sync`` that delivers other weights: version 1's copy holds the previous version
    (``stale``), or one element of leaf ``leaf`` off by a float32 ulp; the checksums of what was sent
    are the trainer's own."""
    sync = pipeline.Pipeline.sync

    def delivers(self, version, trained, cast=True):
        snap = sync(self, version, trained, cast)
        if version != 1:
            return snap
        if stale:
            copy = self.snapshots[0].params
        else:
            leaves, tree = jax.tree.flatten(snap.params)
            x = np.array(leaves[leaf])
            x.reshape(-1)[0] = np.nextafter(x.reshape(-1)[0], np.float32(np.inf))
            leaves[leaf] = jax.device_put(x, leaves[leaf].sharding)
            copy = jax.tree.unflatten(tree, leaves)
        snap = pipeline.Snapshot(version, copy, snap.sent, self._got_fp(copy))
        self.snapshots[version] = snap
        return snap

    return delivers


@pytest.mark.parametrize("stale", [False, True])
def test_a_sync_that_delivers_other_weights_stops_the_run_naming_the_step_and_the_leaf(start_point, tmp_path,
                                                                                        two_devices, stale):
    values = split_values(start_point, tmp_path / "run", **{"train.max_steps": 3})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline.Pipeline, "sync", perturbed_sync(stale=stale))
        with pytest.raises(SyncError) as got:
            train(make_config(values))
    message = str(got.value)
    assert message.startswith("step 1: the weight sync of policy version 1 does not hold the trainer's parameters")
    import re

    differ = re.search(r": (\d+) of (\d+) arrays differ, the first \['\w+'\]", message)
    assert differ, message
    assert (int(differ.group(1)) > 1) if stale else int(differ.group(1)) == 1, message
    assert max(step_metrics(tmp_path / "run")) == 1  # step 0's record, and nothing after the bad sync


def test_a_sampler_whose_log_probs_are_off_stops_the_run_at_the_kl_bound(start_point, tmp_path, two_devices):
    """The sampler's log-probs of every token raised by 2 (a decode that computes other numbers): the KL
    to the trainer's pi_old is far over rollout.max_kl at the first step."""
    from arlopti_jax.rl import collect

    round_ = collect.Collector._round

    def off(self, *args):
        got = yield from round_(self, *args)
        rollout = got.rollout
        object.__setattr__(rollout, "logprobs", np.where(rollout.response_mask > 0, rollout.logprobs - 2.0, 0.0))
        return got

    values = split_values(start_point, tmp_path / "run", **{"train.max_steps": 2})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(collect.Collector, "_round", off)
        with pytest.raises(MismatchError, match=r"step 0: the sampler's log-probs of its batch are .* above "
                                                r"rollout.max_kl=0.5"):
            train(make_config(values))


@pytest.mark.xdist_group("two_processes")
def test_sampler_hosts_give_the_split_runs_records_and_resume_after_a_kill(start_point, tmp_path):
    """launch/local.sh 2 --devices 1 with rollout.hosts=1 (process 0 trains, process 1 samples, the
    weights crossing by cross-process device_put) against 1 process on 2 host devices with
    rollout.devices=1: the same records, every key (both are exact here: one device each side). Then the
    hosts run killed once checkpoint 2 is complete and resumed: the uninterrupted records."""
    import signal
    import time

    from two_processes import launch_two

    want_dir = tmp_path / "split"
    with pytest.MonkeyPatch.context() as patch:
        devices = jax.local_devices()[:2]
        patch.setattr(jax, "devices", lambda *a: devices)
        patch.setattr(jax, "device_count", lambda *a: len(devices))
        train(make_config(split_values(start_point, want_dir)))
    want = step_metrics(want_dir)
    values = split_values(start_point, tmp_path / "hosts", **{"rollout.devices": 0, "rollout.hosts": 1})
    args = [f"--config.{k}={v}" for k, v in values.items()]
    proc = launch_two(args, tmp_path / "logs", timeout=900, devices=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    got = step_metrics(tmp_path / "hosts")
    assert sorted(got) == sorted(want)
    for step in want:
        assert set(got[step]) == set(want[step]), step
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)

    killed = {**values, "run_dir": str(tmp_path / "killed")}
    run_dir = Path(killed["run_dir"])
    started = launch_two([f"--config.{k}={v}" for k, v in killed.items()], tmp_path / "logs_killed", timeout=900,
                         devices=1, wait=False)
    deadline = time.time() + 900
    while not (run_dir / "checkpoints" / "2" / "commit_success.txt").exists():
        assert started.poll() is None and time.time() < deadline, "the run ended before checkpoint 2"
        time.sleep(0.5)
    os.killpg(started.pid, signal.SIGKILL)
    started.wait()
    assert max(step_metrics(run_dir)) < 4, "the kill came too late to test anything"
    proc = launch_two([f"--config.{k}={v}" for k, v in {**killed, "resume": "auto"}.items()],
                      tmp_path / "logs_resumed", timeout=900, devices=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert step_metrics(run_dir) == got
