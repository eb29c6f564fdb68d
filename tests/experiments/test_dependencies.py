"""A plain install (``pip install arlopti_jax``, no extras) has every module the package imports:
each third-party import in arlopti_jax/ comes from a main dependency of pyproject.toml or from
one of theirs. ``reproduce`` writes its figures with matplotlib after every run of a sweep has
finished, so a module left to the test extra would fail there, hours in. The one exception is
the optional trackers (extras ``wandb`` and ``mlflow``): only ``store/trackers.py`` imports
them, and only for a run whose ``train.loggers`` names them, whose start-up checks them first."""

import ast
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def installed_by_plain_install() -> set[str]:
    """The main dependencies and, transitively, what they require without extras."""
    todo = [_name(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = requires(name) or []
        except PackageNotFoundError:
            continue
        todo += [_name(r) for r in reqs if "extra ==" not in r and "extra==" not in r]
    return seen


OPTIONAL = {"wandb": "wandb", "mlflow": "mlflow"}  # module -> the extra that installs it
TRACKERS = ROOT / "arlopti_jax" / "store" / "trackers.py"


def test_every_third_party_import_comes_with_a_plain_install():
    modules = set()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for path in (ROOT / "arlopti_jax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found = {node.module.split(".")[0]}
            else:
                continue
            for module in found & set(OPTIONAL):
                assert path == TRACKERS, f"{path}: imports the optional {module}; only store/trackers.py may"
                assert extras[OPTIONAL[module]], f"pyproject.toml has no extra {OPTIONAL[module]!r}"
            modules |= found - set(OPTIONAL)
    third_party = modules - set(sys.stdlib_module_names) - {"arlopti_jax", "__future__"}
    dists = packages_distributions()
    plain = installed_by_plain_install()
    missing = {m: dists.get(m) for m in third_party
               if not any(_name(d) in plain for d in dists.get(m, [m]))}
    assert "matplotlib" in third_party  # reproduce's report and the plot command draw with it
    assert not missing, f"imported by arlopti_jax but not installed by a plain install: {missing}"
