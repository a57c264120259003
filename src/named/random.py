"""Random NamedArrays: ``nm.random.normal(key, (Batch, Embed))``.

Values depend only on the key and the axes, never on the mesh: jax's partitionable threefry
(on by default in jax 0.10) draws each shard where it lives, so a jitted init under a
parameter mapping never builds a whole parameter on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._axis import AxisError, NamedError, AxisSelection, AxisSelector, format_axes, index_of, union
from ._core import NamedArray, axes_of, raw
from ._shape import _axes_for_creation

if not jax.config.jax_threefry_partitionable:  # pragma: no cover - guards a jax default
    raise NamedError("named needs jax_threefry_partitionable=True for mesh-independent random init")


def _key(key):
    """A jax key; a 0-d NamedArray of a key (what nm.vmap over a named key array hands in) is unwrapped."""
    if isinstance(key, NamedArray):
        if key.axes:
            raise AxisError(f"a random key must be a single key, got keys with axes {format_axes(key.axes)}; nm.vmap over them")
        return key.array
    return key


def _shape(axes):
    return tuple(a.size for a in axes)


def _param(value, axes, what: str):
    """A scalar or a NamedArray whose axes are among ``axes``, laid out to broadcast to them."""
    p_axes = axes_of(value)
    extra = [a for a in p_axes if a.name not in {b.name for b in axes}]
    if extra:
        raise AxisError(f"{what} has axes {format_axes(extra)} that are not among the requested {format_axes(axes)}")
    union(axes, p_axes)
    return raw(value, axes)


def normal(key, axes: AxisSelection, dtype=jnp.float32, *, mean=0.0, stddev=1.0) -> NamedArray:
    ax = _axes_for_creation(axes)
    z = jax.random.normal(_key(key), _shape(ax), dtype)
    return NamedArray(z * _param(stddev, ax, "stddev") + _param(mean, ax, "mean"), ax)


def uniform(key, axes: AxisSelection, dtype=jnp.float32, *, minval=0.0, maxval=1.0) -> NamedArray:
    ax = _axes_for_creation(axes)
    lo, hi = _param(minval, ax, "minval"), _param(maxval, ax, "maxval")
    return NamedArray(jax.random.uniform(_key(key), _shape(ax), dtype, lo, hi), ax)


def truncated_normal(key, axes: AxisSelection, dtype=jnp.float32, *, lower=-2.0, upper=2.0) -> NamedArray:
    """Standard normal truncated to ``[lower, upper]``."""
    ax = _axes_for_creation(axes)
    lo, hi = _param(lower, ax, "lower"), _param(upper, ax, "upper")
    return NamedArray(jax.random.truncated_normal(_key(key), lo, hi, _shape(ax), dtype), ax)


def bernoulli(key, axes: AxisSelection, p=0.5) -> NamedArray:
    ax = _axes_for_creation(axes)
    return NamedArray(jax.random.bernoulli(_key(key), _param(p, ax, "p"), _shape(ax)), ax)


def randint(key, axes: AxisSelection, minval, maxval, dtype=jnp.int32) -> NamedArray:
    ax = _axes_for_creation(axes)
    lo, hi = _param(minval, ax, "minval"), _param(maxval, ax, "maxval")
    return NamedArray(jax.random.randint(_key(key), _shape(ax), lo, hi, dtype), ax)


def categorical(key, logits: NamedArray, axis: AxisSelector) -> NamedArray:
    """One index along ``axis`` per entry of the other axes, drawn with probabilities softmax(logits)."""
    i = index_of(logits.axes, axis)
    rest = logits.axes[:i] + logits.axes[i + 1 :]
    return NamedArray(jax.random.categorical(_key(key), logits.array, axis=i), rest)
