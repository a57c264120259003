"""Where arrays live: meshes, axis mappings, sharding constraints and named_jit.

A *mapping* sends an axis name to a mesh axis, a tuple of mesh axes, or None (replicated):
``{"batch": "data", "mlp": "model"}``. A run has two: the *compute* mapping (activations,
set with ``axis_mapping``) and the *parameter* mapping (how weights and optimizer state are
stored). FSDP is parameter ``{"embed": "data"}`` + compute ``{"batch": "data"}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._axis import ArgumentTypeError, Axis, AxisSelection, NamedError, as_selectors, format_axes
from ._compat import is_tracer
from ._context import (  # noqa: F401  (re-exported: this module is where users find them)
    FrozenMapping,
    MeshAxes,
    ResourceMapping,
    ShardingError,
    axis_mapping,
    check_mapping_values,
    current_mapping,
    current_mesh,
)
from ._core import NamedArray, is_named_array, unchecked
from ._fields import field, map_named  # noqa: F401  (field: public here)

# ---- meshes --------------------------------------------------------------------------


def make_mesh(shape: Mapping[str, int], *, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh from ``{"data": -1, "model": 2}``; ``-1`` takes the devices left over.

    Axes are ``AxisType.Auto`` (GSPMD): sharding constraints set layouts rather than check them.
    """
    devices = list(devices) if devices is not None else jax.devices()
    sizes = mesh_sizes(shape, len(devices))
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes), devices=devices)


def mesh_sizes(shape: Mapping[str, int], n: int) -> dict[str, int]:
    """The size of each axis of ``shape`` (one ``-1``: the devices left over) on ``n`` devices,
    or a ShardingError naming the shape: what ``make_mesh`` builds, decided without devices."""
    names = tuple(shape)
    sizes = [int(s) for s in shape.values()]
    if not names:
        raise ShardingError("make_mesh needs at least one axis, e.g. {'data': -1}")
    wild = [i for i, s in enumerate(sizes) if s == -1]
    if len(wild) > 1:
        raise ShardingError(f"mesh shape {dict(shape)}: only one axis may be -1")
    if any(s == 0 or s < -1 for s in sizes):
        raise ShardingError(f"mesh shape {dict(shape)}: sizes must be positive (or one -1)")
    known = math.prod(s for s in sizes if s != -1)
    if wild:
        if n % known:
            raise ShardingError(f"mesh shape {dict(shape)} does not fit {n} devices: {n} is not divisible by {known}")
        sizes[wild[0]] = n // known
    if math.prod(sizes) != n:
        raise ShardingError(f"mesh shape {dict(shape)} needs {math.prod(sizes)} devices but {n} are available")
    return dict(zip(names, sizes))


def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with its Explicit axes made Auto: the same devices, names and sizes. ``jax.make_mesh``
    makes Explicit axes by default, on which a sharding constraint only checks a layout and every
    op must agree on its operands' shardings; named lays arrays out by constraints (GSPMD), so
    ``named_jit`` and ``shard`` run on this twin of such a mesh."""
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return mesh
    types = tuple(AxisType.Auto if t == AxisType.Explicit else t for t in mesh.axis_types)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def _onto(mesh: Mesh, tree: Any) -> Any:
    """The arrays of ``tree`` that lie on the Explicit twin of ``mesh``, put on ``mesh`` (same devices
    and layout: only the mesh in their sharding changes)."""

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        if (
            isinstance(x, jax.Array)
            and isinstance(sharding, NamedSharding)
            and sharding.mesh is not mesh
            and sharding.mesh.axis_names == mesh.axis_names
            and auto_mesh(sharding.mesh) == mesh
        ):
            return jax.device_put(x, NamedSharding(mesh, sharding.spec))
        return x

    return jax.tree.map(leaf, tree)


def set_mesh(mesh: Mesh):
    """``with nm.set_mesh(mesh):`` (the same as ``jax.set_mesh``)."""
    if not isinstance(mesh, Mesh):
        raise ArgumentTypeError(
            f"nm.set_mesh takes a jax.sharding.Mesh (nm.make_mesh({{'data': -1}})), got {type(mesh).__name__}"
        )
    return jax.set_mesh(mesh)


# ---- mappings (the current one, axis_mapping and current_mesh live in _context) ---------------


def mesh_axes_of(v: MeshAxes) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    return tuple(v)


def check_mapping(mapping: ResourceMapping, mesh: Mesh | Mapping[str, int]) -> None:
    """Every mesh axis the mapping names must exist in ``mesh`` (a mesh, or its axis sizes as
    ``make_mesh`` takes them: a config can be checked before there are devices)."""
    check_mapping_values(mapping)
    sizes = getattr(mesh, "shape", mesh)  # a Mesh or AbstractMesh, or the sizes themselves
    for name, v in mapping.items():
        for m in mesh_axes_of(v):
            if m not in sizes:
                raise ShardingError(
                    f"axis {name!r} is mapped to mesh axis {m!r}, which the mesh does not have "
                    f"(mesh axes: {dict(sizes)})"
                )


# ---- inference: PartitionSpec and NamedSharding for axes ---------------------------------


def _axes(x: NamedArray | AxisSelection) -> tuple[Axis, ...]:
    if isinstance(x, NamedArray):
        return x.axes
    return tuple(a for a in as_selectors(x))  # type: ignore[misc]


def _is_axes(x) -> bool:
    """Axes (an Axis, a name, ``"a b"``, or a sequence of those), as opposed to a pytree of arrays."""
    if isinstance(x, (Axis, str)):
        return True
    return isinstance(x, (tuple, list)) and all(isinstance(a, (Axis, str)) for a in x)


def pspec_for(x, mapping: ResourceMapping | None = None, mesh: Mesh | None = None):
    """The PartitionSpec of an array (or of its axes) under ``mapping`` (default: current).

    With a mesh (given or current), mesh axis names and divisibility are checked. A pytree (a
    module, Haliax's ``pspec_for(model)``) gives the same tree with a PartitionSpec in place of
    each NamedArray and of each plain array in an ``nm.field(axis_names=...)`` field; other
    arrays get ``PartitionSpec()`` (replicated), other leaves None.
    """
    if not isinstance(x, NamedArray) and not _is_axes(x):
        return map_named(
            lambda a: pspec_for(a, mapping, mesh), x, plain=lambda v: PartitionSpec() if eqx.is_array(v) else None
        )
    mapping = current_mapping() if mapping is None else mapping
    mesh = mesh if mesh is not None else current_mesh()
    axes = _axes(x)
    if mapping is None:
        return PartitionSpec(*([None] * len(axes)))
    check_mapping_values(mapping)
    used: dict[str, str] = {}
    entries = []
    for a in axes:
        name = a.name if isinstance(a, Axis) else a
        target = mesh_axes_of(mapping.get(name))
        for m in target:
            if mesh is not None and m not in mesh.shape:
                raise ShardingError(
                    f"axis {name!r} is mapped to mesh axis {m!r}, which the mesh does not have (mesh axes: "
                    f"{dict(mesh.shape)})"
                )
            if m in used:
                raise ShardingError(
                    f"axes {used[m]!r} and {name!r} of one array are both mapped to mesh axis {m!r}; "
                    f"an array can use a mesh axis once (axes {format_axes([b for b in axes if isinstance(b, Axis)])})"
                )
            used[m] = name
        if target and mesh is not None and isinstance(a, Axis):
            parts = math.prod(mesh.shape[m] for m in target)
            if a.size % parts:
                raise ShardingError(
                    f"axis {name!r} of size {a.size} cannot be split over mesh axes {target} "
                    f"({parts} devices): {a.size} is not divisible by {parts}; change the mesh shape, "
                    f"or map {name!r} to other mesh axes (None keeps it whole)"
                )
        entries.append(None if not target else (target[0] if len(target) == 1 else target))
    return PartitionSpec(*entries)


def sharding_for(
    x: NamedArray | AxisSelection, mapping: ResourceMapping | None = None, mesh: Mesh | None = None
) -> NamedSharding:
    """The NamedSharding of an array (or of its axes) under ``mapping`` on ``mesh`` (defaults: current)."""
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise ShardingError("no mesh: pass mesh= or enter `with jax.set_mesh(mesh):`")
    return NamedSharding(mesh, pspec_for(x, mapping, mesh))


def infer_shardings(tree: Any, mapping: ResourceMapping | None = None, mesh: Mesh | None = None) -> Any:
    """A pytree like ``tree`` with a NamedSharding for every NamedArray's array (and for every
    plain array in an ``nm.field(axis_names=...)`` field), None elsewhere."""

    def leaf(x):
        return unchecked(sharding_for(x, mapping, mesh), x.axes)

    return map_named(leaf, tree, plain=lambda _: None)


# ---- shard: constrain or place ----------------------------------------------------------


def constrain(arr: jax.Array, mesh, spec: PartitionSpec) -> jax.Array:
    """``arr`` (traced) laid out as ``spec`` on ``mesh``, whatever the mesh's axis types.

    Auto axes (GSPMD, ``nm.make_mesh``'s) take a sharding constraint, which sets the layout.
    On Explicit axes (``jax.make_mesh``'s default) a constraint only asserts the layout the
    array's type already has, so the layout is changed with ``jax.sharding.reshard``, the
    explicit-sharding API; a mesh with both kinds gets each part from its own API."""
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    if not explicit:
        return jax.lax.with_sharding_constraint(arr, NamedSharding(mesh, spec))

    def part(keep) -> PartitionSpec:
        entries = []
        for e in spec:
            ms = tuple(m for m in mesh_axes_of(e) if keep(m))
            entries.append(None if not ms else ms[0] if len(ms) == 1 else ms)
        return PartitionSpec(*entries)

    arr = jax.sharding.reshard(arr, NamedSharding(mesh, part(lambda m: m in explicit)))
    auto = part(lambda m: m not in explicit)
    return jax.lax.with_sharding_constraint(arr, NamedSharding(mesh, auto)) if any(e is not None for e in auto) else arr


def shard(tree: Any, mapping: ResourceMapping | None = None, mesh: Mesh | None = None) -> Any:
    """Lay out every NamedArray leaf of ``tree`` by ``mapping`` (default: the current one).

    Inside jit this is a sharding constraint; outside, a ``device_put``. A plain array in an
    ``nm.field(axis_names=...)`` field is laid out by those names; other plain arrays and other
    leaves pass through. With no mapping or no mesh it does nothing.
    """
    mapping = current_mapping() if mapping is None else mapping
    mesh = mesh if mesh is not None else current_mesh()
    if mapping is None or mesh is None:
        return tree

    def leaf(x):
        if not isinstance(x, NamedArray) or not hasattr(x.array, "shape"):
            return x
        spec = pspec_for(x, mapping, mesh)
        if is_tracer(x.array) or not isinstance(mesh, Mesh):  # in a trace: abstract mesh
            arr = constrain(x.array, mesh, spec)
        else:  # placed on the Auto twin of an Explicit mesh, where named_jit runs
            arr = jax.device_put(x.array, NamedSharding(auto_mesh(mesh), spec))
        return unchecked(arr, x.axes)

    return map_named(leaf, tree)


# ---- named_jit -----------------------------------------------------------------------------
# jax.jit over the call split by hand, not eqx.filter_jit, which (equinox 0.13) donates only all
# arguments or all but the first (we donate by pytree prefix), holds a jax.ShapeDtypeStruct
# static (plans lower from shapes alone), returns its own Lowered, and blocks on every call
# (a train loop would lose async dispatch). The mesh and the mapping are jit-key contexts, so
# jax's cache sees them; named_jit only enters the ones it was given.


@jax.tree_util.register_static
class _StaticOut:
    """The non-array part of a result, carried in the output treedef, which ties it to the trace
    that made it (``x.shape[0]`` changes with the input shapes). Compared by identity: it may
    hold NamedArray nodes, whose ``==`` is elementwise."""

    def __init__(self, value):
        self.value = value


def _is_dynamic(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _donated(prefix, tree, what: str) -> list[bool]:
    """One bool per leaf of ``tree``, from a bool or a pytree prefix of bools (None: False)."""
    prefix = jax.tree.map(bool, prefix, is_leaf=lambda p: p is None or isinstance(p, bool))
    try:
        return jax.tree.leaves(jax.tree.broadcast(prefix, tree))
    except ValueError as e:  # jax's message says where the structures part
        raise NamedError(
            f"{what} must be a bool, or a pytree prefix of the arguments with a bool (or None) "
            f"for each subtree; it does not match the arguments:\n{e}"
        ) from None


class NamedJitWrapped:
    """A function compiled by ``named_jit``; call it, or ``.lower(*args)`` to inspect the program."""

    def __init__(
        self, fn: Callable, mapping, in_mapping, out_mapping, donate: tuple, mesh: Mesh | None, jit_kwargs: dict
    ):
        def traced(donated, kept, static):
            treedef, fixed = static
            args, kwargs = jax.tree.unflatten(
                treedef, [d if d is not None else k if k is not None else s for d, k, s in zip(donated, kept, fixed)]
            )
            mesh = current_mesh()
            for m in (current_mapping(), in_mapping, out_mapping) if mesh is not None else ():
                if m is not None:
                    check_mapping(m, mesh)
            if in_mapping is not None:
                args, kwargs = shard((args, kwargs), in_mapping)
            dyn, stat = eqx.partition(shard(fn(*args, **kwargs), out_mapping), _is_dynamic)
            return dyn, _StaticOut(stat)

        # the compiled module is then called jit_<fn name>, which is what HLO dumps and profiles show
        traced.__name__ = traced.__qualname__ = getattr(fn, "__name__", type(fn).__name__)
        self._jitted = jax.jit(traced, donate_argnums=0, static_argnums=2, **jit_kwargs)
        self._donate = donate
        self._mesh = mesh
        self._mapping_context = (
            functools.partial(axis_mapping, mapping) if mapping is not None else contextlib.nullcontext
        )
        functools.update_wrapper(self, fn)

    def _placed(self, args: tuple, kwargs: dict):
        """``(mesh to enter or None, args, kwargs)``. The mesh is the one given or the one around
        the call; an Explicit one is replaced by its Auto twin (``auto_mesh``), and the arguments
        that lie on it are moved onto the twin, so that the layers' constraints set layouts."""
        mesh = self._mesh
        if mesh is None:
            try:
                mesh = jax.sharding.get_mesh()
            except ValueError:  # called inside another trace: its mesh is what it is
                mesh = None
            mesh = None if mesh is None or mesh.empty else mesh
        twin = None if mesh is None else auto_mesh(mesh)
        if twin is not None and twin is not mesh:
            args, kwargs = _onto(twin, (args, kwargs))
        return (twin if self._mesh is not None or twin is not mesh else None), args, kwargs

    def _split(self, args: tuple, kwargs: dict):
        """(donated arrays, kept arrays, (treedef, static leaves)); each list has None elsewhere."""
        donate_args, donate_kwargs = self._donate
        if isinstance(donate_args, (tuple, list)):
            if len(donate_args) > len(args):
                raise NamedError(
                    f"donate_args has {len(donate_args)} entries but the function got {len(args)} positional arguments"
                )
            donate_args = tuple(donate_args) + (False,) * (len(args) - len(donate_args))
        donate = _donated(donate_args, args, "donate_args") + _donated(donate_kwargs, kwargs, "donate_kwargs")
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dyn = [_is_dynamic(x) for x in leaves]
        return (
            [x if y and d else None for x, y, d in zip(leaves, dyn, donate)],
            [x if y and not d else None for x, y, d in zip(leaves, dyn, donate)],
            (treedef, tuple(None if y else x for x, y in zip(leaves, dyn))),
        )

    def __call__(self, *args, **kwargs):
        mesh, args, kwargs = self._placed(args, kwargs)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext(), self._mapping_context():
            try:
                dyn, stat = self._jitted(*self._split(args, kwargs))
            except AttributeError as e:
                if not _jmp_crossing(e):
                    raise
                raise ArgumentTypeError(
                    "a jmp loss scale (jmp.DynamicLossScale) cannot be returned from or passed through a jit: "
                    "jmp checks its leaves when a jit rebuilds it from placeholders. Use nn.DynamicLossScale, the "
                    "same arithmetic as an Equinox module, which crosses nm.named_jit and eqx.filter_jit"
                ) from e
        return eqx.combine(dyn, stat.value)

    def lower(self, *args, **kwargs):
        """``jax.stages.Lowered`` for these arguments (``.compile().as_text()`` for the HLO)."""
        return self._stage("lower", args, kwargs)

    def trace(self, *args, **kwargs):
        """``jax.stages.Traced`` for these arguments (``.jaxpr``: the program before XLA sees it)."""
        return self._stage("trace", args, kwargs)

    def _stage(self, stage: str, args, kwargs):
        mesh, args, kwargs = self._placed(args, kwargs)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext(), self._mapping_context():
            return getattr(self._jitted, stage)(*self._split(args, kwargs))

    def __get__(self, instance, owner):
        if instance is None:
            return self
        bound = functools.partial(self, instance)
        bound.lower = functools.partial(self.lower, instance)  # type: ignore[attr-defined]
        bound.trace = functools.partial(self.trace, instance)  # type: ignore[attr-defined]
        return bound


def _jmp_crossing(e: AttributeError) -> bool:
    """Whether ``e`` is jmp's loss scale checking its leaves when rebuilt (``__post_init__``), which
    fails when a jit rebuilds one from placeholders."""
    return any(f"{os.sep}jmp{os.sep}" in f.filename for f in traceback.extract_tb(e.__traceback__))


# Haliax's spellings of the three mapping arguments, accepted from code moving over (see
# docs/from_haliax.md) and translated here, the one place that knows them.
HALIAX_SPELLINGS = {"axis_resources": "mapping", "in_axis_resources": "in_mapping", "out_axis_resources": "out_mapping"}


def haliax_spellings(fn_name: str, extra: dict, **given) -> tuple:
    """``given`` (mapping=..., in_mapping=..., out_mapping=...) with any Haliax spelling in ``extra``
    moved over (and removed from ``extra``); both spellings of one argument is an error."""
    for old, new in HALIAX_SPELLINGS.items():
        if old in extra:
            if given[new] is not None:
                raise ArgumentTypeError(f"{fn_name}: give {new}= or its Haliax spelling {old}=, not both")
            given[new] = extra.pop(old)
    return tuple(given.values())


def named_jit(
    fn: Callable | None = None,
    *,
    mapping: ResourceMapping | None = None,
    in_mapping: ResourceMapping | None = None,
    out_mapping: ResourceMapping | None = None,
    donate_args: Any = None,
    donate_kwargs: Any = None,
    mesh: Mesh | None = None,
    **jit_kwargs,
):
    """jit whose layouts come from axis names; ``@named_jit`` or ``@named_jit(mapping=...)``.

    - ``mapping``: the compute mapping while ``fn`` is traced (default: the current one).
    - ``in_mapping``: lays out NamedArray inputs (default: they keep their layout).
    - ``out_mapping``: lays out NamedArray results (default: ``mapping``).
    - ``donate_args`` / ``donate_kwargs``: a bool, or a pytree prefix of bools, per argument.
    - Non-array leaves of the arguments are static: a new value compiles a new program.
      Programs are cached, keyed also on the mesh and the compute mapping around the call.
    - Haliax's ``axis_resources=``/``in_axis_resources=``/``out_axis_resources=`` are accepted.
    """
    mapping, in_mapping, out_mapping = haliax_spellings(
        "named_jit", jit_kwargs, mapping=mapping, in_mapping=in_mapping, out_mapping=out_mapping
    )
    for m in (mapping, in_mapping, out_mapping):
        if m is not None:
            check_mapping_values(m)
            if mesh is not None:
                check_mapping(m, mesh)

    def wrap(f):
        return NamedJitWrapped(f, mapping, in_mapping, out_mapping, (donate_args, donate_kwargs), mesh, jit_kwargs)

    return wrap if fn is None else wrap(fn)


# ---- guard rails -----------------------------------------------------------------------


@dataclasses.dataclass
class ShardingCheck:
    """Which parameters stay replicated under a mapping, and what fraction of bytes that is."""

    replicated: list[tuple[str, tuple[Axis, ...], int]]
    total_bytes: int
    replicated_bytes: int

    @property
    def replicated_fraction(self) -> float:
        return self.replicated_bytes / self.total_bytes if self.total_bytes else 0.0

    def __str__(self) -> str:
        lines = [f"{self.replicated_fraction:.1%} of {self.total_bytes:,} parameter bytes stay replicated"]
        lines += [f"  {path}: {format_axes(axes)} ({n:,} bytes)" for path, axes, n in self.replicated]
        return "\n".join(lines)


def _nbytes(x: NamedArray) -> int:
    return int(np.prod([a.size for a in x.axes], dtype=np.int64)) * np.dtype(x.dtype).itemsize


def check_sharding(
    tree: Any, mapping: ResourceMapping, mesh: Mesh, max_replicated_fraction: float | None = None
) -> ShardingCheck:
    """Report the NamedArray leaves that ``mapping`` leaves fully replicated on ``mesh``.

    Raises ShardingError, listing them, when their share of the bytes exceeds
    ``max_replicated_fraction`` (MaxText's "sharding tolerance"). Also checks every leaf's
    layout (divisibility, mesh axis names).
    """
    check_mapping(mapping, mesh)
    replicated, total, rep_bytes = [], 0, 0
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named_array)[0]:
        if not isinstance(x, NamedArray):
            continue
        spec = pspec_for(x, mapping, mesh)
        n = _nbytes(x)
        total += n
        if all(s is None for s in spec):
            replicated.append((jax.tree_util.keystr(path), x.axes, n))
            rep_bytes += n
    report = ShardingCheck(replicated, total, rep_bytes)
    if max_replicated_fraction is not None and report.replicated_fraction > max_replicated_fraction:
        raise ShardingError(f"{report}\nthis exceeds max_replicated_fraction={max_replicated_fraction}")
    return report
