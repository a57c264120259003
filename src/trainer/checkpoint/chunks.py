"""Whole chunks as their bytes: the chunk files a checkpoint writes and reads without tensorstore.

zarr's ``bytes`` codec stores a whole chunk as its values in C order, little-endian
(``store.zarr_spec`` states that codec and the default chunk keys), so a shard that fills its
chunk is written as it lies in memory, checksummed on the way, with O_DIRECT where the file
system takes it; and a region of a restore that is one whole chunk is its file's bytes, mapped
copy-on-write (``map_chunk_file``: the pages the kernel reads the file into become the device
array's memory, so none is zeroed first), or where the file system cannot map it read with
O_DIRECT into a page-aligned buffer the device array is made from, checksummed piece by piece
from memory either way. Through the page cache (tensorstore's file
driver) a save cost this VM 1-3 s of CPU per GiB, most of it first-touching page-cache memory,
then as much again to read every file back for its hash; a restore paid the kernel's copy out of
the page cache and one more copy into a fresh buffer. Everything else (``zarr.json``, shards that
are not one chunk, regions that span chunks, another codec) goes through tensorstore.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import jax
import numpy as np

from . import checksum
from .store import RAW_CODECS, CheckpointError, safe_relpath

DIRECT_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length multiples of the logical block
DIRECT_PIECE = 4 << 20  # bytes per write, through one page-aligned staging buffer per call
READ_PIECE = 8 << 20  # bytes per read; each piece is checksummed as soon as it is in memory


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


def write_raw_chunk(path: Path, data: np.ndarray, check: str = checksum.DEFAULT) -> tuple[str, int]:
    """Write one whole chunk as its C-order bytes to the new file ``path``, fsync it, and return
    its (``check`` digest, size), computed from memory as it is written (nothing is read back)."""
    src = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    digest = checksum.new(check)
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
                digest = checksum.new(check)
                direct = 0
        if not direct:
            digest.update(src)
            _write_all(fd, src)
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest(), len(src)


def write_direct(fd: int, src: memoryview, digest) -> None:
    """Write ``src`` to ``fd`` (opened with O_DIRECT), feeding ``digest`` as it goes: from where
    it lies when that is page-aligned (a Checkpointer's host copies, ``aligned_empty``), its whole
    blocks at least; the rest through one page-aligned staging buffer."""
    n, done = len(src), 0
    if n and np.frombuffer(src, np.uint8).ctypes.data % DIRECT_ALIGN == 0:
        done = n - n % DIRECT_ALIGN
        for pos in range(0, done, DIRECT_PIECE):
            piece = src[pos : min(pos + DIRECT_PIECE, done)]
            digest.update(piece)
            _write_all(fd, piece)
    if done < n:
        stage = mmap.mmap(-1, min(DIRECT_PIECE, -(-(n - done) // DIRECT_ALIGN) * DIRECT_ALIGN))  # page-aligned
        try:
            buf = np.frombuffer(stage, np.uint8)
            for pos in range(done, n, len(stage)):
                piece = src[pos : pos + len(stage)]
                digest.update(piece)
                k = len(piece)
                buf[:k] = np.frombuffer(piece, np.uint8)
                padded = -(-k // DIRECT_ALIGN) * DIRECT_ALIGN
                buf[k:padded] = 0
                view = memoryview(stage)[:padded]
                _write_all(fd, view)
                view.release()
            del buf
        finally:
            stage.close()
    if n % DIRECT_ALIGN:
        os.ftruncate(fd, n)  # the padding of the last block goes


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


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


def check_chunk_size(size: int, rel: str, record: dict, where: str) -> None:
    """A whole chunk's file holds exactly the chunk's values."""
    dtype = jax.numpy.dtype(record["store_dtype"])
    if size != int(np.prod(record["chunk"])) * dtype.itemsize:
        raise CheckpointError(f"{where}: {rel} has {size} bytes, not one whole chunk {record['chunk']} of {dtype}")


def aligned_empty(n: int) -> np.ndarray:
    """``n`` bytes of fresh anonymous memory, page-aligned, with room up to the next block boundary
    (O_DIRECT reads whole blocks), its pages mapped at once (``MAP_POPULATE``, where Linux has it).

    Not ``np.empty``, and no ``madvise(MADV_HUGEPAGE)``: numpy asks for transparent huge pages on
    large arrays, and on this VM faulting them in cost 2.5-3 s of CPU per GiB (a restore took
    10-14 s), where mapping 4 KiB pages in one call costs about 0.4-0.7 s. Huge pages are cheap
    (a 1 GiB read with its crc32c in 0.27-0.35 s of CPU) only while the 2 MiB blocks some earlier
    buffer freed are still the guest's; a few seconds later the VM's free page reporting has given
    them back to the host, and the same read cost 2.4-2.75 s of CPU against 0.60-0.75 s with
    4 KiB pages (docs/benchmarks.md section 5)."""
    room = max(DIRECT_ALIGN, -(-n // DIRECT_ALIGN) * DIRECT_ALIGN)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return np.frombuffer(mmap.mmap(-1, room, flags=flags), np.uint8)  # the array keeps the mapping alive


def _open_read(path: Path, direct: int) -> tuple[int, int]:
    try:
        return os.open(path, os.O_RDONLY | direct), direct
    except OSError as e:
        if not direct or e.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_RDONLY), 0  # the file system refuses O_DIRECT at open


def read_direct(fd: int, buf: np.ndarray, n: int, digest) -> int:
    """Read up to ``n`` bytes from ``fd`` into ``buf`` (page-aligned, room for whole blocks),
    feeding each piece to ``digest`` once it is in memory; return the bytes read."""
    view, got = memoryview(buf), 0
    try:
        while got < n:
            k = os.readv(fd, [view[got : min(got + READ_PIECE, len(view))]])
            if not k:
                break
            digest.update(view[got : min(got + k, n)])
            got += k
    finally:
        view.release()
    return got


def read_whole_chunk(ckpt: Path, rel: str, info: dict, record: dict, where: str) -> np.ndarray:
    """A whole chunk of ``record``'s array from its file ``rel``, checksummed against ``info`` from
    memory: the file mapped copy-on-write (``map_chunk_file``), whose pages become the chunk's
    values, or where the file system cannot map it, read once with O_DIRECT where it takes that
    into a page-aligned buffer (no second copy either way)."""
    full = safe_relpath(rel, ckpt)
    n = info["size"]
    check_chunk_size(n, rel, record, where)
    kind = checksum.check_of(info, full)
    buf, digest = map_chunk_file(ckpt, full, n, kind)
    if buf is None:
        buf, digest = _read_chunk_file(ckpt, full, n, kind)
    if digest.hexdigest() != info[kind]:
        raise CheckpointError(f"checkpoint {ckpt}: checksum mismatch in file {full} (corrupted; {kind})")
    return buf[:n].view(jax.numpy.dtype(record["store_dtype"])).reshape(record["chunk"])


def map_chunk_file(ckpt: Path, full: Path, n: int, kind: str):
    """(the ``n`` bytes of ``full`` as an array over a private, copy-on-write mapping of the file,
    the ``kind`` digest of them), or (None, None) where the file cannot be mapped (a file system
    without ``mmap``, or the process out of mappings). Touching the pages to checksum them reads
    the file through the page cache, with the kernel's read-ahead: no page is zeroed first, as
    fresh anonymous memory is (on this project's VM that zeroing was most of a restore's CPU,
    docs/benchmarks.md section 5). A committed checkpoint's files are never written again (a new
    step is a new folder), so the mapping holds what the digest saw; a file cut short after the
    size check below would raise SIGBUS on access, as for any mapped file."""
    fd = os.open(full, os.O_RDONLY)
    try:
        _check_size(ckpt, full, fd, n)
        try:
            m = mmap.mmap(fd, n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return None, None
    finally:
        os.close(fd)
    if hasattr(mmap, "MADV_SEQUENTIAL"):
        m.madvise(mmap.MADV_SEQUENTIAL)  # read ahead far, as one pass reads the whole file
    digest, view = checksum.new(kind), memoryview(m)
    try:
        for pos in range(0, n, READ_PIECE):
            digest.update(view[pos : pos + READ_PIECE])
    finally:
        view.release()
    return np.frombuffer(m, np.uint8), digest  # the array keeps the mapping alive


def _check_size(ckpt: Path, full: Path, fd: int, n: int) -> None:
    size = os.fstat(fd).st_size
    if size != n:
        raise CheckpointError(f"checkpoint {ckpt}: file {full} has {size} bytes, the commit says {n} (truncated?)")


def _read_chunk_file(ckpt: Path, full: Path, n: int, kind: str):
    """(``full`` read with O_DIRECT where the file system takes it into fresh page-aligned
    memory, its ``kind`` digest): the restore of a file that cannot be mapped."""
    buf = aligned_empty(n)
    fd, direct = _open_read(full, getattr(os, "O_DIRECT", 0))
    try:
        _check_size(ckpt, full, fd, n)
        digest = checksum.new(kind)
        try:
            got = read_direct(fd, buf, n, digest)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            # the file system refuses O_DIRECT at the first read: read it plainly, from the start
            os.close(fd)
            fd = -1
            fd, digest = os.open(full, os.O_RDONLY), checksum.new(kind)
            got = read_direct(fd, buf, n, digest)
    finally:
        if fd >= 0:
            os.close(fd)
    if got != n:
        raise CheckpointError(f"checkpoint {ckpt}: file {full} ended after {got} bytes (truncated?)")
    return buf, digest
