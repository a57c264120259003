"""Every input format gives the same tokens as the plain-text version of the same corpus.

One generated corpus (unicode, newlines inside documents, an empty document, a document
longer than a decompression block) is written as one ``.txt`` file per document (the
reference format) and in every other format; each must tokenise to exactly the ids of
``doc.encode() + [eos]`` for every non-empty document, in order.
"""

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from named.trainer.data import ByteTokenizer, DataConfig, _compressed, build_data, token_stream

BYTE = ByteTokenizer()


def make_docs(n: int = 240, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "data", "é", "naïve", "日本語", "🙂", "x=1;", '"quoted"', "tab\there", "back\\slash"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 120))).replace(" ;", "\n") for _ in range(n)]
    docs[3] = ""  # no tokens, and no lone eos, in every format
    docs[7] = "line one\nline two\n\nline four"
    docs[11] = "long " * 20_000  # one line over many decompressed blocks
    return docs


DOCS = make_docs()


def expected_ids(docs: list[str]) -> list[int]:
    """The independent reference: each non-empty document's UTF-8 bytes, then eos."""
    return [t for d in docs if d for t in (*d.encode(), BYTE.eos_id)]


def jsonl_bytes(docs, field="text") -> bytes:
    return "".join(json.dumps({"id": i, field: d, "meta": {"n": i}}) + "\n" for i, d in enumerate(docs)).encode()


def zstd_frames(data: bytes, parts: int = 1) -> bytes:
    cut = [len(data) * i // parts for i in range(parts + 1)]
    c = zstandard.ZstdCompressor(write_checksum=True)
    return b"".join(c.compress(data[a:b]) for a, b in zip(cut, cut[1:]))


def gzip_members(data: bytes, parts: int = 1) -> bytes:
    cut = [len(data) * i // parts for i in range(parts + 1)]
    return b"".join(gzip.compress(data[a:b]) for a, b in zip(cut, cut[1:]))


def save_to_disk_folder(folder: Path, table: pa.Table, shards: int) -> Path:
    """A folder laid out as ``datasets.Dataset.save_to_disk`` writes it (datasets 2.x/3.x):
    ``data-0000i-of-0000n.arrow`` Arrow IPC *stream* files, ``state.json`` listing them in
    ``_data_files``, and ``dataset_info.json`` with the features."""
    folder.mkdir(parents=True)
    cut = [table.num_rows * i // shards for i in range(shards + 1)]
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for name, a, b in zip(names, cut, cut[1:]):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            part = table.slice(a, b - a)
            for batch in part.to_batches(max_chunksize=50):
                writer.write_batch(batch)
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    info = {
        "citation": "",
        "description": "",
        "homepage": "",
        "license": "",
        "features": {
            name: {"dtype": "string" if name == "text" else "int64", "_type": "Value"} for name in table.column_names
        },
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2))
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """``{format: (spec, text_field)}``, every entry holding DOCS."""
    d = tmp_path_factory.mktemp("formats")
    out = {}
    plain = d / "plain"
    plain.mkdir()
    for i, doc in enumerate(DOCS):
        (plain / f"doc{i:04d}.txt").write_text(doc, encoding="utf-8")
        (plain / f"doc{i:04d}.txt.gz").write_bytes(gzip.compress(doc.encode()))
        (plain / f"doc{i:04d}.txt.zst").write_bytes(zstd_frames(doc.encode()))
    out["txt"] = (str(plain / "*.txt"), "text")
    out["txt.gz"] = (str(plain / "*.txt.gz"), "text")
    out["txt.zst"] = (str(plain / "*.txt.zst"), "text")
    raw = jsonl_bytes(DOCS)
    (d / "c.jsonl").write_bytes(raw)
    (d / "c.json").write_bytes(raw)  # JSON Lines under the other common name
    (d / "c.jsonl.gz").write_bytes(gzip_members(raw, 3))  # several members, as pigz writes
    (d / "c.json.gz").write_bytes(gzip.compress(raw))
    (d / "c.jsonl.zst").write_bytes(zstd_frames(raw, 3))  # several frames
    (d / "content.jsonl.zst").write_bytes(zstd_frames(jsonl_bytes(DOCS, "content")))
    for name in ("c.jsonl", "c.json", "c.jsonl.gz", "c.json.gz", "c.jsonl.zst"):
        out[name.removeprefix("c.")] = (str(d / name), "text")
    out["jsonl.zst, text_field"] = (str(d / "content.jsonl.zst"), "content")
    table = pa.table({"id": pa.array(range(len(DOCS)), pa.int64()), "text": pa.array(DOCS, pa.string())})
    pq.write_table(table, d / "c.parquet", row_group_size=37)  # several row groups
    pq.write_table(
        table.rename_columns(["id", "body"]).cast(pa.schema([("id", pa.int64()), ("body", pa.large_string())])),
        d / "body.parquet",
        row_group_size=100,
    )
    out["parquet"] = (str(d / "c.parquet"), "text")
    out["parquet, large_string text_field"] = (str(d / "body.parquet"), "body")
    with pa.OSFile(str(d / "c.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=64)
    out["arrow (IPC file)"] = (str(d / "c.arrow"), "text")
    out["save_to_disk folder"] = (str(save_to_disk_folder(d / "saved", table, shards=3)), "text")
    shards = d / "shards"
    shards.mkdir()
    half = len(DOCS) // 2
    (shards / "part-000.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(DOCS[:half])))
    (shards / "sub").mkdir()
    (shards / "sub" / "part-001.jsonl.zst").write_bytes(zstd_frames(jsonl_bytes(DOCS[half:])))
    (shards / "README.md").write_text("not data: skipped when a directory is expanded")
    (shards / "dataset_infos.json").write_text('{\n  "metadata": "skipped too"\n}')
    (shards / ".DS_Store").write_bytes(b"\0\1")
    out["directory of shards"] = (str(shards), "text")
    out["glob over shards"] = (str(shards / "**" / "part-*"), "text")
    return out


def tokens_of(spec: str, field: str, cache: Path) -> list[int]:
    stream = token_stream([spec], BYTE, DataConfig(cache_dir=str(cache)), text_field=field)
    return np.concatenate([np.asarray(a, np.int64) for a in stream.arrays]).tolist()


FORMATS = [
    "txt",
    "txt.gz",
    "txt.zst",
    "jsonl",
    "json",
    "jsonl.gz",
    "json.gz",
    "jsonl.zst",
    "jsonl.zst, text_field",
    "parquet",
    "parquet, large_string text_field",
    "arrow (IPC file)",
    "save_to_disk folder",
    "directory of shards",
    "glob over shards",
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_gives_the_plain_text_token_stream(corpus, fmt, tmp_path):
    spec, field = corpus[fmt]
    assert tokens_of(spec, field, tmp_path / "cache") == expected_ids(DOCS)


def test_plain_text_reference_is_the_expected_stream(corpus, tmp_path):
    # The reference format itself goes through the pre-existing text path; checked once here
    # so that every other format above is compared with a known-good stream.
    spec, _ = corpus["txt"]
    assert tokens_of(spec, "text", tmp_path / "c") == expected_ids(DOCS)


@pytest.mark.parametrize("fmt", ["txt.gz", "txt.zst", "jsonl.gz", "jsonl.zst", "directory of shards"])
def test_compressed_formats_with_tiny_blocks(corpus, fmt, monkeypatch, tmp_path):
    # 101 compressed bytes per read: headers, members, frames and lines all straddle reads.
    monkeypatch.setattr(_compressed, "BLOCK_BYTES", 101)
    spec, field = corpus[fmt]
    assert tokens_of(spec, field, tmp_path / "c") == expected_ids(DOCS)


def test_named_source_passes_its_text_field_through_the_config(corpus, tmp_path):
    spec, field = corpus["jsonl.zst, text_field"]
    cfg = DataConfig(
        train=[{"name": "only", "paths": [spec], "text_field": field}],
        seq_len=16,
        val_fraction=0.0,
        cache_dir=str(tmp_path / "c"),
    )
    data = build_data(cfg, BYTE)
    got = np.concatenate([np.asarray(a, np.int64) for a in data.train.stream.arrays]).tolist()
    assert got == expected_ids(DOCS)


def test_changing_the_text_field_changes_the_cache_key(tmp_path):
    table = pa.table({"a": ["first"], "b": ["second"]})
    pq.write_table(table, tmp_path / "t.parquet")
    cache = tmp_path / "cache"
    assert tokens_of(str(tmp_path / "t.parquet"), "a", cache) == expected_ids(["first"])
    assert tokens_of(str(tmp_path / "t.parquet"), "b", cache) == expected_ids(["second"])
    assert len(list(cache.iterdir())) == 2


def test_parquet_is_read_one_row_group_at_a_time(corpus, monkeypatch, tmp_path):
    # Lazily: the reader asks pyarrow for one row group per call, never the whole table.
    asked = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *a, **kw):
        asked.append(tuple(kw.get("row_groups") or ()))
        return real(self, *a, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(pq.ParquetFile, "read", lambda *a, **k: pytest.fail("read the whole file"))
    spec, _ = corpus["parquet"]
    assert tokens_of(spec, "text", tmp_path / "c") == expected_ids(DOCS)
    assert asked == [(g,) for g in range(-(-len(DOCS) // 37))]
