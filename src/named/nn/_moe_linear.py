"""MoELinear (Haliax's): one Linear per expert, applied to token rows grouped by expert with one
``jax.lax.ragged_dot``: the first ``group_sizes[0]`` rows through expert 0, the next
``group_sizes[1]`` through expert 1, and so on. ``nn.MoE`` routes tokens and calls the same
kernel for its gated experts; this is the building block for code that sorts tokens itself.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import random as nmr
from .._axis import ArgumentError, ArgumentTypeError, Axis, AxisError, format_axes
from .._core import NamedArray, expect_named
from .._index import concrete
from .._shape import zeros
from ..partitioning import shard
from ._linear import TRUNCATED_NORMAL_STD


class MoELinear(eqx.Module):
    """``y[rows of expert e] = x[rows of expert e] · W[e] + b``; the weight has axes ``(Experts,
    In, Out)`` (``(Experts, Out, In)`` with ``out_first``), the bias ``(Out,)``, shared by the
    experts as in Haliax."""

    weight: NamedArray
    bias: NamedArray | None
    Experts: Axis = eqx.field(static=True)
    In: Axis = eqx.field(static=True)
    Out: Axis = eqx.field(static=True)
    use_gmm: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(
        Experts: Axis,
        In: Axis,
        Out: Axis,
        *,
        key,
        use_bias: bool = True,
        out_first: bool = False,
        init_scale: float = 1.0,
        use_gmm: bool = False,
        dtype=jnp.float32,
    ) -> MoELinear:
        """Each expert's weights as ``Linear.init``'s: std ``init_scale / sqrt(In.size)``, truncated
        at two standard deviations. ``use_gmm`` (Haliax's Pallas kernel switch) is kept for code
        that passes it; the product is always ``jax.lax.ragged_dot``, whose kernel XLA picks."""
        for what, a in (("Experts", Experts), ("In", In), ("Out", Out)):
            if not isinstance(a, Axis):
                raise AxisError(f"MoELinear.init: {what} must be one Axis with a size, got {a!r}")
        if len({Experts.name, In.name, Out.name}) != 3:
            raise AxisError(
                f"MoELinear.init: Experts, In and Out need three names, got {format_axes((Experts, In, Out))}"
            )
        std = init_scale / math.sqrt(In.size) / TRUNCATED_NORMAL_STD
        w = nmr.truncated_normal(key, (Experts, Out, In) if out_first else (Experts, In, Out), dtype) * std
        return MoELinear(w.astype(dtype), zeros(Out, dtype) if use_bias else None, Experts, In, Out, use_gmm)

    @property
    def out_first(self) -> bool:
        """Whether the weight stores ``Out`` before ``In`` (torch's order)."""
        return self.weight.index_of(self.Out) < self.weight.index_of(self.In)

    def __call__(self, x: NamedArray, group_sizes, *, key=None) -> NamedArray:
        """``x`` (axes: ``In`` and the rows, e.g. ``tokens``; several row axes are taken
        row-major) and ``group_sizes`` (integers over ``Experts``, rows per expert, in order; a
        NamedArray or a plain 1-d array). Returns ``x``'s axes with ``In`` replaced by ``Out``."""
        expect_named(x, "MoELinear")
        if self.In.name not in x.names:
            raise AxisError(f"MoELinear expects input axis {self.In.name!r}; the input has {format_axes(x.axes)}")
        x.resolve_axis(self.In)  # at the weight's size
        if self.Out.name in x.names or self.Experts.name in x.names:
            raise AxisError(
                f"MoELinear: the input {format_axes(x.axes)} already has {self.Out.name!r} or "
                f"{self.Experts.name!r}; rename it first"
            )
        sizes = (
            group_sizes.rearrange((self.Experts.name,)).array
            if isinstance(group_sizes, NamedArray)
            else jnp.asarray(group_sizes)
        )
        if sizes.shape != (self.Experts.size,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
            raise ArgumentTypeError(
                f"MoELinear: group_sizes must be {self.Experts.size} integers (one per expert), "
                f"got shape {tuple(sizes.shape)} {sizes.dtype}"
            )
        rows = tuple(a for a in x.axes if a.name != self.In.name)
        known = concrete(sizes)
        if known is not None and int(known.sum()) != math.prod(a.size for a in rows):
            raise ArgumentError(
                f"MoELinear: group_sizes {known.tolist()} count {int(known.sum())} rows, but the input "
                f"{format_axes(x.axes)} has {math.prod(a.size for a in rows)}; rows past the groups would "
                "come out as zeros"
            )
        lhs = x.rearrange(tuple(a.name for a in rows) + (self.In.name,)).array.reshape(-1, self.In.size)
        rhs = self.weight.rearrange((self.Experts.name, self.In.name, self.Out.name)).array
        out = jax.lax.ragged_dot(lhs, rhs, sizes.astype(jnp.int32))
        y = NamedArray(out.reshape(tuple(a.size for a in rows) + (self.Out.size,)), rows + (self.Out,))
        if self.bias is not None:
            y = y + self.bias
        order = tuple(self.Out.name if a.name == self.In.name else a.name for a in x.axes)
        return shard(y.rearrange(order))
