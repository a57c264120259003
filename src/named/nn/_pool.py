"""Max, min and mean pooling over windows along named axes (one ``jax.lax.reduce_window`` each)."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .._axis import ArgumentError, ArgumentTypeError, Axis, AxisError, format_axes
from .._core import NamedArray, expect_named, unchecked
from .._ops import lowest_value
from ._conv import explicit_padding, output_size, padding_spec, per_axis


def _window(x, window, what: str) -> dict[str, int]:
    hint = (
        " (named takes the array first: Haliax's pool(Window, x) is pool(x, Window) here)"
        if isinstance(window, NamedArray)
        else ""
    )
    expect_named(x, what, hint=hint)
    if isinstance(window, Axis):
        window = (window,)
    if isinstance(window, Mapping):
        sizes = {getattr(k, "name", k): v for k, v in window.items()}
    elif isinstance(window, (tuple, list)) and window and all(isinstance(a, Axis) for a in window):
        sizes = {a.name: a.size for a in window}
    else:
        raise ArgumentTypeError(
            f"{what}: window must be {{name: size}} or Axis objects whose sizes are the window's, got {window!r}"
        )
    for n in sizes:
        if n not in x.names:
            raise AxisError(f"{what}: window axis {n!r} is not among the input's axes {format_axes(x.axes)}")
    names = tuple(sizes)
    return dict(zip(names, per_axis(tuple(sizes.values()), names, f"{what} window")))


def _pool(what, x, window, stride, padding, use_ceil, init, combine, weights: bool | None = None):
    """``(pooled, divisor)``: ``divisor`` (None unless ``weights`` is given) counts, per output
    entry, the input entries (and, if ``weights``, the explicit padding) under its window."""
    sizes = _window(x, window, what)
    names = tuple(sizes)
    strides = per_axis(1 if stride is None else stride, names, f"{what} stride")
    axes = [x.resolve_axis(n) for n in names]
    pads = explicit_padding(padding_spec(padding, names, what), [a.size for a in axes], list(sizes.values()), strides)
    extra = []  # entries added at the high end by use_ceil
    for a, (lo, hi), w, s in zip(axes, pads, sizes.values(), strides):
        if lo >= w or hi >= w:
            raise ArgumentError(f"{what}: padding {(lo, hi)} on axis {a.name!r} must be smaller than its window {w}")
        out = output_size(what, a, (lo, hi), w, s)
        if use_ceil and (a.size + lo + hi - w) % s and out * s < a.size + lo:
            # torch's ceil_mode: one more window, provided it starts inside the input or the low padding
            extra.append(out * s + w - (a.size + lo + hi))
        else:
            extra.append(0)
    by_name = {n: (w, s, (lo, hi + e)) for n, w, s, (lo, hi), e in zip(names, sizes.values(), strides, pads, extra)}
    dims, st, pd = zip(*(by_name.get(a.name, (1, 1, (0, 0))) for a in x.axes))
    # A numpy initial value, never a jax one: reduce_window recognises max, min and add (which have
    # gradients) only from a constant it can read; under jit a jnp value is traced, and the generic
    # reduce_window it then falls back on cannot be differentiated.
    pooled = jax.lax.reduce_window(x.array, np.asarray(init(x.dtype), x.dtype), combine, dims, st, pd)
    out_axes = tuple(a.resize(pooled.shape[i]) for i, a in enumerate(x.axes))
    divisor = None
    if weights is not None:
        # The count is static: a small array over the window axes only, which XLA folds into a
        # constant. Explicit padding counts if ``weights``; use_ceil's extra entries never do.
        ones = np.pad(np.ones([a.size for a in axes], np.float32), pads, constant_values=float(weights))
        counts = jax.lax.reduce_window(
            jnp.asarray(ones), 0.0, jax.lax.add, tuple(sizes.values()), strides, [(0, e) for e in extra]
        )
        divisor = unchecked(counts, tuple(a.resize(counts.shape[i]) for i, a in enumerate(axes)))
    return unchecked(pooled, out_axes), divisor


def max_pool(x: NamedArray, window, stride=None, padding="VALID", use_ceil: bool = False) -> NamedArray:
    """The largest entry of each window.

    Args:
        x: any NamedArray; axes not in ``window`` are carried through untouched.
        window: ``{name: size}`` (or ``Axis`` objects whose sizes are the window's) for each pooled axis.
        stride: an int for every window axis, one per axis (in ``window`` order), or ``{name: int}``;
            None is 1 (as in Haliax and flax; torch's default is the window).
        padding: ``"VALID"`` (none), ``"SAME"`` (output ``ceil(size / stride)``), an int, one int or
            ``(low, high)`` pair per window axis, or ``{name: int or pair}``; each side smaller than
            the window. Padding never wins the max.
        use_ceil: torch's ``ceil_mode``: a last, partial window when the stride leaves entries over.
    """
    return _pool("max_pool", x, window, stride, padding, use_ceil, lowest_value, jax.lax.max)[0]


def min_pool(x: NamedArray, window, stride=None, padding="VALID", use_ceil: bool = False) -> NamedArray:
    """The smallest entry of each window; arguments as :func:`max_pool`."""
    return _pool(
        "min_pool", x, window, stride, padding, use_ceil, lambda d: lowest_value(d, highest=True), jax.lax.min
    )[0]


def mean_pool(
    x: NamedArray, window, stride=None, padding="VALID", use_ceil: bool = False, count_include_pad: bool = True
) -> NamedArray:
    """The mean of each window; arguments as :func:`max_pool`.

    Padding adds zeros. ``count_include_pad=True`` (torch's default) divides by the window size
    including the explicit padding; ``False`` divides by the number of input entries under the
    window. As in torch, the extra entries of ``use_ceil`` are never counted. Integer inputs give float32.
    """
    if isinstance(x, NamedArray) and not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.float32)
    total, count = _pool(
        "mean_pool", x, window, stride, padding, use_ceil, lambda d: 0, jax.lax.add, weights=count_include_pad
    )
    return (total / count).astype(x.dtype)
