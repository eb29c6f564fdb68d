"""``launch/local.sh`` on its own, with a stand-in module instead of the trainer (no JAX): the exit
status is the first failure's, also when every process ends in the same instant (stop 70's CI:
``wait -n`` lost processes bash had already reaped and the launcher exited 1 for 75); a failure
stops the others; each process gets its own id and the coordinator; all succeed -> 0."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

STANDIN = """
import os, sys, time
args = sys.argv[1:]
pid = int(next(a for a in args if a.startswith("--config.distributed.process_id=")).split("=")[1])
open(os.path.join(os.environ["MARKS"], f"started_{pid}"), "w").write(" ".join(args))
plan = dict(p.split(":") for p in os.environ["PLAN"].split(","))  # process id -> "seconds/code"
seconds, code = plan.get(str(pid), plan["*"]).split("/")
time.sleep(float(seconds))
open(os.path.join(os.environ["MARKS"], f"ended_{pid}"), "w").write(code)
sys.exit(int(code))
"""


def launch(tmp_path: Path, n: int, plan: str) -> tuple[int, str, float]:
    (tmp_path / "standin_module.py").write_text(STANDIN)
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHON": sys.executable, "MARKS": str(marks),
           "PLAN": plan}
    start = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "launch" / "local.sh"), str(n), "--module", "standin_module",
                           "--logs", str(tmp_path / "logs"), "--", "--config.run_dir=x"],
                          capture_output=True, text=True, timeout=120, env=env)
    return proc.returncode, proc.stderr, time.monotonic() - start


@pytest.mark.parametrize("round_", range(3))
def test_processes_ending_together_give_their_status(tmp_path, round_):
    code, err, _ = launch(tmp_path, 6, "*:0.5/75")
    assert code == 75, err
    assert "no such job" not in err and "unbound variable" not in err, err


def test_all_succeed_gives_0_and_each_process_its_id(tmp_path):
    code, err, _ = launch(tmp_path, 3, "*:0.2/0")
    assert code == 0, err
    for i in range(3):
        args = (tmp_path / "marks" / f"started_{i}").read_text().split()
        assert args[0] == "--config.run_dir=x"
        assert f"--config.distributed.process_id={i}" in args
        assert "--config.distributed.num_processes=3" in args
        assert any(a.startswith("--config.distributed.coordinator=localhost:") for a in args)


def test_first_failure_is_the_status_and_stops_the_others(tmp_path):
    code, err, seconds = launch(tmp_path, 3, "1:0.5/3,2:2/5,*:60/0")
    assert code == 3, err
    assert "process 1 " in err and "status 3" in err
    assert seconds < 30  # process 0 would sleep 60 s: it was stopped
    assert not (tmp_path / "marks" / "ended_0").exists()
