"""Small random models for the models tests: transformers models (the reference) and ours.

Every parameter is perturbed after Hugging Face's init, so that layer-norm gains and biases
are not 1 and 0 (a swapped weight/bias would otherwise go unnoticed) and the logits are far
from uniform (so greedy decoding does not fall into a repeated token at once).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

import named as nm

GPT2 = {
    "gpt2-tied": dict(n_layer=2, n_head=4, n_embd=48, n_positions=32, vocab_size=97),
    "gpt2-untied-n_inner": dict(n_layer=2, n_head=5, n_embd=40, n_positions=24, vocab_size=83, n_inner=72,
                                tie_word_embeddings=False, activation_function="gelu", layer_norm_epsilon=1e-4),
}
LLAMA = {
    "llama-gqa4/2-untied": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=97, max_position_embeddings=32,
                                tie_word_embeddings=False),
    "llama-gqa4/1-tied": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=1, vocab_size=97, max_position_embeddings=32, tie_word_embeddings=True,
                              rope_theta=500.0),
    "llama-mha-head_dim10": dict(hidden_size=48, intermediate_size=56, num_hidden_layers=2, num_attention_heads=3,
                                 num_key_value_heads=3, head_dim=10, vocab_size=61, max_position_embeddings=24,
                                 tie_word_embeddings=False, rms_norm_eps=1e-5),
}
CONFIGS = {**GPT2, **LLAMA}


def build(name: str, seed: int = 0, scale: float = 0.1):
    """The transformers model ``name`` (eager attention, eval mode, float32), weights perturbed."""
    torch.manual_seed(seed)
    kwargs = dict(CONFIGS[name])
    if name in GPT2:
        # ids in range so transformers does not warn; nothing here generates an end-of-text token
        config = transformers.GPT2Config(bos_token_id=0, eos_token_id=None, pad_token_id=None, **kwargs)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(bos_token_id=0, eos_token_id=None, pad_token_id=None, **kwargs)
        model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def load_hf(folder):
    """transformers' own loader on a folder, eager attention, eval mode."""
    cls = transformers.AutoModelForCausalLM
    return cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


def random_ids(vocab: int, shape, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, shape).astype(np.int32)


def random_model(cls, config, seed: int = 0, scale: float = 0.2):
    """Our model with random parameters drawn by numpy: ``cls.init`` is only traced, not compiled
    (compiling the random init of a whole model costs seconds on CPU). Norm gains are near 1."""
    rng = np.random.RandomState(seed)
    abstract = eqx.filter_eval_shape(cls.init, config, key=jax.random.key(0))

    def fill(path, x):
        value = rng.normal(0.0, scale, x.array.shape).astype(np.float32)
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        if "norm" in name or "ln_" in name:
            value += 1.0 if name.endswith("weight") else 0.0
        return nm.NamedArray(jnp.asarray(value), x.axes)

    return jax.tree_util.tree_map_with_path(fill, abstract, is_leaf=nm.is_named_array)
