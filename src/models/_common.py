"""What every model shares: the KV cache, causal attention that reads and writes it, per-layer
dropout keys, the output head, the protocol by which a model hands a loss its hidden states, head
and auxiliary losses, and the description of its Hugging Face tensors (``HfLayout``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

import named as nm
from named import Axis, NamedArray, nn


class LayerCache(NamedTuple):
    """One layer's part of a ``KVCache``: its keys, its values and the rows' first positions."""

    k: NamedArray
    v: NamedArray
    start: NamedArray


class KVCache(eqx.Module):
    """Keys and values of every layer for the tokens decoded so far.

    ``k`` and ``v`` hold one array per layer, each ``(batch, heads | kv_heads, key_position,
    head_size)``: the order both contractions of a decode step read as they lie (the scores
    contract ``head_size``, the weights·values ``key_position``, with batch and heads in front),
    and one buffer per layer, so that a step writes each layer's new token in place (one
    ``dynamic_update_slice``) and its attention reads the buffer without a copy.
    ``key_position`` is the longest sequence the cache can hold. ``start`` (int32 over
    ``batch``) is where each row's tokens begin: a shorter prompt of a batch is padded on the
    left, its token at ``key_position`` s stands at position ``s - start`` and the keys before
    ``start`` are masked. Entries past the current position are garbage that the causal mask hides.
    """

    k: tuple[NamedArray, ...]
    v: tuple[NamedArray, ...]
    start: NamedArray

    @staticmethod
    def init(
        Layers: Axis, Batch: Axis, KeyPos: Axis, Heads: Axis, HeadSize: Axis, dtype=jnp.float32, start=None
    ) -> KVCache:
        if KeyPos.name != "key_position":
            raise nm.ArgumentError(f"the cache's length axis must be called 'key_position', got {KeyPos.name!r}")
        zeros = tuple(nm.zeros((Batch, Heads, KeyPos, HeadSize), dtype) for _ in range(Layers.size))
        start = nm.zeros(Batch, jnp.int32) if start is None else start.astype(jnp.int32)
        return KVCache(zeros, zeros, start)

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self.k[i], self.v[i], self.start)

    def with_layers(self, layers) -> KVCache:
        return KVCache(tuple(c.k for c in layers), tuple(c.v for c in layers), self.start)

    def positions(self, Position: Axis, pos) -> NamedArray:
        """The positions of tokens written at ``pos, pos + 1, ...``: ``(batch, position)``, each row's
        counted from its ``start`` (a padding slot before it gets 0)."""
        return nm.maximum(nm.arange(Position) + pos - self.start, 0).rearrange(("batch", Position.name))


def decode_layers(stack, x: NamedArray, cache: KVCache, pos, **kwargs) -> tuple[NamedArray, KVCache]:
    """``x, layer_cache = block(x, cache=..., pos=pos, **kwargs)`` for each block of ``stack`` (an
    ``nn.Stacked`` or ``nn.BlockSeq``) in a Python loop, each with its own layer of ``cache``;
    keyword arguments with the stack's Layers axis are sliced per layer. The loop is unrolled so
    that each layer's cache stays its own buffer (a scan would slice it out and stack it back)."""
    name = stack.Layers.name
    layers = []
    for i, block in enumerate(stack.unstacked()):
        kw = {k: v[name, i] if isinstance(v, NamedArray) and name in v.names else v for k, v in kwargs.items()}
        x, layer_cache = block(x, cache=cache.layer(i), pos=pos, **kw)
        layers.append(layer_cache)
    return x, cache.with_layers(layers)


class Head(NamedTuple):
    """A model's output head: the logits are ``table.unembed(hidden)``, then
    ``tanh(logits / softcap) * softcap`` where ``softcap`` is set (Gemma 2's ``final_logit_softcapping``).
    A model hands it out beside its final hidden states (``models.hidden_with_aux``), so a loss can
    make the logits a vocab block at a time instead (``nn.blockwise_next_token_loss``)."""

    table: nn.Embedding  # (vocab, embed): the untied lm_head, or the input embedding when tied
    softcap: float | None = None

    @property
    def weight(self) -> NamedArray:
        return self.table.weight

    def logits(self, hidden: NamedArray) -> NamedArray:
        logits = self.table.unembed(hidden)
        return logits if self.softcap is None else nm.tanh(logits / self.softcap) * self.softcap


def causal_attention(
    q: NamedArray,
    k: NamedArray,
    v: NamedArray,
    *,
    segment_ids=None,
    cache: LayerCache | None = None,
    pos=None,
    window=None,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[NamedArray, LayerCache | None]:
    """Causal attention of ``q`` over ``k, v``, all three with a ``position`` axis.

    Without a cache the keys are the queries' own positions (``segment_ids`` keep packed
    documents apart). With one layer's ``cache`` (``KVCache.layer``), ``k, v`` are first written into
    it at ``pos`` and the queries, which stand at ``pos, pos + 1, ...``, attend to the whole cache
    from each row's ``start`` on.
    ``window`` (a sliding window), ``scale`` and ``softcap`` go to ``nn.dot_product_attention``,
    which combines them with the causal mask and the segments.
    Returns the output (the query's axes) and the updated cache (None without one).
    """
    k, v = k.rename({"position": "key_position"}), v.rename({"position": "key_position"})
    options = dict(causal=True, window=window, scale=scale, softcap=softcap)
    if cache is None:
        return nn.dot_product_attention(q, k, v, segment_ids=segment_ids, **options), None
    if segment_ids is not None:
        raise nm.ArgumentError("decoding with a KV cache does not take segment_ids")
    k = nm.updated_slice(cache.k, {"key_position": pos}, k)
    v = nm.updated_slice(cache.v, {"key_position": pos}, v)
    valid = nm.arange(k.resolve_axis("key_position")) >= cache.start  # a left-padded row's padding is no key
    # The XLA path: one query per step needs no blocking, and cuDNN's kernel takes no offset.
    out = nn.dot_product_attention(q, k, v, q_offset=pos, mask=valid, implementation="xla", **options)
    return out, LayerCache(k, v, cache.start)


def split_key(key, n: int):
    """``n`` typed keys from ``key``, a typed or raw (uint32) key; None gives None (no dropout)."""
    if key is None:
        return None
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    return jax.random.split(key, n)


def layer_keys(key, Layers: Axis) -> NamedArray | None:
    """One key per layer as a NamedArray over ``layers`` (Stacked slices it per block)."""
    return None if key is None else nm.named(split_key(key, Layers.size), (Layers,))


def check_sequence_length(input_ids: NamedArray, limit: int, what: str) -> None:
    n = input_ids.axis_size("position")
    if n > limit:
        raise nm.ArgumentError(f"input has {n} positions but the model supports at most {limit} ({what})")


def token_positions(input_ids: NamedArray, segment_ids: NamedArray | None = None) -> NamedArray:
    """Each token's position: its index along ``position``, restarting in every packed segment."""
    if segment_ids is not None:
        return nn.positions_from_segments(segment_ids)
    return nm.arange(input_ids.resolve_axis("position"))


# ---- what a loss asks of a model ---------------------------------------------------------------


def forward_with_aux(
    model, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None
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


def hidden_with_aux(
    model, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None
) -> tuple[NamedArray, Head, dict]:
    """``(hidden, head, aux)``: ``forward_with_aux`` short of the logits, so that a loss can make them a
    vocab block at a time and never hold all of them (``nn.blockwise_next_token_loss(hidden,
    head.weight, ..., softcap=head.softcap)``). ``hidden`` are the final hidden states (after the
    last norm), ``head.logits(hidden)`` the logits ``forward_with_aux`` returns, ``aux`` its
    auxiliary losses. A model takes part with a ``hidden_with_aux`` method of this signature.
    """
    method = getattr(model, "hidden_with_aux", None)
    if method is None:
        raise nm.ArgumentError(
            f"{type(model).__name__} has no hidden_with_aux method: it hands out only its logits, "
            "so its loss cannot be made a vocab block at a time"
        )
    return method(input_ids, segment_ids=segment_ids, key=key)


# ---- Hugging Face tensors ------------------------------------------------------------------------

LINEAR_LAYOUTS = ("in_out", "out_in")


@dataclasses.dataclass(frozen=True)
class HfLayout:
    """How a model's parameters are named and stored in a Hugging Face folder (``models/hf.py``
    reads and writes every family through one of these).

    Attributes:
        keys: our parameter path (``nm.state_dict``'s) -> the ``transformers`` tensor name;
            ``{i}`` stands for the layer, ``{j}`` for an MoE layer's expert.
        linear: how a Linear weight is stored: ``in_out`` (GPT-2's Conv1D, our own order with
            each side flattened) or ``out_in`` (torch's nn.Linear: the transpose).
        base_prefix: the base model's prefix, which some folders leave out (the original
            OpenAI GPT-2 checkpoints): a tensor found without it is read as if it had it.
        ignored: regular expressions of tensor names that are no parameter (buffers that
            older checkpoints saved), skipped when reading.
    """

    keys: Mapping[str, str]
    linear: str
    base_prefix: str = ""
    ignored: tuple[str, ...] = ()

    def __post_init__(self):
        if self.linear not in LINEAR_LAYOUTS:
            raise nm.ArgumentError(f"HfLayout.linear={self.linear!r} is not one of {', '.join(LINEAR_LAYOUTS)}")

    def with_keys(self, keys: Mapping[str, str]) -> HfLayout:
        """This layout with ``keys`` added or renamed (Mixtral's names for the decoder's experts)."""
        return dataclasses.replace(self, keys={**self.keys, **keys})
