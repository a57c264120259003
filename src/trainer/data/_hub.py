"""The files of a Hugging Face dataset source: ``{hf_dataset: org/name, split: train, subset: ...}``.

The dataset repository's snapshot in the Hub cache (``config.hub``: fetched, and pinned to its
commit, when the config was loaded) holds Parquet, JSON Lines or text files, which our own
readers read (``_sources``), tokenised and cached like any local file. The ``datasets``
library is not needed: a repository's data files are what it would read too, and reading them
ourselves keeps one reader, one cache and one set of checks for every source.

A split's files are found as ``datasets`` finds them when a repository declares none: a file
belongs to a split when its path (below ``subset``) holds the split's name, or one of its usual
spellings (``SPLIT_NAMES``), as a word of its own (``data/train-00000-of-00002.parquet``,
``validation.jsonl``, ``default/test/0000.parquet``); a repository whose paths name no split
is all ``train``.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..config.data_section import DataError, SourceSpec
from ..config.hub import dataset_files, dataset_id, snapshot
from ._sources import data_files

# The usual spellings of the standard splits, as ``datasets`` takes them.
SPLIT_NAMES = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}


def _names(path: str, words) -> bool:
    """Whether ``path`` holds one of ``words`` as a word of its own (no letter on either side)."""
    return any(re.search(rf"(?<![a-z]){re.escape(w)}(?![a-z])", path) for w in words)


def dataset_paths(spec: SourceSpec) -> list[str]:
    """The files of ``spec.split`` in the snapshot of ``spec.hf_dataset``, in sorted order; DataError
    naming the split and the splits there are when it has none."""
    hid = dataset_id(spec.hf_dataset, "hf_dataset", error=DataError)
    root = snapshot(hid, "hf_dataset", kind="dataset", patterns=dataset_files(spec.subset), error=DataError)
    folder = root / spec.subset if spec.subset else root
    if not folder.is_dir():
        raise DataError(f"hf_dataset={spec.hf_dataset!r} has no folder {spec.subset!r} (subset)")
    files = {p.relative_to(folder).as_posix().lower(): _inside(root, p) for p in data_files(folder)}
    if not files:
        raise DataError(f"hf_dataset={spec.hf_dataset!r} holds no data files we read (Parquet, JSON Lines, text)")
    found = [name for name, words in SPLIT_NAMES.items() if any(_names(rel, words) for rel in files)]
    words = SPLIT_NAMES.get(spec.split, (spec.split.lower(),))
    chosen = [p for rel, p in files.items() if _names(rel, words)]
    if not chosen and not found and spec.split == "train":
        chosen = list(files.values())  # no file names a split: all of it is train
    if not chosen:
        there = ", ".join(found) if found else "train (no file names a split)"
        raise DataError(f"hf_dataset={spec.hf_dataset!r} has no files of the split {spec.split!r}; its splits: {there}")
    return [str(p) for p in chosen]


def _inside(root: Path, path: Path) -> Path:
    """``path``, refused unless it leads (through its links) into the snapshot ``root`` or the blobs
    of its repository: the rule of every Hugging Face folder we read (``folder_file``)."""
    from named.models.hf import CheckpointFormatError, folder_file  # with the models: not in workers

    try:
        return folder_file(root, path.relative_to(root).as_posix())
    except CheckpointFormatError as e:
        raise DataError(str(e)) from None
