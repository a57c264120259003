"""Whole chunks as their bytes: the chunk files a checkpoint writes and reads without tensorstore.

zarr's ``bytes`` codec stores a whole chunk as its values in C order, little-endian
(``store.zarr_spec`` states that codec and the default chunk keys), so a shard that fills its
chunk is written as it lies in memory, hashed on the way, with O_DIRECT where the file system
takes it; and a region of a restore that is one whole chunk is its file's bytes, read once and
hashed from memory. Through the page cache (tensorstore's file driver) a save cost this VM
1-3 s of CPU per GiB, most of it first-touching page-cache memory, then as much again to read
every file back for its hash. Everything else (``zarr.json``, shards that are not one chunk,
regions that span chunks, another codec) goes through tensorstore.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from pathlib import Path

import jax
import numpy as np

from .store import RAW_CODECS, CheckpointError, safe_relpath

DIRECT_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length multiples of the logical block
DIRECT_PIECE = 4 << 20  # bytes per write, through one page-aligned staging buffer per call


def raw_chunk_ok(record: dict, data: np.ndarray) -> bool:
    """Whether ``data`` is a whole chunk of ``record``'s array, in a dtype whose bytes are its
    values (what ``write_raw_chunk`` writes)."""
    dt = np.dtype(data.dtype)
    return (
        list(data.shape) == record["chunk"]
        and dt.name == record["store_dtype"]
        and dt.byteorder in ("=", "<", "|")
        and dt.kind in "biufcV"
        and data.size > 0
    )


def write_raw_chunk(path: Path, data: np.ndarray) -> tuple[str, int]:
    """Write one whole chunk as its C-order bytes to the new file ``path``, fsync it, and return
    its (sha256, size), hashed from memory as it is written (nothing is read back)."""
    src = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    digest = hashlib.sha256()
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct, 0o644)
    except OSError as e:
        if not direct or e.errno != errno.EINVAL:
            raise
        # the file system refuses O_DIRECT at open (e.g. tmpfs before Linux 6.6), perhaps after
        # creating the file: open it plainly
        fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 0
    try:
        if direct:
            try:
                write_direct(fd, src, digest)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                # the file system does not take O_DIRECT (tmpfs, some network mounts): start over
                os.close(fd)
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
                digest = hashlib.sha256()
                direct = 0
        if not direct:
            digest.update(src)
            view = src
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest(), len(src)


def write_direct(fd: int, src: memoryview, digest) -> None:
    n = len(src)
    stage = mmap.mmap(-1, min(DIRECT_PIECE, -(-n // DIRECT_ALIGN) * DIRECT_ALIGN))  # anonymous: page-aligned
    try:
        buf = np.frombuffer(stage, np.uint8)
        for pos in range(0, n, len(stage)):
            piece = src[pos : pos + len(stage)]
            digest.update(piece)
            k = len(piece)
            buf[:k] = np.frombuffer(piece, np.uint8)
            padded = -(-k // DIRECT_ALIGN) * DIRECT_ALIGN
            buf[k:padded] = 0
            view, done = memoryview(stage)[:padded], 0
            while done < padded:
                done += os.write(fd, view[done:])
            view.release()
        if n % DIRECT_ALIGN:
            os.ftruncate(fd, n)  # the padding of the last block goes
        del buf
    finally:
        stage.close()


def raw_layout(meta: dict | None, record: dict) -> bool:
    """Whether ``meta`` (an array's zarr.json) describes the array ``record`` with each whole chunk
    stored as its values' bytes in C order, little-endian, under the default chunk keys (what
    ``store.zarr_spec`` asks tensorstore for, and tensorstore's default before it did)."""
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3:
        return False
    keys = meta.get("chunk_key_encoding") or {}
    grid = (meta.get("chunk_grid") or {}).get("configuration") or {}
    try:
        itemsize = jax.numpy.dtype(record["store_dtype"]).itemsize
    except TypeError:
        return False
    codecs = meta.get("codecs")
    return (
        (codecs == RAW_CODECS or (codecs == [{"name": "bytes"}] and itemsize == 1))
        and keys.get("name") == "default"
        and (keys.get("configuration") or {}).get("separator", "/") == "/"
        and meta.get("data_type") == record["store_dtype"]
        and meta.get("shape") == record["store_shape"]
        and grid.get("chunk_shape") == record["chunk"]
    )


def chunk_from(data, rel: str, record: dict, where: str) -> np.ndarray:
    """A whole chunk's values from its file's bytes."""
    dtype = jax.numpy.dtype(record["store_dtype"])
    if len(data) != int(np.prod(record["chunk"])) * dtype.itemsize:
        raise CheckpointError(f"{where}: {rel} has {len(data)} bytes, not one whole chunk {record['chunk']} of {dtype}")
    return np.frombuffer(data, dtype).reshape(record["chunk"])


def read_whole_chunk(ckpt: Path, rel: str, info: dict, check: bool) -> bytearray:
    """A chunk file's bytes, read once; with ``check``, hashed from memory against ``info``."""
    full = safe_relpath(rel, ckpt)
    buf = bytearray(info["size"])
    with open(full, "rb", buffering=0) as f:
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                raise CheckpointError(f"checkpoint {ckpt}: file {full} ended after {got} bytes (truncated?)")
            got += n
    if check and hashlib.sha256(buf).hexdigest() != info["sha256"]:
        raise CheckpointError(f"checkpoint {ckpt}: checksum mismatch in file {full} (corrupted)")
    return buf
