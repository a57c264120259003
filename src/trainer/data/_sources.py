"""Where documents come from: text, JSONL, Parquet, Arrow, pre-tokenised arrays, the stdlib corpus.

A *source spec* is a string: a path, a glob (``data/**/*.jsonl.zst``), a directory, or
``"stdlib"`` for the embedded default corpus. Each file's kind follows from its extension:

- ``.jsonl`` / ``.json`` (JSON Lines: one object per line; the document is its text field,
  ``text`` unless the source names another), also compressed: ``.jsonl.gz``, ``.json.gz``,
  ``.jsonl.zst``, ``.json.zst``, stream-decompressed (``_compressed``);
- ``.parquet`` and ``.arrow`` (one document per row of the text column, read lazily;
  ``_columnar``), and a folder written by ``datasets``' ``save_to_disk``;
- ``.npy`` and ``.bin``: pre-tokenised, taken as they are;
- ``.txt.gz`` / ``.txt.zst``, and any other file: a text file holding one document.

An extension that names a format we do not read (``.bz2``, ``.xz``, ``.zip``, ``.csv``,
``.pkl``, ...; or ``.gz``/``.zst`` around anything but ``.txt``/``.jsonl``/``.json``) is
refused naming the file. A directory expands to the data files under it (the kinds above
by extension, except plain ``.json``; hidden files and other names skipped), in sorted order. Text must be UTF-8:
a file with a NUL byte or invalid UTF-8 is refused (naming the file and line) rather than
trained on as replacement characters.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from ..config.data_section import STDLIB, DataError, check_data_key
from . import _columnar, _compressed

_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_SCAN_CHUNK = 1 << 24  # tokens per chunk when checking ids of a pre-tokenised file
# JSON escapes can produce lone surrogates, which no tokenizer can encode.
_SURROGATE = re.compile("[\ud800-\udfff]")

Kind = Literal["text", "jsonl", "parquet", "arrow", "npy", "bin"]
FIELD_KINDS = ("jsonl", "parquet", "arrow")  # the kinds whose documents are one field of a record
_KINDS: dict[str, Kind] = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".npy": "npy",
    ".bin": "bin",
    ".txt": "text",
}
_COMPRESSIBLE = {".jsonl": "jsonl", ".json": "jsonl", ".txt": "text"}
# Formats a user may reasonably point at that we do not read: refused rather than read as text.
_UNREAD = {
    ".bz2",
    ".xz",
    ".lz4",
    ".lzma",
    ".br",
    ".snappy",
    ".zip",
    ".tar",
    ".tgz",
    ".7z",
    ".rar",
    ".csv",
    ".tsv",
    ".feather",
    ".orc",
    ".avro",
    ".pkl",
    ".pickle",
    ".pt",
    ".pth",
    ".safetensors",
    ".h5",
    ".hdf5",
    ".tfrecord",
    ".msgpack",
    ".sqlite",
    ".db",
    ".xlsx",
}
SUPPORTED = ".txt, .jsonl, .json, .jsonl.gz, .json.gz, .txt.gz, .jsonl.zst, .txt.zst, .parquet, .arrow, .npy, .bin"


@dataclass(frozen=True)
class SourceFile:
    path: Path
    kind: Kind
    codec: str | None = None  # "gzip" or "zstd" for a compressed file
    text_field: str = "text"  # the field holding the document, for the FIELD_KINDS
    listed: Path | None = None  # the path as the source lists it, when ``path`` (resolved) differs

    @property
    def pretokenized(self) -> bool:
        return self.kind in ("npy", "bin")

    @property
    def shown(self) -> Path:
        """The file as messages name it: as listed (a Hub snapshot's link, not the blob it leads to)."""
        return self.listed or self.path


def resolve_sources(
    specs: Sequence[str], *, stdlib_bytes: int = 8_000_000, text_field: str = "text", chat: bool = False
) -> list[SourceFile]:
    """Expand specs into an ordered, de-duplicated file list; fail on anything missing or
    unreadable: for Parquet and Arrow files the text column (``chat``: the columns of chat
    records) is checked here, before any tokenising."""
    if not specs:
        raise DataError("no data sources given; list files, globs or 'stdlib' in data.train")
    files: list[Path] = []
    for spec in specs:
        if spec == STDLIB:
            files += stdlib_files(stdlib_bytes)
        elif glob.has_magic(spec):
            matched = sorted(Path(p) for p in glob.glob(str(Path(spec).expanduser()), recursive=True))
            matched = [p for p in matched if p.is_file()]
            if not matched:
                raise DataError(f"no files match the pattern {spec!r}")
            files += matched
        else:
            path = Path(spec).expanduser()
            if path.is_dir():
                files += _expand_dir(path, spec)
                continue
            if not path.exists():
                raise DataError(f"data source {spec!r} does not exist")
            if not path.is_file():
                raise DataError(f"data source {spec!r} is not a regular file")
            files.append(path)
    seen: set[Path] = set()
    out = []
    for listed in files:
        p = listed.resolve()
        if p not in seen:
            seen.add(p)
            kind, codec = _kind(listed)  # by the name listed: a Hub snapshot's files link to blobs named by hash
            shown = listed.absolute()
            src = SourceFile(p, kind, codec, text_field, shown if shown != p else None)
            if kind in ("parquet", "arrow") and chat:
                _columnar.chat_columns(p, kind, src.shown)
            elif kind in ("parquet", "arrow"):
                _columnar.check_text_column(p, kind, text_field, src.shown)
            out.append(src)
    return out


def _expand_dir(folder: Path, spec: str) -> list[Path]:
    """The data files under ``folder``: its own files in sorted order, then each sub-folder's
    (sorted); a ``save_to_disk`` folder gives its shards, in its own order."""
    if _columnar.is_saved_dataset(folder):
        return _columnar.saved_dataset_files(folder)
    out = data_files(folder)
    if not out:
        hint = f"{spec.rstrip('/')}/**/*.md"
        raise DataError(
            f"data source {spec!r} is a directory holding no data files ({SUPPORTED}); for text files of "
            f"another extension give a glob such as {hint!r}"
        )
    return out


def data_files(folder: Path) -> list[Path]:
    """The data files under ``folder`` (by extension; hidden names and linked folders skipped), sorted."""
    try:
        entries = sorted((p for p in folder.iterdir() if not p.name.startswith(".")), key=lambda p: p.name)
    except OSError as e:
        raise DataError(f"cannot list the data folder {str(folder)!r}: {e.strerror}") from e
    files = [p for p in entries if p.is_file() and _is_data_name(p.name)]
    for d in entries:
        if d.is_dir() and not d.is_symlink():  # a linked folder could lead back up: not followed
            files += _columnar.saved_dataset_files(d) if _columnar.is_saved_dataset(d) else data_files(d)
    return files


def stdlib_files(max_bytes: int) -> list[Path]:
    """The default corpus: this Python's standard-library ``*.py`` files (tests and
    site-packages left out), in sorted order, up to about ``max_bytes``.

    Needs no network and is the same on every run on one machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_STDLIB_DIRS]  # prunes the walk
        candidates += [Path(folder, n) for n in names if n.endswith(".py")]
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    out, total = [], 0
    for p in candidates:
        if total >= max_bytes:
            break
        out.append(p)
        total += p.stat().st_size
    if not out:
        raise DataError(
            f"no standard-library sources under {str(root)!r} for the 'stdlib' corpus; "
            "list your own files in data.train"
        )
    return out


def iter_documents(files: Sequence[SourceFile]) -> Iterator[tuple[str, str]]:
    """``(where, text)`` for each document of the files that are not pre-tokenised, in order;
    ``where`` is the file, ``file:line`` in JSONL, or the row group (batch) and row in Parquet (Arrow)."""
    for src in files:
        if src.kind == "text":
            raw = _compressed.read_all(src.path, src.codec) if src.codec else _read_bytes(src.path)
            yield str(src.path), _decode_text(raw, src.path)
        elif src.kind == "jsonl":
            for where, record in iter_records([src]):
                yield where, _record_text(record, where, src.text_field)
        elif src.kind in ("parquet", "arrow"):
            yield from _columnar.documents(src.path, src.kind, src.text_field, shown=src.shown)


def open_pretokenized(src: SourceFile, *, bin_dtype: str, vocab_size: int | None) -> np.ndarray:
    """Memory-map a ``.npy`` or ``.bin`` token file after checking its size, dtype and ids.

    ``vocab_size=None`` skips the id scan (benchmarks on synthetic files).
    """
    tokens = _map_npy(src.path) if src.kind == "npy" else _map_bin(src.path, bin_dtype)
    if vocab_size is not None:
        check_token_ids(tokens, vocab_size, src.path)
    return tokens


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start : start + _SCAN_CHUNK]
        i = first_out_of_range(chunk, vocab_size)
        if i is not None:
            raise DataError(
                f"{str(path)!r}: token id {int(chunk[i])} at position {start + i} is outside the tokenizer's "
                f"vocabulary of {vocab_size}; was the file made with another tokenizer?"
            )


def first_out_of_range(ids: np.ndarray, vocab_size: int) -> int | None:
    """Index of the first id outside ``[0, vocab_size)``, or None; a min and a max when all are in range."""
    if ids.size == 0 or (int(ids.max()) < vocab_size and (ids.dtype.kind == "u" or int(ids.min()) >= 0)):
        return None
    return int(np.argmax((ids >= vocab_size) | (ids < 0)))


def _kind(path: Path) -> tuple[Kind, str | None]:
    """The kind and the compression codec of a file, from its extension."""
    suffixes = [s.lower() for s in path.suffixes]
    last = suffixes[-1] if suffixes else ""
    if last in _compressed.CODECS:
        inner = suffixes[-2] if len(suffixes) > 1 else ""
        if inner not in _COMPRESSIBLE:
            raise DataError(
                f"{str(path)!r}: a {last} file of {inner or 'unknown'} content; compressed sources must be "
                f"text or JSON Lines ({SUPPORTED})"
            )
        return _COMPRESSIBLE[inner], _compressed.CODECS[last]
    if last in _UNREAD:
        raise DataError(f"{str(path)!r}: the extension {last} is not a data format we read; give one of {SUPPORTED}")
    return _KINDS.get(last, "text"), None


def _is_data_name(name: str) -> bool:
    """Whether a directory walk takes the file: plain ``.json`` only when named or globbed,
    since folders of data often hold JSON metadata (``dataset_infos.json``) beside it."""
    suffixes = [s.lower() for s in Path(name).suffixes]
    if not suffixes:
        return False
    if suffixes[-1] in _compressed.CODECS:
        return len(suffixes) > 1 and suffixes[-2] in _COMPRESSIBLE
    return suffixes[-1] in _KINDS and suffixes[-1] != ".json"


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror}") from e


def _decode_text(raw: bytes, path: Path) -> str:
    nul = raw.find(b"\0")
    if nul >= 0:
        raise DataError(
            f"{path}:{_line_at(raw, nul)}: a NUL byte (at byte {nul}); this looks like a binary file, not UTF-8 "
            "text; give text, .jsonl, .npy or .bin files"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}:{_line_at(raw, e.start)}: not valid UTF-8 (at byte {e.start}); convert the file to UTF-8"
        ) from e


def _line_at(raw: bytes, offset: int) -> int:
    return raw.count(b"\n", 0, offset) + 1


def _plain_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    try:
        f = path.open("rb")
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror}") from e
    lineno = 0
    try:
        with f:
            for lineno, line in enumerate(f, start=1):
                yield lineno, line
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r} after line {lineno}: {e.strerror}") from e


def iter_records(
    files: Sequence[SourceFile], on_bad: Callable[[DataError], None] | None = None
) -> Iterator[tuple[str, object]]:
    """``(file:line, value)`` for each non-blank line of JSONL files, ``(file: row group, row,
    record)`` for each row of Parquet and Arrow files (chat sources read whole records). A line
    that is not JSON raises, or is handed to ``on_bad`` and passed over."""
    for src in files:
        if src.kind in ("parquet", "arrow"):
            yield from _columnar.records(src.path, src.kind, src.shown)
            continue
        lines = _compressed.lines(src.path, src.codec) if src.codec else _plain_lines(src.path)
        for lineno, line in lines:
            if not line.strip():
                continue
            try:
                value = _json_line(line, src.path, lineno)
            except DataError as e:
                if on_bad is None:
                    raise
                on_bad(e)
                continue
            yield f"{src.path}:{lineno}", value


def _json_line(line: bytes, path: Path, lineno: int):
    try:
        return json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: not valid UTF-8 (at byte {e.start} of the line)") from e
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise DataError(f"{path}:{lineno}: not valid JSON ({type(e).__name__}: {e})") from e


def has_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def _record_text(record, where: str, field: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with a string {field!r} field, got {json_kind(record)}")
    text = record.get(field)
    if not isinstance(text, str):
        got = f"no {field!r} field" if field not in record else f"{field!r} is {json_kind(text)}"
        raise DataError(f"{where}: expected an object with a string {field!r} field; {got}")
    if has_surrogate(text):
        raise DataError(f"{where}: the {field!r} field holds a lone UTF-16 surrogate (\\ud800-\\udfff escape)")
    return text


def json_kind(value) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    kinds = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def _map_npy(path: Path) -> np.ndarray:
    try:
        with path.open("rb") as f:
            version = np.lib.format.read_magic(f)
            fmt = np.lib.format
            shape, _, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(f)
            offset = f.tell()
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{str(path)!r} is not a readable .npy file: {e}") from e
    if dtype.kind not in "iu" or len(shape) != 1:
        raise DataError(f"{str(path)!r} holds {dtype} of shape {shape}; a token file is a 1-D integer array")
    expected = offset + shape[0] * dtype.itemsize
    actual = path.stat().st_size
    if actual != expected:
        raise DataError(f"{str(path)!r} is truncated or corrupt: {actual} bytes, its header says {expected}")
    if shape[0] == 0:
        raise DataError(f"{str(path)!r} holds no tokens")
    return memmap_tokens(path, dtype, offset=offset, shape=shape)


def _map_bin(path: Path, dtype_name: str) -> np.ndarray:
    check_data_key("bin_dtype", dtype_name)
    dtype = np.dtype(dtype_name)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"cannot read data file {str(path)!r}: {e.strerror}") from e
    if size == 0:
        raise DataError(f"{str(path)!r} holds no tokens")
    if size % dtype.itemsize:
        raise DataError(
            f"{str(path)!r} is {size} bytes, not a multiple of {dtype.itemsize} (data.bin_dtype={dtype_name}); "
            "truncated, or written with another dtype?"
        )
    return memmap_tokens(path, dtype)


def memmap_tokens(path: Path, dtype: np.dtype, **kw) -> np.memmap:
    try:
        return np.memmap(path, dtype=dtype, mode="r", **kw)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot memory-map data file {str(path)!r}: {e}") from e
