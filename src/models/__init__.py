"""models: GPT-2 and the decoder family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, OLMo 2, Gemma 2/3, and the
mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE) built from ``named.nn``, Hugging Face import/export, and generation.

    from named import models
    config, model = models.load_pretrained("path/to/hf-folder")
    logits = model(input_ids)                      # (batch, position) -> (batch, position, vocab)
    tokens = models.generate(model, prompt, 20, temperature=0)
    models.save_pretrained(model, config, "out/")  # loads in transformers' from_pretrained

``models.FAMILIES`` (``registry.py``) is the one list of families.
"""

from . import decoder, gpt2
from ._common import Head, HfLayout, KVCache, forward_with_aux, hidden_with_aux
from ._rope import RopeScaling
from .decoder import DecoderConfig, DecoderLMHeadModel
from .families import (
    Gemma2Config,
    Gemma3Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from .generate import generate, sample_token
from .gpt2 import Gpt2Config, Gpt2LMHeadModel
from .hf import CheckpointFormatError, check_pretrained, config_from_hf, hf_state_dict, load_pretrained, save_pretrained
from .registry import FAMILIES, Family, family_for

LlamaLMHeadModel = DecoderLMHeadModel  # every decoder family runs on the one decoder


def num_params(config) -> int:
    """Every parameter of the model ``config`` describes (a tied embedding counted once)."""
    return family_for(config).num_params(config)


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token, ``6 N + 12 d Σ T`` (see ``gpt2.flops_per_token``, ``decoder.flops_per_token``)."""
    return family_for(config).flops_per_token(config, seq_len)


__all__ = [
    "FAMILIES",
    "CheckpointFormatError",
    "DecoderConfig",
    "DecoderLMHeadModel",
    "Family",
    "Gemma2Config",
    "Gemma3Config",
    "Gpt2Config",
    "Gpt2LMHeadModel",
    "Head",
    "HfLayout",
    "KVCache",
    "LlamaConfig",
    "LlamaLMHeadModel",
    "MistralConfig",
    "MixtralConfig",
    "Olmo2Config",
    "Qwen2Config",
    "Qwen2MoeConfig",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "RopeScaling",
    "check_pretrained",
    "config_from_hf",
    "decoder",
    "family_for",
    "flops_per_token",
    "forward_with_aux",
    "generate",
    "gpt2",
    "hf_state_dict",
    "hidden_with_aux",
    "load_pretrained",
    "num_params",
    "sample_token",
    "save_pretrained",
]
