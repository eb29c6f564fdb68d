"""The sampling loop (rl/pipeline.py, ``rollout.max_staleness``): the fixed schedule and its
version check on a stand-in collector, and end to end at k = 1: every update's batch comes from
version t - 1 (read from the stamped versions in metrics.jsonl), a run repeats exactly and equals
the same run with its jobs in the main thread, the 'tis' correction trains, and a killed and
resumed run equals the uninterrupted one."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from arlopti_jax.rl.pipeline import Pipeline, Snapshot, Task, checkpoint_versions, run_together, sampling_version
from arlopti_jax.store.metrics import Timer
from arlopti_jax.train import train
from run_fixtures import kill_after_checkpoint, make_config, overrides, step_metrics


class Positions:
    """An iterator stand-in: its position is the number of batches drawn."""

    def __init__(self):
        self.drawn = 0

    def state_dict(self):
        return {"epoch": 0, "index": self.drawn}

    def __next__(self):
        self.drawn += 1
        return self.drawn


def test_schedule_versions_and_checkpoint_slots():
    assert [sampling_version(b, 2) for b in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [sampling_version(b, 1) for b in range(4)] == [0, 0, 1, 2]
    assert checkpoint_versions(0, 2) == [0, 0] and checkpoint_versions(5, 2) == [3, 4]
    assert checkpoint_versions(1, 1) == [0] and checkpoint_versions(3, 1) == [2]


class StandIn:
    """A collector stand-in: ``steps`` yields once (a decode loop's wait), then returns the batch it
    drew and the version it was given; ``started`` records the trainer's step when each batch began."""

    def __init__(self, trainer_step):
        self.trainer_step, self.started = trainer_step, {}

    def steps(self, params, iterator, key):
        batch = next(iterator) - 1
        self.started[batch] = self.trainer_step["now"]
        yield
        return {"batch": batch, "params": int(params)}


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_sampler_waits_for_its_version_and_drops_nothing(k):
    """Batch b starts only once step b - k has begun, every batch arrives once and in order, each
    stamped with the version of the parameters it was given (here the version number itself), and
    from the second step on each batch is sampled in turns with the update of the step before it."""
    trainer_step = {"now": -1}
    collect = StandIn(trainer_step)
    steps = 8
    loop = Pipeline(collect, Timer(), Positions(), key=__import__("jax").random.key(0), k=k, steps=steps, frozen={})
    loop._copy = lambda tree: tree  # the versions are plain numbers here: nothing to copy
    loop._sent_fp = loop._got_fp = lambda tree: np.zeros((1, 2), np.uint32)
    loop.snapshot(0, np.int32(0))
    loop.start(0)
    turns = []
    for step in range(steps):
        trainer_step["now"] = step
        loop.advance(step, np.int32(step))
        sampled = loop.take(step)
        assert sampled.batch == step and sampled.step_batch["batch"] == step
        assert sampled.version == sampling_version(step, k) == sampled.step_batch["params"]
        assert sampled.data_before == {"epoch": 0, "index": step} and sampled.data_after["index"] == step + 1

        def update():
            turns.append(("update", step))
            yield
            turns.append(("update done", step))

        run_together(Task("update", update()), loop.ahead(step),
                     on_turn=lambda task: turns.append(("turn", task.name, trainer_step["now"])))
        loop.verify(step, ["leaf"])
        loop.release(step + 1)
        assert sorted(loop.snapshots) == sorted(set(checkpoint_versions(step + 1, k)))
    loop.close()
    assert sorted(collect.started) == list(range(steps))
    for batch, at in collect.started.items():  # never more than k versions ahead, and ahead from step 1 on
        assert batch - k <= at <= max(0, batch - 1), f"batch {batch} started at trainer step {at} with k={k}"
    for step in range(steps - k):  # the update's first turn, then the sampler's, before the update finishes
        first = turns.index(("turn", "update", step))
        assert turns[first + 1:first + 3] == [("update", step), ("turn", "sampler", step)], turns[first:first + 4]
        assert turns.index(("turn", "sampler", step)) < turns.index(("update done", step))


def test_a_batch_of_another_version_is_an_error():
    loop = Pipeline(StandIn({"now": 0}), Timer(), Positions(), key=__import__("jax").random.key(0), k=1, steps=4,
                    frozen={})
    loop.adopt(0, 0)
    loop.snapshots[0] = Snapshot(1, 0)  # a copy labelled with the wrong version
    loop.start(0)
    with pytest.raises(RuntimeError, match="lag -1, not 0"):
        loop.take(0)
    with pytest.raises(ValueError, match="max_staleness=-1"):
        Pipeline(None, Timer(), Positions(), key=None, k=-1, steps=4, frozen={})


def test_a_copy_that_differs_from_what_was_sent_is_one_error_naming_the_step_and_leaf():
    """The checksums (``pipeline.fingerprint_program``) are exact: equal for the same bits in any
    sharding, different for one element changed by one bit or two elements swapped."""
    import jax
    import jax.numpy as jnp

    from arlopti_jax.rl.pipeline import SyncError, fingerprint_program
    from arlopti_jax.runtime import sharding as shd

    mesh = shd.make_mesh({"fsdp": 4}, jax.devices()[:4])
    other = shd.make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:])
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(8, 6)).astype(np.float32), "b": rng.normal(size=(4,)).astype(jnp.bfloat16)}
    here = jax.device_put(tree, {"a": shd.NamedSharding(mesh, shd.P("fsdp")), "b": shd.NamedSharding(mesh, shd.P())})
    there = jax.device_put(tree, {"a": shd.NamedSharding(other, shd.P(None, "tensor")),
                                  "b": shd.NamedSharding(other, shd.P("data"))})
    sums = lambda t: np.asarray(fingerprint_program(t)(t))
    assert (sums(here) == sums(there)).all()
    flipped = tree["a"].copy()
    flipped.view(np.uint32)[3, 2] ^= 1  # the last bit of one float
    swapped = tree["a"].copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    for changed in (flipped, swapped):
        got = sums({"a": jax.device_put(changed), "b": jax.device_put(tree["b"])})
        assert (got[0] != sums(here)[0]).any() and (got[1] == sums(here)[1]).all()

    loop = Pipeline(StandIn({"now": 0}), Timer(), Positions(), key=jax.random.key(0), k=1, steps=4, frozen={})
    loop.snapshot(0, here)
    loop.verify(0, ["['a']", "['b']"])  # the copy is the trainer's: nothing to say
    loop.snapshots[0] = Snapshot(0, None, sums(here), sums({"a": jax.device_put(flipped), "b": tree["b"]}))
    with pytest.raises(SyncError, match=r"step 0: the sampler's copy of policy version 0 .*1 of 2 arrays differ, "
                                        r"the first \['a'\]"):
        loop.verify(0, ["['a']", "['b']"])


# ---- end to end (slow) ----

def staleness_values(sp, run_dir, **extra):
    return overrides(sp, run_dir, **{"rollout.max_staleness": 1, "rollout.correction": "tis", "rollout.tis_cap": 1.05,
                                     "data.max_prompt_length": 128, "reward.fn": "reward_fixtures:length_reward",
                                     "reward.workers": 0, **extra})


@pytest.fixture(scope="module")
def one_step_off(start_point, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("staleness") / "a"
    summary = train(make_config(staleness_values(start_point, run_dir)))
    return summary, step_metrics(run_dir), run_dir


@pytest.mark.slow
def test_every_update_consumes_the_batch_of_the_version_before(one_step_off):
    summary, records, _ = one_step_off
    assert sorted(records) == [1, 2, 3, 4]
    for step in range(4):  # metrics of step t are recorded at t + 1
        rec = records[step + 1]
        assert rec["sampler/version"] == max(0, step - 1) and rec["sampler/lag"] == min(step, 1)
    # the 'tis' run trains: pi_old moved away from the behaviour policy after the first update, the
    # cap bound on some tokens, and the losses are finite
    assert records[1]["offpolicy/kl_k3"] == pytest.approx(0, abs=1e-6)  # step 0: pi_old is the sampler's policy
    assert all(records[s]["offpolicy/kl_k3"] > 1e-6 for s in (3, 4))
    assert any(records[s]["offpolicy/tis_clipped"] > 0 for s in (3, 4))
    assert all(np.isfinite(records[s]["update/low/pg_loss"]) for s in records)
    assert len(summary["rewards"]) == 4


def one_after_another(*tasks, on_turn=None):
    """``run_together`` without the overlap: each task to its end in turn, the update's programs waited
    for before the sampler's are dispatched."""
    import jax

    for task in tasks:
        if task is None:
            continue
        while not task.done:
            task.turn()
        if task.name == "update":
            jax.block_until_ready(task.value.params)


@pytest.mark.slow
def test_a_run_repeats_and_the_overlap_changes_no_record(one_step_off, start_point, tmp_path, monkeypatch):
    """The same run again gives the same records; so does the run with the sampler's programs dispatched
    only once the update has finished: the overlap changes the timing alone (a concurrent program must
    not change the decode: on the CPU under XLA's own fusions it once did, journal 2026-12-06)."""
    from arlopti_jax.rl import loop

    _, want, _ = one_step_off
    train(make_config(staleness_values(start_point, tmp_path / "again")))
    assert step_metrics(tmp_path / "again") == want
    monkeypatch.setattr(loop, "run_together", one_after_another)
    train(make_config(staleness_values(start_point, tmp_path / "serial")))
    assert step_metrics(tmp_path / "serial") == want


@pytest.mark.slow
def test_killed_and_resumed_equals_uninterrupted(one_step_off, start_point, tmp_path):
    """SIGKILL once checkpoint 2 is complete (batch 2, sampled by version 1, in flight), then resume=auto."""
    _, want, _ = one_step_off
    values = staleness_values(start_point, tmp_path / "b")
    helpers = str(Path(__file__).resolve().parents[1] / "helpers")  # reward_fixtures, for the child process
    kill_after_checkpoint(values, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [helpers, os.environ.get("PYTHONPATH", "")])})
    train(make_config({**values, "resume": "auto"}))
    assert step_metrics(tmp_path / "b") == want


@pytest.mark.slow
def test_a_correction_without_two_policies_and_another_schedule_on_resume_stop_at_start_up(one_step_off, start_point,
                                                                                            tmp_path):
    """One ``error:`` line each under ARLOPTI_STARTUP_CHECK=1, before any weights load: 'tis' on the
    on-policy loop, and resuming the k = 1 run's folder with k = 0."""
    from arlopti_jax.config.cli import STARTUP_CHECK_ENV
    from run_fixtures import cli

    def error_line(values):
        proc = subprocess.run(cli(values), capture_output=True, text=True, timeout=600,
                              env={**os.environ, STARTUP_CHECK_ENV: "1"})
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return errors[0]

    line = error_line(overrides(start_point, tmp_path / "c", **{"rollout.correction": "tis"}))
    assert line.startswith("error: config.rollout.correction='tis' is invalid: corrects pi_old")
    _, _, run_dir = one_step_off
    line = error_line({**overrides(start_point, run_dir), "rollout.max_staleness": 0})
    assert "config.rollout.max_staleness=0 but the checkpoint" in line and "written with 1" in line


@pytest.mark.slow
def test_a_stop_signal_saves_stops_the_sampler_and_the_resumed_run_equals_uninterrupted(one_step_off, start_point,
                                                                                         tmp_path):
    """SIGTERM as step 2's metrics record is written (batch 2 in flight, batch 3 perhaps being
    sampled): checkpoint 2 saved, the sampler's thread stopped, exit 75; resume=auto then finishes
    with the uninterrupted run's records."""
    import re

    from arlopti_jax.runtime import faults
    from run_fixtures import cli

    _, want, _ = one_step_off
    values = staleness_values(start_point, tmp_path / "run")
    helpers = str(Path(__file__).resolve().parents[1] / "helpers")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([helpers, os.environ.get("PYTHONPATH", "")]),
           faults.ENV: "metrics:2", faults.SIGNAL_ENV: "SIGTERM"}
    proc = subprocess.run(cli(values), capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 75 and re.search(r"received SIGTERM: checkpoint 2 saved", out), out[-3000:]
    assert max(step_metrics(tmp_path / "run")) == 2
    train(make_config({**values, "resume": "auto"}))
    assert step_metrics(tmp_path / "run") == want

