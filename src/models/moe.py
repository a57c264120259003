"""What the mixture-of-experts families add to the decoder: the auxiliary-loss protocol the
trainer reads (and its variant that stops short of the logits), and Mixtral's tensor names. The
MoE layer is ``named.nn.MoE``; the decoder (``decoder.py``) builds it in place of the MLP when
``num_experts`` is set, and the families (``families.py``: Mixtral, Qwen2-MoE, Qwen3-MoE) are
configs like the dense ones.
"""

from __future__ import annotations

import types

from named import ArgumentError, NamedArray

from . import decoder
from ._common import Head


def forward_with_aux(model, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None
                     ) -> tuple[NamedArray, dict]:
    """``(logits, {name: (weight, value)})``: the protocol by which a model hands auxiliary losses
    to the trainer. A model with a ``forward_with_aux`` method of this signature returns its
    logits and its auxiliary losses, each a scalar ``value`` (a mean over the batch's tokens) with
    the ``weight`` (a float) it carries in the training loss; the trainer adds ``weight * value``
    to the mean next-token loss and reports ``value`` under ``aux/<name>``. Any other model has none.
    """
    method = getattr(model, "forward_with_aux", None)
    if method is None:
        return model(input_ids, segment_ids=segment_ids, key=key), {}
    return method(input_ids, segment_ids=segment_ids, key=key)


def hidden_with_aux(model, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None
                    ) -> tuple[NamedArray, Head, dict]:
    """``(hidden, head, aux)``: ``forward_with_aux`` short of the logits, so that a loss can make them a
    vocab block at a time and never hold all of them (``nn.blockwise_next_token_loss(hidden,
    head.weight, ..., softcap=head.softcap)``). ``hidden`` are the final hidden states (after the
    last norm), ``head.logits(hidden)`` the logits ``forward_with_aux`` returns, ``aux`` its
    auxiliary losses. A model takes part with a ``hidden_with_aux`` method of this signature.
    """
    method = getattr(model, "hidden_with_aux", None)
    if method is None:
        raise ArgumentError(f"{type(model).__name__} has no hidden_with_aux method: it hands out only its logits, "
                            "so its loss cannot be made a vocab block at a time")
    return method(input_ids, segment_ids=segment_ids, key=key)


# Mixtral keeps its experts in "block_sparse_moe" and calls their gate, up and down w1, w3, w2. A
# registry Family's "module" gives the key map; this one is the decoder's with those names.
MIXTRAL = types.SimpleNamespace(
    HF_KEYS={**decoder.HF_KEYS, **decoder.moe_hf_keys("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"})},
    HF_LINEAR_LAYOUT=decoder.HF_LINEAR_LAYOUT, HF_BASE_PREFIX=decoder.HF_BASE_PREFIX, HF_IGNORED=decoder.HF_IGNORED,
    num_params=decoder.num_params, flops_per_token=decoder.flops_per_token,
)
