"""Elementwise math and reductions by name.

The broadcasting rule (docs/named_arrays.md): the result of an n-ary elementwise op has the
*union* of its operands' axes, in the order of the operand with the most axes (the leftmost on
a tie), followed by the names it lacks in first-seen order; a name must have one size in all
operands. Python numbers and 0-d arrays broadcast against anything; a positional
array with dimensions is refused (wrap it with ``nm.named``).
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ._axis import (
    ArgumentTypeError,
    Axis,
    AxisError,
    AxisSelection,
    as_selectors,
    broadcast_axes,
    format_axes,
    index_of,
    indices_of,
    name_of,
    union,
)
from ._core import NamedArray, axes_of, expect_named, raw, unchecked


def _elementwise(fn: Callable, *args, name: str | None = None, **kwargs):
    axes = broadcast_axes(*(axes_of(a) for a in args))
    named = builtins.any(isinstance(a, NamedArray) for a in args)
    try:
        out = fn(*(raw(a, axes) for a in args), **kwargs) if named else fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        # the operands broadcast (checked above), so what jnp refuses is their dtypes (a float into a bitwise op)
        dtypes = ", ".join(str(jnp.result_type(a)) for a in args)
        raise ArgumentTypeError(
            f"nm.{name or getattr(fn, '__name__', 'op')} does not take operands of dtype {dtypes}: {e}"
        ) from e
    if not named:
        return NamedArray(out, ())  # scalars in, 0-d NamedArray out
    return unchecked(out, axes)


def _wrap(fn: Callable, name: str | None = None) -> Callable:
    @functools.wraps(fn)
    def op(*args, **kwargs):
        return _elementwise(fn, *args, name=op.__name__, **kwargs)

    op.__name__ = name or fn.__name__
    op.__qualname__ = op.__name__
    op.__doc__ = f"Elementwise ``{getattr(fn, '__module__', 'jnp')}.{fn.__name__}`` over names (union broadcasting)."
    return op


# Unary
abs = _wrap(jnp.abs, "abs")
negative = _wrap(jnp.negative)
sign = _wrap(jnp.sign)
exp = _wrap(jnp.exp)
exp2 = _wrap(jnp.exp2)
expm1 = _wrap(jnp.expm1)
log = _wrap(jnp.log)
log2 = _wrap(jnp.log2)
log10 = _wrap(jnp.log10)
log1p = _wrap(jnp.log1p)
sqrt = _wrap(jnp.sqrt)
rsqrt = _wrap(lax.rsqrt, "rsqrt")
cbrt = _wrap(jnp.cbrt)
square = _wrap(jnp.square)
reciprocal = _wrap(jnp.reciprocal)
sin = _wrap(jnp.sin)
cos = _wrap(jnp.cos)
tan = _wrap(jnp.tan)
arcsin = _wrap(jnp.arcsin)
arccos = _wrap(jnp.arccos)
arctan = _wrap(jnp.arctan)
sinh = _wrap(jnp.sinh)
cosh = _wrap(jnp.cosh)
tanh = _wrap(jnp.tanh)
arcsinh = _wrap(jnp.arcsinh)
arccosh = _wrap(jnp.arccosh)
arctanh = _wrap(jnp.arctanh)
floor = _wrap(jnp.floor)
ceil = _wrap(jnp.ceil)
round = _wrap(jnp.round, "round")
trunc = _wrap(jnp.trunc)
isnan = _wrap(jnp.isnan)
isinf = _wrap(jnp.isinf)
isfinite = _wrap(jnp.isfinite)
logical_not = _wrap(jnp.logical_not)
invert = _wrap(jnp.invert)
conj = _wrap(jnp.conj)
real = _wrap(jnp.real)
imag = _wrap(jnp.imag)
erf = _wrap(jax.scipy.special.erf, "erf")
erfc = _wrap(jax.scipy.special.erfc, "erfc")
sigmoid = _wrap(jax.nn.sigmoid, "sigmoid")
log_sigmoid = _wrap(jax.nn.log_sigmoid, "log_sigmoid")
softplus = _wrap(jax.nn.softplus, "softplus")
relu = _wrap(jax.nn.relu, "relu")
relu6 = _wrap(jax.nn.relu6, "relu6")
silu = _wrap(jax.nn.silu, "silu")
swish = silu
elu = _wrap(jax.nn.elu, "elu")
leaky_relu = _wrap(jax.nn.leaky_relu, "leaky_relu")


def gelu(x, approximate: bool = False):
    """GELU; ``approximate=True`` is the tanh form GPT-2 uses, False the exact erf form."""
    return _elementwise(functools.partial(jax.nn.gelu, approximate=approximate), x, name="gelu")


# Binary and ternary
add = _wrap(jnp.add)
subtract = _wrap(jnp.subtract)
multiply = _wrap(jnp.multiply)
divide = _wrap(jnp.divide)
true_divide = divide
floor_divide = _wrap(jnp.floor_divide)
mod = _wrap(jnp.mod)
remainder = mod
power = _wrap(jnp.power)
maximum = _wrap(jnp.maximum)
minimum = _wrap(jnp.minimum)
arctan2 = _wrap(jnp.arctan2)
hypot = _wrap(jnp.hypot)
logaddexp = _wrap(jnp.logaddexp)
equal = _wrap(jnp.equal)
not_equal = _wrap(jnp.not_equal)
less = _wrap(jnp.less)
less_equal = _wrap(jnp.less_equal)
greater = _wrap(jnp.greater)
greater_equal = _wrap(jnp.greater_equal)
logical_and = _wrap(jnp.logical_and)
logical_or = _wrap(jnp.logical_or)
logical_xor = _wrap(jnp.logical_xor)
bitwise_and = _wrap(jnp.bitwise_and)
bitwise_or = _wrap(jnp.bitwise_or)
bitwise_xor = _wrap(jnp.bitwise_xor)
isclose = _wrap(jnp.isclose)


def floating(dtype):
    """The dtype a layer that scales or normalises returns for an input of ``dtype``: the input's own
    when it is floating (bf16 stays bf16), else float32, so that an int input is never truncated."""
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.float32


def where(condition, x, y):
    """``x`` where ``condition`` else ``y``; all three broadcast by the union rule."""
    return _elementwise(jnp.where, condition, x, y, name="where")


def clip(x, lower=None, upper=None):
    """Clip to ``[lower, upper]`` (either may be None); one n-ary op under the broadcasting rule."""
    if lower is None and upper is None:
        return _elementwise(lambda a: a, x, name="clip")
    if lower is None:
        return _elementwise(lambda a, hi: jnp.minimum(a, hi), x, upper, name="clip")
    if upper is None:
        return _elementwise(lambda a, lo: jnp.maximum(a, lo), x, lower, name="clip")
    return _elementwise(lambda a, lo, hi: jnp.minimum(jnp.maximum(a, lo), hi), x, lower, upper, name="clip")


# ---- reductions ------------------------------------------------------------------


def _reduction_axes(x: NamedArray, axis: AxisSelection | None, what: str = "a reduction") -> tuple[int, ...]:
    if axis is None:
        return tuple(range(x.ndim))
    return indices_of(x.axes, axis, what)


def check_bool_mask(mask, what: str, keep: str = "keep", more: str = "") -> None:
    """Refuse a mask that is not boolean. Read as truth values, torch's additive masks (0 = keep,
    -inf = drop) would mean the exact inverse, and a 0.5 weight would count in full."""
    dtype = mask.dtype if hasattr(mask, "dtype") else jnp.asarray(mask).dtype
    if not jnp.issubdtype(dtype, jnp.bool_):
        raise ArgumentTypeError(
            f"{what} must be a boolean mask (True = {keep}), got dtype {dtype}; convert a 0/1 mask "
            f"with `mask != 0` and an additive one (0 = {keep}, -inf = not) with `mask == 0`{more}"
        )


def _where_mask(x: NamedArray, where):
    if where is None:
        return None
    check_bool_mask(where, "where=")
    w_axes = axes_of(where)
    extra = [a for a in w_axes if a.name not in x.names]
    if extra:
        raise AxisError(f"where= has axes {format_axes(extra)} that the reduced array {format_axes(x.axes)} lacks")
    union(x.axes, w_axes)  # size check
    mask = raw(where, x.axes)
    return jnp.broadcast_to(mask, x.array.shape)


def _positional(x, axis, what: str):
    """A plain array that a reduction takes (Haliax's ``hax.all(x == y)``) is reduced over all of it,
    to a 0-d NamedArray: its positional array. Names cannot address its dimensions, so an ``axis``
    is refused."""
    if not (_is_positional(x) or isinstance(x, (int, float, complex, bool))):
        raise ArgumentTypeError(f"{what} takes a NamedArray (or a plain array, reduced whole), got {type(x).__name__}")
    if axis is not None:
        raise ArgumentTypeError(
            f"{what}(x, axis={axis!r}) on a plain array of shape {tuple(jnp.shape(x))}: axes are "
            "names, and a plain array has none; wrap it with nm.named(x, names), or give axis=None "
            "to reduce all of it"
        )
    x = jnp.asarray(x)
    return x, tuple(Axis(f"dim{i}", n) for i, n in enumerate(x.shape))


def _is_positional(x) -> bool:
    return not isinstance(x, NamedArray) and hasattr(x, "shape") and hasattr(x, "dtype")


def reduce_over(fn: Callable, array, axes: tuple[Axis, ...], dims, what: str, **kwargs):
    """``fn(array, axis=dims)``, where ``array`` is laid out as ``axes``. What numpy refuses, jnp
    refuses too, in its own words: a reduction without an identity (max, argmax, ptp) over a
    zero-size axis becomes an AxisError naming the axis, a dtype the reduction does not take an
    ArgumentTypeError naming it."""
    try:
        return fn(array, axis=dims, **kwargs)
    except (TypeError, ValueError) as e:
        reduced = range(len(axes)) if dims is None else (dims if isinstance(dims, tuple) else (dims,))
        empty = [axes[i].name for i in reduced if axes[i].size == 0]
        if empty:
            raise AxisError(
                f"{what} over the zero-size axis {empty[0]!r} of {format_axes(axes)}: there is no entry to "
                "give (numpy refuses too); give where= with the value for an empty axis, or check the "
                "size first"
            ) from e
        raise ArgumentTypeError(f"{what} does not take an array of dtype {array.dtype}: {e}") from e


def _reduce(fn: Callable, x: NamedArray, axis, *, where=None, name: str | None = None, **kwargs) -> NamedArray:
    what = f"nm.{name or getattr(fn, '__name__', 'reduce')}"
    if not isinstance(x, NamedArray):
        if where is not None:
            kwargs["where"] = jnp.asarray(where.array if isinstance(where, NamedArray) else where, bool)
        array, axes = _positional(x, axis, what)
        return NamedArray(reduce_over(fn, array, axes, None, what, **kwargs), ())
    dims = _reduction_axes(x, axis, what)
    if where is not None:
        kwargs["where"] = _where_mask(x, where)
    out = reduce_over(fn, x.array, x.axes, dims, what, **kwargs)
    keep = tuple(a for i, a in enumerate(x.axes) if i not in dims)
    return unchecked(out, keep)


def sum(x, axis=None, *, where=None, dtype=None):
    """Sum over ``axis`` (a name, several names, or None for all); returns a NamedArray."""
    return _reduce(jnp.sum, x, axis, where=where, dtype=dtype)


def mean(x, axis=None, *, where=None, dtype=None):
    return _reduce(jnp.mean, x, axis, where=where, dtype=dtype)


_mean = mean  # for standardize, whose mean= argument hides the function


def prod(x, axis=None, *, where=None, dtype=None):
    return _reduce(jnp.prod, x, axis, where=where, dtype=dtype)


def _lowest(dtype, highest: bool = False):
    # The identity of max (min) in ``dtype``: what a fully masked-out max (min) returns.
    if jnp.issubdtype(dtype, jnp.bool_):
        return highest
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.max if highest else info.min
    return jnp.inf if highest else -jnp.inf


def max(x, axis=None, *, where=None):
    kw = {} if where is None else {"initial": _lowest(x.dtype)}
    return _reduce(jnp.max, x, axis, where=where, **kw)


def min(x, axis=None, *, where=None):
    kw = {} if where is None else {"initial": _lowest(x.dtype, highest=True)}
    return _reduce(jnp.min, x, axis, where=where, **kw)


def std(x, axis=None, *, where=None, ddof=0):
    return _reduce(jnp.std, x, axis, where=where, ddof=ddof)


def var(x, axis=None, *, where=None, ddof=0):
    return _reduce(jnp.var, x, axis, where=where, ddof=ddof)


def any(x, axis=None, *, where=None):
    return _reduce(jnp.any, x, axis, where=where)


def all(x, axis=None, *, where=None):
    return _reduce(jnp.all, x, axis, where=where)


def logsumexp(x, axis=None, *, where=None):
    return _reduce(jax.nn.logsumexp, x, axis, where=where)


def _arg_reduce(fn, x: NamedArray, axis, name: str | None = None) -> NamedArray:
    what = f"nm.{name or fn.__name__}"
    if not isinstance(x, NamedArray):
        array, axes = _positional(x, axis, what)
        return NamedArray(reduce_over(fn, array, axes, None, what), ())
    if axis is None:  # numpy's flat index: row-major over the array's own axis order
        return unchecked(reduce_over(fn, x.array, x.axes, None, what), ())
    if len(as_selectors(axis)) != 1:
        raise AxisError(
            f"{what} needs exactly one axis name, or None for a flat index; the array has axes "
            f"{format_axes(x.axes)}, got {axis!r}"
        )
    (sel,) = as_selectors(axis)
    i = index_of(x.axes, sel)
    return unchecked(reduce_over(fn, x.array, x.axes, i, what), x.axes[:i] + x.axes[i + 1 :])


def argmax(x, axis=None) -> NamedArray:
    """The index of the largest entry along one axis; ``None``: the flat index over all axes
    (row-major in the array's axis order, an index into ``nm.ravel(x, ...)``)."""
    return _arg_reduce(jnp.argmax, x, axis)


def argmin(x, axis=None) -> NamedArray:
    return _arg_reduce(jnp.argmin, x, axis)


# ---- along-one-axis ops that keep the shape ---------------------------------------


def _along(fn: Callable, x: NamedArray, axis, **kwargs) -> NamedArray:
    expect_named(x, f"nm.{getattr(fn, '__name__', 'op')}")
    sels = as_selectors(axis)
    if len(sels) != 1:
        raise AxisError(
            f"{getattr(fn, '__name__', 'op')} needs exactly one axis name, got {axis!r}; the array has axes {format_axes(x.axes)}"
        )
    i = index_of(x.axes, sels[0])
    return unchecked(fn(x.array, axis=i, **kwargs), x.axes)


def softmax(x, axis, *, where=None) -> NamedArray:
    """Softmax along ``axis``."""
    if where is None:
        return _along(jax.nn.softmax, x, axis)
    return _along(jax.nn.softmax, x, axis, where=_where_mask(x, where))


def log_softmax(x, axis, *, where=None) -> NamedArray:
    if where is None:
        return _along(jax.nn.log_softmax, x, axis)
    return _along(jax.nn.log_softmax, x, axis, where=_where_mask(x, where))


def standardize(x, axis, *, mean=None, variance=None, epsilon: float = 1e-5, where=None) -> NamedArray:
    """``(x - mean) / sqrt(variance + eps)`` along ``axis`` (one or several names); with ``where=``
    the statistics count only the entries where it is True (every entry is still standardized).
    ``mean`` and ``variance`` (Haliax's) replace the computed statistics, e.g. running ones; each
    is a number or a NamedArray that broadcasts with ``x`` by name."""
    m = _mean(x, axis, where=where) if mean is None else mean
    v = var(x, axis, where=where) if variance is None else variance
    return (x - m) * rsqrt(v + epsilon)


def cumsum(x, axis, *, reverse: bool = False) -> NamedArray:
    return _along(lax.cumsum, x, axis, reverse=reverse)


def cumprod(x, axis, *, reverse: bool = False) -> NamedArray:
    return _along(lax.cumprod, x, axis, reverse=reverse)


def _sorting(fn, x: NamedArray, axis, new_axis, **kwargs) -> NamedArray:
    if axis is not None:
        return _along(fn, x, axis, **kwargs)
    if new_axis is None:
        raise AxisError(f"{fn.__name__}(axis=None) flattens {format_axes(x.axes)}: name the flat axis with new_axis=")
    new = (Axis(name_of(new_axis), x.size),)
    return unchecked(fn(x.array, axis=None, **kwargs), new)


def sort(x, axis, *, descending: bool = False, new_axis=None) -> NamedArray:
    """Sorted along ``axis``; ``axis=None`` sorts all entries along one new axis ``new_axis``."""
    return _sorting(jnp.sort, x, axis, new_axis, descending=descending)


def argsort(x, axis, *, stable: bool = True, descending: bool = False, new_axis=None) -> NamedArray:
    """The indices that sort ``x`` along ``axis``; ``axis=None``: flat indices (into
    ``nm.ravel(x, ...)``) along one new axis ``new_axis``."""
    return _sorting(jnp.argsort, x, axis, new_axis, stable=stable, descending=descending)


__all__ = [
    "abs",
    "negative",
    "sign",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sqrt",
    "rsqrt",
    "cbrt",
    "square",
    "reciprocal",
    "sin",
    "cos",
    "tan",
    "arcsin",
    "arccos",
    "arctan",
    "sinh",
    "cosh",
    "tanh",
    "arcsinh",
    "arccosh",
    "arctanh",
    "floor",
    "ceil",
    "round",
    "trunc",
    "isnan",
    "isinf",
    "isfinite",
    "logical_not",
    "invert",
    "conj",
    "real",
    "imag",
    "erf",
    "erfc",
    "sigmoid",
    "log_sigmoid",
    "softplus",
    "relu",
    "relu6",
    "silu",
    "swish",
    "elu",
    "leaky_relu",
    "add",
    "subtract",
    "multiply",
    "divide",
    "true_divide",
    "floor_divide",
    "mod",
    "remainder",
    "power",
    "maximum",
    "minimum",
    "arctan2",
    "hypot",
    "logaddexp",
    "equal",
    "not_equal",
    "less",
    "less_equal",
    "greater",
    "greater_equal",
    "logical_and",
    "logical_or",
    "logical_xor",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "isclose",
    "gelu",
    "where",
    "clip",
    "sum",
    "mean",
    "prod",
    "max",
    "min",
    "std",
    "var",
    "any",
    "all",
    "logsumexp",
    "argmax",
    "argmin",
    "softmax",
    "log_softmax",
    "standardize",
    "cumsum",
    "cumprod",
    "sort",
    "argsort",
]
