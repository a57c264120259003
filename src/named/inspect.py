"""Human-facing views of arrays and layouts (terminal text and notebook HTML)."""

from __future__ import annotations

import html

from ._core import NamedArray


def named_array_html(x: NamedArray) -> str:
    """A small table: one row per axis with its size (and, under a mapping, its layout)."""
    rows = "".join(f"<tr><td><code>{html.escape(a.name)}</code></td><td>{a.size}</td></tr>" for a in x.axes)
    dtype = html.escape(str(getattr(x.array, "dtype", "?")))
    return (
        f"<div><b>NamedArray</b> <code>{dtype}</code>"
        f"<table><tr><th>axis</th><th>size</th></tr>{rows}</table></div>"
    )
