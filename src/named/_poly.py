"""Polynomials by name (Haliax's ``haliax.poly``): ``jnp``'s polynomial functions on coefficient
arrays, highest degree first (numpy's order), each a NamedArray along one axis.

A coefficient array is a 1-d NamedArray (its one axis holds the coefficients) or a plain
sequence; results are along the input's coefficient axis, resized, or along ``degree`` when no
input is named (``new_axis=`` names it otherwise). ``nm.polyval`` evaluates them. ``roots``
and ``trim_zeros`` have data-dependent sizes, so they run eagerly only (as in jnp).
"""

from __future__ import annotations

import jax.numpy as jnp

from ._axis import ArgumentError, ArgumentTypeError, Axis, AxisError, AxisSelector, format_axes, name_of
from ._core import NamedArray, expect_named

DEGREE = "degree"


def _coeffs(p, what: str):
    """The raw 1-d coefficients of ``p`` and its axis name (None for a plain sequence)."""
    if isinstance(p, NamedArray):
        if p.ndim != 1:
            raise AxisError(
                f"nm.{what}: a polynomial is a 1-d NamedArray of coefficients, got axes {format_axes(p.axes)}"
            )
        return p.array, p.axes[0].name
    arr = jnp.asarray(p)
    if arr.ndim > 1:
        raise ArgumentTypeError(f"nm.{what}: a polynomial's coefficients are 1-d, got shape {arr.shape}")
    return jnp.atleast_1d(arr), None


def _named(raw, new_axis: AxisSelector | None, *names) -> NamedArray:
    name = name_of(new_axis) if new_axis is not None else next((n for n in names if n is not None), DEGREE)
    raw = jnp.atleast_1d(raw)  # numpy's poly of no roots is the 0-d 1.0
    return NamedArray(raw, (Axis(name, raw.shape[0]),))


def _order(m, what: str, name: str = "m") -> int:
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ArgumentError(f"nm.{what}: {name}={m!r}; it must be an int >= 0")
    return m


def poly(zeros, *, new_axis: AxisSelector | None = None) -> NamedArray:
    """The coefficients of the monic polynomial whose roots are ``zeros``."""
    raw, name = _coeffs(zeros, "poly")
    return _named(jnp.poly(raw), new_axis, name)


def _binary(fn, what: str):
    def op(p1, p2, *, new_axis: AxisSelector | None = None) -> NamedArray:
        (a, n1), (b, n2) = _coeffs(p1, what), _coeffs(p2, what)
        return _named(fn(a, b), new_axis, n1, n2)

    op.__name__ = op.__qualname__ = what
    op.__doc__ = f"``jnp.{what}`` of two polynomials (coefficients highest degree first)."
    return op


polyadd = _binary(jnp.polyadd, "polyadd")
polysub = _binary(jnp.polysub, "polysub")
polymul = _binary(jnp.polymul, "polymul")


def polydiv(p1, p2, *, new_axis: AxisSelector | None = None) -> tuple[NamedArray, NamedArray]:
    """``(quotient, remainder)`` of ``p1 / p2``."""
    (a, n1), (b, n2) = _coeffs(p1, "polydiv"), _coeffs(p2, "polydiv")
    q, r = jnp.polydiv(a, b)
    return _named(q, new_axis, n1, n2), _named(r, new_axis, n1, n2)


def polyint(p, m: int = 1, k=None, *, new_axis: AxisSelector | None = None) -> NamedArray:
    """The ``m``-th antiderivative, with integration constants ``k`` (numpy's)."""
    raw, name = _coeffs(p, "polyint")
    m = _order(m, "polyint")
    k = k.array if isinstance(k, NamedArray) else (None if k is None else jnp.asarray(k))
    return _named(jnp.polyint(raw, m=m, k=k), new_axis, name)


def polyder(p, m: int = 1, *, new_axis: AxisSelector | None = None) -> NamedArray:
    """The ``m``-th derivative."""
    raw, name = _coeffs(p, "polyder")
    m = _order(m, "polyder")
    return _named(jnp.polyder(raw, m=m), new_axis, name)


def polyfit(x, y, deg: int, *, rcond=None, w=None, cov: bool = False, new_axis: AxisSelector = DEGREE):
    """The least-squares polynomial of degree ``deg`` through ``(x, y)``, along ``new_axis``
    (default ``degree``; Haliax names it after x's axis). ``x``, ``y`` and the weights ``w`` are
    1-d, along one axis. With ``cov``: ``(coefficients, covariance)``, the covariance over
    ``(new_axis, new_axis + "_cov")``."""
    deg = _order(deg, "polyfit", "deg")
    xs, ys = _samples(x, "x"), _samples(y, "y")
    if xs.shape[0] == 0:
        axis = x.axes[0].name if isinstance(x, NamedArray) else "x"
        raise ArgumentError(f"nm.polyfit through no points (axis {axis!r} has size 0)")
    ws = None if w is None else _samples(w, "w")
    named = [v for v in (x, y, w) if isinstance(v, NamedArray)]
    if len({v.axes for v in named}) > 1:
        raise AxisError(f"nm.polyfit: x, y and w must share their one axis, got {[format_axes(v.axes) for v in named]}")
    out = jnp.polyfit(xs, ys, deg, rcond=rcond, w=ws, cov=cov)
    Coef = Axis(name_of(new_axis), deg + 1)
    if not cov:
        return NamedArray(out, (Coef,))
    return NamedArray(out[0], (Coef,)), NamedArray(out[1], (Coef, Coef.alias(f"{Coef.name}_cov")))


def _samples(v, what: str):
    if isinstance(v, NamedArray):
        if v.ndim != 1:
            raise AxisError(f"nm.polyfit: {what} must have one axis, got {format_axes(v.axes)}")
        return v.array
    return jnp.asarray(v)


def roots(p, *, new_axis: AxisSelector | None = None) -> NamedArray:
    """The roots of the polynomial (complex in general). Eager only: their number depends on
    the values."""
    raw, name = _coeffs(p, "roots")
    return _named(jnp.roots(raw), new_axis, name)


def trim_zeros(p, trim: str = "fb", *, new_axis: AxisSelector | None = None) -> NamedArray:
    """The coefficients without leading (``"f"``) and/or trailing (``"b"``) zeros. Eager only."""
    raw, name = _coeffs(p, "trim_zeros")
    return _named(jnp.trim_zeros(raw, trim=trim), new_axis, name)


def vander(x: NamedArray, degree: AxisSelector) -> NamedArray:
    """The Vandermonde matrix of a 1-d ``x``: its axis, then ``degree`` (decreasing powers, as
    ``jnp.vander``). A name for ``degree`` gets x's size (numpy's square default)."""
    expect_named(x, "nm.vander")
    if x.ndim != 1:
        raise AxisError(f"nm.vander takes a 1-d NamedArray, got {format_axes(x.axes)}")
    D = degree if isinstance(degree, Axis) else Axis(name_of(degree), x.axes[0].size)
    if D.name == x.axes[0].name:
        raise AxisError(f"nm.vander: the degree axis must differ from x's axis {x.axes[0].name!r}")
    return NamedArray(jnp.vander(x.array, N=D.size), (x.axes[0], D))


__all__ = [
    "poly",
    "polyadd",
    "polysub",
    "polymul",
    "polydiv",
    "polyint",
    "polyder",
    "polyfit",
    "roots",
    "trim_zeros",
    "vander",
]
