"""Linear and Embedding: the two layers that make new activations from weights."""

from __future__ import annotations

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._axis import Axis, AxisError, AxisSelection, NamedError, as_selectors, format_axes
from .._core import NamedArray, expect_named
from .._einsum import dot
from .._index import concrete, first_flagged
from .. import random as nmr
from ..partitioning import shard
from .._shape import zeros


# std of a standard normal truncated to [-2, 2] (jax.random.truncated_normal's default bounds);
# dividing by it makes the weights' std what init() says (as jax.nn.initializers.variance_scaling does).
_TRUNCATED_NORMAL_STD = 0.87962566103423978


def _axes(axes: AxisSelection, what: str) -> tuple[Axis, ...]:
    out = as_selectors(axes)
    for a in out:
        if not isinstance(a, Axis):
            raise AxisError(f"{what} needs Axis objects with sizes, got {a!r}")
    return out  # type: ignore[return-value]


class Linear(eqx.Module):
    """``y = x · W + b`` contracting the ``In`` axes; ``In`` and ``Out`` may each be several axes.

    The weight has axes ``In + Out``; the output is constrained to the current compute mapping.
    """

    weight: NamedArray
    bias: NamedArray | None
    In: tuple[Axis, ...] = eqx.field(static=True)
    Out: tuple[Axis, ...] = eqx.field(static=True)

    @staticmethod
    def init(In: AxisSelection, Out: AxisSelection, *, key, use_bias: bool = True, init_scale: float = 1.0,
             dtype=jnp.float32) -> Linear:
        """Weights ~ normal truncated at two standard deviations, with std ``init_scale / sqrt(fan_in)``
        (fan_in = product of the In sizes); bias zero."""
        In, Out = _axes(In, "Linear In"), _axes(Out, "Linear Out")
        clash = {a.name for a in In} & {a.name for a in Out}
        if clash:
            raise AxisError(f"Linear: axes {sorted(clash)} are both input and output; rename the output axis")
        fan_in = math.prod(a.size for a in In)
        std = init_scale / math.sqrt(fan_in) / _TRUNCATED_NORMAL_STD
        w = nmr.truncated_normal(key, In + Out, dtype) * std
        b = zeros(Out, dtype) if use_bias else None
        return Linear(w.astype(dtype), b, In, Out)

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        check_input(self, x)
        y = dot(x, self.weight, axis=tuple(a.name for a in self.In))
        if self.bias is not None:
            y = y + self.bias
        return shard(y)


def check_input(layer, x: NamedArray) -> None:
    """``x`` has every ``In`` axis of ``layer`` (a Linear or a quantized one) and none of its ``Out`` axes."""
    what = type(layer).__name__
    expect_named(x, what)
    missing = [a.name for a in layer.In if a.name not in x.names]
    if missing:
        raise AxisError(f"{what} expects input axes {format_axes(layer.In)}; {missing} missing from {format_axes(x.axes)}")
    # An output name already on the input would be matched elementwise by the contraction
    # (a silent wrong answer), not created.
    taken = [a.name for a in layer.Out if a.name in x.names]
    if taken:
        raise AxisError(f"{what} produces axes {format_axes(layer.Out)} but the input {format_axes(x.axes)} already has "
                        f"{taken}; rename that input axis first")


class Embedding(eqx.Module):
    """Token embedding with axes ``(Vocab, Embed)``; ``unembed`` is the tied output head.

    An id outside ``[0, vocab)`` is not an error by default: like any XLA gather, the lookup
    clamps it (ids >= vocab read the last row) and a negative id counts from the end, as in
    numpy. ``check_ids=True`` (at init, or ``dataclasses.replace(emb, check_ids=True)`` on a
    loaded model) checks every lookup instead: eagerly a NamedError naming the first bad id
    and where it is; under jit an ``equinox.EquinoxRuntimeError`` when the program runs (a
    check on device, so it costs a reduction over the ids per call).
    """

    weight: NamedArray
    Vocab: Axis = eqx.field(static=True)
    Embed: Axis = eqx.field(static=True)
    check_ids: bool = eqx.field(static=True, default=False)

    @staticmethod
    def init(Vocab: Axis, Embed: Axis, *, key, init_scale: float = 0.02, dtype=jnp.float32,
             check_ids: bool = False) -> Embedding:
        w = nmr.normal(key, (Vocab, Embed), dtype) * init_scale
        return Embedding(w, Vocab, Embed, check_ids)

    def __call__(self, ids: NamedArray) -> NamedArray:
        """Look up integer ``ids`` (any axes): the result has ``ids.axes + (Embed,)``."""
        expect_named(ids, "Embedding", "ids")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise AxisError(f"Embedding takes integer token ids, got dtype {ids.dtype}")
        out = self.weight.take(self.Vocab.name, ids)
        if self.check_ids:
            out = _checked(out, ids, self.Vocab)
        return shard(out)

    def unembed(self, x: NamedArray) -> NamedArray:
        """Logits over Vocab: ``x · Wᵀ`` contracting Embed."""
        expect_named(x, "Embedding.unembed")
        return shard(dot(x, self.weight, axis=self.Embed.name))


def _checked(out: NamedArray, ids: NamedArray, Vocab: Axis) -> NamedArray:
    """``out``, after making sure every id is in ``[0, vocab)``."""
    bad = (ids.array < 0) | (ids.array >= Vocab.size)
    known = concrete(bad)
    if known is None:
        msg = f"Embedding: a token id is outside [0, {Vocab.size}) (vocab {Vocab.name!r}); it would have been clamped"
        return NamedArray._unchecked(eqx.error_if(out.array, jnp.any(bad), msg), out.axes)
    if known.any():
        where, at = first_flagged(known, ids.axes)
        raise NamedError(f"Embedding: token id {int(np.asarray(ids.array)[where])} at ({at}) is outside "
                         f"[0, {Vocab.size}) (vocab {Vocab.name!r}); {int(known.sum())} id(s) out of range in all")
    return out
