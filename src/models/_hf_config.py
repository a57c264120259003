"""The rule every file of a Hugging Face folder obeys (it lies inside the folder), checked
``config.json`` fields, what a family's ``config.json`` format does (``HfConfigFormat``), and
GPT-2's (``HfGpt2``; the decoder families' is ``_hf_decoder.py``; which family a folder holds is
``registry.py``'s business)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import typing
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from named import NamedError, nn

from . import gpt2


class CheckpointFormatError(NamedError, ValueError):
    """A Hugging Face folder we cannot read or write; the message names the file, tensor or field."""


# ---- files of a folder ---------------------------------------------------------------------------


def _roots(folder: Path) -> tuple[Path, ...]:
    folder = folder.resolve()
    # the hub cache keeps a snapshot's files in the repository's blobs/, reached by symlinks
    # from snapshots/<revision>/: the same repository, so they count as the folder's own
    repo = folder.parent.parent
    if (
        folder.parent.name == "snapshots"
        and repo.name.startswith(("models--", "datasets--"))
        and (repo / "blobs").is_dir()
    ):
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
        raise CheckpointFormatError(
            f"{where}, which is not inside the folder {folder}: only files inside the folder are read"
        )
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

REQUIRED = object()
_KINDS = {int: "int", float: "float", bool: "bool", str: "str", dict: "dict (a JSON object)", list: "list"}


def _is_probability(name: str) -> bool:
    return name.endswith(("pdrop", "dropout"))


def checked_field(d: Mapping, name: str, kind: type, default: Any = REQUIRED, *, where: Path, prefix: str = "") -> Any:
    """``d[name]`` if it is of ``kind``; ``default`` when missing or null.

    The rule per kind: an int is a size, so positive (never a bool); a float is finite and
    positive (an int is taken), a dropout probability in [0, 1); the others by type alone.
    ``prefix`` places a nested field in the message (``rope_parameters.``).
    """
    value = d.get(name)
    field = prefix + name
    if value is None:
        if default is REQUIRED:
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
    default: Any = REQUIRED
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
        value = checked_field(d, f.name, f.kind or _kind(cls, f.ours), f.default, where=where)
        if f.allowed is not None and value not in f.allowed:
            raise CheckpointFormatError(f"{where}: unsupported {f.name}={value!r} ({f.why})")
        if f.ours is not None:
            out[f.ours] = value
    return out


def build_config(cls: type, kwargs: dict, where: Path):
    try:
        return cls(**kwargs)
    except ValueError as e:  # the config's own consistency checks (divisibility), which name the fields
        raise CheckpointFormatError(f"{where}: {e}") from None


# ---- config.json <-> our configs ---------------------------------------------------------


class HfConfigFormat(Protocol):
    """How one family's ``config.json`` reads and writes; every family of the registry has one.
    ``model_type`` and ``architectures`` are the registry's (``Family.from_hf`` / ``to_hf``): a
    format deals in the rest."""

    def read(self, family, d: Mapping, where: Path) -> Any:
        """Our config (of ``family.config_cls``) for the parsed ``config.json`` ``d`` at ``where``;
        a field it cannot take raises a CheckpointFormatError naming it."""

    def write(self, family, config) -> dict:
        """The fields of ``config.json`` for ``config``, refusing (CheckpointFormatError) a config
        the format cannot hold before anything is written."""


_GPT2 = (
    _Hf("n_layer", ours="n_layer"),
    _Hf("n_head", ours="n_head"),
    _Hf("n_embd", ours="n_embd"),
    _Hf("n_positions", ours="n_positions"),
    _Hf("vocab_size", ours="vocab_size"),
    _Hf("resid_pdrop", 0.0, ours="dropout"),
    _Hf("layer_norm_epsilon", 1e-5, ours="layer_norm_epsilon"),
    _Hf(
        "activation_function",
        "gelu_new",
        ours="activation",
        allowed=nn.ACTIVATIONS,
        why=f"known: {', '.join(sorted(nn.ACTIVATIONS))}",
    ),
    _Hf("tie_word_embeddings", True, ours="tie_word_embeddings"),
    _Hf("n_inner", None, ours="n_inner"),
    *(
        _Hf(name, ok, kind=bool, allowed=(ok,), why=f"our GPT-2 implements {name}={ok} only")
        for name, ok in (
            ("add_cross_attention", False),
            ("scale_attn_by_inverse_layer_idx", False),
            ("scale_attn_weights", True),
        )
    ),
)


@dataclasses.dataclass(frozen=True)
class HfGpt2:
    """GPT-2's ``config.json``: the fields of ``_GPT2``, read and written by the one table."""

    fields: tuple[_Hf, ...] = _GPT2

    def read(self, family, d: Mapping, where: Path) -> gpt2.Gpt2Config:
        return build_config(family.config_cls, _read(d, family.config_cls, self.fields, where), where)

    def write(self, family, c: gpt2.Gpt2Config) -> dict:
        out = {f.name: getattr(c, f.ours) if f.ours is not None else f.default for f in self.fields}
        return {
            **out,
            "n_ctx": c.n_positions,
            "reorder_and_upcast_attn": False,
            # our dropout acts on the embeddings and the residual branches, not on attention weights
            "embd_pdrop": c.dropout,
            "attn_pdrop": 0.0,
        }
