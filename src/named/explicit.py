"""Explicit mode: per-device code over named blocks, with collectives by axis name (seqax-style).

``nm.shard_map(fn, ...)`` runs ``fn`` once per device on *local blocks*. A block keeps its
axis names; an axis that is split over mesh axes has its local size and remembers the mesh
axes (a :class:`ShardedAxis`), so ``nm.layout(w)`` inside the body reads ``embed/data mlp/model``
exactly as outside. Collectives take axis names and find the mesh axes from the block:

    w = nm.all_gather(w, "embed")                       # embed/data -> embed (whole)
    y = nm.einsum_unreduced("... mlp, mlp embed -> ... embed", h, w_down)  # Unreduced over model
    y = nm.psum(y)  or  nm.psum_scatter(y, "embed")     # the reduction that is owed

A contraction over a split axis gives partial sums; ``einsum_unreduced`` returns them as an
:class:`Unreduced` value that no op accepts until ``psum`` / ``psum_scatter`` settles it.
See docs/explicit.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from . import _compat
from ._axis import ArgumentTypeError, Axis, AxisSelection, NamedError, as_selectors, name_of
from ._context import FrozenMapping, body_context, current_body
from ._core import NamedArray, expect_named, unchecked
from ._einsum import local_einsum
from ._local import (
    LocalBody,
    ShardedAxis,
    Unreduced,
    UnreducedError,
    block_layout,
    is_local_leaf,
    issue,
    split_over,
    unreduced_error,
    with_layout,
    with_split,
)
from .partitioning import (
    ResourceMapping,
    ShardingError,
    check_mapping,
    check_mapping_values,
    current_mapping,
    current_mesh,
    haliax_spellings,
    mesh_axes_of,
    pspec_for,
)

__all__ = [
    "ShardedAxis",
    "Unreduced",
    "UnreducedError",
    "all_gather",
    "all_to_all",
    "axis_index",
    "block_layout",
    "einsum_unreduced",
    "pmax",
    "pmean",
    "psum",
    "psum_scatter",
    "shard_map",
    "with_layout",
]


# ---- the body context -------------------------------------------------------------------------


def _body(what: str) -> LocalBody:
    body = current_body()
    if body is None:
        raise NamedError(f"nm.{what} is a collective: call it inside a function run by nm.shard_map")
    return body


def _size(body: LocalBody, mesh_axes: Sequence[str]) -> int:
    return math.prod(body.mesh.shape[m] for m in mesh_axes)


def _group(mesh_axes: Sequence[str]):
    return mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes)


def _mapped(body: LocalBody, name: str, what: str) -> tuple[str, ...]:
    if name in body.ambiguous:
        raise ShardingError(
            f"nm.{what}: axis {name!r} is mapped to different mesh axes by different inputs "
            f"({body.ambiguous[name]}); pass mesh_axes= to say which"
        )
    return body.mapping.get(name, ())


# ---- shard_map ---------------------------------------------------------------------------------


def _prefix_mappings(resources, args: tuple, what: str) -> list:
    """One mapping per leaf of ``args`` from a mapping, or a tuple of them (one per argument)."""
    leaves = jax.tree.leaves(args, is_leaf=is_local_leaf)
    if resources is None or isinstance(resources, Mapping):
        return [resources] * len(leaves)
    if not isinstance(resources, (tuple, list)):
        raise ShardingError(
            f"{what} is a mapping (axis name -> mesh axes) or a tuple of them, one per argument; got {resources!r}"
        )
    if len(resources) != len(args):
        raise ShardingError(f"{what} has {len(resources)} entries but the function got {len(args)} arguments")
    out = []
    for m, a in zip(resources, args):
        if m is not None and not isinstance(m, Mapping):
            raise ShardingError(f"{what}: each entry is a mapping or None, got {m!r}")
        out += [m] * len(jax.tree.leaves(a, is_leaf=is_local_leaf))
    return out


def _local_axes(axes: tuple[Axis, ...], spec: PartitionSpec, mesh) -> tuple[Axis, ...]:
    out = []
    for a, entry in zip(axes, tuple(spec) + (None,) * (len(axes) - len(spec))):
        over = mesh_axes_of(entry)
        n = math.prod(mesh.shape[m] for m in over)
        out.append(with_split(a, a.size // n, over))
    return tuple(out)


def _varying(arr) -> frozenset:
    aval = jax.typeof(arr)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or getattr(aval, "vma", ()) or ())


class _Static:
    """A leaf that is not an array: passed into (or out of) the body as it is."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _is_dynamic_leaf(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "__jax_array__")


class _ShardMapped:
    def __init__(self, fn, mesh, in_mapping, out_mapping, mapping, check_vma):
        self.fn, self.mesh, self.in_mapping, self.out_mapping, self.mapping, self.check_vma = (
            fn,
            mesh,
            in_mapping,
            out_mapping,
            mapping,
            check_vma,
        )

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise NamedError(
                f"nm.shard_map passes positional arguments only, got keywords {sorted(kwargs)}; "
                "bind them first with functools.partial"
            )
        mesh = self.mesh if self.mesh is not None else current_mesh()
        if mesh is None:
            raise ShardingError("nm.shard_map needs a mesh: pass mesh=, or call it under jax.set_mesh / named_jit")
        in_mapping = self.in_mapping if self.in_mapping is not None else current_mapping()
        for m in (list(in_mapping) if isinstance(in_mapping, (tuple, list)) else [in_mapping]) + [self.mapping]:
            if m is not None:
                check_mapping(m, mesh)
        leaves, treedef = jax.tree.flatten(args, is_leaf=is_local_leaf)
        mappings = _prefix_mappings(in_mapping, args, "in_mapping")
        body = LocalBody(mesh, *self._active(in_mapping))

        dyn, specs, kinds = [], [], []  # kinds: local axes of a NamedArray, "array", or _Static
        for leaf, m in zip(leaves, mappings):
            if isinstance(leaf, Unreduced):
                raise unreduced_error(leaf, "nm.shard_map (as an input)")
            if isinstance(leaf, NamedArray):
                spec = pspec_for(leaf, m or {}, mesh)
                dyn.append(leaf.array)
                specs.append(spec)
                kinds.append(_local_axes(leaf.axes, spec, mesh))
            elif _is_dynamic_leaf(leaf):
                dyn.append(leaf)
                specs.append(PartitionSpec())
                kinds.append("array")
            else:
                kinds.append(_Static(leaf))

        def run(record: list, *arrays):
            it = iter(arrays)
            local = [
                k.value if isinstance(k, _Static) else next(it) if k == "array" else unchecked(next(it), k)
                for k in kinds
            ]
            with body_context(body):
                out = self.fn(*jax.tree.unflatten(treedef, local))
            return self._outputs(out, record)

        # jax wants out_specs before it traces the body, but they depend on what the body returns
        # (its blocks' layouts, or the out mapping applied to its names): read them off a first,
        # abstract trace.
        probe: list = []
        jax.eval_shape(
            _compat.shard_map(
                functools.partial(run, probe),
                mesh=mesh,
                in_specs=tuple(specs),
                out_specs=PartitionSpec(),
                check_vma=False,
            ),
            *dyn,
        )
        record: list = []
        final = functools.partial(run, record)
        functools.update_wrapper(final, self.fn)
        outs = _compat.shard_map(
            final, mesh=mesh, in_specs=tuple(specs), out_specs=tuple(probe[0]["specs"]), check_vma=self.check_vma
        )(*dyn)
        meta = record[-1]
        it = iter(outs)
        result = []
        for k in meta["kinds"]:
            if isinstance(k, _Static):
                result.append(k.value)
            elif k == "array":
                result.append(next(it))
            else:
                arr = next(it)
                result.append(unchecked(arr, tuple(Axis(a.name, n) for a, n in zip(k, arr.shape))))
        return jax.tree.unflatten(meta["treedef"], result)

    def _active(self, in_mapping):
        """The mapping collectives fall back on when no block can say (axis_index, plain psum_scatter)."""
        if self.mapping is not None:
            return FrozenMapping({k: mesh_axes_of(v) for k, v in self.mapping.items()}), FrozenMapping({})
        maps = [m for m in (in_mapping if isinstance(in_mapping, (tuple, list)) else [in_mapping]) if m is not None]
        merged: dict[str, tuple[str, ...]] = {}
        ambiguous: dict[str, list] = {}
        for m in maps:
            for k, v in m.items():
                v = mesh_axes_of(v)
                if k in merged and merged[k] != v:
                    ambiguous.setdefault(k, [merged[k]]).append(v)
                merged.setdefault(k, v)
        return FrozenMapping(merged), FrozenMapping({k: tuple(v) for k, v in ambiguous.items()})

    def _outputs(self, out, record: list):
        flat, treedef = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_local_leaf)
        if isinstance(self.out_mapping, (tuple, list)):
            outs = out if isinstance(out, tuple) else (out,)
            out_maps = _prefix_mappings(self.out_mapping, outs, "out_mapping")
        else:
            out_maps = [self.out_mapping] * len(flat)
        arrays, specs, kinds = [], [], []
        for (path, leaf), m in zip(flat, out_maps):
            where = f"output {jax.tree_util.keystr(path) or '(the result)'}"
            if isinstance(leaf, Unreduced):
                raise unreduced_error(leaf, f"nm.shard_map's {where}")
            if isinstance(leaf, NamedArray):
                spec = _out_spec(leaf, m, where)
                if self.check_vma:
                    _check_varying(leaf, spec, where)
                arrays.append(leaf.array)
                specs.append(spec)
                kinds.append(leaf.axes)
            elif _is_dynamic_leaf(leaf) or _compat.is_tracer(leaf):
                if self.check_vma and _varying(leaf):
                    raise ShardingError(
                        f"{where} is a plain array, returned replicated, but it may differ across mesh axes "
                        f"{sorted(_varying(leaf))} (a statistic of this device's rows only?): reduce it over them "
                        f"(jax.lax.psum / pmean) or return it as a NamedArray split along an axis"
                    )
                arrays.append(leaf)
                specs.append(PartitionSpec())
                kinds.append("array")
            else:
                kinds.append(_Static(leaf))
        record.append({"specs": specs, "kinds": kinds, "treedef": treedef})
        return tuple(arrays)


def _out_spec(x: NamedArray, mapping, where: str) -> PartitionSpec:
    """The block's own layout as a PartitionSpec; an out mapping only checks it."""
    spec = PartitionSpec(*(_group(split_over(a)) if split_over(a) else None for a in x.axes))
    if mapping is None:
        return spec
    for a, entry in zip(x.axes, pspec_for(x.names, mapping, mesh=None)):
        have, want = split_over(a), tuple(mesh_axes_of(entry))
        if have != want:
            from .inspect import layout

            state = f"split over {have}" if have else "whole here"
            raise ShardingError(
                f"{where} is laid out {block_layout(x)!r} in the body, but out_mapping says "
                f"{layout(x.names, mapping)!r}: axis {a.name!r} is {state}, not "
                f"{'split over ' + str(want) if want else 'whole'}. "
                f"Gather or scatter it in the body, fix out_mapping, or (if an op dropped the axis' layout) "
                f"say where it is with nm.with_layout."
            )
    return spec


def _check_varying(x: NamedArray, spec: PartitionSpec, where: str) -> None:
    named = {m for e in spec for m in mesh_axes_of(e)}
    extra = sorted(_varying(x.array) - named)
    if extra:
        raise ShardingError(
            f"{where}, layout {block_layout(x)!r}, may differ across mesh axes {extra} that its layout does not "
            f"split it over. If it came from nm.all_gather, jax still counts it as varying over the gathered axes: "
            f"gather with nm.all_gather(..., invariant=True), return it split, or pass check_vma=False knowingly."
        )


def shard_map(
    fn: Callable | None = None,
    *,
    mesh=None,
    in_mapping: ResourceMapping | Sequence[ResourceMapping | None] | None = None,
    out_mapping: ResourceMapping | Sequence[ResourceMapping | None] | None = None,
    mapping: ResourceMapping | None = None,
    check_vma: bool = True,
    **haliax_names,
):
    """Run ``fn`` on every device's local blocks; collectives inside take axis names.

    Args:
        fn: called with the local blocks of its arguments (the same pytree). NamedArrays keep
            their names; an axis split over mesh axes has its local size and is a
            :class:`ShardedAxis` that remembers those mesh axes. Plain arrays come in
            replicated; other leaves (numbers, strings, static module fields) as they are.
        mesh: default: the current mesh (``named_jit``'s, or ``jax.set_mesh``'s).
        in_mapping: how the inputs are split: one mapping for all arguments, or a tuple
            with one mapping (None: replicated) per positional argument, e.g.
            ``(param_mapping, compute_mapping)``. Default: the current compute mapping.
        out_mapping: how the results are laid out: a mapping, or a tuple of them (one per
            element of a tuple result). Default: as the blocks say, each result split where
            its block's axes are split. A mapping that contradicts a block's layout is an error.
        mapping: the mapping collectives fall back on when no block can answer
            (``axis_index(name)``, ``psum_scatter`` of a plain NamedArray). Default: the union
            of the in mappings (an axis they map differently then needs ``mesh_axes=``).
        check_vma: jax's check that a value it knows to vary across a mesh axis is not returned
            as replicated over it. Keep it on: it is also what makes autodiff insert the
            reductions a replicated value used against split ones needs.

    Returns:
        a function of the same positional arguments that returns global NamedArrays.

    ``fn`` is traced twice per call (jax needs the out_specs before the trace that uses them,
    and they depend on what ``fn`` returns); under ``jit`` that is once per compilation.
    """
    mapping, in_mapping, out_mapping = haliax_spellings(
        "shard_map", haliax_names, mapping=mapping, in_mapping=in_mapping, out_mapping=out_mapping
    )
    if haliax_names:
        raise ArgumentTypeError(f"shard_map got unexpected keyword arguments {sorted(haliax_names)}")
    for m in (mapping,) + (tuple(in_mapping) if isinstance(in_mapping, (tuple, list)) else (in_mapping,)):
        if m is not None:
            check_mapping_values(m)

    def wrap(f):
        wrapped = _ShardMapped(f, mesh, in_mapping, out_mapping, mapping, check_vma)
        functools.update_wrapper(wrapped, f, updated=())
        return wrapped

    return wrap if fn is None else wrap(fn)


# ---- collectives by axis name -------------------------------------------------------------------


def _check_named(x, what: str) -> NamedArray:
    if isinstance(x, Unreduced):
        raise unreduced_error(x, f"nm.{what}")
    return expect_named(x, f"nm.{what}")


def all_gather(x: NamedArray, axis: AxisSelection, *, invariant: bool = False) -> NamedArray:
    """Gather ``axis`` (one name or several) whole on every device, from the mesh axes that
    split it in this block. ``embed/data mlp/model`` gathered on ``embed`` is ``embed mlp/model``.

    The gradient of the gather is a reduce-scatter (``psum_scatter``) over the same mesh axes:
    FSDP's weight gradients come out sharded, never whole. jax still counts the result as
    varying over those mesh axes; ``invariant=True`` types it replicated instead (then it can
    be returned whole from the body), at the price of a gradient that is an all-reduce and a
    slice instead of a reduce-scatter.
    """
    x = _check_named(x, "all_gather")
    body = _body("all_gather")
    arr, axes = x.array, list(x.axes)
    for sel in as_selectors(axis):
        i = x.index_of(sel)
        a = axes[i]
        over = split_over(a)
        if not over:
            raise ShardingError(
                f"nm.all_gather: axis {a.name!r} is whole in this block (layout {block_layout(x)!r}); there is "
                f"nothing to gather. If an op dropped its layout, restore it with nm.with_layout(x, ...)."
            )
        n = _size(body, over)
        arr = issue(lax.all_gather, arr, _group(over), axis=i, tiled=True, to="invarying" if invariant else "varying")
        axes[i] = Axis(a.name, a.size * n)
    return unchecked(arr, tuple(axes))


def psum_scatter(
    x: NamedArray | Unreduced, axis: str | Axis, *, mesh_axes: str | Sequence[str] | None = None
) -> NamedArray:
    """Sum partial sums across devices and leave each device its slice of ``axis``: a reduce-scatter.

    For an :class:`Unreduced` value the sum is over the mesh axes it is owed over, and ``axis``
    ends up split over those same axes (``batch/data position embed {U: model}`` ->
    ``batch/data position embed/model``). For a plain NamedArray (whose partial sums you made
    yourself) the mesh axes are ``mesh_axes``, else the ones the active mapping gives ``axis``.
    If ``axis`` was already split, the new split is nested inside (its mesh axes go minor).
    """
    body = _body("psum_scatter")
    name = name_of(axis)
    if isinstance(x, Unreduced):
        if mesh_axes is not None and tuple(mesh_axes_of(mesh_axes)) != x.over:
            raise ShardingError(
                f"nm.psum_scatter: the value is owed a sum over {x.over}, not {tuple(mesh_axes_of(mesh_axes))}"
            )
        over, value = x.over, x.value
    else:
        value = _check_named(x, "psum_scatter")
        over = tuple(mesh_axes_of(mesh_axes)) if mesh_axes is not None else _mapped(body, name, "psum_scatter")
        if not over:
            raise ShardingError(
                f"nm.psum_scatter: no mesh axes to reduce over for axis {name!r} of a block laid out "
                f"{block_layout(value)!r}: pass an Unreduced value (from nm.einsum_unreduced) or mesh_axes="
            )
    i = value.index_of(name)
    a = value.axes[i]
    n = _size(body, over)
    if a.size % n:
        raise ShardingError(
            f"nm.psum_scatter: axis {name!r} of the block {block_layout(value)!r} has local size {a.size}, "
            f"which does not split over mesh axes {over} ({n} devices)"
        )
    clash = [b.name for b in value.axes if set(split_over(b)) & set(over)]
    if clash:
        raise ShardingError(f"nm.psum_scatter: axes {clash} of {block_layout(value)!r} are already split over {over}")
    arr = issue(lax.psum_scatter, value.array, _group(over), scatter_dimension=i, tiled=True)
    axes = list(value.axes)
    axes[i] = with_split(a, a.size // n, split_over(a) + tuple(over))
    return unchecked(arr, tuple(axes))


def _reduce(x, axis, mesh_axes, what: str, local_fn, collective):
    _body(what)  # refuses a collective outside a shard_map body
    if isinstance(x, Unreduced):
        if what != "psum":
            raise unreduced_error(x, f"nm.{what}")
        if axis is not None:
            raise NamedError(
                "nm.psum of an Unreduced value takes no axis: it settles the sum it is owed "
                "(to also reduce an axis, sum it first: nm.psum(u).sum(axis))"
            )
        over = x.over if mesh_axes is None else tuple(mesh_axes_of(mesh_axes))
        extra = [m for m in over if m not in x.over]
        if extra:
            raise ShardingError(f"nm.psum: the value is owed a sum over {x.over}, not over {extra}")
        out = unchecked(issue(lax.psum, x.value.array, _group(over)), x.value.axes)
        rest = tuple(m for m in x.over if m not in over)
        return Unreduced(out, rest) if rest else out
    x = _check_named(x, what)
    if axis is None and mesh_axes is None:
        raise NamedError(f"nm.{what} needs the axes to reduce (nm.{what}(x, 'batch')) or mesh_axes=")
    names = [name_of(a) for a in as_selectors(axis)] if axis is not None else []
    over: list[str] = []
    for n in names:
        for m in split_over(x.resolve_axis(n)):
            over.append(m)
    if mesh_axes is not None:
        over += [m for m in mesh_axes_of(mesh_axes) if m not in over]
    out = local_fn(x, tuple(names)) if names else x
    if over:
        out = unchecked(issue(collective, out.array, _group(tuple(over))), out.axes)
    return out


def psum(
    x: NamedArray | Unreduced, axis: AxisSelection | None = None, *, mesh_axes: str | Sequence[str] | None = None
) -> NamedArray | Unreduced:
    """Sums across devices, by name.

    - ``nm.psum(u)`` for an :class:`Unreduced` value: settle the sum it is owed (an all-reduce);
      ``mesh_axes=`` settles only part of it (the rest stays Unreduced).
    - ``nm.psum(x, "batch")``: the sum over the *whole* ``batch`` axis: the block's own rows,
      then an all-reduce over the mesh axes that split ``batch`` (none if it is whole).
    - ``nm.psum(x, mesh_axes="data")``: add the blocks of all devices along ``data``
      elementwise (``lax.psum``); for values you know to be partial sums.
    """
    return _reduce(x, axis, mesh_axes, "psum", lambda v, n: v.sum(n), lax.psum)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _pmax(arr, axis_name):
    return lax.pmax(arr, axis_name)


@_pmax.defjvp
def _pmax_jvp(axis_name, primals, tangents):
    # lax.pmax has no differentiation rule. This is jnp.max's, across devices: the tangent of
    # the entries that hold the maximum, shared equally among ties.
    (arr,), (t,) = primals, tangents
    out = lax.pmax(arr, axis_name)
    at_max = (arr == out).astype(t.dtype)
    return out, lax.psum(t * at_max, axis_name) / lax.psum(at_max, axis_name)


def pmax(
    x: NamedArray, axis: AxisSelection | None = None, *, mesh_axes: str | Sequence[str] | None = None
) -> NamedArray:
    """The maximum over the whole named ``axis`` (the block's, then across the mesh axes that split it),
    or elementwise across ``mesh_axes``. Its gradient goes to the entries that hold the maximum
    (split equally among ties), as ``jnp.max``'s does."""
    return _reduce(x, axis, mesh_axes, "pmax", lambda v, n: v.max(n), _pmax)


def pmean(
    x: NamedArray, axis: AxisSelection | None = None, *, mesh_axes: str | Sequence[str] | None = None
) -> NamedArray:
    """The mean over the whole named ``axis`` (or elementwise across ``mesh_axes``)."""
    body = _body("pmean")
    x = _check_named(x, "pmean")
    count = 1
    for n in [name_of(a) for a in as_selectors(axis)] if axis is not None else []:
        a = x.resolve_axis(n)
        count *= a.size * _size(body, split_over(a))
    for m in mesh_axes_of(mesh_axes) if mesh_axes is not None else ():
        count *= body.mesh.shape[m]
    return psum(x, axis, mesh_axes=mesh_axes) / count


def all_to_all(
    x: NamedArray, *, split: str | Axis, concat: str | Axis, mesh_axes: str | Sequence[str] | None = None
) -> NamedArray:
    """Move the split from one axis to another: ``concat`` (split over some mesh axes) becomes
    whole and ``split`` (whole) becomes split over those mesh axes. ``position/model heads`` with
    ``split="heads", concat="position"`` is ``position heads/model`` (sequence -> head parallel).
    ``mesh_axes`` overrides the mesh axes read from ``concat``'s layout.
    """
    x = _check_named(x, "all_to_all")
    body = _body("all_to_all")
    si, ci = x.index_of(split), x.index_of(concat)
    s, c = x.axes[si], x.axes[ci]
    over = tuple(mesh_axes_of(mesh_axes)) if mesh_axes is not None else split_over(c)
    if not over:
        raise ShardingError(
            f"nm.all_to_all: axis {c.name!r} is whole in the block {block_layout(x)!r}; "
            "there is nothing to concatenate (pass mesh_axes= if an op dropped its layout)"
        )
    if split_over(c) and split_over(c)[-len(over) :] != over:
        raise ShardingError(f"nm.all_to_all: {c.name!r} is split over {split_over(c)}, not (minor-most) over {over}")
    n = _size(body, over)
    if s.size % n:
        raise ShardingError(
            f"nm.all_to_all: axis {s.name!r} (local size {s.size}) does not split over {over} ({n} devices)"
        )
    arr = issue(lax.all_to_all, x.array, _group(over), split_axis=si, concat_axis=ci, tiled=True)
    axes = list(x.axes)
    axes[si] = with_split(s, s.size // n, split_over(s) + over)
    c_rest = split_over(c)[: len(split_over(c)) - len(over)]
    axes[ci] = with_split(c, c.size * n, c_rest)
    return unchecked(arr, tuple(axes))


def axis_index(
    axis: str | Axis | None = None, *, of: NamedArray | None = None, mesh_axes: str | Sequence[str] | None = None
) -> jax.Array:
    """This device's block number along a named axis (0 .. number of blocks - 1): from the
    layout of ``of`` when given, else from the active mapping; or along ``mesh_axes``.
    ``axis_index("position", of=x) * x.axis_size("position")`` is where the block starts."""
    body = _body("axis_index")
    if mesh_axes is not None:
        over = tuple(mesh_axes_of(mesh_axes))
    elif axis is None:
        raise NamedError("nm.axis_index needs an axis name or mesh_axes=")
    elif of is not None:
        over = split_over(of.resolve_axis(name_of(axis)))
    else:
        over = _mapped(body, name_of(axis), "axis_index")
    if not over:
        return jax.numpy.zeros((), jax.numpy.int32)
    return lax.axis_index(_group(over))


# ---- contractions that owe a reduction ------------------------------------------------------------


def einsum_unreduced(equation: str, *arrays: NamedArray, **kwargs) -> NamedArray | Unreduced:
    """``nm.einsum`` on local blocks that says what it owes: contracting an axis that is split
    over mesh axes gives each device only its share of the sum, returned as
    :class:`Unreduced` over those mesh axes; contracting only whole axes gives a NamedArray.

    Operands must agree on each axis: split over the same mesh axes, or (when an op dropped
    one operand's layout) the same local size, where the split side is believed.
    """
    for k, x in enumerate(arrays):
        if isinstance(x, Unreduced):
            raise unreduced_error(x, f"nm.einsum_unreduced operand {k}")
    claims = _merge_layouts(arrays, "einsum_unreduced")
    out = local_einsum(equation, *arrays, settle=False, **kwargs)
    contracted = {a.name for x in arrays for a in x.axes} - set(out.names)
    over: list[str] = []
    for n in sorted(contracted, key=lambda n: [a.name for x in arrays for a in x.axes].index(n)):
        over += [m for m in claims.get(n, ()) if m not in over]
    out = unchecked(out.array, tuple(with_split(a, a.size, claims.get(a.name, ())) for a in out.axes))
    return Unreduced(out, over) if over else out


def _merge_layouts(arrays: Sequence[NamedArray], what: str) -> dict[str, tuple[str, ...]]:
    """Axis name -> the mesh axes it is split over, agreed by all operands (or an error that shows both)."""
    first: dict[str, tuple[int, Axis]] = {}
    claims: dict[str, tuple[str, ...]] = {}
    for k, x in enumerate(arrays):
        if not isinstance(x, NamedArray):
            raise ArgumentTypeError(f"nm.{what} operand {k} is a {type(x).__name__}, not a NamedArray")
        for a in x.axes:
            over = split_over(a)
            if a.name in first:
                j, b = first[a.name]
                if b.size != a.size or (over and claims.get(a.name, over) != over):
                    raise ShardingError(
                        f"nm.{what}: axis {a.name!r} is {_describe(b)} in "
                        f"operand {j} ({block_layout(arrays[j])!r}) but "
                        f"{_describe(a)} in operand {k} ({block_layout(x)!r}); gather the split one "
                        f"(nm.all_gather) or split the whole one so both blocks hold the same part"
                    )
            else:
                first[a.name] = (k, a)
            if over:
                claims[a.name] = over
    return claims


def _describe(a: Axis) -> str:
    over = split_over(a)
    return f"split over {over} (local size {a.size})" if over else f"whole here (size {a.size})"
