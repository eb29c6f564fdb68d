"""The reproduction sweep's --quick form end to end: every variant runs, the table and the figures
are written and well-formed, and a second invocation resumes instead of starting over. The gpu
scale's start point (3-5 people; built here at tiny sizes) and its scale check; --jobs 2 on the
gpu scale's --quick form: the same runs as one job, three test sets in the report, resumption
(also of records a stopped main process had not merged), and a failed worker named with its runs
and log."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from arlopti_jax.reproduce import VARIANTS
from arlopti_jax.experiments.sweep import PAPER_VARIANTS

# One xdist worker runs this file, and its sweeps are session fixtures: a module fixture is torn
# down whenever the worker runs another file's test in between, and was built twice that way
# (150 s + 158 s of set-up in a fresh-clone run); every worker would build its own otherwise
pytestmark = pytest.mark.xdist_group("reproduce")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def run_quick(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m arlopti_jax.reproduce --quick [extra] --out OUT`` on CPU."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "arlopti_jax.reproduce", "--quick", *extra, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="session")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce")
    proc = run_quick(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.mark.slow  # about a minute on 2 cores; CI runs the slow tests
def test_quick_sweep_writes_the_table_and_figures(sweep):
    out, proc = sweep
    report = (out / "reproduction.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ")]  # the |---| rule is left out
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[0] == "method" and header[-1] == "avg" and len(header) >= 4  # at least two test sets
    body = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")[1:]] for r in rows[1:]}
    assert "start point (before RL)" in body
    for label, *_ in (VARIANTS[v] for v in PAPER_VARIANTS):
        cells = body[f"+ {label} (n=1)"]
        assert len(cells) == len(header) - 1
        for cell in cells:
            mean, std = (float(x) for x in re.fullmatch(r"([0-9.]+) ± ([0-9.]+)", cell).groups())
            assert 0.0 <= mean <= 1.0 and std == 0.0  # one seed
    for figure in ("curves.png", "mechanism.png"):
        width, height = png_size(out / figure)
        assert width > 600 and height > 300
    assert "![mechanism](mechanism.png)" in report
    mech = [line for line in report.splitlines() if line.startswith("| GRPO |")]
    assert len(mech) == 3 and all(len(line.strip("|").split("|")) == 6 for line in mech)  # norms, 2 isolation rows
    assert "![curves](curves.png)" in report and "Command: `python -m arlopti_jax.reproduce --quick" in report
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == len(PAPER_VARIANTS) and all(r["finished"] for r in results["runs"].values())
    # --report-only writes the same report from the records, running nothing
    (out / "reproduction.md").unlink()
    again = run_quick(out, "--report-only")
    assert again.returncode == 0 and again.stdout.strip() == f"wrote {out / 'reproduction.md'}", again.stderr[-3000:]
    assert (out / "reproduction.md").read_text() == report


@pytest.mark.slow  # about a minute on 2 cores; CI runs the slow tests
def test_a_second_invocation_resumes(sweep):
    out, _ = sweep
    results = json.loads((out / "results.json").read_text())
    lines = {name: len((out / "runs" / name / "metrics.jsonl").read_text().splitlines()) for name in results["runs"]}
    # as if the sweep had been killed during its last run
    last = list(results["runs"])[-1]
    del results["runs"][last]
    (out / "results.json").write_text(json.dumps(results))
    proc = run_quick(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((out / "results.json").read_text())
    assert set(again["runs"]) == set(lines)
    for name, count in lines.items():  # finished runs were skipped, the interrupted one resumed at its checkpoint
        assert len((out / "runs" / name / "metrics.jsonl").read_text().splitlines()) == count, name


# ---- scales and --jobs

TINY_GPU = dict(sft_steps=1, sft_batch=8, sft_rows_per_size=8, train_rows_per_size=12, test_rows_per_size=5,
                hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                dtype="float32")


@pytest.fixture(scope="module")
def gpu_start_point(tmp_path_factory):
    from arlopti_jax.embedded.start_point import ensure_start_point

    return ensure_start_point(tmp_path_factory.mktemp("gpu") / "start_point", seed=0, sizes=TINY_GPU, scale="gpu")


def test_gpu_scale_start_point_has_3_to_5_people(gpu_start_point):
    import pyarrow.parquet as pq

    data = gpu_start_point / "data"
    assert sorted(p.name for p in data.iterdir()) == ["test_3ppl.parquet", "test_4ppl.parquet", "test_5ppl.parquet",
                                                      "train.parquet"]
    for n in (3, 4, 5):
        test = pq.read_table(data / f"test_{n}ppl.parquet").to_pylist()
        assert len(test) == 5 and {r["data_source"] for r in test} == {f"kk_logic{n}"}
        assert all(len(r["names"]) == n and r["quiz"].startswith(f"You meet {n} inhabitants") for r in test)
    train = pq.read_table(data / "train.parquet").to_pylist()
    assert {r["data_source"] for r in train} == {"kk_logic3", "kk_logic4", "kk_logic5"}
    assert {tuple(r["names"]) for r in train if len(r["names"]) == 5} == {("Alice", "Bob", "Carol", "Dave", "Eve")}
    built = json.loads((gpu_start_point / "scale.json").read_text())
    assert built["scale"] == "gpu" and built["build"] == 2 and built["sizes"]["people"] == [3, 4, 5]
    config = json.loads((gpu_start_point / "model" / "config.json").read_text())
    assert config["hidden_size"] == 32  # the sizes' model, not the scale's


def test_a_start_point_of_another_scale_is_refused(gpu_start_point, tmp_path):
    from arlopti_jax.embedded.start_point import StartPointMismatch, ensure_start_point

    with pytest.raises(StartPointMismatch, match=rf"{re.escape(str(gpu_start_point))} holds a start point of "
                                                 r"scale 'gpu', not 'cpu'"):
        ensure_start_point(gpu_start_point, seed=0, sizes=TINY_GPU)
    with pytest.raises(StartPointMismatch, match=r"other settings .*differing: \['sft_steps'\]"):
        ensure_start_point(gpu_start_point, seed=0, sizes={**TINY_GPU, "sft_steps": 2}, scale="gpu")
    assert ensure_start_point(gpu_start_point, seed=0, sizes=TINY_GPU, scale="gpu") == gpu_start_point
    legacy = tmp_path / "start_point"  # built before scales: no scale.json, taken as cpu, build 1
    shutil.copytree(gpu_start_point, legacy)
    (legacy / "scale.json").unlink()
    with pytest.raises(StartPointMismatch, match="scale 'cpu', not 'gpu'"):
        ensure_start_point(legacy, seed=0, scale="gpu")
    with pytest.raises(StartPointMismatch, match=r"earlier version of this project \(build 1; this one builds 2"):
        ensure_start_point(legacy, seed=0)


def run_jobs(out: Path) -> subprocess.CompletedProcess:
    # no diagnostics: their compiles are half of a worker's time
    return run_quick(out, "--scale", "gpu", "--jobs", "2", "--variants", "grpo,grpo_ar_lopti",
                     "--diagnostics-every", "0")


@pytest.fixture(scope="session")
def jobs_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("jobs")
    proc = run_jobs(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow  # two worker processes compile the whole pipeline: ~2 min on 2 cores
def test_jobs_sweep_records_the_runs_of_one_job_and_reports_three_test_sets(jobs_sweep, sweep):
    results = json.loads((jobs_sweep / "results.json").read_text())
    one_job = json.loads((sweep[0] / "results.json").read_text())
    assert list(results["runs"]) == [n for n in one_job["runs"] if n.split("/")[0] in ("grpo", "grpo_ar_lopti")]
    for name, run in results["runs"].items():
        assert run["finished"] and [e["step"] for e in run["evals"]] == [1], name
        assert set(run) == set(one_job["runs"][name]), name
    assert results["scale"] == "gpu" and "start_eval" in results
    report = (jobs_sweep / "reproduction.md").read_text()
    assert "scale 'gpu' (3 / 4 / 5 people" in report
    rows = [line for line in report.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header == ["method", "test_3ppl", "test_4ppl", "test_5ppl", "avg"]
    assert {r.split("|")[1].strip() for r in rows[1:4]} == {
        "start point (before RL)", "+ GRPO (n=1)", "+ GRPO + AR + Lopti (n=1)"}
    assert all(len(r.strip("|").split("|")) == 5 for r in rows[1:4])
    assert png_size(jobs_sweep / "curves.png")[0] > 600
    assert sorted(p.name for p in (jobs_sweep / "logs").iterdir()) == ["worker0.log", "worker1.log"]
    assert not list((jobs_sweep / "workers").glob("worker*.json"))  # merged


@pytest.mark.slow  # two worker processes compile the whole pipeline: ~2 min on 2 cores
def test_jobs_sweep_resumes_and_names_a_failed_workers_runs(jobs_sweep):
    results = json.loads((jobs_sweep / "results.json").read_text())
    lines = {n: len((jobs_sweep / "runs" / n / "metrics.jsonl").read_text().splitlines()) for n in results["runs"]}
    # killed during grpo_ar_lopti's run, and before the records of grpo's were merged
    del results["runs"]["grpo_ar_lopti/seed0"]
    worker = {"runs": {"grpo/seed0": results["runs"].pop("grpo/seed0")}}
    (jobs_sweep / "workers" / "worker1.json").write_text(json.dumps(worker))
    (jobs_sweep / "results.json").write_text(json.dumps(results))
    proc = run_jobs(jobs_sweep)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((jobs_sweep / "results.json").read_text())
    assert list(again["runs"]) == list(lines) and all(r["finished"] for r in again["runs"].values())
    for name, count in lines.items():
        assert len((jobs_sweep / "runs" / name / "metrics.jsonl").read_text().splitlines()) == count, name
    # a run that fails: its worker is named with the run and its log
    del again["runs"]["grpo/seed0"]
    (jobs_sweep / "results.json").write_text(json.dumps(again))
    run_dir = jobs_sweep / "runs" / "grpo" / "seed0"
    shutil.rmtree(run_dir)
    (run_dir / "metrics.jsonl").mkdir(parents=True)  # the trainer cannot write its metrics
    proc = run_jobs(jobs_sweep)
    assert proc.returncode != 0
    failed = re.search(r"worker (\d) failed \(exit code \d+\) with runs \['grpo/seed0'\]: see (\S+)", proc.stderr)
    assert failed, proc.stderr[-3000:]
    assert failed.group(2) == str(jobs_sweep / "logs" / f"worker{failed.group(1)}.log")
    assert "metrics.jsonl" in Path(failed.group(2)).read_text()  # the worker's error is in its log
