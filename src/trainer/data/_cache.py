"""The tokenised-data cache: one flat token file per (sources, tokenizer), memory-mapped.

A cache file is raw tokens (uint16 when the vocabulary fits, else uint32), each document
followed by the tokenizer's eos id, nanoGPT ``.bin`` style. Its name carries a hash of the
source list (paths, kinds, sizes, mtimes) and the tokenizer's fingerprint, so changing
any of them builds a new file and a second run with the same inputs reads the old one.
Files appear only complete: they are written under a temporary name in the same folder,
fsynced, then renamed (``os.replace`` is atomic), so readers never see a partial file and
processes building the same cache at once just race to an identical result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ._errors import DataError
from ._sources import SourceFile, iter_documents
from ._tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
_TEMP_PREFIX = ".partial-"
_STALE_TEMP_S = 24 * 3600  # a temp file this old belongs to a writer that was killed
_ENCODE_CHUNK_CHARS = 4 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@contextmanager
def atomic_write(path: Path) -> Iterator[BinaryIO]:
    """Write ``path`` all-or-nothing: on any exception the temp file is removed, and
    ``path`` is untouched."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX + path.name + ".")
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


def cache_key(files: Sequence[SourceFile], tokenizer: Tokenizer) -> str:
    listing = []
    for f in files:
        st = f.path.stat()
        listing.append([str(f.path), f.kind, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"format": CACHE_FORMAT, "tokenizer": tokenizer.fingerprint, "files": listing})
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached_tokens(files: Sequence[SourceFile], tokenizer: Tokenizer, cache_dir: str | Path) -> np.memmap:
    """Tokens of the text/JSONL ``files`` joined by eos, from the cache or tokenised into it."""
    dtype = token_dtype(tokenizer.vocab_size)
    cache_dir = Path(cache_dir).expanduser()
    path = cache_dir / f"tokens-{cache_key(files, tokenizer)}.{dtype.name}.bin"
    if not path.is_file():
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(
                f"cannot create the data cache folder {str(cache_dir)!r} (data.cache_dir): {e.strerror}"
            ) from e
        _remove_stale_temps(cache_dir)
        t0 = time.perf_counter()
        n = _tokenize_into(path, files, tokenizer, dtype)
        log.info("tokenised %d files into %d tokens in %.1fs -> %s", len(files), n, time.perf_counter() - t0, path)
    return np.memmap(path, dtype=dtype, mode="r")


def _tokenize_into(path: Path, files: Sequence[SourceFile], tokenizer: Tokenizer, dtype: np.dtype) -> int:
    encode_batch = getattr(tokenizer, "encode_batch", None) or (lambda texts: [tokenizer.encode(t) for t in texts])
    eos = tokenizer.eos_id
    n = 0
    with atomic_write(path) as f:
        for docs in _chunked(iter_documents(files)):
            ids = [doc + [eos] for doc in encode_batch(docs) if doc]
            if ids:
                flat = np.fromiter((t for doc in ids for t in doc), dtype=dtype)
                f.write(flat.tobytes())
                n += flat.size
        if n == 0:
            names = ", ".join(str(f.path) for f in files[:3]) + (", ..." if len(files) > 3 else "")
            raise DataError(f"the corpus is empty: no text in {names}")
    return n


def _chunked(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= _ENCODE_CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _remove_stale_temps(cache_dir: Path) -> None:
    cutoff = time.time() - _STALE_TEMP_S
    for p in cache_dir.glob(_TEMP_PREFIX + "*"):
        with suppress(OSError):
            if p.stat().st_mtime < cutoff:
                p.unlink()


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable; some filesystems refuse to open a folder.
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
