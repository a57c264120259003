"""Bad data input: every case raises DataError naming the culprit and leaves no cache file.

Also the positive side of the same guarantees: a tokenizer with sparse ids gets a
vocabulary that covers its largest id, ids above 65535 round-trip through a uint32 cache,
and an id outside the vocabulary in tokenised text is refused when the cache is built.
"""

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers

from named.trainer.config import ConfigError, load_config
from named.trainer.data import DataConfig, DataError, HFTokenizer, _encode, build_data

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "config/gpt2_nano.yaml"
SPARSE = {"a": 0, "<unk>": 1, "</s>": 2, "b": 1000}  # 4 entries, largest id 1000
WIDE = {"a": 0, "<unk>": 1, "</s>": 2, "b": 70_000}  # an id that does not fit uint16


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def wordlevel(folder: Path, vocab: dict[str, int]) -> Path:
    tok = HFTok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def cfg(tmp_path: Path, train, **kw) -> DataConfig:
    kw = {"seq_len": 4, "val_fraction": 0.0, "cache_dir": str(tmp_path / "cache"), **kw}
    return DataConfig(train=[str(t) for t in train], **kw)


def cache_files(tmp_path: Path) -> list[str]:
    cache = tmp_path / "cache"
    return sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []


def stream_ids(data) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.int64) for a in data.train.stream.arrays])


def reference_ids(tokenizer_json: Path, eos: str, docs: list[str]) -> list[int]:
    """The ids straight from the ``tokenizers`` library: each document, then eos."""
    hf = HFTok.from_file(str(tokenizer_json))
    out = []
    for d in docs:
        out += hf.encode(d, add_special_tokens=False).ids + [hf.token_to_id(eos)]
    return out


class UndercountingTokenizer:
    """An HF tokenizer that reports ``get_vocab_size`` (entries, not ids) as its vocabulary:
    the pre-fix behaviour, which let ids past the model's embedding through."""

    def __init__(self, path: Path):
        self._inner = HFTokenizer(path)
        self.vocab_size = HFTok.from_file(str(path)).get_vocab_size(with_added_tokens=True)
        self.eos_id, self.fingerprint = self._inner.eos_id, "undercount-" + self._inner.fingerprint

    def encode(self, text):
        return self._inner.encode(text)

    def decode(self, ids):
        return self._inner.decode(ids)

    def __repr__(self):
        return f"UndercountingTokenizer(vocab_size={self.vocab_size})"


# --- vocabulary and id range ---------------------------------------------------------------


def test_sparse_ids_give_a_vocabulary_past_the_largest_id(tmp_path):
    path = wordlevel(tmp_path / "tok", SPARSE)
    raw = json.loads(path.read_text())
    largest = max([*raw["model"]["vocab"].values(), *(t["id"] for t in raw["added_tokens"])])
    tok = HFTokenizer(path)
    assert HFTok.from_file(str(path)).get_vocab_size(with_added_tokens=True) == 4  # the undercount
    assert tok.vocab_size == largest + 1 == 1001
    docs = ["a b a", "b b"]
    srcs = [write(tmp_path / f"{i}.txt", d) for i, d in enumerate(docs)]
    data = build_data(cfg(tmp_path, srcs), tok)
    ids = stream_ids(data)
    assert ids.tolist() == reference_ids(path, "</s>", docs) and ids.max() == 1000 < tok.vocab_size
    assert tok.decode([1000, 0]) == "b a"


def test_sparse_tokenizer_sizes_the_model_past_its_largest_id(tmp_path):
    from named.trainer.loop.train import build_run  # the trainer's own choice of model vocabulary

    path = wordlevel(tmp_path / "tok", SPARSE)
    src = write(tmp_path / "c.txt", "a b " * 200)
    args = [
        "--data.tokenizer",
        str(path),
        "--data.train",
        f"[{src}]",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--data.seq_len",
        "16",
        "--data.val_fraction",
        "0",
        "--trainer.train_batch_size",
        "8",
        "--trainer.sample_interval",
        "0",
        "--trainer.run_dir",
        str(tmp_path / "run"),
        "--model.n_layer",
        "1",
        "--model.n_head",
        "2",
        "--model.n_embd",
        "32",
        "--model.n_positions",
        "16",
    ]
    run = build_run(load_config(NANO, args))
    data, model_cfg = run.data, run.setup.model_cfg
    assert model_cfg.vocab_size >= 1001 and stream_ids(data).max() == 1000


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_build_rejects_ids_outside_an_undercounted_vocabulary(tmp_path, kind):
    tok = UndercountingTokenizer(wordlevel(tmp_path / "tok", SPARSE))
    assert tok.vocab_size == 4
    if kind == "text":
        srcs = [write(tmp_path / "ok.txt", "a a a"), write(tmp_path / "culprit.txt", "a b")]
        culprit = r"culprit\.txt"
    else:
        srcs = [write(tmp_path / "docs.jsonl", '{"text": "a a"}\n{"text": "a"}\n{"text": "b a"}\n')]
        culprit = r"docs\.jsonl:3"
    with pytest.raises(DataError, match=culprit + r": the tokenizer gave id 1000, outside its vocabulary of 4"):
        build_data(cfg(tmp_path, srcs), tok)
    assert cache_files(tmp_path) == []


def test_ids_above_uint16_round_trip_through_the_cache(tmp_path):
    path = wordlevel(tmp_path / "tok", WIDE)
    tok = HFTokenizer(path)
    assert tok.vocab_size == 70_001
    docs = ["a b b", "b a", "a a b a"]
    srcs = [write(tmp_path / f"{i}.txt", d) for i, d in enumerate(docs)]
    expected = reference_ids(path, "</s>", docs)
    first = stream_ids(build_data(cfg(tmp_path, srcs), tok))
    [name] = cache_files(tmp_path)
    assert name.endswith(".uint32.bin")
    on_disk = np.fromfile(tmp_path / "cache" / name, np.uint32)
    again = stream_ids(build_data(cfg(tmp_path, srcs), HFTokenizer(path)))  # read back from the cache
    assert cache_files(tmp_path) == [name]
    assert first.tolist() == on_disk.tolist() == again.tolist() == expected and 70_000 in expected


# --- config -------------------------------------------------------------------------------


def test_empty_train_list_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.train must be non-empty, got \[\]"):  # also a DataConfig in code
        cfg(tmp_path, [])
    with pytest.raises(ConfigError, match=r"data\.train"):  # the config layer refuses it before any data is read
        load_config(NANO, ["--data.train", "[]", "--data.cache_dir", str(tmp_path / "cache")])
    with pytest.raises(ConfigError, match=r"data\.train\[1\].*None"):
        DataConfig(train=["stdlib", None])
    with pytest.raises((DataError, ConfigError), match=r"data\.validation\[0\].*''"):
        DataConfig(validation=[""])
    assert cache_files(tmp_path) == []


# --- cache folder and disk failures -------------------------------------------------------


def test_cache_dir_that_is_a_file(tmp_path):
    src = write(tmp_path / "a.txt", "hello world")
    blocker = write(tmp_path / "cache", "not a folder")
    for cache_dir, culprit in [(blocker, r"cache'"), (blocker / "sub", r"cache/sub'")]:
        with pytest.raises(DataError, match=r"data cache folder '.*" + culprit + r".*data\.cache_dir"):
            build_data(cfg(tmp_path, [src], cache_dir=str(cache_dir)))
    assert blocker.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "cache"]


def test_cache_target_that_is_a_folder(tmp_path):
    src = write(tmp_path / "a.txt", "hello world")
    c = cfg(tmp_path, [src])
    build_data(c)
    [name] = cache_files(tmp_path)
    target = tmp_path / "cache" / name
    target.unlink()
    target.mkdir()  # the rename onto it fails
    with pytest.raises(DataError, match=f"cannot write the token cache '.*{name}'"):
        build_data(c)
    assert cache_files(tmp_path) == [name] and target.is_dir()  # no temp file beside it


class _FullDiskOs:
    """``os`` for the cache module, whose files take one write and then report a full disk."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def fdopen(fd, mode):
        f = os.fdopen(fd, mode)

        class Full:
            writes = 0

            def __getattr__(self, name):
                return getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def write(self, data):
                Full.writes += 1
                if Full.writes > 1:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return f.write(data)

        return Full()


def test_full_disk_names_the_cache_file_and_leaves_nothing(tmp_path, monkeypatch):
    srcs = [write(tmp_path / f"{i}.txt", "some text " * 10) for i in range(3)]
    monkeypatch.setattr(_encode, "ENCODE_CHUNK_CHARS", 50)  # one write per document: the second fails
    monkeypatch.setattr(_encode, "os", _FullDiskOs())
    with pytest.raises(DataError, match=r"cannot write the token cache '.*tokens-\w+\.uint16\.bin'.*No space left"):
        build_data(cfg(tmp_path, srcs))
    assert cache_files(tmp_path) == []
    monkeypatch.undo()
    assert len(build_data(cfg(tmp_path, srcs)).train.stream) == 3 * 101  # the next run builds it whole


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; covered by the cases above")
def test_read_only_cache_dir(tmp_path):
    src = write(tmp_path / "a.txt", "hello world")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache").chmod(0o500)
    try:
        with pytest.raises(DataError, match=r"cannot write the token cache '.*cache/tokens-"):
            build_data(cfg(tmp_path, [src]))
        assert cache_files(tmp_path) == []
    finally:
        (tmp_path / "cache").chmod(0o700)


def test_corrupt_cache_file_is_named(tmp_path):
    src = write(tmp_path / "a.txt", "hello world")
    c = cfg(tmp_path, [src])
    build_data(c)
    [name] = cache_files(tmp_path)
    (tmp_path / "cache" / name).write_bytes(b"\x01\x02\x03")  # odd size for uint16
    with pytest.raises(DataError, match=f"token cache '.*{name}' is corrupt.*delete it"):
        build_data(c)


# --- bad source files ---------------------------------------------------------------------


def _fifo(t: Path) -> Path:
    os.mkfifo(t / "pipe.txt")
    return t / "pipe.txt"


def _only_dirs(t: Path) -> Path:
    (t / "d1.txt").mkdir()
    return t / "d*.txt"


BAD_SOURCES = {
    "binary file as text": (
        lambda t: write(t / "blob.txt", b"hi\n\x1f\x8b\x08\x00\x00\x00"),
        r"blob\.txt:2: a NUL byte.*binary",
    ),
    "UTF-16 text": (lambda t: write(t / "wide.txt", "hello".encode("utf-16")), r"wide\.txt:1: .*NUL byte"),
    "invalid UTF-8 text": (
        lambda t: write(t / "latin.txt", "ok\ncaf\xe9\n".encode("latin-1")),
        r"latin\.txt:2: not valid UTF-8",
    ),
    "invalid UTF-8 in JSONL": (
        lambda t: write(t / "b.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
        r"b\.jsonl:2: not valid UTF-8",
    ),
    "JSONL line is an array": (
        lambda t: write(t / "l.jsonl", '{"text": "ok"}\n["text"]\n'),
        r"l\.jsonl:2: expected an object .* got an array",
    ),
    "JSONL line is a number": (
        lambda t: write(t / "n.jsonl", "3\n"),
        r"n\.jsonl:1: expected an object .* got a number",
    ),
    "JSONL line is null": (lambda t: write(t / "z.jsonl", "null\n"), r"z\.jsonl:1: .*got null"),
    "text field not a string": (
        lambda t: write(t / "t.jsonl", '{"text": ["a"]}\n'),
        r"t\.jsonl:1: .*'text' is an array",
    ),
    "text field missing": (lambda t: write(t / "m.jsonl", '{"body": "a"}\n'), r"m\.jsonl:1: .*no 'text' field"),
    "JSONL nested too deep": (
        lambda t: write(t / "deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n"),
        r"deep\.jsonl:1: not valid JSON",
    ),
    "lone surrogate": (lambda t: write(t / "s.jsonl", '{"text": "a\\ud800b"}\n'), r"s\.jsonl:1: .*surrogate"),
    "directory given as a file": (lambda t: (t / "folder").mkdir() or t / "folder", r"'.*folder' is a directory"),
    "glob matching nothing": (lambda t: t / "*.parquet", r"no files match the pattern '.*\*\.parquet'"),
    "glob matching only folders": (_only_dirs, r"no files match the pattern '.*d\*\.txt'"),
    "fifo": (_fifo, r"pipe\.txt' is not a regular file"),
}


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_bad_source_raises_data_error_naming_it(tmp_path, case):
    make, culprit = BAD_SOURCES[case]
    src = make(tmp_path)
    ok = write(tmp_path / "fine.txt", "some fine text first")  # tokenised before the bad file is met
    with pytest.raises(DataError, match=culprit):
        build_data(cfg(tmp_path, [ok, src]))
    assert cache_files(tmp_path) == []


class _BadEos:
    vocab_size, eos_id, fingerprint = 257, 257, "bad-eos"

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return ""

    def __repr__(self):
        return "BadEos()"


def test_tokenizer_eos_outside_its_vocabulary(tmp_path):
    src = write(tmp_path / "a.npy", b"")
    np.save(src, np.arange(10, dtype=np.uint16))  # pre-tokenised only: eos still pads evaluation rows
    with pytest.raises(DataError, match=r"BadEos\(\): eos id 257 is outside its vocabulary of 257"):
        build_data(cfg(tmp_path, [src]), _BadEos())
