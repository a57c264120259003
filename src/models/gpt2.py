"""GPT-2 (Radford et al., 2019) written against axis names, with Hugging Face parameter names.

Axes (every array below is laid out by these names, never by position):

    batch         sequences in a batch
    position      the tokens being computed (queries)
    key_position  the tokens attended to (keys and values; the KV cache when decoding)
    embed         the residual stream, ``n_embd``
    qkv           query / key / value, the three parts of the fused input projection ``c_attn``
    heads         attention heads, ``n_head``
    head_size     ``n_embd // n_head``
    mlp           MLP hidden units, ``n_inner`` (default ``4 * n_embd``)
    vocab         the vocabulary, ``vocab_size``
    max_position  rows of the learned position table, ``n_positions``
    layers        the stacked transformer blocks, ``n_layer``
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax

import named as nm
from named import Axis, NamedArray, nn

from ._common import (
    Head,
    HfLayout,
    KVCache,
    causal_attention,
    check_sequence_length,
    decode_layers,
    layer_keys,
    split_key,
    token_positions,
)

Qkv = Axis("qkv", 3)


@dataclasses.dataclass(frozen=True)
class Gpt2Config:
    """GPT-2 hyper-parameters; the defaults are the 124M model. Field names follow Hugging Face."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_positions: int = 1024
    vocab_size: int = 50257
    dropout: float = 0.0  # on the embeddings and on each residual branch (none on attention weights)
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_new"
    tie_word_embeddings: bool = True
    n_inner: int | None = None  # MLP width; None means 4 * n_embd
    remat: str = "none"  # gradient checkpointing of each block: an nn.Stacked policy ("full", "save_dots", ...)

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise nm.ArgumentError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        nn.activation(self.activation)  # fails early on an unknown name

    Embed = property(lambda self: Axis("embed", self.n_embd))
    Heads = property(lambda self: Axis("heads", self.n_head))
    HeadSize = property(lambda self: Axis("head_size", self.n_embd // self.n_head))
    Mlp = property(lambda self: Axis("mlp", self.n_inner or 4 * self.n_embd))
    Vocab = property(lambda self: Axis("vocab", self.vocab_size))
    MaxPosition = property(lambda self: Axis("max_position", self.n_positions))
    Layers = property(lambda self: Axis("layers", self.n_layer))


def _residual_scale(config: Gpt2Config) -> float:
    # GPT-2 shrinks the init of the projections that write into the residual stream
    return 1 / math.sqrt(2 * config.n_layer)


class Gpt2Attention(eqx.Module):
    c_attn: nn.Linear  # embed -> (qkv, heads, head_size)
    c_proj: nn.Linear  # (heads, head_size) -> embed

    @staticmethod
    def init(config: Gpt2Config, *, key) -> Gpt2Attention:
        k_attn, k_proj = jax.random.split(key)
        c = config
        return Gpt2Attention(
            nn.Linear.init(c.Embed, (Qkv, c.Heads, c.HeadSize), key=k_attn),
            nn.Linear.init((c.Heads, c.HeadSize), c.Embed, key=k_proj, init_scale=_residual_scale(c)),
        )

    def __call__(self, x: NamedArray, *, segment_ids=None, cache=None, pos=None):
        q, k, v = nm.unbind(self.c_attn(x), "qkv")
        out, cache = causal_attention(q, k, v, segment_ids=segment_ids, cache=cache, pos=pos)
        return self.c_proj(out), cache


class Gpt2Block(eqx.Module):
    ln_1: nn.LayerNorm
    attn: Gpt2Attention
    ln_2: nn.LayerNorm
    mlp: nn.MLP  # up = HF c_fc, down = HF c_proj
    dropout: nn.Dropout

    @staticmethod
    def init(config: Gpt2Config, *, key) -> Gpt2Block:
        k_attn, k_mlp = jax.random.split(key)
        eps = config.layer_norm_epsilon
        mlp = nn.MLP.init(config.Embed, config.Mlp, key=k_mlp, activation=config.activation)
        mlp = eqx.tree_at(lambda m: m.down.weight, mlp, mlp.down.weight * _residual_scale(config))
        return Gpt2Block(
            nn.LayerNorm.init(config.Embed, eps=eps),
            Gpt2Attention.init(config, key=k_attn),
            nn.LayerNorm.init(config.Embed, eps=eps),
            mlp,
            nn.Dropout(config.dropout),
        )

    def __call__(self, x: NamedArray, *, segment_ids=None, cache=None, pos=None, key=None):
        # key: this block's entry of the per-layer keys (a NamedArray without axes), or None
        k_attn, k_mlp = (None, None) if key is None else split_key(key.array, 2)
        h, cache = self.attn(self.ln_1(x), segment_ids=segment_ids, cache=cache, pos=pos)
        x = x + self.dropout(h, key=k_attn, inference=key is None)
        x = x + self.dropout(self.mlp(self.ln_2(x)), key=k_mlp, inference=key is None)
        return x, cache


class Gpt2LMHeadModel(eqx.Module):
    wte: nn.Embedding  # (vocab, embed); also the output head when tied
    wpe: nn.Embedding  # (max_position, embed)
    blocks: nn.Stacked[Gpt2Block]
    ln_f: nn.LayerNorm
    lm_head: nn.Embedding | None  # (vocab, embed); None when tied to wte
    dropout: nn.Dropout
    config: Gpt2Config = eqx.field(static=True)

    @staticmethod
    def init(config: Gpt2Config, *, key) -> Gpt2LMHeadModel:
        k_wte, k_wpe, k_blocks, k_head = jax.random.split(key, 4)
        c = config
        return Gpt2LMHeadModel(
            nn.Embedding.init(c.Vocab, c.Embed, key=k_wte),
            nn.Embedding.init(c.MaxPosition, c.Embed, key=k_wpe),
            nn.Stacked.init(c.Layers, Gpt2Block.init, c, key=k_blocks, remat=c.remat),
            nn.LayerNorm.init(c.Embed, eps=c.layer_norm_epsilon),
            None if c.tie_word_embeddings else nn.Embedding.init(c.Vocab, c.Embed, key=k_head),
            nn.Dropout(c.dropout),
            c,
        )

    def __call__(self, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None) -> NamedArray:
        """Logits ``(batch, position, vocab)`` for token ids ``(batch, position)``.

        ``segment_ids`` (same axes) pack several documents in one row: attention stays within
        a segment and positions restart at each one, so a packed row computes what its
        documents would separately. ``key`` turns dropout on; without it the model is
        deterministic (inference).
        """
        hidden, head, _ = self.hidden_with_aux(input_ids, segment_ids=segment_ids, key=key)
        return head.logits(hidden)

    def hidden_with_aux(
        self, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None
    ) -> tuple[NamedArray, Head, dict]:
        """The call short of its logits: the final hidden states ``(batch, position, embed)``, the
        head that makes the logits of them, and no auxiliary losses (``models.hidden_with_aux``)."""
        check_sequence_length(input_ids, self.config.n_positions, "n_positions")
        positions = token_positions(input_ids, segment_ids)
        hidden = self._run(input_ids, positions, segment_ids=segment_ids, key=key)
        return hidden, self.head, {}

    def decode(self, input_ids: NamedArray, cache: KVCache, pos, *, last: bool = False) -> tuple[NamedArray, KVCache]:
        """Logits for ``input_ids`` standing at positions ``pos, pos + 1, ...`` of sequences whose
        earlier keys and values are in ``cache``; returns them and the cache with these tokens added.
        ``last``: the logits of the last position only (all a prefill needs), without ``position``."""
        positions = cache.positions(input_ids.resolve_axis("position"), pos)
        x, cache = decode_layers(self.blocks, self.wte(input_ids) + self.wpe(positions), cache, pos)
        hidden = self.ln_f(x["position", -1] if last else x)
        return self.head.logits(hidden), cache

    @property
    def head(self) -> Head:
        return Head(self.wte if self.lm_head is None else self.lm_head)

    def init_cache(self, Batch: Axis, max_length: int, start: NamedArray | None = None) -> KVCache:
        """An empty cache of ``max_length`` positions; ``start`` (over ``batch``): where each row's
        tokens begin, for prompts padded on the left (``KVCache``)."""
        c = self.config
        if max_length > c.n_positions:
            raise nm.ArgumentError(f"a cache of {max_length} positions exceeds n_positions={c.n_positions}")
        KeyPos = Axis("key_position", max_length)
        return KVCache.init(c.Layers, Batch, KeyPos, c.Heads, c.HeadSize, self.wte.weight.dtype, start)

    def _run(self, input_ids, positions, *, segment_ids=None, key=None):
        k_embed, k_layers = split_key(key, 2) if key is not None else (None, None)
        x = self.wte(input_ids) + self.wpe(positions)
        x = self.dropout(x, key=k_embed, inference=key is None)
        x, _ = self.blocks.scan(x, segment_ids=segment_ids, key=layer_keys(k_layers, self.config.Layers))
        return self.ln_f(x)


# ---- size and cost --------------------------------------------------------------------


def num_params(config: Gpt2Config) -> int:
    """Every parameter of the model (a tied embedding counted once), position table included."""
    D, V, M, L = config.n_embd, config.vocab_size, config.Mlp.size, config.n_layer
    per_layer = 2 * D + (3 * D * D + 3 * D) + (D * D + D) + 2 * D + (D * M + M) + (M * D + D)
    head = 0 if config.tie_word_embeddings else V * D
    return V * D + config.n_positions * D + L * per_layer + 2 * D + head


def flops_per_token(config: Gpt2Config, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: ``6 N + 12 L d T``.

    ``N`` counts the weights that take part in a matmul: the attention and MLP projections
    of every layer and the output head (``V d``, tied or not); not the biases, norms or the
    embedding gathers. ``12 L d T`` is the attention (``q·k`` and ``weights·v``, ``d =
    n_embd``, ``T = seq_len``) with the causal mask *not* halving it (PaLM's convention).
    """
    D, M, L = config.n_embd, config.Mlp.size, config.n_layer
    n_matmul = L * (4 * D * D + 2 * D * M) + D * config.vocab_size
    return 6.0 * n_matmul + 12.0 * L * D * seq_len


# ---- Hugging Face layout ------------------------------------------------------------------
# Our parameter path -> the transformers GPT2LMHeadModel tensor name; "{i}" is the layer.
# GPT-2's Conv1D stores its weight [in, out], as our Linear does (In axes, then Out axes,
# flattened): c_attn [embed, 3 * embed] is our (embed, qkv, heads, head_size) reshaped.

HF_LAYOUT = HfLayout(
    linear="in_out",
    base_prefix="transformer.",  # the original OpenAI checkpoints were saved without it
    ignored=(r"\.attn\.bias$", r"\.attn\.masked_bias$"),  # causal-mask buffers of old checkpoints
    keys={
        "wte.weight": "transformer.wte.weight",
        "wpe.weight": "transformer.wpe.weight",
        "blocks.stacked.ln_1.weight": "transformer.h.{i}.ln_1.weight",
        "blocks.stacked.ln_1.bias": "transformer.h.{i}.ln_1.bias",
        "blocks.stacked.attn.c_attn.weight": "transformer.h.{i}.attn.c_attn.weight",
        "blocks.stacked.attn.c_attn.bias": "transformer.h.{i}.attn.c_attn.bias",
        "blocks.stacked.attn.c_proj.weight": "transformer.h.{i}.attn.c_proj.weight",
        "blocks.stacked.attn.c_proj.bias": "transformer.h.{i}.attn.c_proj.bias",
        "blocks.stacked.ln_2.weight": "transformer.h.{i}.ln_2.weight",
        "blocks.stacked.ln_2.bias": "transformer.h.{i}.ln_2.bias",
        "blocks.stacked.mlp.up.weight": "transformer.h.{i}.mlp.c_fc.weight",
        "blocks.stacked.mlp.up.bias": "transformer.h.{i}.mlp.c_fc.bias",
        "blocks.stacked.mlp.down.weight": "transformer.h.{i}.mlp.c_proj.weight",
        "blocks.stacked.mlp.down.bias": "transformer.h.{i}.mlp.c_proj.bias",
        "ln_f.weight": "transformer.ln_f.weight",
        "ln_f.bias": "transformer.ln_f.bias",
        "lm_head.weight": "lm_head.weight",  # untied only
    },
)
