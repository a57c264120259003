"""Dropout, activations by name, and the MLP."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import _ops as ops
from .. import random as nm_random
from .._axis import (
    ArgumentError,
    ArgumentTypeError,
    Axis,
    AxisError,
    AxisSelection,
    AxisSelector,
    format_axes,
    names_of,
)
from .._core import NamedArray, expect_named, unchecked
from .._ops import elu, gelu, leaky_relu, log_sigmoid, relu, relu6, sigmoid, silu, softplus, swish  # noqa: F401  (nn.relu, ...)
from .._shape import split
from ._linear import Linear

# Activations jax.nn has and nm does not: the same elementwise wrapper as nm.relu (one broadcasting rule).
selu = ops.elementwise_op(jax.nn.selu, "selu")
celu = ops.elementwise_op(jax.nn.celu, "celu")
hard_sigmoid = ops.elementwise_op(jax.nn.hard_sigmoid, "hard_sigmoid")
hard_silu = ops.elementwise_op(jax.nn.hard_silu, "hard_silu")
hard_swish = hard_silu
hard_tanh = ops.elementwise_op(jax.nn.hard_tanh, "hard_tanh")
soft_sign = ops.elementwise_op(jax.nn.soft_sign, "soft_sign")
mish = ops.elementwise_op(jax.nn.mish, "mish")


def relu_squared(x: NamedArray) -> NamedArray:
    """``relu(x) ** 2`` (Primer; Hugging Face calls it ``relu2``)."""
    return ops.square(ops.relu(x))


def quick_gelu(x: NamedArray) -> NamedArray:
    """``x * sigmoid(1.702 x)``, CLIP's approximation of GELU."""
    return x * ops.sigmoid(1.702 * x)


def glu(x: NamedArray, axis: AxisSelector) -> NamedArray:
    """Gated linear unit along ``axis``: ``a * sigmoid(b)`` where ``a`` and ``b`` are the first and
    second halves of ``axis`` (as ``jax.nn.glu`` and ``torch.nn.functional.glu``). The result keeps
    the name of ``axis`` at half its size."""
    expect_named(x, "glu")
    A = x.resolve_axis(axis)
    if A.size % 2:
        raise ArgumentError(f"glu splits axis {A.name!r} in two halves, but its size {A.size} is odd")
    a, b = split(x, A.name, (A.resize(A.size // 2),) * 2)
    return a * ops.sigmoid(b)


def _identity(x: NamedArray) -> NamedArray:
    return x


ACTIVATIONS: dict[str, Callable[[NamedArray], NamedArray]] = {
    "gelu": lambda x: ops.gelu(x, approximate=False),
    "gelu_new": lambda x: ops.gelu(x, approximate=True),  # GPT-2's tanh approximation
    "gelu_tanh": lambda x: ops.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: ops.gelu(x, approximate=True),
    "silu": ops.silu,
    "swish": ops.silu,
    "relu": ops.relu,
    "relu6": ops.relu6,
    "relu_squared": relu_squared,
    "relu2": relu_squared,  # Hugging Face's name
    "leaky_relu": ops.leaky_relu,  # slope 0.01
    "elu": ops.elu,
    "celu": celu,
    "selu": selu,
    "quick_gelu": quick_gelu,
    "mish": mish,
    "tanh": ops.tanh,
    "sigmoid": ops.sigmoid,
    "log_sigmoid": ops.log_sigmoid,
    "softplus": ops.softplus,
    "soft_sign": soft_sign,
    "hard_sigmoid": hard_sigmoid,
    "hard_silu": hard_silu,
    "hard_swish": hard_silu,
    "hard_tanh": hard_tanh,
    "linear": _identity,  # Hugging Face's name for no activation
    "identity": _identity,
}


def activation(name: str | Callable[[NamedArray], NamedArray]) -> Callable[[NamedArray], NamedArray]:
    """The activation called ``name`` (``gelu``, ``gelu_new``, ``silu``, ``relu``, ...); a callable is
    returned as it is."""
    if callable(name):
        return name
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ArgumentError(f"unknown activation {name!r}; known: {', '.join(sorted(ACTIVATIONS))}") from None


_activation_fn = activation  # MLP.init's ``activation`` argument shadows the function


class Dropout(eqx.Module):
    """Zero each entry with probability ``pdrop`` and scale the rest by ``1/(1-pdrop)``.

    Active unless ``inference=True`` or ``pdrop == 0``; when active it needs ``key=`` (a jax key,
    or a NamedArray holding one, such as a layer's slice of ``nm.named(jax.random.split(k, n), "layers")``).
    """

    pdrop: float = eqx.field(static=True)

    def __check_init__(self):
        if not 0.0 <= self.pdrop <= 1.0:
            raise ArgumentError(f"Dropout: pdrop must be in [0, 1], got {self.pdrop}")

    def __call__(self, x: NamedArray, *, key=None, inference: bool = False) -> NamedArray:
        expect_named(x, "Dropout")
        if inference or self.pdrop == 0.0:
            return x
        if key is None:
            raise ArgumentError(
                f"Dropout(pdrop={self.pdrop}) is active and needs key=; pass inference=True to disable it"
            )
        if isinstance(key, NamedArray):  # a per-layer key sliced from nm.named(keys, "layers") by Stacked
            if key.axes:
                raise ArgumentError(f"Dropout needs a single key, got keys with axes {format_axes(key.axes)}")
            key = key.array
        dtype = ops.floating(x.dtype)  # an int input is scaled, not truncated
        if self.pdrop == 1.0:  # x / 0 would put NaN into the gradient
            return unchecked(jnp.zeros_like(x.array, dtype), x.axes)
        keep = nm_random.block_draw(lambda shape: jax.random.bernoulli(key, 1.0 - self.pdrop, shape), x.axes)
        return unchecked(jnp.where(keep, x.array / (1.0 - self.pdrop), 0).astype(dtype), x.axes)


WIDTH_NAME = "mlp"  # the hidden axis of MLP.init(In, Out, width=<int>, ...)


class MLP(eqx.Module):
    """A feed-forward network, in one of two forms (see :meth:`init`).

    The Transformer block ``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when gated
    (SwiGLU); or a perceptron of any depth ``down(act(... act(hidden[0](act(up(x))))))``.
    ``up`` is None for a depth-0 MLP, which is the single Linear ``down``.
    """

    up: Linear | None
    down: Linear
    gate: Linear | None
    act: str | Callable[[NamedArray], NamedArray] = eqx.field(static=True)
    hidden: tuple[Linear, ...] = ()  # the layers between up and down (depth >= 2)

    @staticmethod
    def init(
        In: AxisSelection,
        Out: AxisSelection,
        width: int | Axis | None = None,
        depth: int | None = None,
        activation: str | Callable[[NamedArray], NamedArray] = "gelu",
        *,
        key,
        gated: bool = False,
        use_bias: bool = True,
        use_final_bias: bool | None = None,
        dtype=jnp.float32,
    ) -> MLP:
        """Two forms.

        ``MLP.init(Embed, Mlp, key=k)`` (no ``width``/``depth``) is the Transformer feed-forward
        block: the second axis is the *hidden* one, ``up`` (and ``gate``) map ``Embed -> Mlp``,
        ``down`` maps ``Mlp -> Embed``, and the output has the input's axes.

        ``MLP.init(In, Out, width, depth, key=k)`` is Haliax's and equinox's MLP: ``depth`` hidden
        layers of ``width`` units between ``In`` and ``Out``. An int width makes the axis
        ``Axis("mlp", width)``; successive hidden layers alternate between that name and the
        name + ``"2"`` (``mlp``, ``mlp2``, ``mlp``, ...), since a Linear cannot map an axis to
        itself. ``depth=0`` is one Linear ``In -> Out``; ``depth`` defaults to 1.

        Args:
            activation: a name from :data:`ACTIVATIONS` or a callable on NamedArrays, applied
                after every hidden layer.
            gated: ``act(gate(x)) * up(x)`` for the first layer (SwiGLU with ``"silu"``); needs depth 1.
            use_bias: biases of the hidden layers; ``use_final_bias`` (default: ``use_bias``)
                that of the last layer.
        """
        _activation_fn(activation)  # an unknown name fails at init, not at the first call
        if width is None and depth is None:
            Embed, Hidden = In, Out
            if Embed.name == Hidden.name:
                raise AxisError("MLP: the hidden axis needs its own name (e.g. 'mlp')")
            width, depth, Out = Hidden, 1, Embed
        if width is None:
            raise ArgumentError(f"MLP: depth={depth} needs width= (an int, or an Axis for the hidden units)")
        depth = 1 if depth is None else depth
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ArgumentError(f"MLP: depth must be an int >= 0 (the number of hidden layers), got {depth!r}")
        if gated and depth != 1:
            raise ArgumentError(f"MLP: gated=True gates the one hidden layer of a depth-1 MLP, got depth={depth}")
        Width = Axis(WIDTH_NAME, width) if isinstance(width, int) and not isinstance(width, bool) else width
        if not isinstance(Width, Axis):
            raise ArgumentTypeError(f"MLP: width must be an int or an Axis, got {width!r}")
        Width2 = Width.alias(Width.name + "2")
        ends = set(names_of(In)) | set(names_of(Out))
        clash = sorted(ends & ({Width.name, Width2.name} if depth > 1 else {Width.name} if depth else set()))
        if clash:
            raise AxisError(
                f"MLP: the hidden axis {clash[0]!r} is also an input or output axis; pass width=Axis('hidden', n)"
            )
        final_bias = use_bias if use_final_bias is None else use_final_bias
        if depth == 0:
            return MLP(None, Linear.init(In, Out, key=key, use_bias=final_bias, dtype=dtype), None, activation)
        # keys[0..2] as the two-axis form always drew them, so its weights are those of earlier versions
        keys = jax.random.split(key, depth + 2)
        up = Linear.init(In, Width, key=keys[0], use_bias=use_bias, dtype=dtype)
        gate = Linear.init(In, Width, key=keys[2], use_bias=use_bias, dtype=dtype) if gated else None
        hidden, cur, nxt = [], Width, Width2
        for k in keys[3:]:
            hidden.append(Linear.init(cur, nxt, key=k, use_bias=use_bias, dtype=dtype))
            cur, nxt = nxt, cur
        down = Linear.init(cur, Out, key=keys[1], use_bias=final_bias, dtype=dtype)
        return MLP(up, down, gate, activation, tuple(hidden))

    @property
    def layers(self) -> tuple[Linear, ...]:
        """The Linears in the order they are applied (``gate`` left out)."""
        return tuple(x for x in (self.up, *self.hidden, self.down) if x is not None)

    def __call__(self, x: NamedArray, *, key=None) -> NamedArray:
        expect_named(x, "MLP")
        if self.up is None:
            return self.down(x)
        act = _activation_fn(self.act)
        h = act(self.gate(x)) * self.up(x) if self.gate is not None else act(self.up(x))
        for layer in self.hidden:
            h = act(layer(h))
        return self.down(h)
