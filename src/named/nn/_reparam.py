"""Haliax's abc-parametrizations of a Linear (``Linear.init(..., reparam_cls=...)``): how a layer's
weights are initialised (``init_scale``), what its output is multiplied by (``active_scale``) and
what its Adam learning rate is multiplied by (``lr_scale``), from its fan-in alone.

These are the absolute muP rules of Yang et al. ("Tensor Programs V", Table 3): widths enter as
``1 / fan_in``, not relative to a base model. ``nn.mup`` (``rescale_init``/``scale_updates``
with base widths) is the relative form, which keeps a base model's hyper-parameters; both live
in ``nn.mup``.
"""

from __future__ import annotations

import dataclasses
import math

from .._axis import Axis, AxisError, AxisSelection, as_selectors


def fan_in(In: AxisSelection) -> int:
    """The inputs each output sums over; at least 1 (a layer of no inputs has nothing to scale)."""
    return max(math.prod(a.size for a in as_selectors(In)), 1)


class AbstractReparam:
    """What a layer's output (``active_scale``) and its weight's learning rate (``lr_scale``) are
    multiplied by; 1 unless a parametrization says otherwise."""

    @property
    def active_scale(self) -> float:
        """What the layer's output (before the bias) is multiplied by."""
        return 1.0

    @property
    def lr_scale(self) -> float:
        """What the weight's learning rate is multiplied by (``nn.mup.scale_reparam_updates``)."""
        return 1.0


@dataclasses.dataclass(frozen=True)
class AbstractLinearReparam(AbstractReparam):
    """A Linear's parametrization, given its ``In`` and ``Out`` axes."""

    In: Axis | tuple[Axis, ...]
    Out: Axis | tuple[Axis, ...]

    def __post_init__(self):
        for what, axes in (("In", self.In), ("Out", self.Out)):
            if not all(isinstance(a, Axis) for a in as_selectors(axes)):
                raise AxisError(
                    f"{type(self).__name__}: {what} must be Axes with sizes (the fan-in is their product), got {axes!r}"
                )

    @staticmethod
    def init_scale(In, Out) -> float:
        """The weights' standard deviation (before ``Linear.init``'s ``init_scale``)."""
        return 1.0 / math.sqrt(fan_in(In))


class LinearStandardParam(AbstractLinearReparam):
    """The standard parametrization: std ``1/sqrt(fan_in)``, nothing else scaled."""


class InputLinearMup(AbstractLinearReparam):
    """muP's input layer: unit-variance weights, no scaling of output or learning rate."""

    @staticmethod
    def init_scale(In, Out) -> float:
        return 1.0


class HiddenLinearMup(AbstractLinearReparam):
    """muP's hidden layer: std ``1/sqrt(fan_in)``, learning rate ``1/fan_in``."""

    @property
    def lr_scale(self) -> float:
        return 1.0 / fan_in(self.In)


class OutputLinearMup(AbstractLinearReparam):
    """muP's output (readout) layer: unit-variance weights, output multiplied by ``1/fan_in``."""

    @staticmethod
    def init_scale(In, Out) -> float:
        return 1.0

    @property
    def active_scale(self) -> float:
        return 1.0 / fan_in(self.In)


@dataclasses.dataclass(frozen=True)
class AbstractEmbeddingReparam(AbstractReparam):
    """An Embedding's parametrization (Haliax's), given its ``Embed`` and ``Vocab`` axes: the same
    scales as a Linear's, and ``unembed_active_scale``, what ``unembed``'s logits are multiplied
    by (a tied output head's muP readout multiplier)."""

    Embed: Axis | tuple[Axis, ...]
    Vocab: Axis

    @staticmethod
    def init_scale(In, Out) -> float:
        """Multiplies ``Embedding.init``'s ``init_scale`` (the weights' standard deviation)."""
        return 1.0

    @property
    def unembed_active_scale(self) -> float:
        return 1.0


class EmbeddingStandardParam(AbstractEmbeddingReparam):
    """The standard parametrization: ``Embedding.init``'s ``init_scale`` as the std, nothing scaled."""


class EmbeddingMup(AbstractEmbeddingReparam):
    """muP for an embedding: init and learning rate unchanged; ``unembed`` (a tied output head)
    multiplies its logits by ``1 / embed size``, muP's readout multiplier."""

    @property
    def unembed_active_scale(self) -> float:
        return 1.0 / fan_in(self.Embed)
