"""The decoder family: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, OLMo 2, Gemma 2 and Gemma 3 (text) as
one model whose differences are configuration, not copied classes. Parameter names are Hugging
Face's, so a family's key map is the identity under ``model.``.

What the families change, and the field of ``DecoderConfig`` that says it:

    RoPE variant (llama3, linear, yarn, ...)    rope_theta, rope_scaling
    q/k/v and o biases (Qwen2: q/k/v only)      qkv_bias, o_bias
    q/k RMSNorm per head (Qwen3, Gemma 3) or
      over the whole projection (OLMo 2)        qk_norm = "head" | "projection"
    where the norms sit (OLMo 2: after each
      sublayer; Gemma: before and after)        norm_layout = "pre" | "post" | "sandwich"
    (1 + w) norms, embeddings * sqrt(hidden)    norm_unit_offset, scale_embeddings (Gemma)
    score scale, attention / logit soft-caps    query_pre_attn_scalar, attn_logit_softcapping,
                                                final_logit_softcapping (Gemma 2)
    sliding-window layers (Mistral: all; Qwen:  sliding_window with sliding_window_pattern or
      from max_window_layers; Gemma: 1:1, 5:1)    layer_types; rope_local_base_freq (Gemma 3)
    a mixture of experts in place of the MLP    num_experts, num_experts_per_tok, moe_intermediate_size,
      (Mixtral, Qwen2/3-MoE)                      norm_topk_prob, shared_expert_intermediate_size, ...

Layers that differ (local and global) still share one set of stacked weights and one ``scan``:
what differs per layer (its window, its rotary frequencies) is passed to the scan as data with
a ``layers`` axis, and sliced per layer like the weights.

Axes (every array below is laid out by these names, never by position):

    batch         sequences in a batch
    position      the tokens being computed (queries)
    key_position  the tokens attended to (keys and values; the KV cache when decoding)
    embed         the residual stream, ``hidden_size``
    heads         query heads, ``num_attention_heads``
    kv_heads      key/value heads, ``num_key_value_heads``; each serves ``heads / kv_heads``
                  consecutive query heads
    head_size     ``head_dim`` (default ``hidden_size // num_attention_heads``)
    mlp           MLP hidden units, ``intermediate_size`` (an expert's: ``moe_intermediate_size``)
    experts       the routed experts of an MoE layer, ``num_experts``; ``topk`` the chosen ones
    vocab         the vocabulary, ``vocab_size``
    layers        the stacked decoder layers, ``num_hidden_layers``
    rotary        ``head_size / 2`` rotary frequencies (a per-layer table, not a weight)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import named as nm
from named import Axis, NamedArray, nn

from ._common import (
    Head,
    KVCache,
    causal_attention,
    check_sequence_length,
    decode_layers,
    token_positions,
)
from ._rope import RopeScaling, rope_frequencies

QK_NORMS = ("none", "head", "projection")
LAYER_TYPES = ("full_attention", "sliding_attention")
# The decoder-layer field that plays each role: (before attention, after attention, before the
# MLP, after the MLP), by layout. Llama's pre-MLP norm is called post_attention_layernorm.
NORM_ROLES = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Decoder hyper-parameters (defaults: Llama-2 7B). Field names follow Hugging Face where it
    has one; each family (``LlamaConfig``, ``Qwen3Config``, ...) is a subclass whose defaults are
    that family's architecture."""

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
    hidden_act: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    rope_scaling: RopeScaling = RopeScaling()
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # none | head | projection
    norm_layout: str = "pre"  # pre | post | sandwich
    norm_unit_offset: bool = False  # norms compute x̂ * (1 + w), their weights start at 0
    scale_embeddings: bool = False  # embeddings * sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # scores * query_pre_attn_scalar**-0.5; None: head_size
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None  # the local layers' window: each token sees itself and window - 1 before
    sliding_window_pattern: int | None = None  # None: every layer local; k: every k-th layer global
    layer_types: tuple[str, ...] | None = None  # per layer, full_attention | sliding_attention; overrides the pattern
    rope_local_base_freq: float | None = None  # the local layers' default-RoPE base (Gemma 3); None: as global
    remat: str = "none"  # gradient checkpointing of each layer: an nn.Stacked policy ("full", "save_dots", ...)
    # Mixture of experts (every layer): null num_experts is a dense MLP. See nn.MoE.
    num_experts: int | None = None  # routed experts per layer
    num_experts_per_tok: int = 2  # k: experts each token goes through
    moe_intermediate_size: int | None = None  # an expert's hidden size; None: intermediate_size
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to 1
    router_softmax: str = "before_topk"  # before_topk: softmax over all experts; after_topk: over the k chosen
    shared_expert_intermediate_size: int | None = None  # an always-on shared expert (Qwen2-MoE); None: none
    shared_expert_gate: bool = False  # the shared expert scaled by sigmoid(Linear(embed -> ())) (Qwen2-MoE)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in the training loss
    router_z_loss_coef: float = 0.0  # weight of the router z-loss in the training loss
    moe_dispatch: str = "dropless"  # dropless (ragged_dot over sorted tokens) | dense (every expert, reference)
    expert_parallel: str = "auto"  # with experts split by the mapping: auto (GSPMD) | explicit (shard_map)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise nm.ArgumentError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise nm.ArgumentError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; set head_dim"
            )
        if self.HeadSize.size % 2:
            raise nm.ArgumentError(f"head_dim={self.HeadSize.size} is odd; rotary embeddings need an even head size")
        for name, allowed in (("qk_norm", QK_NORMS), ("norm_layout", tuple(NORM_ROLES))):
            if getattr(self, name) not in allowed:
                raise nm.ArgumentError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.hidden_act not in nn.ACTIVATIONS:
            raise nm.ArgumentError(f"hidden_act={self.hidden_act!r} is not one of {', '.join(sorted(nn.ACTIVATIONS))}")
        for name in (
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_base_freq",
        ):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise nm.ArgumentError(f"{name} must be a finite positive number or null, got {value!r}")
        if isinstance(self.rope_scaling, Mapping):  # as JSON and Python users write it
            try:
                object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
            except TypeError as e:
                raise nm.ArgumentError(f"rope_scaling: {e}") from None
        if not isinstance(self.rope_scaling, RopeScaling):
            raise nm.ArgumentError(
                f"rope_scaling should be a RopeScaling or a mapping of its fields, got {self.rope_scaling!r}"
            )
        _check_moe(self)
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a YAML list; hashable
            if len(self.layer_types) != self.num_hidden_layers:
                raise nm.ArgumentError(
                    f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}"
                )
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise nm.ArgumentError(f"layer_types: {bad[0]!r} is not one of {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise nm.ArgumentError("layer_types has sliding_attention layers but sliding_window is null")

    Embed = property(lambda self: Axis("embed", self.hidden_size))
    Heads = property(lambda self: Axis("heads", self.num_attention_heads))
    KVHeads = property(lambda self: Axis("kv_heads", self.num_key_value_heads))
    HeadSize = property(lambda self: Axis("head_size", self.head_dim or self.hidden_size // self.num_attention_heads))
    Mlp = property(lambda self: Axis("mlp", self.intermediate_size))
    Vocab = property(lambda self: Axis("vocab", self.vocab_size))
    Layers = property(lambda self: Axis("layers", self.num_hidden_layers))
    Rotary = property(lambda self: Axis("rotary", self.HeadSize.size // 2))
    Experts = property(lambda self: Axis("experts", self.num_experts or 0))
    ExpertMlp = property(lambda self: Axis("mlp", self.moe_intermediate_size or self.intermediate_size))

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Whether each layer is a sliding-window (local) layer."""
        if self.sliding_window is None:
            return (False,) * self.num_hidden_layers
        if self.layer_types is not None:
            return tuple(t == "sliding_attention" for t in self.layer_types)
        k = self.sliding_window_pattern
        return tuple(k is None or (i + 1) % k != 0 for i in range(self.num_hidden_layers))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.sliding_window if local else None for local in self.local_layers)


MOE_CHOICES = {
    "router_softmax": ("before_topk", "after_topk"),
    "moe_dispatch": nn.MoE.DISPATCHES,
    "expert_parallel": nn.MoE.PARALLEL,
}


def _check_moe(c: DecoderConfig) -> None:
    for name, allowed in MOE_CHOICES.items():
        if getattr(c, name) not in allowed:
            raise nm.ArgumentError(f"{name}={getattr(c, name)!r} is not one of {', '.join(allowed)}")
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
        value = getattr(c, name)
        if not (math.isfinite(value) and value >= 0):
            raise nm.ArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
    if c.num_experts is not None and not 1 <= c.num_experts_per_tok <= c.num_experts:
        raise nm.ArgumentError(
            f"num_experts_per_tok={c.num_experts_per_tok} must be in [1, num_experts={c.num_experts}]"
        )
    if c.num_experts is None and c.shared_expert_intermediate_size is not None:
        raise nm.ArgumentError(
            "shared_expert_intermediate_size needs num_experts (a shared expert sits beside routed ones)"
        )
    if c.shared_expert_gate and c.shared_expert_intermediate_size is None:
        raise nm.ArgumentError("shared_expert_gate needs shared_expert_intermediate_size (the expert it gates)")


# ---- layers ------------------------------------------------------------------------------------


def _norm(config: DecoderConfig, axes) -> nn.RMSNorm:
    return nn.RMSNorm.init(axes, eps=config.rms_norm_eps, unit_offset=config.norm_unit_offset)


class Attention(eqx.Module):
    q_proj: nn.Linear  # embed -> (heads, head_size)
    k_proj: nn.Linear  # embed -> (kv_heads, head_size)
    v_proj: nn.Linear  # embed -> (kv_heads, head_size)
    o_proj: nn.Linear  # (heads, head_size) -> embed
    q_norm: nn.RMSNorm | None  # over head_size ("head") or (heads, head_size) ("projection")
    k_norm: nn.RMSNorm | None

    @staticmethod
    def init(config: DecoderConfig, *, key) -> Attention:
        c = config
        kq, kk, kv, ko = jax.random.split(key, 4)
        q_norm = k_norm = None
        if c.qk_norm == "head":
            q_norm, k_norm = _norm(c, c.HeadSize), _norm(c, c.HeadSize)
        elif c.qk_norm == "projection":
            q_norm, k_norm = _norm(c, (c.Heads, c.HeadSize)), _norm(c, (c.KVHeads, c.HeadSize))
        return Attention(
            nn.Linear.init(c.Embed, (c.Heads, c.HeadSize), key=kq, use_bias=c.qkv_bias),
            nn.Linear.init(c.Embed, (c.KVHeads, c.HeadSize), key=kk, use_bias=c.qkv_bias),
            nn.Linear.init(c.Embed, (c.KVHeads, c.HeadSize), key=kv, use_bias=c.qkv_bias),
            nn.Linear.init((c.Heads, c.HeadSize), c.Embed, key=ko, use_bias=c.o_bias),
            q_norm,
            k_norm,
        )

    def __call__(
        self,
        x: NamedArray,
        positions: NamedArray,
        *,
        inv_freq,
        rope_scale,
        window,
        scale,
        softcap,
        segment_ids=None,
        cache=None,
        pos=None,
    ):
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # HF checkpoints already hold q/k in the rotate-half layout nn.rotary_embedding uses: no permutation.
        q = nn.rotary_embedding(q, positions, inv_freq=inv_freq, scale=rope_scale)
        k = nn.rotary_embedding(k, positions, inv_freq=inv_freq, scale=rope_scale)
        out, cache = causal_attention(
            q,
            k,
            self.v_proj(x),
            segment_ids=segment_ids,
            cache=cache,
            pos=pos,
            window=window,
            scale=scale,
            softcap=softcap,
        )
        return self.o_proj(out), cache


def _apply(norm, x):
    return x if norm is None else norm(x)


class DecoderLayer(eqx.Module):
    input_layernorm: nn.RMSNorm | None
    self_attn: Attention
    post_attention_layernorm: nn.RMSNorm | None
    pre_feedforward_layernorm: nn.RMSNorm | None
    post_feedforward_layernorm: nn.RMSNorm | None
    mlp: nn.MLP | nn.MoE  # down(act(gate(x)) * up(x)), or num_experts of them behind a router
    norm_layout: str = eqx.field(static=True)

    @staticmethod
    def init(config: DecoderConfig, *, key) -> DecoderLayer:
        k_attn, k_mlp = jax.random.split(key)
        present = set(NORM_ROLES[config.norm_layout])
        norms = {
            name: _norm(config, config.Embed) if name in present else None
            for name in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        }
        if config.num_experts is None:
            mlp = nn.MLP.init(
                config.Embed, config.Mlp, key=k_mlp, activation=config.hidden_act, gated=True, use_bias=False
            )
        else:
            mlp = _moe(config, k_mlp)
        return DecoderLayer(
            self_attn=Attention.init(config, key=k_attn), mlp=mlp, norm_layout=config.norm_layout, **norms
        )

    def __call__(self, x: NamedArray, **kwargs):
        x, (cache, _) = self.forward_with_aux(x, **kwargs)
        return x, cache

    def forward_with_aux(
        self,
        x: NamedArray,
        *,
        positions,
        inv_freq,
        rope_scale=1.0,
        window=None,
        scale=None,
        softcap=None,
        segment_ids=None,
        cache=None,
        pos=None,
    ):
        """``(x, (cache, stats))``: the layer and its MoE router's statistics (``nn.router_stats``;
        none for a dense MLP), from which ``aux_losses`` makes the losses after the stack."""
        before_attn, after_attn, before_mlp, after_mlp = (
            None if name is None else getattr(self, name) for name in NORM_ROLES[self.norm_layout]
        )
        h, cache = self.self_attn(
            _apply(before_attn, x),
            positions,
            inv_freq=inv_freq,
            rope_scale=rope_scale,
            window=window,
            scale=scale,
            softcap=softcap,
            segment_ids=segment_ids,
            cache=cache,
            pos=pos,
        )
        x = x + _apply(after_attn, h)
        if isinstance(self.mlp, nn.MoE):
            h, stats = self.mlp.with_stats(_apply(before_mlp, x))
        else:
            h, stats = self.mlp(_apply(before_mlp, x)), {}
        x = x + _apply(after_mlp, h)
        return x, (cache, stats)


def _moe(c: DecoderConfig, key) -> nn.MoE:
    shared = None if c.shared_expert_intermediate_size is None else Axis("mlp", c.shared_expert_intermediate_size)
    return nn.MoE.init(
        c.Embed,
        c.ExpertMlp,
        c.Experts,
        c.num_experts_per_tok,
        key=key,
        activation=c.hidden_act,
        routing="softmax_topk" if c.router_softmax == "before_topk" else "topk_softmax",
        normalize=c.norm_topk_prob,
        shared_mlp=shared,
        shared_gate=c.shared_expert_gate,
        dispatch=c.moe_dispatch,
        parallel=c.expert_parallel,
    )


def aux_losses(config: DecoderConfig, per_layer: dict) -> dict[str, tuple[float, jax.Array]]:
    """The auxiliary training losses, ``{name: (weight, value)}``: each MoE router loss averaged
    over the layers (``per_layer``: the scan's stacked ``nn.router_stats``), with its coefficient."""
    if config.num_experts is None:
        return {}
    losses = nn.router_losses(per_layer)  # one value per layer
    return {
        "moe_load_balancing": (config.router_aux_loss_coef, losses["load_balancing"].mean()),
        "moe_router_z": (config.router_z_loss_coef, losses["router_z"].mean()),
    }


# ---- what the layers take from the config, at each call ------------------------------------------

NO_WINDOW = 2**30  # a global layer's "window" when windows are per-layer data: longer than any sequence


def layer_data(config: DecoderConfig) -> dict:
    """The inputs of the scan besides the weights: rotary frequencies and their attention factor,
    the window, the score scale and soft-cap. Read from the config at each call (the weights hold
    none of it), so one fact lives in one place.

    Where every layer agrees each is one value (an int window stays static, so the fused attention
    kernel can take it); where layers differ it is an array over ``layers`` that the scan slices.
    """
    c = config
    hs, L = c.HeadSize.size, c.Layers
    tables = {}
    for local in set(c.local_layers):
        if local and c.rope_local_base_freq is not None:
            tables[local] = rope_frequencies(hs, c.rope_local_base_freq, RopeScaling(), c.max_position_embeddings)
        else:
            tables[local] = rope_frequencies(hs, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    per_layer = [tables[local] for local in c.local_layers]
    inv = np.stack([t[0] for t in per_layer])
    scales = [t[1] for t in per_layer]
    windows = c.layer_windows
    if (inv == inv[0]).all():
        inv_freq = nm.named(jnp.asarray(inv[0]), (c.Rotary,))
    else:
        inv_freq = nm.named(jnp.asarray(inv), (L, c.Rotary))
    rope_scale = scales[0] if len(set(scales)) == 1 else nm.named(jnp.asarray(scales, jnp.float32), (L,))
    window = (
        windows[0]
        if len(set(windows)) == 1
        else nm.named(jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32), (L,))
    )
    return dict(
        inv_freq=inv_freq,
        rope_scale=rope_scale,
        window=window,
        scale=(c.query_pre_attn_scalar or hs) ** -0.5,
        softcap=c.attn_logit_softcapping,
    )


# ---- the model -----------------------------------------------------------------------------------


class DecoderLMHeadModel(eqx.Module):
    embed_tokens: nn.Embedding  # (vocab, embed); also the output head when tied
    layers: nn.Stacked[DecoderLayer]
    norm: nn.RMSNorm
    lm_head: nn.Embedding | None  # (vocab, embed); None when tied to embed_tokens
    config: DecoderConfig = eqx.field(static=True)

    @staticmethod
    def init(config: DecoderConfig, *, key) -> DecoderLMHeadModel:
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        c = config
        return DecoderLMHeadModel(
            nn.Embedding.init(c.Vocab, c.Embed, key=k_embed),
            nn.Stacked.init(c.Layers, DecoderLayer.init, c, key=k_layers, remat=c.remat),
            _norm(c, c.Embed),
            None if c.tie_word_embeddings else nn.Embedding.init(c.Vocab, c.Embed, key=k_head),
            c,
        )

    def __call__(self, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None) -> NamedArray:
        """Logits ``(batch, position, vocab)`` for token ids ``(batch, position)``.

        ``segment_ids`` (same axes) pack several documents in one row: attention stays within
        a segment (and within the window, for local layers) and rotary positions restart at each
        one. ``key`` is accepted for a uniform signature; these models have no dropout.
        """
        return self.forward_with_aux(input_ids, segment_ids=segment_ids, key=key)[0]

    def forward_with_aux(
        self, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None
    ) -> tuple[NamedArray, dict[str, tuple[float, jax.Array]]]:
        """The logits and the auxiliary training losses ``{name: (weight, value)}`` (the MoE
        router's, see ``aux_losses``; none for a dense model): the protocol ``models.forward_with_aux``
        reads, through which the trainer adds ``weight * value`` to the loss and reports ``value``."""
        hidden, head, aux = self.hidden_with_aux(input_ids, segment_ids=segment_ids, key=key)
        return head.logits(hidden), aux

    def hidden_with_aux(
        self, input_ids: NamedArray, *, segment_ids: NamedArray | None = None, key=None
    ) -> tuple[NamedArray, Head, dict[str, tuple[float, jax.Array]]]:
        """``forward_with_aux`` short of the logits: the final hidden states ``(batch, position, embed)``,
        the head that makes the logits of them (with Gemma 2's soft-cap), and the auxiliary losses
        (``models.hidden_with_aux``)."""
        check_sequence_length(input_ids, self.config.max_position_embeddings, "max_position_embeddings")
        positions = token_positions(input_ids, segment_ids)
        hidden, stats = self._run(input_ids, positions, segment_ids=segment_ids)
        return hidden, self.head, aux_losses(self.config, stats)

    def decode(self, input_ids: NamedArray, cache: KVCache, pos, *, last: bool = False) -> tuple[NamedArray, KVCache]:
        """Logits for ``input_ids`` standing at positions ``pos, pos + 1, ...`` of sequences whose
        earlier keys and values are in ``cache``; returns them and the cache with these tokens added.
        ``last``: the logits of the last position only (all a prefill needs), without ``position``.
        The cache keeps every position; a local layer's window masks the older ones."""
        x = self._embed(input_ids)
        positions = cache.positions(input_ids.resolve_axis("position"), pos)
        x, cache = decode_layers(self.layers, x, cache, pos, positions=positions, **layer_data(self.config))
        hidden = self.norm(x["position", -1] if last else x)
        return self.head.logits(hidden), cache

    @property
    def head(self) -> Head:
        return Head(self.embed_tokens if self.lm_head is None else self.lm_head, self.config.final_logit_softcapping)

    def init_cache(self, Batch: Axis, max_length: int, start: NamedArray | None = None) -> KVCache:
        """An empty cache of ``max_length`` positions; ``start`` (over ``batch``): where each row's
        tokens begin, for prompts padded on the left (``KVCache``)."""
        c = self.config
        if max_length > c.max_position_embeddings:
            raise nm.ArgumentError(
                f"a cache of {max_length} positions exceeds max_position_embeddings={c.max_position_embeddings}"
            )
        KeyPos = Axis("key_position", max_length)
        return KVCache.init(c.Layers, Batch, KeyPos, c.KVHeads, c.HeadSize, self.embed_tokens.weight.dtype, start)

    def _embed(self, input_ids: NamedArray) -> NamedArray:
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:  # rounded to the compute dtype, as Gemma does
            x = x * jnp.asarray(math.sqrt(self.config.hidden_size), x.dtype)
        return x

    def _run(self, input_ids, positions, *, segment_ids=None):
        x, (_, stats) = self.layers.scan_via("forward_with_aux")(
            self._embed(input_ids), positions=positions, segment_ids=segment_ids, **layer_data(self.config)
        )
        return self.norm(x), stats


# ---- size and cost --------------------------------------------------------------------


def _matmul_params_per_layer(c: DecoderConfig, *, active: bool = False) -> int:
    """The matmul weights of one layer; with ``active`` only those a token goes through (its
    ``num_experts_per_tok`` experts of an MoE layer, not all ``num_experts``)."""
    D, H, KV, hd, M = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.HeadSize.size, c.intermediate_size
    attention = D * H * hd + 2 * D * KV * hd + H * hd * D
    if c.num_experts is None:
        return attention + 3 * D * M
    experts = c.num_experts_per_tok if active else c.num_experts
    shared = 3 * D * (c.shared_expert_intermediate_size or 0) + D * c.shared_expert_gate
    return attention + D * c.num_experts + experts * 3 * D * c.ExpertMlp.size + shared


def num_params(config: DecoderConfig) -> int:
    """Every parameter of the model (a tied embedding counted once)."""
    c = config
    D, V, L, H, KV, hd = (
        c.hidden_size,
        c.vocab_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.HeadSize.size,
    )
    biases = (H + 2 * KV) * hd * c.qkv_bias + D * c.o_bias
    qk_norms = {"none": 0, "head": 2 * hd, "projection": (H + KV) * hd}[c.qk_norm]
    norms = sum(name is not None for name in set(NORM_ROLES[c.norm_layout])) * D
    head = 0 if c.tie_word_embeddings else V * D
    return V * D + L * (_matmul_params_per_layer(c) + biases + qk_norms + norms) + D + head


def flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: ``6 N + 12 d Σ_layers T_l``.

    ``N`` counts the weights that take part in a matmul: q, k, v, o and the three MLP
    projections of every layer and the output head (``V · hidden``, tied or not); not the
    norms, biases or the embedding gather. In an MoE layer it counts the router, the shared
    expert and the ``num_experts_per_tok`` experts a token goes through, not the idle ones, so
    the MFU built on it is the work done. The attention term (``q·k`` and ``weights·v``,
    ``d = heads · head_size``) counts ``T_l = seq_len`` keys per query, or the window for a
    local layer when it is shorter, with the causal mask *not* halving it (PaLM's convention).
    """
    c = config
    L, d = c.num_hidden_layers, c.num_attention_heads * c.HeadSize.size
    n_matmul = L * _matmul_params_per_layer(c, active=True) + c.hidden_size * c.vocab_size
    # counted without a loop over the layers: a plan may be asked for an absurd depth
    if c.sliding_window is None:
        local = 0
    elif c.layer_types is not None:
        local = c.layer_types.count("sliding_attention")
    else:
        local = L if c.sliding_window_pattern is None else L - L // c.sliding_window_pattern
    keys = (L - local) * seq_len + local * min(seq_len, c.sliding_window or seq_len)
    return 6.0 * n_matmul + 12.0 * d * keys
