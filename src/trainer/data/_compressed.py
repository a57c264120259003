"""Stream decompression of ``.gz`` and ``.zst`` files that names the file and offset of any damage.

The stdlib ``gzip`` module and ``zstandard.stream_reader`` both hide where a stream broke
(and ``stream_reader`` returns a truncated frame as a short, silent end of file), so both
codecs go through one loop over their ``decompressobj``: compressed bytes are fed in blocks
of ``BLOCK_BYTES``, concatenated gzip members and zstd frames are read as one stream (``pigz``
and ``zstd -T`` write several), and a file that ends inside a member or frame is refused
as truncated. Damage is reported as the block of compressed bytes it was found in, which is
as precise as the decompressors allow, together with the last complete line before it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

from ..config.data_section import DataError

BLOCK_BYTES = 1 << 16  # compressed bytes per decompress call: bounds memory and the error's byte range
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # gzip header and trailer, CRC and length checked by zlib

CODECS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


def _decompressor(codec: str):
    if codec == "gzip":
        return zlib.decompressobj(_GZIP_WBITS)
    import zstandard  # imported lazily: only .zst sources need it

    return zstandard.ZstdDecompressor().decompressobj()


def _codec_errors(codec: str) -> tuple[type[BaseException], ...]:
    if codec == "gzip":
        return (zlib.error,)
    import zstandard

    return (zstandard.ZstdError,)


class Damaged(DataError):
    """Raised inside the stream; ``lines`` turns it into a DataError that also names a line."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def decompressed_blocks(path: Path, codec: str) -> Iterator[bytes]:
    """The decompressed bytes of ``path``, a block at a time (never the whole file)."""
    errors = _codec_errors(codec)
    try:
        f = path.open("rb")
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror}") from e
    with f:
        d, fed, pos = _decompressor(codec), False, 0
        while True:
            try:
                raw = f.read(BLOCK_BYTES)
            except OSError as e:
                raise DataError(f"cannot read data file {str(path)!r} at byte {pos}: {e.strerror}") from e
            if not raw:
                break
            data = raw
            while data:
                if not fed and codec == "gzip":
                    data = data.lstrip(b"\0")  # gzip allows zero padding after a member
                    if not data:
                        break
                fed = True
                try:
                    out = d.decompress(data)
                except errors as e:
                    raise Damaged(f"corrupt {codec} data in compressed bytes {pos}-{pos + len(raw)} ({e})") from e
                if out:
                    yield out
                if not d.eof:
                    break
                data, d, fed = d.unused_data, _decompressor(codec), False  # the next member or frame
            pos += len(raw)
        if fed and not d.eof:
            raise Damaged(
                f"truncated: the {codec} stream stops at byte {pos} (the end of the file) in the middle "
                "of a compressed member; the file was cut short, re-download or re-compress it"
            )


def read_all(path: Path, codec: str) -> bytes:
    """The whole decompressed file (a compressed text file is one document)."""
    try:
        return b"".join(decompressed_blocks(path, codec))
    except Damaged as e:
        raise DataError(f"{path}: {e.what}") from e


def lines(path: Path, codec: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of the decompressed file, numbered from 1, line ends kept."""
    lineno, pending = 0, []  # pending: the pieces of a line that has not ended yet
    try:
        for block in decompressed_blocks(path, codec):
            if b"\n" not in block:  # a line longer than a block: joined once, when it ends
                pending.append(block)
                continue
            parts = block.split(b"\n")
            parts[0] = b"".join([*pending, parts[0]])
            pending = [parts.pop()]
            for line in parts:
                lineno += 1
                yield lineno, line + b"\n"
    except Damaged as e:
        after = f"; the lines before it (1-{lineno}) were read" if lineno else ""
        raise DataError(f"{path}: {e.what}{after}") from e
    tail = b"".join(pending)
    if tail:
        yield lineno + 1, tail
