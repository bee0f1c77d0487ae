"""The documentation runs and links: the ```python blocks of README.md and of every page under docs/
execute (in order, one namespace per page, 8 simulated CPU devices as in the rest of the suite), and
every relative link of those pages points to a file or directory of the repository (and to a heading
of the page it names, for ``page.md#anchor`` links)."""

import re
from pathlib import Path

import pytest

from core import parallel_state

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
# [text](target) outside code spans and blocks.
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
CODE = re.compile(FENCE.pattern + r"|`[^`\n]*`", flags=re.S | re.M)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_python_blocks_run(page):
    blocks = PYTHON_BLOCK.findall(page.read_text())
    namespace: dict = {"__name__": f"docs:{_name(page)}"}
    parallel_state.destroy_model_parallel()  # a page may call initialize_model_parallel
    try:
        for block in blocks:
            exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 (the docs' own examples)
    finally:
        parallel_state.destroy_model_parallel()


def _relative_links(page: Path) -> list[tuple[str, str]]:
    """(path, anchor) of every relative link of ``page``; an empty path is the page itself."""
    text = CODE.sub("", page.read_text())
    links = [(t + "#").split("#")[:2] for t in LINK.findall(text)]
    return [(p, a) for p, a in links if not re.match(r"^[a-z][a-z0-9+.-]*:", p)]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_exist(page):
    missing = []
    for path, anchor in _relative_links(page):
        target = page.parent / path if path else page
        if not target.exists():
            missing.append(path)
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            missing.append(f"{path}#{anchor}")
    assert not missing, f"{_name(page)} links to missing files or headings: {missing}"


def test_every_docs_page_is_listed_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md"]
    assert [p for p in pages if f"({p})" not in index] == []
