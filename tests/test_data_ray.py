"""Cache builds on a Ray cluster (``RayShards``): a local Ray of two CPUs, started once for the
module, writes the local build's cache byte for byte (the stdlib corpus; a mixture of Parquet files
cut at row groups and JSONL); a worker killed mid-shard is retried; a build that fails resumes
from its shards."""

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _ray_tokenizers import FailOn, KillOnce, Recording

from named.trainer.commands import cli
from named.trainer.data import (
    ByteTokenizer,
    ClusterError,
    DataConfig,
    DataError,
    RayShards,
    _shards,
    build_data,
    token_stream,
)

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,  # a Ray start is about 15 s here
    pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning"),  # Ray starts its processes; JAX is loaded, unused
]
TESTS = Path(__file__).resolve().parent
N_FILES = 6


def shard_everything(monkeypatch) -> None:
    """The corpora here are small: built from shards all the same (the reference builds, before this, in one pass)."""
    monkeypatch.setattr(_shards, "SHARDED_MIN_BYTES", 0)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # Imported here, not at the top: collecting this file (every pytest worker does, whatever -m
    # leaves out) then costs no Ray import, about 5 s of CPU.
    ray = pytest.importorskip("ray")
    # Ray's processes inherit this environment: its workers then import the tokenizers above by name.
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [before])])
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    yield
    ray.shutdown()


def caches(folder: Path) -> dict[str, bytes]:
    """Every file of a cache folder (a shard folder left behind would show here)."""
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_named_data_build_on_ray_of_the_stdlib_corpus_is_the_local_build(tmp_path, capsys, monkeypatch):
    flags = ["build", "--config", "gpt2_nano", "--data.stdlib_bytes", "300000", "--data.cache_dir"]
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    assert cli.main_data([*flags, str(local)]) == 0
    local_report = capsys.readouterr().out
    shard_everything(monkeypatch)
    assert cli.main_data([*flags, str(on_ray), "--ray", "auto"]) == 0  # "auto": the Ray this process started
    assert capsys.readouterr().out == local_report.replace(str(local), str(on_ray))  # the same splits
    assert len(caches(local)) == 1 and caches(on_ray) == caches(local)


def write_parquet(path: Path, column: str, docs: list[str], row_group_size: int) -> None:
    pq.write_table(pa.table({column: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group_size)


def test_a_ray_build_of_a_parquet_mixture_is_the_local_build(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    web = [f"page {i} " + "lorem ipsum é " * (i % 17 + 1) for i in range(600)]
    write_parquet(data / "web-0.parquet", "text", web[:400], row_group_size=50)  # 8 row groups
    write_parquet(data / "web-1.parquet", "text", web[400:], row_group_size=200)
    (data / "code.jsonl").write_text("".join(f'{{"content": "def f{i}(): return {i}"}}\n' for i in range(300)))
    write_parquet(data / "code.parquet", "content", [f"x{i} = {i} * 2" for i in range(300)], row_group_size=64)
    cfg = dict(
        train=[
            {"name": "web", "paths": [str(data / "web-*.parquet")], "weight": 3},
            {"name": "code", "paths": [str(data / "code.*")], "weight": 1, "text_field": "content"},
        ],
        seq_len=32,
    )
    build_data(DataConfig(**cfg, cache_dir=str(tmp_path / "local")), ByteTokenizer())  # one pass each, no shards
    shard_everything(monkeypatch)
    monkeypatch.setattr(_shards, "PIECE_BYTES", 2000)  # the larger Parquet files are cut at row groups
    jobs = []

    def recording_ray(todo, *args):
        jobs.extend(piece for piece, _ in todo)
        RayShards()(todo, *args)

    build_data(DataConfig(**cfg, cache_dir=str(tmp_path / "ray")), ByteTokenizer(), runner=recording_ray)
    local = caches(tmp_path / "local")
    assert len(local) == 2 and caches(tmp_path / "ray") == local
    cut = [p.row_groups for p in jobs if p.src.path.name == "web-0.parquet"]
    assert len(cut) > 1 and cut[0][0] == 0 and cut[-1][1] == 8  # several runs of row groups, covering all 8


@pytest.fixture
def corpus(tmp_path) -> tuple[str, bytes]:
    """Six text files (their glob), and the cache a single local pass makes of them."""
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(N_FILES):
        (d / f"f{i}.txt").write_text(f"file {i} é " + " ".join(str(i * 7919 % (j + 3)) for j in range(2000)))
    glob = str(d / "*.txt")
    token_stream([glob], ByteTokenizer(), DataConfig(cache_dir=str(tmp_path / "single")))
    [reference] = caches(tmp_path / "single").values()
    return glob, reference


def test_a_worker_killed_mid_shard_is_retried(corpus, tmp_path, monkeypatch):
    glob, reference = corpus
    shard_everything(monkeypatch)
    marker = tmp_path / "killed"
    cache = tmp_path / "c"
    with pytest.raises(ClusterError, match=r"f2\.txt failed on every try \(1\)"):  # no retries: the death is reported
        token_stream(
            [glob], KillOnce("file 2 ", marker), DataConfig(cache_dir=str(cache)), runner=RayShards(max_retries=0)
        )
    marker.unlink()
    token_stream([glob], KillOnce("file 2 ", marker), DataConfig(cache_dir=str(cache)), runner=RayShards())
    assert marker.exists()  # a worker died mid-shard ...
    assert list(caches(cache).values()) == [reference]  # ... and its task ran again, to the same bytes


def test_a_failed_ray_build_resumes_from_its_shards(corpus, tmp_path, monkeypatch):
    glob, reference = corpus
    shard_everything(monkeypatch)
    cache = tmp_path / "c"
    with pytest.raises(Exception, match="file 3"):
        token_stream([glob], FailOn("file 3 "), DataConfig(cache_dir=str(cache)), runner=RayShards())
    [folder] = [p for p in cache.iterdir() if p.name.startswith(".shards-")]
    kept = {int(p.stem) for p in folder.glob("0*.bin")}
    assert 3 not in kept
    log = tmp_path / "encoded"
    token_stream([glob], Recording(log), DataConfig(cache_dir=str(cache)), runner=RayShards())
    assert sorted(int(w) for w in log.read_text().split()) == sorted(set(range(N_FILES)) - kept)
    assert list(caches(cache).values()) == [reference]


def test_bad_input_in_a_ray_task_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    shard_everything(monkeypatch)
    for i in range(3):
        (tmp_path / f"d{i}.txt").write_bytes(b"fine text " * 50 if i != 1 else b"bad \xff byte")
    with pytest.raises(DataError, match=r"d1\.txt:1: not valid UTF-8"):
        token_stream(
            [str(tmp_path / "d*.txt")], ByteTokenizer(), DataConfig(cache_dir=str(tmp_path / "c")), runner=RayShards()
        )
    assert list((tmp_path / "c").iterdir()) == []
