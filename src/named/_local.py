"""Local blocks and partial sums, for explicit mode (``named.explicit``).

Inside ``nm.shard_map`` an axis that is split over mesh axes is a :class:`ShardedAxis`: its
size is the local size and it remembers the mesh axes. A contraction over such an axis owes a
sum across devices; :class:`Unreduced` carries that debt in the type until it is paid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from ._axis import ArgumentTypeError, Axis, AxisError, NamedError, format_axes
from ._core import NamedArray
from ._layout import parse_layout
from .partitioning import ResourceMapping, _check_mapping_values, _mesh_axes


# ---- local blocks ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class ShardedAxis(Axis):
    """An axis of a local block inside ``nm.shard_map``: ``size`` is the local size and
    ``mesh_axes`` the mesh axes it is split over (major to minor). Whole axes are plain Axis."""

    mesh_axes: tuple[str, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "mesh_axes", tuple(self.mesh_axes))

    def __repr__(self) -> str:
        return f"ShardedAxis({self.name!r}, {self.size}, over={self.mesh_axes!r})"


def _split_over(a: Axis) -> tuple[str, ...]:
    return a.mesh_axes if isinstance(a, ShardedAxis) else ()


def _with_split(a: Axis, size: int, mesh_axes: tuple[str, ...]) -> Axis:
    return ShardedAxis(a.name, size, tuple(mesh_axes)) if mesh_axes else Axis(a.name, size)


def block_layout(x: NamedArray | Unreduced) -> str:
    """The layout of a local block: ``"batch/data position embed"``; an Unreduced value adds
    ``{U: model}`` (seqax's notation for a sum still owed over ``model``)."""
    if isinstance(x, Unreduced):
        return f"{block_layout(x.value)} {{U: {'+'.join(x.over)}}}"
    parts = []
    for a in x.axes:
        over = _split_over(a)
        parts.append(f"{a.name}/{'+'.join(over)}" if over else a.name)
    return " ".join(parts)


def with_layout(x: NamedArray, layout: str | ResourceMapping) -> NamedArray:
    """Say where a block's axes are split, for axes an op re-created without their layout
    (``rename``, ``flatten_axes``, ``unflatten_axis``, slicing make fresh whole axes).

    ``with_layout(x, "batch/data heads/model head_size")`` or ``with_layout(x, {"heads": "model"})``.
    Axes it names take the layout it gives (a bare name or None: whole); the others keep theirs.
    Nothing moves: this only labels the block.
    """
    if isinstance(layout, str):
        names, mapping = parse_layout(layout)
        unknown = [n for n in names if n not in x.names]
        if unknown:
            raise AxisError(f"with_layout: {unknown} in {layout!r} are not axes of the block {format_axes(x.axes)}")
    else:
        _check_mapping_values(layout)
        mapping = dict(layout)
        unknown = [n for n in mapping if n not in x.names]
        if unknown:
            raise AxisError(f"with_layout: {unknown} are not axes of the block {format_axes(x.axes)}")
        names = tuple(mapping)
    axes = tuple(_with_split(a, a.size, _mesh_axes(mapping.get(a.name))) if a.name in names else a for a in x.axes)
    return NamedArray._unchecked(x.array, axes)


# ---- partial sums ------------------------------------------------------------------------------


class UnreducedError(NamedError, TypeError):
    """An Unreduced partial sum was used before its reduction."""


class Unreduced:
    """A block of partial sums still owed a ``psum`` over the mesh axes ``over``.

    Made by :func:`einsum_unreduced` when it contracts a split axis. It adds to another
    Unreduced over the same mesh axes and scales by numbers (sums of partial sums are partial
    sums); anything else raises :class:`UnreducedError` until ``nm.psum(u)`` or
    ``nm.psum_scatter(u, axis)`` settles it.
    """

    __slots__ = ("value", "over")

    def __init__(self, value: NamedArray, over: Sequence[str]):
        if not isinstance(value, NamedArray):
            raise ArgumentTypeError(f"Unreduced wraps a NamedArray, got {type(value).__name__}")
        over = tuple(over)
        if not over:
            raise NamedError("Unreduced needs the mesh axes the sum is owed over, e.g. over=('model',)")
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "over", over)

    def __setattr__(self, name, value):
        raise AttributeError("Unreduced is immutable")  # protocol: setattr

    def _refuse(self, what: str) -> UnreducedError:
        return UnreducedError(
            f"{what}: the value is an unreduced partial sum, layout {block_layout(self)!r}: each device holds "
            f"only its share of a sum over mesh axes {self.over}. Reduce it first: nm.psum(u) (every device gets "
            f"the total) or nm.psum_scatter(u, axis) (each device gets its slice of axis)."
        )

    def __getattr__(self, name):
        if name.startswith("_"):  # protocol probes (_repr_html_, __array__, ...) just find nothing
            raise AttributeError(name)  # protocol: getattr
        raise self._refuse(f"an op read .{name}")

    def __jax_array__(self):
        raise self._refuse("converting to a jax array")

    def __repr__(self) -> str:
        return f"Unreduced({block_layout(self)}, {getattr(self.value.array, 'dtype', '?')})"

    def __add__(self, other):
        if isinstance(other, Unreduced) and other.over == self.over:
            return Unreduced(self.value + other.value, self.over)
        if isinstance(other, Unreduced):
            raise UnreducedError(f"adding partial sums owed over different mesh axes ({self.over} and {other.over}); "
                                 "psum one of them first")
        raise self._refuse("+ with a value that is not a partial sum (it would be counted once per device)")

    __radd__ = __add__

    def __sub__(self, other):
        return self + (-other)

    def __neg__(self):
        return Unreduced(-self.value, self.over)

    def __mul__(self, other):
        if isinstance(other, (int, float)):
            return Unreduced(self.value * other, self.over)
        raise self._refuse("* by something other than a number")

    __rmul__ = __mul__

    def __truediv__(self, other):
        if isinstance(other, (int, float)):
            return Unreduced(self.value / other, self.over)
        raise self._refuse("/ by something other than a number")

    def _no_op(self, *_, **__):
        raise self._refuse("an op")

    __matmul__ = __rmatmul__ = __rsub__ = __rtruediv__ = __pow__ = __rpow__ = _no_op
    __lt__ = __le__ = __gt__ = __ge__ = __abs__ = __getitem__ = __iter__ = __len__ = _no_op
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):  # type: ignore[override]
        raise self._refuse("==")

    def __bool__(self):
        raise self._refuse("bool()")


def _unreduced_flatten(u: Unreduced):
    return ((jax.tree_util.GetAttrKey("value"), u.value),), u.over


def _unreduced_unflatten(over, children):
    u = object.__new__(Unreduced)
    object.__setattr__(u, "value", children[0])
    object.__setattr__(u, "over", over)
    return u


jax.tree_util.register_pytree_with_keys(Unreduced, _unreduced_flatten, _unreduced_unflatten,
                                        flatten_func=lambda u: ((u.value,), u.over))


def _is_leaf(x) -> bool:
    return isinstance(x, (NamedArray, Unreduced))
