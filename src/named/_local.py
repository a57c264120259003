"""Local blocks and partial sums, for explicit mode (``named.explicit``).

Inside ``nm.shard_map`` an axis that is split over mesh axes is a :class:`ShardedAxis`: its
size is the local size and it remembers the mesh axes. A contraction over such an axis owes a
sum across devices; :class:`Unreduced` carries that debt in the type until it is paid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from . import _compat
from ._axis import ArgumentTypeError, Axis, AxisError, NamedError, format_axes
from ._context import FrozenMapping, block_parts, current_order, order_context
from ._core import NamedArray, expect_named, unchecked
from ._layout import parse_layout
from .partitioning import ResourceMapping, check_mapping_values, mesh_axes_of

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


def split_over(a: Axis) -> tuple[str, ...]:
    return a.mesh_axes if isinstance(a, ShardedAxis) else ()


def with_split(a: Axis, size: int, mesh_axes: tuple[str, ...]) -> Axis:
    return ShardedAxis(a.name, size, tuple(mesh_axes)) if mesh_axes else Axis(a.name, size)


# ---- parts of a block (explicit mode's batch split; the part being traced: _context.part_of_block) ---


def split_block(x: NamedArray, name: str, parts: int) -> list[NamedArray]:
    """``x``'s block cut into ``parts`` equal pieces along ``name``; each keeps the layout."""
    i = x.names.index(name)
    a = x.axes[i]
    if a.size % parts:
        raise AxisError(f"cannot split this device's block of axis {name!r} (size {a.size}) into {parts} equal parts")
    n = a.size // parts
    piece = with_split(a, n, split_over(a))
    return [
        unchecked(jax.lax.slice_in_dim(x.array, k * n, (k + 1) * n, axis=i), x.axes[:i] + (piece,) + x.axes[i + 1 :])
        for k in range(parts)
    ]


def join_blocks(pieces: Sequence[NamedArray], name: str) -> NamedArray:
    """The inverse of :func:`split_block`: the pieces concatenated along ``name``."""
    i = pieces[0].names.index(name)
    a = pieces[0].axes[i]
    whole = with_split(a, sum(p.axes[i].size for p in pieces), split_over(a))
    return unchecked(
        jnp.concatenate([p.array for p in pieces], axis=i), pieces[0].axes[:i] + (whole,) + pieces[0].axes[i + 1 :]
    )


# Explicit mode's batch split traces a layer once per piece of the batch. The pieces do not depend
# on each other, so XLA may merge the k-th collective of one with the k-th of the next (one
# all-reduce for both) and then neither piece's compute can run while it is in flight. The order
# below makes piece p's k-th collective wait for piece p-1's k-th in the forward pass, and piece
# p-1's wait for piece p's in the backward pass: never merged, and each piece's collective has
# the neighbouring piece's compute beside it (the seed's staggered batch split).


class CollectiveOrder:
    """Orders the collectives of the pieces traced one after another under :meth:`piece`: those
    issued through :func:`issue`, and the all-reduces that autodiff makes of the ``vary`` marks
    :func:`vary` puts on a contraction's replicated operands (tensor parallelism's input
    gradients)."""

    def __init__(self):
        self.prev: list = []
        self.cur: list = []
        self.n_vary = 0
        self.vary_sums: dict[int, Any] = {}  # k -> the backward all-reduce of a piece's k-th vary mark

    @contextlib.contextmanager
    def piece(self) -> Iterator[None]:
        try:
            with order_context(self):
                yield
        finally:
            self.prev, self.cur, self.n_vary = self.cur, [], 0

    def issue(self, collective, arr, *args, **kwargs):
        k = len(self.cur)
        if k < len(self.prev) and _is_float(arr) and _is_float(self.prev[k]):
            arr = _after(arr, self.prev[k])
        out = collective(arr, *args, **kwargs)
        self.cur.append(out)
        return out

    def vary(self, x, axes: tuple[str, ...]):
        k, self.n_vary = self.n_vary, self.n_vary + 1
        sums = self.vary_sums

        @jax.custom_vjp
        def mark(x):
            return jax.lax.pcast(x, axes, to="varying")

        def fwd(x):
            return mark(x), None

        def bwd(_, ct):
            # autodiff makes this sum; the first piece whose backward pass reaches it goes
            # first, the other piece's waits for it
            if k in sums and _is_float(ct):
                ct = _after(ct, sums[k])
            out = jax.lax.psum(ct, axes)
            sums[k] = out
            return (out,)

        mark.defvjp(fwd, bwd)
        return mark(x)


def issue(collective, arr, *args, **kwargs):
    """``collective(arr, ...)``; every collective of named's explicit mode is issued through here,
    so that a :class:`CollectiveOrder` being traced can order it."""
    order = current_order()
    return collective(arr, *args, **kwargs) if order is None else order.issue(collective, arr, *args, **kwargs)


def vary(x, axes) -> Any:
    """``x`` marked varying over mesh axes ``axes`` (what jax does by itself where a replicated
    value meets a split one); under a :class:`CollectiveOrder` the all-reduce it costs in the
    backward pass is ordered between the pieces."""
    order = current_order()
    if order is None or not axes:
        return x
    return order.vary(x, tuple(sorted(axes)))


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _after(x, prev):
    """``x``, available only once ``prev`` is; in the backward pass, where the two vary over the
    same mesh axes, ``prev``'s cotangent gets a zero available only once ``x``'s cotangent is (the
    reverse order). An optimization barrier types all its operands alike, so ``prev`` is first
    marked varying where ``x`` varies (a relabelling: no data moves); ``x``'s type never changes."""
    vx, vp = _compat.varying_axes(x), _compat.varying_axes(prev)
    if not vp <= vx:  # ordering would make x vary over more mesh axes: leave it alone
        return x
    shape, dtype = prev.shape, prev.dtype

    @jax.custom_vjp
    def after(x, prev):
        if vx - vp:
            prev = jax.lax.pcast(prev, tuple(sorted(vx - vp)), to="varying")
        return jax.lax.optimization_barrier((x, prev))[0]

    def fwd(x, prev):
        return after(x, prev), None

    def bwd(_, ct):
        zero = jnp.zeros(shape, dtype)
        if vp:  # a cotangent has its primal's type
            zero = jax.lax.pcast(zero, tuple(sorted(vp)), to="varying")
        # (a cotangent may vary over more mesh axes than its primal: then the order is left out)
        return jax.lax.optimization_barrier((ct, zero)) if _compat.varying_axes(ct) == vp else (ct, zero)

    after.defvjp(fwd, bwd)
    return after(x, prev)


def block_layout(x: NamedArray | Unreduced) -> str:
    """The layout of a local block: ``"batch/data position embed"``; an Unreduced value adds
    ``{U: model}`` (seqax's notation for a sum still owed over ``model``)."""
    if isinstance(x, Unreduced):
        return f"{block_layout(x.value)} {{U: {'+'.join(x.over)}}}"
    expect_named(x, "nm.explicit.block_layout")
    parts = []
    for a in x.axes:
        over = split_over(a)
        parts.append(f"{a.name}/{'+'.join(over)}" if over else a.name)
    return " ".join(parts)


def with_layout(x: NamedArray, layout: str | ResourceMapping) -> NamedArray:
    """Say where a block's axes are split, for axes an op re-created without their layout
    (``rename``, ``flatten_axes``, ``unflatten_axis``, slicing make fresh whole axes).

    ``with_layout(x, "batch/data heads/model head_size")`` or ``with_layout(x, {"heads": "model"})``.
    Axes it names take the layout it gives (a bare name or None: whole); the others keep theirs.
    Nothing moves: this only labels the block.
    """
    expect_named(x, "nm.with_layout")
    if isinstance(layout, str):
        names, mapping = parse_layout(layout)
        unknown = [n for n in names if n not in x.names]
        if unknown:
            raise AxisError(f"with_layout: {unknown} in {layout!r} are not axes of the block {format_axes(x.axes)}")
    else:
        check_mapping_values(layout)
        mapping = dict(layout)
        unknown = [n for n in mapping if n not in x.names]
        if unknown:
            raise AxisError(f"with_layout: {unknown} are not axes of the block {format_axes(x.axes)}")
        names = tuple(mapping)
    axes = tuple(with_split(a, a.size, mesh_axes_of(mapping.get(a.name))) if a.name in names else a for a in x.axes)
    return unchecked(x.array, axes)


# ---- the body: explicit mode's hooks into the array core ------------------------------------------


@dataclasses.dataclass(frozen=True)
class LocalBody:
    """The ``nm.shard_map`` body being traced (``_context.body_context``'s value): what collectives
    need to know, and the hooks the array core calls on local blocks (``nm.einsum``'s contraction,
    ``nm.random.block_draw``) so that it never reads explicit mode's state itself. A jit-key
    value, hence frozen and hashable."""

    mesh: Any
    mapping: FrozenMapping  # axis name -> mesh axes, for axis_index and psum_scatter of plain blocks
    ambiguous: FrozenMapping  # axis name -> the different mesh axes the in mappings give it

    def contract(self, einsum, arrays: tuple[NamedArray, ...], out_axes: tuple[Axis, ...], settle: bool):
        """``einsum(*raw)`` of local blocks. A contraction over a split axis gives this device's
        share; with ``settle`` the sum over the devices makes it the value it has outside
        (Megatron's row-parallel sum)."""
        raw = [x.array for x in arrays]
        if current_order() is not None:  # the batch split: the backward sums of jax's implicit vary marks, ordered
            varies = [_compat.varying_axes(r) for r in raw]
            every = frozenset().union(*varies)
            raw = [vary(r, every - v) for r, v in zip(raw, varies)]
        result = einsum(*raw)
        owed = _owed(arrays, out_axes) if settle else ()
        if owed:
            result = issue(jax.lax.psum, result, owed[0] if len(owed) == 1 else owed)
        return result

    def draw(self, draw, axes: tuple[Axis, ...]):
        """``nm.random.block_draw`` on local blocks: ``draw`` of the whole array, of which this
        device's block (and under the batch split, the part being traced) is kept."""
        split = [split_over(a) for a in axes]
        parts = block_parts()
        if not any(split) and not any(a.name in parts for a in axes):
            return draw(tuple(a.size for a in axes))
        sizes, starts = [], []
        for a, over in zip(axes, split):
            part, n = parts.get(a.name, (0, 1))
            sizes.append(a.size * n * math.prod(self.mesh.shape[m] for m in over))
            block = jax.lax.axis_index(over if len(over) > 1 else over[0]) if over else 0
            starts.append((block * n + part) * a.size)
        return jax.lax.dynamic_slice(draw(tuple(sizes)), starts, tuple(a.size for a in axes))


def _owed(arrays: tuple[NamedArray, ...], out_axes: tuple[Axis, ...]) -> tuple[str, ...]:
    """The mesh axes that split some contracted axis."""
    kept = {a.name for a in out_axes}
    owed: list[str] = []
    for x in arrays:
        for a in x.axes:
            if a.name not in kept:
                owed += [m for m in split_over(a) if m not in owed]
    return tuple(owed)


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

    def __getattr__(self, name):
        if name.startswith("_"):  # protocol probes (_repr_html_, __array__, ...) just find nothing
            raise AttributeError(name)  # protocol: getattr
        raise unreduced_error(self, f"an op read .{name}")

    def __jax_array__(self):
        raise unreduced_error(self, "converting to a jax array")

    def __repr__(self) -> str:
        return f"Unreduced({block_layout(self)}, {getattr(self.value.array, 'dtype', '?')})"

    def __add__(self, other):
        if isinstance(other, Unreduced) and other.over == self.over:
            return Unreduced(self.value + other.value, self.over)
        if isinstance(other, Unreduced):
            raise UnreducedError(
                f"adding partial sums owed over different mesh axes ({self.over} and {other.over}); "
                "psum one of them first"
            )
        raise unreduced_error(self, "+ with a value that is not a partial sum (it would be counted once per device)")

    __radd__ = __add__

    def __sub__(self, other):
        return self + (-other)

    def __neg__(self):
        return Unreduced(-self.value, self.over)

    def __mul__(self, other):
        if isinstance(other, (int, float)):
            return Unreduced(self.value * other, self.over)
        raise unreduced_error(self, "* by something other than a number")

    __rmul__ = __mul__

    def __truediv__(self, other):
        if isinstance(other, (int, float)):
            return Unreduced(self.value / other, self.over)
        raise unreduced_error(self, "/ by something other than a number")

    def _no_op(self, *_, **__):
        raise unreduced_error(self, "an op")

    __matmul__ = __rmatmul__ = __rsub__ = __rtruediv__ = __pow__ = __rpow__ = _no_op
    __lt__ = __le__ = __gt__ = __ge__ = __abs__ = __getitem__ = __iter__ = __len__ = _no_op
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):  # type: ignore[override]
        raise unreduced_error(self, "==")

    def __bool__(self):
        raise unreduced_error(self, "bool()")


def unreduced_error(u: Unreduced, what: str) -> UnreducedError:
    """The error for ``what`` done to the partial sum ``u`` before it is reduced."""
    return UnreducedError(
        f"{what}: the value is an unreduced partial sum, layout {block_layout(u)!r}: each device holds "
        f"only its share of a sum over mesh axes {u.over}. Reduce it first: nm.psum(u) (every device gets "
        f"the total) or nm.psum_scatter(u, axis) (each device gets its slice of axis)."
    )


def _unreduced_flatten(u: Unreduced):
    return ((jax.tree_util.GetAttrKey("value"), u.value),), u.over


def _unreduced_unflatten(over, children):
    u = object.__new__(Unreduced)
    object.__setattr__(u, "value", children[0])
    object.__setattr__(u, "over", over)
    return u


jax.tree_util.register_pytree_with_keys(
    Unreduced, _unreduced_flatten, _unreduced_unflatten, flatten_func=lambda u: ((u.value,), u.over)
)


def is_local_leaf(x) -> bool:
    return isinstance(x, (NamedArray, Unreduced))
