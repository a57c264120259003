"""muP, the maximal update parametrization (Yang et al. 2022, "Tensor Programs V"), for Linear and
Embedding trained with Adam: hyper-parameters tuned on a narrow *base* model carry over to wide ones.

In a named model a layer's width is an axis name, so muP needs only the names of the width axes
and the size each had in the base model: ``base = {"embed": 64, "mlp": 256}``. A layer's width
multiplier ``m`` is the product of ``size / base size`` over the width axes of its ``In``, and
its role follows from the names alone:

=========  ==================================  ==================  =================
role       which layers                        init                Adam lr
=========  ==================================  ==================  =================
input      no width axis in ``In`` (Embedding  unchanged           unchanged
           included): the first layer
hidden     width axes in ``In`` and ``Out``    unchanged           ``÷ m``
readout    width axes in ``In``, none in       std ``÷ m``         ``÷ m``
           ``Out``: the output head
=========  ==================================  ==================  =================

Biases, norms and every other parameter keep their init and learning rate. ``Linear.init``'s
``1/sqrt(fan_in)`` std already is muP's for input and hidden layers. The readout row is the
Adam-equivalent of the ``mup`` package's ``MuReadout`` (an output multiplier ``1/m``): scaling
a weight and its Adam step by ``1/m`` scales its output and that output's change alike. At the
base widths (``m = 1``) nothing changes: the base model is the standard one.

``rescale_init(model, base)`` applies the init column; ``scale_updates(updates, base)`` the lr
column, to an optimizer's updates (any pytree shaped like the model): with optax,
``optax.chain(optax.adamw(lr), optax.stateless(lambda u, _: mup.scale_updates(u, base)))``.
The decoupled weight decay of AdamW is scaled with the step, as a per-group learning rate
scales it in torch.

Haliax's absolute form is here too: ``Linear.init(..., reparam_cls=OutputLinearMup)`` (and
``InputLinearMup``, ``HiddenLinearMup``, ``LinearStandardParam``) fixes a layer's init, output
and learning-rate scales from its own fan-in; ``scale_reparam_updates(updates, params)`` applies
the learning-rate column. Use one form per model: the relative one keeps a tuned base model's
hyper-parameters, the absolute one needs none.

An untied output head that is an ``Embedding`` called through ``unembed`` (the decoders'
``lm_head``) is named in ``readouts=``: from the names alone it would look like an input layer.
Not covered: an output head tied to the input embedding is both an input and a readout layer, which
muP treats differently (untie it, or scale its logits by ``1/m`` in the model), and attention, whose
logits muP scales by ``1/head_size`` rather than ``1/sqrt(head_size)`` when ``head_size`` grows
(``dot_product_attention(scale=...)``; growing the number of heads instead needs no change)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax

from .._axis import ArgumentError, Axis, as_selectors
from .._core import NamedArray
from ._linear import Embedding, Linear
from ._quant import Fp8Linear, Int8Linear
from ._reparam import (
    AbstractEmbeddingReparam,
    AbstractLinearReparam,
    EmbeddingMup,
    EmbeddingStandardParam,
    HiddenLinearMup,
    InputLinearMup,
    LinearStandardParam,
    OutputLinearMup,
)

__all__ = [
    "INPUT",
    "HIDDEN",
    "READOUT",
    "roles",
    "rescale_init",
    "scale_updates",
    "scale_reparam_updates",
    "AbstractLinearReparam",
    "LinearStandardParam",
    "InputLinearMup",
    "HiddenLinearMup",
    "OutputLinearMup",
    "AbstractEmbeddingReparam",
    "EmbeddingStandardParam",
    "EmbeddingMup",
]

INPUT, HIDDEN, READOUT = "input", "hidden", "readout"


def _check_base(base: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(base, Mapping) or not base:
        raise ArgumentError(
            f"muP: base maps each width axis name to its size in the base model, e.g. {{'embed': 64}}; got {base!r}"
        )
    for name, size in base.items():
        if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ArgumentError(f"muP: base[{name!r}] must be an axis name and a size >= 1, got {size!r}")
    return dict(base)


def _role(In: tuple[Axis, ...], Out: tuple[Axis, ...], base: dict[str, int]) -> tuple[str, float]:
    wide_in = [a for a in In if a.name in base]
    if not wide_in:
        return INPUT, 1.0
    m = math.prod(a.size / base[a.name] for a in wide_in)
    return (HIDDEN if any(a.name in base for a in Out) else READOUT), m


def _is_layer(x) -> bool:
    return isinstance(x, (Linear, Embedding, Fp8Linear, Int8Linear))  # layers with a float weight


def _axes(layer, readout: bool) -> tuple[tuple[Axis, ...], tuple[Axis, ...]]:
    if isinstance(layer, Embedding):
        embed = as_selectors(layer.Embed)
        return (embed, (layer.Vocab,)) if readout else ((layer.Vocab,), embed)
    return as_selectors(layer.In), as_selectors(layer.Out)


def _layers(tree, base: Mapping[str, int], readouts: Sequence[str]):
    """``(keypath, layer, role, m)`` for each layer of ``tree``, checking ``base`` and ``readouts``."""
    base = _check_base(base)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_layer)[0]
    found = [(k, _path(k), x) for k, x in flat if _is_layer(x)]
    embeddings = {p for _, p, x in found if isinstance(x, Embedding)}
    bad = [r for r in ([readouts] if isinstance(readouts, str) else readouts) if r not in embeddings]
    if bad:
        raise ArgumentError(
            f"muP: readouts {bad} are not Embeddings of {type(tree).__name__} (an output head called "
            f"through unembed); its Embeddings: {', '.join(sorted(embeddings)) or 'none'}"
        )
    names = {a.name for _, _, x in found for side in _axes(x, False) for a in side}
    unknown = sorted(set(base) - names)
    if unknown:
        raise ArgumentError(
            f"muP: base names {unknown}, which no Linear or Embedding of {type(tree).__name__} has; "
            f"their axes: {', '.join(sorted(names)) or 'none'}"
        )
    return [(k, x, *_role(*_axes(x, p in readouts), base)) for k, p, x in found]


def _path(keypath) -> str:
    return jax.tree_util.keystr(keypath, simple=True, separator=".")


def roles(model, base: Mapping[str, int], readouts: Sequence[str] = ()) -> dict[str, tuple[str, float]]:
    """Each Linear and Embedding of ``model`` by dotted path: its role and width multiplier ``m``.

    Args:
        base: each width axis name and its size in the base model.
        readouts: the paths of Embeddings used as an untied output head (``lm_head``, called
            through ``unembed``): readout layers from ``embed`` to ``vocab``.

    Raises:
        ArgumentError: a ``base`` that is not a mapping of names to sizes, or that names an axis
            no Linear or Embedding of the model has (a typo would silently give the standard
            parametrization), or a readout that is not an Embedding of the model.
    """
    return {_path(k): (role, m) for k, _, role, m in _layers(model, base, readouts)}


def _scaled(tree, base, readouts, which: tuple[str, ...]):
    scale = {_path(k): 1.0 / m for k, x, role, m in _layers(tree, base, readouts) if role in which and m != 1.0}

    def node(keypath, x):
        s = scale.get(_path(keypath)) if _is_layer(x) else None
        if s is None or not isinstance(x.weight, NamedArray):  # None: a weight with no update here
            return x
        return eqx.tree_at(lambda v: v.weight, x, x.weight * s)

    return jax.tree_util.tree_map_with_path(node, tree, is_leaf=_is_layer)


def rescale_init(model, base: Mapping[str, int], readouts: Sequence[str] = ()):
    """``model`` (freshly initialised at its own widths) with each readout weight divided by ``m``."""
    return _scaled(model, base, readouts, (READOUT,))


def scale_updates(updates: Any, base: Mapping[str, int], readouts: Sequence[str] = ()):
    """An optimizer's ``updates`` (shaped like the model) with the hidden and readout weights'
    divided by ``m``: muP's per-parameter Adam learning rates. Biases and the rest are unchanged."""
    return _scaled(updates, base, readouts, (HIDDEN, READOUT))


# ---- Haliax's absolute form: a Linear's reparam_cls -------------------------------------------------


def scale_reparam_updates(updates: Any, params: Any):
    """``updates`` with each Linear's weight update multiplied by its ``reparam.lr_scale`` (muP's
    per-layer Adam learning rate for layers made with ``Linear.init(..., reparam_cls=...)``;
    Levanter's ``scale_by_mup_lr``). ``params`` is the model the updates are for; biases and the
    rest are unchanged. With optax: ``optax.stateless(lambda u, p: mup.scale_reparam_updates(u, p))``
    after the optimizer, which then needs ``params=`` in its ``update``."""
    if params is None:
        raise ArgumentError(
            "scale_reparam_updates needs the parameters the updates are for (params=), whose Linears "
            "say their learning-rate scale"
        )

    def node(u, p):
        if not isinstance(p, Linear) or not isinstance(u, Linear) or not isinstance(u.weight, NamedArray):
            return u
        s = p.reparam.lr_scale
        return u if s == 1 else eqx.tree_at(lambda v: v.weight, u, u.weight * s)

    return jax.tree.map(node, updates, params, is_leaf=lambda x: isinstance(x, Linear))
