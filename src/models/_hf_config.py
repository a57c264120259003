"""Hugging Face ``config.json`` <-> our model configs, and the architectures we read and write."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from named import nn

from . import gpt2, llama


class CheckpointFormatError(ValueError):
    """A Hugging Face folder we cannot read or write; the message names the file, tensor or field."""


_REQUIRED = object()


def _field(d: Mapping, name: str, default: Any = _REQUIRED, *, where: Path, kind: type | None = None):
    value = d.get(name)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointFormatError(f"{where}: missing field {name!r}")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise CheckpointFormatError(f"{where}: field {name!r} should be {kind.__name__}, got {value!r}")
    return value


def _unsupported(where: Path, name: str, value, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where}: unsupported {name}={value!r} ({why})")


# ---- config.json <-> our configs ---------------------------------------------------------


def _gpt2_from_hf(d: Mapping, where: Path) -> gpt2.Gpt2Config:
    only = (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True))
    for name, ok in only:
        if d.get(name, ok) != ok:
            raise _unsupported(where, name, d[name], f"our GPT-2 implements {name}={ok} only")
    act = _field(d, "activation_function", "gelu_new", where=where, kind=str)
    if act not in nn.ACTIVATIONS:
        raise _unsupported(where, "activation_function", act, f"known: {', '.join(sorted(nn.ACTIVATIONS))}")
    f = functools.partial(_field, d, where=where)
    return gpt2.Gpt2Config(
        n_layer=f("n_layer", kind=int), n_head=f("n_head", kind=int), n_embd=f("n_embd", kind=int),
        n_positions=f("n_positions", kind=int), vocab_size=f("vocab_size", kind=int),
        dropout=f("resid_pdrop", 0.0, kind=float), layer_norm_epsilon=f("layer_norm_epsilon", 1e-5, kind=float),
        activation=act, tie_word_embeddings=f("tie_word_embeddings", True, kind=bool), n_inner=f("n_inner", None, kind=int),
    )


def _gpt2_to_hf(c: gpt2.Gpt2Config) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "n_positions": c.n_positions, "n_ctx": c.n_positions,
        "vocab_size": c.vocab_size, "n_inner": c.n_inner, "activation_function": c.activation,
        "layer_norm_epsilon": c.layer_norm_epsilon, "tie_word_embeddings": c.tie_word_embeddings,
        # our dropout acts on the embeddings and the residual branches, not on attention weights
        "embd_pdrop": c.dropout, "resid_pdrop": c.dropout, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
    }


def _llama_from_hf(d: Mapping, where: Path) -> llama.LlamaConfig:
    if _field(d, "hidden_act", "silu", where=where, kind=str) != "silu":
        raise _unsupported(where, "hidden_act", d["hidden_act"], "our Llama uses silu")
    for name in ("attention_bias", "mlp_bias"):
        if d.get(name):
            raise _unsupported(where, name, d[name], "our Llama has no biases")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        field = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
        raise _unsupported(where, f"{field}.rope_type", rope_type, "only the default rotary embedding is implemented")
    f = functools.partial(_field, d, where=where)
    heads = f("num_attention_heads", kind=int)
    return llama.LlamaConfig(
        hidden_size=f("hidden_size", kind=int), intermediate_size=f("intermediate_size", kind=int),
        num_hidden_layers=f("num_hidden_layers", kind=int), num_attention_heads=heads,
        num_key_value_heads=f("num_key_value_heads", heads, kind=int),
        rope_theta=float(rope.get("rope_theta", f("rope_theta", 10000.0, kind=float))),
        rms_norm_eps=f("rms_norm_eps", 1e-6, kind=float), max_position_embeddings=f("max_position_embeddings", kind=int),
        tie_word_embeddings=f("tie_word_embeddings", False, kind=bool), vocab_size=f("vocab_size", kind=int),
        head_dim=f("head_dim", None, kind=int),
    )


def _llama_to_hf(c: llama.LlamaConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.HeadSize.size, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_word_embeddings, "vocab_size": c.vocab_size,
        "attention_bias": False, "mlp_bias": False,
    }


@dataclasses.dataclass(frozen=True)
class Arch:
    model_type: str
    architecture: str
    config_cls: type
    model_cls: type
    module: Any  # the model file, for HF_KEYS, HF_LINEAR_LAYOUT, HF_BASE_PREFIX, HF_IGNORED
    from_hf: Callable[[Mapping, Path], Any]
    to_hf: Callable[[Any], dict]


_ARCHS = {
    "gpt2": Arch("gpt2", "GPT2LMHeadModel", gpt2.Gpt2Config, gpt2.Gpt2LMHeadModel, gpt2, _gpt2_from_hf, _gpt2_to_hf),
    "llama": Arch("llama", "LlamaForCausalLM", llama.LlamaConfig, llama.LlamaLMHeadModel, llama,
                  _llama_from_hf, _llama_to_hf),
}
_SUPPORTED = ", ".join(f"{a.model_type} ({a.architecture})" for a in _ARCHS.values())


def arch_for_hf(d: Mapping, where: Path) -> Arch:
    model_type = d.get("model_type")
    if model_type is None:
        raise CheckpointFormatError(f"{where}: missing field 'model_type'; supported: {_SUPPORTED}")
    arch = _ARCHS.get(model_type)
    if arch is None:
        raise CheckpointFormatError(f"{where}: unsupported model_type {model_type!r}; supported: {_SUPPORTED}")
    archs = d.get("architectures") or [arch.architecture]
    if arch.architecture not in archs:
        raise CheckpointFormatError(f"{where}: unsupported architectures {archs!r}; for model_type {model_type!r} "
                                    f"we load {arch.architecture!r} (a causal LM with its head)")
    return arch


def arch_for(obj) -> Arch:
    for arch in _ARCHS.values():
        if isinstance(obj, (arch.config_cls, arch.model_cls)):
            return arch
    raise TypeError(f"no Hugging Face layout for {type(obj).__name__}; supported: {_SUPPORTED}")


def config_from_hf(folder: str | Path) -> Any:
    """Our config for the ``config.json`` in ``folder``."""
    where = Path(folder) / "config.json"
    d = read_json(where)
    return arch_for_hf(d, where).from_hf(d, where)


def read_json(path: Path) -> dict:
    if not path.is_file():
        needed = "; a Hugging Face folder needs config.json" if path.name == "config.json" else ""
        raise CheckpointFormatError(f"{path}: not found{needed}")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object")
    return d
