"""Where arrays live, for people: layout notation, parameter reports, compiled-program reports.

Layout notation (after the seqax post): each axis of an array written as ``name`` when it is
replicated, or ``name/mesh_axis`` (``name/a+b`` over several mesh axes, major first) when it is
split: ``"batch/data position embed/model"``. seqax's ``d_model/t/d`` reads the same as
``d_model/t+d``. A block inside ``nm.shard_map`` that still owes a sum ends in ``{U: model}``.

- :func:`layout` / :func:`parse_layout`: to the notation and back.
- :func:`param_report`: every NamedArray of a pytree (a model, an optimizer state) under a
  mapping on a mesh: path, axes, layout, dtype, global bytes and bytes per device, totals.
- :func:`compiled_report`: for a compiled program, the collectives XLA put in it (kind, count,
  bytes, mesh axes), memory per device and FLOPs, per execution: every iteration of its loops
  counted (``named._hlo`` reads the trip counts from the optimized HLO).
- :func:`device_bytes`: what each device really holds of a pytree of placed arrays.
- :func:`device_grid`: the mesh drawn as a grid, each device's cell naming the block of every
  array axis it holds (any rank; placed, abstract, or under a mapping); ``ParamReport.grid``.

Every report prints as text and renders as an HTML table in Jupyter (``_repr_html_``).
"""

from __future__ import annotations

import collections
import dataclasses
import html
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from . import _hlo
from ._axis import ArgumentTypeError, Axis, AxisError, as_selectors
from ._compat import is_tracer
from ._core import NamedArray, expect_named, is_named_array, unchecked
from ._grid import DeviceGrid, DeviceGrids, device_grid
from ._hlo import Collective
from ._layout import format_layout, parse_layout, sharding_layout, spec_entries  # noqa: F401  (parse_layout: public here)
from ._local import ShardedAxis, Unreduced, block_layout
from .partitioning import ResourceMapping, current_mapping, current_mesh, pspec_for

# ---- layout notation ----------------------------------------------------------------------


def _is_block(x) -> bool:
    return isinstance(x, Unreduced) or (isinstance(x, NamedArray) and any(isinstance(a, ShardedAxis) for a in x.axes))


def layout(x: NamedArray | Any, mapping: ResourceMapping | None = None) -> str:
    """``"batch/data position embed/model"``: the array's axes and the mesh axes that split them.

    ``x`` is a NamedArray or axes (names). With a mapping (or a current one) the layout is
    what the mapping asks for; without one, a concrete sharded array reports where it actually
    lives. A local block inside ``nm.shard_map`` reports its own layout.
    """
    if _is_block(x):
        return block_layout(x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # an array: a NamedArray (a plain one has no names to lay out)
        expect_named(x, "nm.layout")
    axes = x.axes if isinstance(x, NamedArray) else as_selectors(x)
    mapping = mapping if mapping is not None else current_mapping()
    if mapping is None and isinstance(x, NamedArray) and hasattr(x.array, "sharding") and not is_tracer(x.array):
        return sharding_layout(axes, x.array.sharding)
    return format_layout(axes, spec_entries(pspec_for(axes, mapping or {}, mesh=None)))


# ---- sizes -------------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# Every cell gets its own background: Jupyter stripes alternate table rows in light grey, and a
# marked row shaded in a light colour of its own would read as one of those stripes.
_PLAIN_CELL = "background-color:#ffffff;color:#000000"
_MARKED_CELL = (
    "background-color:#ffffff;color:#000000;"
    "background-image:repeating-linear-gradient(135deg,#ffd8a8 0 3px,#ffffff 3px 9px)"
)


def _table_html(
    head: tuple[str, ...], rows: list[tuple], numeric: set[int] = frozenset(), marked: list[bool] | None = None
) -> str:
    th = "".join(
        f"<th style='text-align:{'right' if i in numeric else 'left'}'>{html.escape(h)}</th>"
        for i, h in enumerate(head)
    )
    body = []
    for k, r in enumerate(rows):
        is_marked = bool(marked and marked[k])
        tds = "".join(
            f"<td style='text-align:{'right' if i in numeric else 'left'};{_MARKED_CELL if is_marked else _PLAIN_CELL}"
            + (";border-left:4px solid #e8590c" if is_marked and i == 0 else "")
            + "'>"
            + (html.escape(str(c)) if i in numeric else f"<code>{html.escape(str(c))}</code>")
            + "</td>"
            for i, c in enumerate(r)
        )
        body.append(f"<tr>{tds}</tr>")
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _table_text(head: tuple[str, ...], rows: list[tuple], numeric: set[int] = frozenset()) -> list[str]:
    cells = [tuple(str(c) for c in r) for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(head)]

    def line(r):
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return [line(head)] + [line(r) for r in cells]


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
        """Whole on every device (no axis is split)."""
        return "/" not in self.layout

    @property
    def size(self) -> int:
        return math.prod(a.size for a in self.axes)


@dataclasses.dataclass(repr=False)
class ParamReport:
    """Every NamedArray of a pytree: path, axes, layout, dtype, global bytes, bytes per device."""

    rows: list[ParamRow]
    mesh_shape: dict[str, int]
    mapping: ResourceMapping | None = None
    mesh: Any = dataclasses.field(default=None, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(r.global_bytes for r in self.rows)

    @property
    def bytes_per_device(self) -> int:
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def n_params(self) -> int:
        return sum(r.size for r in self.rows)

    @property
    def replicated_bytes(self) -> int:
        return sum(r.global_bytes for r in self.rows if r.replicated)

    @property
    def replicated_fraction(self) -> float:
        """Share of the bytes that no mapping splits (each device holds all of them)."""
        return self.replicated_bytes / self.total_bytes if self.total_bytes else 0.0

    _HEAD = ("path", "axes", "layout", "dtype", "bytes", "bytes/device")

    def _cells(self):
        return [
            (
                r.path or "(root)",
                " ".join(f"{a.name}={a.size}" for a in r.axes),
                r.layout,
                r.dtype,
                _human(r.global_bytes),
                _human(r.bytes_per_device),
            )
            for r in self.rows
        ]

    def _summary(self) -> str:
        return (
            f"{len(self.rows)} arrays, {self.n_params:,} elements, {_human(self.total_bytes)} in all over mesh "
            f"{self.mesh_shape}: {_human(self.bytes_per_device)} per "
            f"device, {self.replicated_fraction:.1%} of the bytes replicated"
        )

    def __str__(self) -> str:
        return "\n".join(_table_text(self._HEAD, self._cells(), {4, 5}) + [self._summary()])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        table = _table_html(self._HEAD, self._cells(), {4, 5}, [r.replicated for r in self.rows])
        return f"{table}<p>{html.escape(self._summary())} (replicated rows hatched, with an orange edge)</p>"

    def grid(self, path: str | None = None) -> DeviceGrid | DeviceGrids:
        """The device grid of one array (its path as in the report, or a unique part of it,
        e.g. ``"c_attn.weight"``), or of every array when ``path`` is None."""
        if path is None:
            return DeviceGrids([self._grid(r) for r in self.rows])
        rows = [r for r in self.rows if r.path == path] or [r for r in self.rows if path in r.path]
        if len(rows) != 1:
            known = ", ".join(r.path for r in self.rows[:8]) + (", ..." if len(self.rows) > 8 else "")
            what = (
                "matches no array"
                if not rows
                else f"matches {len(rows)} arrays ({', '.join(r.path for r in rows[:4])})"
            )
            raise AxisError(f"param_report.grid({path!r}) {what}; paths: {known}")
        return self._grid(rows[0])

    def _grid(self, row: ParamRow) -> DeviceGrid:
        shaped = jax.ShapeDtypeStruct(tuple(a.size for a in row.axes), np.dtype(row.dtype))
        return device_grid(unchecked(shaped, row.axes), self.mapping or {}, self.mesh, title=row.path)


def param_report(tree: Any, mapping: ResourceMapping | None, mesh=None) -> ParamReport:
    """The layout and memory of every NamedArray in ``tree`` under ``mapping`` on ``mesh``.

    Works on abstract trees (``jax.eval_shape`` of an init): nothing is allocated. Layouts are
    checked against the mesh (divisibility, mesh axis names) as ``named_jit`` would.
    """
    mesh = mesh if mesh is not None else current_mesh()
    mesh_shape = dict(mesh.shape) if mesh is not None else {}
    rows = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named_array)[0]:
        if not isinstance(x, NamedArray):
            continue
        spec = pspec_for(x, mapping or {}, mesh)
        parts = 1
        for e in spec_entries(spec):
            parts *= math.prod(mesh_shape[m] for m in e) if e else 1
        nbytes = int(np.prod([a.size for a in x.axes], dtype=np.int64)) * np.dtype(x.array.dtype).itemsize
        rows.append(
            ParamRow(
                jax.tree_util.keystr(path),
                x.axes,
                layout(x, mapping or {}),
                str(np.dtype(x.array.dtype)),
                nbytes,
                nbytes // parts,
            )
        )
    return ParamReport(rows, mesh_shape, mapping, mesh)


def device_bytes(tree: Any) -> dict[int, int]:
    """Bytes of ``tree``'s placed arrays on each device (device id -> bytes), read from the shards
    the arrays really have; replicated arrays count on every device that holds a copy."""
    out: dict[int, int] = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        arr = leaf.array if isinstance(leaf, NamedArray) else leaf
        for shard in getattr(arr, "addressable_shards", ()):
            out[shard.device.id] += shard.data.nbytes
    return dict(sorted(out.items()))


def named_array_html(x: NamedArray, mapping: Mapping | None = None) -> str:
    """Notebook view of a NamedArray: dtype, one row per axis with its size and layout, and the
    device grid when the array is laid out on a mesh (placed, or abstract with a sharding)."""
    lay = layout(x, mapping).split()
    rows = "".join(
        f"<tr><td><code>{html.escape(a.name)}</code></td><td style='text-align:right'>{a.size}</td>"
        f"<td><code>{html.escape(lay[i])}</code></td></tr>"
        for i, a in enumerate(x.axes)
    )
    dtype = html.escape(str(getattr(x.array, "dtype", "?")))
    nbytes = _human(x.size * np.dtype(x.array.dtype).itemsize) if hasattr(x.array, "dtype") else "?"
    return (
        f"<div><b>NamedArray</b> <code>{dtype}</code> <code>{html.escape(' '.join(lay))}</code> ({nbytes})"
        f"<table><thead><tr><th>axis</th><th>size</th><th>layout</th></tr></thead><tbody>{rows}</tbody></table>"
        f"{_grid_html(x, mapping)}</div>"
    )


# The notebook view is attached here, not defined on NamedArray, so the core imports nothing of
# the reports (``import named`` imports this module, so every NamedArray has it).
NamedArray._repr_html_ = named_array_html


def _grid_html(x: NamedArray, mapping) -> str:
    if is_tracer(x.array):
        return ""
    if mapping is None and not isinstance(getattr(x.array, "sharding", None), jax.sharding.NamedSharding):
        return ""  # not laid out on a mesh (one device, or a tracer): nothing to draw
    if mapping is not None and current_mesh() is None:
        return ""
    return device_grid(x, mapping)._repr_html_()


# ---- compiled-program report ------------------------------------------------------------------


def parse_collectives(hlo: str, mesh=None) -> list[Collective]:
    """The collective instructions of optimized HLO text, in execution order, with the mesh axes
    they run over (read from their replica groups: the mesh axes along which a group's devices
    differ) and how many times each runs per execution (loop trip counts multiplied)."""
    return _hlo.analyze(hlo, mesh).collectives


@dataclasses.dataclass(repr=False)
class CompiledReport:
    """Collectives, memory per device and FLOPs of one execution of a compiled program.

    Everything is per device and per execution, with loop bodies weighted by their trip counts
    (see ``named._hlo`` for what is counted). ``xla_flops`` is ``compiled.cost_analysis()``'s
    figure, which counts each while body once: a cross-check for loop-free programs only.
    """

    collectives: list[Collective]
    memory: dict[str, int]
    cost: _hlo.HloCost
    xla_flops: float | None
    mesh_shape: dict[str, int]
    hlo: str = dataclasses.field(repr=False, default="")

    @property
    def flops(self) -> float:
        """Matmul FLOPs plus one per element of elementwise arithmetic and reductions."""
        return self.cost.flops

    @property
    def matmul_flops(self) -> float:
        return self.cost.matmul_flops

    @property
    def transcendentals(self) -> float:
        return self.cost.transcendentals

    @property
    def bytes_accessed(self) -> float:
        return self.cost.bytes_accessed

    @property
    def loops(self) -> list[tuple[str, int | None]]:
        """(while instruction, trip count or None) for every loop, nested ones included."""
        return self.cost.loops

    @property
    def unknown_loops(self) -> list[str]:
        """Loops whose trip count XLA did not record: counted once, so the figures are lower bounds."""
        return self.cost.unknown_loops

    def count(self, kind: str | None = None, mesh_axes: tuple[str, ...] | str | None = None) -> int:
        """How many times collectives of ``kind`` (e.g. ``"reduce-scatter"``) over ``mesh_axes``
        run per execution (an instruction in a loop body counts once per iteration)."""
        return sum(c.runs for c in self._select(kind, mesh_axes))

    def instructions(self, kind: str | None = None, mesh_axes: tuple[str, ...] | str | None = None) -> int:
        """How many collective instructions of ``kind`` over ``mesh_axes`` the program text holds."""
        return len(self._select(kind, mesh_axes))

    def total_bytes(self, kind: str | None = None, mesh_axes: tuple[str, ...] | str | None = None) -> int:
        """Bytes of the collectives of ``kind`` over ``mesh_axes``, summed over every run."""
        return sum(c.bytes * c.runs for c in self._select(kind, mesh_axes))

    def _select(self, kind, mesh_axes):
        if isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        return [
            c
            for c in self.collectives
            if (kind is None or c.kind == kind) and (mesh_axes is None or tuple(c.mesh_axes) == tuple(mesh_axes))
        ]

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries - aliased (donated) bytes, per device: what the
        program needs live at its worst, by XLA's buffer assignment."""
        m = self.memory
        return m.get("argument", 0) + m.get("output", 0) + m.get("temp", 0) - m.get("alias", 0)

    def summary(self) -> list[tuple[str, str, int, int, int, str]]:
        """(kind, mesh axes, runs, bytes, sent bytes, in loop) per kind and mesh axes; runs and
        bytes per execution. ``in loop`` is "" (none in a loop), "yes", or "yes, trip unknown"."""
        groups: dict[tuple[str, tuple[str, ...]], list[Collective]] = {}
        for c in self.collectives:
            groups.setdefault((c.kind, c.mesh_axes), []).append(c)
        rows = []
        for (k, m), cs in sorted(groups.items()):
            loop = (
                ""
                if not any(c.in_loop for c in cs)
                else "yes"
                if all(c.runs_known for c in cs)
                else "yes, trip unknown"
            )
            rows.append(
                (
                    k,
                    "+".join(m) or "-",
                    sum(c.runs for c in cs),
                    sum(c.bytes * c.runs for c in cs),
                    sum(c.sent_bytes * c.runs for c in cs),
                    loop,
                )
            )
        return rows

    _HEAD = ("collective", "mesh axes", "count", "bytes", "sent/device", "in loop")

    def _cells(self):
        return [(k, m, n, _human(b), _human(s), loop) for k, m, n, b, s, loop in self.summary()]

    def _footer(self) -> list[str]:
        m = self.memory
        lines = []
        if self.loops:
            trips = ", ".join(f"{name} x{n if n is not None else '?'}" for name, n in self.loops)
            lines.append(f"while loops (trip count): {trips}; counts, bytes and FLOPs include every iteration")
        if self.unknown_loops:
            lines.append(
                f"trip count unknown for {', '.join(self.unknown_loops)}: counted once, so the figures are lower bounds"
            )
        if m:
            lines.append(
                f"memory per device: arguments {_human(m.get('argument', 0))}, outputs {_human(m.get('output', 0))}, "
                f"temporaries {_human(m.get('temp', 0))}, aliased {_human(m.get('alias', 0))}; "
                f"peak {_human(self.peak_bytes)}"
            )
        lines.append(
            f"FLOPs per device: {self.flops:,.0f} ({self.matmul_flops:,.0f} in matmuls; elementwise and "
            f"reductions 1 per element) and {self.transcendentals:,.0f} transcendentals; bytes accessed "
            f"~{_human(self.bytes_accessed)}"
        )
        if self.xla_flops is not None and self.loops:
            lines.append(f"XLA cost_analysis: {self.xla_flops:,.0f} FLOPs (each loop body counted once)")
        if self.cost.conditionals:
            lines.append(f"{self.cost.conditionals} conditional(s): the costliest branch counted")
        return lines

    def __str__(self) -> str:
        head = [f"mesh {self.mesh_shape}; per device, per execution"]
        body = _table_text(self._HEAD, self._cells(), {2, 3, 4}) if self.collectives else ["no collectives"]
        return "\n".join(head + body + self._footer())

    __repr__ = __str__

    def _repr_html_(self) -> str:
        table = _table_html(self._HEAD, self._cells(), {2, 3, 4}) if self.collectives else "<p>no collectives</p>"
        foot = "".join(f"<p>{html.escape(line)}</p>" for line in self._footer())
        return (
            f"<div><b>compiled program</b> on mesh <code>{html.escape(str(self.mesh_shape))}</code>, per device and "
            f"execution{table}{foot}</div>"
        )


def _compile(fn_or_stage, args, kwargs):
    stage = fn_or_stage
    if hasattr(stage, "lower") and not isinstance(stage, jax.stages.Lowered):
        stage = stage.lower(*args, **kwargs)
    elif args or kwargs:
        raise ArgumentTypeError("compiled_report: arguments are only for a function to lower (named_jit or jax.jit)")
    if isinstance(stage, jax.stages.Lowered):
        stage = stage.compile()
    if not isinstance(stage, jax.stages.Compiled):
        raise ArgumentTypeError(
            f"compiled_report takes a named_jit / jax.jit function (with its arguments), a Lowered or a "
            f"Compiled, got {type(fn_or_stage).__name__}"
        )
    return stage


def _mesh_of(compiled):
    try:
        shardings = jax.tree.leaves(compiled.input_shardings) + jax.tree.leaves(compiled.output_shardings)
    except Exception:  # noqa: BLE001 - an executable without sharding info: no mesh axes to name
        shardings = []
    for s in shardings:
        if isinstance(s, jax.sharding.NamedSharding):
            return s.mesh
    return None


def compiled_report(fn_or_stage, *args, mesh=None, **kwargs) -> CompiledReport:
    """The collectives, memory per device and FLOPs of one execution of a compiled program,
    with every iteration of its loops counted (a ``scan`` over 8 layers counts 8 layers).

    ``fn_or_stage`` is a ``named_jit`` (or ``jax.jit``) function, called as it would be with
    ``*args, **kwargs`` (it is lowered and compiled, not run); or a ``Lowered`` / ``Compiled``.
    The mesh (for naming the mesh axes of each collective) is ``mesh=``, else the program's
    shardings', else the current mesh.
    """
    compiled = _compile(fn_or_stage, args, kwargs)
    mesh = mesh if mesh is not None else (_mesh_of(compiled) or current_mesh())
    hlo = compiled.as_text()
    memory: dict[str, int] = {}
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends have no memory analysis
        ma = None
    if ma is not None:
        for key in ("argument", "output", "temp", "alias", "generated_code"):
            v = getattr(ma, f"{key}_size_in_bytes", None)
            if v is not None:
                memory[key] = int(v)
    try:
        xla = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without cost analysis: the HLO count stands alone
        xla = None
    if isinstance(xla, (list, tuple)):
        xla = xla[0] if xla else None
    xla_flops = float(xla["flops"]) if xla and "flops" in xla else None
    cost = _hlo.analyze(hlo, mesh)
    return CompiledReport(cost.collectives, memory, cost, xla_flops, dict(mesh.shape) if mesh is not None else {}, hlo)
