"""Conv and ConvTranspose over spatial axes chosen by name, and the window arithmetic pooling shares.

Both layers are one ``jax.lax.conv_general_dilated`` whose dimension numbers are read off the
input's axis names, so the input may hold its axes in any order and the output keeps that order
(``In`` replaced by ``Out``). Every axis that is neither spatial nor ``In`` is a batch axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import random as nmr
from .._axis import ArgumentError, Axis, AxisError, AxisSelection, format_axes, name_of, names_of
from .._core import NamedArray, expect_named, unchecked
from ..partitioning import shard

_BATCH = "__conv_batch__"  # the batch axes folded into one, for the few calls that need exactly one


# ---- per-axis arguments (shared with _pool) -------------------------------------------------


def spatial_names(Spatial: AxisSelection, what: str) -> tuple[str, ...]:
    names = names_of(Spatial)
    if not names:
        raise AxisError(f"{what}: needs at least one spatial axis name, got {Spatial!r}")
    if len(set(names)) != len(names):
        raise AxisError(f"{what}: spatial axes {names} repeat a name")
    return names


def per_axis(value, names: tuple[str, ...], what: str, *, minimum: int = 1) -> tuple[int, ...]:
    """An int for every axis in ``names`` from one int, one per axis in order, or ``{name: int}``."""
    if isinstance(value, Mapping):
        unknown = [k for k in value if name_of(k) not in names]
        if unknown:
            raise ArgumentError(f"{what}: {unknown} are not among the axes {names}")
        missing = [n for n in names if n not in {name_of(k) for k in value}]
        if missing:
            raise ArgumentError(f"{what}: no value for axis {missing[0]!r} (give every one of {names})")
        value = tuple(value[k] for n in names for k in value if name_of(k) == n)
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,) * len(names)
    value = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if len(value) != len(names):
        raise ArgumentError(f"{what}={value!r}: give one int, one per axis {names}, or a dict by name")
    for n, v in zip(names, value):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
            raise ArgumentError(f"{what}: axis {n!r} needs an int >= {minimum}, got {v!r}")
    return tuple(int(v) for v in value)


def padding_spec(padding, names: tuple[str, ...], what: str):
    """``"SAME"``/``"VALID"``, or a ``(low, high)`` pair per axis, from: one int, one entry (int or
    pair) per axis, or ``{name: int or pair}``."""
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ArgumentError(f"{what}: padding={padding!r}; use 'SAME', 'VALID', ints or (low, high) pairs")
        return padding.upper()
    if isinstance(padding, Mapping):
        unknown = [k for k in padding if name_of(k) not in names]
        if unknown:
            raise ArgumentError(f"{what}: padding for {unknown}, which are not among the axes {names}")
        by_name = {name_of(k): v for k, v in padding.items()}
        entries = tuple(by_name.get(n, 0) for n in names)  # an axis left out is not padded
    elif isinstance(padding, (int, np.integer)) and not isinstance(padding, bool):
        entries = (padding,) * len(names)
    elif isinstance(padding, (tuple, list)) and len(padding) == len(names):
        entries = tuple(padding)
    else:
        raise ArgumentError(
            f"{what}: padding={padding!r}; give one int, one int or (low, high) pair per axis {names}, "
            "or a dict by name"
        )
    pairs = []
    for n, e in zip(names, entries):
        pair = (e, e) if isinstance(e, (int, np.integer)) else tuple(e) if isinstance(e, (tuple, list)) else None
        if (
            pair is None
            or len(pair) != 2
            or any(isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 0 for p in pair)
        ):
            raise ArgumentError(
                f"{what}: padding of axis {n!r} must be an int >= 0 or a (low, high) pair of them, got {e!r}"
            )
        pairs.append((int(pair[0]), int(pair[1])))
    return tuple(pairs)


def explicit_padding(padding, sizes, windows, strides) -> tuple[tuple[int, int], ...]:
    """``(low, high)`` per axis; "SAME" and "VALID" resolved as jax.lax does (SAME: out = ceil(in / stride))."""
    if isinstance(padding, str):
        return tuple(tuple(p) for p in jax.lax.padtype_to_pads(sizes, windows, strides, padding))
    return padding


def output_size(what: str, axis: Axis, pad: tuple[int, int], window: int, stride: int) -> int:
    """Windows that fit along ``axis`` after padding; a window larger than the padded axis is an error."""
    span = axis.size + pad[0] + pad[1]
    if window > span:
        raise ArgumentError(
            f"{what}: the window of {window} along axis {axis.name!r} is larger than the axis "
            f"(size {axis.size}, padded {pad} to {span}); pad it or use a smaller kernel"
        )
    return (span - window) // stride + 1


# ---- the layers ---------------------------------------------------------------------------------


def _channel_axes(In, Out, what: str) -> None:
    for label, a in (("In", In), ("Out", Out)):
        if not isinstance(a, Axis):
            raise AxisError(f"{what}: {label} must be an Axis with a size, got {a!r}")


def _check_groups(groups, In: Axis, Out: Axis, what: str) -> int:
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ArgumentError(f"{what}: groups must be an int >= 1, got {groups!r}")
    for a in (In, Out):
        if a.size % groups:
            raise ArgumentError(f"{what}: groups={groups} does not divide the {a.size} channels of axis {a.name!r}")
    return int(groups)


def _geometry(what: str, Spatial, In: Axis, Out: Axis, groups, kernel_size, stride, dilation):
    """The checked spatial names, groups, and per-axis kernel size, stride and dilation of a conv layer."""
    names = spatial_names(Spatial, what)
    _channel_axes(In, Out, what)
    if set(names) & {In.name, Out.name}:
        raise AxisError(f"{what}: the channel axes {In.name!r}/{Out.name!r} cannot also be spatial axes {names}")
    groups = _check_groups(groups, In, Out, what)
    return (
        names,
        groups,
        per_axis(kernel_size, names, f"{what} kernel_size"),
        per_axis(stride, names, f"{what} stride"),
        per_axis(dilation, names, f"{what} dilation"),
    )


def _layout(x: NamedArray, spatial: tuple[str, ...], In: Axis, what: str):
    """Check ``x`` and fold its batch axes into one; returns (folded x, its batch axes)."""
    expect_named(x, what)
    for n in spatial:
        if n not in x.names:
            raise AxisError(f"{what}: spatial axis {n!r} is not among the input's axes {format_axes(x.axes)}")
    x.resolve_axis(In)  # present, and of the size the layer was made for
    batch = tuple(a for a in x.axes if a.name not in spatial and a.name != In.name)
    if len(batch) == 1:
        return x, batch
    if not batch:
        return x.broadcast_axis(Axis(_BATCH, 1)), batch
    return x.flatten_axes(batch, _BATCH), batch


def _convolve(x: NamedArray, kernel: jax.Array, In: Axis, Out: Axis, spatial, batch, out_sizes, **conv) -> NamedArray:
    """``conv_general_dilated`` with dimension numbers read from ``x``'s names; the output keeps
    ``x``'s axis order with In replaced by Out. ``kernel`` is laid out (Out, In / groups, *spatial)."""
    pos = {a.name: i for i, a in enumerate(x.axes)}
    n = pos[batch[0].name] if len(batch) == 1 else pos[_BATCH]
    lhs = (n, pos[In.name], *(pos[s] for s in spatial))
    numbers = jax.lax.ConvDimensionNumbers(lhs, tuple(range(kernel.ndim)), lhs)
    dtype = jnp.result_type(x.dtype, kernel.dtype)
    y = jax.lax.conv_general_dilated(x.array.astype(dtype), kernel.astype(dtype), dimension_numbers=numbers, **conv)
    sizes = dict(zip(spatial, out_sizes))
    axes = tuple(Out if a.name == In.name else a.resize(sizes[a.name]) if a.name in sizes else a for a in x.axes)
    out = unchecked(y, axes)
    if len(batch) != 1:
        out = out[_BATCH, 0] if not batch else out.unflatten_axis(_BATCH, batch)
    return out


def _finish(y: NamedArray, x_axes, In: Axis, Out: Axis, bias) -> NamedArray:
    y = y.rearrange(tuple(Out.name if a.name == In.name else a.name for a in x_axes))
    if bias is not None:
        y = y + bias
    return shard(y)


def _kernel_axis(a: Axis, other: Axis, groups: int, suffix: str) -> Axis:
    """A channel axis of the kernel at ``1/groups`` of its size, renamed if the other channel axis shares its name."""
    a = a.resize(a.size // groups)
    return a.alias(a.name + suffix) if a.name == other.name else a


def _init_weights(key, axes, fan_in: int, bias_axis: Axis, use_bias: bool, dtype):
    # equinox's (and torch's) default: uniform in ±1/sqrt(fan_in) for the kernel and the bias
    lim = 1 / math.sqrt(fan_in)
    kw, kb = jax.random.split(key)
    weight = nmr.uniform(kw, axes, dtype, minval=-lim, maxval=lim)
    bias = nmr.uniform(kb, bias_axis, dtype, minval=-lim, maxval=lim) if use_bias else None
    return weight, bias


class Conv(eqx.Module):
    """An N-d convolution over the spatial axes named in ``Spatial``, mapping channel axis ``In`` to ``Out``.

    The weight has axes ``(Out, In', *Spatial)`` (torch's layout): ``In'`` is ``In`` at ``1/groups``
    of its size (named ``<In>_in`` when ``In`` and ``Out`` share a name) and the kernel axes carry
    the spatial names at the kernel's sizes. The bias has axis ``Out``. The output is constrained
    to the current compute mapping.
    """

    weight: NamedArray
    bias: NamedArray | None
    Spatial: tuple[str, ...] = eqx.field(static=True)
    In: Axis = eqx.field(static=True)
    Out: Axis = eqx.field(static=True)
    kernel_size: tuple[int, ...] = eqx.field(static=True)
    stride: tuple[int, ...] = eqx.field(static=True)
    padding: str | tuple[tuple[int, int], ...] = eqx.field(static=True)
    dilation: tuple[int, ...] = eqx.field(static=True)
    groups: int = eqx.field(static=True)

    @staticmethod
    def init(
        Spatial: AxisSelection,
        In: Axis,
        Out: Axis,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        use_bias: bool = True,
        *,
        key,
        dtype=jnp.float32,
    ) -> Conv:
        """Args:
            Spatial: the names of the 1, 2 or 3 spatial axes (``"height width"``, ``("height", "width")``).
            In, Out: the input and output channel axes (they may share a name: the output's replaces the input's).
            kernel_size, stride, dilation: an int for every spatial axis, one per axis (in ``Spatial``
                order), or a dict by name.
            padding: ``"SAME"`` (output size ``ceil(in / stride)``), ``"VALID"`` (no padding), an
                int, one int or ``(low, high)`` pair per axis, or a dict by name.
            groups: split the channels into ``groups`` independent convolutions; it must divide
                both ``In`` and ``Out``.
            use_bias: add a learned bias over ``Out``.

        Weights and bias are uniform in ``±1/sqrt(fan_in)``, ``fan_in = In.size / groups * prod(kernel_size)``.
        """
        names, groups, kernel_size, stride, dilation = _geometry(
            "Conv", Spatial, In, Out, groups, kernel_size, stride, dilation
        )
        padding = padding_spec(padding, names, "Conv")
        kernel_in = _kernel_axis(In, Out, groups, "_in")
        axes = (Out, kernel_in, *(Axis(n, k) for n, k in zip(names, kernel_size)))
        weight, bias = _init_weights(key, axes, kernel_in.size * math.prod(kernel_size), Out, use_bias, dtype)
        return Conv(weight, bias, names, In, Out, kernel_size, stride, padding, dilation, groups)

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        if self.Out.name != self.In.name and self.Out.name in getattr(x, "names", ()):
            raise AxisError(f"Conv makes axis {self.Out.name!r} but the input {format_axes(x.axes)} already has it")
        folded, batch = _layout(x, self.Spatial, self.In, "Conv")
        axes = [folded.resolve_axis(n) for n in self.Spatial]
        windows = [d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation)]
        pads = explicit_padding(self.padding, [a.size for a in axes], windows, self.stride)
        out_sizes = [output_size("Conv", a, p, w, s) for a, p, w, s in zip(axes, pads, windows, self.stride)]
        y = _convolve(
            folded,
            self.weight.array,
            self.In,
            self.Out,
            self.Spatial,
            batch,
            out_sizes,
            window_strides=self.stride,
            padding=pads,
            rhs_dilation=self.dilation,
            feature_group_count=self.groups,
        )
        return _finish(y, x.axes, self.In, self.Out, self.bias)


class ConvTranspose(eqx.Module):
    """The transpose (gradient with respect to its input) of a :class:`Conv`, as ``torch.nn.ConvTranspose*d``.

    Along each spatial axis the output has ``(in - 1) * stride - low - high + dilation * (kernel - 1)
    + output_padding + 1`` entries, where ``(low, high)`` is the padding. ``"VALID"`` is no padding;
    ``"SAME"`` makes the output ``in * stride`` long (the transpose of a ``"SAME"`` Conv).

    The weight has torch's layout ``(In, Out', *Spatial)``: ``Out'`` is ``Out`` at ``1/groups`` of its
    size (named ``<Out>_out`` when ``In`` and ``Out`` share a name).
    """

    weight: NamedArray
    bias: NamedArray | None
    Spatial: tuple[str, ...] = eqx.field(static=True)
    In: Axis = eqx.field(static=True)
    Out: Axis = eqx.field(static=True)
    kernel_size: tuple[int, ...] = eqx.field(static=True)
    stride: tuple[int, ...] = eqx.field(static=True)
    padding: tuple[tuple[int, int], ...] = eqx.field(static=True)
    output_padding: tuple[int, ...] = eqx.field(static=True)
    dilation: tuple[int, ...] = eqx.field(static=True)
    groups: int = eqx.field(static=True)

    @staticmethod
    def init(
        Spatial: AxisSelection,
        In: Axis,
        Out: Axis,
        kernel_size,
        stride=1,
        padding=0,
        output_padding=0,
        dilation=1,
        groups: int = 1,
        use_bias: bool = True,
        *,
        key,
        dtype=jnp.float32,
    ) -> ConvTranspose:
        """Arguments as :meth:`Conv.init`, plus ``output_padding`` (per axis, as ``stride``): extra
        entries at the high end of each spatial axis, smaller than that axis's stride or dilation
        (it picks among the input sizes a strided Conv maps to the same output size)."""
        names, groups, kernel_size, stride, dilation = _geometry(
            "ConvTranspose", Spatial, In, Out, groups, kernel_size, stride, dilation
        )
        output_padding = per_axis(output_padding, names, "ConvTranspose output_padding", minimum=0)
        for n, op, s, d in zip(names, output_padding, stride, dilation):
            if op >= max(s, d):
                raise ArgumentError(
                    f"ConvTranspose: output_padding {op} on axis {n!r} must be smaller than its stride "
                    f"{s} or dilation {d}"
                )
        padding = padding_spec(padding, names, "ConvTranspose")
        if padding == "VALID":
            padding = ((0, 0),) * len(names)
        elif padding == "SAME":
            windows = [d * (k - 1) + 1 for k, d in zip(kernel_size, dilation)]
            totals = [max(w - s, 0) for w, s in zip(windows, stride)]
            padding = tuple((t // 2, t - t // 2) for t in totals)
            # a window shorter than the stride leaves a gap at the end that only output padding fills
            output_padding = tuple(op + max(s - w, 0) for op, s, w in zip(output_padding, stride, windows))
        kernel_out = _kernel_axis(Out, In, groups, "_out")
        axes = (In, kernel_out, *(Axis(n, k) for n, k in zip(names, kernel_size)))
        # torch's fan-in for a transposed kernel: its dimension 1 (Out / groups) times the kernel size
        weight, bias = _init_weights(key, axes, kernel_out.size * math.prod(kernel_size), Out, use_bias, dtype)
        return ConvTranspose(
            weight, bias, names, In, Out, kernel_size, stride, padding, output_padding, dilation, groups
        )

    def _conv_kernel(self) -> jax.Array:
        """The kernel of the equivalent forward convolution: (Out, In / groups, *spatial), flipped in space."""
        w = self.weight.array
        g, i, o = self.groups, self.In.size // self.groups, self.Out.size // self.groups
        k = w.shape[2:]
        w = w.reshape(g, i, o, *k).swapaxes(1, 2).reshape(g * o, i, *k)
        return jnp.flip(w, axis=tuple(range(2, w.ndim)))

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        if self.Out.name != self.In.name and self.Out.name in getattr(x, "names", ()):
            raise AxisError(
                f"ConvTranspose makes axis {self.Out.name!r} but the input {format_axes(x.axes)} already has it"
            )
        folded, batch = _layout(x, self.Spatial, self.In, "ConvTranspose")
        pads, out_sizes = [], []
        for n, k, s, d, (lo, hi), op in zip(
            self.Spatial, self.kernel_size, self.stride, self.dilation, self.padding, self.output_padding
        ):
            a, reach = folded.resolve_axis(n), d * (k - 1)
            # the input dilated by the stride, padded so that a plain conv of the flipped kernel is the transpose
            pads.append((reach - lo, reach - hi + op))
            size = (a.size - 1) * s - lo - hi + reach + op + 1
            if size < 1:
                raise ArgumentError(f"ConvTranspose: padding {(lo, hi)} on axis {n!r} (size {a.size}) leaves no output")
            out_sizes.append(size)
        y = _convolve(
            folded,
            self._conv_kernel(),
            self.In,
            self.Out,
            self.Spatial,
            batch,
            out_sizes,
            window_strides=(1,) * len(self.Spatial),
            padding=pads,
            lhs_dilation=self.stride,
            rhs_dilation=self.dilation,
            feature_group_count=self.groups,
        )
        return _finish(y, x.axes, self.In, self.Out, self.bias)
