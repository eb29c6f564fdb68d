"""A small RL run on the session's start point: its config, its command line and its records
(shared by the training, fault, distributed and shared-prefix tests)."""

import json
import sys
import time
from pathlib import Path

from arlopti_jax.embedded.default import get_config

# metrics that depend on wall time, not on the computation
TIMING = ("time/", "throughput/", "compile/")  # wall time, and what this process happened to compile


def overrides(sp: Path, run_dir: Path, **extra) -> dict:
    base = {"run_dir": str(run_dir), "model.path": str(sp / "model"),
            "data.train_files": str(sp / "data" / "train.parquet"), "data.test_files": "",
            "rollout.n": 4, "rollout.max_response_length": 12, "train.batch_prompts": 4,
            "train.mini_batch": 8, "train.micro_batch": 8, "train.max_steps": 4, "train.save_every": 2,
            "train.samples_every": 1, "train.export_at_end": False, "loss.kl_coef": 0.001,
            "optim.schedule": "constant"}
    base.update(extra)
    return base


def make_config(values: dict):
    c = get_config()
    for key, value in values.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def assert_nothing_compiled_late(summary: dict) -> None:
    """The run compiled nothing after its first step (``train``'s warm-up compiled every program it
    met later; each late one is also logged as a warning naming it)."""
    programs, _, late = summary["compile"]
    assert late == 0, f"{late} of the run's {programs} programs compiled after the first step"


def cli(values: dict) -> list[str]:
    flag = lambda v: ",".join(map(str, v)) if isinstance(v, tuple) else v
    return [sys.executable, "-m", "arlopti_jax.train"] + [f"--config.{k}={flag(v)}" for k, v in values.items()]


def step_metrics(run_dir: Path) -> dict[int, dict]:
    """Each step's values from metrics.jsonl (records of one step merged, later ones winning:
    a resumed run rewrites steps), without timing-dependent values."""
    from arlopti_jax.runtime import paths

    out: dict[int, dict] = {}
    for line in (paths.path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update({k: v for k, v in rec.items() if not k.startswith(TIMING)})
    return out


def wait_for(predicate, proc, timeout=600):
    start = time.time()
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"training exited early with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        if time.time() - start > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the training process")
        time.sleep(0.5)


def kill_after_checkpoint(values: dict, step: int = 2, env: dict | None = None) -> None:
    """Run ``values`` as a separate ``train`` process and SIGKILL it once checkpoint ``step`` is
    complete (before the run's last step, or the kill tests nothing)."""
    import signal
    import subprocess

    from arlopti_jax.runtime import paths

    run_dir = paths.path(values["run_dir"])  # a local folder or a bucket's
    proc = subprocess.Popen(cli(values), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    wait_for(lambda: (run_dir / "checkpoints" / str(step) / "commit_success.txt").exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert max(step_metrics(run_dir)) < values.get("train.max_steps", 4), "the kill came too late to test anything"

