"""models: GPT-2 and Llama built from ``named.nn``, Hugging Face import/export, and generation.

    from named import models
    config, model = models.load_pretrained("path/to/hf-folder")
    logits = model(input_ids)                      # (batch, position) -> (batch, position, vocab)
    tokens = models.generate(model, prompt, 20, temperature=0)
    models.save_pretrained(model, config, "out/")  # loads in transformers' from_pretrained
"""

from . import gpt2, llama
from ._common import KVCache
from .generate import generate, sample_token
from .gpt2 import Gpt2Config, Gpt2LMHeadModel
from .hf import CheckpointFormatError, config_from_hf, hf_state_dict, load_pretrained, save_pretrained
from .llama import LlamaConfig, LlamaLMHeadModel

_MODULES = {Gpt2Config: gpt2, LlamaConfig: llama}


def _module_for(config):
    try:
        return _MODULES[type(config)]
    except KeyError:
        raise TypeError(f"expected a Gpt2Config or LlamaConfig, got {type(config).__name__}") from None


def num_params(config) -> int:
    """Every parameter of the model ``config`` describes (see ``gpt2.num_params``, ``llama.num_params``)."""
    return _module_for(config).num_params(config)


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token, ``6 N + 12 L d T`` (see ``gpt2.flops_per_token`` for the convention)."""
    return _module_for(config).flops_per_token(config, seq_len)


__all__ = [
    "CheckpointFormatError",
    "Gpt2Config",
    "Gpt2LMHeadModel",
    "KVCache",
    "LlamaConfig",
    "LlamaLMHeadModel",
    "config_from_hf",
    "flops_per_token",
    "generate",
    "gpt2",
    "hf_state_dict",
    "llama",
    "load_pretrained",
    "num_params",
    "sample_token",
    "save_pretrained",
]
