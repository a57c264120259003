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
processes building the same cache at once just race to an identical result. A corpus of
64 MB or more is built from shards of its files and Parquet row groups, resumably, by this
machine's cores or a runner such as a Ray cluster's (``_shards``).

A chat source (``_chat``) is cached as a pair: its token file and a flag file of one byte per
token (``flags-<key>.uint8.bin``: which tokens carry loss, where documents start), keyed also
by the template, the stop tokens and the loss options (``ChatRules``). Chat caches are built in
one pass, never from shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

import numpy as np

from ..config.data_section import DataError
from ._chat import CHAT_FORMAT, DEFAULT_RULES, ChatRules, encode_chat_into
from ._encode import CACHE_FORMAT, TEMP_PREFIX, atomic_write, empty_corpus, encode_into
from ._shards import ShardRunner, build_sharded, use_shards
from ._sources import FIELD_KINDS, SourceFile, iter_documents, iter_records, memmap_tokens
from ._tokenizer import Tokenizer, check_tokenizer
from .chat_template import ChatFormat

log = logging.getLogger(__name__)

_STALE_TEMP_S = 24 * 3600  # a temp file this old belongs to a writer that was killed


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def cache_key(files: Sequence[SourceFile], tokenizer: Tokenizer, chat: list | None = None) -> str:
    listing = []
    for f in files:
        try:
            st = f.path.stat()
        except OSError as e:
            raise DataError(f"cannot read data file {str(f.path)!r}: {e.strerror}") from e
        field = [f.text_field] if f.kind in FIELD_KINDS else []  # another column of the same file: other tokens
        listing.append([str(f.path), f.kind, st.st_size, st.st_mtime_ns, *field])
    key = {"format": CACHE_FORMAT, "tokenizer": tokenizer.fingerprint, "vocab": int(tokenizer.vocab_size)}
    if chat is not None:  # only then: the keys (and files) of text caches stay what they were
        key["chat"] = [CHAT_FORMAT, chat]
    blob = json.dumps({**key, "files": listing})
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached_tokens(
    files: Sequence[SourceFile], tokenizer: Tokenizer, cache_dir: str | Path, runner: ShardRunner | None = None
) -> np.memmap:
    """Tokens of the documents of ``files`` (text, JSONL, Parquet, Arrow) joined by eos, from
    the cache or tokenised into it: a large corpus in shards, by ``runner`` if one is given (``_shards``).

    Raises DataError naming the document if the tokenizer gives an id outside
    ``[0, tokenizer.vocab_size)``, and naming the cache file if it cannot be written
    (read-only or full disk); nothing is left behind either way.
    """
    check_tokenizer(tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    cache_dir = Path(cache_dir).expanduser()
    path = cache_dir / f"tokens-{cache_key(files, tokenizer)}.{dtype.name}.bin"
    if not path.is_file():
        _write_cache(path, files, lambda: _tokenize_into(path, files, tokenizer, dtype, runner))
    return _open_cache(path)


def cached_chat(
    files: Sequence[SourceFile], fmt: ChatFormat, cache_dir: str | Path, rules: ChatRules = DEFAULT_RULES
) -> tuple[np.memmap, np.memmap]:
    """Tokens of the chat records of ``files`` (``_chat``) and their flags (one byte per token:
    ``LOSS``, ``START``), from the cache or tokenised into it.

    The flags are a second file, ``flags-<key>.uint8.bin``, written with the tokens: both appear
    only complete (the flags first, so a token file whose flags are missing is rebuilt), and a
    pair whose lengths differ is refused as corrupt.
    """
    tokenizer = fmt.tokenizer
    check_tokenizer(tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)
    cache_dir = Path(cache_dir).expanduser()
    key = cache_key(files, tokenizer, chat=[fmt.fingerprint, *rules.key])
    path, flags_path = cache_dir / f"tokens-{key}.{dtype.name}.bin", cache_dir / f"flags-{key}.uint8.bin"
    if not (path.is_file() and flags_path.is_file()):
        _write_cache(path, files, lambda: _chat_into(path, flags_path, files, fmt, dtype, rules))
    tokens, flags = _open_cache(path), _open_cache(flags_path)
    if len(tokens) != len(flags):
        raise DataError(
            f"the token cache {str(path)!r} holds {len(tokens)} tokens but its flags {str(flags_path)!r} "
            f"{len(flags)}; delete both to rebuild"
        )
    return tokens, flags


def _write_cache(path: Path, files: Sequence[SourceFile], tokenize) -> None:
    cache_dir = path.parent
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the data cache folder {str(cache_dir)!r} (data.cache_dir): {e.strerror}") from e
    _remove_stale_temps(cache_dir)
    t0 = time.perf_counter()
    try:
        n = tokenize()
    except OSError as e:  # reading sources raises DataError; an OSError here is the cache write
        raise DataError(
            f"cannot write the token cache {str(path)!r} (data.cache_dir): {e.strerror or e}; "
            "free some space or point data.cache_dir at a writable folder"
        ) from e
    log.info("tokenised %d files into %d tokens in %.1fs -> %s", len(files), n, time.perf_counter() - t0, path)


def _open_cache(path: Path) -> np.memmap:
    dtype = np.dtype(path.suffixes[-2][1:])  # the name records the dtype the file was written in
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise DataError(f"the token cache {str(path)!r} is corrupt ({size} bytes of {dtype}); delete it to rebuild")
    return memmap_tokens(path, dtype)


def _tokenize_into(
    path: Path, files: Sequence[SourceFile], tokenizer: Tokenizer, dtype: np.dtype, runner: ShardRunner | None
) -> int:
    if use_shards(files):
        return build_sharded(path, files, tokenizer, dtype, runner)
    with atomic_write(path) as f:
        n = encode_into(f, iter_documents(files), tokenizer, dtype)
        if n == 0:
            raise empty_corpus(files)
    return n


def _chat_into(
    path: Path, flags_path: Path, files: Sequence[SourceFile], fmt: ChatFormat, dtype: np.dtype, rules: ChatRules
) -> int:
    # Chat corpora are built in one pass (no worker shards): a worker would need the template too.
    with atomic_write(path) as tokens_f, atomic_write(flags_path) as flags_f:  # the inner one, flags, lands first
        n = encode_chat_into(tokens_f, flags_f, lambda on_bad: iter_records(files, on_bad), fmt, dtype, rules)
        if n == 0:
            raise empty_corpus(files)
    return n


def _remove_stale_temps(cache_dir: Path) -> None:
    cutoff = time.time() - _STALE_TEMP_S
    for p in cache_dir.glob(TEMP_PREFIX + "*"):
        with suppress(OSError):
            if p.stat().st_mtime < cutoff:
                p.unlink()
