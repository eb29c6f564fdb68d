"""A damaged model folder or an unusable run folder stops a run's start-up in one ``error:`` line that
names the file and the key (or the folder and the files looked for, or the path), before any tensor
is read and with nothing written to ``run_dir`` (``model_folder_fuzz.py``'s cases, on copies of the
embedded start point's folder). The cases go through ``run_setup.prepare_inputs``, the start-up that
``python -m arlopti_jax.train`` runs, in this process; two go through the commands themselves,
``train`` and ``eval`` under ARLOPTI_STARTUP_CHECK=1: a folder without its tokenizer, which until
2026-12-07 passed the check and then wrote ``run_dir`` and died in the warm-up on empty prompts, and a
weights file cut in its data."""

import os
import shutil
import subprocess
import sys
from collections import namedtuple


from arlopti_jax.config.cli import STARTUP_CHECK_ENV
from arlopti_jax.models import hf
from arlopti_jax.rl import run_setup
from model_folder_fuzz import TOKENIZER_FILES, fixed_cases, random_cases
from run_fixtures import cli, make_config, overrides


class HeaderOnly:
    """``safe_open`` that reads headers (names, shapes) and fails the test on a tensor's read."""

    real = hf.safe_open

    def __init__(self, *args, **kwargs):
        self._file = self.real(*args, **kwargs)

    def __enter__(self):
        self._st = self._file.__enter__()
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def keys(self):
        return self._st.keys()

    def get_slice(self, name):
        return self._st.get_slice(name)

    def get_tensor(self, name):
        raise AssertionError(f"start-up read the tensor {name}")


def start_up_error(start_point, folder, run_dir) -> str | None:
    """The message train's start-up would print for a run on ``folder`` (None: it starts)."""
    config = make_config(overrides(start_point, run_dir, **{"model.path": str(folder)}))
    try:
        run_setup.prepare_inputs(config)
    except (ValueError, FileNotFoundError) as err:  # what train.py's start-up turns into its error line
        return str(err)
    return None


def check(case, message, folder, run_dir) -> str | None:
    """What is wrong with the start-up's answer to ``case`` (None: it is right)."""
    if message is None:
        return "started"
    wanted = [n for n in case.names if n not in message]
    if "\n" in message or str(folder) not in message or wanted:
        return f"{message!r} (one line, naming {folder} and {wanted})"
    if run_dir.exists():
        return f"wrote {sorted(p.name for p in run_dir.iterdir())} to run_dir"
    return None


def test_every_damaged_model_folder_stops_start_up_in_one_line(start_point, tmp_path, monkeypatch):
    good = start_point / "model"
    monkeypatch.setattr(hf, "safe_open", HeaderOnly)
    assert start_up_error(start_point, good, tmp_path / "control") is None  # the undamaged folder starts
    cases = fixed_cases(good) + random_cases(good, seed=0, count=12)
    assert len({c.name for c in cases}) == len(cases)
    wrong = {}
    for case in cases:
        folder = tmp_path / case.name / "model"
        shutil.copytree(good, folder)
        case.damage(folder)
        run_dir = tmp_path / case.name / "run"
        problem = check(case, start_up_error(start_point, folder, run_dir), folder, run_dir)
        if problem:
            wrong[case.name] = problem
    assert not wrong, "\n".join(f"{name}: {problem}" for name, problem in wrong.items())


def test_a_run_dir_that_cannot_be_written_or_has_no_room_stops_start_up(start_point, tmp_path, monkeypatch):
    good = start_point / "model"
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    message = start_up_error(start_point, good, blocker / "run")
    assert message == f"config.run_dir={blocker / 'run'}: {blocker} is a file, not a folder"
    if not os.access("/sys", os.W_OK) or os.geteuid() == 0:  # sysfs takes no files, root's or anyone's
        message = start_up_error(start_point, good, "/sys/arlopti_run")
        assert message == "config.run_dir=/sys/arlopti_run: cannot write in /sys (Permission denied)"
        assert not os.path.exists("/sys/arlopti_run")

    usage = namedtuple("usage", "total used free")
    disk_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(*disk_usage(p)[:2], 3 << 20))  # 3 MiB free
    run_dir = tmp_path / "full" / "run"
    message = start_up_error(start_point, good, run_dir)
    assert message.startswith(f"config.run_dir={run_dir}: 0.00 GiB free on the disk of {tmp_path}, and one "
                              "checkpoint of this run takes 0.")
    assert not (tmp_path / "full").exists()


def one_error_line(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "start-up check passed" not in proc.stdout
    return errors[0]


def test_the_commands_stop_on_a_missing_tokenizer_and_cut_weights(start_point, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(start_point / "model", bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    values = overrides(start_point, tmp_path / "run", **{"model.path": str(bare)})
    env = {**os.environ, STARTUP_CHECK_ENV: "1"}
    proc = subprocess.run(cli(values), capture_output=True, text=True, env=env, timeout=600)
    assert one_error_line(proc) == (f"error: {bare}: no tokenizer (looked for tokenizer.json, tokenizer.model, "
                                    "vocab.json with merges.txt)")
    assert not (tmp_path / "run").exists()

    cut = tmp_path / "cut"
    shutil.copytree(start_point / "model", cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    values = overrides(start_point, tmp_path / "eval_run", **{"model.path": str(cut), "data.train_files": "",
                                                              "data.test_files": str(start_point / "data" /
                                                                                     "test_2ppl.parquet")})
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.eval", *cli(values)[3:]], capture_output=True,
                          text=True, env=env, timeout=600)
    assert one_error_line(proc).startswith(f"error: {weights}: not a whole safetensors file, cut short or damaged")
    assert not (tmp_path / "eval_run").exists()
