"""The README and docs/ stay true: every ``python`` block runs, every relative link resolves.

A page's blocks run in order in one namespace, as a reader would paste them. A block that
cannot run here opens with ``# not run: <reason>`` (CUDA, several processes) and is skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import needs_compile

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"#\s*not run:\s*(.*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """``(line, source)`` of each ``python`` block of ``page``, in order."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start()) + 2, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == "python"
    ]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``."""
    text = FENCE.sub("", page.read_text())
    out = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=[needs_compile] if page.name == "compile.md" else [])
        for page in PAGES
    ],
    ids=_name,
)
def test_python_blocks_run(page: Path) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for line, source in python_blocks(page):
        first = source.lstrip().splitlines()[0] if source.strip() else ""
        skip = NOT_RUN.match(first)
        if skip:
            assert skip.group(1).strip(), f"{_name(page)}:{line}: '# not run:' needs a reason"
            continue
        code = compile(source, f"{_name(page)}:{line}", "exec")
        exec(code, namespace)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {path}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading '#{anchor}' in {_name(dest)}")
    assert not broken, f"{_name(page)}: " + "; ".join(broken)


def test_every_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not missing
