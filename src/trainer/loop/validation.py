"""The validation loss the loop logs: over the validation rows and, for a mixture, per named source,
each source's evaluated batches standing for all its rows (``eval_losses``)."""

from __future__ import annotations

import jax

from ..data import Data, JoinedRows, PackedSequences, Sequences, eval_batches, num_eval_batches


def eval_losses(loss_sum, data: Data, t) -> dict[str, float]:
    """``loss`` over the validation rows and, for several named sources, ``<name>/loss`` per
    source. ``loss_sum(batch)`` gives a batch's summed token loss and its count of loss tokens.

    Each source is evaluated on its first ``trainer.eval_batches`` batches (0: all of them), and
    its rows count in the overall ``loss`` as many times as they stand for its validation rows:
    the overall loss estimates the loss over every validation token, and equals it when every
    batch is evaluated. (Evaluating the sources' rows one after another instead would make the
    first ``eval_batches`` batches, and so the overall loss, the first source's alone.)"""
    if not data.validation_sources:
        total, count, _ = _eval_sums(loss_sum, data.validation, t)
        return {"loss": total / max(count, 1.0)}
    per_source, total, count = {}, 0.0, 0.0
    for name, rows in data.validation_sources.items():
        s, c, seen = _eval_sums(loss_sum, rows, t)
        per_source[f"{name}/loss"] = s / max(c, 1.0)
        stands_for = len(rows) / seen  # validation rows of this source per evaluated row
        total, count = total + stands_for * s, count + stands_for * c
    return {"loss": total / max(count, 1.0), **per_source}


def _eval_sums(loss_sum, rows: Sequences | PackedSequences | JoinedRows, t) -> tuple[float, float, int]:
    """The summed loss and loss tokens of the first ``trainer.eval_batches`` batches of ``rows``
    (all of them for 0), and how many of its rows these batches hold."""
    limit = t.eval_batches or num_eval_batches(rows, t.train_batch_size)
    total = count = 0.0
    for i, b in enumerate(
        eval_batches(
            rows, batch_size=t.train_batch_size, process_index=jax.process_index(), process_count=jax.process_count()
        )
    ):
        if i >= limit:
            break
        s, c = loss_sum(b)
        total, count = total + float(s), count + float(c)
    return total, count, min(limit * t.train_batch_size, len(rows))
