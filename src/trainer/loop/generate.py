"""Text from a model: the loop's periodic samples (``trainer.sample_interval``), ``named-sample``'s
continuation of a prompt or chat message, and ``named-eval``'s ``generate_until`` requests (batched)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import named as nm
from named import models


def sample_text(
    model,
    tokenizer,
    prompt: str,
    n_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    key=None,
    stop_ids: tuple[int, ...] = (),
) -> str:
    """``prompt`` and its continuation, cut before the first of ``stop_ids`` (which is not shown)."""
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    return prompt + tokenizer.decode(
        continue_ids(model, ids, n_tokens, temperature=temperature, top_k=top_k, key=key, stop_ids=stop_ids)
    )


def continue_ids(
    model,
    ids: list[int],
    n_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key=None,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Up to ``n_tokens`` new ids after ``ids``, ending before the first of ``stop_ids``."""
    return continue_rows(
        model, [ids], n_tokens, temperature=temperature, top_k=top_k, top_p=top_p, key=key, stop_ids=stop_ids
    )[0]


def continue_rows(
    model,
    rows: list[list[int]],
    n_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key=None,
    stop_ids: tuple[int, ...] = (),
    width: int | None = None,
    batch: int | None = None,
) -> list[list[int]]:
    """Up to ``n_tokens`` new ids after each of ``rows`` (prompts of any lengths), decoded as one
    batch, each ending before its first of ``stop_ids``. ``width`` (at least the longest row) and
    ``batch`` (at least ``len(rows)``; the extra rows repeat the first) pad the program's shape, so
    that batches of nearby sizes share one compiled program."""
    width = max(len(r) for r in rows) if width is None else width
    batch = len(rows) if batch is None else batch
    ids = np.zeros((batch, width), np.int32)
    lengths = np.zeros(batch, np.int32)
    for r in range(batch):
        row = rows[r] if r < len(rows) else rows[0]
        ids[r, : len(row)], lengths[r] = row, len(row)
    out = models.generate(
        model,
        nm.named(jnp.asarray(ids), ("batch", "position")),
        n_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        key=key,
        stop_ids=stop_ids,
        prompt_lengths=None if (lengths == width).all() else lengths,
    )
    new = np.asarray(out.array)[: len(rows), width:].tolist()
    return [row[: next((k for k, i in enumerate(row) if i in stop_ids), len(row))] for row in new]
