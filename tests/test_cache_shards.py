"""Sharded cache builds: worker processes give the single-pass cache byte for byte, and an
interrupted build (an exception, or SIGKILL) resumes from its finished shards."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from named.trainer.data import (
    ByteTokenizer,
    DataConfig,
    DataError,
    LocalShards,
    _shards,
    resolve_sources,
    token_stream,
)

ROOT = Path(__file__).resolve().parents[1]
N_FILES = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("shards")
    for i in range(N_FILES):
        (d / f"f{i}.txt").write_text(f"file {i} é " + " ".join(str(i * 7919 % (j + 3)) for j in range(3000)))
    return d


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> bytes:
    """The cache a single pass writes (the corpus is far below the sharding threshold)."""
    cache = tmp_path_factory.mktemp("single")
    token_stream([str(corpus / "*.txt")], ByteTokenizer(), DataConfig(cache_dir=str(cache)))
    [f] = cache.iterdir()
    return f.name, f.read_bytes()


def build(corpus: Path, cache: Path, tokenizer=None):
    return token_stream([str(corpus / "*.txt")], tokenizer or ByteTokenizer(), DataConfig(cache_dir=str(cache)))


@pytest.fixture
def sharded(monkeypatch):
    monkeypatch.setattr(_shards, "SHARDED_MIN_BYTES", 0)
    monkeypatch.setattr(_shards, "WORKERS", 1)


def cache_file(cache: Path) -> Path:
    [f] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    return f


def test_worker_processes_write_the_single_pass_cache(corpus, reference, sharded, monkeypatch, tmp_path):
    monkeypatch.setattr(_shards, "WORKERS", 2)
    build(corpus, tmp_path / "c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [reference[0]]  # shard folder gone
    assert cache_file(tmp_path / "c").read_bytes() == reference[1]


class Interrupted(Exception):
    pass


class ByteCounting(ByteTokenizer):
    """The byte tokenizer (same fingerprint, same cache key) that records which documents it
    encodes, and can stop on one."""

    def __init__(self, stop_at: str | None = None):
        self.seen, self.stop_at = [], stop_at

    def encode_batch(self, texts):
        for t in texts:
            if self.stop_at and t.startswith(self.stop_at):
                raise Interrupted(self.stop_at)
            self.seen.append(t.split(" ")[1])
        return super().encode_batch(texts)


def test_an_interrupted_build_resumes_from_its_shards(corpus, reference, sharded, tmp_path):
    cache = tmp_path / "c"
    with pytest.raises(Interrupted):
        build(corpus, cache, ByteCounting(stop_at="file 3 "))
    [folder] = [p for p in cache.iterdir() if p.name.startswith(".shards-")]
    assert sorted(p.name for p in folder.iterdir()) == ["000000.bin", "000001.bin", "000002.bin", "manifest.json"]
    again = ByteCounting()
    build(corpus, cache, again)
    assert again.seen == ["3", "4", "5"]  # only the files without a shard
    assert sorted(p.name for p in cache.iterdir()) == [reference[0]]
    assert cache_file(cache).read_bytes() == reference[1]


def test_shards_of_other_inputs_are_not_reused(corpus, reference, sharded, tmp_path):
    cache = tmp_path / "c"
    folder = cache / f".shards-{reference[0]}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text('{"files": "from another corpus"}')
    (folder / "000000.bin").write_bytes(b"\x01\x00" * 10)
    build(corpus, cache)
    assert cache_file(cache).read_bytes() == reference[1]


def test_a_source_changed_during_the_build_is_refused(corpus, sharded, tmp_path):
    class Touching(ByteTokenizer):
        def encode_batch(self, texts):
            os.utime(corpus / "f0.txt", ns=(1, 1))  # the first file changes after it was listed
            return super().encode_batch(texts)

    before = (corpus / "f0.txt").stat()
    try:
        with pytest.raises(DataError, match="changed while it was being tokenised"):
            build(corpus, tmp_path / "c", Touching())
    finally:
        os.utime(corpus / "f0.txt", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert list((tmp_path / "c").iterdir()) == []


def test_a_build_overtaken_by_another_process_uses_its_cache(corpus, reference, sharded, tmp_path):
    cache = tmp_path / "c"

    class Overtaken(ByteTokenizer):
        """Mid-shard, another builder of the same cache runs to the end and removes the shards."""

        def encode_batch(self, texts):
            if texts[0].startswith("file 2 "):
                build(corpus, cache)
            return super().encode_batch(texts)

    stream = build(corpus, cache, Overtaken())
    assert sorted(p.name for p in cache.iterdir()) == [reference[0]]
    assert cache_file(cache).read_bytes() == reference[1] and len(stream) == len(reference[1]) // 2


def test_a_build_starting_as_another_finishes_uses_its_cache(corpus, reference, sharded, monkeypatch, tmp_path):
    """Another builder of the same cache runs to the end (its file written, the shard folder
    removed) between this build making the folder and holding it: the late build tokenises
    nothing, and the folder it made is gone too."""
    cache, working_in = tmp_path / "c", _shards.working_in

    def overtaken(folder, make):
        def make_then_lose_the_race():
            make()
            monkeypatch.setattr(_shards, "working_in", working_in)  # the other builder works as usual
            build(corpus, cache)

        return working_in(folder, make_then_lose_the_race)

    monkeypatch.setattr(_shards, "working_in", overtaken)
    late = ByteCounting()
    stream = build(corpus, cache, late)
    assert late.seen == []
    assert sorted(p.name for p in cache.iterdir()) == [reference[0]]
    assert cache_file(cache).read_bytes() == reference[1] and len(stream) == len(reference[1]) // 2


def test_bad_input_in_a_worker_is_named_and_leaves_nothing(sharded, monkeypatch, tmp_path):
    monkeypatch.setattr(_shards, "WORKERS", 2)
    for i in range(3):
        (tmp_path / f"d{i}.txt").write_bytes(b"fine text " * 50 if i != 1 else b"bad \xff byte")
    with pytest.raises(DataError, match=r"d1\.txt:1: not valid UTF-8"):
        token_stream([str(tmp_path / "d*.txt")], ByteTokenizer(), DataConfig(cache_dir=str(tmp_path / "c")))
    assert list((tmp_path / "c").iterdir()) == []


_SLOW_BUILD = """
import sys, time
from named.trainer.data import ByteTokenizer, DataConfig, token_stream, _shards
_shards.SHARDED_MIN_BYTES, _shards.WORKERS = 0, 1

class Slow(ByteTokenizer):
    def encode_batch(self, texts):
        time.sleep(0.4)
        return super().encode_batch(texts)

token_stream([sys.argv[1]], Slow(), DataConfig(cache_dir=sys.argv[2]))
"""


@pytest.mark.procs
def test_a_build_killed_with_sigkill_resumes_to_the_same_cache(corpus, reference, sharded, tmp_path):
    cache = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, str(corpus / "*.txt"), str(cache)])
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(list(cache.glob(".shards-*/0*.bin"))) < 2:
            time.sleep(0.05)
        assert proc.poll() is None, "the build ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    done = len(list(cache.glob(".shards-*/0*.bin")))
    assert 2 <= done < N_FILES
    again = ByteCounting()
    build(corpus, cache, again)
    assert len(again.seen) == N_FILES - done
    assert cache_file(cache).read_bytes() == reference[1]
    assert sorted(p.name for p in cache.iterdir()) == [
        reference[0]
    ]  # the killed shard's temp file went with its folder


def test_a_large_parquet_file_is_cut_at_row_groups_into_the_same_cache(sharded, monkeypatch, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"row {i} " + "ünïcode " * (i % 13) for i in range(500)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "big.parquet", row_group_size=50)  # 10 row groups
    spec = [str(tmp_path / "big.parquet")]
    monkeypatch.setattr(_shards, "SHARDED_MIN_BYTES", 1 << 40)
    token_stream(spec, ByteTokenizer(), DataConfig(cache_dir=str(tmp_path / "single")))  # one pass
    monkeypatch.setattr(_shards, "SHARDED_MIN_BYTES", 0)
    monkeypatch.setattr(_shards, "PIECE_BYTES", 1500)
    pieces, tokenize = [], _shards.tokenize_pieces

    def recording(jobs, *args):
        pieces.extend(p.row_groups for p, _ in jobs)
        tokenize(jobs, *args)

    monkeypatch.setattr(_shards, "tokenize_pieces", recording)
    token_stream(spec, ByteTokenizer(), DataConfig(cache_dir=str(tmp_path / "cut")))
    assert len(pieces) > 2 and pieces[0][0] == 0 and pieces[-1][1] == 10
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))  # runs of row groups, in order, none left out
    assert cache_file(tmp_path / "cut").read_bytes() == cache_file(tmp_path / "single").read_bytes()


def test_a_host_tokenises_its_share_first_then_the_others_from_the_end(corpus, reference, sharded, tmp_path):
    cache = tmp_path / "c"
    folder = cache / f".shards-{reference[0]}"
    piece_4 = _shards.pieces(resolve_sources([str(corpus / "*.txt")]))[4]

    class BesideHostZero(ByteCounting):
        """Process 1 of 2; while it tokenises file 5, host 0 writes the shard of file 4."""

        def encode_batch(self, texts):
            if texts[0].startswith("file 5 "):
                _shards.write_shard(folder / "000004.bin", piece_4, ByteTokenizer(), np.dtype(np.uint16))
            return super().encode_batch(texts)

    host = BesideHostZero()
    token_stream([str(corpus / "*.txt")], host, DataConfig(cache_dir=str(cache)), runner=LocalShards(1, 2))
    assert host.seen == ["1", "3", "5", "2", "0"]  # its own share, then host 0's from the end, 4 skipped
    assert cache_file(cache).read_bytes() == reference[1]


_HOST_BUILD = """
import sys, time
from pathlib import Path
from named.trainer.data import ByteTokenizer, DataConfig, LocalShards, token_stream, _shards
_shards.SHARDED_MIN_BYTES, _shards.WORKERS = 0, 1
p, corpus, cache, log = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])

class Slow(ByteTokenizer):
    def encode_batch(self, texts):
        with log.open("a") as f:
            f.write(texts[0].split(" ")[1] + "\\n")
        time.sleep(0.5)
        return super().encode_batch(texts)

token_stream([corpus], Slow(), DataConfig(cache_dir=cache), runner=LocalShards(p, 2))
"""


@pytest.mark.procs
def test_two_hosts_building_one_shared_cache_split_its_pieces(corpus, reference, tmp_path):
    from _procs import run_workers

    cache = tmp_path / "shared"
    logs = [tmp_path / f"host{p}.log" for p in range(2)]
    argv = [["-c", _HOST_BUILD, str(p), str(corpus / "*.txt"), str(cache), str(logs[p])] for p in range(2)]
    codes, outs = run_workers(argv, {**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert codes == [0, 0], outs
    assert sorted(p.name for p in cache.iterdir()) == [reference[0]] and cache_file(cache).read_bytes() == reference[1]
    done = [log.read_text().split() if log.exists() else [] for log in logs]
    assert sorted({int(f) for d in done for f in d}) == list(range(N_FILES))
    assert len(done[0]) + len(done[1]) < 2 * N_FILES  # not every piece twice
    for p, d in enumerate(done):
        assert not d or int(d[0]) % 2 == p  # each began with its own share


def test_a_build_logs_its_progress(corpus, sharded, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(_shards, "LOG_EVERY_S", 0.0)  # a line per piece (a cluster job's log has no bar)
    with caplog.at_level("INFO", logger=_shards.__name__):
        build(corpus, tmp_path / "c")
    lines = [r.getMessage() for r in caplog.records if r.name == _shards.__name__]
    assert [line.split(" (")[0] for line in lines] == [f"tokenised {i} of {N_FILES} pieces" for i in range(1, 7)] + [
        f"tokenised {N_FILES} of {N_FILES} pieces"
    ]
    assert "tokens/s" in lines[-1]


def test_a_killed_builds_shards_are_removed_by_a_build_of_another_key(corpus, sharded, caplog, tmp_path):
    """Rebuilt under a new key (other files), nobody would finish the stopped build's shards: the
    next build removes them and names the folder; a folder a live build holds stays."""
    from named.trainer.data import working_in

    cache = tmp_path / "c"
    with pytest.raises(Interrupted):
        build(corpus, cache, ByteCounting(stop_at="file 3 "))
    [stopped] = [p for p in cache.iterdir() if p.name.startswith(".shards-")]
    live = cache / ".shards-tokens-live.uint16.bin"
    with working_in(live, live.mkdir), caplog.at_level("WARNING"):
        token_stream([str(corpus / "f0.txt")], ByteTokenizer(), DataConfig(cache_dir=str(cache)))
        assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == [live.name]
    assert f"removed {stopped}, left behind by a cache build that was stopped" in caplog.text
