"""Layout notation, the plain-text half: ``"batch/data position embed/model"`` from axes and
partition-spec entries, and back to (names, mapping). Depends on nothing but axes, so the core,
explicit mode and the reports can all use it (``named.inspect.layout`` adds reading a layout
off an array or a mapping)."""

from __future__ import annotations

import re
from typing import Any

from ._axis import Axis, AxisError


def spec_entries(spec) -> list[tuple[str, ...]]:
    out = []
    for s in spec:
        out.append(() if s is None else ((s,) if isinstance(s, str) else tuple(s)))
    return out


def format_layout(axes, entries: list[tuple[str, ...]]) -> str:
    parts = []
    for a, e in zip(axes, entries):
        name = a.name if isinstance(a, Axis) else a
        parts.append(name if not e else f"{name}/{'+'.join(e)}")
    return " ".join(parts)


def sharding_layout(axes, sharding) -> str:
    """The layout notation of ``axes`` placed by ``sharding`` (one without a spec: replicated)."""
    spec = getattr(sharding, "spec", None)
    entries = spec_entries(spec) if spec is not None else []
    return format_layout(axes, entries + [()] * (len(axes) - len(entries)))


_NAME = r"[A-Za-z_][\w.\-]*"
_TOKEN = re.compile(rf"^({_NAME})(?:/({_NAME}(?:[+/]{_NAME})*))?$")


def parse_layout(text: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Read ``"batch/data position embed/model+data"`` back: (axis names, mapping).

    The mapping holds the split axes only: ``{"batch": "data", "embed": ("model", "data")}``.
    ``embed/model/data`` (seqax) is read as ``embed/model+data``.
    """
    if not isinstance(text, str):
        raise AxisError(f"a layout is a string like 'batch/data embed', got {text!r}")
    names, mapping = [], {}
    used: dict[str, str] = {}
    for tok in text.split():
        m = _TOKEN.match(tok)
        if not m:
            raise AxisError(f"cannot read {tok!r} in layout {text!r}; write name or name/mesh_axis[+mesh_axis]")
        name, mesh_axes = m.group(1), m.group(2)
        if name in names:
            raise AxisError(f"axis {name!r} appears twice in layout {text!r}")
        names.append(name)
        if mesh_axes:
            parts = tuple(re.split(r"[+/]", mesh_axes))
            for p in parts:
                if p in used:
                    raise AxisError(
                        f"mesh axis {p!r} splits both {used[p]!r} and {name!r} in layout {text!r}; "
                        "an array can use a mesh axis once"
                    )
                used[p] = name
            mapping[name] = parts[0] if len(parts) == 1 else parts
    return tuple(names), mapping
