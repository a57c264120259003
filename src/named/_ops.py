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
    if kwargs.get("where") is not None or kwargs.get("out") is not None:  # jnp's ufuncs raise NotImplementedError
        raise ArgumentTypeError(
            f"nm.{name}: elementwise ops take no where= or out= (JAX arrays are immutable); write "
            f"nm.where(mask, nm.{name}(...), fallback) with a boolean mask"
        )
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


def elementwise_op(fn: Callable, name: str | None = None) -> Callable:
    @functools.wraps(fn)
    def op(*args, **kwargs):
        return _elementwise(fn, *args, name=op.__name__, **kwargs)

    op.__name__ = name or fn.__name__
    op.__qualname__ = op.__name__
    op.__doc__ = f"Elementwise ``{getattr(fn, '__module__', 'jnp')}.{fn.__name__}`` over names (union broadcasting)."
    return op


# Unary
abs = elementwise_op(jnp.abs, "abs")
negative = elementwise_op(jnp.negative)
sign = elementwise_op(jnp.sign)
exp = elementwise_op(jnp.exp)
exp2 = elementwise_op(jnp.exp2)
expm1 = elementwise_op(jnp.expm1)
log = elementwise_op(jnp.log)
log2 = elementwise_op(jnp.log2)
log10 = elementwise_op(jnp.log10)
log1p = elementwise_op(jnp.log1p)
sqrt = elementwise_op(jnp.sqrt)
rsqrt = elementwise_op(lax.rsqrt, "rsqrt")
cbrt = elementwise_op(jnp.cbrt)
square = elementwise_op(jnp.square)
reciprocal = elementwise_op(jnp.reciprocal)
sin = elementwise_op(jnp.sin)
cos = elementwise_op(jnp.cos)
tan = elementwise_op(jnp.tan)
arcsin = elementwise_op(jnp.arcsin)
arccos = elementwise_op(jnp.arccos)
arctan = elementwise_op(jnp.arctan)
sinh = elementwise_op(jnp.sinh)
cosh = elementwise_op(jnp.cosh)
tanh = elementwise_op(jnp.tanh)
arcsinh = elementwise_op(jnp.arcsinh)
arccosh = elementwise_op(jnp.arccosh)
arctanh = elementwise_op(jnp.arctanh)
floor = elementwise_op(jnp.floor)
ceil = elementwise_op(jnp.ceil)
round = elementwise_op(jnp.round, "round")
trunc = elementwise_op(jnp.trunc)
isnan = elementwise_op(jnp.isnan)
isinf = elementwise_op(jnp.isinf)
isfinite = elementwise_op(jnp.isfinite)
logical_not = elementwise_op(jnp.logical_not)
invert = elementwise_op(jnp.invert)
conj = elementwise_op(jnp.conj)
real = elementwise_op(jnp.real)
imag = elementwise_op(jnp.imag)
erf = elementwise_op(jax.scipy.special.erf, "erf")
erfc = elementwise_op(jax.scipy.special.erfc, "erfc")
sigmoid = elementwise_op(jax.nn.sigmoid, "sigmoid")
log_sigmoid = elementwise_op(jax.nn.log_sigmoid, "log_sigmoid")
softplus = elementwise_op(jax.nn.softplus, "softplus")
relu = elementwise_op(jax.nn.relu, "relu")
relu6 = elementwise_op(jax.nn.relu6, "relu6")
silu = elementwise_op(jax.nn.silu, "silu")
swish = silu
elu = elementwise_op(jax.nn.elu, "elu")
leaky_relu = elementwise_op(jax.nn.leaky_relu, "leaky_relu")


def gelu(x, approximate: bool = False):
    """GELU; ``approximate=True`` is the tanh form GPT-2 uses, False the exact erf form."""
    return _elementwise(functools.partial(jax.nn.gelu, approximate=approximate), x, name="gelu")


# Binary and ternary
add = elementwise_op(jnp.add)
subtract = elementwise_op(jnp.subtract)
multiply = elementwise_op(jnp.multiply)
divide = elementwise_op(jnp.divide)
true_divide = divide
floor_divide = elementwise_op(jnp.floor_divide)
mod = elementwise_op(jnp.mod)
remainder = mod
power = elementwise_op(jnp.power)
maximum = elementwise_op(jnp.maximum)
minimum = elementwise_op(jnp.minimum)
arctan2 = elementwise_op(jnp.arctan2)
hypot = elementwise_op(jnp.hypot)
logaddexp = elementwise_op(jnp.logaddexp)
equal = elementwise_op(jnp.equal)
not_equal = elementwise_op(jnp.not_equal)
less = elementwise_op(jnp.less)
less_equal = elementwise_op(jnp.less_equal)
greater = elementwise_op(jnp.greater)
greater_equal = elementwise_op(jnp.greater_equal)
logical_and = elementwise_op(jnp.logical_and)
logical_or = elementwise_op(jnp.logical_or)
logical_xor = elementwise_op(jnp.logical_xor)
bitwise_and = elementwise_op(jnp.bitwise_and)
bitwise_or = elementwise_op(jnp.bitwise_or)
bitwise_xor = elementwise_op(jnp.bitwise_xor)
isclose = elementwise_op(jnp.isclose)


def floating(dtype):
    """The dtype a layer that scales or normalises returns for an input of ``dtype``: the input's own
    when it is floating (bf16 stays bf16), else float32, so that an int input is never truncated."""
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.float32


def wide(*dtypes):
    """The dtype norms, attention scores and losses compute in: the widest of the inputs' floating
    dtypes and float32. bf16 statistics are worth nothing, and a float64 input (a gradient check)
    must not be rounded to float32 on the way."""
    return jnp.result_type(jnp.float32, *(d for d in dtypes if jnp.issubdtype(d, jnp.floating)))


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
                "give (numpy refuses too); give where= with the "
                "value for an empty axis, or check the size first"
            ) from e
        raise ArgumentTypeError(f"{what} does not take an array of dtype {array.dtype}: {e}") from e


def reduce_op(fn: Callable, x: NamedArray, axis, *, where=None, name: str | None = None, **kwargs) -> NamedArray:
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
    return reduce_op(jnp.sum, x, axis, where=where, dtype=dtype)


def mean(x, axis=None, *, where=None, dtype=None):
    return reduce_op(jnp.mean, x, axis, where=where, dtype=dtype)


_mean = mean  # for standardize, whose mean= argument hides the function


def prod(x, axis=None, *, where=None, dtype=None):
    return reduce_op(jnp.prod, x, axis, where=where, dtype=dtype)


def lowest_value(dtype, highest: bool = False):
    # The identity of max (min) in ``dtype``: what a fully masked-out max (min) returns.
    if jnp.issubdtype(dtype, jnp.bool_):
        return highest
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return info.max if highest else info.min
    return jnp.inf if highest else -jnp.inf


def max(x, axis=None, *, where=None):
    kw = {} if where is None else {"initial": lowest_value(x.dtype)}
    return reduce_op(jnp.max, x, axis, where=where, **kw)


def min(x, axis=None, *, where=None):
    kw = {} if where is None else {"initial": lowest_value(x.dtype, highest=True)}
    return reduce_op(jnp.min, x, axis, where=where, **kw)


def std(x, axis=None, *, where=None, ddof=0):
    return reduce_op(jnp.std, x, axis, where=where, ddof=ddof)


def var(x, axis=None, *, where=None, ddof=0):
    return reduce_op(jnp.var, x, axis, where=where, ddof=ddof)


def any(x, axis=None, *, where=None):
    return reduce_op(jnp.any, x, axis, where=where)


def all(x, axis=None, *, where=None):
    return reduce_op(jnp.all, x, axis, where=where)


def logsumexp(x, axis=None, *, where=None):
    return reduce_op(jax.nn.logsumexp, x, axis, where=where)


def arg_reduce_op(fn, x: NamedArray, axis, name: str | None = None) -> NamedArray:
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
    return arg_reduce_op(jnp.argmax, x, axis)


def argmin(x, axis=None) -> NamedArray:
    return arg_reduce_op(jnp.argmin, x, axis)


# ---- along-one-axis ops that keep the shape ---------------------------------------


def along_op(fn: Callable, x: NamedArray, axis, **kwargs) -> NamedArray:
    expect_named(x, f"nm.{getattr(fn, '__name__', 'op')}")
    sels = as_selectors(axis)
    if len(sels) != 1:
        raise AxisError(
            f"{getattr(fn, '__name__', 'op')} needs exactly one axis name, got {axis!r}; the array has axes "
            f"{format_axes(x.axes)}"
        )
    i = index_of(x.axes, sels[0])
    return unchecked(fn(x.array, axis=i, **kwargs), x.axes)


def softmax(x, axis, *, where=None) -> NamedArray:
    """Softmax along ``axis``."""
    if where is None:
        return along_op(jax.nn.softmax, x, axis)
    return along_op(jax.nn.softmax, x, axis, where=_where_mask(x, where))


def log_softmax(x, axis, *, where=None) -> NamedArray:
    if where is None:
        return along_op(jax.nn.log_softmax, x, axis)
    return along_op(jax.nn.log_softmax, x, axis, where=_where_mask(x, where))


def standardize(x, axis, *, mean=None, variance=None, epsilon: float = 1e-5, where=None) -> NamedArray:
    """``(x - mean) / sqrt(variance + eps)`` along ``axis`` (one or several names); with ``where=``
    the statistics count only the entries where it is True (every entry is still standardized).
    ``mean`` and ``variance`` (Haliax's) replace the computed statistics, e.g. running ones; each
    is a number or a NamedArray that broadcasts with ``x`` by name."""
    m = _mean(x, axis, where=where) if mean is None else mean
    v = var(x, axis, where=where) if variance is None else variance
    return (x - m) * rsqrt(v + epsilon)


def cumsum(x, axis, *, reverse: bool = False) -> NamedArray:
    return along_op(lax.cumsum, x, axis, reverse=reverse)


def cumprod(x, axis, *, reverse: bool = False) -> NamedArray:
    return along_op(lax.cumprod, x, axis, reverse=reverse)


def _sorting(fn, x: NamedArray, axis, new_axis, **kwargs) -> NamedArray:
    if axis is not None:
        return along_op(fn, x, axis, **kwargs)
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
