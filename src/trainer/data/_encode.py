"""Writing a token cache file: documents tokenised in batches, every id checked against the
vocabulary, into a file that appears under its final name only when complete. Used by the one-pass
build (``_cache``) and by the per-file shards of a parallel build (``_shards``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from itertools import chain
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..config.data_section import DataError
from ._sources import SourceFile, first_out_of_range
from ._tokenizer import Tokenizer

CACHE_FORMAT = 2  # 2: ids range-checked when written; files of format 1 were not
ENCODE_CHUNK_CHARS = 4 << 20
TEMP_PREFIX = ".partial-"


@contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Write ``path`` all-or-nothing: on any exception the temp file is removed, and
    ``path`` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TEMP_PREFIX + path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def check_target(path: Path, flag: str, example: str) -> None:
    """``path`` can be written by ``atomic_write``: not a folder, and the nearest folder of it that
    exists is a writable folder; a ConfigError naming ``flag`` otherwise, before any work is done."""
    from ..config import ConfigError

    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder: name the file to write, e.g. {flag} {example}")
    folder = path.absolute().parent
    while not folder.exists() and not folder.is_symlink():
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path} cannot be written: {folder} is a file (or a broken link), not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path} cannot be written: the folder {folder} is not writable")


def encode_into(f: BinaryIO, docs: Iterator[tuple[str, str]], tokenizer: Tokenizer, dtype: np.dtype) -> int:
    """Tokenise ``docs`` in batches into ``f`` (each document then eos), checking every id;
    returns the number of tokens written."""
    encode_batch = getattr(tokenizer, "encode_batch", None) or (lambda texts: [tokenizer.encode(t) for t in texts])
    eos = tokenizer.eos_id
    n = 0
    for chunk in chunked(docs):
        encoded = encode_batch([text for _, text in chunk])
        kept = [(where, doc) for (where, _), doc in zip(chunk, encoded) if len(doc)]
        if not kept:
            continue
        ends = np.cumsum([len(doc) + 1 for _, doc in kept])
        # int64 first: an id too large for ``dtype`` must reach the range check, not overflow
        flat = np.fromiter(chain.from_iterable((*doc, eos) for _, doc in kept), dtype=np.int64, count=int(ends[-1]))
        check_ids(flat, ends, [where for where, _ in kept], tokenizer)
        f.write(flat.astype(dtype).tobytes())
        n += flat.size
    return n


def check_ids(flat: np.ndarray, ends: np.ndarray, wheres: Sequence[str], tokenizer: Tokenizer) -> None:
    """Raise DataError naming the document (``wheres[k]`` ends at ``ends[k]`` in ``flat``) of the
    first id outside the tokenizer's vocabulary."""
    vocab = tokenizer.vocab_size
    bad = first_out_of_range(flat, vocab)
    if bad is not None:
        where = wheres[int(np.searchsorted(ends, bad, side="right"))]
        raise DataError(
            f"{where}: the tokenizer gave id {int(flat[bad])}, outside its vocabulary of {vocab} "
            f"(tokenizer {tokenizer!r}); a model sized by that vocabulary cannot embed it"
        )


def empty_corpus(files: Sequence[SourceFile]) -> DataError:
    names = ", ".join(str(f.path) for f in files[:3]) + (", ..." if len(files) > 3 else "")
    return DataError(f"the corpus is empty: no text in {names}")


def chunked(docs: Iterator[tuple]) -> Iterator[list[tuple]]:
    """``(where, text, ...)`` items in lists of about ``ENCODE_CHUNK_CHARS`` characters of text."""
    chunk, size = [], 0
    for item in docs:
        chunk.append(item)
        size += len(item[1])
        if size >= ENCODE_CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; some filesystems refuse to open a folder.
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
