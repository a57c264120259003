"""docs/nn.md is executable: its ```python blocks run in order, in one fresh namespace."""

from __future__ import annotations

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "nn.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_nn_doc_blocks_run():
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 10, "the doc should keep its worked examples"
    namespace: dict = {"__name__": "docs_nn"}
    for i, block in enumerate(blocks):
        code = compile(block, f"{DOC.name}[python block {i}]", "exec")
        exec(code, namespace)  # a failing assert names the block in its traceback
