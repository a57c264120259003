"""Writing and committing checkpoints, asynchronously, to a local directory or an object store.

Protocol of a save (``Checkpointer.save``): in the calling thread, every shard this process
owns is copied to host memory (so the caller may donate or delete its buffers at once; from
the second save on, into the previous save's buffers); a background thread then writes them and
commits. ``save_checkpoint``, which blocks until the commit, writes the shards from where they
are, without a copy. The commit:

- **Local directory**: the chunks go into ``step_<N>.tmp-<token>/`` (a shard that fills its chunk
  written as its bytes, O_DIRECT where the file system takes it, checksummed from memory as it is
  written; anything else through tensorstore, checksummed from its file) and are fsynced;
  with several processes each writes a manifest of its files and all meet at a barrier;
  process 0 writes ``commit.json`` last, fsyncs it, renames the directory to ``step_<N>`` and
  fsyncs the parent, then applies retention. A crash at any point leaves either a ``.tmp-``
  directory (ignored, removed by the next successful save) or a complete commit.
- **Object store** (no atomic rename): every data object of the save goes under
  ``step_<N>/data-<token>/`` (each chunk encoded in memory by tensorstore, checksummed, then
  uploaded through the store's kvstore driver); manifests and the barrier as above; process 0
  then writes ``step_<N>/commit.json`` last, with the checksum and size of every object. Its
  presence is the commit, and a checkpoint is trusted only when its record is present and every
  object it lists matches. A crash or a server that goes away before that leaves objects
  without a record: never trusted, warned about by auto-resume, removed by a later save. A
  re-save of a step writes under a new token, so the old commit stays whole until the new
  record replaces it (one PUT).

Nothing is ever pickled.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from named import NamedArray, is_named_array
from named.internal import distributed_client, is_tracer

from ..config import CHECKSUMS
from . import checksum
from .checksum import hash_file
from .chunks import aligned_empty, raw_chunk_ok, write_raw_chunk
from .read import latest_checkpoint
from .retention import apply_retention, fsync_dir
from .store import (
    COMMIT_FILE,
    FORMAT,
    IO_THREADS,
    CheckpointError,
    Location,
    ObjectPath,
    checkpoint_dir,
    chunk_key,
    delete_objects,
    kvstore_spec,
    list_objects,
    location,
    read_object,
    safe_relpath,
    self_digest,
    show,
    write_objects,
    zarr_spec,
)

# ---- snapshot: the tree, flattened, with host copies of this process's shards --------


@dataclasses.dataclass
class _Leaf:
    record: dict  # what goes into commit.json
    shards: list[tuple[tuple[int, ...], np.ndarray]] = dataclasses.field(default_factory=list)


class _HostBuffers:
    """Host copies of this process's shards, kept from one save to the next.

    On CPU ``np.asarray`` of a shard aliases its device buffer, which the caller may donate once
    ``save`` returns, so a save copies it. Copying into fresh memory is dominated by page faults
    (the OS zeroes and maps every page, on each save, since buffers this large are ``mmap``-ed
    and returned at ``free``); copying into the buffers of the previous save, which the writer is
    done with by then, costs a ``memcpy``. They are page-aligned (``aligned_empty``), so the writer
    sends them to the disk as they lie. Where ``np.asarray`` already transfers to new host
    memory (a GPU or TPU), nothing is kept.
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def copy(self, key: tuple[str, tuple[int, ...]], data: jax.Array) -> np.ndarray:
        host = np.asarray(data)
        if host.flags.owndata:
            return host
        buf = self._kept.get(key)
        if buf is None or buf.shape != host.shape or buf.dtype != host.dtype:
            # page-aligned: the writer sends it to the disk with O_DIRECT as it lies, no staging copy
            buf = self._kept[key] = aligned_empty(host.nbytes)[: host.nbytes].view(host.dtype).reshape(host.shape)
        np.copyto(buf, host)
        return buf

    def keep_only(self, keys: set) -> None:
        for key in set(self._kept) - keys:
            del self._kept[key]


def _snapshot(tree: Any, process_index: int, buffers: _HostBuffers | None) -> list[_Leaf]:
    """The tree's records and this process's shards on the host: copied into ``buffers``, or,
    without, the arrays themselves (``np.asarray``; the caller keeps them alive and unchanged
    until the save is committed)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named_array)
    leaves: list[_Leaf] = []
    pending: list[tuple[_Leaf, list[tuple[tuple[int, ...], jax.Array]]]] = []
    for i, (keypath, x) in enumerate(flat):
        path = jax.tree_util.keystr(keypath)
        axes = None
        if isinstance(x, NamedArray):
            axes = list(x.names)
            x = x.array
        if is_tracer(x):
            raise CheckpointError(f"leaf {show(path)} is a tracer: save checkpoints outside jit/grad")
        if isinstance(x, jax.ShapeDtypeStruct):
            raise CheckpointError(f"leaf {show(path)} is a ShapeDtypeStruct; only concrete values can be saved")
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            record = {"path": path, "kind": "array", "axes": axes, "dir": _array_dir(i, path)}
            if isinstance(x, jax.Array):
                if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                    record["key_impl"] = str(jax.random.key_impl(x))
                    record["dtype"] = str(x.dtype)
                    record["shape"] = list(x.shape)
                    x = jax.random.key_data(x)
                chunk = x.sharding.shard_shape(x.shape)
                owned = [
                    (tuple(s.start or 0 for s in sh.index), sh.data)
                    for sh in x.addressable_shards
                    if sh.replica_id == 0
                ]
            else:
                x = np.asarray(x)
                if x.dtype.hasobject:
                    raise CheckpointError(f"leaf {show(path)} is an object array; only numeric arrays can be saved")
                chunk = x.shape
                owned = [((0,) * x.ndim, x)] if process_index == 0 else []
            record.setdefault("shape", list(x.shape))
            record.setdefault("dtype", np.dtype(x.dtype).name)
            record["store_shape"] = list(x.shape)
            record["store_dtype"] = np.dtype(x.dtype).name
            record["chunk"] = [max(1, int(c)) for c in chunk]
            if 0 in x.shape:
                owned = []  # no data, so no chunk files: zarr.json alone describes it
            leaf = _Leaf(record)
            pending.append((leaf, owned))
        elif isinstance(x, (bool, int, float, str)):
            leaf = _Leaf({"path": path, "kind": "scalar", "type": type(x).__name__, "value": x})
        elif callable(x):
            # e.g. an activation function held in an equinox field: code, not state.
            leaf = _Leaf({"path": path, "kind": "opaque", "type": type(x).__name__})
        else:
            raise CheckpointError(
                f"leaf {show(path)} of type {type(x).__name__} cannot be checkpointed; "
                "make it a static field or filter it out (eqx.filter(tree, eqx.is_array))"
            )
        leaves.append(leaf)
    # Start every device-to-host copy before waiting on any of them.
    for _, owned in pending:
        for _, data in owned:
            if isinstance(data, jax.Array):
                data.copy_to_host_async()
    jobs = [(leaf, start, d) for leaf, owned in pending for start, d in owned]

    def host(job) -> np.ndarray:
        leaf, start, data = job
        if not isinstance(data, jax.Array):
            return np.array(data)
        return np.asarray(data) if buffers is None else buffers.copy((leaf.record["path"], start), data)

    # numpy copies release the GIL: copying in threads beats one memcpy stream.
    with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:
        for (leaf, start, _), copy in zip(jobs, pool.map(host, jobs)):
            leaf.shards.append((start, copy))
    if buffers is not None:
        buffers.keep_only({(leaf.record["path"], start) for leaf, start, _ in jobs})
    return leaves


def _array_dir(index: int, path: str) -> str:
    readable = re.sub(r"\['([^'\]]*)'\]|\[(\d+)\]", lambda m: "." + (m.group(1) or m.group(2)), path)
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", readable).strip("._-")[:80]
    return f"arrays/{index:05d}" + (f".{readable}" if readable else "")


# ---- writing one array ----------------------------------------------------------------


def _write_shards(spec: dict, record: dict, shards, create: bool, context: ts.Context | None = None) -> list[str]:
    """Write this process's shards of one array; return the keys written, relative to the array.

    Process 0 also creates ``zarr.json``; the others open with the metadata assumed, so no
    two processes ever write the same file.
    """
    kwargs = {"context": context} if context is not None else {}
    if create:
        arr = ts.open(spec, create=True, **kwargs).result()
    else:
        arr = ts.open(spec, open=True, create=True, assume_metadata=True, **kwargs).result()
    futures = [arr[tuple(slice(s, s + n) for s, n in zip(start, data.shape))].write(data) for start, data in shards]
    for f in futures:
        f.result()
    return (["zarr.json"] if create else []) + [chunk_key(start, record["chunk"]) for start, _ in shards]


def write_leaf(array_dir: Path, record: dict, shards: list[tuple[tuple[int, ...], np.ndarray]], create: bool) -> list:
    """Local: write one array's shards under ``array_dir``; return the files written, relative to it."""
    if not create and not shards:
        return []
    return _write_shards(zarr_spec(kvstore_spec(array_dir), record), record, shards, create)


def _encode_leaf(record: dict, shards, create: bool) -> dict[str, bytes]:
    """Object store: one array's files as bytes (tensorstore encodes them into a memory kvstore),
    so that each is hashed exactly as uploaded."""
    context = ts.Context()  # its own memory kvstore
    keys = _write_shards(zarr_spec({"driver": "memory"}, record), record, shards, create, context)
    memory = ts.KvStore.open({"driver": "memory"}, context=context).result()
    return {k: memory.read(k).result().value for k in keys}


def check_room(directory: Path, step: int, needed: int) -> None:
    """CheckpointError naming the disk and both byte counts when ``directory``'s disk has less room
    than ``needed`` (this process's shards): said before the save, not as a failed write in it."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return  # unknown: the write itself reports what fails
    if free >= needed:
        return
    mount = directory.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    raise CheckpointError(
        f"checkpoint step {step}: the disk of {directory} (mounted at {mount}) has {free:,} bytes free, and "
        f"this checkpoint needs {needed:,} bytes ({needed / 2**30:.2f} GiB; more when the old ones stay). Free "
        "space on it, lower checkpoint.keep_last, or point checkpoint.base at another disk"
    )


def _barrier(name: str, timeout_s: float) -> None:
    client = distributed_client()  # JAX's own array serialization uses the same client
    if client is None:
        raise CheckpointError("a multi-process checkpoint needs jax.distributed.initialize() first")
    client.wait_at_barrier(name, int(timeout_s * 1000))


def write_json(path: Path, obj: Any) -> None:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _commit_body(
    step: int, process_count: int, metadata: dict, leaves: list[dict], files: dict, temporary: bool
) -> dict:
    body = {
        "format": FORMAT,
        "step": step,
        "time": time.time(),
        "process_count": process_count,
        "temporary": temporary,
        "metadata": metadata,
        "leaves": leaves,
        "files": dict(sorted(files.items())),
    }
    return {**body, "commit_sha256": self_digest(body)}


@dataclasses.dataclass
class _Save:
    """One save as the background thread sees it."""

    step: int
    token: str
    leaves: list[_Leaf]
    metadata: dict
    temporary: bool
    process_index: int
    process_count: int
    keep_last: int | None
    keep_every: int | None
    barrier_timeout_s: float
    checksum: str

    @property
    def primary(self) -> bool:
        return self.process_index == 0


# ---- committing to a local directory --------------------------------------------------


def _write_checkpoint(ckdir: Path, s: _Save) -> Path:
    primary, step, token = s.primary, s.step, s.token
    tmp = ckdir / f"step_{step}.tmp-{token}"
    final = ckdir / f"step_{step}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        arrays = [leaf for leaf in s.leaves if leaf.record["kind"] == "array"]
        raw: list[tuple[str, np.ndarray]] = []  # (file, shard): whole chunks, written as their bytes
        rest: list[list] = []  # per array, the shards tensorstore writes
        for leaf in arrays:
            rec, mine = leaf.record, []
            for start, data in leaf.shards:
                if raw_chunk_ok(rec, data):
                    raw.append((f"{rec['dir']}/{chunk_key(start, rec['chunk'])}", data))
                else:
                    mine.append((start, data))
            rest.append(mine)
        with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:

            def write(leaf: _Leaf, shards: list) -> list[str]:
                # zarr.json (process 0) and the shards a raw write cannot take, through tensorstore
                rel = leaf.record["dir"]
                return [f"{rel}/{f}" for f in write_leaf(tmp / rel, leaf.record, shards, primary)]

            def write_raw(job) -> tuple[str, int]:
                rel, data = job
                path = safe_relpath(rel, tmp)
                path.parent.mkdir(parents=True, exist_ok=True)
                return write_raw_chunk(path, data, s.checksum)

            written = pool.map(write, arrays, rest)
            raw_digests = pool.map(write_raw, raw)
            rels = [rel for files in written for rel in files]
            digests = pool.map(lambda rel: hash_file(safe_relpath(rel, tmp), s.checksum, fsync=True), rels)
            files = {rel: checksum.entry(s.checksum, d, n) for rel, (d, n) in zip(rels, digests)}
            files.update({rel: checksum.entry(s.checksum, d, n) for (rel, _), (d, n) in zip(raw, raw_digests)})
        dirs = {tmp}
        for rel in files:  # every directory that gained an entry, up to tmp itself
            d = (tmp / rel).parent
            while d != tmp and d not in dirs:
                dirs.add(d)
                d = d.parent
        for d in sorted(dirs, reverse=True):
            fsync_dir(d)
        if s.process_count > 1:
            if not primary:
                write_json(tmp / f"manifest.p{s.process_index}.json", files)
                fsync_dir(tmp)
            _barrier(f"named_checkpoint/{token}/written", s.barrier_timeout_s)
        if primary:
            for p in range(1, s.process_count):
                manifest = tmp / f"manifest.p{p}.json"
                files.update(json.loads(manifest.read_text()))
                manifest.unlink()
            records = [leaf.record for leaf in s.leaves]
            write_json(tmp / COMMIT_FILE, _commit_body(step, s.process_count, s.metadata, records, files, s.temporary))
            fsync_dir(tmp)
            aside = None
            if final.exists():
                # Re-saving a step (e.g. after a resume). os.rename cannot replace a non-empty
                # directory, so the old one steps aside; a crash in this window loses step_<N>
                # but never an older checkpoint.
                aside = ckdir / f"step_{step}.replaced-{token}"
                os.rename(final, aside)
            try:
                os.rename(tmp, final)
            except BaseException:
                if aside is not None:
                    os.rename(aside, final)
                raise
            fsync_dir(ckdir)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            apply_retention(ckdir, step, s.keep_last, s.keep_every)
        if s.process_count > 1:
            _barrier(f"named_checkpoint/{token}/committed", s.barrier_timeout_s)
    except BaseException:
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# ---- committing to an object store ------------------------------------------------------


def _write_objects_checkpoint(ckdir: ObjectPath, s: _Save) -> ObjectPath:
    primary, token = s.primary, s.token
    final = ckdir / f"step_{s.step}"
    data = f"data-{token}"
    arrays = [leaf for leaf in s.leaves if leaf.record["kind"] == "array"]

    def upload(leaf: _Leaf) -> dict:
        rel = f"{data}/{leaf.record['dir']}"
        blobs = {f"{rel}/{k}": b for k, b in _encode_leaf(leaf.record, leaf.shards, primary).items()}
        write_objects(final, blobs)
        return {k: checksum.entry(s.checksum, checksum.digest(s.checksum, b), len(b)) for k, b in blobs.items()}

    files: dict = {}
    with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:
        for part in pool.map(upload, arrays):
            files.update(part)
    if s.process_count > 1:
        if not primary:
            write_objects(final, {f"{data}/manifest.p{s.process_index}.json": json.dumps(files).encode()})
        _barrier(f"named_checkpoint/{token}/written", s.barrier_timeout_s)
    if primary:
        for p in range(1, s.process_count):
            raw = read_object(final, f"{data}/manifest.p{p}.json")
            if raw is None:
                raise CheckpointError(f"{final / data}: process {p} wrote no manifest of its objects")
            files.update(json.loads(raw))
        records = [
            {**leaf.record, "dir": f"{data}/{leaf.record['dir']}"} if leaf.record["kind"] == "array" else leaf.record
            for leaf in s.leaves
        ]
        body = _commit_body(s.step, s.process_count, s.metadata, records, files, s.temporary)
        write_objects(final, {COMMIT_FILE: json.dumps(body, indent=1, sort_keys=True).encode()})
        # Objects of this step the new record does not list: manifests, an older commit's data,
        # or a crashed save's.
        stale = [k for k in list_objects(final) if k != COMMIT_FILE and k not in files]
        delete_objects(final, stale)
        apply_retention(ckdir, s.step, s.keep_last, s.keep_every)
    if s.process_count > 1:
        _barrier(f"named_checkpoint/{token}/committed", s.barrier_timeout_s)
    return final


# ---- the asynchronous writer --------------------------------------------------------


class Checkpointer:
    """Writes checkpoints of one run asynchronously; one save in flight at a time.

    Args:
        run_dir: the run directory, or an object-store prefix (``s3://bucket/prefix``,
            ``gs://bucket/prefix``); checkpoints go to ``<run_dir>/<subdir>/step_<N>``.
        keep_last: keep the newest ``keep_last`` permanent checkpoints up to the step just
            saved (None keeps all); checkpoints of later steps are left alone.
        keep_every: also keep every step divisible by ``keep_every`` (None: no such rule).
        subdir: relative path of the checkpoint directory inside ``run_dir``.
        barrier_timeout_s: with several processes, how long one waits for the others.
        checksum: the check each file carries in the commit record, ``"crc32c"`` (the default)
            or ``"sha256"`` (``checkpoint.checksum``); a restore checks whichever a file carries.

    ``save`` returns once this process's shards are in host memory; ``wait`` blocks until
    the commit. An error in the background is raised (as CheckpointError) by the next
    ``save``, ``wait`` or ``close``. All processes must call ``save`` with the same steps.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike | ObjectPath,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        subdir: str = "checkpoints",
        barrier_timeout_s: float = 600.0,
        checksum: str = checksum.DEFAULT,
    ):
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1 or None, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise CheckpointError(f"keep_every must be >= 1 or None, got {keep_every}")
        self.run_dir: Location = location(run_dir)
        self.subdir = subdir
        self.directory: Location = checkpoint_dir(self.run_dir, subdir)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.barrier_timeout_s = barrier_timeout_s
        if checksum not in CHECKSUMS:
            raise CheckpointError(f"checksum must be one of {', '.join(CHECKSUMS)}, got {checksum!r}")
        self.checksum = checksum
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._last: Location | None = None
        self._saves = 0
        self._buffers = _HostBuffers()

    def save(self, step: int, tree: Any, metadata: dict | None = None, *, temporary: bool = False) -> None:
        """Snapshot ``tree`` to host memory and commit it as ``step_<step>`` in the background.
        A ``temporary`` checkpoint is deleted once a newer one commits (checkpoint.retention).
        The host copies are kept for the next save of the same layout (host memory the size of
        this process's shards, held while the Checkpointer lives)."""
        self._start(step, tree, metadata, temporary, self._buffers)

    def _start(
        self, step: int, tree: Any, metadata: dict | None, temporary: bool, buffers: _HostBuffers | None
    ) -> None:
        self.wait()
        step = int(step)
        if step < 0:
            raise CheckpointError(f"step must be >= 0, got {step}")
        metadata = {} if metadata is None else metadata
        try:
            metadata = json.loads(json.dumps(metadata))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint metadata must be JSON-serialisable: {e}") from None
        pid, nproc = jax.process_index(), jax.process_count()
        leaves = _snapshot(tree, pid, buffers)
        token = self._agree_token(pid, nproc)
        if isinstance(self.directory, Path):
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CheckpointError(
                    f"cannot create the checkpoint directory {self.directory}: {e.strerror or e}"
                ) from None
            check_room(self.directory, step, sum(d.nbytes for leaf in leaves for _, d in leaf.shards))
        job = _Save(
            step,
            token,
            leaves,
            metadata,
            bool(temporary),
            pid,
            nproc,
            self.keep_last,
            self.keep_every,
            self.barrier_timeout_s,
            self.checksum,
        )
        write = _write_objects_checkpoint if isinstance(self.directory, ObjectPath) else _write_checkpoint

        def run():
            try:
                self._last = write(self.directory, job)
            except BaseException as e:  # surfaced by the next call
                self._error = (step, e)

        # Not a daemon: an interpreter that exits normally finishes the last commit first.
        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}")
        self._thread.start()

    def _agree_token(self, pid: int, nproc: int) -> str:
        self._saves += 1
        token = uuid.uuid4().hex[:12]
        if nproc == 1:
            return token
        client = distributed_client()
        if client is None:
            raise CheckpointError("a multi-process checkpoint needs jax.distributed.initialize() first")
        key = f"named_checkpoint/{hashlib.sha1(str(self.directory).encode()).hexdigest()[:8]}/{self._saves}"
        if pid == 0:
            client.key_value_set(key, token)
            return token
        return client.blocking_key_value_get(key, int(self.barrier_timeout_s * 1000))

    def wait(self) -> Location | None:
        """Block until the save in flight is committed; return the newest committed path."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            step, err = self._error
            self._error = None
            raise CheckpointError(f"saving checkpoint step {step} to {self.directory} failed: {err}") from err
        return self._last

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self._thread is not None:
            self._thread.join()

    def latest(self) -> Location | None:
        """The newest verified checkpoint of this run (after the save in flight, if any)."""
        self.wait()
        return latest_checkpoint(self.run_dir, subdir=self.subdir)


def save_checkpoint(
    run_dir: str | os.PathLike | ObjectPath, step: int, tree: Any, metadata: dict | None = None, **kwargs
) -> Location:
    """Save synchronously (a Checkpointer's save + wait); kwargs as for Checkpointer.

    The arrays are written from where they are, without a host copy: nothing may delete or
    donate them (from another thread) before this returns."""
    ckpt = Checkpointer(run_dir, **kwargs)
    ckpt._start(step, tree, metadata, False, None)
    path = ckpt.wait()
    if path is None:  # wait() names a failed save itself; None means nothing was saved
        raise CheckpointError(f"no checkpoint of step {step} was committed under {run_dir}")
    return path
