"""Text from a model, one prompt at a time: the loop's periodic samples (``trainer.sample_interval``)
and ``named-sample``'s continuation of a prompt or chat message."""

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
    prompt_ids = nm.named(jnp.asarray([ids], jnp.int32), ("batch", "position"))
    out = models.generate(
        model, prompt_ids, n_tokens, temperature=temperature, top_k=top_k, top_p=top_p, key=key, stop_ids=stop_ids
    )
    new = [int(i) for i in np.asarray(out.array)[0, len(ids) :]]
    ends = [k for k, i in enumerate(new) if i in stop_ids]
    return new[: ends[0]] if ends else new
