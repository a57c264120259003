"""docs/explicit.md is executable: its ```python blocks run in order, in one fresh namespace."""

from __future__ import annotations

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "explicit.md"


def test_explicit_doc_blocks_run():
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 7, "the doc should keep its worked examples"
    namespace: dict = {"__name__": "docs_explicit"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name}[python block {i}]", "exec"), namespace)
