"""Llama (Touvron et al., 2023): RMSNorm, rotary positions, grouped-query attention and a SwiGLU
MLP, written against axis names, with Hugging Face parameter names.

Axes (every array below is laid out by these names, never by position):

    batch         sequences in a batch
    position      the tokens being computed (queries)
    key_position  the tokens attended to (keys and values; the KV cache when decoding)
    embed         the residual stream, ``hidden_size``
    heads         query heads, ``num_attention_heads``
    kv_heads      key/value heads, ``num_key_value_heads``; each serves ``heads / kv_heads``
                  consecutive query heads
    head_size     ``head_dim`` (default ``hidden_size // num_attention_heads``)
    mlp           MLP hidden units, ``intermediate_size``
    vocab         the vocabulary, ``vocab_size``
    layers        the stacked decoder layers, ``num_hidden_layers``
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax

import named as nm
from named import Axis, NamedArray, nn

from ._common import KVCache, causal_attention, check_sequence_length, token_positions


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama hyper-parameters (defaults: Llama-2 7B). Field names follow Hugging Face."""

    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    vocab_size: int = 32000
    head_dim: int | None = None  # None means hidden_size // num_attention_heads
    remat: str = "none"  # gradient checkpointing of each layer: an nn.Stacked policy ("full", "save_dots", ...)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}; set head_dim")

    Embed = property(lambda self: Axis("embed", self.hidden_size))
    Heads = property(lambda self: Axis("heads", self.num_attention_heads))
    KVHeads = property(lambda self: Axis("kv_heads", self.num_key_value_heads))
    HeadSize = property(lambda self: Axis("head_size", self.head_dim or self.hidden_size // self.num_attention_heads))
    Mlp = property(lambda self: Axis("mlp", self.intermediate_size))
    Vocab = property(lambda self: Axis("vocab", self.vocab_size))
    Layers = property(lambda self: Axis("layers", self.num_hidden_layers))


class LlamaAttention(eqx.Module):
    q_proj: nn.Linear  # embed -> (heads, head_size)
    k_proj: nn.Linear  # embed -> (kv_heads, head_size)
    v_proj: nn.Linear  # embed -> (kv_heads, head_size)
    o_proj: nn.Linear  # (heads, head_size) -> embed
    rope_theta: float = eqx.field(static=True)

    @staticmethod
    def init(config: LlamaConfig, *, key) -> LlamaAttention:
        c = config
        kq, kk, kv, ko = jax.random.split(key, 4)
        return LlamaAttention(
            nn.Linear.init(c.Embed, (c.Heads, c.HeadSize), key=kq, use_bias=False),
            nn.Linear.init(c.Embed, (c.KVHeads, c.HeadSize), key=kk, use_bias=False),
            nn.Linear.init(c.Embed, (c.KVHeads, c.HeadSize), key=kv, use_bias=False),
            nn.Linear.init((c.Heads, c.HeadSize), c.Embed, key=ko, use_bias=False),
            c.rope_theta,
        )

    def __call__(self, x: NamedArray, positions: NamedArray, *, segment_ids=None, cache=None, pos=None):
        # HF checkpoints already hold q/k in the rotate-half layout nn.rotary_embedding uses: no permutation.
        q = nn.rotary_embedding(self.q_proj(x), positions, theta=self.rope_theta)
        k = nn.rotary_embedding(self.k_proj(x), positions, theta=self.rope_theta)
        out, cache = causal_attention(q, k, self.v_proj(x), segment_ids=segment_ids, cache=cache, pos=pos)
        return self.o_proj(out), cache


class LlamaDecoderLayer(eqx.Module):
    input_layernorm: nn.RMSNorm
    self_attn: LlamaAttention
    post_attention_layernorm: nn.RMSNorm
    mlp: nn.MLP  # down(silu(gate(x)) * up(x))

    @staticmethod
    def init(config: LlamaConfig, *, key) -> LlamaDecoderLayer:
        k_attn, k_mlp = jax.random.split(key)
        eps = config.rms_norm_eps
        return LlamaDecoderLayer(
            nn.RMSNorm.init(config.Embed, eps=eps),
            LlamaAttention.init(config, key=k_attn),
            nn.RMSNorm.init(config.Embed, eps=eps),
            nn.MLP.init(config.Embed, config.Mlp, key=k_mlp, activation="silu", gated=True, use_bias=False),
        )

    def __call__(self, x: NamedArray, *, positions, segment_ids=None, cache=None, pos=None):
        h, cache = self.self_attn(self.input_layernorm(x), positions, segment_ids=segment_ids, cache=cache, pos=pos)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


class LlamaLMHeadModel(eqx.Module):
    embed_tokens: nn.Embedding  # (vocab, embed); also the output head when tied
    layers: nn.Stacked[LlamaDecoderLayer]
    norm: nn.RMSNorm
    lm_head: nn.Embedding | None  # (vocab, embed); None when tied to embed_tokens
    config: LlamaConfig = eqx.field(static=True)

    @staticmethod
    def init(config: LlamaConfig, *, key) -> LlamaLMHeadModel:
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        c = config
        return LlamaLMHeadModel(
            nn.Embedding.init(c.Vocab, c.Embed, key=k_embed),
            nn.Stacked.init(c.Layers, LlamaDecoderLayer.init, c, key=k_layers, remat=c.remat),
            nn.RMSNorm.init(c.Embed, eps=c.rms_norm_eps),
            None if c.tie_word_embeddings else nn.Embedding.init(c.Vocab, c.Embed, key=k_head),
            c,
        )

    def __call__(self, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None) -> NamedArray:
        """Logits ``(batch, position, vocab)`` for token ids ``(batch, position)``.

        ``segment_ids`` (same axes) pack several documents in one row: attention stays within
        a segment and rotary positions restart at each one. ``key`` is accepted for a uniform
        signature; Llama has no dropout.
        """
        check_sequence_length(input_ids, self.config.max_position_embeddings, "max_position_embeddings")
        positions = token_positions(input_ids, segment_ids)
        logits, _ = self._run(input_ids, positions, segment_ids=segment_ids)
        return logits

    def decode(self, input_ids: NamedArray, cache: KVCache, pos) -> tuple[NamedArray, KVCache]:
        """Logits for ``input_ids`` standing at positions ``pos, pos + 1, ...`` of sequences whose
        earlier keys and values are in ``cache``; returns them and the cache with these tokens added."""
        positions = nm.arange(input_ids.resolve_axis("position")) + pos
        return self._run(input_ids, positions, cache=cache, pos=pos)

    def init_cache(self, Batch: Axis, max_length: int) -> KVCache:
        c = self.config
        if max_length > c.max_position_embeddings:
            raise ValueError(f"a cache of {max_length} positions exceeds "
                             f"max_position_embeddings={c.max_position_embeddings}")
        KeyPos = Axis("key_position", max_length)
        return KVCache.init(c.Layers, Batch, KeyPos, c.KVHeads, c.HeadSize, self.embed_tokens.weight.dtype)

    def _run(self, input_ids, positions, *, segment_ids=None, cache=None, pos=None):
        x = self.embed_tokens(input_ids)
        x, cache = self.layers.scan(x, positions=positions, segment_ids=segment_ids, cache=cache, pos=pos)
        x = self.norm(x)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.unembed(x), cache


# ---- size and cost --------------------------------------------------------------------


def _matmul_params_per_layer(c: LlamaConfig) -> int:
    D, H, KV, hd, M = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.HeadSize.size, c.intermediate_size
    return D * H * hd + 2 * D * KV * hd + H * hd * D + 3 * D * M


def num_params(config: LlamaConfig) -> int:
    """Every parameter of the model (a tied embedding counted once)."""
    D, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    head = 0 if config.tie_word_embeddings else V * D
    return V * D + L * (_matmul_params_per_layer(config) + 2 * D) + D + head


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: ``6 N + 12 L d T``.

    ``N`` counts the weights that take part in a matmul: q, k, v, o and the three MLP
    projections of every layer and the output head (``V · hidden``, tied or not); not the
    norms or the embedding gather. ``12 L d T`` is the attention (``q·k`` and ``weights·v``,
    ``d = heads · head_size``, ``T = seq_len``) with the causal mask *not* halving it (PaLM's
    convention).
    """
    L, d = config.num_hidden_layers, config.num_attention_heads * config.HeadSize.size
    n_matmul = L * _matmul_params_per_layer(config) + config.hidden_size * config.vocab_size
    return 6.0 * n_matmul + 12.0 * L * d * seq_len


# ---- Hugging Face layout ------------------------------------------------------------------
# Our parameter path -> the transformers LlamaForCausalLM tensor name; "{i}" is the layer.
# torch's nn.Linear stores its weight [out, in]: the transpose of our Linear's (In, Out) with
# each side flattened, e.g. q_proj [heads * head_size, embed].

HF_LINEAR_LAYOUT = "out_in"
HF_BASE_PREFIX = "model."
HF_IGNORED = (r"\.rotary_emb\.inv_freq$",)  # a buffer some older checkpoints saved
HF_KEYS = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "layers.stacked.input_layernorm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.stacked.self_attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.stacked.self_attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.stacked.self_attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.stacked.self_attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.stacked.post_attention_layernorm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.stacked.mlp.gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.stacked.mlp.up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.stacked.mlp.down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",  # untied only
}
