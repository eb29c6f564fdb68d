"""The package's layout rule, read from the source: commands at the root, concern packages below,
imports only downward.

    commands (the root's modules)          train, eval, sft, export, plot, reproduce, warm_start
    aot                                    the compile-only check (its __main__ is a command)
    experiments -> rl -> embedded -> finetune -> store -> config -> {algos, rollout, tasks} -> models -> runtime

A module may import its own package and any package to its right; siblings in braces may not
import each other. The test parses every module (function-level imports included) and fails on
an edge that runs up or sideways, naming the file, the line and the two packages.
"""

import ast
from pathlib import Path

import arlopti_jax

PACKAGE = Path(arlopti_jax.__file__).parent
COMMANDS = {"train", "eval", "sft", "export", "plot", "reproduce", "warm_start"}
RANK = {"runtime": 0, "models": 1, "algos": 2, "rollout": 2, "tasks": 2, "config": 3, "store": 4, "finetune": 5,
        "embedded": 6, "rl": 7, "experiments": 8, "aot": 9}
COMMAND_RANK = 10


def _unit(module: str) -> str:
    """'arlopti_jax.rl.loop' -> 'rl'; 'arlopti_jax.train' -> 'train'; 'arlopti_jax' -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _rank(unit: str) -> int:
    return COMMAND_RANK if unit in COMMANDS else RANK[unit]


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) of every arlopti_jax import in the file, relative ones resolved."""
    module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("arlopti_jax")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "arlopti_jax":  # from arlopti_jax import rl, algos: each name is a unit
                found += [(node.lineno, f"arlopti_jax.{a.name}") for a in node.names]
            elif target.startswith("arlopti_jax."):
                found.append((node.lineno, target))
    return found


def violations(root: Path) -> list[str]:
    """Every import in the package at ``root`` that runs up or sideways."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        here = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if here == "__init__":
            continue
        for line, target in _imports(path, root):
            there = _unit(target)
            if there != here and _rank(there) >= _rank(here):
                bad.append(f"arlopti_jax/{rel}:{line}: {here} imports {there} ({target})")
    return bad


def test_the_root_holds_only_commands():
    root = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert root == COMMANDS, f"modules at the package root that are not commands: {sorted(root ^ COMMANDS)}"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(RANK), f"packages not placed in the import order: {sorted(packages ^ set(RANK))}"


def test_imports_run_one_way():
    bad = violations(PACKAGE)
    assert not bad, "imports that run up or sideways:\n" + "\n".join(bad)


def test_the_checker_finds_upward_sideways_and_relative_edges(tmp_path):
    root = tmp_path / "arlopti_jax"
    files = {
        "models/a.py": "from arlopti_jax.runtime import sharding\nfrom arlopti_jax.rl import loop\n",
        "algos/b.py": "from arlopti_jax import rollout, models\n",
        "rl/c.py": "def f():\n    from ..experiments import sweep\n    from . import loop\n",
        "train.py": "from arlopti_jax.rl.loop import train\nimport arlopti_jax.eval\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert violations(root) == [
        "arlopti_jax/algos/b.py:1: algos imports rollout (arlopti_jax.rollout)",
        "arlopti_jax/models/a.py:2: models imports rl (arlopti_jax.rl)",
        "arlopti_jax/rl/c.py:2: rl imports experiments (arlopti_jax.experiments)",
        "arlopti_jax/train.py:2: train imports eval (arlopti_jax.eval)",
    ]
