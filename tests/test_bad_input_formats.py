"""Bad Parquet, Arrow, compressed and mixture input: a DataError naming the file (and the line,
row group or byte offset where it can be known), and nothing left in the cache folder."""

import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from named.trainer.data import ByteTokenizer, DataConfig, DataError, build_data

BYTE = ByteTokenizer()
# Random hex: barely compressible, so the compressed files span several read blocks (64 KiB).
LINES = b"".join(json.dumps({"text": random.Random(i).randbytes(60).hex()}).encode() + b"\n" for i in range(2000))


def _parquet(tmp_path: Path, name: str, table: pa.Table, **kw) -> Path:
    pq.write_table(table, tmp_path / name, **kw)
    return tmp_path / name


def _corrupt_middle(data: bytes) -> bytes:
    mid = len(data) * 3 // 4
    return data[:mid] + bytes(b ^ 0x5A for b in data[mid : mid + 64]) + data[mid + 64 :]


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    (tmp_path / name).write_bytes(data)
    return tmp_path / name


def _saved(tmp_path: Path, state: dict, *, dict_folder: bool = False) -> Path:
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "dataset_info.json").write_text("{}")
    (folder / "state.json").write_text(json.dumps(state))
    if dict_folder:
        (folder / "state.json").unlink()
        (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
        for split in ("train", "test"):
            (folder / split).mkdir()
            (folder / split / "state.json").write_text(json.dumps(state))
    return folder


GZ = gzip.compress(LINES)
ZST = zstandard.ZstdCompressor(write_checksum=True).compress(LINES)

CASES = {
    "parquet without the text column": (
        lambda t: _parquet(t, "notext.parquet", pa.table({"body": ["a", "b"]})),
        r"notext\.parquet: no column 'text' \(its columns: body\).*text_field",
    ),
    "parquet with a non-string text column": (
        lambda t: _parquet(t, "ints.parquet", pa.table({"text": [1, 2, 3]})),
        r"ints\.parquet: column 'text' holds int64, not strings",
    ),
    "parquet with a null text": (
        lambda t: _parquet(t, "nulls.parquet", pa.table({"text": ["a", "b", "c", None, "e"]}), row_group_size=2),
        r"nulls\.parquet: row group 1, row 1: the 'text' value is null",
    ),
    "truncated parquet": (
        lambda t: _write(
            t, "cut.parquet", (_parquet(t, "whole.parquet", pa.table({"text": ["abc"] * 99})).read_bytes()[:-30])
        ),
        r"cut\.parquet: not a readable Parquet file",
    ),
    "parquet with no rows": (
        lambda t: _parquet(t, "norows.parquet", pa.table({"text": pa.array([], pa.string())})),
        r"corpus is empty.*norows\.parquet",
    ),
    "corrupt .jsonl.gz": (  # deflate may decode damage into text; the CRC at the end catches it if JSON does not
        lambda t: _write(t, "bad.jsonl.gz", _corrupt_middle(GZ)),
        r"bad\.jsonl\.gz(:\d+: not valid JSON|: corrupt gzip data in compressed bytes)",
    ),
    ".jsonl.gz with a wrong CRC": (
        lambda t: _write(t, "crc.jsonl.gz", GZ[:-8] + bytes(b ^ 1 for b in GZ[-8:-4]) + GZ[-4:]),
        rf"crc\.jsonl\.gz: corrupt gzip data in compressed bytes 131072-{len(GZ)} \(.*incorrect data check\); "
        r"the lines before it \(1-\d+\) were read",
    ),
    "truncated .jsonl.gz": (
        lambda t: _write(t, "cut.jsonl.gz", GZ[: len(GZ) * 2 // 3]),
        rf"cut\.jsonl\.gz: truncated: the gzip stream stops at byte {len(GZ) * 2 // 3} .*lines before it \(1-\d+\)",
    ),
    "corrupt .jsonl.zst": (
        lambda t: _write(t, "bad.jsonl.zst", _corrupt_middle(ZST)),
        r"bad\.jsonl\.zst: corrupt zstd data in compressed bytes 65536-\d+",
    ),
    "truncated .txt.zst": (
        lambda t: _write(t, "cut.txt.zst", ZST[: len(ZST) // 2]),
        rf"cut\.txt\.zst: truncated: the zstd stream stops at byte {len(ZST) // 2}",
    ),
    "gzip that is not gzip": (
        lambda t: _write(t, "plain.txt.gz", b"just text, never compressed\n"),
        r"plain\.txt\.gz: corrupt gzip data in compressed bytes 0-28",
    ),
    "unknown extension": (
        lambda t: _write(t, "corpus.jsonl.bz2", b"BZh9"),
        r"corpus\.jsonl\.bz2.*\.bz2 is not a data format",
    ),
    "compressed unknown content": (
        lambda t: _write(t, "table.csv.gz", GZ),
        r"table\.csv\.gz.*\.gz file of \.csv content",
    ),
    "compressed parquet": (
        lambda t: _write(t, "x.parquet.zst", ZST),
        r"x\.parquet\.zst.*\.zst file of \.parquet content",
    ),
    "jsonl without the text field": (
        lambda t: _write(t, "other.jsonl", b'{"content": "x"}\n'),
        r"other\.jsonl:1: .*no 'text' field",
    ),
    "save_to_disk state naming a file outside the folder": (
        lambda t: _saved(t, {"_data_files": [{"filename": "../escape.arrow"}]}),
        r"state\.json.*_data_files\[0\] must name a file in the folder",
    ),
    "save_to_disk state naming a missing shard": (
        lambda t: _saved(t, {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}),
        r"lists 'data-00000-of-00001\.arrow', which is not a file",
    ),
    "DatasetDict folder": (
        lambda t: _saved(t, {"_data_files": []}, dict_folder=True),
        r"holds a DatasetDict \(splits: test, train\).*saved/test",
    ),
    "arrow file that is not arrow": (
        lambda t: _write(t, "x.arrow", b"not arrow at all"),
        r"x\.arrow: not a readable Arrow",
    ),
    "directory without data files": (
        lambda t: (t / "empty_dir").mkdir() or _write(t / "empty_dir", "notes.md", b"hi").parent,
        r"empty_dir' is a directory holding no data files",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_file_raises_data_error_naming_it(tmp_path, case):
    make, culprit = CASES[case]
    src = make(tmp_path)
    with pytest.raises(DataError, match=culprit):
        build_data(DataConfig(train=[str(src)], seq_len=4, val_fraction=0.0, cache_dir=str(tmp_path / "cache")), BYTE)
    cache = tmp_path / "cache"
    assert not cache.exists() or not list(cache.iterdir())  # no cache file, no temp file


def test_corrupt_shard_after_good_ones_leaves_nothing(tmp_path):
    # The first shards are tokenised into the temp file before the third turns out corrupt.
    for i in range(2):
        _write(tmp_path, f"part-{i}.jsonl.gz", GZ)
    _write(tmp_path, "part-2.jsonl.gz", GZ[:-8])  # only the trailer (CRC, length) is missing
    with pytest.raises(DataError, match=r"part-2\.jsonl\.gz: truncated"):
        build_data(
            DataConfig(
                train=[str(tmp_path / "part-*.jsonl.gz")],
                seq_len=4,
                val_fraction=0.0,
                cache_dir=str(tmp_path / "cache"),
            ),
            BYTE,
        )
    assert not list((tmp_path / "cache").iterdir())


def _named(tmp_path, *weights, **kw):
    src = _write(tmp_path, "a.jsonl", LINES)
    return [{"name": f"s{i}", "paths": [str(src)], "weight": w, **kw} for i, w in enumerate(weights)]


@pytest.mark.parametrize(
    "train, culprit",
    [
        (lambda t: _named(t, 0, 0), r"data\.train: the weights of the sources sum to 0"),
        (lambda t: _named(t, 1, -0.5), r"data\.train\[1\]\.weight must be a finite number >= 0, got -0\.5"),
        (lambda t: _named(t, 1, float("nan")), r"data\.train\[1\]\.weight must be a finite number"),
        (lambda t: _named(t, 1e308, 1e308), r"data\.train: the weights of the sources sum to inf .*scale them down"),
        (lambda t: _named(t, 1, "2"), r"data\.train\[1\]\.weight .* got '2'"),
        (lambda t: [_named(t, 1)[0], str(t / "a.jsonl")], r"data\.train\[1\] is .* other entries are named sources"),
        (lambda t: _named(t, 1, 1)[:1] * 2, r"data\.train\[1\]\.name 's0' is also the name of data\.train\[0\]"),
        (lambda t: [{"name": "a", "paths": []}], r"data\.train\[0\]\.paths must be"),
        (lambda t: [{"name": "", "paths": ["x"]}], r"data\.train\[0\]\.name must be a non-empty string"),
        (lambda t: [{"name": "a", "paths": ["x"], "wieght": 1}], r"data\.train\[0\]\.wieght .* did you mean weight"),
        (lambda t: [{"name": "a", "paths": ["x"], "text_field": ""}], r"data\.train\[0\]\.text_field"),
    ],
)
def test_bad_mixture_config_names_the_key(tmp_path, train, culprit):
    with pytest.raises(DataError, match=culprit):
        DataConfig(train=train(tmp_path), cache_dir=str(tmp_path / "cache"))


def test_validation_sources_take_no_weight(tmp_path):
    with pytest.raises(DataError, match=r"data\.validation\[0\]\.weight .*validation sources have no weight"):
        DataConfig(validation=[{"name": "v", "paths": ["x"], "weight": 1}])


def test_source_without_documents_is_named(tmp_path):
    good = _write(tmp_path, "good.jsonl", LINES)
    empty = _write(tmp_path, "empty.jsonl", b"\n\n")
    train = [{"name": "good", "paths": [str(good)]}, {"name": "hollow", "paths": [str(empty)]}]
    with pytest.raises(DataError, match=r"data\.train source 'hollow': the corpus is empty: no text in .*empty\.jsonl"):
        build_data(DataConfig(train=train, seq_len=4, val_fraction=0.0, cache_dir=str(tmp_path / "cache")), BYTE)


def test_missing_column_is_found_before_any_tokenising(tmp_path):
    good = _write(tmp_path, "good.jsonl", LINES)
    bad = _parquet(tmp_path, "bad.parquet", pa.table({"body": ["x"]}))
    train = [{"name": "good", "paths": [str(good)]}, {"name": "bad", "paths": [str(bad)]}]
    with pytest.raises(DataError, match=r"data\.train source 'bad': .*bad\.parquet: no column 'text'"):
        build_data(DataConfig(train=train, seq_len=4, val_fraction=0.0, cache_dir=str(tmp_path / "cache")), BYTE)
    assert not (tmp_path / "cache").exists()  # the good source was not tokenised first
