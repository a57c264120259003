"""Where arrays live, for people: layout notation, parameter reports, compiled-program reports.

Layout notation (after the seqax post): each axis of an array written as ``name`` when it is
replicated, or ``name/mesh_axis`` (``name/a+b`` over several mesh axes) when it is split:
``"batch/data position embed/model"``.
"""

from __future__ import annotations

import dataclasses
import html
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ._axis import Axis, AxisError, as_selectors
from ._core import NamedArray, is_named_array
from .partitioning import ResourceMapping, current_mapping, current_mesh, pspec_for

# ---- layout notation ----------------------------------------------------------------------


def _spec_entries(spec) -> list[tuple[str, ...]]:
    out = []
    for s in spec:
        out.append(() if s is None else ((s,) if isinstance(s, str) else tuple(s)))
    return out


def layout(x: NamedArray | Any, mapping: ResourceMapping | None = None) -> str:
    """``"batch/data position embed/model"``: the array's axes and the mesh axes that split them.

    With a mapping (or a current one) the layout is what the mapping asks for; without one,
    a concrete sharded array reports where it actually lives.
    """
    axes = x.axes if isinstance(x, NamedArray) else as_selectors(x)
    mapping = mapping if mapping is not None else current_mapping()
    if mapping is None and isinstance(x, NamedArray) and hasattr(x.array, "sharding") and not isinstance(x.array, jax.core.Tracer):
        sharding = x.array.sharding
        spec = getattr(sharding, "spec", None)
        entries = _spec_entries(spec) + [()] * (len(axes) - len(spec)) if spec is not None else [()] * len(axes)
    else:
        entries = _spec_entries(pspec_for(axes, mapping or {}, mesh=None))
    parts = []
    for a, e in zip(axes, entries):
        name = a.name if isinstance(a, Axis) else a
        parts.append(name if not e else f"{name}/{'+'.join(e)}")
    return " ".join(parts)


_TOKEN = re.compile(r"^([A-Za-z_][\w.\-]*)(?:/([A-Za-z_][\w\-]*(?:\+[A-Za-z_][\w\-]*)*))?$")


def parse_layout(text: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Read ``"batch/data position embed/model+data"`` back: (axis names, mapping)."""
    names, mapping = [], {}
    for tok in text.split():
        m = _TOKEN.match(tok)
        if not m:
            raise AxisError(f"cannot read {tok!r} in layout {text!r}; write name or name/mesh_axis[+mesh_axis]")
        name, mesh_axes = m.group(1), m.group(2)
        if name in names:
            raise AxisError(f"axis {name!r} appears twice in layout {text!r}")
        names.append(name)
        if mesh_axes:
            parts = tuple(mesh_axes.split("+"))
            mapping[name] = parts[0] if len(parts) == 1 else parts
    return tuple(names), mapping


# ---- parameter report ---------------------------------------------------------------------


@dataclasses.dataclass
class ParamRow:
    path: str
    axes: tuple[Axis, ...]
    layout: str
    dtype: str
    global_bytes: int
    bytes_per_device: int

    @property
    def replicated(self) -> bool:
        return "/" not in self.layout


@dataclasses.dataclass
class ParamReport:
    """Every NamedArray of a pytree: path, axes, layout, dtype, global bytes, bytes per device."""

    rows: list[ParamRow]
    mesh_shape: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(r.global_bytes for r in self.rows)

    @property
    def bytes_per_device(self) -> int:
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def replicated_fraction(self) -> float:
        rep = sum(r.global_bytes for r in self.rows if r.replicated)
        return rep / self.total_bytes if self.total_bytes else 0.0

    def __str__(self) -> str:
        head = ("path", "axes", "layout", "dtype", "bytes", "bytes/device")
        body = [
            (r.path, " ".join(f"{a.name}={a.size}" for a in r.axes), r.layout, r.dtype, _human(r.global_bytes), _human(r.bytes_per_device))
            for r in self.rows
        ]
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
        lines.append(
            f"total {_human(self.total_bytes)} over mesh {self.mesh_shape}: {_human(self.bytes_per_device)} per device, "
            f"{self.replicated_fraction:.1%} replicated"
        )
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{h}</th>" for h in ("path", "axes", "layout", "dtype", "bytes", "bytes/device"))
        rows = "".join(
            "<tr>" + "".join(f"<td><code>{html.escape(str(c))}</code></td>" for c in (
                r.path, " ".join(f"{a.name}={a.size}" for a in r.axes), r.layout, r.dtype, _human(r.global_bytes), _human(r.bytes_per_device))) + "</tr>"
            for r in self.rows
        )
        foot = (f"<p>total {_human(self.total_bytes)}, {_human(self.bytes_per_device)} per device on mesh "
                f"{html.escape(str(self.mesh_shape))}, {self.replicated_fraction:.1%} replicated</p>")
        return f"<table><tr>{head}</tr>{rows}</table>{foot}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def param_report(tree: Any, mapping: ResourceMapping | None, mesh=None) -> ParamReport:
    """The layout and memory of every NamedArray in ``tree`` under ``mapping`` on ``mesh``.

    Works on abstract trees (``jax.eval_shape`` of an init): nothing is allocated.
    """
    mesh = mesh if mesh is not None else current_mesh()
    mesh_shape = dict(mesh.shape) if mesh is not None else {}
    rows = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named_array)[0]:
        if not isinstance(x, NamedArray):
            continue
        spec = pspec_for(x, mapping or {}, mesh)
        parts = 1
        for e in _spec_entries(spec):
            parts *= math.prod(mesh_shape[m] for m in e) if e else 1
        nbytes = int(np.prod([a.size for a in x.axes], dtype=np.int64)) * np.dtype(x.array.dtype).itemsize
        rows.append(ParamRow(jax.tree_util.keystr(path), x.axes, layout(x, mapping or {}), str(np.dtype(x.array.dtype)),
                             nbytes, nbytes // parts))
    return ParamReport(rows, mesh_shape)


def named_array_html(x: NamedArray, mapping: Mapping | None = None) -> str:
    """Notebook view of a NamedArray: dtype, and one row per axis with its size and layout."""
    lay = layout(x, mapping).split()
    rows = "".join(
        f"<tr><td><code>{html.escape(a.name)}</code></td><td>{a.size}</td><td><code>{html.escape(lay[i])}</code></td></tr>"
        for i, a in enumerate(x.axes)
    )
    dtype = html.escape(str(getattr(x.array, "dtype", "?")))
    return (
        f"<div><b>NamedArray</b> <code>{dtype}</code> <code>{html.escape(' '.join(lay))}</code>"
        f"<table><tr><th>axis</th><th>size</th><th>layout</th></tr>{rows}</table></div>"
    )
