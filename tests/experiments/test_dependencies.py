"""A plain install (``pip install arlopti_jax``, no extras) has every module the package imports:
each third-party import in arlopti_jax/ comes from a main dependency of pyproject.toml or from
one of theirs. ``reproduce`` writes its figures with matplotlib after every run of a sweep has
finished, so a module left to the test extra would fail there, hours in."""

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


def test_every_third_party_import_comes_with_a_plain_install():
    modules = set()
    for path in (ROOT / "arlopti_jax").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    third_party = modules - set(sys.stdlib_module_names) - {"arlopti_jax", "__future__"}
    dists = packages_distributions()
    plain = installed_by_plain_install()
    missing = {m: dists.get(m) for m in third_party
               if not any(_name(d) in plain for d in dists.get(m, [m]))}
    assert "matplotlib" in third_party  # reproduce's report and the plot command draw with it
    assert not missing, f"imported by arlopti_jax but not installed by a plain install: {missing}"
