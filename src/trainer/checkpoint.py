"""Checkpoints: asynchronous, atomically committed, checksummed, restorable onto any mesh.

Layout of one checkpoint, ``<run_dir>/checkpoints/step_<N>/``::

    arrays/00000.model.embed.weight/zarr.json     one zarr v3 array per array leaf
    arrays/00000.model.embed.weight/c/3/0         one chunk file per saved shard
    ...
    commit.json                                   written last; its presence is the commit

``commit.json`` holds the format tag, the step, the user's JSON metadata (data position,
RNG key data, config, ...), every leaf of the tree in flatten order (its key path, and
for arrays the directory, shape, dtype, chunk shape and NamedArray axis names; Python
scalars are stored inline), the sha256 and size of every file of the checkpoint, and a
sha256 of its own content.

Why zarr v3 with one chunk per shard, and not OCDBT: a chunk is then exactly one shard
of the saving mesh, so every file is written by exactly one process (the owner of the
shard with ``replica_id == 0``), that process can checksum and fsync exactly the files
it wrote, and a corrupted file is named precisely (leaf and chunk). OCDBT packs many
arrays into shared data files and, across processes, needs either a coordinator server
or a per-process database plus a merge step, and its files cannot be attributed to a
leaf. The price is one file per shard and leaf, fine at the scales this project runs.
Chunks are stored uncompressed: float weights barely compress and the CPU time is
better spent on the step. We write with tensorstore directly rather than through
``jax.experimental.array_serialization`` because the commit protocol (per-file
checksums, rename, retention) is ours, and that module's commit machinery would have
to be worked around rather than used.

Protocol of a save (``Checkpointer.save``): in the calling thread, every shard this
process owns is copied to host memory (so the caller may donate or delete its buffers
at once); a background thread then writes the chunks into ``step_<N>.tmp-<token>/``,
hashes and fsyncs them; with several processes each writes a manifest of its files and
all meet at a barrier; process 0 writes ``commit.json`` last, fsyncs it, renames the
directory to ``step_<N>`` and fsyncs the parent, then applies retention. A crash at any
point leaves either a ``.tmp-`` directory (ignored, removed by the next successful save)
or a complete commit. Nothing is ever pickled.

Retention looks only at checkpoints up to the step being saved: ``keep_last`` counts those,
and a checkpoint of a later step is never counted nor deleted. Those can only be left by an
earlier launch that got further (the trainer refuses to resume behind a good one, see
``rundir``), and counting them would make a run prune its own newest checkpoints.

Reading: ``latest_checkpoint`` (what ``load_checkpoint auto`` uses) verifies size and sha256
of every file of the newest commit and falls back, with a CheckpointWarning naming the bad
file, to the previous one. ``restore`` of an explicit ``step_<N>`` checks every file's size
and hashes the files this process reads, and raises CheckpointError naming a bad one. The
target tree gives each leaf's shape, dtype and sharding; every process reads only the
regions its own devices hold, so a checkpoint saved on 8 devices restores onto a 4x2 mesh,
one device, or another number of processes.
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
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from named import NamedArray, NamedError, is_named_array

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "Checkpointer",
    "check_restorable",
    "checkpoint_dir",
    "latest_checkpoint",
    "list_checkpoints",
    "read_commit",
    "restore",
    "save_checkpoint",
    "verify_checkpoint",
]

FORMAT = "named-checkpoint/1"
COMMIT_FILE = "commit.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_LEFTOVER_DIR = re.compile(r"^step_\d+\.(tmp|deleting|replaced)-[0-9a-f]+$")
_SCALAR_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
_IO_THREADS = min(16, (os.cpu_count() or 4))


class CheckpointError(NamedError, RuntimeError):
    """A checkpoint cannot be written, found, verified or matched to the target tree."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupted or truncated) and an older one is used instead."""


# ---- paths ----------------------------------------------------------------------------


def checkpoint_dir(run_dir: str | os.PathLike, subdir: str = "checkpoints") -> Path:
    """``<run_dir>/<subdir>``, refusing a ``subdir`` that is absolute, has ``..`` or leads
    (through a symlink) outside ``run_dir``."""
    sub = Path(subdir)
    if sub.is_absolute() or ".." in sub.parts or not sub.parts:
        raise CheckpointError(
            f"checkpoint subdir {subdir!r} must be a relative path inside the run directory, without '..'"
        )
    run = Path(run_dir)
    out = run / sub
    if not out.resolve().is_relative_to(run.resolve()):
        raise CheckpointError(
            f"checkpoint dir {out} resolves to {out.resolve()}, outside the run directory {run.resolve()}"
        )
    return out


def _safe_relpath(rel: str, root: Path) -> Path:
    # File names come from commit.json, which is data: never let it point outside.
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise CheckpointError(f"{root / COMMIT_FILE}: refuses file path {rel!r} that leaves the checkpoint directory")
    return root / p


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path, fsync: bool = False) -> tuple[str, int]:
    with open(path, "rb", buffering=0) as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        size = f.tell()
        if fsync:
            os.fsync(f.fileno())
    return digest, size


def _write_json(path: Path, obj: Any) -> None:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _self_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---- snapshot: the tree, flattened, with host copies of this process's shards --------


@dataclasses.dataclass
class _Leaf:
    record: dict  # what goes into commit.json
    shards: list[tuple[tuple[int, ...], np.ndarray]] = dataclasses.field(default_factory=list)


def _show(path: str) -> str:
    return repr(path) if path else "(the root)"


def _host_copy(data: jax.Array) -> np.ndarray:
    host = np.asarray(data)
    # On CPU np.asarray aliases the device buffer; the caller may donate it right after save().
    return host.copy() if not host.flags.owndata else host


def _snapshot(tree: Any, process_index: int) -> list[_Leaf]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_named_array)
    leaves: list[_Leaf] = []
    pending: list[tuple[_Leaf, list[tuple[tuple[int, ...], jax.Array]]]] = []
    for i, (keypath, x) in enumerate(flat):
        path = jax.tree_util.keystr(keypath)
        axes = None
        if isinstance(x, NamedArray):
            axes = list(x.names)
            x = x.array
        if isinstance(x, jax.core.Tracer):
            raise CheckpointError(f"leaf {_show(path)} is a tracer: save checkpoints outside jit/grad")
        if isinstance(x, jax.ShapeDtypeStruct):
            raise CheckpointError(f"leaf {_show(path)} is a ShapeDtypeStruct; only concrete values can be saved")
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
                    (tuple(s.start or 0 for s in sh.index), sh.data) for sh in x.addressable_shards if sh.replica_id == 0
                ]
            else:
                x = np.asarray(x)
                if x.dtype.hasobject:
                    raise CheckpointError(f"leaf {_show(path)} is an object array; only numeric arrays can be saved")
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
                f"leaf {_show(path)} of type {type(x).__name__} cannot be checkpointed; "
                "make it a static field or filter it out (eqx.filter(tree, eqx.is_array))"
            )
        leaves.append(leaf)
    # Start every device-to-host copy before waiting on any of them.
    for _, owned in pending:
        for _, data in owned:
            if isinstance(data, jax.Array):
                data.copy_to_host_async()
    # numpy copies release the GIL: copying in threads beats one memcpy stream (page faults).
    jobs = [(leaf, start, d) for leaf, owned in pending for start, d in owned]
    with concurrent.futures.ThreadPoolExecutor(_IO_THREADS) as pool:
        copies = pool.map(lambda d: _host_copy(d) if isinstance(d, jax.Array) else np.array(d), [d for _, _, d in jobs])
        for (leaf, start, _), host in zip(jobs, copies):
            leaf.shards.append((start, host))
    return leaves


def _array_dir(index: int, path: str) -> str:
    readable = re.sub(r"\['([^'\]]*)'\]|\[(\d+)\]", lambda m: "." + (m.group(1) or m.group(2)), path)
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", readable).strip("._-")[:80]
    return f"arrays/{index:05d}" + (f".{readable}" if readable else "")


def _chunk_key(start: tuple[int, ...], chunk: list[int]) -> str:
    return "/".join(["c", *(str(s // c) for s, c in zip(start, chunk))])


# ---- writing ------------------------------------------------------------------------


def _zarr_spec(path: Path, record: dict | None = None) -> dict:
    spec: dict = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    if record is not None:
        spec["metadata"] = {
            "shape": record["store_shape"],
            "data_type": record["store_dtype"],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": record["chunk"]}},
        }
        # Without this, chunks equal to the fill value (all-zero moments) are not written,
        # and "every listed file exists" could not be the integrity rule.
        spec["store_data_equal_to_fill_value"] = True
    return spec


def _write_leaf(array_dir: Path, record: dict, shards: list[tuple[tuple[int, ...], np.ndarray]], create: bool) -> list:
    """Write this process's shards of one array; return the files written, relative to ``array_dir``.

    Process 0 also creates ``zarr.json``; the others open with the metadata assumed, so no
    two processes ever write the same file.
    """
    spec = _zarr_spec(array_dir, record)
    if create:
        arr = ts.open(spec, create=True).result()
    else:
        arr = ts.open(spec, open=True, create=True, assume_metadata=True).result()
    futures = [arr[tuple(slice(s, s + n) for s, n in zip(start, data.shape))].write(data) for start, data in shards]
    for f in futures:
        f.result()
    files = [_chunk_key(start, record["chunk"]) for start, _ in shards]
    return (["zarr.json"] if create else []) + files


def _barrier(name: str, timeout_s: float) -> None:
    from jax._src import distributed  # JAX's own array serialization uses the same client

    client = distributed.global_state.client
    if client is None:
        raise CheckpointError("a multi-process checkpoint needs jax.distributed.initialize() first")
    client.wait_at_barrier(name, int(timeout_s * 1000))


def _write_checkpoint(
    ckdir: Path,
    step: int,
    token: str,
    leaves: list[_Leaf],
    metadata: dict,
    *,
    process_index: int,
    process_count: int,
    keep_last: int | None,
    keep_every: int | None,
    barrier_timeout_s: float,
) -> Path:
    primary = process_index == 0
    tmp = ckdir / f"step_{step}.tmp-{token}"
    final = ckdir / f"step_{step}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        _test_pause()
        arrays = [leaf for leaf in leaves if leaf.record["kind"] == "array"]
        with concurrent.futures.ThreadPoolExecutor(_IO_THREADS) as pool:
            def write(leaf: _Leaf) -> list[str]:
                rel = leaf.record["dir"]
                return [f"{rel}/{f}" for f in _write_leaf(tmp / rel, leaf.record, leaf.shards, primary)]

            written = pool.map(write, arrays)
            rels = [rel for files in written for rel in files]
            digests = pool.map(lambda rel: _hash_file(_safe_relpath(rel, tmp), fsync=True), rels)
            files = {rel: {"sha256": d, "size": n} for rel, (d, n) in zip(rels, digests)}
        dirs = {tmp}
        for rel in files:  # every directory that gained an entry, up to tmp itself
            d = (tmp / rel).parent
            while d != tmp and d not in dirs:
                dirs.add(d)
                d = d.parent
        for d in sorted(dirs, reverse=True):
            _fsync_dir(d)
        _test_pause()
        if process_count > 1:
            if not primary:
                _write_json(tmp / f"manifest.p{process_index}.json", files)
                _fsync_dir(tmp)
            _barrier(f"named_checkpoint/{token}/written", barrier_timeout_s)
        if primary:
            for p in range(1, process_count):
                manifest = tmp / f"manifest.p{p}.json"
                files.update(json.loads(manifest.read_text()))
                manifest.unlink()
            body = {
                "format": FORMAT,
                "step": step,
                "time": time.time(),
                "process_count": process_count,
                "metadata": metadata,
                "leaves": [leaf.record for leaf in leaves],
                "files": dict(sorted(files.items())),
            }
            _write_json(tmp / COMMIT_FILE, {**body, "commit_sha256": _self_digest(body)})
            _fsync_dir(tmp)
            _test_pause()
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
            _fsync_dir(ckdir)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            _apply_retention(ckdir, step, keep_last, keep_every)
        if process_count > 1:
            _barrier(f"named_checkpoint/{token}/committed", barrier_timeout_s)
    except BaseException:
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _test_pause() -> None:
    # Test hook, off unless set: NAMED_TEST_CHECKPOINT_WRITE_DELAY=<seconds> makes the
    # background writer sleep that long at three points of a save (empty temp dir; chunks
    # written but no commit.json; commit.json written but not renamed), so that
    # tests/test_kill_resume.py can SIGKILL a run inside the write window on purpose.
    delay = os.environ.get("NAMED_TEST_CHECKPOINT_WRITE_DELAY")
    if delay:
        time.sleep(float(delay))


def _apply_retention(ckdir: Path, newest: int, keep_last: int | None, keep_every: int | None) -> None:
    steps = [s for s, _ in list_checkpoints(ckdir.parent, subdir=ckdir.name) if s <= newest]
    keep = {newest}
    if keep_last is None:
        keep.update(steps)
    else:
        keep.update(sorted(steps)[-keep_last:])
    if keep_every:
        keep.update(s for s in steps if s % keep_every == 0)
    for s in steps:
        if s < newest and s not in keep:
            doomed = ckdir / f"step_{s}.deleting-{uuid.uuid4().hex[:12]}"
            os.rename(ckdir / f"step_{s}", doomed)  # atomic: never a half-deleted step_<s>
            shutil.rmtree(doomed, ignore_errors=True)
    for entry in ckdir.iterdir():  # leftovers of crashed saves and deletions
        if _LEFTOVER_DIR.match(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
    _fsync_dir(ckdir)


# ---- the asynchronous writer --------------------------------------------------------


class Checkpointer:
    """Writes checkpoints of one run asynchronously; one save in flight at a time.

    Args:
        run_dir: the run directory; checkpoints go to ``<run_dir>/<subdir>/step_<N>``.
        keep_last: keep the newest ``keep_last`` checkpoints up to the step just saved (None
            keeps all); checkpoints of later steps are left alone.
        keep_every: also keep every step divisible by ``keep_every`` (None: no such rule).
        subdir: relative path of the checkpoint directory inside ``run_dir``.
        barrier_timeout_s: with several processes, how long one waits for the others.

    ``save`` returns once this process's shards are in host memory; ``wait`` blocks until
    the commit. An error in the background is raised (as CheckpointError) by the next
    ``save``, ``wait`` or ``close``. All processes must call ``save`` with the same steps.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        subdir: str = "checkpoints",
        barrier_timeout_s: float = 600.0,
    ):
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1 or None, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise CheckpointError(f"keep_every must be >= 1 or None, got {keep_every}")
        self.run_dir = Path(run_dir)
        self.directory = checkpoint_dir(run_dir, subdir)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.barrier_timeout_s = barrier_timeout_s
        self._thread: threading.Thread | None = None
        self._error: tuple[int, BaseException] | None = None
        self._last: Path | None = None
        self._saves = 0

    def save(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        """Snapshot ``tree`` to host memory and commit it as ``step_<step>`` in the background."""
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
        leaves = _snapshot(tree, pid)
        token = self._agree_token(pid, nproc)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint directory {self.directory}: {e.strerror or e}") from None

        def run():
            try:
                self._last = _write_checkpoint(
                    self.directory,
                    step,
                    token,
                    leaves,
                    metadata,
                    process_index=pid,
                    process_count=nproc,
                    keep_last=self.keep_last,
                    keep_every=self.keep_every,
                    barrier_timeout_s=self.barrier_timeout_s,
                )
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
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise CheckpointError("a multi-process checkpoint needs jax.distributed.initialize() first")
        key = f"named_checkpoint/{hashlib.sha1(str(self.directory).encode()).hexdigest()[:8]}/{self._saves}"
        if pid == 0:
            client.key_value_set(key, token)
            return token
        return client.blocking_key_value_get(key, int(self.barrier_timeout_s * 1000))

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Path | None:
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

    def latest(self) -> Path | None:
        """The newest verified checkpoint of this run (after the save in flight, if any)."""
        self.wait()
        return latest_checkpoint(self.directory.parent, subdir=self.directory.name)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restore ``step`` (or the newest verified checkpoint) onto ``target``'s layout."""
        self.wait()
        if step is None:
            return restore(self.run_dir, target, subdir=str(self.directory.relative_to(self.run_dir)))
        return restore(self.directory / f"step_{int(step)}", target)


def save_checkpoint(run_dir: str | os.PathLike, step: int, tree: Any, metadata: dict | None = None, **kwargs) -> Path:
    """Save synchronously (a Checkpointer's save + wait); kwargs as for Checkpointer."""
    ckpt = Checkpointer(run_dir, **kwargs)
    ckpt.save(step, tree, metadata)
    path = ckpt.wait()
    if path is None:  # wait() names a failed save itself; None means nothing was saved
        raise CheckpointError(f"no checkpoint of step {step} was committed under {run_dir}")
    return path


# ---- finding and verifying ----------------------------------------------------------


def list_checkpoints(run_dir: str | os.PathLike, *, subdir: str = "checkpoints") -> list[tuple[int, Path]]:
    """``(step, path)`` of every directory with a commit.json, oldest first; not verified."""
    ckdir = checkpoint_dir(run_dir, subdir)
    if not ckdir.is_dir():
        return []
    out = []
    for entry in ckdir.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and not entry.is_symlink() and (entry / COMMIT_FILE).is_file():
            out.append((int(m.group(1)), entry))
    return sorted(out)


def read_commit(path: str | os.PathLike) -> dict:
    """The commit record of a checkpoint (its own sha256 checked; the files are not read)."""
    return _read_commit(Path(path))


def _read_commit(path: Path) -> dict:
    commit_path = path / COMMIT_FILE
    if not commit_path.is_file():
        raise CheckpointError(f"{path} has no {COMMIT_FILE}: it is not a committed checkpoint")
    try:
        commit = json.loads(commit_path.read_bytes())
        body = {k: v for k, v in commit.items() if k != "commit_sha256"}
        ok = commit.get("commit_sha256") == _self_digest(body)
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{commit_path} is not valid JSON ({e}): the checkpoint is corrupted") from None
    if not ok:
        raise CheckpointError(f"{commit_path}: content does not match its commit_sha256: the checkpoint is corrupted")
    if commit.get("format") != FORMAT:
        raise CheckpointError(f"{commit_path}: unknown format {commit.get('format')!r}, expected {FORMAT!r}")
    return commit


def _verify_files(path: Path, commit: dict, hash_only: set[str] | None = None) -> None:
    """Every listed file exists with its size; hashes all of them, or only ``hash_only``."""
    files = commit["files"]
    to_hash = []
    for rel, info in files.items():
        full = _safe_relpath(rel, path)
        try:
            size = full.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {path}: file {full} is missing") from None
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint {path}: file {full} has {size} bytes, the commit says {info['size']} (truncated?)"
            )
        if hash_only is None or rel in hash_only:
            to_hash.append(rel)
    with concurrent.futures.ThreadPoolExecutor(_IO_THREADS) as pool:
        for rel, (digest, _) in zip(to_hash, pool.map(lambda r: _hash_file(path / r), to_hash)):
            if digest != files[rel]["sha256"]:
                raise CheckpointError(f"checkpoint {path}: checksum mismatch in file {path / rel} (corrupted)")


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check commit.json and the size and sha256 of every file; return the commit record."""
    path = Path(path)
    commit = _read_commit(path)
    _verify_files(path, commit)
    return commit


def _latest(ckdir_parent: Path, subdir: str) -> tuple[Path, dict] | None:
    skipped = []
    for _, path in reversed(list_checkpoints(ckdir_parent, subdir=subdir)):
        try:
            commit = verify_checkpoint(path)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        if skipped:
            warnings.warn(f"skipped unusable checkpoint(s): {'; '.join(skipped)}; using {path}", CheckpointWarning, 3)
        return path, commit
    if skipped:
        warnings.warn(f"skipped unusable checkpoint(s): {'; '.join(skipped)}; none is left", CheckpointWarning, 3)
    return None


def latest_checkpoint(run_dir: str | os.PathLike, *, subdir: str = "checkpoints") -> Path | None:
    """The newest committed checkpoint whose files all verify; None when there is none.

    A newer checkpoint that fails verification is skipped with a CheckpointWarning naming
    the bad file and the checkpoint used instead.
    """
    found = _latest(Path(run_dir), subdir)
    return None if found is None else found[0]


# ---- restoring ----------------------------------------------------------------------


def _default_sharding() -> jax.sharding.Sharding:
    return SingleDeviceSharding(jax.local_devices()[0])


def _key_data_sharding(sharding: jax.sharding.Sharding, ndim: int, path: str) -> jax.sharding.Sharding:
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec) + 1)
        return NamedSharding(sharding.mesh, PartitionSpec(*spec))
    raise CheckpointError(f"leaf {_show(path)}: restoring a PRNG key needs a NamedSharding or single-device target")


@dataclasses.dataclass
class _Plan:
    """How one array leaf of the target is read: which regions go to which devices."""

    record: dict
    target: Any
    sharding: jax.sharding.Sharding | None  # None: a numpy result
    regions: dict[tuple, list]  # ((start, stop), ...) -> devices (or [None] for numpy)
    axes: tuple | None  # the target NamedArray's axes


def _region(index: tuple, shape: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape))


def _chunk_files(record: dict, region: tuple[tuple[int, int], ...]) -> set[str]:
    if any(stop <= start for start, stop in region):
        return set()
    ranges = [range(start // c, (stop - 1) // c + 1) for (start, stop), c in zip(region, record["chunk"])]
    keys = {"c"}
    for r in ranges:
        keys = {f"{k}/{i}" for k in keys for i in r}
    return {f"{record['dir']}/{k}" for k in keys}


def _match(record: dict, path: str, target: Any, ckpt: Path) -> _Plan | Any:
    """Check one target leaf against its saved record; return a read plan or the value itself."""
    where = f"leaf {_show(path)}"
    kind = record["kind"]
    if kind == "opaque":
        if isinstance(target, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, NamedArray)):
            raise CheckpointError(f"{where}: the checkpoint has a {record['type']} (not saved), the target an array")
        return target
    if kind == "scalar":
        if isinstance(target, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, NamedArray)):
            raise CheckpointError(f"{where}: the checkpoint has a Python {record['type']}, the target an array")
        if type(target).__name__ != record["type"]:
            raise CheckpointError(
                f"{where}: the checkpoint has a Python {record['type']}, the target a {type(target).__name__}"
            )
        return _SCALAR_TYPES[record["type"]](record["value"])
    names = axes = None
    if isinstance(target, NamedArray):
        names, axes = list(target.names), target.axes
        target = target.array
    if names != record["axes"]:
        raise CheckpointError(
            f"{where}: axes {record['axes']} in the checkpoint ({ckpt}), {names} in the target "
            "(None means a positional array)"
        )
    if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = getattr(target, "sharding", None) or _default_sharding()
    elif isinstance(target, (np.ndarray, np.generic)):
        sharding = None
    else:
        raise CheckpointError(f"{where}: the checkpoint has an array, the target a {type(target).__name__}")
    if list(target.shape) != record["shape"] or str(target.dtype) != record["dtype"]:
        raise CheckpointError(
            f"{where}: the checkpoint has {record['dtype']}{record['shape']}, "
            f"the target {target.dtype}{list(target.shape)}"
        )
    store_shape = record["store_shape"]
    regions: dict[tuple, list] = {}
    if sharding is None:
        regions[tuple((0, n) for n in store_shape)] = [None]
    else:
        if "key_impl" in record:
            sharding = _key_data_sharding(sharding, len(record["shape"]), path)
        for device, index in sharding.addressable_devices_indices_map(tuple(store_shape)).items():
            regions.setdefault(_region(index, store_shape), []).append(device)
    return _Plan(record, target, sharding, regions, axes)


def _plan(ckpt: Path, commit: dict, target: Any) -> tuple[list, Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_named_array)
    paths = [jax.tree_util.keystr(k) for k, _ in flat]
    saved = {r["path"]: r for r in commit["leaves"]}
    missing = [q for q in paths if q not in saved]
    extra = [q for q in saved if q not in set(paths)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"target leaves not in the checkpoint: {', '.join(map(_show, missing[:8]))}")
        if extra:
            parts.append(f"checkpoint leaves not in the target: {', '.join(map(_show, extra[:8]))}")
        raise CheckpointError(f"checkpoint {ckpt} does not match the target tree; " + "; ".join(parts))
    return [_match(saved[q], q, leaf, ckpt) for q, (_, leaf) in zip(paths, flat)], treedef


def check_restorable(path: str | os.PathLike, target: Any) -> dict:
    """Check, reading no array, that ``path`` is a committed checkpoint whose tree matches
    ``target`` (leaves, shapes, dtypes, axis names; ``jax.eval_shape`` output will do).

    Returns the commit record; raises CheckpointError naming the file or leaf. A trainer
    calls this before compiling anything, so a resume with a changed model fails at once.
    """
    path = Path(path)
    commit = _read_commit(path)
    _plan(path, commit, target)
    return commit


def restore(path_or_run_dir: str | os.PathLike, target: Any, *, subdir: str = "checkpoints") -> tuple[Any, dict]:
    """Read a checkpoint into the structure, shapes, dtypes and shardings of ``target``.

    Args:
        path_or_run_dir: a ``step_<N>`` directory (restored as is, or a CheckpointError
            naming the corrupted file), or a run directory (its newest verified checkpoint).
        target: a pytree of the saved structure whose array leaves are jax.Arrays or
            jax.ShapeDtypeStructs (their ``.sharding`` is the layout of the result; none
            means the first local device), numpy arrays (read to host) or NamedArrays of
            those (axis names must match). Other leaves are checked and passed through.

    Returns:
        ``(tree, metadata)``. Each process reads only the regions its devices hold.
    """
    p = Path(path_or_run_dir)
    if _STEP_DIR.match(p.name) or (p / COMMIT_FILE).exists():
        ckpt, commit = p, _read_commit(p)
        verified = False
    else:
        found = _latest(p, subdir)
        if found is None:
            raise CheckpointError(f"no committed checkpoint under {checkpoint_dir(p, subdir)}")
        (ckpt, commit), verified = found, True

    plans, treedef = _plan(ckpt, commit, target)

    if not verified:  # hash exactly the files this process is about to read
        needed = set()
        for plan in plans:
            if isinstance(plan, _Plan):
                needed.add(f"{plan.record['dir']}/zarr.json")
                for region in plan.regions:
                    needed |= _chunk_files(plan.record, region)
        _verify_files(ckpt, commit, hash_only=needed)

    with concurrent.futures.ThreadPoolExecutor(_IO_THREADS) as pool:
        out = list(pool.map(lambda plan: _read(plan, ckpt) if isinstance(plan, _Plan) else plan, plans))
    return jax.tree_util.tree_unflatten(treedef, out), commit["metadata"]


def _read(plan: _Plan, ckpt: Path) -> Any:
    rec = plan.record
    where = f"leaf {_show(rec['path'])} ({ckpt / rec['dir']})"
    try:
        arr = ts.open(_zarr_spec(ckpt / rec["dir"]), open=True, read=True).result()
    except Exception as e:
        raise CheckpointError(f"{where}: cannot open: {e}") from None
    if list(arr.shape) != rec["store_shape"] or np.dtype(arr.dtype.numpy_dtype).name != rec["store_dtype"]:
        raise CheckpointError(
            f"{where}: zarr.json says {arr.dtype}{list(arr.shape)}, commit.json {rec['store_dtype']}{rec['store_shape']}"
        )
    futures = {region: arr[tuple(slice(a, b) for a, b in region)].read() for region in plan.regions}
    try:
        host = {region: f.result() for region, f in futures.items()}
    except Exception as e:
        raise CheckpointError(f"{where}: read failed: {e}") from None
    if plan.sharding is None:
        (value,) = host.values()
        result = value[()] if isinstance(plan.target, np.generic) else value
    else:
        buffers = [jax.device_put(host[r], device) for r, devices in plan.regions.items() for device in devices]
        result = jax.make_array_from_single_device_arrays(tuple(rec["store_shape"]), plan.sharding, buffers)
        if "key_impl" in rec:
            result = jax.random.wrap_key_data(result, impl=rec["key_impl"])
    return result if plan.axes is None else NamedArray(result, plan.axes)
