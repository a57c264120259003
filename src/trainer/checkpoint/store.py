"""Where checkpoints live: a local directory or a prefix in an object store (``s3://``, ``gs://``).

``config.location`` is the one rule that turns a configured value into a place: a string starting
with ``s3://`` or ``gs://`` is an ``ObjectPath`` (bucket and key prefix), any other ``scheme://``
is refused, everything else is a local ``Path``. Object stores are read and written through
tensorstore's own kvstore drivers (``s3``, ``gcs``), never by HTTP code of ours:

- ``s3://``: credentials as the AWS CLI finds them (``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``~/.aws/credentials`` and ``AWS_PROFILE``,
  the instance metadata service); the endpoint of an S3-compatible server from
  ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` and its region from ``AWS_REGION`` or
  ``AWS_DEFAULT_REGION`` (tensorstore does not read these two itself, so they are passed on here).
- ``gs://``: Google's application-default credentials (``GOOGLE_APPLICATION_CREDENTIALS``, the
  metadata server), as tensorstore's ``gcs`` driver finds them.

Objects have no atomic rename, so the commit protocol on a store differs from the local one
(``write``): the small file-level helpers both use are here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import tensorstore as ts

from ..config.errors import CheckpointError
from ..config.location import Location, ObjectPath, location

FORMAT = "named-checkpoint/1"
COMMIT_FILE = "commit.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
# Threads for checkpoint file work: writes, fsyncs, reads and hashes. They wait on the disk far
# more than they compute (and release the GIL while they do), and a disk is fastest with many
# requests in flight, so this is not tied to the core count: on a 2-core machine, 16 threads
# save 1 GiB in 0.7-1.0 s where 2 threads took 1.1-1.8 s (docs/benchmarks.md section 5).
IO_THREADS = 16

# Whole-chunk reads from an object store in flight at once: until their chunks add up to this many
# bytes, and at least MIN_READS_IN_FLIGHT whatever their size. Tensorstore holds each response in
# buffers of its own until it is decoded into the array's memory, so every read in flight is
# another chunk of memory beside the restored values, which a new process pays for as fresh
# pages. The first restore of a 512 MiB checkpoint (32 chunks) in a new process, on the local S3
# server (medians of 3 rounds per run): 0.54-0.55 s and 0.69-0.71 s of CPU with every chunk in
# flight, 0.53-0.56 s with 16 chunks, 0.49 s and 0.62-0.63 s with 8 (128 MiB), 0.47-0.48 s and
# 0.58-0.59 s with 4 (docs/benchmarks.md section 5). A real store wants more requests in flight
# than a server on the same machine; 128 MiB is about what boto3's transfer manager keeps in flight
# by default (10 requests of 8 MiB).
READ_BYTES_IN_FLIGHT = 128 << 20
MIN_READS_IN_FLIGHT = 4

# Tensorstore's HTTP transport (its s3 and gcs drivers) moves every response's bytes on 4 threads
# unless told otherwise, read once, when the transport is first used. On a loaded machine 4
# threads get a small share of the cores, where a client with a thread per request (boto3) gets
# many: on the local S3 server at a load of 17-20 a restore fetched at 0.57 of boto3's rate with 4
# and 0.68 with 16 (medians of 4 rounds each, one run taking turns; docs/benchmarks.md section 5).
# A value the user set is kept.
os.environ.setdefault("TENSORSTORE_HTTP_THREADS", str(IO_THREADS))

# Transient errors (throttling, a dropped connection) are retried with exponential backoff, up
# to about a minute in all; a server that stays away fails the save (tensorstore's own default
# waits a quarter of an hour). Tests shorten this.
RETRIES = {"max_retries": 8, "initial_delay": "0.5s", "max_delay": "16s"}


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupted, truncated or never committed) and an older one is used instead."""


def checkpoint_dir(root: str | os.PathLike | ObjectPath, subdir: str = "checkpoints") -> Location:
    """``<root>/<subdir>``, refusing a ``subdir`` that is absolute, has ``..`` or leads (through
    a symlink) outside ``root``; ``root`` is a run directory or an object-store prefix."""
    sub = Path(subdir)
    if sub.is_absolute() or ".." in sub.parts or not sub.parts:
        raise CheckpointError(
            f"checkpoint subdir {subdir!r} must be a relative path inside the run directory, without '..'"
        )
    run = location(root)
    if isinstance(run, ObjectPath):
        return run / sub.as_posix()
    out = run / sub
    if not out.resolve().is_relative_to(run.resolve()):
        raise CheckpointError(
            f"checkpoint dir {out} resolves to {out.resolve()}, outside the run directory {run.resolve()}"
        )
    return out


# ---- small shared helpers ----------------------------------------------------------------


def show(path: str) -> str:
    """A leaf's key path for messages."""
    return repr(path) if path else "(the root)"


def self_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def safe_relpath(rel: str, root: Location) -> Location:
    # File names come from commit.json, which is data: never let it point outside.
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise CheckpointError(f"{root / COMMIT_FILE}: refuses file path {rel!r} that leaves the checkpoint directory")
    return root / (p.as_posix() if isinstance(root, ObjectPath) else p)


# ---- object stores through tensorstore's kvstore drivers -------------------------------------

_CONTEXTS: dict[str, ts.Context] = {}
_LOCK = threading.Lock()


def _context(scheme: str) -> ts.Context:
    # One context per driver and process: its connection pool and request limits are shared.
    key = f"{scheme}:{json.dumps(RETRIES, sort_keys=True)}:{bool(os.environ.get('AWS_ACCESS_KEY_ID'))}"
    with _LOCK:
        if key not in _CONTEXTS:
            retries = {"s3": "s3_request_retries", "gs": "gcs_request_retries"}[scheme]
            spec = {retries: dict(RETRIES)}
            if scheme == "s3" and os.environ.get("AWS_ACCESS_KEY_ID"):
                # the keys are in the environment: the default chain would first look for
                # ~/.aws files and log an error for each one that is missing
                spec["aws_credentials"] = {"type": "environment"}
            _CONTEXTS[key] = ts.Context(spec)
        return _CONTEXTS[key]


def kvstore_spec(loc: Location) -> dict:
    """The tensorstore kvstore spec of a directory (``file``) or prefix (``s3`` / ``gcs``)."""
    if isinstance(loc, Path):
        return {"driver": "file", "path": str(loc)}
    path = loc.key + "/" if loc.key else ""
    if loc.scheme == "gs":
        return {"driver": "gcs", "bucket": loc.bucket, "path": path}
    spec = {"driver": "s3", "bucket": loc.bucket, "path": path}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    elif endpoint:
        spec["aws_region"] = "us-east-1"  # S3-compatible servers sign with some region; this is the usual one
    return spec


def reason(e: BaseException) -> str:
    # tensorstore appends the HTTP response body and headers in brackets: the status is enough.
    text = str(e).split(" [", 1)[0].strip()
    return text or type(e).__name__


def store_error(loc: Location, what: str, e: BaseException) -> CheckpointError:
    return CheckpointError(f"{loc}: cannot {what}: {reason(e)}")


def open_store(loc: ObjectPath) -> ts.KvStore:
    try:
        return ts.KvStore.open(kvstore_spec(loc), context=_context(loc.scheme)).result()
    except Exception as e:  # noqa: BLE001 - reported with the URL
        raise store_error(loc, "open the object store", e) from None


def open_array(loc: ObjectPath, meta: dict) -> ts.TensorStore:
    """The zarr array saved under ``loc`` on an object store, opened for reading through the shared
    context with ``meta``, its ``zarr.json`` as already fetched and checked (not fetched again); a
    chunk whose object is missing fails its read instead of reading as the fill value."""
    spec = {**zarr_spec(kvstore_spec(loc)), "metadata": meta, "fill_missing_data_reads": False}
    try:
        return ts.open(spec, context=_context(loc.scheme), open=True, assume_metadata=True, read=True).result()
    except Exception as e:  # noqa: BLE001
        raise store_error(loc, "open the array", e) from None


def read_object(loc: ObjectPath, rel: str) -> bytes | None:
    """The bytes of ``<loc>/<rel>``, None when there is no such object."""
    try:
        r = open_store(loc).read(rel).result()
    except Exception as e:  # noqa: BLE001
        raise store_error(loc / rel, "read", e) from None
    return r.value if r.state == "value" else None


def read_objects(loc: ObjectPath, rels: Iterable[str], window: int = 64):
    """``(rel, bytes or None)`` for each of ``rels``, at most ``window`` reads in flight (memory stays bounded)."""
    kv, rels = open_store(loc), list(rels)
    for i in range(0, len(rels), window):
        batch = rels[i : i + window]
        futures = [kv.read(r) for r in batch]
        for rel, f in zip(batch, futures):
            try:
                r = f.result()
            except Exception as e:  # noqa: BLE001
                raise store_error(loc / rel, "read", e) from None
            yield rel, (r.value if r.state == "value" else None)


def write_objects(loc: ObjectPath, items: dict[str, bytes]) -> None:
    """Write every ``rel -> bytes`` under ``loc`` (each PUT is atomic on its own); raise on the first failure."""
    kv = open_store(loc)
    futures = {rel: kv.write(rel, data) for rel, data in items.items()}
    for rel, f in futures.items():
        try:
            f.result()
        except Exception as e:  # noqa: BLE001
            raise store_error(loc / rel, "write", e) from None


def list_objects(loc: ObjectPath) -> list[str]:
    """Every key under ``loc``, relative to it, sorted (a missing bucket or a refused listing raises)."""
    try:
        keys = open_store(loc).list().result()
    except Exception as e:  # noqa: BLE001
        raise store_error(loc, "list objects", e) from None
    return sorted(k.decode() for k in keys)


def delete_objects(loc: ObjectPath, rels: Iterable[str]) -> None:
    kv = open_store(loc)
    futures = {rel: kv.write(rel, None) for rel in rels}  # writing None deletes the key
    for rel, f in futures.items():
        try:
            f.result()
        except Exception as e:  # noqa: BLE001
            raise store_error(loc / rel, "delete", e) from None


def delete_prefix(loc: ObjectPath) -> None:
    """Delete every object under ``loc``."""
    try:
        open_store(loc).delete_range(ts.KvStore.KeyRange()).result()
    except Exception as e:  # noqa: BLE001
        raise store_error(loc, "delete objects", e) from None


def check_access(loc: ObjectPath, write: bool) -> None:
    """Raise CheckpointError naming ``loc`` when its bucket is missing or refuses listing (and,
    with ``write``, writing and deleting a probe object)."""
    list_objects(loc)
    if write:
        probe = f".write-probe-{os.getpid()}-{threading.get_ident()}"
        write_objects(loc, {probe: b"named-train write probe\n"})
        delete_objects(loc, [probe])


# Stated in every array's zarr.json rather than left to tensorstore's defaults: a whole chunk's
# file is then its values' bytes in C order, little-endian (chunks.write_raw_chunk writes such
# files, chunks.read_whole_chunk reads them), under the key chunk_key gives.
RAW_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}]


def chunk_key(start: Iterable[int], chunk: Iterable[int]) -> str:
    """The key, relative to its array, of the chunk that begins at ``start`` (zarr v3's default
    chunk key encoding: ``c/i/j/...``, the chunk's index along each axis)."""
    return "/".join(["c", *(str(s // c) for s, c in zip(start, chunk))])


def zarr_spec(kvstore: dict, record: dict | None = None) -> dict:
    """The zarr v3 spec of one saved array over ``kvstore``; with ``record``, the metadata to create it."""
    spec: dict = {"driver": "zarr3", "kvstore": kvstore}
    if record is not None:
        spec["metadata"] = {
            "shape": record["store_shape"],
            "data_type": record["store_dtype"],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": record["chunk"]}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": RAW_CODECS,
        }
        # Without this, chunks equal to the fill value (all-zero moments) are not written,
        # and "every listed file exists" could not be the integrity rule.
        spec["store_data_equal_to_fill_value"] = True
    return spec
