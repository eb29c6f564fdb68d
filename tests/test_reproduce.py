"""The reproduction sweep's --quick form end to end: every variant runs, the table and the figures
are written and well-formed, and a second invocation resumes instead of starting over."""

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from arlopti_jax.reproduce import VARIANTS


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def run_quick(out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "arlopti_jax.reproduce", "--quick", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce")
    proc = run_quick(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_quick_sweep_writes_the_table_and_figures(sweep):
    out, proc = sweep
    report = (out / "reproduction.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ")]  # the |---| rule is left out
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[0] == "method" and header[-1] == "avg" and len(header) >= 4  # at least two test sets
    body = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")[1:]] for r in rows[1:]}
    assert "start point (before RL)" in body
    for label, *_ in VARIANTS.values():
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
    assert len(results["runs"]) == len(VARIANTS) and all(r["finished"] for r in results["runs"].values())


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
