"""``load_pretrained(..., check=True)``: a few tokens through our model and, where ``transformers``
is installed, through theirs on the same folder; the report says how far apart the logits are.

``transformers`` and ``torch`` are optional: without them the check is ours alone (the logits
have the expected shape and are finite; ``hf.check_pretrained`` adds the key coverage).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import named as nm


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """What ``check_pretrained`` found. ``max_logit_diff`` is None when there was no reference."""

    family: str
    tokens: tuple[int, int]  # (batch, position) of the ids run
    tensors: int  # tensors of the folder that became parameters
    max_logit_diff: float | None
    reference: str  # the transformers class compared against, or why none was

    def __str__(self) -> str:
        diff = "no reference" if self.max_logit_diff is None else f"max |logit difference| {self.max_logit_diff:.2e}"
        return (
            f"{self.family}: {self.tensors} tensors mapped, logits of {self.tokens[0]}x{self.tokens[1]} tokens "
            f"checked; {diff} vs {self.reference}"
        )


def check_ids(vocab_size: int, max_positions: int) -> np.ndarray:
    return np.random.RandomState(0).randint(0, vocab_size, (2, min(8, max_positions))).astype(np.int32)


@eqx.filter_jit
def _forward(model, ids):
    model = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, model)
    return model(ids).rearrange(("batch", "position", "vocab")).array


def our_logits(model, ids: np.ndarray) -> np.ndarray:
    """Our float32 logits ``[batch, position, vocab]``; refuses any other shape or a non-finite value."""
    logits = np.asarray(_forward(model, nm.named(jnp.asarray(ids), ("batch", "position"))))
    vocab = model.config.vocab_size
    if logits.shape != ids.shape + (vocab,):
        raise nm.ArgumentError(f"logits have shape {logits.shape}, expected {ids.shape + (vocab,)}")
    if not np.isfinite(logits).all():
        raise nm.ArgumentError("the logits are not all finite")
    return logits


def transformers_logits(folder: Path, ids: np.ndarray) -> tuple[np.ndarray | None, str]:
    """transformers' float32 logits for ``folder`` (eager attention) and its class, or None and why not."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return None, "transformers (not installed)"
    import torch
    import transformers

    # safetensors only: transformers would otherwise fall back to a pickled pytorch_model.bin
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", use_safetensors=True
    )
    with torch.no_grad():
        logits = model.eval()(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    return logits, f"transformers {transformers.__version__} {type(model).__name__}"
