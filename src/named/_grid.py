"""The device grid: the mesh drawn as a grid, and in each device's cell the block of every array
axis that device holds (``embed[16:32] mlp[:]``), so a reader sees where an array lives.

``jax.debug.visualize_array_sharding`` draws 1-D and 2-D arrays only and shows no axis names;
this works for arrays of any rank, for abstract arrays (a ``ShapeDtypeStruct`` with a sharding)
and for what a mapping would do to a tree of parameters, before anything is placed.

Rows are the first mesh axis, columns the others (all combinations, the last fastest). Devices
that hold the same block share a colour (HTML) and a letter (text); a block held by ``k``
devices is marked ``×k``: it is replicated over the mesh axes that split nothing of it.
"""

from __future__ import annotations

import dataclasses
import html
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ._axis import ArgumentError, Axis
from ._compat import is_tracer
from ._core import NamedArray, is_named_array, unchecked
from ._layout import format_layout, spec_entries
from .partitioning import ResourceMapping, current_mapping, sharding_for


@dataclasses.dataclass(frozen=True)
class Cell:
    """One device of the mesh: its id (None on an abstract mesh), mesh coordinates, the
    ``(start, stop)`` it holds of each array axis, which distinct block that is, and how many
    devices hold the same block."""

    device: int | None
    coords: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...]
    block_id: int
    copies: int


def _letters(i: int) -> str:
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(ord("A") + r) + s
    return s


def _colour(i: int) -> str:
    # golden-angle hues: neighbouring block ids get far-apart colours, never a stripe-like grey
    return f"hsl({(i * 137.508) % 360:.0f}, 70%, 80%)"


@dataclasses.dataclass(repr=False)
class DeviceGrid:
    """Where one array lives on a mesh. ``str()`` is a text grid, ``_repr_html_`` a coloured one."""

    axes: tuple[Axis, ...]
    dtype: str
    layout: str
    mesh_axes: tuple[tuple[str, int], ...]
    cells: list[Cell]  # in mesh order (row-major over mesh_axes)
    title: str = ""

    @property
    def n_blocks(self) -> int:
        return len({c.block_id for c in self.cells})

    def block(self, device: int) -> dict[str, tuple[int, int]]:
        """``{axis name: (start, stop)}`` that device ``device`` (an id) holds."""
        for c in self.cells:
            if c.device == device:
                return {a.name: b for a, b in zip(self.axes, c.blocks)}
        raise ArgumentError(f"device {device} is not in this grid's mesh {dict(self.mesh_axes)}")

    # ---- layout of the drawing ----
    def _rows(self) -> list[list[Cell]]:
        sizes = [s for _, s in self.mesh_axes] or [1]
        n_cols = math.prod(sizes[1:])
        return [self.cells[r * n_cols : (r + 1) * n_cols] for r in range(sizes[0])]

    def _col_labels(self) -> list[str]:
        rest = self.mesh_axes[1:]
        if not rest:
            return [""]
        return [" ".join(f"{n} {i}" for (n, _), i in zip(rest, idx)) for idx in np.ndindex(*[s for _, s in rest])]

    def _row_label(self, r: int) -> str:
        return f"{self.mesh_axes[0][0]} {r}" if self.mesh_axes else ""

    def _axis_text(self, cell: Cell) -> list[str]:
        return [
            f"{a.name}[:]" if (lo, hi) == (0, a.size) else f"{a.name}[{lo}:{hi}]"
            for a, (lo, hi) in zip(self.axes, cell.blocks)
        ]

    def _head(self) -> str:
        shape = f"{self.dtype}[{' '.join(f'{a.name}={a.size}' for a in self.axes)}]"
        mesh = " x ".join(f"{n}={s}" for n, s in self.mesh_axes) or "one device"
        return f"{self.title + ': ' if self.title else ''}{shape}  {self.layout or '(scalar)'}  on mesh {mesh}"

    def _legend(self) -> str:
        n = len(self.cells)
        copies = {c.copies for c in self.cells}
        if n == 1:
            return "one device holds the whole array"
        if self.n_blocks == 1:
            return f"replicated: every one of the {n} devices holds the whole array"
        if copies == {1}:
            return f"{self.n_blocks} distinct blocks, one per device (nothing replicated)"
        return (
            f"{self.n_blocks} distinct blocks (letters); xk: the block is on k devices, replicated over the "
            "mesh axes that split none of its axes"
        )

    def __str__(self) -> str:
        rows = self._rows()
        texts = [
            [
                [
                    f"dev {c.device if c.device is not None else '?'}: {_letters(c.block_id)}"
                    + (f" x{c.copies}" if c.copies > 1 else "")
                ]
                + self._axis_text(c)
                for c in row
            ]
            for row in rows
        ]
        col_labels = self._col_labels()
        width = max([len(line) for row in texts for cell in row for line in cell] + [len(s) for s in col_labels])
        left = max(len(self._row_label(r)) for r in range(len(rows)))
        border = " " * left + " +" + "+".join("-" * (width + 2) for _ in col_labels) + "+"
        out = [self._head()]
        if any(col_labels):
            out.append(" " * left + "  " + " ".join(f" {s:<{width}} " for s in col_labels).rstrip())
        out.append(border)
        for r, row in enumerate(texts):
            for k in range(len(row[0])):
                label = self._row_label(r) if k == 0 else ""
                out.append(f"{label:<{left}} |" + "|".join(f" {cell[k]:<{width}} " for cell in row) + "|")
            out.append(border)
        out.append(self._legend())
        return "\n".join(out)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        esc = html.escape
        rows = self._rows()
        col_labels = self._col_labels()
        cell_style = "border:1px solid #444;padding:3px 6px;vertical-align:top;text-align:left;color:#000"
        head = ""
        if len(self.mesh_axes) > 1:
            rest = " x ".join(f"{n} ({s})" for n, s in self.mesh_axes[1:])
            head = (
                f'<thead><tr><th colspan="2"></th><th colspan="{len(col_labels)}">{esc(rest)}</th></tr>'
                '<tr><th colspan="2"></th>' + "".join(f"<th>{esc(s)}</th>" for s in col_labels) + "</tr></thead>"
            )
        body = []
        for r, row in enumerate(rows):
            side = ""
            if r == 0:
                name = f"{self.mesh_axes[0][0]} ({self.mesh_axes[0][1]})" if self.mesh_axes else ""
                side = f'<th rowspan="{len(rows)}" style="writing-mode:vertical-lr">{esc(name)}</th>'
            tds = []
            for c in row:
                hatch = (
                    ";background-image:repeating-linear-gradient(45deg,rgba(0,0,0,.12) 0 3px,transparent 3px 9px)"
                    if c.copies > 1
                    else ""
                )
                mark = f" <small>x{c.copies} replicated</small>" if c.copies > 1 else ""
                dev = c.device if c.device is not None else "?"
                lines = "".join(f"<div><code>{esc(t)}</code></div>" for t in self._axis_text(c))
                tds.append(
                    f'<td style="{cell_style};background-color:{_colour(c.block_id)}{hatch}">'
                    f"<div><b>dev {dev}</b> {esc(_letters(c.block_id))}{mark}</div>{lines}</td>"
                )
            body.append(f"<tr>{side}<th>{esc(str(r))}</th>{''.join(tds)}</tr>")
        table = f'<table style="border-collapse:collapse">{head}<tbody>{"".join(body)}</tbody></table>'
        return (
            f"<div><div><code>{esc(self._head())}</code></div>{table}"
            f"<div><small>{esc(self._legend())}</small></div></div>"
        )


@dataclasses.dataclass(repr=False)
class DeviceGrids:
    """The grids of every NamedArray of a tree, by path."""

    grids: list[DeviceGrid]

    def __getitem__(self, i: int) -> DeviceGrid:
        return self.grids[i]

    def __len__(self) -> int:
        return len(self.grids)

    def __str__(self) -> str:
        return "\n\n".join(str(g) for g in self.grids)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return "".join(g._repr_html_() for g in self.grids)


# ---- building a grid -------------------------------------------------------------------------


def _mesh_devices(mesh) -> np.ndarray | None:
    try:
        return np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    except ValueError:  # an AbstractMesh has positions but no devices
        return None


def _cells(
    shape: tuple[int, ...], entries: list[tuple[str, ...]], mesh
) -> tuple[tuple[tuple[str, int], ...], list[Cell]]:
    """Each device's block, from the mesh axes that split each array axis (major first)."""
    names = tuple(mesh.axis_names)
    sizes = tuple(mesh.shape[n] for n in names)
    ids = _mesh_devices(mesh)
    raw = []
    for pos in np.ndindex(*sizes):
        coord = dict(zip(names, pos))
        blocks = []
        for n, e in zip(shape, entries):
            parts = math.prod(mesh.shape[m] for m in e) if e else 1
            k = int(np.ravel_multi_index([coord[m] for m in e], [mesh.shape[m] for m in e])) if e else 0
            step = -(-n // parts)
            blocks.append((min(k * step, n), min((k + 1) * step, n)))
        raw.append((int(ids[pos]) if ids is not None else None, pos, tuple(blocks)))
    return tuple(zip(names, sizes)), _number(raw)


def _number(raw) -> list[Cell]:
    order: dict[tuple, int] = {}
    for _, _, b in raw:
        order.setdefault(b, len(order))
    counts = {b: sum(1 for _, _, c in raw if c == b) for b in order}
    return [Cell(d, pos, b, order[b], counts[b]) for d, pos, b in raw]


def _placement(x: NamedArray, mapping, mesh) -> tuple[Any, list[tuple[str, ...]] | None, Any]:
    """(mesh, per-axis mesh axes, other sharding): a NamedSharding's mesh and spec, or a sharding
    of another kind to read through ``devices_indices_map``."""
    arr = x.array
    sharding = None
    if mapping is None and not is_tracer(arr):
        sharding = getattr(arr, "sharding", None)
    if sharding is None:
        mapping = mapping if mapping is not None else (current_mapping() or {})
        sharding = sharding_for(x.axes, mapping, mesh)
    if isinstance(sharding, NamedSharding):
        entries = spec_entries(sharding.spec)
        return sharding.mesh, entries + [()] * (len(x.axes) - len(entries)), None
    return None, None, sharding


def device_grid(
    x: Any, mapping: ResourceMapping | None = None, mesh=None, *, title: str = ""
) -> DeviceGrid | DeviceGrids:
    """Draw where ``x`` lives: a grid of the mesh's devices, each cell naming the block of every
    array axis that device holds.

    ``x`` is a NamedArray, its axes (``Axis`` objects), or a tree of NamedArrays (one grid per
    leaf, a :class:`DeviceGrids`). With ``mapping`` the grid is what the mapping asks for on
    ``mesh`` (default: the current mesh). Without one, an array that has a sharding (placed, or
    abstract: a ``ShapeDtypeStruct`` with a sharding) is drawn where it really lives; one without
    (axes, a plain abstract array) by the current mapping on the current mesh.
    """
    if isinstance(x, Axis) or (isinstance(x, (tuple, list)) and x and all(isinstance(a, Axis) for a in x)):
        axes = (x,) if isinstance(x, Axis) else tuple(x)
        shaped = jax.ShapeDtypeStruct(tuple(a.size for a in axes), np.float32)
        return device_grid(unchecked(shaped, axes), mapping, mesh, title=title)
    if not isinstance(x, NamedArray):
        leaves = jax.tree_util.tree_flatten_with_path(x, is_leaf=is_named_array)[0]
        return DeviceGrids(
            [
                device_grid(v, mapping, mesh, title=jax.tree_util.keystr(p))
                for p, v in leaves
                if isinstance(v, NamedArray)
            ]
        )
    named_mesh, entries, other = _placement(x, mapping, mesh)
    shape = tuple(a.size for a in x.axes)
    dtype = str(np.dtype(x.array.dtype)) if hasattr(x.array, "dtype") else "?"
    if other is None:
        mesh_axes, cells = _cells(shape, entries, named_mesh)
        return DeviceGrid(x.axes, dtype, format_layout(x.axes, entries), mesh_axes, cells, title)
    # another kind of sharding (one device, or positional): its own devices in a row
    index_map = other.devices_indices_map(shape)
    devices = sorted(index_map, key=lambda d: d.id)
    raw = [
        (d.id, (i,), tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index_map[d], shape)))
        for i, d in enumerate(devices)
    ]
    whole = [all(c[2][i] == (0, n) for c in raw) for i, n in enumerate(shape)]
    lay = format_layout(x.axes, [() if w else ("?",) for w in whole])
    return DeviceGrid(x.axes, dtype, lay, (("device", len(devices)),), _number(raw), title)
