"""Large cache builds: one shard per source file, tokenised by worker processes, resumable.

A corpus of at least ``SHARDED_MIN_BYTES`` is tokenised file by file into a hidden folder
beside the cache file (``.shards-<cache file name>/``): shard ``i`` holds file ``i``'s tokens
and is written atomically, so a build that is killed keeps every finished shard, and the next
run with the same inputs tokenises only the missing ones. The folder's ``manifest.json``
records what the shards were made from (each file's path, kind, text field, size and mtime;
the tokenizer's fingerprint and vocabulary); shards of another manifest are discarded, and a
source that changes while it is tokenised is refused rather than mixed into the cache. When
all shards exist they are concatenated, in file order, into the cache file (atomically), so
the cache is byte for byte the file a single pass writes, and the folder is removed. Processes
building the same cache at once (one per host, say) each tokenise the shards missing when they
start; a process whose shards were removed by one that finished first uses that one's file.

Shards are tokenised by ``min(cores, files)`` worker processes (``spawn``ed: the parent may
hold JAX's threads) when the tokenizer can be loaded again from its ``load_spec`` (the byte
tokenizer and ``tokenizer.json`` files), each with the ``tokenizers`` library's own thread
pool off, since the processes already fill the cores. Only plain values cross to a worker:
the file, the tokenizer's spec and fingerprint, the shard path.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from contextlib import suppress
from pathlib import Path

import numpy as np

from ..config.data_section import DataError
from ._encode import CACHE_FORMAT, atomic_write, empty_corpus, encode_into
from ._sources import SourceFile, iter_documents
from ._tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

SHARDED_MIN_BYTES = 64 << 20  # below this a single pass is quicker than starting workers
WORKERS: int | None = None  # worker processes; None: one per core this process may use
_COPY_BLOCK = 16 << 20
_STALE_S = 24 * 3600  # a shard folder without progress for this long belongs to an abandoned build


def use_shards(files: Sequence[SourceFile]) -> bool:
    return sum(_stat(f).st_size for f in files) >= SHARDED_MIN_BYTES


def build_sharded(path: Path, files: Sequence[SourceFile], tokenizer: Tokenizer, dtype: np.dtype) -> int:
    """Tokenise ``files`` into shards (reusing finished ones), then join them into ``path``."""
    folder = path.parent / f".shards-{path.name}"
    manifest = _manifest(files, tokenizer, dtype)
    _remove_stale(path.parent, keep=folder)
    _start(folder, manifest)
    shards = [folder / f"{i:06d}.bin" for i in range(len(files))]
    todo = [i for i, s in enumerate(shards) if not s.is_file()]
    if len(todo) < len(files):
        done = len(files) - len(todo)
        log.info("resuming the cache build of %s: %d of %d files already tokenised", path, done, len(files))
    try:
        _tokenize(todo, files, shards, tokenizer, dtype)
        if _manifest(files, tokenizer, dtype) != manifest:
            raise DataError(f"a source file changed while it was being tokenised into {str(path)!r}; run again")
        n = sum(s.stat().st_size for s in shards) // dtype.itemsize
        if n == 0:
            raise empty_corpus(files)
        with atomic_write(path) as out:
            for s in shards:
                with s.open("rb") as f:
                    shutil.copyfileobj(f, out, _COPY_BLOCK)
    except DataError:
        shutil.rmtree(folder, ignore_errors=True)  # bad input: fixing it changes the cache key, so no shard is reused
        raise
    except FileNotFoundError:
        # Another process building the same cache finished first and removed the shards: use its file.
        if not path.is_file():
            raise
        n = path.stat().st_size // dtype.itemsize
    shutil.rmtree(folder, ignore_errors=True)
    return n


def write_shard(shard: Path, src: SourceFile, tokenizer: Tokenizer, dtype: np.dtype) -> int:
    with atomic_write(shard) as f:
        return encode_into(f, iter_documents([src]), tokenizer, dtype)


def _tokenize(todo: list[int], files, shards, tokenizer: Tokenizer, dtype: np.dtype) -> None:
    # Only our own classes: a subclass may encode differently from what its spec loads.
    spec = tokenizer.load_spec if type(tokenizer) in (ByteTokenizer, HFTokenizer) else None
    workers = min(WORKERS or _cores(), len(todo))
    bar = _Progress(sum(_stat(files[i]).st_size for i in todo))
    if workers < 2 or spec is None:
        for i in todo:
            bar.done(_stat(files[i]).st_size, write_shard(shards[i], files[i], tokenizer, dtype))
        bar.close()
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(spec, tokenizer.fingerprint)
    ) as pool:
        jobs = {pool.submit(_shard_job, files[i], shards[i], dtype.name): i for i in todo}
        pending = set(jobs)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for job in finished:
                failure = job.exception()
                if failure is not None:  # a worker's error (a DataError naming its file): raised here
                    pool.shutdown(cancel_futures=True)
                    raise failure
                bar.done(_stat(files[jobs[job]]).st_size, job.result())
    bar.close()


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


_worker: dict = {}  # this worker process's tokenizer, loaded once by _init_worker


def _init_worker(spec: tuple, fingerprint: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker.update(spec=spec, fingerprint=fingerprint)
    with suppress(DataError):  # reported by the first job, where the pool can pass it on
        _worker["tokenizer"] = load_tokenizer(*spec)


def _shard_job(src: SourceFile, shard: Path, dtype_name: str) -> int:
    tokenizer = _worker.get("tokenizer") or load_tokenizer(*_worker["spec"])
    if tokenizer.fingerprint != _worker["fingerprint"]:
        raise DataError(f"the tokenizer {_worker['spec'][0]!r} changed while the cache was being built; run again")
    return write_shard(shard, src, tokenizer, np.dtype(dtype_name))


def _manifest(files: Sequence[SourceFile], tokenizer: Tokenizer, dtype: np.dtype) -> dict:
    listing = [[str(f.path), f.kind, f.text_field, _stat(f).st_size, _stat(f).st_mtime_ns] for f in files]
    return {
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer.fingerprint,
        "vocab": int(tokenizer.vocab_size),
        "dtype": dtype.name,
        "files": listing,
    }


def _start(folder: Path, manifest: dict) -> None:
    """The shard folder, holding ``manifest``: a folder made from other inputs is emptied first."""
    record = folder / "manifest.json"
    try:
        if json.loads(record.read_text("utf-8")) == manifest:
            return
    except (OSError, ValueError):
        pass
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with atomic_write(record) as f:
        f.write(json.dumps(manifest, indent=1).encode())


def _remove_stale(cache_dir: Path, keep: Path) -> None:
    cutoff = time.time() - _STALE_S
    for p in cache_dir.glob(".shards-*"):
        with suppress(OSError):
            if p != keep and p.stat().st_mtime < cutoff:
                shutil.rmtree(p)


def _stat(f: SourceFile) -> os.stat_result:
    try:
        return f.path.stat()
    except OSError as e:
        raise DataError(f"cannot read data file {str(f.path)!r}: {e.strerror}") from e


class _Progress:
    """Bytes/s and tokens/s of a build, on a terminal (``tqdm`` turns itself off elsewhere)."""

    def __init__(self, total_bytes: int):
        from tqdm import tqdm

        self.t0, self.tokens = time.perf_counter(), 0
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenising", disable=None)

    def done(self, nbytes: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.update(nbytes)
        self.bar.set_postfix(tokens_per_s=f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.3g}")

    def close(self) -> None:
        self.bar.close()
