"""Hugging Face ``config.json`` <-> our model configs, the architectures we read and write, and
the rule every file of a Hugging Face folder obeys (it lies inside the folder)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from named import nn

from . import gpt2, llama


class CheckpointFormatError(ValueError):
    """A Hugging Face folder we cannot read or write; the message names the file, tensor or field."""


# ---- files of a folder ---------------------------------------------------------------------------


def _roots(folder: Path) -> tuple[Path, ...]:
    folder = folder.resolve()
    # the hub cache keeps a snapshot's files in the repository's blobs/, reached by symlinks
    # from snapshots/<revision>/: the same repository, so they count as the folder's own
    repo = folder.parent.parent
    if folder.parent.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return folder, repo / "blobs"
    return (folder,)


def folder_file(folder: Path, name: str, *, named_by: str = "") -> Path:
    """``folder / name``, refused unless it lies inside ``folder`` once symlinks are followed.

    ``named_by`` says where the name came from (an index and its tensor) for the message.
    The path is only resolved, never opened.
    """
    path = folder / name
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise CheckpointFormatError(f"{named_by or path}: cannot follow {name!r} ({e})") from None
    if not any(root in resolved.parents for root in _roots(folder)):
        where = f"{named_by} names {name!r}" if named_by else f"{path} resolves to {resolved}"
        raise CheckpointFormatError(f"{where}, which is not inside the folder {folder}: "
                                    "only files inside the folder are read")
    return path


def require_file(path: Path, missing: str = "not found") -> None:
    """Refuses a path that is not a regular file (absent, a directory, ...), naming it."""
    if path.is_dir():
        raise CheckpointFormatError(f"{path}: is a directory, expected a file")
    if not path.is_file():
        raise CheckpointFormatError(f"{path}: {missing}")


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Turns an OS error while reading ``path`` into a CheckpointFormatError naming it."""
    try:
        yield
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot be read ({e.strerror or e})") from None


def read_json(path: Path) -> dict:
    needed = "; a Hugging Face folder needs config.json" if path.name == "config.json" else ""
    require_file(path, f"not found{needed}")
    try:
        with reading(path):
            d = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # ValueError: also bad UTF-8 and ints of over 4300 digits
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object")
    return d


# ---- checked fields --------------------------------------------------------------------------------

_REQUIRED = object()
_KINDS = {int: "int", float: "float", bool: "bool", str: "str", dict: "dict (a JSON object)", list: "list"}


def _is_probability(name: str) -> bool:
    return name.endswith(("pdrop", "dropout"))


def _checked(d: Mapping, name: str, kind: type, default: Any = _REQUIRED, *, where: Path, prefix: str = "") -> Any:
    """``d[name]`` if it is of ``kind``; ``default`` when missing or null.

    The rule per kind: an int is a size, so positive (never a bool); a float is finite and
    positive (an int is taken), a dropout probability in [0, 1); the others by type alone.
    ``prefix`` places a nested field in the message (``rope_parameters.``).
    """
    value = d.get(name)
    field = prefix + name
    if value is None:
        if default is _REQUIRED:
            raise CheckpointFormatError(f"{where}: missing field {field!r}")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 2**1000 else math.inf
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise CheckpointFormatError(f"{where}: field {field!r} should be {_KINDS[kind]}, got {value!r}")
    if kind is int and value < 1:
        raise CheckpointFormatError(f"{where}: field {field!r} should be a positive int, got {value}")
    if kind is float:
        ok = 0 <= value < 1 if _is_probability(name) else value > 0
        if not (math.isfinite(value) and ok):
            want = "in [0, 1)" if _is_probability(name) else "a finite positive float"
            raise CheckpointFormatError(f"{where}: field {field!r} should be {want}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class _Hf:
    """A ``config.json`` field: the config field it fills (whose annotation is its kind), or an
    option of ``kind`` that we implement only for the values in ``allowed``."""

    name: str
    default: Any = _REQUIRED
    ours: str | None = None
    kind: type | None = None
    allowed: Collection | None = None
    why: str = ""


@functools.cache
def _kind(cls: type, field: str) -> type:
    hint = typing.get_type_hints(cls)[field]
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


def _read(d: Mapping, cls: type, fields: tuple[_Hf, ...], where: Path) -> dict[str, Any]:
    """Every field of ``fields`` checked; the config fields among them, by their names in ``cls``."""
    out = {}
    for f in fields:
        value = _checked(d, f.name, f.kind or _kind(cls, f.ours), f.default, where=where)
        if f.allowed is not None and value not in f.allowed:
            raise CheckpointFormatError(f"{where}: unsupported {f.name}={value!r} ({f.why})")
        if f.ours is not None:
            out[f.ours] = value
    return out


def _build(cls: type, kwargs: dict, where: Path):
    try:
        return cls(**kwargs)
    except ValueError as e:  # the config's own consistency checks (divisibility), which name the fields
        raise CheckpointFormatError(f"{where}: {e}") from None


# ---- config.json <-> our configs ---------------------------------------------------------

_GPT2 = (
    _Hf("n_layer", ours="n_layer"), _Hf("n_head", ours="n_head"), _Hf("n_embd", ours="n_embd"),
    _Hf("n_positions", ours="n_positions"), _Hf("vocab_size", ours="vocab_size"),
    _Hf("resid_pdrop", 0.0, ours="dropout"), _Hf("layer_norm_epsilon", 1e-5, ours="layer_norm_epsilon"),
    _Hf("activation_function", "gelu_new", ours="activation", allowed=nn.ACTIVATIONS,
        why=f"known: {', '.join(sorted(nn.ACTIVATIONS))}"),
    _Hf("tie_word_embeddings", True, ours="tie_word_embeddings"), _Hf("n_inner", None, ours="n_inner"),
    *(_Hf(name, ok, kind=bool, allowed=(ok,), why=f"our GPT-2 implements {name}={ok} only")
      for name, ok in (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False),
                       ("scale_attn_weights", True))),
)


def _gpt2_from_hf(d: Mapping, where: Path) -> gpt2.Gpt2Config:
    return _build(gpt2.Gpt2Config, _read(d, gpt2.Gpt2Config, _GPT2, where), where)


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


_LLAMA = (
    _Hf("hidden_size", ours="hidden_size"), _Hf("intermediate_size", ours="intermediate_size"),
    _Hf("num_hidden_layers", ours="num_hidden_layers"), _Hf("num_attention_heads", ours="num_attention_heads"),
    _Hf("num_key_value_heads", None, ours="num_key_value_heads"), _Hf("rope_theta", None, ours="rope_theta"),
    _Hf("rms_norm_eps", 1e-6, ours="rms_norm_eps"), _Hf("max_position_embeddings", ours="max_position_embeddings"),
    _Hf("tie_word_embeddings", False, ours="tie_word_embeddings"), _Hf("vocab_size", ours="vocab_size"),
    _Hf("head_dim", None, ours="head_dim"),
    _Hf("hidden_act", "silu", kind=str, allowed=("silu",), why="our Llama uses silu"),
    _Hf("attention_bias", False, kind=bool, allowed=(False,), why="our Llama has no biases"),
    _Hf("mlp_bias", False, kind=bool, allowed=(False,), why="our Llama has no biases"),
)


def _llama_rope(d: Mapping, where: Path) -> tuple[str, Mapping]:
    """The rotary-embedding settings: ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    for name in ("rope_parameters", "rope_scaling"):
        rope = _checked(d, name, dict, {}, where=where)
        if rope:
            return name, rope
    return "rope_parameters", {}


def _llama_from_hf(d: Mapping, where: Path) -> llama.LlamaConfig:
    kwargs = _read(d, llama.LlamaConfig, _LLAMA, where)
    field, rope = _llama_rope(d, where)
    rope_type = _checked(rope, "rope_type", str, None, where=where, prefix=f"{field}.")
    rope_type = rope_type or _checked(rope, "type", str, "default", where=where, prefix=f"{field}.")
    if rope_type != "default":
        raise CheckpointFormatError(f"{where}: unsupported {field}.rope_type={rope_type!r} "
                                    "(only the default rotary embedding is implemented)")
    theta = _checked(rope, "rope_theta", float, None, where=where, prefix=f"{field}.")
    kwargs["rope_theta"] = theta or kwargs["rope_theta"] or 10000.0
    kwargs["num_key_value_heads"] = kwargs["num_key_value_heads"] or kwargs["num_attention_heads"]
    return _build(llama.LlamaConfig, kwargs, where)


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
    if d.get("model_type") is None:
        raise CheckpointFormatError(f"{where}: missing field 'model_type'; supported: {_SUPPORTED}")
    model_type = _checked(d, "model_type", str, where=where)
    arch = _ARCHS.get(model_type)
    if arch is None:
        raise CheckpointFormatError(f"{where}: unsupported model_type {model_type!r}; supported: {_SUPPORTED}")
    archs = _checked(d, "architectures", list, [arch.architecture], where=where)
    if not all(isinstance(a, str) for a in archs):
        raise CheckpointFormatError(f"{where}: field 'architectures' should be a list of names, got {archs!r}")
    if arch.architecture not in archs:
        raise CheckpointFormatError(f"{where}: unsupported architectures {archs!r}; for model_type {model_type!r} "
                                    f"we load {arch.architecture!r} (a causal LM with its head)")
    return arch


def arch_for(obj) -> Arch:
    for arch in _ARCHS.values():
        if isinstance(obj, (arch.config_cls, arch.model_cls)):
            return arch
    raise TypeError(f"no Hugging Face layout for {type(obj).__name__}; supported: {_SUPPORTED}")


def read_config(folder: Path) -> tuple[Arch, Any, Path]:
    """The architecture and our config for the ``config.json`` in ``folder``, and that file's path."""
    if not folder.is_dir():
        raise CheckpointFormatError(f"{folder}: {'not a directory' if folder.exists() else 'not found'}; "
                                    "a Hugging Face model is a folder holding config.json and safetensors files")
    where = folder_file(folder, "config.json")
    d = read_json(where)
    arch = arch_for_hf(d, where)
    return arch, arch.from_hf(d, where), where


def config_from_hf(folder: str | Path) -> Any:
    """Our config for the ``config.json`` in ``folder``."""
    return read_config(Path(folder))[1]
