"""Command lines: --help for every CLI, field descriptions (code = help = README), new fields'
validation, and imports that run one way (entry points -> library)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from arlopti_jax.config.cli import config_table
from arlopti_jax.config import FIELD_DOCS, ConfigError, base_config, field_paths, validate
from arlopti_jax.sft import SFT_FIELD_DOCS, sft_config

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "arlopti_jax"
ENTRY_POINTS = {"arlopti_jax.train", "arlopti_jax.eval", "arlopti_jax.export", "arlopti_jax.sft", "arlopti_jax.plot",
                "arlopti_jax.reproduce"}


def help_output(module: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", module, "--help", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return proc.stdout


@pytest.mark.parametrize("module", ["arlopti_jax.train", "arlopti_jax.eval"])
def test_help_lists_every_config_field(module):
    out = help_output(module)
    listed = set(re.findall(r"^  ([a-z_]+(?:\.[a-z_0-9]+)*) = ", out, re.MULTILINE))
    assert listed == set(field_paths(base_config()))
    assert "configs/kk.py" in out and "--config.GROUP.FIELD=VALUE" in out and "Examples:" in out
    for name, meaning in FIELD_DOCS.items():  # each field's line is followed by its meaning
        assert re.search(rf"^  {re.escape(name)} = .*\n      {re.escape(meaning.split()[0])}", out, re.MULTILINE), name
    # with a config file, its values, and the base default where the file differs
    out = help_output(module, "--config=configs/kk.py:7b,grpo")
    assert "  rollout.max_response_length = 4096\n" in out
    assert "  run_dir = runs/kk_7b_grpo   [base: runs/run]" in out


def test_help_into_a_reader_that_stops_early():
    """`--help | head -1` where head is gone before the help is written: the command still exits
    0, without a traceback (the reader here closes its end at once, so the write always fails)."""
    proc = subprocess.Popen([sys.executable, "-m", "arlopti_jax.train", "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()[-2000:]


def test_help_of_sft_and_export():
    out = help_output("arlopti_jax.sft")
    listed = set(re.findall(r"^  ([a-z_]+(?:\.[a-z_0-9]+)*) = ", out, re.MULTILINE))
    assert listed == set(field_paths(sft_config()))
    assert "Examples:" in out
    out = help_output("arlopti_jax.export")
    assert "--checkpoint" in out and "--out" in out and "examples:" in out  # its only arguments


def test_every_field_has_a_description():
    assert list(FIELD_DOCS) == [f for f in FIELD_DOCS if f in field_paths(base_config())], "stale entries"
    assert set(FIELD_DOCS) == set(field_paths(base_config()))
    assert set(SFT_FIELD_DOCS) == set(field_paths(sft_config()))
    assert all(len(v.split()) >= 2 for v in [*FIELD_DOCS.values(), *SFT_FIELD_DOCS.values()])


def test_reference_config_table_is_the_generated_one():
    page = (REPO / "docs" / "reference" / "config.md").read_text()
    table = config_table()
    assert table in page, ("docs/reference/config.md's config table differs from the code; replace the table\n"
                           "under its 'The fields' heading with the output of\n"
                           "python -c 'from arlopti_jax.config.cli import config_table; print(config_table())'")
    for name in FIELD_DOCS:
        assert f"| `{name}` |" in page


@pytest.mark.parametrize("field,value,message", [
    ("train.eval_ks", (1, 4), "train.eval_ks=(1, 4) is invalid: must be integers k with 1 <= k <= train.eval_n = 1"),
    ("train.eval_ks", ("1,a",), "train.eval_ks=('1,a',) is invalid"),
    ("train.eval_temperature", 0.0, "train.eval_temperature=0.0 is invalid: must be > 0"),
    ("rollout.stop", ("</answer>", ""), "rollout.stop=('</answer>', '') is invalid: must be a tuple of non-empty"),
    ("rollout.stop", (1,), "rollout.stop=(1,) is invalid: must be a tuple of non-empty strings"),
    ("train.diagnostics_every", -1, "train.diagnostics_every=-1 is invalid"),
    ("train.ppo_epochs", 0, "train.ppo_epochs=0 is invalid: must be an integer >= 1"),
    ("algo.max_sample_rounds", 0, "algo.max_sample_rounds=0 is invalid: must be >= 1"),
    ("algo.overlong_buffer", 4096, "algo.overlong_buffer=4096 is invalid: must be in [0, rollout.max_response_length"),
    ("algo.overlong_penalty", -1.0, "algo.overlong_penalty=-1.0 is invalid"),
    ("model.attention", "flash", "model.attention='flash' is invalid: allowed values are ['auto', 'xla', 'cudnn']"),
    ("model.decode_attention", "cudnn",
     "model.decode_attention='cudnn' is invalid: allowed values are ['auto', 'xla', 'pallas']"),
    ("rollout.max_staleness", -1, "rollout.max_staleness=-1 is invalid: must be an integer >= 0"),
    ("rollout.correction", "is", "rollout.correction='is' is invalid: allowed values are ['none', 'tis', 'seq_mask']"),
    ("rollout.correction", "tis", "rollout.correction='tis' is invalid: corrects pi_old against the sampler's"),
    ("rollout.tis_cap", 0.5, "rollout.tis_cap=0.5 is invalid: must be a finite number >= 1"),
    ("rollout.seq_mask_bound", 1.0, "rollout.seq_mask_bound=1.0 is invalid: must be a finite number > 1"),
])
def test_new_fields_are_validated(field, value, message):
    c = base_config()
    group, name = field.split(".")
    c[group][name] = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(c)


def test_cudnn_attention_needs_bfloat16():
    c = base_config()
    c.model.attention, c.model.dtype = "cudnn", "float32"
    with pytest.raises(ConfigError, match=re.escape("model.attention='cudnn' is invalid: cuDNN's fused attention")):
        validate(c)
    c.model.dtype = "bfloat16"
    validate(c)


def test_filter_groups_needs_groups():
    c = base_config()
    c.algo.filter_groups, c.rollout.n, c.train.mini_batch, c.train.micro_batch = True, 1, 64, 8
    with pytest.raises(ConfigError, match=re.escape("algo.filter_groups=True is invalid: needs rollout.n >= 2")):
        validate(c)
    c.rollout.n, c.train.eval_n, c.train.eval_ks = 2, 8, (1, 4, 8)
    c.train.mini_batch = 128
    validate(c)


def _imports(path: Path) -> set[str]:
    """arlopti_jax modules ``path`` imports (at any depth: function-level imports count too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("arlopti_jax"):
            for alias in node.names:  # `from arlopti_jax import algos` imports a module
                sub = f"{node.module}.{alias.name}"
                out.add(sub if _module_file(sub) else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("arlopti_jax"))
    return out


def _module_file(name: str) -> Path | None:
    base = REPO / Path(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_imports_run_one_way():
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    graph = {m: {d for d in _imports(p) if d in modules and d != m} for m, p in modules.items()}
    for name, deps in graph.items():  # entry points import the library, never each other
        assert not deps & ENTRY_POINTS, f"{name} imports the entry point(s) {sorted(deps & ENTRY_POINTS)}"
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in graph[m]:
            if state.get(d) == 1:
                cycle = path[path.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_config_file_flag_is_defined_in_one_place():
    """train, eval and aot define ``--config`` with ``cli.define_config_file``: the embedded default
    without a file, overrides applied, the config locked against new fields."""
    code = ("import sys\nfrom absl import flags\nfrom arlopti_jax.config.cli import define_config_file\n"
            "define_config_file()\nflags.FLAGS(['x', *sys.argv[1:]])\nc = flags.FLAGS.config\n"
            "print(c.train.max_steps, c.rollout.n)\n")
    default = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    from arlopti_jax.embedded.default import get_config

    assert default.stdout.split() == [str(get_config().train.max_steps), str(get_config().rollout.n)], default.stderr
    changed = subprocess.run([sys.executable, "-c", code, "--config.train.max_steps=3"], capture_output=True,
                             text=True, cwd=REPO, timeout=120)
    assert changed.stdout.split()[0] == "3", changed.stderr
    new = subprocess.run([sys.executable, "-c", code, "--config.train.new_field=3"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert new.returncode != 0 and "new_field" in new.stderr
    for path in ("train.py", "eval.py", "aot/__main__.py"):
        source = (PACKAGE / path).read_text()
        assert "define_config_file" in source and "DEFINE_config_file" not in source, path
