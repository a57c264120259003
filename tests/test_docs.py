"""The documentation's examples run: every ```python block of each page (and of the README),
in order, in one namespace per page. The blocks carry their own asserts."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = ["named_arrays.md"]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, code) for each fenced python block."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page):
    path = DOCS / page
    blocks = python_blocks(path)
    assert len(blocks) >= 5, f"{page}: expected runnable examples, found {len(blocks)} python blocks"
    namespace: dict = {"__name__": f"docs.{page}"}
    for line, code in blocks:
        # Compile with the page's line numbers so a failure points at the markdown.
        exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)


def test_readme_example_runs():
    path = DOCS.parent / "README.md"
    blocks = python_blocks(path)
    assert blocks, "README.md should show the API in a python block"
    namespace: dict = {"__name__": "README"}
    for line, code in blocks:
        exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)


def test_every_doc_page_with_python_is_tested():
    """A page with python blocks is run here (PAGES) or named by another test file."""
    tests = " ".join(p.read_text() for p in pathlib.Path(__file__).parent.glob("test_*.py") if p.name != "test_docs.py")
    pages = {p.name for p in DOCS.glob("*.md") if python_blocks(p)}
    missing = {p for p in pages - set(PAGES) if p not in tests}
    assert not missing, f"add {sorted(missing)} to PAGES so their examples run"
