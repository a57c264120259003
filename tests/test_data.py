"""trainer.data: tokenizers, sources, cache, packing, order, sharding, and every error path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import decoders, models, pre_tokenizers, trainers

from named.trainer.config import ConfigError
from named.trainer.data import (
    PAD_SEGMENT,
    ByteTokenizer,
    DataConfig,
    DataError,
    Sequences,
    Tokenizer,
    TokenStream,
    TrainBatches,
    _encode,
    atomic_write,
    build_data,
    eval_batches,
    load_tokenizer,
    num_eval_batches,
    stdlib_files,
    token_dtype,
    token_stream,
)

BYTE = ByteTokenizer()
EOS = BYTE.eos_id


def cfg(tmp_path, train, **kw):
    # no train sources: the default's (the tests that pass none read their sources themselves)
    return DataConfig(**({"train": [str(t) for t in train]} if train else {}), cache_dir=str(tmp_path / "cache"), **kw)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def stream_tokens(stream: TokenStream) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.int64) for a in stream.arrays])


class CountingTokenizer:
    """A byte tokenizer that counts encode calls (and can fail on demand)."""

    def __init__(self, fail_on_call=None, vocab_size=257):
        self.calls, self.fail_on_call = 0, fail_on_call
        self.vocab_size, self.eos_id, self.fingerprint = vocab_size, vocab_size - 1, f"count-{vocab_size}"

    def encode(self, text):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("killed mid-write")
        return list(text.encode())

    def decode(self, ids):
        return BYTE.decode(ids)


# --- tokenizers -------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld ✓ 🚀", "tab\tnew\nline\x00"])
def test_byte_tokenizer_round_trip(text):
    ids = BYTE.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert BYTE.decode(ids) == text
    assert BYTE.decode(ids + [EOS, 999, -3]) == text  # non-byte ids are dropped, never raise
    assert isinstance(BYTE, Tokenizer) and BYTE.vocab_size == 257 and EOS == 256


def test_byte_tokenizer_decodes_invalid_utf8_gracefully():
    cut = "é".encode()[:1]  # half of a two-byte character
    assert BYTE.decode(list(b"ab" + cut + b"cd")) == "ab\ufffdcd"


def _train_hf_tokenizer(folder: Path) -> Path:
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, héllo wörld"] * 20, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_hf_tokenizer_loaded_from_local_path(tmp_path):
    path = _train_hf_tokenizer(tmp_path / "tok")
    reference = HFTok.from_file(str(path))
    for spec in (str(path), str(path.parent)):  # the file, or the folder holding it
        tok = load_tokenizer(spec)
        assert isinstance(tok, Tokenizer)
        assert tok.vocab_size == reference.get_vocab_size() and tok.eos_id == reference.token_to_id("<|endoftext|>")
        text = "the lazy fox, héllo ✓"
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids
        assert tok.decode(tok.encode(text)) == text
        assert tok.eos_id not in tok.encode("a <|endoftext|> b")  # a literal in the text is just text
        assert tok.decode(tok.encode("ok") + [tok.eos_id, -1, 10**6]) == "ok"


def test_hf_tokenizer_eos_from_config_or_argument(tmp_path):
    path = _train_hf_tokenizer(tmp_path / "tok")
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert load_tokenizer(str(path)).eos_id == 0
    with pytest.raises(DataError, match="'<nope>'"):
        load_tokenizer(str(path), eos_token="<nope>")
    # different eos, different cache identity
    assert load_tokenizer(str(path)).fingerprint != load_tokenizer(str(path), eos_token="a").fingerprint


def test_missing_or_unreadable_tokenizer_names_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "tokenizer.json"
    with pytest.raises(DataError, match="nowhere/tokenizer.json"):
        load_tokenizer(str(missing))
    bad = write(tmp_path / "bad" / "tokenizer.json", "{not json")
    with pytest.raises(DataError, match=str(bad)):
        load_tokenizer(str(bad))
    with pytest.raises(DataError, match=str(missing)):  # through the config, before any data work
        build_data(DataConfig(train=[str(tmp_path / "x.txt")], tokenizer=str(missing), cache_dir=str(tmp_path / "c")))


# --- sources ----------------------------------------------------------------------------


def test_text_files_and_globs(tmp_path):
    write(tmp_path / "d" / "b.txt", "cd")
    write(tmp_path / "d" / "a.txt", "ab")
    write(tmp_path / "d" / "sub" / "c.txt", "é")
    write(tmp_path / "d" / "empty.txt", "")  # no tokens, and no lone eos either
    stream = token_stream([str(tmp_path / "d" / "**" / "*.txt")], BYTE, cfg(tmp_path, []))
    expected = [*b"ab", EOS, *b"cd", EOS, *"é".encode(), EOS]  # sorted: a, b, empty, sub/c
    assert stream_tokens(stream).tolist() == expected
    assert stream.arrays[0].dtype == np.uint16


def test_jsonl_source(tmp_path):
    lines = [json.dumps({"text": "one", "id": 1}), "", json.dumps({"text": "two"})]
    f = write(tmp_path / "docs.jsonl", "\n".join(lines) + "\n")
    stream = token_stream([str(f)], BYTE, cfg(tmp_path, []))
    assert stream_tokens(stream).tolist() == [*b"one", EOS, *b"two", EOS]


@pytest.mark.parametrize(
    "bad, culprit",
    [('{"text": "ok"}\n{broken\n', ":2: not valid JSON"), ('{"text": 3}\n', ":1: expected"), ("[1]\n", ":1:")],
)
def test_jsonl_errors_name_file_and_line(tmp_path, bad, culprit):
    f = write(tmp_path / "bad.jsonl", bad)
    with pytest.raises(DataError, match=f"bad.jsonl{culprit}"):
        build_data(cfg(tmp_path, [f], seq_len=2))
    assert not any((tmp_path / "cache").iterdir())  # nothing half-written


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32"])
def test_npy_source(tmp_path, dtype):
    tokens = np.array([1, 2, EOS, 3, EOS], dtype)
    np.save(tmp_path / "t.npy", tokens)
    stream = token_stream([str(tmp_path / "t.npy")], BYTE, cfg(tmp_path, []))
    assert isinstance(stream.arrays[0], np.memmap)
    assert stream_tokens(stream).tolist() == tokens.tolist()


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_source(tmp_path, dtype):
    tokens = np.arange(600, dtype=dtype) % 257
    tokens.tofile(tmp_path / "t.bin")
    stream = token_stream([str(tmp_path / "t.bin")], BYTE, cfg(tmp_path, [], bin_dtype=dtype))
    assert isinstance(stream.arrays[0], np.memmap) and stream.arrays[0].dtype == dtype
    assert stream_tokens(stream).tolist() == tokens.tolist()


def test_mixed_sources_keep_a_boundary_between_files(tmp_path):
    write(tmp_path / "a.txt", "xy")
    np.array([5, 6, 7], np.uint16).tofile(tmp_path / "p.bin")  # no trailing eos
    np.save(tmp_path / "q.npy", np.array([8, 9], np.uint16))
    stream = token_stream([str(tmp_path / n) for n in ("a.txt", "p.bin", "q.npy")], BYTE, cfg(tmp_path, []))
    assert stream_tokens(stream).tolist() == [*b"xy", EOS, 5, 6, 7, 8, 9]
    batch = Sequences(stream, 8).rows([0])
    assert batch.segment_ids[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]  # 7 -> 8 crosses files: new segment
    assert batch.loss_mask[0].tolist() == [1, 1, 0, 1, 1, 0, 1, 0]


def test_stdlib_default_corpus_is_deterministic_and_offline(tmp_path):
    files = stdlib_files(300_000)
    assert files == stdlib_files(300_000) and files and all(f.suffix == ".py" for f in files)
    assert not any(part in ("site-packages", "test") for f in files for part in f.parts)
    sizes = [f.stat().st_size for f in files]
    assert sum(sizes[:-1]) < 300_000 <= sum(sizes) or len(files) == len(stdlib_files(10**12))
    data = build_data(DataConfig(cache_dir=str(tmp_path / "c"), stdlib_bytes=300_000, seq_len=64))
    assert len(data.train) > 100 and len(data.validation) > 0
    assert "import" in data.tokenizer.decode(data.train.rows(np.arange(len(data.train))).input_ids.ravel())


# --- cache ------------------------------------------------------------------------------


def test_cache_is_reused_and_keyed_by_sources_and_tokenizer(tmp_path):
    src = write(tmp_path / "a.txt", "hello world")
    c = cfg(tmp_path, [src], seq_len=4)
    tok = CountingTokenizer()
    first = stream_tokens(token_stream(c.train, tok, c))
    assert tok.calls == 1
    [cached] = list((tmp_path / "cache").iterdir())
    mtime = cached.stat().st_mtime_ns
    again = stream_tokens(token_stream(c.train, tok, c))
    assert tok.calls == 1 and cached.stat().st_mtime_ns == mtime  # reused, not re-tokenised
    assert np.array_equal(first, again)

    os.utime(src, ns=(mtime + 10**9, mtime + 10**9))  # touched source: new key
    token_stream(c.train, tok, c)
    assert tok.calls == 2 and len(list((tmp_path / "cache").iterdir())) == 2
    token_stream(c.train, CountingTokenizer(vocab_size=300), c)  # other tokenizer: new key
    assert len(list((tmp_path / "cache").iterdir())) == 3


def test_cache_dtype_follows_vocab_size(tmp_path):
    assert token_dtype(257) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    src = write(tmp_path / "a.txt", "abc")
    stream = token_stream([str(src)], CountingTokenizer(vocab_size=70_000), cfg(tmp_path, []))
    assert stream.arrays[0].dtype == np.uint32 and stream_tokens(stream).tolist() == [*b"abc", 69_999]


def test_failed_cache_write_leaves_no_partial_file(tmp_path, monkeypatch):
    for i in range(5):
        write(tmp_path / f"{i}.txt", "some text " * 10)
    c = cfg(tmp_path, [tmp_path / "*.txt"], seq_len=4)
    monkeypatch.setattr(_encode, "ENCODE_CHUNK_CHARS", 50)  # one document per chunk: three are written when we fail
    partial_at_failure = []

    class DiesOnFourthDocument(CountingTokenizer):
        def encode(self, text):
            if self.calls == 3:
                partial_at_failure.extend(p.name for p in (tmp_path / "cache").iterdir())
            return super().encode(text)

    with pytest.raises(RuntimeError, match="killed mid-write"):
        token_stream(c.train, DiesOnFourthDocument(fail_on_call=4), c)
    assert len(partial_at_failure) == 1 and partial_at_failure[0].startswith(".partial-tokens-")
    assert list((tmp_path / "cache").iterdir()) == []  # the temp file is gone, no cache file appeared
    stream = token_stream(c.train, CountingTokenizer(), c)  # the next run builds it whole
    assert len(stream) == 5 * 101


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    target = tmp_path / "f.bin"
    with atomic_write(target) as f:
        f.write(b"good")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target) as f:
            f.write(b"half")
            raise KeyboardInterrupt
    assert target.read_bytes() == b"good" and os.listdir(tmp_path) == ["f.bin"]


# --- packing ----------------------------------------------------------------------------


def _reference_rows(files: list[list[int]], seq_len: int):
    """Segments and masks by walking documents one token at a time (independent of pack)."""
    flat, doc, d = [], [], 0
    for f in files:
        for t in f:
            flat.append(t)
            doc.append(d)
            if t == EOS:
                d += 1
        d += 1  # a file boundary always ends a document
    rows = []
    for r in range(len(flat) // seq_len):
        docs = doc[r * seq_len : (r + 1) * seq_len]
        relabel = {x: i for i, x in enumerate(dict.fromkeys(docs))}
        seg = [relabel[x] for x in docs]
        mask = [i + 1 < seq_len and docs[i + 1] == docs[i] for i in range(seq_len)]
        rows.append((flat[r * seq_len : (r + 1) * seq_len], seg, mask))
    return rows


@pytest.mark.parametrize("seq_len", [2, 5, 16])
def test_packing_matches_a_token_by_token_reference(seq_len):
    rng = np.random.default_rng(0)
    files = []
    for _ in range(3):
        docs = [list(rng.integers(0, 256, rng.integers(0, 9))) + [EOS] for _ in range(12)]
        files.append([t for d in docs for t in d][: -int(rng.integers(0, 2)) or None])  # some files end mid-document
    stream = TokenStream([np.array(f, np.uint16) for f in files], EOS)
    seqs = Sequences(stream, seq_len)
    ref = _reference_rows(files, seq_len)
    assert len(seqs) == len(ref)
    batch = seqs.rows(np.arange(len(seqs)))
    for r, (tokens, seg, mask) in enumerate(ref):
        assert batch.input_ids[r].tolist() == tokens
        assert batch.segment_ids[r].tolist() == seg
        assert batch.loss_mask[r].tolist() == mask
    assert batch.input_ids.dtype == np.int32 and batch.segment_ids.dtype == np.int32 and batch.loss_mask.dtype == bool


def test_segment_ids_change_exactly_after_eos():
    tokens = np.array([1, 2, EOS, 3, EOS, EOS, 4, 5, 6, EOS, 7, 8], np.uint16)
    b = Sequences(TokenStream([tokens], EOS), 6).rows([0, 1])
    assert b.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    assert b.loss_mask.tolist() == [[1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 1, 0]]
    assert np.array_equal(b.segment_ids[:, 1:] != b.segment_ids[:, :-1], b.input_ids[:, :-1] == EOS)


# --- order, resume, shards, split -------------------------------------------------------


def _seqs(n_rows=37, seq_len=4):
    tokens = np.arange(n_rows * seq_len + 3) % 250  # row r starts with token 4r % 250: rows are identifiable
    return Sequences(TokenStream([tokens.astype(np.uint16)], EOS), seq_len)


def test_order_is_a_seeded_permutation_per_epoch():
    seqs = _seqs()
    a = TrainBatches(seqs, batch_size=6, seed=3)
    assert a.batches_per_epoch == 6
    epoch0 = np.concatenate([a.global_indices(s) for s in range(6)])
    epoch1 = np.concatenate([a.global_indices(s) for s in range(6, 12)])
    assert len(set(epoch0.tolist())) == 36 and len(set(epoch1.tolist())) == 36  # no row twice in an epoch
    assert not np.array_equal(epoch0, epoch1)
    b = TrainBatches(seqs, batch_size=6, seed=3)
    for step in (0, 5, 6, 100):
        assert all(np.array_equal(x, y) for x, y in zip(a.batch_at(step), b.batch_at(step)))
    assert not np.array_equal(TrainBatches(seqs, batch_size=6, seed=4).global_indices(0), a.global_indices(0))


def test_batch_at_any_step_equals_the_run_from_zero_without_replay(monkeypatch):
    # a resume asks for its step's batch directly (the loop calls batch_at(step)): the same rows as a
    # run that went through every step before it, and only that batch's rows are read
    seqs = _seqs()
    batches = TrainBatches(seqs, batch_size=4, seed=0)
    streamed = [batches.batch_at(step) for step in range(20)]  # crosses two epoch boundaries (9 batches each)
    fresh = TrainBatches(seqs, batch_size=4, seed=0)
    read = []
    real_rows = Sequences.rows
    monkeypatch.setattr(Sequences, "rows", lambda self, idx: read.append(len(idx)) or real_rows(self, idx))
    for k in (13, 0, 19, 9, 18):
        assert all(np.array_equal(x, y) for x, y in zip(fresh.batch_at(k), streamed[k]))
    assert read == [4] * 5  # each resume read exactly one batch's rows
    assert len({tuple(fresh.global_indices(k)) for k in range(9)}) == 9  # and the steps' batches differ


@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_process_shards_union_is_the_global_batch(process_count):
    seqs = _seqs()
    whole = TrainBatches(seqs, batch_size=8, seed=1)
    shards = [
        TrainBatches(seqs, batch_size=8, seed=1, process_index=p, process_count=process_count)
        for p in range(process_count)
    ]
    for step in (0, 3, 11):
        parts = [s.batch_at(step) for s in shards]
        assert all(p.input_ids.shape == (8 // process_count, 4) for p in parts)
        for field in range(3):
            assert np.array_equal(np.concatenate([p[field] for p in parts]), whole.batch_at(step)[field])


def test_process_reads_only_its_rows(monkeypatch):
    seqs = _seqs()
    asked = []
    real_rows = Sequences.rows
    monkeypatch.setattr(Sequences, "rows", lambda self, idx: asked.append(list(idx)) or real_rows(self, idx))
    shard = TrainBatches(seqs, batch_size=8, seed=1, process_index=1, process_count=2)
    shard.batch_at(2)
    assert asked == [shard.global_indices(2)[4:].tolist()]


def test_eval_batches_cover_every_row_once_and_pad(tmp_path):
    seqs = _seqs(n_rows=11)
    assert num_eval_batches(seqs, 4) == 3
    for process_count in (1, 2):
        per_proc = [
            list(eval_batches(seqs, batch_size=4, process_index=p, process_count=process_count))
            for p in range(process_count)
        ]
        assert [len(b) for b in per_proc] == [3] * process_count  # same count everywhere: no process waits
        steps = list(zip(*per_proc))  # steps[i][p]: process p's part of global batch i
        ids, seg, mask = (np.concatenate([part[f] for step in steps for part in step]) for f in range(3))
        assert ids.shape == (12, 4)
        assert np.array_equal(ids[:11], seqs.rows(np.arange(11)).input_ids)
        assert (seg[11:] == PAD_SEGMENT).all() and not mask[11:].any() and (seg[:11] >= 0).all()


def test_train_and_validation_are_disjoint(tmp_path):
    write(tmp_path / "a.txt", "abcdefghij" * 100)  # 1001 tokens -> 62 rows of 16
    data = build_data(cfg(tmp_path, [tmp_path / "a.txt"], seq_len=16, val_fraction=0.1))
    train, val = data.train, data.validation
    assert (len(train), len(val)) == (56, 6) and train.stream is val.stream
    train_span = set(range(train.first * 16, (train.first + len(train)) * 16))
    val_span = set(range(val.first * 16, (val.first + len(val)) * 16))
    assert not train_span & val_span
    seen = {i for s in range(20) for i in TrainBatches(train, batch_size=4, seed=0).global_indices(s)}
    assert seen <= set(range(len(train)))  # train batches never reach into validation rows
    assert build_data(cfg(tmp_path, [tmp_path / "a.txt"], seq_len=16, val_fraction=0.0)).validation is None


def test_separate_validation_sources(tmp_path):
    write(tmp_path / "t.txt", "t" * 99)
    write(tmp_path / "v.txt", "v" * 49)
    data = build_data(cfg(tmp_path, [tmp_path / "t.txt"], validation=[str(tmp_path / "v.txt")], seq_len=10))
    assert (len(data.train), len(data.validation)) == (10, 5)
    assert set(data.validation.rows(np.arange(5)).input_ids.ravel().tolist()) == {ord("v"), EOS}


# --- errors: each names its culprit, nothing left on disk --------------------------------


def _bad_bin(tmp_path):
    p = tmp_path / "odd.bin"
    p.write_bytes(b"\x01\x00\x02")
    return p


def _big_ids(tmp_path):
    p = tmp_path / "gpt2.bin"
    np.array([1, 2, 50256], np.uint16).tofile(p)
    return p


def _truncated_npy(tmp_path):
    p = tmp_path / "cut.npy"
    np.save(p, np.arange(100, dtype=np.uint16))
    p.write_bytes(p.read_bytes()[:-10])
    return p


def _float_npy(tmp_path):
    p = tmp_path / "floats.npy"
    np.save(p, np.zeros(10, np.float32))
    return p


def _garbage_npy(tmp_path):
    p = tmp_path / "garbage.npy"
    p.write_bytes(b"definitely not numpy")
    return p


def _negative_npy(tmp_path):
    p = tmp_path / "neg.npy"
    np.save(p, np.array([1, -5, 2], np.int32))
    return p


def _empty_texts(tmp_path):
    write(tmp_path / "e1.txt", "")
    write(tmp_path / "e2.txt", "")
    return tmp_path / "e*.txt"


def _empty_bin(tmp_path):
    p = tmp_path / "empty.bin"
    p.write_bytes(b"")
    return p


def _a_dir(tmp_path):
    (tmp_path / "folder").mkdir()
    return tmp_path / "folder"


ERROR_CASES = {
    "glob matches nothing": (lambda t: t / "nothing-*.txt", {}, "nothing-\\*.txt"),
    "missing file": (lambda t: t / "absent.txt", {}, "absent.txt"),
    "directory": (_a_dir, {}, "folder.*glob"),
    "bin size not a multiple": (_bad_bin, {}, "odd.bin.*multiple of 2"),
    "bin ids over vocab": (_big_ids, {}, "gpt2.bin.*50256.*257"),
    "npy truncated": (_truncated_npy, {}, "cut.npy.*truncated"),
    "npy not integers": (_float_npy, {}, "floats.npy.*float32"),
    "npy garbage": (_garbage_npy, {}, "garbage.npy"),
    "npy negative id": (_negative_npy, {}, "neg.npy.*-5"),
    "empty corpus": (_empty_texts, {}, "corpus is empty.*e1.txt"),
    "empty bin": (_empty_bin, {}, "empty.bin.*no tokens"),
    "shorter than a sequence": (
        lambda t: write(t / "short.txt", "abc"),
        {"seq_len": 64},
        "train data holds 4 tokens.*seq_len=64",
    ),
    "too short to split": (lambda t: write(t / "short.txt", "abc"), {"seq_len": 4}, "only 1 sequences.*val_fraction"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_data_raises_data_error_naming_the_culprit(tmp_path, case):
    make, kw, culprit = ERROR_CASES[case]
    src = make(tmp_path)
    before = {p for p in tmp_path.rglob("*")}
    with pytest.raises(DataError, match=culprit):
        build_data(cfg(tmp_path, [src], **kw))
    new_files = {p for p in tmp_path.rglob("*") if p.is_file()} - before
    if "short" in case:  # found only after tokenising: the complete cache stays, for a shorter seq_len
        assert [p.name.startswith("tokens-") for p in new_files] == [True]
    else:
        assert not new_files  # no cache file, no temp file


@pytest.mark.parametrize(
    "kw, culprit",
    [
        ({"seq_len": 1}, "data.seq_len.*1"),
        ({"val_fraction": 1.0}, "data.val_fraction"),
        ({"bin_dtype": "int8"}, "data.bin_dtype.*int8"),
    ],
)
def test_bad_config_raises_before_any_work(tmp_path, kw, culprit):
    with pytest.raises(ConfigError, match=culprit):
        cfg(tmp_path, ["stdlib"], **kw)
    with pytest.raises(ConfigError, match="data.seq_len must be >= 2, got 1"):
        Sequences(TokenStream([np.zeros(8, np.uint16)], EOS), 1)


def test_batch_and_process_errors():
    seqs = _seqs(n_rows=5)
    with pytest.raises(DataError, match="5 sequences.*batch of 8"):
        TrainBatches(seqs, batch_size=8, seed=0)
    with pytest.raises(DataError, match="batch size 4 is not divisible by the 3 processes"):
        TrainBatches(seqs, batch_size=4, seed=0, process_count=3)
    with pytest.raises(DataError, match="process_index 2"):
        TrainBatches(seqs, batch_size=4, seed=0, process_index=2, process_count=2)
    with pytest.raises(DataError, match="no data sources"):
        token_stream([], BYTE, DataConfig())


@pytest.mark.procs
def test_data_imports_no_models_and_no_training_stack():
    # named.trainer.data sits under the named namespace, so jax is already imported with
    # `named`; what the data layer must not pull in is model code or the training stack.
    code = (
        "import sys, named.trainer; before = set(sys.modules); import named.trainer.data; "
        "bad = {m for m in set(sys.modules) - before if m.startswith('named.models') "
        "or m.split('.')[0] in ('optax', 'tensorstore', 'draccus')}; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


_HOST = """
import sys
import numpy as np
from named.trainer.data import ByteTokenizer, DataConfig, Sequences, TrainBatches, build_data

p, n, corpus, cache, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
asked = []
rows = Sequences.rows
Sequences.rows = lambda self, idx: asked.append(np.asarray(idx).copy()) or rows(self, idx)
data = build_data(DataConfig(train=[corpus], cache_dir=cache, seq_len=16, val_fraction=0), ByteTokenizer())
batches = TrainBatches(data.train, batch_size=8, seed=5, process_index=p, process_count=n)
got = [batches.batch_at(step) for step in range(3)]
np.savez(out, asked=np.stack(asked), **{f"{k}{s}": b[k] for s, b in enumerate(got) for k in range(3)})
"""


@pytest.mark.procs
def test_two_hosts_each_read_their_own_share_of_a_shared_cache(tmp_path):
    """Two processes (hosts) open one cache folder, built beforehand (named-data build): neither
    tokenises nor writes anything, and each reads only its block of rows of every global batch."""
    from _procs import run_workers

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i}: " + "words " * (i % 9) + "\n" for i in range(400)))
    cache = tmp_path / "shared"
    cfg = DataConfig(train=[str(corpus)], cache_dir=str(cache), seq_len=16, val_fraction=0)
    whole = TrainBatches(build_data(cfg, BYTE).train, batch_size=8, seed=5)
    [built] = cache.iterdir()
    before = built.stat()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [["-c", _HOST, str(p), "2", str(corpus), str(cache), str(tmp_path / f"host{p}.npz")] for p in range(2)]
    codes, outs = run_workers(argv, env, timeout=120)
    assert codes == [0, 0], outs
    assert list(cache.iterdir()) == [built] and built.stat().st_mtime_ns == before.st_mtime_ns  # mapped, not rebuilt
    hosts = [np.load(tmp_path / f"host{p}.npz") for p in range(2)]
    for step in range(3):
        rows = whole.global_indices(step)
        for p, h in enumerate(hosts):
            assert h["asked"][step].tolist() == rows[4 * p : 4 * p + 4].tolist()  # its block of rows, no other
        for k, field in enumerate(whole.batch_at(step)):
            assert np.array_equal(np.concatenate([h[f"{k}{step}"] for h in hosts]), field)
