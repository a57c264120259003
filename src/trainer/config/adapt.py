"""The config sections that change the model after init: LoRA adapters (``lora:``) and
low-precision Linears (``quantization:``). ``named.trainer.config`` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass

from .rules import NONEMPTY, above, at_least, between, key, one_of


@dataclass
class LoraConfig:
    """LoRA adapters on the model's linear layers, the base weights frozen (``lora:`` absent or
    null: every weight trains). See ``model_init`` and ``named.nn.lora``."""

    # at most the smaller side of every targeted layer (model_init)
    rank: int = key(8, at_least(1), doc="the adapters' rank r")
    alpha: float = key(16.0, above(0), doc="the update is scaled by alpha / r (PEFT's lora_alpha)")
    dropout: float = key(
        0.0, between(0, 1, high_open=True), doc="dropout on the adapters' input during training (PEFT's lora_dropout)"
    )
    targets: list[str] = key(
        factory=lambda: ["q_proj", "v_proj"],
        rule=NONEMPTY,
        doc="the linear modules to adapt, by the family's Hugging Face names (q_proj, ...; "
        "GPT-2: c_attn, c_proj, c_fc), as PEFT's target_modules",
    )
    base_dtype: str = key(
        "float32",
        one_of("float32", "bfloat16"),
        doc="the frozen weights' dtype (bfloat16 halves their memory; norms stay float32)",
    )


@dataclass
class QuantizationConfig:
    """Low-precision Linears (docs/nn.md, "Low precision"): after init (and after LoRA, whose
    adapted layers keep their own), every ``nn.Linear`` that ``targets`` names is swapped by
    ``nn.quantize``; the model's code is unchanged. ``fp8``: e4m3 forward, e5m2 gradients, delayed
    scaling (the scales are learned from an amax history the optimizer overwrites, never decays);
    ``int8``: dynamic (input per token, weight per channel, float gradients). Int8 weight-only
    storage is for inference (``nn.quantize(model, "int8_weight")``): it cannot be trained."""

    kind: str = key("none", one_of("none", "fp8", "int8"), doc="`fp8` (delayed scaling) or `int8` (dynamic) Linears")
    targets: list[str] | None = key(
        None,
        NONEMPTY,
        doc="regular expressions searched in each Linear's dotted path (`blocks.stacked.mlp.up`); null: every Linear",
    )
    amax_history: int = key(16, at_least(1), doc="fp8: the steps of amax the delayed scaling remembers")
