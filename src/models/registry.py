"""The one list of model families. Everything else finds a family here: the trainer (its YAML
``model.type`` choices, model class, FLOPs, positions), ``named-plan``, and the Hugging Face
import and export (``model_type``, ``architectures``, key map, ``config.json`` fields). Adding a
family is an entry below and its own code (a config in ``families.py``, or a model file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import named as nm

from . import _hf_decoder, decoder, families, gpt2
from ._common import HfLayout
from ._hf_config import CheckpointFormatError, HfConfigFormat, HfGpt2, checked_field
from ._hf_decoder import HfDecoder


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: what the trainer, ``named-plan`` and the Hugging Face import and export
    ask of a model, the same for every family.

    ``positions_field`` is the config field that bounds the sequence length; ``layout`` names and
    shapes its tensors in a Hugging Face folder, ``hf`` reads and writes its ``config.json``
    (beside ``model_type`` and ``architectures``, which are the family's own); ``num_params`` and
    ``flops_per_token`` are its closed forms (``config -> int``, ``(config, seq_len) -> float``).
    """

    name: str  # the YAML model.type
    config_cls: type
    model_cls: type
    model_type: str  # Hugging Face config.json model_type
    architecture: str  # the transformers causal-LM class, in config.json's architectures
    positions_field: str
    layout: HfLayout
    hf: HfConfigFormat
    num_params: Callable[[Any], int]
    flops_per_token: Callable[[Any, int], float]

    def from_hf(self, d: Mapping, where: Path):
        """Our config for the parsed ``config.json`` ``d`` (at ``where``) of this family."""
        return self.hf.read(self, d, where)

    def to_hf(self, config) -> dict:
        """``config.json`` for ``config``."""
        return {"architectures": [self.architecture], "model_type": self.model_type, **self.hf.write(self, config)}

    def max_positions(self, config) -> int:
        return getattr(config, self.positions_field)


def _decoder(name, config_cls, model_type, architecture, layout=_hf_decoder.HF_LAYOUT, **hf) -> Family:
    return Family(
        name,
        config_cls,
        decoder.DecoderLMHeadModel,
        model_type,
        architecture,
        "max_position_embeddings",
        layout,
        HfDecoder(**hf),
        decoder.num_params,
        decoder.flops_per_token,
    )


_GEMMA = dict(
    activation_field="hidden_activation",
    windows="layer_types",
    gemma=True,
    no_effect=frozenset({"hidden_act", "cache_implementation"}),
)  # transformers reads hidden_activation only

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "gpt2",
            gpt2.Gpt2Config,
            gpt2.Gpt2LMHeadModel,
            "gpt2",
            "GPT2LMHeadModel",
            "n_positions",
            gpt2.HF_LAYOUT,
            HfGpt2(),
            gpt2.num_params,
            gpt2.flops_per_token,
        ),
        _decoder(
            "llama",
            families.LlamaConfig,
            "llama",
            "LlamaForCausalLM",
            only={"mlp_bias": (False,), "pretraining_tp": (1,)},
        ),
        _decoder("mistral", families.MistralConfig, "mistral", "MistralForCausalLM", bias="fixed", windows="all"),
        _decoder("qwen2", families.Qwen2Config, "qwen2", "Qwen2ForCausalLM", bias="fixed", windows="qwen"),
        _decoder("qwen3", families.Qwen3Config, "qwen3", "Qwen3ForCausalLM", windows="qwen"),
        _decoder("olmo2", families.Olmo2Config, "olmo2", "Olmo2ForCausalLM"),
        _decoder("gemma2", families.Gemma2Config, "gemma2", "Gemma2ForCausalLM", attn_softcap=True, **_GEMMA),
        _decoder(
            "gemma3",
            families.Gemma3Config,
            "gemma3_text",
            "Gemma3ForCausalLM",
            nested_rope=True,
            pattern_fields=("sliding_window_pattern", "_sliding_window_pattern"),
            **_GEMMA,
        ),
        # mixtures of experts: the decoder with nn.MoE in place of the MLP
        _decoder(
            "mixtral",
            families.MixtralConfig,
            "mixtral",
            "MixtralForCausalLM",
            layout=_hf_decoder.MIXTRAL_HF_LAYOUT,
            bias="fixed",
            windows="all",
            moe="mixtral",
        ),
        _decoder(
            "qwen3_moe",
            families.Qwen3MoeConfig,
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            moe="qwen3",
            only={"use_sliding_window": (False,)},
            no_effect=frozenset({"sliding_window", "max_window_layers"}),
        ),
        _decoder(
            "qwen2_moe",
            families.Qwen2MoeConfig,
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            bias="fixed",
            windows="qwen",
            moe="qwen2",
            only={"qkv_bias": (True,)},
        ),
    )
}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}
SUPPORTED = ", ".join(f"{f.model_type} ({f.architecture})" for f in FAMILIES.values())


def family_for(obj) -> Family:
    """The family of a config, of a model (by its config), or of a trainer section built on a config."""
    config = getattr(obj, "config", obj)
    by_class = {f.config_cls: f for f in FAMILIES.values()}
    for cls in type(config).__mro__:
        if cls in by_class:
            return by_class[cls]
    raise nm.ArgumentTypeError(
        f"{type(obj).__name__} is not a config or model of a known family; known: {', '.join(FAMILIES)}"
    )


def family_for_hf(d: Mapping, where: Path) -> Family:
    """The family a ``config.json`` (already parsed, at ``where``) names."""
    if d.get("model_type") is None:
        raise CheckpointFormatError(f"{where}: missing field 'model_type'; supported: {SUPPORTED}")
    model_type = checked_field(d, "model_type", str, where=where)
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise CheckpointFormatError(f"{where}: unsupported model_type {model_type!r}; supported: {SUPPORTED}")
    archs = checked_field(d, "architectures", list, [family.architecture], where=where)
    if not all(isinstance(a, str) for a in archs):
        raise CheckpointFormatError(f"{where}: field 'architectures' should be a list of names, got {archs!r}")
    if family.architecture not in archs:
        raise CheckpointFormatError(
            f"{where}: unsupported architectures {archs!r}; for model_type {model_type!r} "
            f"we load {family.architecture!r} (a causal LM with its head)"
        )
    return family
