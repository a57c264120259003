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


_CITED_TEST = re.compile(r"tests/(\w+\.py)((?:::\w+)?)")
_CITED_MORE = re.compile(r"`::(\w+)`")


def test_cited_tests_exist():
    """Pages name the tests that back them; a renamed or deleted test must not leave a page
    pointing at nothing. ``tests/x.py::name`` and a following ```::name``` both count."""
    tests = DOCS.parent / "tests"
    missing = []
    for page in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]:
        for line in page.read_text().splitlines():
            files = [(m.start(), tests / m.group(1), m.group(2)[2:]) for m in _CITED_TEST.finditer(line)]
            for m in _CITED_MORE.finditer(line):  # `::name` belongs to the file cited just before it
                before = [f for f in files if f[0] < m.start()]
                if before:
                    files.append((m.start(), before[-1][1], m.group(1)))
            for _, path, name in files:
                if not path.is_file() or (name and f"def {name}(" not in path.read_text()):
                    missing.append(f"{page.name}: {path.name}{'::' + name if name else ''}")
    assert not missing, "pages cite tests that do not exist:\n" + "\n".join(missing)


def test_pages_cite_no_missing_documents():
    """No page points at a document that is not in the repository (a design note outside it,
    a machine path)."""
    bad = []
    for page in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        bad += [f"{page.name}: {m}" for m in re.findall(r"(?:/work/|/root/|/home/)\S+", text)]
        for target in re.findall(r"\]\(([^)#]+?\.(?:md|ipynb|py|yaml))\)", text):
            if not (page.parent / target).exists():
                bad.append(f"{page.name}: link to {target}")
        if "DESIGN.md" in text:
            bad.append(f"{page.name}: cites DESIGN.md, which is not part of the repository")
    assert not bad, "\n".join(bad)


_FENCE = re.compile(r"^```text\n(.*?)^```", re.S | re.M)
_MODULE = re.compile(r"\b(\w+\.py)\b")


def code_map_modules(text: str) -> set[str]:
    """The modules docs/code_map.md names, as paths under src/: its ```text blocks that start with
    ``src/<package>/`` list modules at two spaces, and a ``folder/`` at two spaces lists its own
    modules indented below it."""
    named = set()
    for block in _FENCE.findall(text):
        lines = block.splitlines()
        head = re.match(r"src/(\w+)/\s*$", lines[0]) if lines else None
        if not head:
            continue
        folder = None
        for line in lines[1:]:
            indent = len(line) - len(line.lstrip())
            sub = re.match(r"  (\w+)/\s", line + " ")
            if sub and indent == 2:
                folder = sub.group(1)
                continue
            if indent == 2:
                folder = None
            for name in _MODULE.findall(line):
                named.add("/".join(p for p in (head.group(1), folder if indent > 2 else None, name) if p))
    return named


def test_code_map_names_every_module():
    """docs/code_map.md's trees name every module under src/ (each in its own folder) and nothing
    that is gone: a new module without a line there, or a deleted one still listed, fails here."""
    src = DOCS.parent / "src"
    actual = {str(p.relative_to(src)) for p in src.rglob("*.py") if p.name != "__init__.py"}
    documented = {m for m in code_map_modules((DOCS / "code_map.md").read_text()) if not m.endswith("__init__.py")}
    assert not actual - documented, f"docs/code_map.md does not name: {sorted(actual - documented)}"
    assert not documented - actual, f"docs/code_map.md names modules that do not exist: {sorted(documented - actual)}"


def test_code_map_names_every_command():
    """Every console script pyproject.toml installs is named on docs/code_map.md."""
    import tomllib

    scripts = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())["project"]["scripts"]
    text = (DOCS / "code_map.md").read_text()
    assert not [s for s in scripts if s not in text], [s for s in scripts if s not in text]
