"""NamedArray: one jax.Array plus a tuple of Axis, registered as a pytree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._axis import (
    ArgumentTypeError,
    Axis,
    AxisError,
    AxisSelection,
    AxisSelector,
    as_selectors,
    check_unique,
    format_axes,
    index_of,
    name_of,
    resolve,
)


def _is_concrete_shape(array: Any) -> bool:
    return hasattr(array, "shape") and hasattr(array, "dtype")


class NamedArray:
    """An array whose dimensions are addressed by name.

    The array is the only pytree child; the axes are static aux data, so a NamedArray
    goes through ``jax.jit``, ``jax.grad``, ``eqx.filter_jit`` and ``jax.tree.map`` like
    a plain array, and two NamedArrays with different axes never share a compiled trace.
    """

    __slots__ = ("array", "axes")
    __array_priority__ = 1000  # so ndarray.__add__ defers to us
    array: jax.Array
    axes: tuple[Axis, ...]

    def __init__(self, array: Any, axes: Sequence[Axis]):
        axes = tuple(axes)
        for a in axes:
            if not isinstance(a, Axis):
                raise AxisError(f"NamedArray axes must be Axis objects, got {a!r}; use nm.named(array, names)")
        check_unique(axes)
        if _is_concrete_shape(array):
            shape = tuple(array.shape)
            if shape != tuple(a.size for a in axes):
                raise AxisError(f"array of shape {shape} does not match axes {format_axes(axes)}")
        object.__setattr__(self, "array", array)
        object.__setattr__(self, "axes", axes)

    def __setattr__(self, name, value):
        raise AttributeError("NamedArray is immutable; use x.at[...] for functional updates")  # protocol: setattr

    # ---- metadata -------------------------------------------------------------------
    @property
    def shape(self) -> dict[str, int]:
        """``{name: size}`` in axis order."""
        return {a.name: a.size for a in self.axes}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    @property
    def dtype(self):
        return self.array.dtype

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def size(self) -> int:
        return int(np.prod([a.size for a in self.axes], dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def has_axis(self, axis: AxisSelection) -> bool:
        names = set(self.names)
        return all(name_of(a) in names for a in as_selectors(axis))

    def axis_size(self, axis: AxisSelector) -> int:
        return resolve(self.axes, axis).size

    def resolve_axis(self, axis: AxisSelection) -> Axis | tuple[Axis, ...]:
        """The Axis objects for names; one Axis for one selector, a tuple for several."""
        if isinstance(axis, (Axis,)) or (isinstance(axis, str) and " " not in axis.strip()):
            return resolve(self.axes, axis)
        return tuple(resolve(self.axes, a) for a in as_selectors(axis))

    def index_of(self, axis: AxisSelector) -> int:
        """Where ``axis`` sits among this array's axes (0-based). Not ``nm.axis_index``, which is a
        device's index along a mesh axis inside ``nm.shard_map``."""
        return index_of(self.axes, axis)

    def axis_indices(self, axis: AxisSelection) -> int | None | tuple[int | None, ...]:
        """Haliax's lookup: the index of one axis, or a tuple of them for several, None where
        the array lacks the name. An Axis whose name is here at another size is an AxisError."""
        if isinstance(axis, Axis) or (isinstance(axis, str) and " " not in axis.strip()):
            name = name_of(axis)
            if name not in self.names:
                return None
            i = self.names.index(name)
            if isinstance(axis, Axis) and self.axes[i].size != axis.size:
                raise AxisError(
                    f"axis_indices: {axis} is here as {self.axes[i]} (another size) in {format_axes(self.axes)}"
                )
            return i
        return tuple(self.axis_indices(a) for a in as_selectors(axis))

    def item(self):
        """The Python value of a one-element array."""
        return self.array.item()

    def scalar(self) -> jax.Array:
        """The 0-d jax array of a NamedArray with no axes (e.g. a loss to differentiate)."""
        if self.axes:
            raise AxisError(
                f"scalar() needs an array with no axes, this one has {format_axes(self.axes)}; reduce it "
                "first (x.sum(), x.mean(...))"
            )
        return self.array

    def __repr__(self) -> str:
        dtype = getattr(self.array, "dtype", None)
        head = f"{dtype}[{' '.join(f'{a.name}={a.size}' for a in self.axes)}]"
        return f"NamedArray({head}, {self.array!r})" if _is_concrete_shape(self.array) else f"NamedArray({head})"

    def __bool__(self) -> bool:
        return bool(self.array)

    def __len__(self) -> int:
        raise ArgumentTypeError(
            "len() is positional and NamedArray has no first axis; use x.shape[name] or x.axis_size(name)"
        )

    def __iter__(self):
        raise ArgumentTypeError("iteration is positional; use nm.unbind(x, axis) to split along a named axis")

    # ---- conversions ---------------------------------------------------------------
    def astype(self, dtype) -> NamedArray:
        return unchecked(self.array.astype(dtype), self.axes)

    def rename(self, mapping: dict[AxisSelector, AxisSelector]) -> NamedArray:
        return _shape.rename(self, mapping)

    def rearrange(self, axes, **sizes) -> NamedArray:
        return _shape.rearrange(self, axes, **sizes)

    def broadcast_axis(self, axes) -> NamedArray:
        return _shape.broadcast_axis(self, axes)

    def broadcast_to(self, axes, **kwargs) -> NamedArray:
        return _shape.broadcast_to(self, axes, **kwargs)

    def flatten_axes(self, axes, new_axis) -> NamedArray:
        return _shape.flatten_axes(self, axes, new_axis)

    def unflatten_axis(self, axis, new_axes) -> NamedArray:
        return _shape.unflatten_axis(self, axis, new_axes)

    def take(self, axis, index) -> NamedArray:
        return _index.take(self, axis, index)

    def __getitem__(self, idx) -> NamedArray:
        return _index.getitem(self, idx)

    @property
    def at(self):
        return _index.AtIndexer(self)

    # ---- reductions (one-line delegates) ------------------------------------------
    def sum(self, axis=None, *, where=None, dtype=None):
        return _ops.sum(self, axis, where=where, dtype=dtype)

    def mean(self, axis=None, *, where=None, dtype=None):
        return _ops.mean(self, axis, where=where, dtype=dtype)

    def max(self, axis=None, *, where=None):
        return _ops.max(self, axis, where=where)

    def min(self, axis=None, *, where=None):
        return _ops.min(self, axis, where=where)

    def prod(self, axis=None, *, where=None, dtype=None):
        return _ops.prod(self, axis, where=where, dtype=dtype)

    def std(self, axis=None, *, where=None, ddof=0):
        return _ops.std(self, axis, where=where, ddof=ddof)

    def var(self, axis=None, *, where=None, ddof=0):
        return _ops.var(self, axis, where=where, ddof=ddof)

    def any(self, axis=None, *, where=None):
        return _ops.any(self, axis, where=where)

    def all(self, axis=None, *, where=None):
        return _ops.all(self, axis, where=where)

    def argmax(self, axis):
        return _ops.argmax(self, axis)

    def argmin(self, axis):
        return _ops.argmin(self, axis)

    def logsumexp(self, axis=None, *, where=None):
        return _ops.logsumexp(self, axis, where=where)

    def dot(self, *others, axis):
        return _einsum.dot(self, *others, axis=axis)

    # ---- arithmetic ----------------------------------------------------------------
    def __add__(self, o):
        return _ops.add(self, o)

    def __radd__(self, o):
        return _ops.add(o, self)

    def __sub__(self, o):
        return _ops.subtract(self, o)

    def __rsub__(self, o):
        return _ops.subtract(o, self)

    def __mul__(self, o):
        return _ops.multiply(self, o)

    def __rmul__(self, o):
        return _ops.multiply(o, self)

    def __truediv__(self, o):
        return _ops.divide(self, o)

    def __rtruediv__(self, o):
        return _ops.divide(o, self)

    def __floordiv__(self, o):
        return _ops.floor_divide(self, o)

    def __rfloordiv__(self, o):
        return _ops.floor_divide(o, self)

    def __mod__(self, o):
        return _ops.mod(self, o)

    def __rmod__(self, o):
        return _ops.mod(o, self)

    def __pow__(self, o):
        return _ops.power(self, o)

    def __rpow__(self, o):
        return _ops.power(o, self)

    def __matmul__(self, o):
        raise ArgumentTypeError("@ is positional; use nm.dot(a, b, axis=name) or nm.einsum")

    def __neg__(self):
        return _ops.negative(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _ops.abs(self)

    def __invert__(self):
        return _ops.invert(self)

    def __and__(self, o):
        return _ops.bitwise_and(self, o)

    def __rand__(self, o):
        return _ops.bitwise_and(o, self)

    def __or__(self, o):
        return _ops.bitwise_or(self, o)

    def __ror__(self, o):
        return _ops.bitwise_or(o, self)

    def __xor__(self, o):
        return _ops.bitwise_xor(self, o)

    def __rxor__(self, o):
        return _ops.bitwise_xor(o, self)

    def __lt__(self, o):
        return _ops.less(self, o)

    def __le__(self, o):
        return _ops.less_equal(self, o)

    def __gt__(self, o):
        return _ops.greater(self, o)

    def __ge__(self, o):
        return _ops.greater_equal(self, o)

    def __eq__(self, o):  # type: ignore[override]
        return _ops.equal(self, o)

    def __ne__(self, o):  # type: ignore[override]
        return _ops.not_equal(self, o)

    __hash__ = None  # type: ignore[assignment]


def unchecked(array: Any, axes: tuple[Axis, ...]) -> NamedArray:
    """A NamedArray of ``array`` and ``axes`` (a tuple of Axis) without the constructor's checks:
    for the library's own results, whose axes are right by construction, and for pytree unflatten
    and transforms, which put placeholders (None, object(), tracers of another rank) where the
    array goes."""
    x = object.__new__(NamedArray)
    object.__setattr__(x, "array", array)
    object.__setattr__(x, "axes", axes)
    return x


def _flatten_with_keys(x: NamedArray):
    return ((jax.tree_util.GetAttrKey("array"), x.array),), x.axes


def _unflatten(axes, children):
    return unchecked(children[0], axes)


jax.tree_util.register_pytree_with_keys(
    NamedArray, _flatten_with_keys, _unflatten, flatten_func=lambda x: ((x.array,), x.axes)
)


def is_named_array(x: Any) -> bool:
    return isinstance(x, NamedArray)


def named(array: Any, axes: AxisSelection) -> NamedArray:
    """Wrap a positional array: ``nm.named(a, ("batch", "embed"))`` or ``nm.named(a, "batch embed")``.

    Names take their sizes from ``array``; an Axis must agree with the array's size.
    """
    if isinstance(array, NamedArray):
        raise AxisError(f"nm.named got a NamedArray with axes {format_axes(array.axes)}; use rename or rearrange")
    if not _is_concrete_shape(array):
        array = jnp.asarray(array)
    sels = as_selectors(axes)
    if len(sels) != array.ndim:
        raise AxisError(
            f"array of shape {tuple(array.shape)} has {array.ndim} dimensions but {len(sels)} axes were given: {sels}"
        )
    out = []
    for sel, n in zip(sels, array.shape):
        if isinstance(sel, Axis):
            if sel.size != n:
                raise AxisError(
                    f"axis {sel.name!r} has size {sel.size} but the array's dimension is {n} (shape "
                    f"{tuple(array.shape)})"
                )
            out.append(sel)
        elif sel is Ellipsis:
            raise AxisError("nm.named does not take '...'; name every dimension")
        else:
            out.append(Axis(sel, int(n)))
    return NamedArray(array, tuple(out))


_WRAP = "wrap it with nm.named(array, axes) so its dimensions have names"


def expect_named(x: Any, what: str, arg: str | None = None, hint: str = "") -> NamedArray:
    """``x``, which ``what`` (a layer, an op) takes as a NamedArray (as its argument ``arg``).
    Anything else, a plain ``jax.Array`` most often, gets the one message every entry of the
    library gives for it, the same as an elementwise op's: wrap it with ``nm.named``."""
    if isinstance(x, NamedArray):
        return x
    got = f"a positional array of shape {tuple(x.shape)}; {_WRAP}" if _is_concrete_shape(x) else type(x).__name__
    raise ArgumentTypeError(f"{what} takes a NamedArray{f' as {arg}' if arg else ''}, got {got}{hint}")


def axes_of(x: Any) -> tuple[Axis, ...]:
    """Axes of a NamedArray; () for Python numbers and 0-d arrays; an error for positional arrays."""
    if isinstance(x, NamedArray):
        return x.axes
    if isinstance(x, (int, float, complex, bool, np.number, np.bool_)):
        return ()
    if _is_concrete_shape(x):
        if len(x.shape) == 0:
            return ()
        raise AxisError(f"a positional array of shape {tuple(x.shape)} was mixed with NamedArrays; {_WRAP}")
    raise ArgumentTypeError(f"expected a NamedArray or a scalar, got {type(x).__name__}")


def raw(x: Any, axes: Sequence[Axis]) -> Any:
    """The positional array of ``x`` laid out (broadcastably) for ``axes``, which hold x's axes."""
    if not isinstance(x, NamedArray):
        return x
    if x.axes == tuple(axes):
        return x.array
    pos = {a.name: i for i, a in enumerate(axes)}
    order = sorted(range(x.ndim), key=lambda i: pos[x.axes[i].name])
    arr = jnp.transpose(x.array, order) if order != list(range(x.ndim)) else x.array
    mine = {a.name for a in x.axes}
    shape = tuple(a.size if a.name in mine else 1 for a in axes)
    return arr.reshape(shape) if arr.shape != shape else arr


from . import _einsum, _index, _ops, _shape  # noqa: E402  (methods delegate to these)
