"""Random NamedArrays: ``nm.random.normal(key, (Batch, Embed))``.

Values depend only on the key and the axes, never on the mesh: jax's partitionable threefry
(on by default in jax 0.10) draws each shard where it lives, so a jitted init under a
parameter mapping never builds a whole parameter on one device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ._axis import (
    ArgumentError,
    ArgumentTypeError,
    Axis,
    AxisError,
    AxisSelection,
    AxisSelector,
    NamedError,
    as_selectors,
    check_unique,
    format_axes,
    index_of,
    union,
)
from ._compat import threefry_partitionable
from ._context import current_body
from ._core import NamedArray, axes_of, expect_named, raw, unchecked
from ._index import concrete
from ._shape import axes_for_creation

if not threefry_partitionable():  # pragma: no cover - guards a jax default
    raise NamedError("named needs jax_threefry_partitionable=True for mesh-independent random init")


def _key(key):
    """A jax key; a 0-d NamedArray of a key (what nm.vmap over a named key array hands in) is unwrapped."""
    if isinstance(key, NamedArray):
        if key.axes:
            raise AxisError(
                f"a random key must be a single key, got keys with axes {format_axes(key.axes)}; nm.vmap over them"
            )
        return key.array
    return key


def _shape(axes):
    return tuple(a.size for a in axes)


def block_draw(draw, axes):
    """``draw(shape)`` for ``axes``. On local blocks (inside ``nm.shard_map``), whose split axes
    hold only this device's part, every device gets its own part of the values the same key
    gives outside: explicit mode draws the whole array and keeps this device's block of it
    (the draw is mesh-independent: ``jax_threefry_partitionable``), at the cost of drawing all of
    it. Code that computes one part of a block (explicit mode's batch split) keeps that part."""
    axes = axes_for_creation(axes)
    body = current_body()
    return draw(_shape(axes)) if body is None else body.draw(draw, axes)


# A parameter's domain, where numpy checks one: values known before tracing outside it are refused
# (jax.random would return NaN, or a constant draw, without a word); traced ones cannot be checked.
_DOMAINS = {
    "p": (lambda v: (v >= 0) & (v <= 1), "in [0, 1]"),
    "a": (lambda v: v > 0, "> 0"),
    "b": (lambda v: v > 0, "> 0"),
    "df": (lambda v: v > 0, "> 0"),
    "scale": (lambda v: v > 0, "> 0"),
    "concentration": (lambda v: v > 0, "> 0"),
    "lam": (lambda v: v >= 0, ">= 0"),
    "n": (lambda v: v >= 0, ">= 0"),
    "stddev": (lambda v: v >= 0, ">= 0"),
}


def _in_domain(value, what: str, draw: str) -> None:
    rule = _DOMAINS.get(what)
    known = None if rule is None else concrete(value)
    if known is not None and not np.all(rule[0](known)):
        raise ArgumentError(f"nm.random.{draw}: {what} must be {rule[1]}, got {known.tolist()}")


def _ordered(lo, hi, names: str, draw: str) -> None:
    """``lo < hi`` for a range known before tracing (numpy refuses the other order too)."""
    known_lo, known_hi = concrete(lo), concrete(hi)
    if known_lo is not None and known_hi is not None and not np.all(known_lo < known_hi):
        raise ArgumentError(
            f"nm.random.{draw}: {names} must be an interval with the first below the second, got "
            f"{known_lo.tolist()} and {known_hi.tolist()}"
        )


def _call(draw: str, fn, *args, dtype=None):
    """``fn(*args)``: what jax.random refuses once the axes and parameters are checked is the dtype."""
    try:
        return fn(*args)
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError(
            f"nm.random.{draw} does not draw dtype {jnp.dtype(dtype) if dtype else 'given'}: {e}"
        ) from e


def _param(value, axes, what: str, draw: str = ""):
    """A scalar or a NamedArray whose axes are among ``axes``, laid out to broadcast to them."""
    _in_domain(value, what, draw)
    p_axes = axes_of(value)
    extra = [a for a in p_axes if a.name not in {b.name for b in axes}]
    if extra:
        raise AxisError(f"{what} has axes {format_axes(extra)} that are not among the requested {format_axes(axes)}")
    union(axes, p_axes)
    return raw(value, axes)


def normal(key, axes: AxisSelection, dtype=jnp.float32, *, mean=0.0, stddev=1.0) -> NamedArray:
    ax = axes_for_creation(axes)
    z = _call("normal", jax.random.normal, _key(key), _shape(ax), dtype, dtype=dtype)
    return NamedArray(z * _param(stddev, ax, "stddev", "normal") + _param(mean, ax, "mean"), ax)


def uniform(key, axes: AxisSelection, dtype=jnp.float32, *, minval=0.0, maxval=1.0) -> NamedArray:
    ax = axes_for_creation(axes)
    lo, hi = _param(minval, ax, "minval"), _param(maxval, ax, "maxval")
    _ordered(lo, hi, "minval, maxval", "uniform")
    return NamedArray(_call("uniform", jax.random.uniform, _key(key), _shape(ax), dtype, lo, hi, dtype=dtype), ax)


def truncated_normal(key, axes: AxisSelection, dtype=jnp.float32, *, lower=-2.0, upper=2.0) -> NamedArray:
    """Standard normal truncated to ``[lower, upper]``."""
    ax = axes_for_creation(axes)
    lo, hi = _param(lower, ax, "lower"), _param(upper, ax, "upper")
    _ordered(lo, hi, "lower, upper", "truncated_normal")
    return NamedArray(
        _call("truncated_normal", jax.random.truncated_normal, _key(key), lo, hi, _shape(ax), dtype, dtype=dtype), ax
    )


def bernoulli(key, axes: AxisSelection, p=0.5) -> NamedArray:
    ax = axes_for_creation(axes)
    return NamedArray(jax.random.bernoulli(_key(key), _param(p, ax, "p", "bernoulli"), _shape(ax)), ax)


def randint(key, axes: AxisSelection, minval, maxval, dtype=jnp.int32) -> NamedArray:
    ax = axes_for_creation(axes)
    lo, hi = _param(minval, ax, "minval"), _param(maxval, ax, "maxval")
    _ordered(lo, hi, "minval, maxval", "randint")
    return NamedArray(_call("randint", jax.random.randint, _key(key), _shape(ax), lo, hi, dtype, dtype=dtype), ax)


def categorical(key, logits: NamedArray, axis: AxisSelector, axes: AxisSelection = ()) -> NamedArray:
    """One index along ``axis`` per entry of the other axes, drawn with probabilities softmax(logits);
    ``axes``: new sample axes, in front (that many draws per entry)."""
    i = index_of(expect_named(logits, "nm.random.categorical", "logits").axes, axis)
    if logits.axes[i].size == 0:
        raise AxisError(f"nm.random.categorical along the zero-size axis {logits.axes[i].name!r}: no category to draw")
    rest = logits.axes[:i] + logits.axes[i + 1 :]
    new = axes_for_creation(axes) if as_selectors(axes) else ()
    out_axes = new + rest
    check_unique(out_axes, "the categorical draw's")
    return NamedArray(jax.random.categorical(_key(key), logits.array, axis=i, shape=_shape(out_axes)), out_axes)


# ---- keys ----------------------------------------------------------------------------------


def split(key, num: int | Axis = 2):
    """Split a key, keeping its names.

    A jax key splits as ``jax.random.split`` does. A NamedArray of keys (e.g. one per layer,
    ``nm.named(jax.random.split(k, n), "layers")``, or the 0-d slice a layer sees inside
    ``Stacked``) splits each of its keys: ``num`` an int gives a tuple of ``num`` NamedArrays
    with the key's axes; ``num`` an Axis gives one NamedArray with that axis added last.
    Entry ``i`` along the new axis of key ``k`` is ``jax.random.split(k, n)[i]``.
    """
    if isinstance(num, Axis):
        n = num.size
    elif isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise ArgumentError(f"nm.random.split: num must be an int >= 0 or an Axis, got {num!r}")
    else:
        n = num
    if not isinstance(key, NamedArray):
        if jnp.ndim(key):
            raise ArgumentTypeError(
                f"nm.random.split: a plain array of {jnp.shape(key)} keys; give one key, or wrap them "
                "with nm.named (nm.named(keys, 'layers')) to split each"
            )
        keys = jax.random.split(key, n)
        return NamedArray(keys, (num,)) if isinstance(num, Axis) else keys
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        raise ArgumentTypeError(
            f"nm.random.split: a NamedArray of keys must hold typed keys (jax.random.key), got dtype "
            f"{key.dtype}; convert raw keys with jax.random.wrap_key_data"
        )
    if isinstance(num, Axis) and num.name in key.names:
        raise AxisError(
            f"nm.random.split: the new axis {num.name!r} is already an axis of the keys {format_axes(key.axes)}"
        )
    flat = key.array.reshape(-1)
    keys = jax.vmap(lambda k: jax.random.split(k, n))(flat).reshape(key.array.shape + (n,))
    if isinstance(num, Axis):
        return unchecked(keys, key.axes + (num,))
    return tuple(unchecked(keys[..., i], key.axes) for i in range(n))


# ---- distributions that draw alike: fn(key, *params, shape, dtype) -------------------------

# name -> (jax function, its parameters). Each parameter is a number or a NamedArray whose
# axes are among the requested ones; the draw has exactly the requested axes.
DRAWS: dict[str, tuple] = {
    "gumbel": (jax.random.gumbel, ()),
    "laplace": (jax.random.laplace, ()),
    "logistic": (jax.random.logistic, ()),
    "exponential": (jax.random.exponential, ()),
    "cauchy": (jax.random.cauchy, ()),
    "maxwell": (jax.random.maxwell, ()),
    "rademacher": (jax.random.rademacher, ()),
    "beta": (jax.random.beta, ("a", "b")),
    "gamma": (jax.random.gamma, ("a",)),
    "loggamma": (jax.random.loggamma, ("a",)),
    "poisson": (jax.random.poisson, ("lam",)),
    "t": (jax.random.t, ("df",)),
    "chisquare": (jax.random.chisquare, ("df",)),
    "pareto": (jax.random.pareto, ("b",)),
    "geometric": (jax.random.geometric, ("p",)),
    "weibull_min": (jax.random.weibull_min, ("scale", "concentration")),
    "binomial": (jax.random.binomial, ("n", "p")),
}


def _draw(name: str, fn, params: tuple[str, ...]):
    def draw(key, axes: AxisSelection, *args, dtype=None, **kwargs) -> NamedArray:
        if len(args) > len(params):
            raise ArgumentTypeError(
                f"nm.random.{name} takes {len(params)} parameters "
                f"({', '.join(params) or 'none'}) after the axes, got {len(args)}"
            )
        values = dict(zip(params, args))
        for k, v in kwargs.items():
            if k not in params or k in values:
                raise ArgumentTypeError(
                    f"nm.random.{name} got an unexpected or repeated keyword {k!r}; its parameters: "
                    f"{', '.join(params) or 'none'}"
                )
            values[k] = v
        missing = [p for p in params if p not in values]
        if missing:
            raise ArgumentTypeError(f"nm.random.{name} needs the parameters {missing}")
        ax = axes_for_creation(axes)
        raw_params = [_param(values[p], ax, p, name) for p in params]
        return NamedArray(_call(name, fn, _key(key), *raw_params, _shape(ax), dtype, dtype=dtype), ax)

    draw.__name__ = draw.__qualname__ = name
    draw.__doc__ = (
        f"``jax.random.{name}`` over named axes: ``nm.random.{name}(key, axes"
        + "".join(f", {p}" for p in params)
        + ", dtype=None)``."
    )
    return draw


globals().update({name: _draw(name, fn, params) for name, (fn, params) in DRAWS.items()})


# ---- draws shaped by an array --------------------------------------------------------------


def _one_axis(x: NamedArray, axis, what: str) -> int:
    if axis is None:
        if x.ndim != 1:
            raise AxisError(f"nm.random.{what} needs axis= to pick one of {format_axes(x.axes)}")
        return 0
    return index_of(x.axes, axis)


def permutation(key, x, axis: AxisSelector | None = None, *, independent: bool = False) -> NamedArray:
    """A random order: of ``0 .. x.size - 1`` along ``x`` when it is an Axis, or of a NamedArray's
    entries along ``axis`` (``independent=True``: a separate order per entry of the other axes)."""
    if isinstance(x, Axis):
        return NamedArray(jax.random.permutation(_key(key), x.size), (x,))
    if not isinstance(x, NamedArray):
        raise ArgumentTypeError(f"nm.random.permutation takes an Axis or a NamedArray, got {type(x).__name__}")
    i = _one_axis(x, axis, "permutation")
    return unchecked(jax.random.permutation(_key(key), x.array, axis=i, independent=independent), x.axes)


def choice(
    key, a, axes: AxisSelection = (), *, axis: AxisSelector | None = None, replace: bool = True, p=None
) -> NamedArray:
    """Draw from ``0 .. a.size - 1`` (``a`` an Axis) or from a NamedArray's entries along ``axis``;
    the draws have the new ``axes``, which take the chosen axis' place. ``p`` (a NamedArray
    along the chosen axis) weights the choice."""
    new = axes_for_creation(axes) if as_selectors(axes) else ()
    if isinstance(a, Axis):
        pool, i, rest_before, rest_after = a.size, 0, (), ()
        chosen = a
    elif isinstance(a, NamedArray):
        i = _one_axis(a, axis, "choice")
        pool, chosen = a.array, a.axes[i]
        rest_before, rest_after = a.axes[:i], a.axes[i + 1 :]
        if chosen.size == 0 and new and math.prod(n.size for n in new):
            raise AxisError(f"nm.random.choice from the zero-size axis {chosen.name!r}: no entry to draw")
    else:
        raise ArgumentTypeError(
            f"nm.random.choice takes an Axis or a NamedArray to choose from, got {type(a).__name__}"
        )
    if p is not None:
        if not isinstance(p, NamedArray) or p.axes != (chosen,):
            raise AxisError(
                f"nm.random.choice: p must be a NamedArray along the chosen axis {format_axes((chosen,))}, got "
                f"{format_axes(p.axes) if isinstance(p, NamedArray) else type(p).__name__}"
            )
        p = p.array
    out_axes = rest_before + new + rest_after
    check_unique(out_axes, "the chosen")
    if not replace and int(np.prod([n.size for n in new])) > chosen.size:
        raise ArgumentError(
            f"nm.random.choice: {format_axes(new)} draws without "
            f"replacement from {chosen.size} entries of {chosen.name!r}"
        )
    out = jax.random.choice(_key(key), pool, tuple(n.size for n in new), replace=replace, p=p, axis=i)
    return unchecked(out, out_axes)


def dirichlet(key, alpha: NamedArray, axis: AxisSelector, axes: AxisSelection = (), dtype=None) -> NamedArray:
    """Draws from Dirichlet(``alpha``), the concentrations along ``axis`` (the event axis), one per
    entry of alpha's other axes and of the new ``axes``. Axes: the new ones, alpha's others, then
    the event axis."""
    i = index_of(expect_named(alpha, "nm.random.dirichlet", "alpha").axes, axis)
    _in_domain(alpha, "a", "dirichlet")
    event = alpha.axes[i]
    batch = alpha.axes[:i] + alpha.axes[i + 1 :]
    new = axes_for_creation(axes) if as_selectors(axes) else ()
    out_axes = new + batch + (event,)
    check_unique(out_axes, "the dirichlet draw's")
    moved = jnp.moveaxis(alpha.array, i, -1)
    return unchecked(jax.random.dirichlet(_key(key), moved, _shape(new + batch), dtype), out_axes)
