"""LayerNorm and RMSNorm, both on the one core ``nm.standardize`` (``(x - mean) * rsqrt(variance +
eps)``): LayerNorm with the input's mean and variance, RMSNorm about zero with its mean square.
Statistics are computed in float32, or float64 for a float64 input (``_ops.wide``)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import equinox as eqx

from .. import _ops as ops
from .._axis import ArgumentError, Axis
from .._core import NamedArray, expect_named
from .._shape import flatten_axes, ones, unflatten_axis, zeros


class LayerNorm(eqx.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over ``axis``: one axis, or several (the
    statistics then run over all of them, and the weight and bias have them all)."""

    weight: NamedArray | None
    bias: NamedArray | None
    axis: Axis | tuple[Axis, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-5)
    keep_full_precision: ClassVar[bool] = True  # precision.cast_for_compute leaves these params alone
    no_weight_decay: ClassVar[bool] = True  # an optimizer's decay mask leaves them out (trainer's decay_mask)

    @staticmethod
    def init(
        axis: Axis | tuple[Axis, ...], *, eps: float = 1e-5, use_weight: bool = True, use_bias: bool = True
    ) -> LayerNorm:
        axis = tuple(axis) if isinstance(axis, (tuple, list)) else axis
        return LayerNorm(ones(axis) if use_weight else None, zeros(axis) if use_bias else None, axis, eps)

    def __call__(self, x: NamedArray) -> NamedArray:
        names = _names(self.axis)
        x32 = expect_named(x, "LayerNorm").astype(ops.wide(x.dtype))
        y = ops.standardize(x32, names, epsilon=self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.astype(ops.floating(x.dtype))

    # -- torch's layout, for state dicts with flatten=True (Haliax's flatten_for_export) --

    def flatten_for_export(self) -> LayerNorm:
        """This norm with its weight and bias over one axis (several axes merged, row-major), as
        torch's ``LayerNorm(d * e)`` holds them; ``unflatten_from_export(template)`` undoes it."""
        if not isinstance(self.axis, tuple) or len(self.axis) == 1:
            return self
        flat = Axis("__OUT__", math.prod(a.size for a in self.axis))

        def merge(p):
            return None if p is None else flatten_axes(p, _names(self.axis), flat)

        return dataclasses.replace(self, weight=merge(self.weight), bias=merge(self.bias), axis=flat)

    def unflatten_from_export(self, template: LayerNorm) -> LayerNorm:
        """This flattened norm back in ``template``'s axes."""
        if not isinstance(template.axis, tuple) or len(template.axis) == 1:
            return dataclasses.replace(template, weight=self.weight, bias=self.bias)

        def split(p, t):
            return None if p is None else unflatten_axis(p, self.axis.name, template.axis).rearrange(t.names)

        return dataclasses.replace(
            template, weight=split(self.weight, template.weight), bias=split(self.bias, template.bias)
        )


def _names(axis) -> str | tuple[str, ...]:
    return tuple(a.name for a in axis) if isinstance(axis, tuple) else axis.name


class RMSNorm(eqx.Module):
    """``x / sqrt(mean(x²) + eps) * weight`` over ``axis`` (Llama), or ``* (1 + weight)`` with
    ``unit_offset`` (Gemma, whose weights start at 0). ``axis`` is one axis or several (OLMo 2
    normalises a whole q/k projection, ``(heads, head_size)``); the statistics and the product
    are float32 (float64 for a float64 input)."""

    weight: NamedArray | None
    axis: Axis | tuple[Axis, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-6)
    unit_offset: bool = eqx.field(static=True, default=False)
    keep_full_precision: ClassVar[bool] = True
    no_weight_decay: ClassVar[bool] = True

    @staticmethod
    def init(
        axis: Axis | tuple[Axis, ...], *, eps: float = 1e-6, use_weight: bool = True, unit_offset: bool = False
    ) -> RMSNorm:
        if unit_offset and not use_weight:
            raise ArgumentError("RMSNorm: unit_offset scales by (1 + weight), so it needs use_weight=True")
        axis = tuple(axis) if isinstance(axis, (tuple, list)) else axis
        weight = None if not use_weight else zeros(axis) if unit_offset else ones(axis)
        return RMSNorm(weight, axis, eps, unit_offset)

    def __call__(self, x: NamedArray) -> NamedArray:
        names = _names(self.axis)
        x32 = expect_named(x, "RMSNorm").astype(ops.wide(x.dtype))
        y = ops.standardize(x32, names, mean=0.0, variance=ops.square(x32).mean(names), epsilon=self.eps)
        if self.weight is not None:
            w = self.weight.astype(x32.dtype)
            y = y * (1.0 + w if self.unit_offset else w)
        return y.astype(ops.floating(x.dtype))
