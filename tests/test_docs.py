"""The docs' own links and layout: every relative link in the repository's Markdown reaches a file
or folder of the checkout, and docs/measurements/ holds records, not scripts (benchmarks live in
bench/; a closed question's script is named in its folder's README with the commit that held it)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    top = [REPO / "README.md", REPO / "bench" / "README.md", REPO / "analysis" / "README.md"]
    return [p for p in top if p.exists()] + sorted((REPO / "docs").rglob("*.md"))


def broken_links(path: Path) -> list[str]:
    """Relative link targets of ``path`` (outside code blocks) that name no path of the checkout."""
    text = FENCE.sub("", path.read_text())
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):  # a URL or an anchor
            continue
        if not (path.parent / target.split("#")[0]).exists():
            out.append(target)
    return out


def test_every_relative_markdown_link_reaches_a_path():
    broken = {str(p.relative_to(REPO)): b for p in markdown_files() if (b := broken_links(p))}
    assert not broken, f"links to paths that do not exist: {broken}"


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("[a](there.md) [b](gone/x.md#s) [c](https://example.org) [d](#top)\n"
                    "```bash\n[e](inside/a/fence.md)\n```\n")
    assert broken_links(page) == ["gone/x.md#s"]


def test_measurements_hold_no_scripts():
    scripts = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs" / "measurements").rglob("*")
                     if p.suffix in (".py", ".sh"))
    assert not scripts, f"scripts in docs/measurements/ (move them to bench/ or remove them): {scripts}"
