"""Dropout, activations by name, and an MLP helper."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from .._axis import Axis, AxisError, NamedError, format_axes
from .._core import NamedArray
from .. import _ops as ops
from ._linear import Linear

ACTIVATIONS: dict[str, Callable[[NamedArray], NamedArray]] = {
    "gelu": lambda x: ops.gelu(x, approximate=False),
    "gelu_new": lambda x: ops.gelu(x, approximate=True),  # GPT-2's tanh approximation
    "gelu_tanh": lambda x: ops.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: ops.gelu(x, approximate=True),
    "silu": ops.silu,
    "swish": ops.silu,
    "relu": ops.relu,
    "quick_gelu": lambda x: x * ops.sigmoid(1.702 * x),
    "tanh": ops.tanh,
    "sigmoid": ops.sigmoid,
}


def activation(name: str) -> Callable[[NamedArray], NamedArray]:
    """The activation called ``name`` (``gelu``, ``gelu_new``, ``silu``, ``relu``, ...)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise NamedError(f"unknown activation {name!r}; known: {', '.join(sorted(ACTIVATIONS))}") from None


_activation_fn = activation  # MLP.init's ``activation`` argument shadows the function


class Dropout(eqx.Module):
    """Zero each entry with probability ``pdrop`` and scale the rest by ``1/(1-pdrop)``.

    Active unless ``inference=True`` or ``pdrop == 0``; when active it needs ``key=`` (a jax key,
    or a NamedArray holding one, such as a layer's slice of ``nm.named(jax.random.split(k, n), "layers")``).
    """

    pdrop: float = eqx.field(static=True)

    def __check_init__(self):
        if not 0.0 <= self.pdrop <= 1.0:
            raise NamedError(f"Dropout: pdrop must be in [0, 1], got {self.pdrop}")

    def __call__(self, x: NamedArray, *, key=None, inference: bool = False) -> NamedArray:
        if inference or self.pdrop == 0.0:
            return x
        if key is None:
            raise NamedError(f"Dropout(pdrop={self.pdrop}) is active and needs key=; pass inference=True to disable it")
        if isinstance(key, NamedArray):  # a per-layer key sliced from nm.named(keys, "layers") by Stacked
            if key.axes:
                raise NamedError(f"Dropout needs a single key, got keys with axes {format_axes(key.axes)}")
            key = key.array
        if self.pdrop == 1.0:  # x / 0 would put NaN into the gradient
            return NamedArray._unchecked(jnp.zeros_like(x.array), x.axes)
        keep = jax.random.bernoulli(key, 1.0 - self.pdrop, x.array.shape)
        return NamedArray._unchecked(jnp.where(keep, x.array / (1.0 - self.pdrop), 0).astype(x.dtype), x.axes)


class MLP(eqx.Module):
    """``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when ``gated`` (SwiGLU)."""

    up: Linear
    down: Linear
    gate: Linear | None
    act: str = eqx.field(static=True)

    @staticmethod
    def init(Embed: Axis, Hidden: Axis, *, key, activation: str = "gelu", gated: bool = False,
             use_bias: bool = True) -> MLP:
        if Embed.name == Hidden.name:
            raise AxisError("MLP: the hidden axis needs its own name (e.g. 'mlp')")
        _activation_fn(activation)  # an unknown name fails at init, not at the first call
        k1, k2, k3 = jax.random.split(key, 3)
        gate = Linear.init(Embed, Hidden, key=k3, use_bias=use_bias) if gated else None
        return MLP(Linear.init(Embed, Hidden, key=k1, use_bias=use_bias),
                   Linear.init(Hidden, Embed, key=k2, use_bias=use_bias), gate, activation)

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        act = _activation_fn(self.act)
        h = act(self.gate(x)) * self.up(x) if self.gate is not None else act(self.up(x))
        return self.down(h)
