"""The config sections that change the model after init: LoRA adapters (``lora:``) and
low-precision Linears (``quantization:``). ``named.trainer.config`` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraConfig:
    """LoRA adapters on the model's linear layers, the base weights frozen (``lora:`` absent or
    null: every weight trains). See ``model_init`` and ``named.nn.lora``.

    Args:
        rank: the adapters' rank r (at most the smaller side of every targeted layer).
        alpha: the update is scaled by alpha / r (PEFT's lora_alpha).
        dropout: dropout on the adapters' input during training (PEFT's lora_dropout).
        targets: the linear modules to adapt, by the family's Hugging Face module names
            (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2: c_attn,
            c_proj, c_fc), as PEFT's target_modules.
        base_dtype: the frozen weights' dtype (bfloat16 halves their memory; norms stay float32).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    base_dtype: str = "float32"


@dataclass
class QuantizationConfig:
    """Low-precision Linears (docs/nn.md, "Low precision"): after init (and after LoRA, whose
    adapted layers keep their own), every ``nn.Linear`` that ``targets`` names is swapped by
    ``nn.quantize``; the model's code is unchanged.

    Args:
        kind: ``none``; ``fp8`` (e4m3 forward, e5m2 gradients, delayed scaling: the scales are
            learned from an amax history the optimizer overwrites, never decays); or ``int8``
            (dynamic: input per token, weight per channel, float gradients). Int8 weight-only
            storage is for inference (``nn.quantize(model, "int8_weight")``): it cannot be trained.
        targets: regular expressions searched in each Linear's dotted path (``blocks.stacked.mlp.up``,
            ``layers.stacked.self_attn.q_proj``); null: every Linear.
        amax_history: fp8: the steps of amax the delayed scaling remembers.
    """

    kind: str = "none"
    targets: list[str] | None = None
    amax_history: int = 16
