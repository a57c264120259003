"""LoRA (Hu et al., 2021): a trainable low-rank update beside a frozen Linear.

``LoraLinear`` wraps an ``nn.Linear``: ``y = linear(x) + (alpha / rank) · (dropout(x) · A) · B``
with ``A`` over ``In + (lora_rank,)`` and ``B`` over ``(lora_rank,) + Out``. The adapters are
NamedArrays like any weight, so the mappings lay them out (``{"embed": "data"}`` splits ``A``
of an ``embed ->`` projection) and ``Stacked`` slices them per layer: a Linear inside a stack
has a ``layers`` axis on its weight, and its adapters get it too.

``B`` starts at zero, so an adapted model computes what the base computes; ``A`` is drawn as
PEFT draws it (uniform in ``±1/sqrt(fan_in)``, torch's kaiming-uniform with ``a = sqrt(5)``), so
the two start from the same distribution.

``apply`` wraps the Linears a model names, ``merge`` folds the adapters back into plain
Linears, ``trainable`` marks the adapter arrays (for ``eqx.partition``: the base stays frozen
and needs neither gradients nor optimizer state).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import random as nmr
from .._axis import ArgumentError, Axis, as_selectors, format_axes
from .._core import NamedArray, expect_named, is_named_array, named
from .._einsum import dot
from .._shape import zeros
from ..partitioning import shard
from ._basic import Dropout
from ._linear import Linear

RANK = "lora_rank"  # the adapters' own axis: a mapping may name it like any other

__all__ = ["RANK", "LoraLinear", "apply", "linear_paths", "merge", "trainable", "with_dropout_keys"]


class LoraLinear(eqx.Module):
    """A frozen ``linear`` plus ``scale · (x · lora_a) · lora_b``; see the module docstring."""

    linear: Linear
    lora_a: NamedArray  # (extra..., In..., lora_rank): extra is e.g. the layers axis inside a Stacked
    lora_b: NamedArray  # (extra..., lora_rank, Out...)
    scale: float = eqx.field(static=True)  # alpha / rank
    dropout: float = eqx.field(static=True, default=0.0)
    # Set for one forward pass by with_dropout_keys (the models call their linears without a key);
    # None otherwise, so it is never part of a saved model.
    dropout_key: Any = None

    In = property(lambda self: self.linear.In)
    Out = property(lambda self: self.linear.Out)
    rank = property(lambda self: self.lora_a.axis_size(RANK))

    @staticmethod
    def init(
        linear: Linear,
        rank: int,
        *,
        key,
        alpha: float | None = None,
        dropout: float = 0.0,
        dtype=None,
        name: str = "Linear",
    ) -> LoraLinear:
        """Adapters of ``rank`` for ``linear``; ``alpha`` defaults to ``rank`` (scale 1), ``dtype``
        to the weight's. ``name`` names the layer in errors."""
        if not isinstance(linear, Linear):
            raise ArgumentError(f"LoRA wraps an nn.Linear; {name} is a {type(linear).__name__}")
        ins, outs = as_selectors(linear.In), as_selectors(linear.Out)
        fan_in, fan_out = math.prod(a.size for a in ins), math.prod(a.size for a in outs)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(fan_in, fan_out):
            raise ArgumentError(
                f"LoRA rank {rank!r} for {name}, {format_axes(ins)} -> {format_axes(outs)}: "
                f"a rank is an integer from 1 to the layer's smaller side, {min(fan_in, fan_out)}"
            )
        alpha = float(rank if alpha is None else alpha)
        if not (math.isfinite(alpha) and alpha > 0):
            raise ArgumentError(f"LoRA alpha for {name} must be a finite number > 0, got {alpha}")
        if not 0.0 <= dropout < 1.0:
            raise ArgumentError(f"LoRA dropout for {name} must be in [0, 1), got {dropout}")
        own = {a.name for a in ins + outs}
        extra = tuple(a for a in linear.weight.axes if a.name not in own)  # a stack's layers axis
        dtype = linear.weight.dtype if dtype is None else dtype
        Rank = Axis(RANK, rank)
        bound = 1.0 / math.sqrt(fan_in)
        a = nmr.uniform(key, extra + ins + (Rank,), dtype, minval=-bound, maxval=bound)
        b = zeros(extra + (Rank,) + outs, dtype)
        return LoraLinear(linear, a, b, alpha / rank, float(dropout))

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        expect_named(x, "LoraLinear")
        y = self.linear(x)
        key = self.dropout_key if key is None else key
        h = Dropout(self.dropout)(x, key=key) if self.dropout and key is not None else x
        low = shard(dot(h, self.lora_a, axis=tuple(a.name for a in as_selectors(self.In))))
        # in the base layer's output dtype: float32 adapters beside a bfloat16 base keep its activations bfloat16
        # a muP readout (reparam_cls) scales the whole product, adapters included, as merged() does
        scale = self.scale * self.linear.reparam.active_scale
        return shard(y + (dot(low, self.lora_b, axis=RANK) * scale).astype(y.dtype))

    def delta(self) -> NamedArray:
        """``scale · A · B``, the update to the weight, with the weight's axes (float32 or wider)."""
        w = self.linear.weight
        dtype = jnp.result_type(self.lora_a.dtype, self.lora_b.dtype, jnp.float32)
        d = dot(
            self.lora_a.astype(dtype),
            self.lora_b.astype(dtype),
            axis=RANK,
            out_axes=w.names,
            precision=jax.lax.Precision.HIGHEST,
        )  # a merge should not round through TF32
        return d * jnp.asarray(self.scale, dtype)

    def merged(self) -> Linear:
        """The plain Linear computing what this layer computes: weight ``W + scale · A · B`` in the
        wider of the weight's and the adapters' dtypes."""
        w = self.linear.weight
        d = self.delta()
        dtype = jnp.result_type(w.dtype, self.lora_a.dtype)
        return eqx.tree_at(lambda lin: lin.weight, self.linear, (w.astype(d.dtype) + d).astype(dtype))


# ---- whole models ----------------------------------------------------------------------------------


def _is_layer(x) -> bool:
    return isinstance(x, (Linear, LoraLinear))


def _path(keypath) -> str:
    return jax.tree_util.keystr(keypath, simple=True, separator=".")


def linear_paths(model) -> list[str]:
    """The dotted path of every Linear in ``model`` (``layers.stacked.self_attn.q_proj``)."""
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)[0]
    return [_path(k) for k, x in flat if isinstance(x, Linear)]


def _matcher(targets) -> Callable[[str, Linear], bool]:
    if callable(targets):
        return targets
    names = [targets] if isinstance(targets, str) else list(targets)
    return lambda path, _: any(path == t or path.endswith("." + t) for t in names)


def apply(
    model,
    targets: str | Sequence[str] | Callable[[str, Linear], bool],
    *,
    rank: int,
    key,
    alpha: float | None = None,
    dropout: float = 0.0,
    dtype=None,
):
    """``model`` with every Linear that ``targets`` names wrapped in a ``LoraLinear``.

    Args:
        targets: names matched against each Linear's dotted path, whole or as its last parts
            (``"q_proj"`` and ``"self_attn.q_proj"`` both name ``layers.stacked.self_attn.q_proj``);
            or a function ``(path, linear) -> bool``. Every name must match a Linear.
        rank, alpha, dropout, dtype: as ``LoraLinear.init``; each layer draws ``A`` from its own key.

    Raises:
        ArgumentError: a name that matches no Linear (the model's Linears are listed), a layer
            that already has adapters, or a rank the layer cannot take.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_layer)
    paths = [_path(k) for k, _ in flat]
    layers = [p for p, (_, x) in zip(paths, flat) if _is_layer(x)]
    if not callable(targets):
        names = [targets] if isinstance(targets, str) else list(targets)
        missing = [t for t in names if not any(_matcher(t)(p, None) for p in layers)]
        if missing:
            raise ArgumentError(
                f"LoRA targets {missing} match no Linear of {type(model).__name__}; its Linears: "
                f"{', '.join(layers) or 'none'}"
            )
    match = _matcher(targets)
    chosen = [i for i, (p, (_, x)) in enumerate(zip(paths, flat)) if _is_layer(x) and match(p, x)]
    if not chosen:
        raise ArgumentError(f"LoRA targets {targets!r} match no Linear of {type(model).__name__}")
    again = [paths[i] for i in chosen if isinstance(flat[i][1], LoraLinear)]
    if again:
        raise ArgumentError(f"LoRA: {', '.join(again)} already have adapters (merge them first)")
    keys = jax.random.split(key, len(chosen))
    leaves = [x for _, x in flat]
    for k, i in zip(keys, chosen):
        leaves[i] = LoraLinear.init(leaves[i], rank, key=k, alpha=alpha, dropout=dropout, dtype=dtype, name=paths[i])
    return jax.tree.unflatten(treedef, leaves)


def merge(model):
    """``model`` with every ``LoraLinear`` folded into a plain Linear (``LoraLinear.merged``)."""
    return jax.tree.map(
        lambda x: x.merged() if isinstance(x, LoraLinear) else x, model, is_leaf=lambda x: isinstance(x, LoraLinear)
    )


def trainable(model):
    """A pytree of bools over ``model`` (NamedArrays as leaves): True for the adapter arrays.
    ``eqx.partition(model, trainable(model), is_leaf=nm.is_named_array)`` splits off the rest."""

    def node(x):
        if isinstance(x, LoraLinear):
            return LoraLinear(
                jax.tree.map(lambda _: False, x.linear, is_leaf=is_named_array),
                True,
                True,
                x.scale,
                x.dropout,
                None if x.dropout_key is None else False,
            )
        return False

    return jax.tree.map(node, model, is_leaf=lambda x: isinstance(x, LoraLinear) or is_named_array(x))


def with_dropout_keys(model, key):
    """``model`` with a dropout key in every ``LoraLinear`` whose dropout is on (for one forward
    pass: the models call their Linears without keys). Each layer gets its own key; a layer
    inside a ``Stacked`` gets one per slice of its stacked axes."""
    flat, treedef = jax.tree_util.tree_flatten(model, is_leaf=lambda x: isinstance(x, LoraLinear))
    out = []
    for i, x in enumerate(flat):
        if isinstance(x, LoraLinear) and x.dropout:
            own = {a.name for a in as_selectors(x.In)} | {RANK}
            extra = tuple(a for a in x.lora_a.axes if a.name not in own)
            k = jax.random.fold_in(key, i)
            keys = named(jax.random.split(k, tuple(a.size for a in extra)), extra) if extra else k
            x = eqx.tree_at(lambda m: m.dropout_key, x, keys, is_leaf=lambda v: v is None)
        out.append(x)
    return jax.tree.unflatten(treedef, out)
