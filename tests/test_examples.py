"""Every shell and Python example in the README and in the config files' docstrings runs through
its start-up here, so that examples cannot drift from the code.

A command with a start-up beyond its arguments (train, eval, sft, export, reproduce) runs, in this
process, until ``cli.startup_done``: arguments parsed, config validated, paths resolved; with
``ARLOPTI_STARTUP_CHECK=1`` it stops there, before any heavy work. Any other Python command
stops once ``argparse`` has parsed its arguments. Launch scripts forward their arguments to the
trainer, whose start-up runs in a subprocess with the launch's device count. Python examples run
whole, on a small model.

Paths the examples name that do not exist here (``/models/Qwen2.5-3B-Instruct``, ``DIR``,
``RUN/checkpoints/STEP``) are checked twice: as written, the command must stop with one
``error:`` line naming the path; then each is replaced by a small real stand-in (a model folder,
a checkpoint's metadata) and the start-up must pass. Data paths resolve against a miniature of
the public data's layout (``data/kk/{3..7}ppl/{train,test}.parquet``, ``data/math/*.parquet``);
the embedded default finds a start point folder where it would build one.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import logging
import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from arlopti_jax.config.cli import STARTUP_CHECK_ENV

REPO = Path(__file__).resolve().parents[1]
PYTHONS = ("python", "python3", ".venv/bin/python")
# Flags naming paths: a model folder and a checkpoint must exist (an absent one gets a stand-in),
# data files are resolved, outputs are only written after the start-up.
MODEL_FLAGS = ("--config.model.path",)
CHECKPOINT_FLAGS = ("--checkpoint",)
OUTPUT_FLAGS = ("--config.run_dir", "--config.out_dir", "--out", "--config.compile_cache_dir")
DATA_FLAGS = ("--config.data.train_files", "--config.data.test_files", "--config.data.files")
# Devices of a launch: TPU chips by type (v5p and v4 names count TensorCores, 2 a chip).
TPU_CHIPS = {"v5litepod-16": 16, "v5p-8": 4}
SLURM_GPUS_PER_NODE = 8  # launch/slurm_gpu.sh's #SBATCH --gpus-per-node


# ---------------------------------------------------------------- the examples
def _shell_commands(text: str) -> list[str]:
    """Command lines of a shell snippet: continuations joined, comments dropped, split at &&."""
    out = []
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out += [c.strip() for c in shlex.join(shlex.split(line, comments=True)).split(" '&&' ")]
    return [c for c in out if c]


def markdown_examples(path: Path) -> list[tuple[str, str, str]]:
    """(where, kind, text): fenced bash and python blocks, and inline `python ...` commands."""
    text = path.read_text()
    name = str(path.relative_to(REPO))
    out = []
    for m in re.finditer(r"^```(bash|python)\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        line = text[: m.start()].count("\n") + 1
        if m.group(1) == "python":
            out.append((f"{name}:{line}", "python", m.group(2)))
        else:
            out += [(f"{name}:{line}", "shell", c) for c in _shell_commands(m.group(2))]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    for m in re.finditer(r"`((?:\.venv/bin/)?python3? [^`]+)`", prose):
        if m.group(1).split()[1] != "-":  # `python -` names stdin, not a command
            out.append((f"{name} (inline)", "shell", m.group(1)))
    return out


def readme_examples() -> list[tuple[str, str, str]]:
    return markdown_examples(REPO / "README.md")


GUIDES = sorted((REPO / "docs" / "guides").glob("*.md"))


def guide_examples() -> list[tuple[str, str, str]]:
    """The commands of docs/guides/*.md: a guide is followed step by step, so every command runs."""
    return [e for path in GUIDES for e in markdown_examples(path)]


def config_examples() -> list[tuple[str, str, str]]:
    """Command lines in the docstrings of configs/**/*.py (indented, with continuations)."""
    out = []
    for path in sorted((REPO / "configs").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        for block in re.findall(r"^(    \S.*(?:\n    .*)*)", doc, re.MULTILINE):
            out += [(str(path.relative_to(REPO)), "shell", c) for c in _shell_commands(block)
                    if c.split()[0] in (*PYTHONS, "launch/tpu_pod.sh", "launch/local.sh", "sbatch")]
    return out


EXAMPLES = [e for e in readme_examples() + guide_examples() + config_examples() if e[1] == "shell"]


def _id(example) -> str:
    return f"{example[0]}: {example[2]}"[:120]


# ---------------------------------------------------------------- stand-ins
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder to run the examples in: the public data's layout in miniature, a start point
    folder where the embedded default looks for one, a model folder, a checkpoint and a sweep's
    records to stand in for absent ones."""
    from hf_fixtures import write_hf_model

    from arlopti_jax.embedded.start_point import BUILD, SCALE_FILE, compact_rows, scale_sizes, sft_target
    from arlopti_jax.tasks.kk import generate_rows, write_parquet

    root = tmp_path_factory.mktemp("examples")
    for folder in ("configs", "bench", "analysis", "launch"):  # the examples run from a checkout's root
        (root / folder).symlink_to(REPO / folder, target_is_directory=True)
    model = write_hf_model(root / "stand_in" / "model", vocab_size=4096)  # rows for the stand-in tokenizer's tokens
    # enough rows for one batch of every config (train checks that at start-up: 64 prompts)
    for n in range(3, 8):
        for split in ("train", "test"):
            write_parquet(generate_rows(n, 64, seed=n), root / "data" / "kk" / f"{n}ppl" / f"{split}.parquet")
    kk = compact_rows(2, 32, seed=0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    math_rows = pa.table({"prompt": [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(64)],
                          "data_source": ["math_dsr"] * 64,
                          "reward_model": [{"ground_truth": str(i + 1), "style": "rule"} for i in range(64)]})
    for name in ("deepscaler_uniform_train", "math500", "aime", "amc"):
        (root / "data" / "math").mkdir(parents=True, exist_ok=True)
        pq.write_table(math_rows, root / "data" / "math" / f"{name}.parquet")
    from arlopti_jax.tasks import arith

    for split, rows in zip(("train", "test"), arith.generate(64, 64)):
        for task in ("arith", "arith_addsub20"):
            arith.write_parquet(rows, root / "data" / task / f"{split}.parquet")
    from arlopti_jax.finetune.tool_traces import NO_TOOL, prompt_messages
    from arlopti_jax.tasks import calc

    for arm in ("tool", "notool"):  # configs/smollm2_calc.py's start points (finetune/tool_traces.py's layout)
        start = root / "runs" / f"calc_{arm}_start"
        start.mkdir(parents=True)
        (start / "model").symlink_to(model, target_is_directory=True)
        for name, rows in zip(("train", "test_calc"), calc.generate(64, 64)):
            calc.write_parquet([{**r, "prompt": prompt_messages(r["extra_info"]["question"], NO_TOOL)} for r in rows],
                               start / "data" / f"{name}.parquet")
    for split, rows in zip(("train", "test"), calc.generate(64, 64)):  # python -m arlopti_jax.tasks.calc's
        calc.write_parquet(rows, root / "data" / "calc" / f"{split}.parquet")
    _stand_in_tokenizer(root / "data").save_pretrained(model)  # start-ups tokenize the prompts
    # a tool episode's absent model folder (a Qwen2.5 one) gets a stand-in whose template supports tools
    from chat_templates import QWEN25_TEMPLATE

    qwen_model = write_hf_model(root / "stand_in" / "qwen_model", vocab_size=4096)
    _stand_in_tokenizer(root / "data", QWEN25_TEMPLATE).save_pretrained(qwen_model)
    (root / "pairs.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "response": sft_target(r)}) + "\n"
                                              for r in kk))
    # the embedded default's start point, as ensure_start_point recognises a finished one
    sp = root / "runs" / "start_point"
    sp.mkdir(parents=True)
    (sp / "model").symlink_to(model, target_is_directory=True)
    write_parquet(kk, sp / "data" / "train.parquet")
    for n in (2, 3):
        write_parquet(kk, sp / "data" / f"test_{n}ppl.parquet")
    (sp / SCALE_FILE).write_text(json.dumps({"scale": "cpu", "build": BUILD, "seed": 0, "sizes": scale_sizes("cpu")}))
    # a checkpoint step folder: its metadata names the run's config and model folder
    from arlopti_jax.embedded.default import get_config

    checkpoint = root / "stand_in" / "run" / "checkpoints" / "30"
    (checkpoint / "meta").mkdir(parents=True)
    (checkpoint / "meta" / "metadata").write_text(json.dumps({"config": get_config().to_json(),
                                                              "model_path": str(model)}))
    # a LoRA run's (export --adapter): adapters of rank 16 on the stand-in model, by its hash
    from arlopti_jax.rl.resume import base_digest

    lora_config = get_config()
    lora_config.model.lora_rank = 16
    checkpoint_lora = root / "stand_in" / "lora_run" / "checkpoints" / "16"
    (checkpoint_lora / "meta").mkdir(parents=True)
    (checkpoint_lora / "meta" / "metadata").write_text(json.dumps(
        {"config": lora_config.to_json(), "model_path": str(model), "base_sha256": base_digest(model)}))
    # a --matched sweep's records (what reproduce --report-only reads before its work)
    records = root / "stand_in" / "sweep"
    records.mkdir(parents=True)
    (records / "results.json").write_text(json.dumps({"runs": {"grpo/seed0": {"finished": True}}, "matched": {}}))
    return {"root": root, "model": model, "qwen_model": qwen_model, "checkpoint": checkpoint,
            "checkpoint_lora": checkpoint_lora, "records": records,
            "data_file": root / "data" / "kk" / "3ppl" / "train.parquet"}


def _stand_in_tokenizer(data: Path, template: str | None = None):
    """A byte-level BPE tokenizer trained on the stand-in data's prompts, with a chat template:
    the prompts fit the configs' max_prompt_length as the real models' tokenizers make them fit.
    ``template``: one with tools (Qwen2.5's), whose tools section, written for ``calc``'s tool, is
    trained on too, and whose call markers are tokens of their own, as in Qwen2.5's vocabulary."""
    import pyarrow.parquet as pq
    import transformers
    from task_fixtures import CHAT_TEMPLATE, SPECIAL_TOKENS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [m["content"] for f in sorted(data.rglob("*.parquet"))
             for prompt in pq.read_table(f, columns=["prompt"]).column("prompt").to_pylist() for m in prompt]
    if template is not None:
        from arlopti_jax.tasks.envs import load_environment

        tools = load_environment("calc").tools
        renderer = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()),
                                                        chat_template=template)
        texts.append(renderer.apply_chat_template([{"role": "user", "content": "q"}], tools=tools, tokenize=False))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4000, special_tokens=SPECIAL_TOKENS,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    if template is not None:
        tok.add_tokens(["<tool_call>", "</tool_call>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"],
                                                chat_template=template or CHAT_TEMPLATE)


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value ``args`` give ``flag`` (``--flag=V`` or ``--flag V``; the last one wins), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with every value of ``flag`` replaced by ``value`` (appended when absent)."""
    out, i, found = [], 0, False
    while i < len(args):
        if args[i].startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        elif args[i] == flag and i + 1 < len(args):
            out += [flag, value]
            found, i = True, i + 1
        else:
            out.append(args[i])
        i += 1
    return out if found else out + [f"{flag}={value}"]


def path_arguments(module: str, args: list[str], cwd: Path) -> dict[str, str]:
    """flag -> the path it names: the model, data and checkpoint paths of the command line, and for
    train, eval and any script given a --config, those its config file names when the line does
    not (its defaults)."""
    out = {flag: v for flag in MODEL_FLAGS + DATA_FLAGS + CHECKPOINT_FLAGS if (v := _flag_value(args, flag))}
    if module == "arlopti_jax.reproduce" and "--report-only" in args:  # --out holds the records it reads
        out["--out"] = _flag_value(args, "--out")
    if module in ("arlopti_jax.train", "arlopti_jax.eval") or _flag_value(args, "--config"):
        from arlopti_jax.config import DEFAULT_CONFIG, load_config_file

        path, _, arg = (_flag_value(args, "--config") or DEFAULT_CONFIG).partition(":")
        config = load_config_file(cwd / path, arg)
        for flag, value in [("--config.model.path", config.model.path),
                            ("--config.data.train_files", config.data.train_files),
                            ("--config.data.test_files", config.data.test_files)]:
            if value and flag not in out:
                out[flag] = value
    return out


def absent(value: str, cwd: Path) -> list[str]:
    return [p for p in value.split(",") if p and not (cwd / p).exists()]


def substitute(args: list[str], paths: dict[str, str], world) -> list[str]:
    """``args`` with every absent path replaced by a stand-in (absolute data paths by their part
    from ``data/`` on, when the miniature layout holds it) and absolute outputs moved into the
    example folder."""
    root = world["root"]
    for flag, value in paths.items():
        if not absent(value, root):
            continue
        if flag in MODEL_FLAGS:
            new = str(world["qwen_model" if _flag_value(args, "--config.env.name") else "model"])
        elif flag in CHECKPOINT_FLAGS:
            new = str(world["checkpoint_lora" if "--adapter" in args else "checkpoint"])
        elif flag == "--out":  # a sweep's records (reproduce --report-only)
            new = str(world["records"])
        else:  # data: the same path in the miniature layout, else one of its files
            mapped = [p[p.index("/data/") + 1:] if "/data/" in p else p for p in value.split(",")]
            new = ",".join(p if (root / p).exists() else str(world["data_file"]) for p in mapped)
        args = _set_flag(args, flag, new)
    for flag in OUTPUT_FLAGS:  # a relative run_dir stays: the default's start point is beside it
        value = _flag_value(args, flag)
        if value is not None and value.startswith(("/", "gs://")) and flag not in paths:  # no bucket here
            args = _set_flag(args, flag, str(root / "outputs" / value.removeprefix("gs://").strip("/")))
    return args


# ---------------------------------------------------------------- running a start-up
class _Parsed(Exception):
    """argparse has parsed a command's arguments: its start-up is done."""


def _has_startup(module_file: str) -> bool:
    return "startup_done(" in Path(module_file).read_text()


def run_startup(target: str, source: str, args: list[str], cwd: Path, monkeypatch, capsys):
    """Run ``python -m target args`` (``python target args`` when target is a .py file; its code
    is ``source``) in this process to the end of its start-up; (exit status, stdout, stderr)."""
    from absl import flags

    known = set(flags.FLAGS)
    handlers = logging.getLogger().handlers[:]  # train's logging.basicConfig(force=True) replaces them
    monkeypatch.chdir(cwd)
    monkeypatch.setenv(STARTUP_CHECK_ENV, "1")
    monkeypatch.setattr(sys, "argv", [target, *args])
    if target.endswith(".py"):
        monkeypatch.syspath_prepend(str(Path(target).parent))  # a script imports its neighbours
    if not _has_startup(source):  # its start-up is its argument parsing
        parse = argparse.ArgumentParser.parse_args

        def parse_then_stop(self, *a, **k):
            parse(self, *a, **k)
            raise _Parsed

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    capsys.readouterr()
    try:
        if target.endswith(".py"):
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        code = 0
    except _Parsed:
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        for name in set(flags.FLAGS) - known:  # the command's flags, defined again by the next one
            delattr(flags.FLAGS, name)
        flags.FLAGS.unparse_flags()
        logging.getLogger().handlers[:] = handlers
    out, err = capsys.readouterr()
    return code, out, err


def check_command(tokens: list[str], world, monkeypatch, capsys):
    """One `python -m MODULE ARGS` or `python SCRIPT ARGS` command line through its start-up."""
    if tokens[1] == "-m":
        target = tokens[2]
        source = importlib.util.find_spec(target).origin
        if source.endswith("__init__.py"):  # a package runs its __main__
            source = str(Path(source).with_name("__main__.py"))
    else:
        target = source = str(REPO / tokens[1])
    args = [a.strip("[]") for a in tokens[3 if tokens[1] == "-m" else 2:]]  # an optional [--flag=X] is given
    root = world["root"]
    # aot reads no data and falls back to a Qwen2.5 size's shape for an absent model folder
    paths = path_arguments(target, args, root) if _has_startup(source) and target != "arlopti_jax.aot" else {}
    named = [p for value in paths.values() for p in absent(value, root)]
    if named:  # as written: stops with one line naming an absent path, and no traceback
        code, out, err = run_startup(target, source, args, root, monkeypatch, capsys)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and any(p in errors[0] for p in named), err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    code, out, err = run_startup(target, source, substitute(args, paths, world), root, monkeypatch, capsys)
    assert code == 0, (out + err)[-3000:]
    if any(a in ("-h", "--help") for a in args):
        assert out.startswith("usage:"), out[:3000]
    elif _has_startup(source):
        assert "start-up check passed" in out, (out + err)[-3000:]


def check_launch(tokens: list[str], world, *, processes: int, devices: int, script: str):
    """A launch script's trainer arguments through the trainer's start-up, in a subprocess with
    the launch's devices (every option the script itself takes must be one its parser knows; a
    line without trainer arguments, such as ``tpu_pod.sh --status``, checks just those)."""
    text = (REPO / script).read_text()
    options = set(re.findall(r"^\s+(--[a-z-]+)\)", text, re.MULTILINE))
    split = tokens.index("--") if "--" in tokens else next(
        (i for i, t in enumerate(tokens) if t.startswith("--config")), len(tokens))
    own = [t for t in tokens[:split] if t.startswith("--")]
    assert set(own) <= options, f"{script} does not take {sorted(set(own) - options)}"
    if split == len(tokens):
        return
    args = tokens[split + (tokens[split] == "--"):]
    args = substitute(args, path_arguments("arlopti_jax.train", args, world["root"]), world)
    env = {**os.environ, STARTUP_CHECK_ENV: "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={processes * devices}"}
    command = [sys.executable, "-m", "arlopti_jax.train", *args]
    if any(a.startswith("--config.rollout.hosts=") for a in args):  # roles are processes: run that many
        env.update(XLA_FLAGS="", PYTHON=sys.executable)
        command = ["bash", str(REPO / "launch" / "local.sh"), str(processes), "--devices", str(devices), "--", *args]
    proc = subprocess.run(command, cwd=world["root"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "start-up check passed" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]


# ---------------------------------------------------------------- the test
@pytest.mark.parametrize("example", EXAMPLES, ids=_id)
def test_example_passes_its_startup(example, world, monkeypatch, capsys):
    where, kind, text = example
    root = world["root"]
    tokens = shlex.split(text)
    program = tokens[0]
    if program in PYTHONS and tokens[1:3] == ["-m", "venv"]:
        assert tokens[3] == ".venv"  # the folder every other example's interpreter lives in
    elif program in PYTHONS and tokens[1:3] == ["-m", "pytest"]:
        config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
        for i, arg in enumerate(tokens):
            if arg == "-n":
                import xdist  # noqa: F401  (pytest-xdist, a test dependency, runs -n)
            if arg == "-m" and i > 2:
                assert any(m.split(":")[0] == tokens[i + 1] for m in config["markers"]), tokens[i + 1]
    elif program in PYTHONS and tokens[1] == "-c":
        monkeypatch.chdir(root)
        exec(compile(tokens[2], "<example>", "exec"), {"__name__": "__main__"})
    elif program in PYTHONS:
        check_command(tokens, world, monkeypatch, capsys)
    elif program in (".venv/bin/pip", "pip"):
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for spec in tokens[2:]:
            if spec.startswith(".["):
                assert set(spec[2:-1].split(",")) <= set(extras), spec
    elif program == "tensorboard":
        from arlopti_jax.embedded.default import get_config

        assert tokens[1:] == ["--logdir", get_config().run_dir]  # the default's TensorBoard folder
    elif program == "bash" and tokens[1] == "bench/gpu.sh":
        for line in gpu_group_commands(tokens[2]):
            check_command(["python", *line], world, monkeypatch, capsys)
    elif program == "launch/local.sh":
        check_launch(tokens, world, processes=int(tokens[1]), script=program,
                     devices=int(tokens[tokens.index("--devices") + 1]) if "--devices" in tokens else 1)
    elif program == "sbatch":
        nodes = next((int(t.split("=")[1]) for t in tokens if t.startswith("--nodes=")), 1)
        check_launch(tokens[tokens.index("launch/slurm_gpu.sh"):], world, processes=nodes,
                     devices=SLURM_GPUS_PER_NODE, script="launch/slurm_gpu.sh")
    elif program == "launch/tpu_pod.sh":
        chips = TPU_CHIPS[tokens[tokens.index("--type") + 1]] if "--type" in tokens else 0  # 0: no trainer
        check_launch(tokens, world, processes=1, devices=chips, script=program)
    elif program == "hf":  # huggingface_hub's CLI (a dependency): the subcommand and its options exist
        assert tokens[1] == "download", tokens
        hf = Path(sys.executable).parent / "hf"
        usage = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True, timeout=60).stdout
        for option in [t.split("=")[0] for t in tokens[2:] if t.startswith("--")]:
            assert option in usage, f"hf download has no {option}"
    elif program == "gcloud":  # no gcloud here: the staging copies' form (tpu_pod.sh's are in test_tpu_pod.py)
        assert tokens[1:4] == ["storage", "cp", "-r"] and tokens[-1].startswith("gs://"), tokens
    else:
        pytest.fail(f"{where}: no start-up check for {program!r}: add one to tests/test_examples.py")


def gpu_group_commands(group: str) -> list[list[str]]:
    """The `run NAME SECONDS SCRIPT ARGS...` benchmark lines of one group of bench/gpu.sh."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "bench" / "gpu.sh").read_text())
    body = re.search(rf"^  {group}\)\n(.*?)^    ;;", text, re.MULTILINE | re.DOTALL)
    assert body, f"bench/gpu.sh has no group {group!r}"
    lines = [shlex.split(l)[3:] for l in body.group(1).splitlines() if l.strip().startswith("run ")]
    assert lines, f"bench/gpu.sh group {group!r} runs no benchmark"
    return lines


def test_every_guide_has_commands_and_no_python_block():
    """Each guide's commands are found (a layout change must not leave a guide unchecked), and a
    guide holds no Python block, which only the README's API section runs."""
    assert GUIDES, "docs/guides/ holds no guide"
    for path in GUIDES:
        kinds = [kind for _, kind, _ in markdown_examples(path)]
        assert "shell" in kinds, f"{path.relative_to(REPO)} has no command in a ```bash block"
        assert "python" not in kinds, f"{path.relative_to(REPO)} has a ```python block: make it a command"


def test_every_config_docstring_example_was_found():
    """The extraction above sees the examples (a change of docstring layout must not silently
    leave them unchecked)."""
    found = {where for where, _, _ in config_examples()}
    for path in (REPO / "configs").rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if re.search(r"^    (python|launch/)", doc, re.MULTILINE):
            assert str(path.relative_to(REPO)) in found, path


# ---------------------------------------------------------------- Python examples
# Names a README Python block leaves to the reader, for the blocks' 16 responses (2 prompts x 8).
READER_NAMES = {"prompt_token_lists": [[5, 6, 7, 8], [9, 10]], "rewards": np.arange(16, dtype=np.float32) % 3}
# Sizes cut for the small model: its responses never meet the EOS ids the example names, so each
# runs to the budget (generate took 15 s at 512 tokens on 2 cores, 9.5 s at 16, mostly compiling).
SMALLER = {"max_response_len=512": "max_response_len=16"}


def python_examples() -> str:
    """The README's Python blocks as one program (later blocks use the earlier ones' names), but
    the LoRA section's (``test_the_readme_lora_example_runs``)."""
    return "\n".join(text for _, kind, text in readme_examples() if kind == "python" and "peft" not in text)


@pytest.mark.slow  # a LoRA run of 2 steps on the stand-in model, its export and PEFT
def test_the_readme_lora_example_runs(world, start_point, tmp_path):
    """The README's LoRA section end to end on the tests' start point model: its train command (cut to 2
    steps), its `export --adapter` of that run's checkpoint, and its Python block, which loads the
    adapter onto the base with peft and transformers."""
    examples = readme_examples()
    [train] = [shlex.split(t) for _, k, t in examples if k == "shell" and "lora_rank" in t and "train" in t]
    [export] = [shlex.split(t) for _, k, t in examples if k == "shell" and "--adapter" in t]
    [block] = [t for _, k, t in examples if k == "python" and "peft" in t]
    root = tmp_path / "checkout"
    (root / "models").mkdir(parents=True)
    (root / "models" / "smollm2-135m").symlink_to(start_point / "model", target_is_directory=True)
    for folder in ("configs", "data"):
        (root / folder).symlink_to(world["root"] / folder, target_is_directory=True)
    # 2 steps; the start point's small tokenizer makes the arithmetic prompts longer than SmolLM2's does
    steps = ["--config.train.max_steps=2", "--config.train.save_every=2", "--config.train.eval_every=2",
             "--config.data.max_prompt_length=512"]
    for command in (train[1:] + steps, [a.replace("checkpoints/16", "checkpoints/2") for a in export[1:]]):
        proc = subprocess.run([sys.executable, *command], cwd=root, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    cwd = os.getcwd()
    os.chdir(root)
    try:
        scope = {"__name__": "__main__"}
        exec(compile(block, "README.md (LoRA)", "exec"), scope)
    finally:
        os.chdir(cwd)
    config = scope["model"].peft_config["default"]
    assert config.r == 16 and config.lora_alpha == 32
    layers = scope["base"].config.num_hidden_layers
    assert sum("lora_A" in name for name, _ in scope["model"].named_parameters()) == 7 * layers  # every projection


def test_python_examples_run(world, monkeypatch):
    """As written, the program must fail naming its absent model folder; with the stand-in
    model it must run to the end."""
    code = python_examples()
    absent = sorted({p for p in re.findall(r"\"(/[^\"]+)\"", code) if not Path(p).exists()})
    assert absent, "the README's Python examples name no model folder"
    monkeypatch.chdir(world["root"])
    with pytest.raises(Exception, match=re.escape(absent[0])):
        exec(compile(code, "README.md", "exec"), {"__name__": "__main__", **READER_NAMES})
    for path in absent:
        code = code.replace(f'"{path}"', f'"{world["model"]}"')
    for size, smaller in SMALLER.items():
        assert size in code, f"the README's Python examples no longer set {size}: update SMALLER"
        code = code.replace(size, smaller)
    scope = {"__name__": "__main__", **READER_NAMES}
    exec(compile(code, "README.md", "exec"), scope)
    assert (world["root"] / "exported" / "config.json").is_file()  # save_pretrained's folder
    assert len(scope["passes"]) == 2  # Lopti: the low- and high-probability passes
