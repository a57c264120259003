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
    "gpt2-untied-n_inner": dict(
        n_layer=2,
        n_head=5,
        n_embd=40,
        n_positions=24,
        vocab_size=83,
        n_inner=72,
        tie_word_embeddings=False,
        activation_function="gelu",
        layer_norm_epsilon=1e-4,
    ),
}
LLAMA = {
    "llama-gqa4/2-untied": dict(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    ),
    "llama-gqa4/1-tied": dict(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=97,
        max_position_embeddings=32,
        tie_word_embeddings=True,
        rope_theta=500.0,
    ),
    "llama-mha-head_dim10": dict(
        hidden_size=48,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=10,
        vocab_size=61,
        max_position_embeddings=24,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
}
CONFIGS = {**GPT2, **LLAMA}

# The decoder families: (transformers config class, its arguments). Odd sizes on purpose: head
# counts that are not powers of two, GQA and MQA, tied and untied heads, every RoPE variant, and
# sliding windows (4-5) shorter than the sequences the tests run (13 tokens; 25 when decoding).
_SMALL = dict(num_hidden_layers=2, vocab_size=97, max_position_embeddings=64)
FAMILY_CONFIGS = {
    "llama3.2-llama3rope-gqa6/2-tied": (
        "LlamaConfig",
        dict(
            _SMALL,
            hidden_size=48,
            intermediate_size=80,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama-linear-mqa3/1-bias": (
        "LlamaConfig",
        dict(
            _SMALL,
            hidden_size=30,
            intermediate_size=56,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=10,
            attention_bias=True,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        ),
    ),
    "llama-yarn-mha5": (
        "LlamaConfig",
        dict(
            _SMALL,
            hidden_size=40,
            intermediate_size=72,
            num_attention_heads=5,
            num_key_value_heads=5,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16),
        ),
    ),
    "llama-dynamic-gqa4/2": (
        "LlamaConfig",
        dict(
            _SMALL,
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        ),
    ),
    "mistral-window5-mqa5/1": (
        "MistralConfig",
        dict(
            _SMALL,
            hidden_size=40,
            intermediate_size=64,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=8,
            sliding_window=5,
        ),
    ),
    "qwen2-bias-window4-gqa6/3-tied": (
        "Qwen2Config",
        dict(
            _SMALL,
            num_hidden_layers=3,
            hidden_size=36,
            intermediate_size=60,
            num_attention_heads=6,
            num_key_value_heads=3,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        ),
    ),
    "qwen3-qknorm-gqa6/2-bias": (
        "Qwen3Config",
        dict(
            _SMALL,
            hidden_size=40,
            intermediate_size=64,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            attention_bias=True,
        ),
    ),
    "olmo2-gqa6/2": (
        "Olmo2Config",
        dict(_SMALL, hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2),
    ),
    "gemma2-softcap-window4-mqa3/1-untied": (
        "Gemma2Config",
        dict(
            _SMALL,
            num_hidden_layers=3,
            hidden_size=30,
            intermediate_size=56,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=8,
            sliding_window=4,
            query_pre_attn_scalar=10,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=8.0,
            tie_word_embeddings=False,
        ),
    ),
    "gemma3-local:global-window4-gqa4/2-untied": (
        "Gemma3TextConfig",
        dict(
            _SMALL,
            num_hidden_layers=3,
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=6,
            sliding_window=4,
            query_pre_attn_scalar=12,
            tie_word_embeddings=False,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=5000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=50.0),
            },
        ),
    ),
}


def build(name: str, seed: int = 0, scale: float = 0.1):
    """The transformers model ``name`` (eager attention, eval mode, float32), weights perturbed."""
    torch.manual_seed(seed)
    if name in FAMILY_CONFIGS:
        cls, kwargs = FAMILY_CONFIGS[name]
        config = getattr(transformers, cls)(bos_token_id=0, eos_token_id=None, pad_token_id=None, **kwargs)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    elif name in GPT2:
        # ids in range so transformers does not warn; nothing here generates an end-of-text token
        config = transformers.GPT2Config(bos_token_id=0, eos_token_id=None, pad_token_id=None, **CONFIGS[name])
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(bos_token_id=0, eos_token_id=None, pad_token_id=None, **CONFIGS[name])
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


@eqx.filter_jit
def forward(model, ids):
    return model(ids).rearrange(("batch", "position", "vocab")).array


def named_ids(ids: np.ndarray):
    return nm.named(jnp.asarray(ids), ("batch", "position"))


def _next_token_loss(model, ids):
    # written out in jax (not named's loss) so that the gradient tests check only the model
    logits = model(ids).rearrange(("batch", "position", "vocab")).array
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.take_along_axis(logp, ids.array[:, 1:, None], axis=-1).mean()


def gradient_errors(hf, model, ids: np.ndarray) -> tuple[float, dict[str, float]]:
    """|our next-token loss - torch's| and, per Hugging Face parameter name, the largest gradient
    difference relative to the largest torch gradient entry."""
    from named import models

    hf.zero_grad()
    loss = hf(torch.tensor(ids, dtype=torch.long), labels=torch.tensor(ids, dtype=torch.long)).loss
    loss.backward()
    ours_loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(_next_token_loss))(model, named_ids(ids))
    ours = models.hf_state_dict(grads)
    theirs = {n: p.grad.numpy() for n, p in hf.named_parameters()}
    assert set(ours) == set(theirs)
    return abs(float(ours_loss) - loss.item()), {
        n: float(np.abs(ours[n] - ref).max() / np.abs(ref).max()) for n, ref in theirs.items()
    }
