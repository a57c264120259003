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

import jax.numpy as jnp

from . import _ops
from ._axis import (
    ArgumentError,
    Axis,
    AxisError,
    AxisSelection,
    AxisSelector,
    as_selectors,
    check_unique,
    format_axes,
    index_of,
    name_of,
)
from ._core import NamedArray, axes_of, expect_named
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
    # reductions that skip NaN
    "nansum": ("reduce", jnp.nansum),
    "nanmean": ("reduce", jnp.nanmean),
    "nanprod": ("reduce", jnp.nanprod),
    "nanstd": ("reduce", jnp.nanstd),
    "nanvar": ("reduce", jnp.nanvar),
    "nanmax": ("reduce_max", jnp.nanmax),
    "nanmin": ("reduce_min", jnp.nanmin),
    "nanargmax": ("arg", jnp.nanargmax),
    "nanargmin": ("arg", jnp.nanargmin),
    "nancumsum": ("along", jnp.nancumsum),
    "nancumprod": ("along", jnp.nancumprod),
    # other reductions
    "median": ("reduce_plain", jnp.median),
    "nanmedian": ("reduce_plain", jnp.nanmedian),
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
    def op(x, axis: AxisSelection, *, n: int | None = None, norm: str | None = None, new_axis: AxisSelector | None = None):
        expect_named(x, f"nm.{name}")
        dims = [index_of(x.axes, s) for s in as_selectors(axis)]
        if not dims:
            raise AxisError(f"nm.{name} needs an axis name; the array has axes {format_axes(x.axes)}")
        axes = list(x.axes)
        if len(dims) == 1:
            (i,) = dims
            out = fn1(x.array, n=n, axis=i, norm=norm)
            axes[i] = Axis(name_of(new_axis) if new_axis is not None else x.axes[i].name, _fft_size(rule, x.axes[i].size, n))
        else:
            if fnn is None or n is not None or new_axis is not None:
                raise ArgumentError(f"nm.{name} over several axes {[x.axes[i].name for i in dims]} takes neither n= nor new_axis="
                                    + ("" if fnn is not None else f" (and jnp has no n-dimensional {name})"))
            out = fnn(x.array, axes=dims, norm=norm)
            # the n-dimensional real transforms halve (or restore) only the last axis they are given
            axes[dims[-1]] = x.axes[dims[-1]].resize(_fft_size(rule, x.axes[dims[-1]].size, None))
        check_unique(axes, f"nm.{name}'s result")
        return NamedArray._unchecked(out, tuple(axes))

    return op


def _make(name: str, row: tuple) -> Callable:
    kind, fn = row[0], row[1]
    if kind == "elementwise":
        return _ops._wrap(fn, name)
    if kind in ("reduce", "reduce_max", "reduce_min"):
        def op(x, axis: AxisSelection | None = None, *, where=None, **kwargs):
            if where is not None and kind != "reduce":
                kwargs.setdefault("initial", _ops._lowest(x.dtype, highest=kind == "reduce_min"))
            return _ops._reduce(fn, x, axis, where=where, **kwargs)

        how = "over names (None: all axes), with where="
    elif kind == "reduce_plain":
        def op(x, axis: AxisSelection | None = None, **kwargs):
            return _ops._reduce(fn, x, axis, **kwargs)

        how = "over names (None: all axes)"
    elif kind == "arg":
        def op(x, axis: AxisSelector | None = None):
            return _ops._arg_reduce(fn, x, axis)

        how = "along one name, or None for a flat index over all axes"
    elif kind == "along":
        def op(x, axis: AxisSelector, **kwargs):
            return _ops._along(fn, x, axis, **kwargs)

        how = "along one name, the shape kept"
    elif kind == "fft":
        op, how = _fft(name, fn, row[2], row[3]), "along one name (n=, new_axis=) or several"
    else:
        def op(x, axis: AxisSelection | None = None):
            dims = tuple(range(x.ndim)) if axis is None else tuple(index_of(x.axes, a) for a in as_selectors(axis))
            return NamedArray._unchecked(fn(x.array, axes=dims), x.axes)

        how = "over names (None: all axes), the shape kept"
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"``{fn.__name__}`` of jax.numpy {how}."
    return op


globals().update({name: _make(name, row) for name, row in SURFACE.items()})


# ---- the functions with shapes of their own --------------------------------------------


def _sized(axis, what: str) -> Axis:
    if not isinstance(axis, Axis):
        raise ArgumentError(f"nm.{what} needs the result's size as an Axis (e.g. Axis('found', 8)) so that the shape is "
                            f"static under jit; got {axis!r}")
    return axis


def ravel(x: NamedArray, new_axis: AxisSelector) -> NamedArray:
    """All axes merged into ``new_axis``, row-major in the array's axis order (``flatten_axes`` of all)."""
    if not x.axes:
        return NamedArray._unchecked(x.array.reshape(1), (Axis(name_of(new_axis), 1),))
    return flatten_axes(x, x.names, new_axis)


def unique(x: NamedArray, size: Axis, *, fill_value=None, return_index: bool = False, return_inverse: bool = False,
           return_counts: bool = False):
    """The sorted distinct values of ``x`` (all axes) along ``size``, padded with ``fill_value``
    (default: the smallest value). ``return_index``: flat indices into ``nm.ravel(x, ...)``;
    ``return_inverse``: over x's axes; ``return_counts``: along ``size``. A tuple when any is set."""
    size = _sized(size, "unique")
    out = jnp.unique(x.array, return_index=return_index, return_inverse=return_inverse, return_counts=return_counts,
                     size=size.size, fill_value=fill_value)
    if not (return_index or return_inverse or return_counts):
        return NamedArray._unchecked(out, (size,))
    out = list(out)
    result = [NamedArray._unchecked(out.pop(0), (size,))]
    if return_index:
        result.append(NamedArray._unchecked(out.pop(0), (size,)))
    if return_inverse:
        result.append(NamedArray._unchecked(out.pop(0).reshape(x.array.shape), x.axes))
    if return_counts:
        result.append(NamedArray._unchecked(out.pop(0), (size,)))
    return tuple(result)


def nonzero(x: NamedArray, size: Axis, *, fill_value=None) -> dict[str, NamedArray]:
    """The indices of the first ``size.size`` nonzero entries (row-major), one NamedArray along
    ``size`` per axis of ``x``, keyed by axis name: ``x[nm.nonzero(x, Found)]`` gathers them.
    Missing entries get ``fill_value`` (default 0)."""
    size = _sized(size, "nonzero")
    if size.name in x.names:
        raise AxisError(f"nm.nonzero: the result axis {size.name!r} is already an axis of {format_axes(x.axes)}")
    idx = jnp.nonzero(x.array, size=size.size, fill_value=fill_value)
    return {a.name: NamedArray._unchecked(i, (size,)) for a, i in zip(x.axes, idx)}


def searchsorted(sorted_x: NamedArray, values, axis: AxisSelector | None = None, *, side: str = "left", method: str = "scan") -> NamedArray:
    """Where ``values`` would go along ``axis`` of ``sorted_x`` to keep it sorted. Other axes of
    ``sorted_x`` are batch axes, matched with ``values``' by name."""
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
        raise AxisError(f"nm.searchsorted: the values {format_axes(values.axes)} have the searched axis {a!r}; rename it")
    return nmap(functools.partial(jnp.searchsorted, side=side, method=method), consume=a, produce=())(sorted_x, values)


def bincount(x: NamedArray, length: Axis, *, weights: NamedArray | None = None, axis: AxisSelection | None = None) -> NamedArray:
    """How often each value ``0 .. length.size - 1`` occurs in ``x`` over ``axis`` (default: all
    axes), per entry of the other axes, along the new axis ``length``; values outside are
    dropped. ``weights`` (x's axes) sums weights instead of counting."""
    length = _sized(length, "bincount")
    counted = x.names if axis is None else tuple(name_of(a) for a in as_selectors(axis))
    for a in counted:
        index_of(x.axes, a)
    if weights is not None and set(axes_of(weights)) != set(x.axes):
        raise AxisError(f"nm.bincount: weights {format_axes(axes_of(weights))} must have the axes of x {format_axes(x.axes)}")

    def count(v, w):
        return jnp.bincount(v.reshape(-1), None if w is None else w.reshape(-1), length=length.size)

    return nmap(count, consume=counted, produce=length.name)(x, weights)


def repeat(x: NamedArray, repeats: int, axis: AxisSelector) -> NamedArray:
    """Each entry repeated ``repeats`` times along ``axis`` (which grows by that factor)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ArgumentError(f"nm.repeat: repeats must be an int >= 0, got {repeats!r}")
    i = index_of(x.axes, axis)
    new = x.axes[i].resize(x.axes[i].size * repeats)
    return NamedArray._unchecked(jnp.repeat(x.array, repeats, axis=i), x.axes[:i] + (new,) + x.axes[i + 1 :])


def tile(x: NamedArray, reps: Mapping[AxisSelector, int]) -> NamedArray:
    """The whole array repeated along named axes: ``nm.tile(x, {"position": 3})``."""
    counts = [1] * x.ndim
    for a, r in reps.items():
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ArgumentError(f"nm.tile: the repeat count for {name_of(a)!r} must be an int >= 0, got {r!r}")
        counts[index_of(x.axes, a)] = r
    axes = tuple(a.resize(a.size * r) for a, r in zip(x.axes, counts))
    return NamedArray._unchecked(jnp.tile(x.array, counts), axes)


def trace(x: NamedArray, axis1: AxisSelector, axis2: AxisSelector, *, offset: int = 0, dtype=None) -> NamedArray:
    """The sum of the (``offset``) diagonal of ``axis1`` x ``axis2``; both axes are dropped."""
    i, j = index_of(x.axes, axis1), index_of(x.axes, axis2)
    if i == j:
        raise AxisError(f"nm.trace needs two different axes, got {x.axes[i].name!r} twice")
    rest = tuple(a for k, a in enumerate(x.axes) if k not in (i, j))
    return NamedArray._unchecked(jnp.trace(x.array, offset=offset, axis1=i, axis2=j, dtype=dtype), rest)


def polyval(coeffs, x, axis: AxisSelector | None = None) -> NamedArray:
    """The polynomial with ``coeffs`` (highest degree first, as ``np.polyval``) at ``x``.

    ``coeffs`` is a sequence of numbers, or a NamedArray whose ``axis`` holds the coefficients
    and whose other axes broadcast with ``x``'s by name (one polynomial per entry)."""
    if isinstance(coeffs, NamedArray):
        if axis is None:
            raise AxisError(f"nm.polyval needs axis= to say which of {format_axes(coeffs.axes)} holds the coefficients")
        terms = unbind(coeffs, axis)
    else:
        terms = list(coeffs)
    # Horner from zeros, as np.polyval does (so that inf and nan inputs give what numpy gives)
    acc = NamedArray._unchecked(jnp.zeros_like(x.array), x.axes) if isinstance(x, NamedArray) else NamedArray(jnp.zeros_like(x), ())
    for c in terms:
        acc = acc * x + c
    return acc


def allclose(a, b, *, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> NamedArray:
    """Whether all entries are close, with ``a`` and ``b`` broadcast by name (a 0-d bool NamedArray)."""
    return _ops.isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan).all()


def array_equal(a, b, *, equal_nan: bool = False) -> NamedArray:
    """Whether ``a`` and ``b`` have the same axes (names and sizes, in any order) and entries."""
    aa, ba = axes_of(a), axes_of(b)
    if set(aa) != set(ba):
        return NamedArray(jnp.asarray(False), ())
    eq = _ops.equal(a, b)
    if equal_nan:
        eq = _ops.logical_or(eq, _ops.logical_and(_ops.isnan(a), _ops.isnan(b)))
    return eq.all()


def fftfreq(axis: Axis, d: float = 1.0, *, rfft: bool = False, new_axis: AxisSelector | None = None) -> NamedArray:
    """The sample frequencies of ``nm.fft`` (``rfft=True``: of ``nm.rfft``) along ``axis``; the result
    is along ``new_axis`` (default: the axis' own name) with the transform's size."""
    if not isinstance(axis, Axis):
        raise AxisError(f"nm.fftfreq needs an Axis with a size, got {axis!r}")
    out = (jnp.fft.rfftfreq if rfft else jnp.fft.fftfreq)(axis.size, d)
    return NamedArray._unchecked(out, (Axis(name_of(new_axis) if new_axis is not None else axis.name, out.shape[0]),))


__all__ = [*SURFACE, "ravel", "unique", "nonzero", "searchsorted", "bincount", "repeat", "tile", "trace", "polyval",
           "allclose", "array_equal", "fftfreq"]
