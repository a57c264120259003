"""The documentation's examples run: every ```python block of each page (and of the README),
in order, in one namespace per page. The blocks carry their own asserts."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# The worked examples each page must keep (a page that loses them fails here).
MIN_BLOCKS = {"named_arrays.md": 5, "partitioning.md": 8, "nn.md": 10, "models.md": 6, "explicit.md": 7}


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, code) for each fenced python block."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in _BLOCK.finditer(text)]


PAGES = sorted(p.name for p in DOCS.glob("*.md") if python_blocks(p))


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page):
    path = DOCS / page
    blocks = python_blocks(path)
    need = MIN_BLOCKS.get(page, 1)
    assert len(blocks) >= need, f"{page}: expected {need} runnable examples, found {len(blocks)} python blocks"
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


def test_the_main_pages_have_runnable_examples():
    assert set(MIN_BLOCKS) <= set(PAGES), f"pages without python examples: {sorted(set(MIN_BLOCKS) - set(PAGES))}"
