"""Cross-entropy losses over named axes: per-token (ids or probabilities), next-token, blockwise
over the vocabulary, and binary (per-entry sigmoid).

Every loss is computed in float32 whatever the dtype of the logits (or of the hidden states and
weights for the blockwise loss): the log-sum-exp of a bf16 row of 50k logits is not worth
having. Float64 logits (a gradient check) are computed, and returned, in float64.

Vocab-parallel (Megatron's fused cross-entropy) needs no special code path. The loss is written
as three reductions over the vocab axis, a max, a sum of exponentials and a masked sum that picks
the target's logit, never as a gather along vocab. Under a mapping ``{"vocab": "model"}`` GSPMD
therefore keeps each device's ``vocab / tp`` slice of the logits where it is and all-reduces
only ``[batch, position]``-sized partial results (a max, then two sums), which is exactly
Megatron's scheme; ``tests/test_loss.py`` reads the compiled HLO to show it.
"""

from __future__ import annotations

import math
from typing import Literal

import jax.numpy as jnp
import numpy as np

from .. import _ops as ops
from .._axis import ArgumentError, ArgumentTypeError, Axis, AxisError, AxisSelector, format_axes
from .._core import NamedArray, expect_named
from .._index import concrete, first_flagged
from .._shape import arange, broadcast_to, roll
from ..partitioning import ResourceMapping, check_mapping_values
from ._fused_loss import GATHERS, fused_per_token_loss, whole_axis
from ._fused_loss import head_bytes_held as head_bytes_held  # for named.internal (named-plan)

Reduction = Literal["mean", "sum", "none"]
_REDUCTIONS = ("mean", "sum", "none")
IGNORE_INDEX = -100  # torch's default ignore_index: the label Hugging Face datasets give a token not to score

__all__ = [
    "binary_cross_entropy_loss",
    "blockwise_cross_entropy_loss",
    "blockwise_next_token_loss",
    "cross_entropy_loss",
    "next_token_loss",
    "next_token_targets",
]


# ---- shared pieces ----------------------------------------------------------------------


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ArgumentError(f"reduction={reduction!r}; use one of {', '.join(map(repr, _REDUCTIONS))}")


def _check_targets(targets: NamedArray, Vocab: Axis, loss_axes: tuple[Axis, ...]) -> None:
    if not isinstance(targets, NamedArray):
        raise ArgumentTypeError(f"targets must be an integer NamedArray, got {type(targets).__name__}")
    if jnp.issubdtype(targets.dtype, jnp.floating) and Vocab.name not in targets.names:
        raise ArgumentTypeError(
            f"targets must hold integer token ids, or float probabilities over the vocab axis {Vocab.name!r}; "
            f"got dtype {targets.dtype} {format_axes(targets.axes)}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ArgumentTypeError(
            f"targets must hold integer token ids, got dtype {targets.dtype} {format_axes(targets.axes)}"
        )
    if Vocab.name in targets.names:
        raise AxisError(
            f"targets {format_axes(targets.axes)} have the vocab axis {Vocab.name!r}; "
            "pass integer ids (one per token), not one-hot or probabilities"
        )
    known = {a.name: a.size for a in loss_axes}
    for a in targets.axes:
        if known.get(a.name) != a.size:
            raise AxisError(
                f"targets axis {a.name}={a.size} is not among the logits' token axes {format_axes(loss_axes)}"
            )


def _check_where(where, what: str = "where=") -> None:
    """A mask is boolean, as the reductions' ``where=``: read as weights, an additive 0/-inf mask
    would zero the loss and a float 0.5 would halve a token rather than drop it."""
    if where is not None and not isinstance(where, NamedArray):
        raise ArgumentTypeError(f"{what} must be a NamedArray mask over the targets' axes, got {type(where).__name__}")
    if where is not None:
        ops.check_bool_mask(
            where,
            what,
            "count the token",
            "; to weight tokens, take reduction='none' and reduce (loss * weights).sum() / weights.sum()",
        )


def _screen_ids(
    targets: NamedArray, Vocab: Axis, where, ignore_index, what: str
) -> tuple[NamedArray | None, NamedArray]:
    """``(where, in_vocab)``: ``where`` with the tokens whose target is ``ignore_index`` taken out
    (they neither contribute nor count, as in torch), and where each target is a vocab id.

    Any other id outside ``[0, vocab)`` that counts is a mistake with no right answer: when the
    ids (and ``where``) are concrete it is refused here, naming the first one; under a trace its
    token's loss becomes NaN (see ``_nan_outside``), never a plausible number."""
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise ArgumentTypeError(f"{what}: ignore_index must be an int (torch's -100) or None, got {ignore_index!r}")
    _check_where(where)
    in_vocab = (targets >= 0) & (targets < Vocab.size)
    wrong = ~in_vocab
    if ignore_index is not None:
        keep = targets != ignore_index
        where = keep if where is None else where & keep
        wrong = wrong & keep
    known = concrete(wrong)
    counted = None if known is None or (where is not None and concrete(where) is None) else wrong
    if counted is not None and where is not None:
        counted = counted & where
    flags = None if counted is None else concrete(counted)
    if flags is not None and flags.any():
        at_index, at = first_flagged(flags, counted.axes)
        ids = np.asarray(broadcast_to(targets, counted.axes).array)
        skip = (
            f"ignore_index={ignore_index} marks a token to skip"
            if ignore_index is not None
            else "ignore_index marks a token to skip"
        )
        raise ArgumentError(
            f"{what}: target id {int(ids[at_index])} at ({at}) is outside [0, {Vocab.size}) (vocab axis "
            f"{Vocab.name!r}); "
            f"{int(flags.sum())} counted target(s) out of range in all. Ids must be vocab entries; {skip}, "
            "and where= masks tokens out"
        )
    return where, in_vocab


def _nan_outside(loss: NamedArray, in_vocab: NamedArray) -> NamedArray:
    """NaN for the tokens whose target is not a vocab id: masked or ignored ones are zeroed by the
    reduction afterwards, a counted one makes the loss NaN (the trainer's NaN policy sees it)."""
    return ops.where(in_vocab, loss, jnp.nan)


def _target_logit(logits: NamedArray, Vocab: Axis, targets: NamedArray, vocab_ids: NamedArray) -> NamedArray:
    # A masked sum rather than a gather: it is elementwise + reduce over vocab, which GSPMD
    # partitions along a sharded vocab (local pick, then a sum all-reduce), and a target
    # outside the vocab picks 0 instead of reading out of bounds (_screen_ids deals with it).
    picked = ops.where(targets == vocab_ids, logits, 0.0)
    return picked.sum(Vocab.name)


def vocab_axis(x: NamedArray, axis: AxisSelector, what: str, arg: str, keyword: str = "axis") -> Axis:
    """``x``'s class axis ``axis``; a NamedArray without it is an AxisError that says which keyword names it."""
    x = expect_named(x, what, arg)
    name = axis.name if isinstance(axis, Axis) else axis
    if name not in x.names:
        raise AxisError(
            f"{what}: {arg} {format_axes(x.axes)} has no class axis {name!r}; name its class axis with "
            f"{keyword}= (e.g. {keyword}={x.axes[-1].name!r} if it is the last)"
            if x.axes
            else f"{what}: {arg} is 0-d: it has no class axis {name!r}"
        )
    return x.resolve_axis(axis)


def _check_within(x: NamedArray, axes: tuple[Axis, ...], what: str, of: str) -> None:
    """Every axis of ``x`` is one of ``axes``, at the same size."""
    known = {a.name: a.size for a in axes}
    for a in x.axes:
        if known.get(a.name) != a.size:
            raise AxisError(f"{what} axis {a.name}={a.size} is not among the {of} axes {format_axes(axes)}")


def _check_smoothing(label_smoothing) -> None:
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ArgumentError(f"label_smoothing={label_smoothing!r}; it must be a number in [0, 1]")


def _apply_reduction(loss: NamedArray, where, reduction: str) -> NamedArray:
    """Mask ``loss`` (per token) by ``where`` and reduce it over all its axes (or not)."""
    weight = None
    _check_where(where)
    if where is not None:
        extra = [a for a in where.axes if a.name not in loss.names]
        if extra:
            raise AxisError(
                f"where= has axes {format_axes(extra)} that the per-token loss {format_axes(loss.axes)} lacks"
            )
        weight = broadcast_to(where.astype(loss.dtype), loss.axes)
        # where(), not a product: a masked-out token whose loss is inf or nan must not leak in.
        loss = ops.where(weight != 0, loss, 0.0)
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    if weight is None:
        n = math.prod(a.size for a in loss.axes)
        return total / n if n else total  # no token (a batch of 0): 0, as an all-masked batch below
    count = weight.sum()
    # An all-masked batch has mean 0 (and zero gradients), not nan.
    safe = ops.where(count > 0, count, 1.0)
    return ops.where(count > 0, total / safe, 0.0)


def _loss_from_parts(lse: NamedArray, target_logit: NamedArray, z_loss_weight: float) -> NamedArray:
    return _plus_z_loss(lse - target_logit, lse, z_loss_weight)


def _plus_z_loss(loss: NamedArray, lse: NamedArray, z_loss_weight: float) -> NamedArray:
    if z_loss_weight:
        # PaLM's auxiliary z-loss keeps the softmax normaliser log Z near 0.
        loss = loss + z_loss_weight * ops.square(lse)
    return loss


# ---- the per-token loss -------------------------------------------------------------------


def cross_entropy_loss(
    logits: NamedArray,
    targets: NamedArray,
    *,
    axis: AxisSelector = "vocab",
    where: NamedArray | None = None,
    reduction: Reduction = "mean",
    z_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
) -> NamedArray:
    """Softmax cross-entropy of ``targets`` under ``logits``, in float32 (float64 for float64 logits).

    Per token, for integer targets: ``logsumexp(logits) - logits[target] + z_loss_weight *
    logsumexp(logits)**2``; for probability targets ``p``: ``-sum(p * log_softmax(logits))`` plus
    the same z-loss (``torch.nn.functional.cross_entropy`` with class probabilities; ``p`` is used
    as given, not renormalised).

    Args:
        logits: scores with the vocab axis and any token axes (``batch``, ``position``, ...).
        targets: integer ids in ``[0, vocab)`` with (some of) the logits' axes except the vocab
            axis; or float probabilities with the vocab axis and (some of) the token axes.
        axis: the vocab (class) axis of ``logits`` (by default the one named ``"vocab"``).
        where: a boolean mask over the targets' axes (True = count the token); masked tokens
            contribute nothing and are not counted by the mean. Any other dtype is an
            ArgumentTypeError (a 0/1 or additive mask: convert it; weights: ``reduction="none"``).
        reduction: ``"mean"`` (masked mean over every remaining axis), ``"sum"``, or ``"none"``
            (the per-token loss, zero where masked).
        z_loss_weight: weight of the z-loss term (PaLM uses 1e-4); 0 turns it off.
        label_smoothing: ``ε`` in ``[0, 1]``: the targets become ``(1 - ε) * targets + ε / vocab``
            (torch's ``label_smoothing``).
        ignore_index: a target equal to it is skipped as if masked by ``where`` (not counted by
            the mean), as torch's ``ignore_index``; ``-100`` by default, the label Hugging Face
            datasets give padding and prompt tokens; None: no id is skipped. Ids only.

    Any other target outside ``[0, vocab)`` that counts (not masked by ``where``) is an error:
    an ``ArgumentError`` naming the first one when the targets (and ``where``) are concrete;
    under ``jax.jit`` (where values cannot be looked at) the token's loss is NaN, and so is the
    mean or sum that counts it.

    Returns:
        A float32 (float64) NamedArray: 0-d for ``"mean"``/``"sum"``, the token axes for ``"none"``.
    """
    _check_reduction(reduction)
    _check_smoothing(label_smoothing)
    Vocab = vocab_axis(logits, axis, "cross_entropy_loss", "logits")
    token_axes = tuple(a for a in logits.axes if a.name != Vocab.name)
    logits32 = logits.astype(ops.wide(logits.dtype))
    lse = ops.logsumexp(logits32, Vocab.name)
    if isinstance(targets, NamedArray) and jnp.issubdtype(targets.dtype, jnp.floating) and Vocab.name in targets.names:
        _check_within(targets, logits.axes, "targets", "logits'")
        probs = targets.astype(logits32.dtype)
        if label_smoothing:
            probs = (1.0 - label_smoothing) * probs + label_smoothing / Vocab.size
        loss = _plus_z_loss((probs * (lse - logits32)).sum(Vocab.name), lse, z_loss_weight)
    else:
        _check_targets(targets, Vocab, token_axes)
        where, in_vocab = _screen_ids(targets, Vocab, where, ignore_index, "cross_entropy_loss")
        picked = _target_logit(logits32, Vocab, targets, arange(Vocab, dtype=targets.dtype))
        if label_smoothing:
            # the smoothed target's expected logit: a mean over vocab, so vocab-parallel stays reductions only
            picked = (1.0 - label_smoothing) * picked + label_smoothing * logits32.mean(Vocab.name)
        loss = _nan_outside(_loss_from_parts(lse, picked, z_loss_weight), in_vocab)
    return _apply_reduction(loss.rearrange(token_axes), where, reduction)


# ---- binary: one sigmoid per entry ---------------------------------------------------------------


def binary_cross_entropy_loss(
    logits: NamedArray,
    targets: NamedArray,
    *,
    pos_weight: NamedArray | float | None = None,
    where: NamedArray | None = None,
    reduction: Reduction = "mean",
) -> NamedArray:
    """Sigmoid cross-entropy of ``targets`` in ``[0, 1]`` under ``logits``, entry by entry, in float32
    (float64 for float64 logits; ``torch.nn.functional.binary_cross_entropy_with_logits``).

    Per entry: ``-(pos_weight * t * log(sigmoid(x)) + (1 - t) * log(1 - sigmoid(x)))``, computed
    from the logits without forming ``sigmoid(x)``, so large logits neither overflow nor round to 0.

    Args:
        logits: scores with any axes (e.g. ``batch`` and a ``label`` axis for multi-label data).
        targets: probabilities (or 0/1 labels) with exactly the logits' axes, in any order.
        pos_weight: weight of the positive term: a number, or a NamedArray over some of the
            logits' axes (one per class, as torch's ``pos_weight``).
        where: a boolean mask over some of the logits' axes (as in :func:`cross_entropy_loss`);
            masked entries contribute nothing and are not counted by the mean.
        reduction: ``"mean"`` (over every entry that counts), ``"sum"`` or ``"none"``.

    Returns:
        A float32 (float64) NamedArray: 0-d for ``"mean"``/``"sum"``, the logits' axes for ``"none"``.
    """
    _check_reduction(reduction)
    for what, v in (("logits", logits), ("targets", targets)):
        expect_named(v, "binary_cross_entropy_loss", what)
    if set(targets.names) != set(logits.names):
        odd = sorted(set(targets.names) ^ set(logits.names))
        raise AxisError(
            f"binary_cross_entropy_loss: targets {format_axes(targets.axes)} and logits "
            f"{format_axes(logits.axes)} must have the same axes; {odd[0]!r} is in only one"
        )
    _check_within(targets, logits.axes, "targets", "logits'")
    x = logits.astype(ops.wide(logits.dtype))
    t = targets.astype(x.dtype)
    softplus_neg = ops.softplus(-x)  # -log(sigmoid(x)); -log(1 - sigmoid(x)) is x + softplus(-x)
    if pos_weight is None:
        positive = softplus_neg
    else:
        if isinstance(pos_weight, NamedArray):
            _check_within(pos_weight, logits.axes, "pos_weight", "logits'")
        positive = pos_weight * softplus_neg
    loss = (t * positive + (1.0 - t) * (x + softplus_neg)).rearrange(logits.axes)
    return _apply_reduction(loss, where, reduction)


# ---- next-token prediction ------------------------------------------------------------------


def next_token_targets(
    input_ids: NamedArray, *, Pos: AxisSelector = "position", loss_mask: NamedArray | None = None
) -> tuple[NamedArray, NamedArray]:
    """Targets and mask for predicting token ``t + 1`` from position ``t``.

    The targets are ``input_ids`` rolled by one along ``Pos`` (same shape, so a sharded
    position axis stays evenly sharded); the last position, which has nothing to predict, is
    masked out, and ``loss_mask`` (if given) multiplies in.

    Args:
        input_ids: integer token ids with the ``Pos`` axis.
        Pos: the position (sequence) axis.
        loss_mask: a boolean mask aligned with the *predicting* positions: entry ``t``
            keeps the prediction of token ``t + 1`` made at position ``t``. Its axes must be
            among ``input_ids``' axes.

    Returns:
        ``(targets, mask)``: both with ``input_ids``' axes; ``mask`` is boolean.
    """
    Pos = expect_named(input_ids, "next_token_targets", "input_ids").resolve_axis(Pos)
    targets = roll(input_ids, -1, Pos.name)
    mask = arange(Pos) < Pos.size - 1
    if loss_mask is not None:
        _check_where(loss_mask, "loss_mask")
        extra = [a for a in loss_mask.axes if a.name not in input_ids.names]
        if extra:
            raise AxisError(
                f"loss_mask has axes {format_axes(extra)} that input_ids {format_axes(input_ids.axes)} lack"
            )
        mask = mask & loss_mask
    return targets, broadcast_to(mask, input_ids.axes)


def next_token_loss(
    logits: NamedArray,
    input_ids: NamedArray,
    *,
    Pos: AxisSelector = "position",
    axis: AxisSelector = "vocab",
    loss_mask: NamedArray | None = None,
    reduction: Reduction = "mean",
    z_loss_weight: float = 0.0,
    label_smoothing: float = 0.0,
    ignore_index: int | None = IGNORE_INDEX,
) -> NamedArray:
    """Language-model loss: the logits at position ``t`` predict ``input_ids`` at ``t + 1``.

    The last position is excluded. ``loss_mask`` (over e.g. ``(batch, position)``) is aligned
    with the logits' positions and multiplies in; see :func:`next_token_targets`. An id equal
    to ``ignore_index`` (``-100``, as in Hugging Face labels) is not predicted. The mean is over
    the tokens that count. Other arguments are those of :func:`cross_entropy_loss`.
    """
    targets, mask = next_token_targets(input_ids, Pos=Pos, loss_mask=loss_mask)
    return cross_entropy_loss(
        logits,
        targets,
        axis=axis,
        where=mask,
        reduction=reduction,
        z_loss_weight=z_loss_weight,
        label_smoothing=label_smoothing,
        ignore_index=ignore_index,
    )


# ---- blockwise over the vocabulary -----------------------------------------------------------


def block_size_error(V: Axis, block_size) -> ArgumentError:
    divisors = [d for d in range(1, V.size + 1) if V.size % d == 0]
    try:
        below = [d for d in divisors if d < block_size][-1:]
        above = [d for d in divisors if d > block_size][:1]
        hint = f"; try {' or '.join(map(str, below + above))}"
    except TypeError:
        hint = ""
    return ArgumentError(
        f"block_size={block_size!r} does not divide the size {V.size} of axis {V.name!r}{hint} "
        "(block_size must be a positive divisor of the vocab size; pad the vocabulary if it has none that suits)"
    )


def blockwise_cross_entropy_loss(
    hidden: NamedArray,
    unembed_weight: NamedArray,
    targets: NamedArray,
    *,
    Embed: AxisSelector = "embed",
    Vocab: AxisSelector = "vocab",
    block_size: int,
    where: NamedArray | None = None,
    reduction: Reduction = "mean",
    z_loss_weight: float = 0.0,
    softcap: float | None = None,
    ignore_index: int | None = IGNORE_INDEX,
    weight_mapping: ResourceMapping | None = None,
    gather: str = "auto",
) -> NamedArray:
    """:func:`cross_entropy_loss` of ``hidden · unembed_weight`` without ever holding all the logits:
    a fused loss with its own gradient.

    The logits exist ``block_size`` vocab entries at a time. One pass over the blocks keeps an
    online log-sum-exp (running max and rescaled sum) and picks the target's logit in the block
    that holds it; only the log-sum-exp of each token is kept for the backward pass, which makes
    each block's logits again and adds their share to the gradients of ``hidden`` and of the
    weight (``jax.custom_vjp``). Neither pass holds an array of size ``tokens × vocab``; the
    largest is ``tokens × block_size``. The matmuls accumulate in float32.

    Under a mesh and a compute mapping the loss runs per device (``nm.shard_map``), with its
    collectives outside the block loop: an embed-split (FSDP) weight is all-gathered once and its
    gradient reduce-scattered once (``gather="once"``), or, to hold a block of it rather than all
    of it, each block is gathered in both passes and its gradient reduce-scattered
    (``gather="blocks"``); ``"auto"`` gathers block by block where the whole head would be more
    than ``nn._fused_loss.WHOLE_HEAD_BYTES`` (16 MiB) per device; a vocab-split weight (Megatron's vocab-parallel head,
    ``{"vocab": "model"}``) stays split, each device making the blocks of its own slice, and only
    ``[tokens]``-sized maxima and sums cross devices; ``block_size`` must then split over those
    devices as the vocab does. Inside an ``nm.shard_map`` body it runs on the blocks it is given.

    For next-token prediction use :func:`blockwise_next_token_loss`, or pass the outputs of
    :func:`next_token_targets` as ``targets`` and ``where``.

    Args:
        hidden: final hidden states with ``Embed`` and the token axes (``batch``, ``position``).
        unembed_weight: the output projection with exactly the axes ``Embed`` and ``Vocab``
            (in either order; a tied ``Embedding.weight`` works as it is).
        targets: integer ids over (some of) the token axes.
        Embed: the contracted axis.
        Vocab: the vocab axis of ``unembed_weight``.
        block_size: vocab entries per block; must divide the vocab size.
        where, reduction, z_loss_weight, ignore_index: as in :func:`cross_entropy_loss`, ids
            outside the vocab included.
        softcap: when set, each logit ``x`` becomes ``tanh(x / softcap) * softcap`` before the loss
            (Gemma 2's ``final_logit_softcapping``, which its model applies to the full logits).
        weight_mapping: the mapping ``unembed_weight`` is stored under (the parameter mapping), so
            that the loss gathers it from where it lies; default: the compute mapping.
        gather: ``"auto"``, ``"once"`` or ``"blocks"``: how an embed-split weight is gathered (above).

    Returns:
        A float32 NamedArray: 0-d for ``"mean"``/``"sum"``, the token axes for ``"none"``.
    """
    _check_reduction(reduction)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ArgumentError(f"softcap={softcap!r}; it must be a positive number, or None for no cap")
    Embed = whole_axis(expect_named(hidden, "blockwise_cross_entropy_loss", "hidden").resolve_axis(Embed))
    V = whole_axis(vocab_axis(unembed_weight, Vocab, "blockwise_cross_entropy_loss", "unembed_weight", "Vocab"))
    if set(unembed_weight.names) != {Embed.name, V.name}:
        raise AxisError(
            f"unembed_weight must have exactly the axes {Embed.name!r} and {V.name!r}, "
            f"got {format_axes(unembed_weight.axes)}"
        )
    if whole_axis(unembed_weight.resolve_axis(Embed.name)) != Embed:
        unembed_weight.resolve_axis(Embed)  # the size error, naming both sizes
    if V.name in hidden.names:
        raise AxisError(f"hidden {format_axes(hidden.axes)} already has the vocab axis {V.name!r}")
    if not isinstance(block_size, int) or block_size <= 0 or V.size % block_size:
        raise block_size_error(V, block_size)
    if weight_mapping is not None:
        check_mapping_values(weight_mapping)
    if gather not in GATHERS:
        raise ArgumentError(f"gather={gather!r}; it must be one of {', '.join(map(repr, GATHERS))}")
    token_axes = tuple(a for a in hidden.axes if a.name != Embed.name)
    _check_targets(targets, V, token_axes)
    where, in_vocab = _screen_ids(targets, V, where, ignore_index, "blockwise_cross_entropy_loss")
    loss = fused_per_token_loss(
        hidden,
        unembed_weight,
        broadcast_to(targets, token_axes),
        Embed=Embed,
        Vocab=V,
        block_size=block_size,
        softcap=softcap,
        z_loss_weight=z_loss_weight,
        weight_mapping=weight_mapping,
        gather=gather,
    )
    return _apply_reduction(_nan_outside(loss, in_vocab), where, reduction)


def blockwise_next_token_loss(
    hidden: NamedArray,
    unembed_weight: NamedArray,
    input_ids: NamedArray,
    *,
    Pos: AxisSelector = "position",
    Embed: AxisSelector = "embed",
    Vocab: AxisSelector = "vocab",
    block_size: int,
    loss_mask: NamedArray | None = None,
    reduction: Reduction = "mean",
    z_loss_weight: float = 0.0,
    softcap: float | None = None,
    ignore_index: int | None = IGNORE_INDEX,
    weight_mapping: ResourceMapping | None = None,
    gather: str = "auto",
) -> NamedArray:
    """:func:`next_token_loss` computed by :func:`blockwise_cross_entropy_loss` (no full logits)."""
    targets, mask = next_token_targets(input_ids, Pos=Pos, loss_mask=loss_mask)
    return blockwise_cross_entropy_loss(
        hidden,
        unembed_weight,
        targets,
        Embed=Embed,
        Vocab=Vocab,
        block_size=block_size,
        where=mask,
        reduction=reduction,
        z_loss_weight=z_loss_weight,
        softcap=softcap,
        ignore_index=ignore_index,
        weight_mapping=weight_mapping,
        gather=gather,
    )
