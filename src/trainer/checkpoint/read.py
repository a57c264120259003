"""Finding, verifying and reading checkpoints, from a local directory or an object store.

``latest_checkpoint`` verifies size and checksum (the crc32c or sha256 its commit record lists:
``checksum``) of every file of the newest commit and falls back, with a CheckpointWarning naming
the bad file, to the previous one; on an object store it also warns about step prefixes that hold
objects but no commit record (a save that never committed: never trusted). ``restore`` of a run
directory does the same while it reads: each candidate, newest first, is read once, every byte
checked as it arrives, and the tree is returned only when all of them agree with the commit
record; a bad file is named and the previous checkpoint read instead. ``restore`` of an explicit
``step_<N>`` checks every file's size and checksums the files this process reads, and raises
CheckpointError naming a bad one. The target tree gives each leaf's shape, dtype and sharding;
every process reads only the regions its own devices hold, so a checkpoint saved on 8 devices
restores onto a 4x2 mesh, one device, or another number of processes.

A region of the target that is one whole chunk of the saved array (every region, when the
layout is the one saved) is its chunk file's bytes, read once: on a local disk mapped from the
file (``chunks.map_chunk_file``; O_DIRECT into a fresh buffer where it cannot be mapped), those
pages the device array's memory, many files in flight, each checksummed from memory piece by
piece as it is read, in place of a hashing pass before the read. Other regions
are read through tensorstore. On an object store each file this process needs is fetched once,
its size and checksum checked, and decoded from memory: the bytes checked are the bytes used;
every leaf's zarr.json first, in one batch, then the whole chunks, up to ``READ_BYTES_IN_FLIGHT``
of them at a time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import os
import re
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from named import NamedArray, NamedError, is_named_array

from . import checksum
from .checksum import hash_file
from .chunks import aligned_empty, raw_layout, read_whole_chunk
from .store import (
    COMMIT_FILE,
    FORMAT,
    IO_THREADS,
    MIN_READS_IN_FLIGHT,
    READ_BYTES_IN_FLIGHT,
    STEP_DIR,
    CheckpointError,
    CheckpointWarning,
    Location,
    ObjectPath,
    checkpoint_dir,
    chunk_key,
    kvstore_spec,
    list_objects,
    location,
    open_array,
    read_object,
    read_objects,
    reason,
    safe_relpath,
    self_digest,
    show,
    zarr_spec,
)

_SCALAR_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
_COMMIT_KEY = re.compile(r"^step_(\d+)/" + re.escape(COMMIT_FILE) + "$")
_STEP_KEY = re.compile(r"^(step_\d+)/")


# ---- finding ------------------------------------------------------------------------------


def list_checkpoints(
    run_dir: str | os.PathLike | ObjectPath, *, subdir: str = "checkpoints"
) -> list[tuple[int, Location]]:
    """``(step, path)`` of every checkpoint with a commit record, oldest first; not verified."""
    ckdir = checkpoint_dir(run_dir, subdir)
    if isinstance(ckdir, ObjectPath):
        keys = list_objects(ckdir)
        return sorted((int(m.group(1)), ckdir / f"step_{m.group(1)}") for k in keys if (m := _COMMIT_KEY.match(k)))
    if not ckdir.is_dir():
        return []
    out = []
    for entry in ckdir.iterdir():
        m = STEP_DIR.match(entry.name)
        if m and not entry.is_symlink() and (entry / COMMIT_FILE).is_file():
            out.append((int(m.group(1)), entry))
    return sorted(out)


def uncommitted_steps(ckdir: ObjectPath) -> list[str]:
    """``step_<N>`` prefixes of an object store that hold objects but no commit record: saves
    that never committed (or a retention that deleted the record and stopped)."""
    keys = list_objects(ckdir)
    committed = {f"step_{m.group(1)}" for k in keys if (m := _COMMIT_KEY.match(k))}
    return sorted({m.group(1) for k in keys if (m := _STEP_KEY.match(k))} - committed)


def read_commit(path: str | os.PathLike | ObjectPath) -> dict:
    """The commit record of a checkpoint (its own sha256 checked; the files are not read)."""
    path = location(path)
    commit_path = path / COMMIT_FILE
    if isinstance(path, ObjectPath):
        raw = read_object(path, COMMIT_FILE)
    else:
        raw = commit_path.read_bytes() if commit_path.is_file() else None
    if raw is None:
        raise CheckpointError(f"{path} has no {COMMIT_FILE}: it is not a committed checkpoint")
    try:
        commit = json.loads(raw)
        body = {k: v for k, v in commit.items() if k != "commit_sha256"}
        ok = commit.get("commit_sha256") == self_digest(body)
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{commit_path} is not valid JSON ({e}): the checkpoint is corrupted") from None
    if not ok:
        raise CheckpointError(f"{commit_path}: content does not match its commit_sha256: the checkpoint is corrupted")
    if commit.get("format") != FORMAT:
        raise CheckpointError(f"{commit_path}: unknown format {commit.get('format')!r}, expected {FORMAT!r}")
    return commit


# ---- verifying ----------------------------------------------------------------------------


def _check_bytes(path: Location, rel: str, data: bytes | None, info: dict) -> None:
    full = path / rel
    if data is None:
        raise CheckpointError(f"checkpoint {path}: file {full} is missing")
    if len(data) != info["size"]:
        raise CheckpointError(
            f"checkpoint {path}: file {full} has {len(data)} bytes, the commit says {info['size']} (truncated?)"
        )
    if not checksum.matches(info, data, full):
        raise CheckpointError(
            f"checkpoint {path}: checksum mismatch in file {full} (corrupted; {checksum.check_of(info, full)})"
        )


def fetch_verified(path: ObjectPath, commit: dict, rels) -> dict[str, bytes]:
    """The bytes of ``rels`` from an object store, each checked against the commit record."""
    files = commit["files"]
    out = {}
    for rel in rels:
        safe_relpath(rel, path)
        if rel not in files:
            raise CheckpointError(f"checkpoint {path}: {rel} is not listed in its {COMMIT_FILE}")
    for rel, data in read_objects(path, rels):
        _check_bytes(path, rel, data, files[rel])
        out[rel] = data
    return out


def _verify_files(
    path: Location, commit: dict, hash_only: set[str] | None = None, only: set[str] | None = None
) -> None:
    """Every listed file exists with its size; hashes all of them, or only ``hash_only``. On an
    object store (where reading an object is the only way to learn its size) every file, or
    ``only`` those, is fetched and checked."""
    files = commit["files"]
    if isinstance(path, ObjectPath):
        rels = sorted(files if only is None else only)
        for rel in rels:
            safe_relpath(rel, path)
        for rel, data in read_objects(path, rels):
            _check_bytes(path, rel, data, files[rel])
        return
    to_hash = []
    for rel, info in files.items():
        full = safe_relpath(rel, path)
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
    checks = {rel: checksum.check_of(files[rel], path / rel) for rel in to_hash}
    with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:
        for rel, (digest, _) in zip(to_hash, pool.map(lambda r: hash_file(path / r, checks[r]), to_hash)):
            if digest != files[rel][checks[rel]]:
                raise CheckpointError(
                    f"checkpoint {path}: checksum mismatch in file {path / rel} (corrupted; {checks[rel]})"
                )


def verify_checkpoint(path: str | os.PathLike | ObjectPath) -> dict:
    """Check commit.json and the size and checksum of every file; return the commit record."""
    path = location(path)
    commit = read_commit(path)
    _verify_files(path, commit)
    return commit


def _newest(root: Location, subdir: str, use: Callable[[Location, dict], Any]) -> tuple[Location, Any] | None:
    """``(path, use(path, commit))`` for the newest committed checkpoint under ``root`` whose
    commit record reads and for which ``use`` raises no CheckpointError; each one skipped (and
    every uncommitted save newer than the one used) is named in one CheckpointWarning."""
    skipped = []
    ckdir = checkpoint_dir(root, subdir)
    found = list_checkpoints(root, subdir=subdir)
    if isinstance(ckdir, ObjectPath):
        newest = found[-1][0] if found else -1
        partial = [name for name in uncommitted_steps(ckdir) if int(name[5:]) > newest]
        skipped += [
            f"{ckdir / name} holds objects but no {COMMIT_FILE} (a save that never committed)" for name in partial
        ]
    for _, path in reversed(found):
        try:
            out = use(path, read_commit(path))
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        if skipped:
            warnings.warn(f"skipped unusable checkpoint(s): {'; '.join(skipped)}; using {path}", CheckpointWarning, 3)
        return path, out
    if skipped:
        warnings.warn(f"skipped unusable checkpoint(s): {'; '.join(skipped)}; none is left", CheckpointWarning, 3)
    return None


def latest_checkpoint(
    run_dir: str | os.PathLike | ObjectPath, *, subdir: str = "checkpoints", checksums: bool = True
) -> Location | None:
    """The newest committed checkpoint whose files all verify; None when there is none.

    A newer checkpoint that fails verification is skipped with a CheckpointWarning naming
    the bad file and the checkpoint used instead. ``checksums=False``: only that the commit
    record reads and, on a file system, that every file is there at its size (nothing is
    read: ``restore`` of the run directory checks the checksums as it reads).
    """

    def verify(path: Location, commit: dict) -> None:
        if checksums:
            _verify_files(path, commit)
        else:  # sizes only on a file system, nothing on an object store
            _verify_files(path, commit, hash_only=set(), only=set())

    found = _newest(location(run_dir), subdir, verify)
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
    raise CheckpointError(f"leaf {show(path)}: restoring a PRNG key needs a NamedSharding or single-device target")


@dataclasses.dataclass
class _Plan:
    """How one array leaf of the target is read: which regions go to which devices."""

    record: dict
    target: Any
    sharding: jax.sharding.Sharding | None  # None: a numpy result
    regions: dict[tuple, list]  # ((start, stop), ...) -> devices (or [None] for numpy)
    axes: tuple | None  # the target NamedArray's axes

    def files(self) -> set[str]:
        """The files this process reads for this leaf: its zarr.json and the chunks of its regions."""
        out = {f"{self.record['dir']}/zarr.json"}
        for region in self.regions:
            out |= _chunk_files(self.record, region)
        return out

    def whole_chunks(self, meta: dict | None) -> dict[tuple, str]:
        """The regions that are one whole chunk each in an array whose ``zarr.json`` (``meta``)
        stores a chunk as its values' bytes, with the file (relative to the checkpoint) of each."""
        rec = self.record
        if not raw_layout(meta, rec):
            return {}
        chunk = rec["chunk"]
        return {
            region: f"{rec['dir']}/{chunk_key((start for start, _ in region), chunk)}"
            for region in self.regions
            if all(start % c == 0 and stop - start == c for (start, stop), c in zip(region, chunk))
        }


def _meta_of(raw: bytes | None) -> dict | None:
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return None  # tensorstore's own open then says what is wrong with it


def _region(index: tuple, shape: list[int]) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape))


def _chunk_files(record: dict, region: tuple[tuple[int, int], ...]) -> set[str]:
    if any(stop <= start for start, stop in region):
        return set()
    chunk = record["chunk"]
    starts = itertools.product(*(range(start - start % c, stop, c) for (start, stop), c in zip(region, chunk)))
    return {f"{record['dir']}/{chunk_key(first, chunk)}" for first in starts}


def _match(record: dict, path: str, target: Any, ckpt: Location) -> _Plan | Any:
    """Check one target leaf against its saved record; return a read plan or the value itself."""
    where = f"leaf {show(path)}"
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


def _plan(ckpt: Location, commit: dict, target: Any, partial: bool = False) -> tuple[list, Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_named_array)
    paths = [jax.tree_util.keystr(k) for k, _ in flat]
    saved = {r["path"]: r for r in commit["leaves"]}
    missing = [q for q in paths if q not in saved]
    extra = [] if partial else [q for q in saved if q not in set(paths)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"target leaves not in the checkpoint: {', '.join(map(show, missing[:8]))}")
        if extra:
            parts.append(f"checkpoint leaves not in the target: {', '.join(map(show, extra[:8]))}")
        raise CheckpointError(f"checkpoint {ckpt} does not match the target tree; " + "; ".join(parts))
    return [_match(saved[q], q, leaf, ckpt) for q, (_, leaf) in zip(paths, flat)], treedef


def check_restorable(path: str | os.PathLike | ObjectPath, target: Any) -> dict:
    """Check, reading no array, that ``path`` is a committed checkpoint whose tree matches
    ``target`` (leaves, shapes, dtypes, axis names; ``jax.eval_shape`` output will do).

    Returns the commit record; raises CheckpointError naming the file or leaf. A trainer
    calls this before compiling anything, so a resume with a changed model fails at once.
    """
    path = location(path)
    commit = read_commit(path)
    _plan(path, commit, target)
    return commit


def _is_checkpoint(p: Location) -> bool:
    if STEP_DIR.match(p.name):
        return True
    if isinstance(p, ObjectPath):
        return read_object(p, COMMIT_FILE) is not None
    return (p / COMMIT_FILE).exists()


def restore(
    path_or_run_dir: str | os.PathLike | ObjectPath, target: Any, *, subdir: str = "checkpoints", partial: bool = False
) -> tuple[Any, dict]:
    """Read a checkpoint into the structure, shapes, dtypes and shardings of ``target``.

    Args:
        path_or_run_dir: a ``step_<N>`` directory (restored as is, or a CheckpointError
            naming the corrupted file), or a run directory (its newest checkpoint whose files
            all check out as they are read, each byte read once; a corrupted newer one is
            skipped with a CheckpointWarning naming the file); either may be an object-store
            URL (``s3://``, ``gs://``).
        target: a pytree of the saved structure whose array leaves are jax.Arrays or
            jax.ShapeDtypeStructs (their ``.sharding`` is the layout of the result; none
            means the first local device), numpy arrays (read to host) or NamedArrays of
            those (axis names must match). Other leaves are checked and passed through.
        partial: the target may leave out parts of the saved tree (None in their place, e.g.
            ``(model, None)`` for the model of a ``(model, opt_state)`` checkpoint): those are not read.

    Returns:
        ``(tree, metadata)``. Each process reads only the regions its devices hold.
    """
    p = location(path_or_run_dir)
    if _is_checkpoint(p):
        commit = read_commit(p)
        return _restore(p, commit, *_plan(p, commit, target, partial), every_file=False)

    def use(path: Location, commit: dict):
        try:
            plans = _plan(path, commit, target, partial)
        except CheckpointError as e:  # a target that does not fit: the caller's error, not the checkpoint's
            raise _NotTheTarget(e) from None
        return _restore(path, commit, *plans, every_file=True)

    try:
        found = _newest(p, subdir, use)
    except _NotTheTarget as e:
        raise e.args[0] from None
    if found is None:
        raise CheckpointError(f"no committed checkpoint under {checkpoint_dir(p, subdir)}")
    return found[1]


class _NotTheTarget(NamedError):  # not a CheckpointError: the search for a usable checkpoint lets it through
    """Carries a CheckpointError about the target past the search for a usable checkpoint."""


def _restore(ckpt: Location, commit: dict, plans: list, treedef, every_file: bool) -> tuple[Any, dict]:
    """Read ``plans`` (``_plan``'s) from ``ckpt``, every byte read once and checked against the
    commit record before the tree is returned. ``every_file``: also check the files this read does
    not need (other processes' shards, leaves a partial target leaves out), so every process of a
    run judges a checkpoint whole or not alike; otherwise only the files read are checked."""
    arrays = [plan for plan in plans if isinstance(plan, _Plan)]
    needed = set().union(*(plan.files() for plan in arrays))
    whole: dict[int, dict] = {}  # per plan: its whole-chunk regions, read (and hashed) straight from their files
    metas: dict[str, bytes] = {}  # on an object store: each leaf's zarr.json, fetched and checked
    if isinstance(ckpt, Path):
        for plan in arrays:
            meta_file = safe_relpath(f"{plan.record['dir']}/zarr.json", ckpt)
            whole[id(plan)] = plan.whole_chunks(_meta_of(meta_file.read_bytes() if meta_file.is_file() else None))
        on_read = {rel for chunks in whole.values() for rel in chunks.values()}
        # every file's size; the hash of those not hashed as they are read, each once
        _verify_files(ckpt, commit, hash_only=(set(commit["files"]) if every_file else needed) - on_read)
    else:
        if every_file:
            _verify_files(ckpt, commit, only=set(commit["files"]) - needed)
        # Every leaf's zarr.json in one batch before any chunk is read: one fetched later waits
        # behind the other leaves' chunks (up to 0.13 s of a 0.45 s restore on the local server).
        metas = fetch_verified(ckpt, commit, sorted({f"{plan.record['dir']}/zarr.json" for plan in arrays}))

    # Leaves in one pool, the chunk files they read in another (a leaf waits on its chunks).
    in_flight = ReadsInFlight()  # an object store's whole-chunk reads, all leaves together
    with (
        concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool,
        concurrent.futures.ThreadPoolExecutor(IO_THREADS) as chunks,
    ):

        def read(plan):
            if not isinstance(plan, _Plan):
                return plan
            return _read(plan, ckpt, commit, whole.get(id(plan)), chunks, in_flight, metas)

        out = list(pool.map(read, plans))
    return jax.tree_util.tree_unflatten(treedef, out), commit["metadata"]


class ReadsInFlight:
    """Whole-chunk reads from an object store under way, held to ``READ_BYTES_IN_FLIGHT`` bytes
    together (and at least ``MIN_READS_IN_FLIGHT`` reads): ``start`` waits for room, the read's
    completion makes it."""

    def __init__(self):
        self._cond = threading.Condition()
        self.reads = self.bytes = self.peak_bytes = self.peak_reads = 0

    def start(self, n: int, read: Callable[[], ts.Future]) -> ts.Future:
        with self._cond:
            self._cond.wait_for(lambda: self.reads < MIN_READS_IN_FLIGHT or self.bytes + n <= READ_BYTES_IN_FLIGHT)
            self.reads, self.bytes = self.reads + 1, self.bytes + n
            self.peak_reads, self.peak_bytes = max(self.peak_reads, self.reads), max(self.peak_bytes, self.bytes)
        try:
            future = read()
        except BaseException:
            self._done(n)
            raise
        future.add_done_callback(lambda _: self._done(n))
        return future

    def _done(self, n: int) -> None:
        with self._cond:
            self.reads, self.bytes = self.reads - 1, self.bytes - n
            self._cond.notify_all()


def _whole_objects(
    ckpt: ObjectPath, commit: dict, rec: dict, meta: dict, chunks: dict[tuple, str], in_flight: ReadsInFlight
) -> dict[tuple, np.ndarray]:
    """Whole chunks from an object store, several requests in flight (``in_flight``, shared by the
    leaves of one restore), each decoded by tensorstore's zarr driver straight into a page-aligned
    buffer of ours (``aligned_empty``), which the device array is then made from without a copy:
    no Python ``bytes`` on the way (a copy into fresh memory), and no array of tensorstore's,
    which jax copied again wherever it was not aligned.
    Each is checked against its object's checksum from the buffer's bytes, which are the
    object's: a raw layout is little-endian, as every host jax runs on."""
    if not chunks:
        return {}
    arr = open_array(ckpt / rec["dir"], meta)
    dtype = jax.numpy.dtype(rec["store_dtype"])
    n = int(np.prod(rec["chunk"])) * dtype.itemsize
    reads = {}
    for region in chunks:
        src = arr[tuple(slice(a, b) for a, b in region)]
        buf = aligned_empty(n)[:n]
        dest = ts.array(buf.view(dtype).reshape(rec["chunk"]), copy=False, write=True)
        reads[region] = (buf, in_flight.start(n, lambda: dest.translate_to[src.domain.origin].write(src)))
    out = {}
    for region, rel in chunks.items():
        full, info = ckpt / rel, commit["files"][rel]
        buf, write = reads[region]
        try:
            write.result()
        except Exception as e:  # noqa: BLE001 - named with the object
            raise CheckpointError(
                f"checkpoint {ckpt}: file {full} cannot be read as one whole chunk {rec['chunk']} of "
                f"{rec['store_dtype']} (missing or truncated?): {reason(e)}"
            ) from None
        if not checksum.matches(info, buf, full):
            raise CheckpointError(
                f"checkpoint {ckpt}: checksum mismatch in file {full} (corrupted; {checksum.check_of(info, full)})"
            )
        out[region] = buf.view(dtype).reshape(rec["chunk"])
    return out


def _open_leaf(plan: _Plan, ckpt: Location, data: dict[str, bytes] | None):
    rec = plan.record
    if isinstance(ckpt, Path):
        return ts.open(zarr_spec(kvstore_spec(ckpt / rec["dir"])), open=True, read=True).result()
    # An object store: this leaf's files, fetched and checked, decoded from memory.
    context = ts.Context()  # a memory kvstore of its own
    memory = ts.KvStore.open({"driver": "memory"}, context=context).result()
    prefix = rec["dir"] + "/"
    for f in [memory.write(rel[len(prefix) :], blob) for rel, blob in data.items()]:
        f.result()
    return ts.open(zarr_spec({"driver": "memory"}), context=context, open=True, read=True).result()


def _read(
    plan: _Plan,
    ckpt: Location,
    commit: dict,
    whole: dict[tuple, str] | None,
    pool,
    in_flight: ReadsInFlight,
    metas: dict[str, bytes],
) -> Any:
    """One leaf. A region that is one whole chunk of a raw layout (``whole``, or on an object
    store found from its zarr.json in ``metas``) is its chunk file's bytes, read once (on a local
    disk into the buffer the device array is made from, on an object store decoded by
    tensorstore, checksummed from memory either way); the others go through tensorstore."""
    rec = plan.record
    where = f"leaf {show(rec['path'])} ({ckpt / rec['dir']})"
    host: dict[tuple, np.ndarray] = {}
    if isinstance(ckpt, Path):
        data = None
        jobs = {
            region: pool.submit(read_whole_chunk, ckpt, rel, commit["files"][rel], rec, where)
            for region, rel in (whole or {}).items()
            if rel in commit["files"]
        }
        host = {region: job.result() for region, job in jobs.items()}
    else:
        meta = f"{rec['dir']}/zarr.json"
        zarr_json = _meta_of(metas[meta])
        chunks = {r: rel for r, rel in plan.whole_chunks(zarr_json).items() if rel in commit["files"]}
        host = _whole_objects(ckpt, commit, rec, zarr_json, chunks, in_flight)
    rest = [region for region in plan.regions if region not in host]
    if rest:
        if not isinstance(ckpt, Path):  # the rest's files, fetched and checked, for a memory kvstore
            files = set().union(*(_chunk_files(rec, r) for r in rest))
            data = {meta: metas[meta], **fetch_verified(ckpt, commit, sorted(files))}
        try:
            arr = _open_leaf(plan, ckpt, data)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{where}: cannot open: {e}") from None
        if list(arr.shape) != rec["store_shape"] or np.dtype(arr.dtype.numpy_dtype).name != rec["store_dtype"]:
            raise CheckpointError(
                f"{where}: zarr.json says {arr.dtype}{list(arr.shape)}, commit.json "
                f"{rec['store_dtype']}{rec['store_shape']}"
            )
        futures = {region: arr[tuple(slice(a, b) for a, b in region)].read() for region in rest}
        try:
            host.update({region: f.result() for region, f in futures.items()})
        except Exception as e:
            raise CheckpointError(f"{where}: read failed: {e}") from None
    if plan.sharding is None:
        (value,) = host.values()
        value = value if value.flags.writeable else value.copy()  # an object's bytes are read-only
        result = value[()] if isinstance(plan.target, np.generic) else value
    else:
        buffers = [jax.device_put(host[r], device) for r, devices in plan.regions.items() for device in devices]
        result = jax.make_array_from_single_device_arrays(tuple(rec["store_shape"]), plan.sharding, buffers)
        if "key_impl" in rec:
            result = jax.random.wrap_key_data(result, impl=rec["key_impl"])
    return result if plan.axes is None else NamedArray(result, plan.axes)
