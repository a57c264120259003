"""Columnar sources: Parquet files, Arrow IPC files, and folders written by ``datasets``' ``save_to_disk``.

Each is read with ``pyarrow`` a piece at a time (a row group of a Parquet file, a record
batch of an Arrow file, memory-mapped), never whole, and only the text column is decoded (for a
chat source, the columns of its records: ``CHAT_COLUMNS``, a ``messages`` list of structs read as
a list of dicts). Messages name a file as its source lists it (a Hub snapshot's path, never the
blob it links to).

A ``save_to_disk`` folder (``datasets`` 2.x and later) holds ``state.json``, whose
``_data_files`` lists the shards in order (``[{"filename": "data-00000-of-00001.arrow"}]``),
``dataset_info.json`` (the features), and the shards themselves: Arrow IPC *stream* files.
It is read without importing ``datasets``. A ``DatasetDict`` folder (``dataset_dict.json``
and one such folder per split) is refused with the split folders to choose from, rather than
training on every split at once. Shard names come from ``state.json``, so each is checked
to be a plain file name in the folder: nothing outside the folder the user named is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..config.data_section import DataError

_ROWS_PER_READ = 4096  # rows decoded at once from a Parquet row group
_ARROW_FILE_MAGIC = b"ARROW1"  # the random-access IPC format; the stream format has no magic


def is_saved_dataset(folder: Path) -> bool:
    has = (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    return has or (folder / "dataset_dict.json").is_file()


def saved_dataset_files(folder: Path) -> list[Path]:
    """The Arrow shards of a ``save_to_disk`` folder, in the order ``state.json`` gives."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if (p / "state.json").is_file())
        raise DataError(
            f"{str(folder)!r} holds a DatasetDict (splits: {', '.join(splits) or 'none'}); "
            f"name one split's folder, e.g. {str(folder / (splits[0] if splits else 'train'))!r}"
        )
    state = folder / "state.json"
    try:
        meta = json.loads(state.read_text("utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise DataError(
            f"{str(state)!r} cannot be read as JSON ({e}); is {str(folder)!r} a save_to_disk folder?"
        ) from e
    entries = meta.get("_data_files") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or not entries:
        raise DataError(f"{str(state)!r} has no '_data_files' list: not a folder written by datasets' save_to_disk")
    files = []
    for i, entry in enumerate(entries):
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise DataError(f"{str(state)!r}: _data_files[{i}] must name a file in the folder, got {entry!r}")
        path = folder / name
        if not path.is_file():
            raise DataError(f"{str(state)!r} lists {name!r}, which is not a file in {str(folder)!r}")
        files.append(path)
    return files


# The columns of each chat record kind (``_chat``), first found wins, and the optional ones read with it.
_CHAT_KINDS = (
    (("messages",), ("tools",)),
    (("conversations",), ("tools",)),
    (("prompt", "completion"), ()),
    (("instruction", "output"), ("input", "system")),
)


def check_text_column(path: Path, kind: str, field: str, shown: Path | None = None) -> None:
    """The file opens and has a string column ``field``: cheap (a footer or a header), so it
    runs for every file before any tokenising starts. ``shown``: the file as its source names it
    (a Hub snapshot's link, not the blob it leads to), for messages."""
    shown = shown or path
    schema = _schema(path, kind, shown)
    if field not in schema.names:
        chat = [c for c in ("messages", "conversations") if c in schema.names]
        hint = f", or read its {chat[0]!r} column as conversations with the source's format: chat" if chat else ""
        raise DataError(
            f"{shown}: no column {field!r} (its columns: {', '.join(schema.names) or 'none'}); "
            f"name the text column with the source's text_field{hint}"
        )
    kind_of = schema.field(field).type
    if not _is_string(kind_of):
        raise DataError(f"{shown}: column {field!r} holds {kind_of}, not strings; name a text column with text_field")


def chat_columns(path: Path, kind: str, shown: Path | None = None) -> list[str]:
    """The columns a chat source reads from the file's rows: those of the first record kind of
    ``_CHAT_KINDS`` whose columns it has (``messages`` over a ``prompt`` column beside it, as in
    UltraChat), with the optional ones it has; DataError naming the file when it has none. Cheap
    (a footer or a header): it runs for every file before any tokenising."""
    shown = shown or path
    names = _schema(path, kind, shown).names
    for needed, optional in _CHAT_KINDS:
        if all(c in names for c in needed):
            return [*needed, *(c for c in optional if c in names)]
    raise DataError(
        f"{shown}: no chat columns (its columns: {', '.join(names) or 'none'}); a chat source's rows need "
        "'messages' (a list of {role, content}), 'conversations' (ShareGPT), 'prompt' and 'completion', or "
        "'instruction' and 'output' (alpaca)"
    )


def records(path: Path, kind: str, shown: Path | None = None) -> Iterator[tuple[str, dict]]:
    """``(where, record)`` for each row of a chat file: its ``chat_columns`` as plain Python values
    (a list of structs as a list of dicts), null values left out."""
    shown = shown or path
    columns = chat_columns(path, kind, shown)
    for where, first, batch in _pieces(path, kind, columns, None, shown):
        try:
            values = {c: batch.column(c).to_pylist() for c in columns}
        except UnicodeDecodeError as e:
            raise DataError(f"{shown}: {where}, rows {first}-{first + batch.num_rows - 1}: invalid UTF-8 ({e})") from e
        for i in range(batch.num_rows):
            row = {c: _without_nulls(values[c][i]) for c in columns if values[c][i] is not None}
            yield f"{shown}: {where}, row {first + i}", row


def _without_nulls(value):
    """A value of a row with the null fields of its structs left out (Arrow gives every struct of a
    column every field: a message without ``tool_calls`` reads ``tool_calls: None``)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def documents(
    path: Path, kind: str, field: str, row_groups: range | None = None, shown: Path | None = None
) -> Iterator[tuple[str, str]]:
    """``(where, text)`` for each row of the text column (of ``row_groups`` only, for a Parquet
    file, if given); ``where`` names the file (``shown``, else ``path``), the row group or record
    batch and the row in it."""
    shown = shown or path
    for where, first, batch in _pieces(path, kind, [field], row_groups, shown):
        column = batch.column(field)
        if column.null_count:
            row = first + column.is_null().to_pylist().index(True)
            raise DataError(f"{shown}: {where}, row {row}: the {field!r} value is null")
        try:
            texts = column.to_pylist()
        except UnicodeDecodeError as e:
            raise DataError(
                f"{shown}: {where}, rows {first}-{first + len(column) - 1}: column {field!r} holds invalid UTF-8 ({e})"
            ) from e
        for row, text in enumerate(texts, start=first):
            yield f"{shown}: {where}, row {row}", text


def _pieces(path: Path, kind: str, columns: list[str], row_groups: range | None, shown: Path):
    if kind == "parquet":
        return _parquet_pieces(path, columns, row_groups, shown)
    return _arrow_pieces(path, columns, shown)


def row_group_bytes(path: Path) -> list[int]:
    """The compressed size of each row group of a Parquet file (its footer alone is read)."""
    meta = _open_parquet(path).metadata
    groups = (meta.row_group(g) for g in range(meta.num_row_groups))
    return [sum(rg.column(c).total_compressed_size for c in range(rg.num_columns)) for rg in groups]


def _parquet_pieces(path: Path, columns: list[str], row_groups: range | None, shown: Path):
    import pyarrow as pa

    pf = _open_parquet(path, shown)
    for group in range(pf.num_row_groups) if row_groups is None else row_groups:
        rows = 0
        try:
            for batch in pf.iter_batches(batch_size=_ROWS_PER_READ, row_groups=[group], columns=columns):
                yield f"row group {group}", rows, batch
                rows += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{shown}: row group {group} of {pf.num_row_groups} cannot be read: {e}") from e


def _arrow_pieces(path: Path, columns: list[str], shown: Path):
    import pyarrow as pa

    reader = _open_arrow(path, shown)
    i = 0
    while True:
        try:
            if isinstance(reader, pa.ipc.RecordBatchFileReader):
                if i == reader.num_record_batches:
                    return
                batch = reader.get_batch(i)
            else:
                batch = reader.read_next_batch()
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{shown}: record batch {i} cannot be read: {e}") from e
        yield f"record batch {i}", 0, batch.select(columns)
        i += 1


def _schema(path: Path, kind: str, shown: Path):
    return _open_parquet(path, shown).schema_arrow if kind == "parquet" else _open_arrow(path, shown).schema


def _open_parquet(path: Path, shown: Path | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, memory_map=True)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{shown or path}: not a readable Parquet file ({e})") from e


def _open_arrow(path: Path, shown: Path):
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path))
        magic = source.read(len(_ARROW_FILE_MAGIC))
        source.seek(0)
        return pa.ipc.open_file(source) if magic == _ARROW_FILE_MAGIC else pa.ipc.open_stream(source)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{shown}: not a readable Arrow IPC file ({e})") from e


def _is_string(arrow_type) -> bool:
    import pyarrow as pa

    checks = (pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", None))
    return any(check is not None and check(arrow_type) for check in checks)
