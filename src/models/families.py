"""The decoder families as data (the dense ones and the mixtures of experts: Mixtral, Qwen2/3-MoE):
each is ``DecoderConfig`` with that architecture's defaults (the
``transformers`` class defaults for the fields a ``config.json`` may leave out). The model code
is ``decoder.py``, shared by all; ``registry.py`` lists the families with their Hugging Face
names. A YAML ``model: {type: qwen3, ...}`` starts from these defaults.
"""

from __future__ import annotations

import dataclasses

from .decoder import DecoderConfig

_family = dataclasses.dataclass(frozen=True)


@_family
class LlamaConfig(DecoderConfig):
    """Llama 2 and 3.x (defaults: Llama-2 7B; Llama 3.x sets rope_scaling and, for 3.2, ties)."""


@_family
class MistralConfig(DecoderConfig):
    """Mistral: every layer attends within a sliding window."""

    sliding_window: int | None = 4096


@_family
class Qwen2Config(DecoderConfig):
    """Qwen2 / Qwen2.5: biases on q, k and v (not o); a window only where ``use_sliding_window``."""

    qkv_bias: bool = True


@_family
class Qwen3Config(DecoderConfig):
    """Qwen3: RMSNorm of each query and key head over ``head_size`` before RoPE."""

    head_dim: int | None = 128
    qk_norm: str = "head"


@_family
class Olmo2Config(DecoderConfig):
    """OLMo 2: q/k RMSNorm over the whole projection (before the head split); the norms follow
    attention and the MLP instead of preceding them."""

    rms_norm_eps: float = 1e-5
    qk_norm: str = "projection"
    norm_layout: str = "post"


@_family
class Gemma2Config(DecoderConfig):
    """Gemma 2: GeGLU, scaled embeddings, (1 + w) norms before and after each sublayer, soft-capped
    attention and final logits, local and global layers alternating."""

    head_dim: int | None = 256
    tie_word_embeddings: bool = True
    hidden_act: str = "gelu_pytorch_tanh"
    norm_layout: str = "sandwich"
    norm_unit_offset: bool = True
    scale_embeddings: bool = True
    query_pre_attn_scalar: float | None = 256.0
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    sliding_window: int | None = 4096
    sliding_window_pattern: int | None = 2


@_family
class Gemma3Config(DecoderConfig):
    """Gemma 3 (text): Gemma 2 without soft-capping, with per-head q/k norm, five local layers to
    one global, and a RoPE base of its own for the local layers."""

    head_dim: int | None = 256
    tie_word_embeddings: bool = True
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float | None = 10_000.0
    qk_norm: str = "head"
    norm_layout: str = "sandwich"
    norm_unit_offset: bool = True
    scale_embeddings: bool = True
    query_pre_attn_scalar: float | None = 256.0
    sliding_window: int | None = 4096
    sliding_window_pattern: int | None = 6


@_family
class MixtralConfig(DecoderConfig):
    """Mixtral: Mistral with a mixture of experts in place of every MLP, two of eight experts per
    token, their weights renormalised (defaults: Mixtral 8x7B)."""

    intermediate_size: int = 14336
    num_key_value_heads: int = 8
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = None
    num_experts: int | None = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001


@_family
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE: Qwen3 with a mixture of experts in every layer, eight of 128 experts per token
    (defaults: transformers' ``Qwen3MoeConfig``)."""

    head_dim: int | None = None
    num_experts: int | None = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int | None = 768
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001


@_family
class Qwen2MoeConfig(Qwen2Config):
    """Qwen2-MoE: Qwen2 with a mixture of experts in every layer and a shared expert beside them,
    scaled by a sigmoid gate (defaults: transformers' ``Qwen2MoeConfig``)."""

    num_experts: int | None = 60
    num_experts_per_tok: int = 4
    moe_intermediate_size: int | None = 1408
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int | None = 5632
    shared_expert_gate: bool = True
    router_aux_loss_coef: float = 0.001
