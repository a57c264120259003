"""The rest of the numpy surface by name, generated from one table (``SURFACE``), plus the few
functions whose shapes need a word of their own (sized ``unique``/``nonzero``, ``searchsorted``,
``bincount``, ``repeat``, ``tile``, ``ravel``, ``trace``, ``polyval``, ``allclose``,
``array_equal``).

Every function here returns a NamedArray and takes axes by name; a data-dependent size
(``unique``, ``nonzero``) is given as an Axis, so the result's shape is static under jit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from . import _ops
from ._axis import (
    ArgumentError,
    ArgumentTypeError,
    Axis,
    AxisError,
    AxisSelection,
    AxisSelector,
    check_unique,
    format_axes,
    index_of,
    indices_of,
    name_of,
)
from ._core import NamedArray, axes_of, expect_named, unchecked
from ._shape import flatten_axes, unbind
from ._transforms import nmap

# ---- the table -------------------------------------------------------------------------
# kind -> how the row's jnp function becomes a named one:
#   elementwise  union broadcasting (docs/named_arrays.md), as nm.add
#   reduce       over names (None: all), where= a boolean mask over some of the axes, as nm.sum
#   reduce_max   as reduce; where= needs the identity for fully masked-out entries (as nm.max)
#   reduce_min
#   reduce_plain over names, no where= (jnp has none)
#   arg          one name, or None for a flat index over all axes, as nm.argmax
#   along        along one name, the shape kept, as nm.cumsum
#   fft          along one name (n=, new_axis=) or several; the row holds the 1-d and n-d
#                functions and how the transformed axis' size changes
#   shift        over names (None: all), the shape kept
_SAME = "same"  # fft size rules: output size from the input size m (or n= when given)
_HALF = "half"  # m // 2 + 1 (a real input's spectrum)
_FULL = "full"  # 2 * (m - 1) (back from a half spectrum)


def _nan_when_empty(fn: Callable) -> Callable:
    """``fn`` (a median), NaN over a zero-size axis as in numpy (jnp's gather fails on one)."""

    @functools.wraps(fn)
    def median(a, axis=None, **kwargs):
        dims = range(a.ndim) if axis is None else (axis if isinstance(axis, tuple) else (axis,))
        if any(a.shape[d] == 0 for d in dims):
            kept = tuple(n for d, n in enumerate(a.shape) if d not in dims)
            return jnp.full(kept, jnp.nan, jnp.result_type(a.dtype, jnp.float32))
        return fn(a, axis=axis, **kwargs)

    return median


SURFACE: dict[str, tuple] = {
    # bitwise and integer
    "bitwise_not": ("elementwise", jnp.bitwise_not),
    "bitwise_count": ("elementwise", jnp.bitwise_count),
    "left_shift": ("elementwise", jnp.left_shift),
    "right_shift": ("elementwise", jnp.right_shift),
    "gcd": ("elementwise", jnp.gcd),
    "lcm": ("elementwise", jnp.lcm),
    # float elementwise
    "fmax": ("elementwise", jnp.fmax),
    "fmin": ("elementwise", jnp.fmin),
    "fmod": ("elementwise", jnp.fmod),
    "copysign": ("elementwise", jnp.copysign),
    "heaviside": ("elementwise", jnp.heaviside),
    "logaddexp2": ("elementwise", jnp.logaddexp2),
    "float_power": ("elementwise", jnp.float_power),
    "signbit": ("elementwise", jnp.signbit),
    "nan_to_num": ("elementwise", jnp.nan_to_num),
    "deg2rad": ("elementwise", jnp.deg2rad),
    "rad2deg": ("elementwise", jnp.rad2deg),
    "sinc": ("elementwise", jnp.sinc),
    "angle": ("elementwise", jnp.angle),
    # numpy's other spellings, which Haliax code uses
    "absolute": ("elementwise", jnp.absolute),
    "fabs": ("elementwise", jnp.fabs),
    "positive": ("elementwise", jnp.positive),
    "rint": ("elementwise", jnp.rint),
    "degrees": ("elementwise", jnp.degrees),
    "radians": ("elementwise", jnp.radians),
    "conjugate": ("elementwise", jnp.conjugate),
    "i0": ("elementwise", jnp.i0),
    "isneginf": ("elementwise", jnp.isneginf),
    "isposinf": ("elementwise", jnp.isposinf),
    "isreal": ("elementwise", jnp.isreal),
    "iscomplex": ("elementwise", jnp.iscomplex),
    "nextafter": ("elementwise", jnp.nextafter),
    "bitwise_invert": ("elementwise", jnp.bitwise_invert),
    "bitwise_left_shift": ("elementwise", jnp.bitwise_left_shift),
    "bitwise_right_shift": ("elementwise", jnp.bitwise_right_shift),
    # reductions that skip NaN
    "nansum": ("reduce", jnp.nansum),
    "nanmean": ("reduce", jnp.nanmean),
    "nanprod": ("reduce", jnp.nanprod),
    "nanstd": ("reduce", jnp.nanstd),
    "nanvar": ("reduce", jnp.nanvar),
    "nanmax": ("reduce_max", jnp.nanmax),
    "nanmin": ("reduce_min", jnp.nanmin),
    "amax": ("reduce_max", jnp.amax),
    "amin": ("reduce_min", jnp.amin),
    "nanargmax": ("arg", jnp.nanargmax),
    "nanargmin": ("arg", jnp.nanargmin),
    "nancumsum": ("along", jnp.nancumsum),
    "nancumprod": ("along", jnp.nancumprod),
    # other reductions
    "median": ("reduce_plain", _nan_when_empty(jnp.median)),
    "nanmedian": ("reduce_plain", _nan_when_empty(jnp.nanmedian)),
    "ptp": ("reduce_plain", jnp.ptp),
    "count_nonzero": ("reduce_plain", jnp.count_nonzero),
    # Fourier transforms
    "fft": ("fft", jnp.fft.fft, jnp.fft.fftn, _SAME),
    "ifft": ("fft", jnp.fft.ifft, jnp.fft.ifftn, _SAME),
    "rfft": ("fft", jnp.fft.rfft, jnp.fft.rfftn, _HALF),
    "irfft": ("fft", jnp.fft.irfft, jnp.fft.irfftn, _FULL),
    "hfft": ("fft", jnp.fft.hfft, None, _FULL),
    "ihfft": ("fft", jnp.fft.ihfft, None, _HALF),
    "fftshift": ("shift", jnp.fft.fftshift),
    "ifftshift": ("shift", jnp.fft.ifftshift),
}


def _fft_size(rule: str, m: int, n: int | None) -> int:
    """The transformed axis' size: from the input size ``m``, or from ``n=`` when it is given."""
    if rule == _HALF:
        return (m if n is None else n) // 2 + 1
    if n is not None:
        return n
    return m if rule == _SAME else 2 * (m - 1)


def _fft(name: str, fn1: Callable, fnn: Callable | None, rule: str) -> Callable:
    def op(
        x, axis: AxisSelection, *, n: int | None = None, norm: str | None = None, new_axis: AxisSelector | None = None
    ):
        expect_named(x, f"nm.{name}")
        dims = list(indices_of(x.axes, axis, f"nm.{name}"))
        if not dims:
            raise AxisError(f"nm.{name} needs an axis name; the array has axes {format_axes(x.axes)}")
        for i in dims:  # numpy refuses a transform of no points too; jnp returns nothing or fails to lower
            if x.axes[i].size == 0:
                raise AxisError(
                    f"nm.{name} along the zero-size axis {x.axes[i].name!r} of {format_axes(x.axes)}: a "
                    "Fourier transform needs at least one point"
                )
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ArgumentError(f"nm.{name}: n={n!r} points; n must be an int >= 1")
        axes = list(x.axes)
        last = dims[-1]  # the n-dimensional real transforms halve (or restore) only the last axis they are given
        size = _fft_size(rule, x.axes[last].size, n)
        if size < 1:
            raise ArgumentError(
                f"nm.{name} of the {x.axes[last].size} point(s) along {x.axes[last].name!r} gives no "
                "points; give n= (the size of the result along it)"
            )
        try:
            if len(dims) == 1:
                out = fn1(x.array, n=n, axis=last, norm=norm)
            else:
                if fnn is None or n is not None or new_axis is not None:
                    raise ArgumentError(
                        f"nm.{name} over several axes {[x.axes[i].name for i in dims]} takes neither "
                        "n= nor new_axis=" + ("" if fnn is not None else f" (and jnp has no n-dimensional {name})")
                    )
                out = fnn(x.array, axes=dims, norm=norm)
        except (TypeError, ValueError) as e:  # a complex array into a real transform
            raise ArgumentTypeError(f"nm.{name} does not take an array of dtype {x.dtype}: {e}") from e
        new = name_of(new_axis) if new_axis is not None else x.axes[last].name
        axes[last] = Axis(new, size)
        check_unique(axes, f"nm.{name}'s result")
        return unchecked(out, tuple(axes))

    return op


def _make(name: str, row: tuple) -> Callable:
    kind, fn = row[0], row[1]
    if kind == "elementwise":
        return _ops.elementwise_op(fn, name)
    if kind in ("reduce", "reduce_max", "reduce_min"):

        def op(x, axis: AxisSelection | None = None, *, where=None, **kwargs):
            if where is not None and kind != "reduce":
                kwargs.setdefault("initial", _ops.lowest_value(x.dtype, highest=kind == "reduce_min"))
            return _ops.reduce_op(fn, x, axis, where=where, name=name, **kwargs)

        how = "over names (None: all axes), with where="
    elif kind == "reduce_plain":

        def op(x, axis: AxisSelection | None = None, **kwargs):
            return _ops.reduce_op(fn, x, axis, name=name, **kwargs)

        how = "over names (None: all axes)"
    elif kind == "arg":

        def op(x, axis: AxisSelector | None = None):
            return _ops.arg_reduce_op(fn, x, axis, name)

        how = "along one name, or None for a flat index over all axes"
    elif kind == "along":

        def op(x, axis: AxisSelector, **kwargs):
            return _ops.along_op(fn, x, axis, **kwargs)

        how = "along one name, the shape kept"
    elif kind == "fft":
        op, how = _fft(name, fn, row[2], row[3]), "along one name (n=, new_axis=) or several"
    else:

        def op(x, axis: AxisSelection | None = None):
            expect_named(x, f"nm.{name}")
            dims = tuple(range(x.ndim)) if axis is None else indices_of(x.axes, axis, f"nm.{name}")
            return unchecked(fn(x.array, axes=dims), x.axes)

        how = "over names (None: all axes), the shape kept"
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``{fn.__name__}`` of jax.numpy {how}."
    return op


globals().update({name: _make(name, row) for name, row in SURFACE.items()})


# ---- the functions with shapes of their own --------------------------------------------


def _sized(axis, what: str) -> Axis:
    if not isinstance(axis, Axis):
        raise ArgumentError(
            f"nm.{what} needs the result's size as an Axis (e.g. Axis('found', 8)) so that the shape is "
            f"static under jit; got {axis!r}"
        )
    return axis


def ravel(x: NamedArray, new_axis: AxisSelector) -> NamedArray:
    """All axes merged into ``new_axis``, row-major in the array's axis order (``flatten_axes`` of all)."""
    expect_named(x, "nm.ravel")
    if not x.axes:
        return unchecked(x.array.reshape(1), (Axis(name_of(new_axis), 1),))
    return flatten_axes(x, x.names, new_axis)


def unique(
    x: NamedArray,
    size: Axis,
    *,
    fill_value=None,
    return_index: bool = False,
    return_inverse: bool = False,
    return_counts: bool = False,
    axis: AxisSelector | None = None,
):
    """The sorted distinct values of ``x`` (all axes) along ``size``, padded with ``fill_value``
    (default: the smallest value). ``return_index``: flat indices into ``nm.ravel(x, ...)``;
    ``return_inverse``: over x's axes; ``return_counts``: along ``size``. A tuple when any is set.

    With ``axis=`` (Haliax's), the distinct slices along ``axis``: the result has x's axes with
    ``axis`` replaced by ``size``; the index and counts are along ``size``, the inverse along
    ``axis`` (which slice of the result each of x's slices is)."""
    expect_named(x, "nm.unique")
    size = _sized(size, "unique")
    if x.size == 0 and size.size and fill_value is None:
        raise ArgumentError(
            f"nm.unique of the empty array {format_axes(x.axes)} into {size!r}: every entry of the "
            "result is a fill; give fill_value="
        )
    kw = dict(
        return_index=return_index,
        return_inverse=return_inverse,
        return_counts=return_counts,
        size=size.size,
        fill_value=fill_value,
    )
    if axis is None:
        out = jnp.unique(x.array, **kw)
        value_axes, inverse_axes = (size,), x.axes
    else:
        i = index_of(x.axes, axis)
        if size.name in x.names and size.name != x.axes[i].name:
            raise AxisError(
                f"nm.unique: the result axis {size.name!r} is already another axis of {format_axes(x.axes)}"
            )
        out = jnp.unique(x.array, axis=i, **kw)
        value_axes, inverse_axes = x.axes[:i] + (size,) + x.axes[i + 1 :], (x.axes[i],)
    if not (return_index or return_inverse or return_counts):
        return unchecked(out, value_axes)
    out = list(out)
    result = [unchecked(out.pop(0), value_axes)]
    if return_index:
        result.append(unchecked(out.pop(0), (size,)))
    if return_inverse:
        result.append(unchecked(out.pop(0).reshape(tuple(a.size for a in inverse_axes)), inverse_axes))
    if return_counts:
        result.append(unchecked(out.pop(0), (size,)))
    return tuple(result)


def unique_values(x: NamedArray, size: Axis, *, axis: AxisSelector | None = None, fill_value=None) -> NamedArray:
    """``unique`` without the extras (numpy's ``unique_values``)."""
    return unique(x, size, axis=axis, fill_value=fill_value)


def unique_counts(x: NamedArray, size: Axis, *, axis: AxisSelector | None = None, fill_value=None):
    """``(values, counts)`` of ``unique``."""
    return unique(x, size, axis=axis, fill_value=fill_value, return_counts=True)


def unique_inverse(x: NamedArray, size: Axis, *, axis: AxisSelector | None = None, fill_value=None):
    """``(values, inverse)`` of ``unique``."""
    return unique(x, size, axis=axis, fill_value=fill_value, return_inverse=True)


def unique_all(x: NamedArray, size: Axis, *, axis: AxisSelector | None = None, fill_value=None):
    """``(values, index, inverse, counts)`` of ``unique``."""
    return unique(x, size, axis=axis, fill_value=fill_value, return_index=True, return_inverse=True, return_counts=True)


def nonzero(x: NamedArray, size: Axis, *, fill_value=None) -> dict[str, NamedArray]:
    """The indices of the first ``size.size`` nonzero entries (row-major), one NamedArray along
    ``size`` per axis of ``x``, keyed by axis name: ``x[nm.nonzero(x, Found)]`` gathers them.
    Missing entries get ``fill_value`` (default 0)."""
    expect_named(x, "nm.nonzero")
    size = _sized(size, "nonzero")
    if size.name in x.names:
        raise AxisError(f"nm.nonzero: the result axis {size.name!r} is already an axis of {format_axes(x.axes)}")
    idx = jnp.nonzero(x.array, size=size.size, fill_value=fill_value)
    return {a.name: unchecked(i, (size,)) for a, i in zip(x.axes, idx)}


def searchsorted(
    sorted_x: NamedArray,
    values,
    axis: AxisSelector | None = None,
    *,
    side: str = "left",
    sorter=None,
    method: str = "scan",
) -> NamedArray:
    """Where ``values`` would go along ``axis`` of ``sorted_x`` to keep it sorted. Other axes of
    ``sorted_x`` are batch axes, matched with ``values``' by name. ``sorter`` (numpy's) holds the
    indices that sort an unsorted ``sorted_x`` along ``axis``: a NamedArray with its axes (or a
    plain 1-d array when it has one axis), e.g. ``nm.argsort(x, axis)``."""
    expect_named(sorted_x, "nm.searchsorted", "the array to search")
    if axis is None:
        if sorted_x.ndim != 1:
            raise AxisError(f"nm.searchsorted needs axis= to search along one of {format_axes(sorted_x.axes)}")
        axis = sorted_x.axes[0].name
    a = sorted_x.axes[index_of(sorted_x.axes, axis)].name
    if not isinstance(values, NamedArray):
        axes_of(values)  # a positional array with dimensions is refused with the usual message
        values = NamedArray(jnp.asarray(values), ())
    if a in values.names:
        raise AxisError(
            f"nm.searchsorted: the values {format_axes(values.axes)} have the searched axis {a!r}; rename it"
        )
    if sorter is None:
        return nmap(functools.partial(jnp.searchsorted, side=side, method=method), consume=a, produce=())(
            sorted_x, values
        )
    if not isinstance(sorter, NamedArray):
        if sorted_x.ndim != 1:
            raise AxisError(
                f"nm.searchsorted: a plain sorter fits a 1-d array; give one over {format_axes(sorted_x.axes)} "
                "as a NamedArray (nm.argsort(x, axis))"
            )
        sorter = NamedArray(jnp.asarray(sorter), sorted_x.axes)
    if set(sorter.axes) != set(sorted_x.axes) or not jnp.issubdtype(sorter.dtype, jnp.integer):
        raise AxisError(
            f"nm.searchsorted: sorter {format_axes(sorter.axes)} ({sorter.dtype}) must be integer indices with "
            f"the axes of the searched array {format_axes(sorted_x.axes)}"
        )

    def search(s, v, order):
        return jnp.searchsorted(s, v, side=side, sorter=order, method=method)

    return nmap(search, consume=a, produce=())(sorted_x, values, sorter)


def bincount(
    x: NamedArray, length: Axis, *, weights: NamedArray | None = None, axis: AxisSelection | None = None
) -> NamedArray:
    """How often each value ``0 .. length.size - 1`` occurs in ``x`` over ``axis`` (default: all
    axes), per entry of the other axes, along the new axis ``length``; values outside are
    dropped. ``weights`` (x's axes) sums weights instead of counting."""
    expect_named(x, "nm.bincount")
    length = _sized(length, "bincount")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ArgumentTypeError(f"nm.bincount counts integers, got dtype {x.dtype} {format_axes(x.axes)}")
    counted = x.names if axis is None else tuple(x.axes[i].name for i in indices_of(x.axes, axis, "nm.bincount"))
    if weights is not None and set(axes_of(weights)) != set(x.axes):
        raise AxisError(
            f"nm.bincount: weights {format_axes(axes_of(weights))} must have the axes of x {format_axes(x.axes)}"
        )

    def count(v, w):
        v = v.reshape(-1)
        # jnp.bincount would count a negative value as 0 (numpy refuses it): weigh values outside by 0
        inside = (v >= 0) & (v < length.size)
        w = inside.astype(jnp.int32) if w is None else jnp.where(inside, w.reshape(-1), 0)
        return jnp.bincount(jnp.where(inside, v, 0), w, length=length.size).astype(
            jnp.int32 if weights is None else w.dtype
        )

    return nmap(count, consume=counted, produce=length.name)(x, weights)


def repeat(x: NamedArray, repeats, axis: AxisSelector, total_repeat_length: int | None = None) -> NamedArray:
    """Each entry repeated along ``axis``: ``repeats`` times (an int), or ``repeats[i]`` times for
    entry ``i`` (a 1-d array, or a NamedArray along ``axis``). The new size must be known before
    tracing: the sum of concrete counts, or ``total_repeat_length`` (numpy's; traced counts need
    it, and it pads with the last entry or truncates)."""
    expect_named(x, "nm.repeat")
    i = index_of(x.axes, axis)
    a = x.axes[i]
    if isinstance(repeats, NamedArray):
        if repeats.names not in ((), (a.name,)):
            raise AxisError(f"nm.repeat: per-entry repeats {format_axes(repeats.axes)} must be along {a.name!r} only")
        repeats = repeats.array
    if isinstance(repeats, bool) or not (
        isinstance(repeats, int) or hasattr(repeats, "shape") or isinstance(repeats, (list, tuple))
    ):
        raise ArgumentError(
            f"nm.repeat: repeats must be an int >= 0 or one count per entry of {a.name!r}, got {repeats!r}"
        )
    if isinstance(repeats, int):
        if repeats < 0:
            raise ArgumentError(f"nm.repeat: repeats must be an int >= 0, got {repeats!r}")
        n = a.size * repeats
    else:
        repeats = jnp.asarray(repeats)
        if repeats.ndim == 1 and repeats.shape[0] != a.size:
            raise AxisError(f"nm.repeat: {repeats.shape[0]} counts for axis {a.name!r} of size {a.size}")
        if repeats.ndim > 1 or not jnp.issubdtype(repeats.dtype, jnp.integer):
            raise ArgumentError(
                f"nm.repeat: per-entry repeats must be a 1-d integer array, got shape {repeats.shape} {repeats.dtype}"
            )
        known = _concrete(repeats)
        if known is not None and (known < 0).any():
            raise ArgumentError(f"nm.repeat: repeats must be >= 0, got {known.tolist()}")
        if total_repeat_length is None:
            if known is None:
                raise ArgumentError(
                    "nm.repeat: traced per-entry repeats need total_repeat_length= (the result's size "
                    "must be known before tracing)"
                )
            n = int(known.sum()) if known.ndim else a.size * int(known)
        else:
            n = total_repeat_length
    if total_repeat_length is not None:
        n = total_repeat_length
    out = jnp.repeat(x.array, repeats, axis=i, total_repeat_length=n)
    return unchecked(out, x.axes[:i] + (a.resize(n),) + x.axes[i + 1 :])


def _concrete(value):
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def tile(x: NamedArray, reps: Mapping[AxisSelector, int]) -> NamedArray:
    """The whole array repeated along named axes: ``nm.tile(x, {"position": 3})``. A name ``x``
    lacks is a new axis of that size, put in front (Haliax's and numpy's rule)."""
    expect_named(x, "nm.tile")
    counts = [1] * x.ndim
    new: list[Axis] = []
    for a, r in reps.items():
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ArgumentError(f"nm.tile: the repeat count for {name_of(a)!r} must be an int >= 0, got {r!r}")
        if name_of(a) in x.names:
            counts[index_of(x.axes, a)] = r
        else:
            new.append(Axis(name_of(a), r))
    axes = tuple(new) + tuple(a.resize(a.size * r) for a, r in zip(x.axes, counts))
    return unchecked(jnp.tile(x.array, [a.size for a in new] + counts), axes)


def packbits(x: NamedArray, axis: AxisSelector, *, bitorder: str = "big") -> NamedArray:
    """``jnp.packbits`` along ``axis``: eight booleans (or 0/1 integers) per uint8, so the axis
    shrinks to ``ceil(size / 8)`` (zero-padded at the end)."""
    expect_named(x, "nm.packbits")
    if not (jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.bool_)):
        raise ArgumentTypeError(
            f"nm.packbits packs booleans (or 0/1 integers), got dtype {x.dtype}; compare first (x > 0)"
        )
    i = index_of(x.axes, axis)
    a = x.axes[i]
    return unchecked(
        jnp.packbits(x.array, axis=i, bitorder=bitorder), x.axes[:i] + (a.resize((a.size + 7) // 8),) + x.axes[i + 1 :]
    )


def unpackbits(x: NamedArray, axis: AxisSelector, *, count: int | None = None, bitorder: str = "big") -> NamedArray:
    """``jnp.unpackbits`` along ``axis`` of a uint8 array: the axis grows eightfold, or to ``count``
    bits (numpy's: more pads with zeros, a negative count drops that many from the end)."""
    expect_named(x, "nm.unpackbits")
    if x.dtype != jnp.uint8:
        raise ArgumentTypeError(f"nm.unpackbits unpacks uint8 bytes (nm.packbits' result), got dtype {x.dtype}")
    i = index_of(x.axes, axis)
    a = x.axes[i]
    n = a.size * 8 if count is None else count if count >= 0 else max(a.size * 8 + count, 0)
    return unchecked(
        jnp.unpackbits(x.array, axis=i, count=count, bitorder=bitorder), x.axes[:i] + (a.resize(n),) + x.axes[i + 1 :]
    )


def trace(x: NamedArray, axis1: AxisSelector, axis2: AxisSelector, *, offset: int = 0, dtype=None) -> NamedArray:
    """The sum of the (``offset``) diagonal of ``axis1`` x ``axis2``; both axes are dropped."""
    expect_named(x, "nm.trace")
    i, j = index_of(x.axes, axis1), index_of(x.axes, axis2)
    if i == j:
        raise AxisError(f"nm.trace needs two different axes, got {x.axes[i].name!r} twice")
    rest = tuple(a for k, a in enumerate(x.axes) if k not in (i, j))
    return unchecked(jnp.trace(x.array, offset=offset, axis1=i, axis2=j, dtype=dtype), rest)


def polyval(coeffs, x, axis: AxisSelector | None = None) -> NamedArray:
    """The polynomial with ``coeffs`` (highest degree first, as ``np.polyval``) at ``x``.

    ``coeffs`` is a sequence of numbers, or a NamedArray whose ``axis`` holds the coefficients
    (its only axis when it has one) and whose other axes broadcast with ``x``'s by name (one
    polynomial per entry). The rest of the polynomial family is in ``named._poly``."""
    if isinstance(coeffs, NamedArray):
        if axis is None and coeffs.ndim == 1:
            axis = coeffs.axes[0]  # one axis: it holds the coefficients (nm.polyfit's result, Haliax's form)
        if axis is None:
            raise AxisError(f"nm.polyval needs axis= to say which of {format_axes(coeffs.axes)} holds the coefficients")
        terms = unbind(coeffs, axis)
    else:
        terms = list(coeffs)
    # Horner from zeros, as np.polyval does (so that inf and nan inputs give what numpy gives)
    acc = unchecked(jnp.zeros_like(x.array), x.axes) if isinstance(x, NamedArray) else NamedArray(jnp.zeros_like(x), ())
    for c in terms:
        acc = acc * x + c
    return acc


def _both_positional(a, b) -> bool:
    """Neither is a NamedArray: the predicate is numpy's, on positional arrays (as Haliax allows)."""
    return not isinstance(a, NamedArray) and not isinstance(b, NamedArray)


def allclose(a, b, *, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> NamedArray:
    """Whether all entries are close, with ``a`` and ``b`` broadcast by name (a 0-d bool NamedArray).
    Two plain arrays are compared positionally, as ``jnp.allclose`` does."""
    if _both_positional(a, b):
        return NamedArray(jnp.allclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan), ())
    return _ops.isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan).all()


def array_equal(a, b, *, equal_nan: bool = False) -> NamedArray:
    """Whether ``a`` and ``b`` have the same axes (names and sizes, in any order) and entries.
    Two plain arrays are compared positionally, as ``jnp.array_equal`` does."""
    if _both_positional(a, b):
        return NamedArray(jnp.array_equal(a, b, equal_nan=equal_nan), ())
    aa, ba = axes_of(a), axes_of(b)
    if set(aa) != set(ba):
        return NamedArray(jnp.asarray(False), ())
    eq = _ops.equal(a, b)
    if equal_nan:
        eq = _ops.logical_or(eq, _ops.logical_and(_ops.isnan(a), _ops.isnan(b)))
    return eq.all()


def array_equiv(a, b) -> NamedArray:
    """Whether one of ``a`` and ``b`` broadcasts to the other by name and they are then equal
    (``np.array_equiv`` by name, and Haliax's): False, not an error, when a shared name has two
    sizes or each has an axis the other lacks (neither broadcasts to the other). Two plain arrays:
    ``jnp.array_equiv``."""
    if _both_positional(a, b):
        return NamedArray(jnp.array_equiv(a, b), ())
    a_names, b_names = {x.name for x in axes_of(a)}, {x.name for x in axes_of(b)}  # a plain array is refused
    if not (a_names <= b_names or b_names <= a_names):
        return NamedArray(jnp.asarray(False), ())
    try:
        eq = _ops.equal(a, b)
    except AxisError:
        return NamedArray(jnp.asarray(False), ())
    return eq.all()


def fftfreq(axis: Axis, d: float = 1.0, *, rfft: bool = False, new_axis: AxisSelector | None = None) -> NamedArray:
    """The sample frequencies of ``nm.fft`` (``rfft=True``: of ``nm.rfft``) along ``axis``; the result
    is along ``new_axis`` (default: the axis' own name) with the transform's size."""
    if not isinstance(axis, Axis):
        raise AxisError(f"nm.fftfreq needs an Axis with a size, got {axis!r}")
    if axis.size == 0:  # as nm.fft refuses a transform of no points (numpy divides by zero)
        raise AxisError(f"nm.fftfreq of the zero-size axis {axis.name!r}: a Fourier transform needs at least one point")
    out = (jnp.fft.rfftfreq if rfft else jnp.fft.fftfreq)(axis.size, d)
    return unchecked(out, (Axis(name_of(new_axis) if new_axis is not None else axis.name, out.shape[0]),))


__all__ = [
    *SURFACE,
    "ravel",
    "unique",
    "unique_values",
    "unique_counts",
    "unique_inverse",
    "unique_all",
    "nonzero",
    "searchsorted",
    "bincount",
    "repeat",
    "tile",
    "packbits",
    "unpackbits",
    "trace",
    "polyval",
    "allclose",
    "array_equal",
    "array_equiv",
    "fftfreq",
]
