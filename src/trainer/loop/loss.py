"""The loss the trainer minimises, in one place for the train step, the eval step and the checks
that trace it: the next-token cross-entropy of every token, from the model's full logits or, with
``trainer.loss_block_size``, from its final hidden states a vocab block at a time by the fused
loss (``nn.blockwise_next_token_loss``), so that the ``[batch, position, vocab]`` logits (and
their gradient) never exist and the output head is gathered once per step."""

from __future__ import annotations

from named import NamedArray, models
from named.nn.loss import blockwise_next_token_loss, next_token_loss


def token_losses(
    model, batch: dict[str, NamedArray], *, key=None, block_size: int | None = None, param_mapping=None
) -> tuple[NamedArray, dict]:
    """``(per_token, aux)``: the float32 next-token loss at each ``(batch, position)`` (zero where
    ``loss_mask`` or the last position masks it out) and the model's auxiliary losses
    ``{name: (weight, value)}`` (``models.forward_with_aux``). ``block_size``: vocab entries per block
    of ``nn.blockwise_next_token_loss``, the fused loss (which keeps the model's logit soft-cap and
    gathers the head from where ``param_mapping`` stores it); None: full logits."""
    ids, segments, mask = batch["input_ids"], batch.get("segment_ids"), batch.get("loss_mask")
    if block_size is None:
        logits, aux = models.forward_with_aux(model, ids, segment_ids=segments, key=key)
        return next_token_loss(logits, ids, loss_mask=mask, reduction="none"), aux
    hidden, head, aux = models.hidden_with_aux(model, ids, segment_ids=segments, key=key)
    per_token = blockwise_next_token_loss(
        hidden,
        head.weight,
        ids,
        block_size=block_size,
        softcap=head.softcap,
        loss_mask=mask,
        reduction="none",
        weight_mapping=param_mapping,
    )
    return per_token, aux
