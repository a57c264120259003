"""The tokenised-data cache: one flat token file per (sources, tokenizer), memory-mapped.

A cache file is raw tokens (uint16 when the vocabulary fits, else uint32), each document
followed by the tokenizer's eos id, nanoGPT ``.bin`` style; the dtype is part of the file
name (``tokens-<key>.uint32.bin``) and reading takes it from there. The key hashes the
source list (paths, kinds, sizes, mtimes), the tokenizer's fingerprint and its vocab size,
so changing any of them builds a new file and a second run with the same inputs reads the
old one. Every id is checked against the vocabulary as it is written (a max per chunk), so
a cache file holds only ids the model can embed, and is never re-scanned when reused.
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
from ._sources import SourceFile, first_out_of_range, iter_documents, memmap_tokens
from ._tokenizer import Tokenizer, check_tokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # 2: ids range-checked when written; files of format 1 were not
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
        try:
            st = f.path.stat()
        except OSError as e:
            raise DataError(f"cannot read data file {str(f.path)!r}: {e.strerror}") from e
        listing.append([str(f.path), f.kind, st.st_size, st.st_mtime_ns])
    key = {"format": CACHE_FORMAT, "tokenizer": tokenizer.fingerprint, "vocab": int(tokenizer.vocab_size)}
    blob = json.dumps({**key, "files": listing})
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached_tokens(files: Sequence[SourceFile], tokenizer: Tokenizer, cache_dir: str | Path) -> np.memmap:
    """Tokens of the text/JSONL ``files`` joined by eos, from the cache or tokenised into it.

    Raises DataError naming the document if the tokenizer gives an id outside
    ``[0, tokenizer.vocab_size)``, and naming the cache file if it cannot be written
    (read-only or full disk); nothing is left behind either way.
    """
    check_tokenizer(tokenizer)
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
        try:
            n = _tokenize_into(path, files, tokenizer, dtype)
        except OSError as e:  # reading sources raises DataError; an OSError here is the cache write
            raise DataError(
                f"cannot write the token cache {str(path)!r} (data.cache_dir): {e.strerror or e}; "
                "free some space or point data.cache_dir at a writable folder"
            ) from e
        log.info("tokenised %d files into %d tokens in %.1fs -> %s", len(files), n, time.perf_counter() - t0, path)
    return _open_cache(path)


def _open_cache(path: Path) -> np.memmap:
    dtype = np.dtype(path.suffixes[-2][1:])  # the name records the dtype the file was written in
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise DataError(f"the token cache {str(path)!r} is corrupt ({size} bytes of {dtype}); delete it to rebuild")
    return memmap_tokens(path, dtype)


def _tokenize_into(path: Path, files: Sequence[SourceFile], tokenizer: Tokenizer, dtype: np.dtype) -> int:
    encode_batch = getattr(tokenizer, "encode_batch", None) or (lambda texts: [tokenizer.encode(t) for t in texts])
    eos, vocab = tokenizer.eos_id, tokenizer.vocab_size
    n = 0
    with atomic_write(path) as f:
        for chunk in _chunked(iter_documents(files)):
            encoded = encode_batch([text for _, text in chunk])
            kept = [(where, doc) for (where, _), doc in zip(chunk, encoded) if len(doc)]
            if not kept:
                continue
            ends = np.cumsum([len(doc) + 1 for _, doc in kept])
            # int64 first: an id too large for ``dtype`` must reach the range check, not overflow
            flat = np.fromiter((t for _, doc in kept for t in (*doc, eos)), dtype=np.int64, count=int(ends[-1]))
            bad = first_out_of_range(flat, vocab)
            if bad is not None:
                where = kept[int(np.searchsorted(ends, bad, side="right"))][0]
                raise DataError(
                    f"{where}: the tokenizer gave id {int(flat[bad])}, outside its vocabulary of {vocab} "
                    f"(tokenizer {tokenizer!r}); a model sized by that vocabulary cannot embed it"
                )
            f.write(flat.astype(dtype).tobytes())
            n += flat.size
        if n == 0:
            names = ", ".join(str(f.path) for f in files[:3]) + (", ..." if len(files) > 3 else "")
            raise DataError(f"the corpus is empty: no text in {names}")
    return n


def _chunked(docs: Iterator[tuple[str, str]]) -> Iterator[list[tuple[str, str]]]:
    chunk, size = [], 0
    for where, text in docs:
        chunk.append((where, text))
        size += len(text)
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
