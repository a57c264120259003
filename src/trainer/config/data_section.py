"""The ``data`` section of a config: its keys and the sources they name (``DataError``, which its
checks raise, lies in ``errors``).

The section is declared here, with the other sections, so that the config's declarations lie
below the code that reads data (``named.trainer.data`` builds splits from a ``DataConfig`` and
re-exports these names: it is their public face). Everything here checks values alone: no
file is opened. A ``DataConfig`` checks its own values when it is made, from a config or in code.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .check import check_section, declaration
from .errors import DataError
from .hub import dataset_id
from .rules import NONEMPTY, Rule, at_least, between, key, one_of

STDLIB = "stdlib"  # the source spec of the embedded corpus: this Python's standard library
BIN_DTYPES = ("uint16", "uint32")
_KEYS = ("name", "paths", "hf_dataset", "split", "subset", "weight", "text_field", "format")
_HUB_KEYS = ("split", "subset")  # keys of a source that only a Hub dataset (hf_dataset) takes
FORMATS = ("text", "chat")  # a source's documents: text (by file kind) or chat records (_chat)
CHAT_PACKINGS = ("whole", "stream")  # whole samples bin-packed into rows (_binpack), or concatenate-and-chunk
TOO_LONG = ("truncate", "drop", "error")  # what whole-sample packing does with a sample longer than a row
MESSAGE_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class SourceSpec:
    """One source of ``data.train`` / ``data.validation``: its files (local ``paths``, or the
    ``split`` of a Hugging Face dataset, ``hf_dataset``, within its folder ``subset``), share,
    text field and format.

    Plain specs (strings) form a single unnamed source (``name == ""``) of text."""

    name: str
    paths: tuple[str, ...]
    weight: float = 1.0
    text_field: str = "text"
    format: str = "text"
    hf_dataset: str | None = None
    split: str = "train"
    subset: str | None = None


def parse_sources(entries: Sequence[Any], key: str, *, weighted: bool) -> list[SourceSpec]:
    """The sources an entry list describes; raises DataError naming ``key[i].field``."""
    named = [isinstance(e, dict) for e in entries]
    if not any(named):
        for i, spec in enumerate(entries):
            if not isinstance(spec, str) or not spec:
                raise DataError(f"{key}[{i}] must be a non-empty path, glob or 'stdlib', got {spec!r}")
        return [SourceSpec("", tuple(entries))] if entries else []
    if not all(named):
        i = named.index(False)
        raise DataError(
            f"{key}[{i}] is {entries[i]!r} but other entries are named sources; give every entry as "
            "{name: ..., paths: [...], weight: ...}"
        )
    default_split = key.rpartition(".")[2]  # data.train: train, data.validation: validation
    out = [_parse_one(e, f"{key}[{i}]", weighted, default_split) for i, e in enumerate(entries)]
    names = [s.name for s in out]
    for i, name in enumerate(names):
        if names.index(name) != i:
            first = names.index(name)
            raise DataError(f"{key}[{i}].name {name!r} is also the name of {key}[{first}]; names must differ")
    total = sum(s.weight for s in out)
    if weighted and not total > 0:
        raise DataError(f"{key}: the weights of the sources sum to 0; give at least one source a positive weight")
    if weighted and not math.isfinite(total):  # each is finite, their sum overflows: every share would be 0 or NaN
        raise DataError(
            f"{key}: the weights of the sources sum to {total} (past the largest float); only their ratios "
            "count, so scale them down (e.g. 3 and 1)"
        )
    return out


def _parse_one(entry: dict, key: str, weighted: bool, default_split: str) -> SourceSpec:
    allowed = [x for x in _KEYS if weighted or x != "weight"]
    for k in entry:
        if k not in allowed:
            near = difflib.get_close_matches(str(k), allowed, n=1)
            why = f"; did you mean {near[0]}?" if near else ""
            why = " (validation sources have no weight)" if k == "weight" else why
            raise DataError(f"{key}.{k} is not a key of a source{why}; its keys: {', '.join(allowed)}")
    hub = _hub_part(entry, key, default_split)
    name = entry.get("name", dataset_id(hub["hf_dataset"], key).repo if hub else None)  # a Hub dataset: its id
    if not isinstance(name, str) or not name.strip():
        raise DataError(f"{key}.name must be a non-empty string, got {name!r}")
    paths = entry.get("paths")
    paths = [paths] if isinstance(paths, str) else paths
    if hub and paths is None:
        paths = []
    elif not isinstance(paths, list) or not paths:
        raise DataError(
            f"{key}.paths must be a path, glob or 'stdlib', or a non-empty list of them (or name a Hugging Face "
            f"dataset with {key}.hf_dataset); got {paths!r}"
        )
    for j, p in enumerate(paths):
        if not isinstance(p, str) or not p:
            raise DataError(f"{key}.paths[{j}] must be a non-empty path, glob or 'stdlib', got {p!r}")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise DataError(f"{key}.weight must be a finite number >= 0, got {weight!r}")
    field = entry.get("text_field", "text")
    if not isinstance(field, str) or not field:
        raise DataError(f"{key}.text_field must be a non-empty column or field name, got {field!r}")
    fmt = entry.get("format", "text")
    if fmt not in FORMATS:
        raise DataError(f"{key}.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "chat" and "text_field" in entry:
        raise DataError(
            f"{key}.text_field: a chat source reads whole records ('messages', or 'prompt' and "
            "'completion'), not one field; leave text_field out"
        )
    return SourceSpec(name, tuple(paths), float(weight), field, fmt, **hub)


def _hub_part(entry: dict, key: str, default_split: str) -> dict[str, Any]:
    """``hf_dataset``, ``split`` and ``subset`` of a source that names a Hugging Face dataset
    (``{}`` for one that does not)."""
    if "hf_dataset" not in entry:
        for k in _HUB_KEYS:
            if k in entry:
                raise DataError(f"{key}.{k} belongs to a Hugging Face dataset; name one with {key}.hf_dataset")
        return {}
    if "paths" in entry:
        raise DataError(f"{key}: give either paths (local files) or hf_dataset (a Hugging Face dataset), not both")
    dataset = entry["hf_dataset"]
    dataset_id(dataset, f"{key}.hf_dataset", error=DataError)
    split = entry.get("split", default_split)
    if not isinstance(split, str) or not re.fullmatch(r"[\w.-]+", split):
        raise DataError(f"{key}.split must be a split name (train, validation, test, ...), got {split!r}")
    subset = entry.get("subset")
    if subset is not None:
        parts = subset.strip("/").split("/") if isinstance(subset, str) else []
        if not parts or any(p in ("", ".", "..") for p in parts) or subset.startswith("/"):
            raise DataError(
                f"{key}.subset must be a folder of the dataset's repository (e.g. `sample/10BT`), got {subset!r}"
            )
        subset = "/".join(parts)
    return {"hf_dataset": dataset, "split": split, "subset": subset}


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how they are cut. The section checks its own values
    (``DataError``) when it is made, from a config or in code."""

    train: list[dict[str, Any] | str] = key(
        factory=lambda: [STDLIB],
        rule=NONEMPTY,
        doc="paths, globs, directories or `stdlib` (the embedded corpus), or named sources "
        "`{name, paths, weight, text_field, format}` drawn by weight (see Mixtures, Chat data); a source "
        "`{hf_dataset: org/name, split, subset}` reads a Hugging Face dataset's files (see Hugging Face Hub ids)",
    )
    validation: list[dict[str, Any] | str] = key(
        factory=list, doc="validation sources in either form; empty: the last val_fraction of the train sequences"
    )
    val_fraction: float = key(
        0.05, between(0, 1, high_open=True), doc="share of the sequences held out for validation (0: none)"
    )
    tokenizer: str = key(
        "byte", doc="`byte`, a local tokenizer.json (or a folder holding one), or a Hugging Face model id holding one"
    )
    chat_template: str | None = key(
        None, NONEMPTY, doc="a Jinja chat template file for chat sources (null: the tokenizer folder's)"
    )
    eos_token: str | None = key(None, doc="the end-of-document token of an HF tokenizer, where it cannot be found")
    seq_len: int = key(256, at_least(2), doc="tokens per packed sequence (at least a token and its target)")
    chat_packing: str = key(
        "whole",
        one_of(*CHAT_PACKINGS),
        doc="chat sources: `whole` samples bin-packed into rows (none split across two), or `stream` "
        "(concatenated and cut every seq_len tokens, as text is)",
    )
    chat_too_long: str = key(
        "truncate",
        one_of(*TOO_LONG),
        doc="whole packing: a sample longer than seq_len is cut to its first seq_len tokens, dropped, or an error",
    )
    loss_roles: list[str] = key(
        factory=lambda: ["assistant"],
        rule=Rule(names=MESSAGE_ROLES, nonempty=True),
        doc="chat sources: the roles whose turns carry loss (at least one)",
    )
    train_on_inputs: bool = key(
        False, doc="chat sources: every token of a sample carries loss (prompts, headers), not only loss_roles' turns"
    )
    skip_bad_records: bool = key(
        False, doc="chat sources: leave out bad records (counted in the log) instead of refusing the data"
    )
    bin_dtype: str = key(
        "uint16", one_of(*BIN_DTYPES), doc="the token dtype of `.bin` files (`.npy` files say their own)"
    )
    cache_dir: str = key("~/.cache/named/data", free=True, doc="where tokenised text is cached")
    stdlib_bytes: int = key(8_000_000, at_least(1), doc="how much of the standard library the `stdlib` corpus takes")

    def __post_init__(self):
        # every value against its declaration, as a config file's are (ConfigError naming the key),
        # also for a DataConfig made in code; then the sources' structure (DataError)
        check_section(DataConfig, self, "data")
        self.sources("train")
        self.sources("validation")

    def sources(self, key: str) -> list[SourceSpec]:
        """``data.train`` or ``data.validation`` as sources: one unnamed source for plain specs."""
        return parse_sources(getattr(self, key), f"data.{key}", weighted=key == "train")


def check_data_key(name: str, value) -> None:
    """``value`` against the declaration of ``data.<name>``, for code that takes one of the section's
    values outside a DataConfig (ConfigError naming the key, as for a config file's)."""
    declaration(DataConfig, name).rule.check(value, f"data.{name}")
