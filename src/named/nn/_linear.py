"""Linear and Embedding: the two layers that make new activations from weights."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .. import random as nmr
from .._axis import (
    ArgumentError,
    ArgumentTypeError,
    Axis,
    AxisError,
    AxisSelection,
    NamedError,
    as_selectors,
    format_axes,
)
from .._core import NamedArray, expect_named, unchecked
from .._einsum import dot
from .._index import concrete, first_flagged
from .._shape import zeros
from ..partitioning import shard
from ._gathered_dot import gathered_dot
from ._reparam import AbstractEmbeddingReparam, AbstractLinearReparam, EmbeddingStandardParam, LinearStandardParam

# std of a standard normal truncated to [-2, 2] (jax.random.truncated_normal's default bounds);
# dividing by it makes the weights' std what init() says (as jax.nn.initializers.variance_scaling does).
TRUNCATED_NORMAL_STD = 0.87962566103423978


def _axes(axes: AxisSelection, what: str) -> tuple[Axis, ...]:
    out = as_selectors(axes)
    for a in out:
        if not isinstance(a, Axis):
            raise AxisError(f"{what} needs Axis objects with sizes, got {a!r}")
    return out  # type: ignore[return-value]


def _spec(axes: AxisSelection, what: str) -> Axis | tuple[Axis, ...]:
    """``In``/``Out`` as the caller wrote them: one Axis stays an Axis (``layer.Out.size``, as in
    Haliax), several become a tuple."""
    out = _axes(axes, what)
    return axes if isinstance(axes, Axis) else out


class Linear(eqx.Module):
    """``y = x · W + b`` contracting the ``In`` axes; ``In`` and ``Out`` may each be several axes.

    The weight has axes ``In + Out`` (``Out + In`` with ``out_first=True``, torch's order); the
    output is constrained to the current compute mapping. ``In`` and ``Out`` keep the caller's
    spelling: one Axis, or a tuple of them (``as_selectors`` turns either into a tuple).
    ``reparam_cls`` is Haliax's abc-parametrization (``nn.mup.OutputLinearMup`` and friends):
    it scales the init, the output and (through ``nn.mup.scale_reparam_updates``) the
    learning rate.
    """

    weight: NamedArray
    bias: NamedArray | None
    In: Axis | tuple[Axis, ...] = eqx.field(static=True)
    Out: Axis | tuple[Axis, ...] = eqx.field(static=True)
    reparam_cls: type[AbstractLinearReparam] = eqx.field(static=True, default=LinearStandardParam)

    @staticmethod
    def init(
        In: AxisSelection,
        Out: AxisSelection,
        *,
        key,
        use_bias: bool = True,
        init_scale: float = 1.0,
        dtype=jnp.float32,
        out_first: bool = False,
        reparam_cls: type[AbstractLinearReparam] = LinearStandardParam,
    ) -> Linear:
        """Weights ~ normal truncated at two standard deviations, with std ``init_scale *
        reparam_cls.init_scale(In, Out)`` (the standard ``1 / sqrt(fan_in)``, fan_in = product of
        the In sizes); bias zero."""
        In, Out = _spec(In, "Linear In"), _spec(Out, "Linear Out")
        ins, outs = as_selectors(In), as_selectors(Out)
        clash = {a.name for a in ins} & {a.name for a in outs}
        if clash:
            raise AxisError(f"Linear: axes {sorted(clash)} are both input and output; rename the output axis")
        if not (isinstance(reparam_cls, type) and issubclass(reparam_cls, AbstractLinearReparam)):
            raise ArgumentError(
                f"Linear: reparam_cls must be a class from nn.mup (LinearStandardParam, InputLinearMup, "
                f"HiddenLinearMup, OutputLinearMup), got {reparam_cls!r}"
            )
        std = init_scale * reparam_cls.init_scale(In, Out) / TRUNCATED_NORMAL_STD
        w = nmr.truncated_normal(key, (outs + ins) if out_first else (ins + outs), dtype) * std
        b = zeros(outs, dtype) if use_bias else None
        return Linear(w.astype(dtype), b, In, Out, reparam_cls)

    @property
    def reparam(self) -> AbstractLinearReparam:
        """The layer's parametrization (``active_scale``, ``lr_scale``), as in Haliax."""
        return self.reparam_cls(self.In, self.Out)

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        check_input(self, x)
        contract = tuple(a.name for a in as_selectors(self.In))
        y = gathered_dot(x, self.weight, contract)  # None unless nn.gather_per_use applies
        if y is None:
            y = dot(x, self.weight, axis=contract)
        scale = self.reparam.active_scale
        if scale != 1:
            y = y * jnp.asarray(scale, y.dtype)
        if self.bias is not None:
            y = y + self.bias
        return shard(y)

    # -- torch's layout, for state dicts with flatten=True (Haliax's flatten_for_export) --

    def flatten_for_export(self) -> Linear:
        """This layer with its weight laid out as torch's ``nn.Linear`` holds it: ``[out, in]``,
        each side one axis (several In or Out axes merged, row-major, into ``__IN__``/``__OUT__``),
        the bias ``[out]``. Axes beyond In and Out (a stack's layers) stay in front. It computes
        what this layer computes; ``unflatten_from_export(template)`` restores the template's axes."""
        ins, outs = as_selectors(self.In), as_selectors(self.Out)
        In, Out = _flat_axis(ins, "__IN__"), _flat_axis(outs, "__OUT__")
        extra = tuple(a.name for a in self.weight.axes if a not in ins + outs)
        w = self.weight.rearrange(extra + tuple(a.name for a in outs + ins))
        w = _merge(_merge(w, outs, Out), ins, In)
        b = (
            None
            if self.bias is None
            else _merge(
                self.bias.rearrange(
                    tuple(a.name for a in self.bias.axes if a not in outs) + tuple(a.name for a in outs)
                ),
                outs,
                Out,
            )
        )
        return dataclasses.replace(self, weight=w, bias=b, In=In, Out=Out)

    def unflatten_from_export(self, template: Linear) -> Linear:
        """This flattened layer back in ``template``'s axes and axis order (the inverse of
        ``template.flatten_for_export()``)."""
        ins, outs = as_selectors(template.In), as_selectors(template.Out)
        w = _split(_split(self.weight, _flat_axis(outs, "__OUT__"), outs), _flat_axis(ins, "__IN__"), ins)
        b = None if self.bias is None else _split(self.bias, _flat_axis(outs, "__OUT__"), outs)
        return dataclasses.replace(
            template,
            weight=w.rearrange(template.weight.names),
            bias=None if b is None else b.rearrange(template.bias.names),
        )


def _flat_axis(axes: tuple[Axis, ...], name: str) -> Axis:
    return axes[0] if len(axes) == 1 else Axis(name, math.prod(a.size for a in axes))


def _merge(x: NamedArray, axes: tuple[Axis, ...], into: Axis) -> NamedArray:
    """``axes`` (adjacent in ``x``, in order) merged into one, on the array or its shape alone."""
    if len(axes) == 1:
        return x
    i = x.index_of(axes[0])
    new = x.axes[:i] + (into,) + x.axes[i + len(axes) :]
    return unchecked(x.array.reshape(tuple(a.size for a in new)), new)


def _split(x: NamedArray, flat: Axis, axes: tuple[Axis, ...]) -> NamedArray:
    if len(axes) == 1:
        return x
    i = x.index_of(flat)
    new = x.axes[:i] + axes + x.axes[i + 1 :]
    return unchecked(x.array.reshape(tuple(a.size for a in new)), new)


def check_input(layer, x: NamedArray) -> None:
    """``x`` has every ``In`` axis of ``layer`` (a Linear or a quantized one) and none of its ``Out`` axes."""
    what = type(layer).__name__
    expect_named(x, what)
    ins, outs = as_selectors(layer.In), as_selectors(layer.Out)
    missing = [a.name for a in ins if a.name not in x.names]
    if missing:
        raise AxisError(f"{what} expects input axes {format_axes(ins)}; {missing} missing from {format_axes(x.axes)}")
    # An output name already on the input would be matched elementwise by the contraction
    # (a silent wrong answer), not created.
    taken = [a.name for a in outs if a.name in x.names]
    if taken:
        raise AxisError(
            f"{what} produces axes {format_axes(outs)} but the input {format_axes(x.axes)} already has "
            f"{taken}; rename that input axis first"
        )


class Embedding(eqx.Module):
    """Token embedding with axes ``(Vocab, Embed)``; ``unembed`` is the tied output head.

    The lookup is a gather by name and follows its rule (docs/named_arrays.md, "Indexing"): ids
    known before tracing must lie in ``[-vocab, vocab)`` (a negative one counts from the end, as
    in numpy), or an AxisError names the first bad one; traced ids cannot be checked and are
    clamped as any XLA gather clamps them (ids >= vocab read the last row). ``check_ids=True``
    (at init, or ``dataclasses.replace(emb, check_ids=True)`` on a loaded model) checks every
    lookup against ``[0, vocab)``: eagerly a NamedError naming the first bad id and where it is;
    under jit an ``equinox.EquinoxRuntimeError`` when the program runs (a check on device, so it
    costs a reduction over the ids per call).
    """

    weight: NamedArray
    Vocab: Axis = eqx.field(static=True)
    Embed: Axis | tuple[Axis, ...] = eqx.field(static=True)  # one axis, or several (Haliax's AxisSpec)
    check_ids: bool = eqx.field(static=True, default=False)
    reparam_cls: type[AbstractEmbeddingReparam] = eqx.field(static=True, default=EmbeddingStandardParam)

    @staticmethod
    def init(
        Vocab: Axis,
        Embed: Axis | tuple[Axis, ...],
        *,
        key,
        init_scale: float = 0.02,
        dtype=jnp.float32,
        check_ids: bool = False,
        reparam_cls: type[AbstractEmbeddingReparam] = EmbeddingStandardParam,
    ) -> Embedding:
        """Normal weights of std ``init_scale * reparam_cls.init_scale``. ``Embed`` may be several
        axes (a lookup then gives all of them); ``reparam_cls=nn.mup.EmbeddingMup`` scales
        ``unembed``'s logits by ``1 / embed size``."""
        if not (isinstance(reparam_cls, type) and issubclass(reparam_cls, AbstractEmbeddingReparam)):
            raise ArgumentTypeError(
                f"Embedding: reparam_cls must be nn.mup.EmbeddingStandardParam or EmbeddingMup, got {reparam_cls!r}"
            )
        Embed = tuple(Embed) if isinstance(Embed, (tuple, list)) else Embed
        std = init_scale * reparam_cls.init_scale(Vocab, Embed)
        w = nmr.normal(key, (Vocab, *as_selectors(Embed)), dtype) * std
        return Embedding(w, Vocab, Embed, check_ids, reparam_cls)

    @property
    def reparam(self) -> AbstractEmbeddingReparam:
        return self.reparam_cls(self.Embed, self.Vocab)

    def __call__(self, ids: NamedArray) -> NamedArray:
        """Look up integer ``ids`` (any axes): the result has ``ids.axes + (Embed,)``."""
        expect_named(ids, "Embedding", "ids")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise AxisError(f"Embedding takes integer token ids, got dtype {ids.dtype}")
        bad = _outside(ids, self.Vocab) if self.check_ids else None  # before the gather's own, wider, check
        out = self.weight.take(self.Vocab.name, ids)
        if bad is not None:
            out = unchecked(
                eqx.error_if(
                    out.array,
                    jnp.any(bad),
                    f"Embedding: a token id is outside [0, "
                    f"{self.Vocab.size}) (vocab {self.Vocab.name!r}); "
                    "it would have been clamped",
                ),
                out.axes,
            )
        return shard(out)

    def unembed(self, x: NamedArray) -> NamedArray:
        """Logits over Vocab: ``x · Wᵀ`` contracting Embed."""
        expect_named(x, "Embedding.unembed")
        x.resolve_axis(self.Embed)  # dot would sum the weight over Embed alone for an input without it
        if self.Vocab.name in x.names:
            raise AxisError(
                f"Embedding.unembed makes the axis {self.Vocab.name!r}, which the input "
                f"{format_axes(x.axes)} already has; rename it first"
            )
        logits = dot(x, self.weight, axis=tuple(a.name for a in as_selectors(self.Embed)))
        scale = self.reparam.unembed_active_scale
        return shard(logits if scale == 1.0 else logits * scale)


def _outside(ids: NamedArray, Vocab: Axis):
    """Where ``ids`` leave ``[0, vocab)``, for the check under jit; ids known before tracing are
    checked here and now, naming the first bad one."""
    bad = (ids.array < 0) | (ids.array >= Vocab.size)
    known = concrete(bad)
    if known is not None and known.any():
        where, at = first_flagged(known, ids.axes)
        raise NamedError(
            f"Embedding: token id {int(np.asarray(ids.array)[where])} at ({at}) is outside "
            f"[0, {Vocab.size}) (vocab {Vocab.name!r}); {int(known.sum())} id(s) out of range in all"
        )
    return None if known is not None else bad
