"""Large cache builds: the corpus cut into pieces, each tokenised into a shard by a worker, resumably.

A corpus of at least ``SHARDED_MIN_BYTES`` is cut into *pieces*: a whole file each, except that a Parquet file larger
than ``PIECE_BYTES`` is cut at row-group boundaries into runs of about that many bytes. Piece
``i`` is tokenised into shard ``i`` of a hidden folder beside the cache file
(``.shards-<cache file name>/``), written atomically, so a build that is killed keeps every
finished shard, and the next run with the same inputs tokenises only the missing ones. The
folder's ``manifest.json`` records what the shards were made from (each file's path, kind, text
field, size and mtime; the pieces; the tokenizer's fingerprint and vocabulary); shards of another
manifest are discarded, and a source that changes while it is tokenised is refused rather than
mixed into the cache. When all shards exist they are concatenated, in order, into the cache file
(atomically), so the cache is byte for byte the file a single pass writes, whoever tokenised the
pieces, and the folder is removed. Processes building the same cache at once (one per host, say)
each tokenise the shards missing when they start; a process whose shards were removed by one that
finished first uses that one's file; a process told its place among them (``LocalShards``)
starts with its own share of the pieces, so that hosts split the work.

Here, shards are tokenised by ``min(cores, pieces)`` worker processes (``spawn``ed: the parent may
hold JAX's threads) when the tokenizer can be loaded again from its ``load_spec`` (the byte
tokenizer and ``tokenizer.json`` files), each with the ``tokenizers`` library's own thread
pool off, since the processes already fill the cores. Only plain values cross to a worker:
the piece, the tokenizer's spec and fingerprint, the shard path. A *runner* (``ShardRunner``)
tokenises them elsewhere instead (a Ray cluster: ``_ray``), with the same ``write_shard``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from named.internal import process_cpu_count

from ..config.data_section import DataError
from ._columnar import documents, row_group_bytes
from ._encode import CACHE_FORMAT, atomic_write, empty_corpus, encode_into
from ._leftovers import remove_abandoned, working_in
from ._sources import SourceFile, iter_documents
from ._tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

SHARDED_MIN_BYTES = 64 << 20  # below this a single pass is quicker than starting workers
PIECE_BYTES = 128 << 20  # a Parquet file larger than this is tokenised in runs of row groups of about this size
WORKERS: int | None = None  # worker processes; None: one per core this process may use
LOG_EVERY_S = 30.0  # a progress line in the log at most this often (the bar is for terminals only)
_COPY_BLOCK = 16 << 20


@dataclass(frozen=True)
class Piece:
    """What one shard holds: a whole file, or row groups ``[first, stop)`` of a Parquet file."""

    src: SourceFile
    nbytes: int  # the file's size, or the row groups' compressed size: the progress made by tokenising it
    row_groups: tuple[int, int] | None = None

    def documents(self) -> Iterator[tuple[str, str]]:
        if self.row_groups is None:
            return iter_documents([self.src])
        return documents(self.src.path, "parquet", self.src.text_field, range(*self.row_groups), self.src.shown)

    def __str__(self) -> str:
        groups = f" (row groups {self.row_groups[0]}-{self.row_groups[1] - 1})" if self.row_groups else ""
        return f"{self.src.path}{groups}"


class ShardRunner(Protocol):
    """Tokenises pieces into shards, ``write_shard(shard, piece, tokenizer, dtype)`` each, in any
    order, calling ``progress.done(piece.nbytes, tokens)`` as each is written; raises the
    first failure (a DataError naming its file as it is)."""

    def __call__(
        self, jobs: Sequence[tuple[Piece, Path]], tokenizer: Tokenizer, dtype: np.dtype, progress: Progress
    ) -> None: ...


def use_shards(files: Sequence[SourceFile]) -> bool:
    return sum(_stat(f).st_size for f in files) >= SHARDED_MIN_BYTES


def pieces(files: Sequence[SourceFile]) -> list[Piece]:
    """The pieces of ``files``, in order: a whole file each, a large Parquet file cut into runs of
    row groups of about ``PIECE_BYTES`` (read from its footer)."""
    out = []
    for f in files:
        size = _stat(f).st_size
        groups = row_group_bytes(f.path) if f.kind == "parquet" and size > PIECE_BYTES else []
        if len(groups) < 2:
            out.append(Piece(f, size))
            continue
        first, run = 0, 0
        for g, n in enumerate(groups):
            run += n
            if run >= PIECE_BYTES or g == len(groups) - 1:
                out.append(Piece(f, run, (first, g + 1)))
                first, run = g + 1, 0
    return out


def build_sharded(
    path: Path, files: Sequence[SourceFile], tokenizer: Tokenizer, dtype: np.dtype, runner: ShardRunner | None = None
) -> int:
    """Tokenise the pieces of ``files`` into shards (reusing finished ones) with ``runner`` (by
    default this machine's worker processes), then join them into ``path``."""
    folder = path.parent / f".shards-{path.name}"
    work = pieces(files)
    manifest = _manifest(files, work, tokenizer, dtype)
    remove_abandoned(
        (p for p in path.parent.glob(".shards-*") if p != folder and p.is_dir()), "a cache build"
    )  # an earlier build, killed, perhaps of another key: nobody finishes it
    with working_in(folder, lambda: _start(folder, manifest)):
        if path.is_file():  # another process building the same cache finished while this one started
            shutil.rmtree(folder, ignore_errors=True)
            return path.stat().st_size // dtype.itemsize
        return _build(path, folder, files, work, manifest, tokenizer, dtype, runner)


def _build(path, folder, files, work, manifest, tokenizer, dtype, runner) -> int:
    shards = [folder / f"{i:06d}.bin" for i in range(len(work))]
    todo = [i for i, s in enumerate(shards) if not s.is_file()]
    if len(todo) < len(work):
        log.info(
            "resuming the cache build of %s: %d of %d pieces already tokenised", path, len(work) - len(todo), len(work)
        )
    try:
        progress = Progress(sum(work[i].nbytes for i in todo), len(todo))
        (runner or LocalShards())([(work[i], shards[i]) for i in todo], tokenizer, dtype, progress)
        progress.close()
        if _manifest(files, work, tokenizer, dtype) != manifest:
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


def write_shard(shard: Path, piece: Piece, tokenizer: Tokenizer, dtype: np.dtype) -> int:
    """``piece`` tokenised into ``shard``, unless another builder of the same cache wrote it first."""
    if shard.is_file():
        return shard.stat().st_size // dtype.itemsize
    with atomic_write(shard) as f:
        return encode_into(f, piece.documents(), tokenizer, dtype)


class LocalShards:
    """The default runner, this machine's cores, for one of ``process_count`` processes (hosts)
    that build one shared cache at once: process ``p`` tokenises its own share of the pieces
    (``p, p + n, p + 2n, ...``) first, then the others' from the last one back, skipping every
    shard another process wrote meanwhile. So the hosts split the work while all are alive, and
    a host that dies or starts late leaves no piece undone."""

    def __init__(self, process_index: int = 0, process_count: int = 1):
        if process_count < 1 or not 0 <= process_index < process_count:
            raise DataError(f"process_index {process_index} is not in [0, process_count={process_count})")
        self.process_index, self.process_count = process_index, process_count

    def __call__(
        self, jobs: Sequence[tuple[Piece, Path]], tokenizer: Tokenizer, dtype: np.dtype, progress: Progress
    ) -> None:
        mine = [j for j in jobs if int(j[1].stem) % self.process_count == self.process_index]
        others = [j for j in jobs if int(j[1].stem) % self.process_count != self.process_index]
        tokenize_pieces([*mine, *others[::-1]], tokenizer, dtype, progress)


def tokenize_pieces(
    jobs: Sequence[tuple[Piece, Path]], tokenizer: Tokenizer, dtype: np.dtype, progress: Progress
) -> None:
    """This machine's cores, the pieces in the order given (the pool starts them in that order)."""
    # Only our own classes: a subclass may encode differently from what its spec loads.
    spec = tokenizer.load_spec if type(tokenizer) in (ByteTokenizer, HFTokenizer) else None
    workers = min(WORKERS or process_cpu_count(), len(jobs))
    if workers < 2 or spec is None:
        for piece, shard in jobs:
            progress.done(piece.nbytes, write_shard(shard, piece, tokenizer, dtype))
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(spec, tokenizer.fingerprint)
    ) as pool:
        futures = {pool.submit(_shard_job, piece, shard, dtype.name): piece for piece, shard in jobs}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for job in finished:
                failure = job.exception()
                if failure is not None:  # a worker's error (a DataError naming its file): raised here
                    pool.shutdown(cancel_futures=True)
                    raise failure
                progress.done(futures[job].nbytes, job.result())


_worker: dict = {}  # this worker process's tokenizer, loaded once by _init_worker


def _init_worker(spec: tuple, fingerprint: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker.update(spec=spec, fingerprint=fingerprint)
    with suppress(DataError):  # reported by the first job, where the pool can pass it on
        _worker["tokenizer"] = load_tokenizer(*spec)


def _shard_job(piece: Piece, shard: Path, dtype_name: str) -> int:
    tokenizer = _worker.get("tokenizer") or load_tokenizer(*_worker["spec"])
    if tokenizer.fingerprint != _worker["fingerprint"]:
        raise DataError(f"the tokenizer {_worker['spec'][0]!r} changed while the cache was being built; run again")
    return write_shard(shard, piece, tokenizer, np.dtype(dtype_name))


def _manifest(files: Sequence[SourceFile], work: Sequence[Piece], tokenizer: Tokenizer, dtype: np.dtype) -> dict:
    listing = [[str(f.path), f.kind, f.text_field, _stat(f).st_size, _stat(f).st_mtime_ns] for f in files]
    return {
        "format": CACHE_FORMAT,
        "tokenizer": tokenizer.fingerprint,
        "vocab": int(tokenizer.vocab_size),
        "dtype": dtype.name,
        "files": listing,
        "pieces": [[str(p.src.path), *(p.row_groups or ())] for p in work],
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
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_write(record) as f:
        f.write(json.dumps(manifest, indent=1).encode())


def _stat(f: SourceFile) -> os.stat_result:
    try:
        return f.path.stat()
    except OSError as e:
        raise DataError(f"cannot read data file {str(f.path)!r}: {e.strerror}") from e


class Progress:
    """Bytes/s and tokens/s of a build: a bar on a terminal (``tqdm`` turns itself off elsewhere),
    and a log line at most every ``LOG_EVERY_S`` seconds and at the end (a cluster job's log)."""

    def __init__(self, total_bytes: int, pieces: int):
        from tqdm import tqdm

        self.total_bytes, self.pieces = total_bytes, pieces
        self.t0 = self.logged = time.perf_counter()
        self.tokens = self.nbytes = self.finished = 0
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenising", disable=None)

    def done(self, nbytes: int, tokens: int) -> None:
        self.tokens, self.nbytes, self.finished = self.tokens + tokens, self.nbytes + nbytes, self.finished + 1
        self.bar.update(nbytes)
        self.bar.set_postfix(tokens_per_s=f"{self._rate():.3g}")
        if time.perf_counter() - self.logged >= LOG_EVERY_S:
            self._log()

    def close(self) -> None:
        self.bar.close()
        if self.pieces:
            self._log()

    def _rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def _log(self) -> None:
        self.logged = time.perf_counter()
        log.info(
            "tokenised %d of %d pieces (%.1f of %.1f MB), %d tokens, %.3g tokens/s",
            self.finished,
            self.pieces,
            self.nbytes / 1e6,
            self.total_bytes / 1e6,
            self.tokens,
            self._rate(),
        )
