"""Weighted mixtures: exact resume, disjoint process shares, exact block makeup, per-source
epochs and token counts, the config form, and the trainer's per-source logs.

The synthetic sources make every row say where it came from: row ``r`` of source ``k`` is
``seq_len`` copies of ``1000 * k + r``, so each check below reads the answer off the batch
itself rather than from the code under test.
"""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from named.trainer.config import load_config
from named.trainer.data import (
    ByteTokenizer,
    DataConfig,
    DataError,
    Mixture,
    Sequences,
    TokenStream,
    TrainBatches,
    build_data,
)
from named.trainer.data._mixture import BLOCK_ROWS

SEQ = 4
EOS = 65_535  # never in a synthetic row
NAMES, SIZES, WEIGHTS = ["tiny", "mid", "big"], [7, 60, 300], [1.0, 2.5, 4.5]
ROOT = Path(__file__).resolve().parents[1]


def labelled(k: int, rows: int) -> Sequences:
    tokens = np.repeat(np.arange(rows, dtype=np.uint32) + 1000 * k, SEQ)
    return Sequences(TokenStream([tokens], EOS), SEQ)


def mixture(sizes=SIZES, weights=WEIGHTS) -> Mixture:
    return Mixture(NAMES[: len(sizes)], [labelled(k, n) for k, n in enumerate(sizes)], weights)


def origin(batch) -> list[tuple[int, int]]:
    """(source, row) of every row of a batch, read off its tokens."""
    ids = batch.input_ids
    assert (ids == ids[:, :1]).all()
    return [divmod(int(t), 1000) for t in ids[:, 0]]


def same(a, b) -> bool:
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


B = 8
STEPS_PER_BLOCK = -(-BLOCK_ROWS // B)


@pytest.fixture(scope="module")
def uninterrupted():
    batches = TrainBatches(mixture(), batch_size=B, seed=3)
    return [batches.batch_at(s) for s in range(STEPS_PER_BLOCK + 40)]  # into a second block


def test_resume_at_any_step_gives_bitwise_the_same_batches(uninterrupted):
    for start in (1, 137, STEPS_PER_BLOCK - 1, STEPS_PER_BLOCK + 5):
        resumed = TrainBatches(mixture(), batch_size=B, seed=3)  # a new process: nothing carried over
        for step in range(start, min(start + 30, len(uninterrupted))):
            assert same(resumed.batch_at(step), uninterrupted[step]), (start, step)
    shuffled = TrainBatches(mixture(), batch_size=B, seed=3)
    for step in np.random.default_rng(0).permutation(len(uninterrupted))[:80]:  # random access
        assert same(shuffled.batch_at(int(step)), uninterrupted[step])


def test_another_seed_gives_another_order(uninterrupted):
    other = TrainBatches(mixture(), batch_size=B, seed=4)
    assert not all(same(other.batch_at(s), uninterrupted[s]) for s in range(20))


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_read_disjoint_rows_that_make_the_global_batch(uninterrupted, processes):
    shares = [
        TrainBatches(mixture(), batch_size=B, seed=3, process_index=p, process_count=processes)
        for p in range(processes)
    ]
    for step in (0, 9, STEPS_PER_BLOCK + 3):
        parts = [s.batch_at(step) for s in shares]
        assert all(len(p.input_ids) == B // processes for p in parts)
        joined = [np.concatenate(field) for field in zip(*parts)]
        assert same(joined, uninterrupted[step])
        index_sets = [set(s.indices(step).tolist()) for s in shares]
        assert sum(len(i) for i in index_sets) == B // processes * processes
        assert all(a.isdisjoint(b) for i, a in enumerate(index_sets) for b in index_sets[i + 1 :])


def test_each_block_holds_each_source_in_proportion(uninterrupted):
    counts = Counter(k for b in uninterrupted[:STEPS_PER_BLOCK] for k, _ in origin(b))
    total = STEPS_PER_BLOCK * B
    assert sum(counts.values()) == total
    for k, w in enumerate(WEIGHTS):
        assert abs(counts[k] - total * w / sum(WEIGHTS)) < 1  # the exact share, rounded
    first_steps = Counter(k for b in uninterrupted[:50] for k, _ in origin(b))
    assert set(first_steps) == {0, 1, 2}  # interleaved within the block, not source after source


def test_a_source_that_runs_out_starts_a_new_epoch_of_itself(uninterrupted):
    taken = [r for b in uninterrupted for k, r in origin(b) if k == 0]  # in the order they were drawn
    n = SIZES[0]
    epochs = [taken[i : i + n] for i in range(0, len(taken) - n + 1, n)]
    assert len(epochs) > 20
    assert all(sorted(e) == list(range(n)) for e in epochs)  # every row once per epoch
    assert len({tuple(e) for e in epochs}) > 1  # a new order per epoch


def test_tokens_by_source_counts_what_the_batches_held(uninterrupted):
    batches = TrainBatches(mixture(), batch_size=B, seed=3)
    for step in (0, 1, 77, STEPS_PER_BLOCK, STEPS_PER_BLOCK + 33):
        seen = Counter(k for b in uninterrupted[:step] for k, _ in origin(b))
        assert batches.tokens_by_source(step) == {f"tokens/{name}": seen[k] * SEQ for k, name in enumerate(NAMES)}
    assert TrainBatches(labelled(0, 40), batch_size=B, seed=0).tokens_by_source(5) == {}


def test_a_weight_too_small_for_a_block_is_refused():
    with pytest.raises(DataError, match="source 'tiny' has weight 1e-05, less than one row"):
        TrainBatches(mixture(weights=[1e-5, 1.0, 1.0]), batch_size=B, seed=0)


def _row_values(batch) -> tuple[float, float]:
    """A stand-in for the trainer's eval step: each loss token "costs" its input id."""
    mask = batch.loss_mask.astype(np.float64)
    return float((batch.input_ids * mask).sum()), float(mask.sum())


def _validation(sources: dict[str, Sequences]):
    from named.trainer.data import Data

    return Data(ByteTokenizer(), labelled(0, 8), Sequences.concat(list(sources.values())), sources)


def _exact(sources: dict[str, Sequences]) -> float:
    """The mean over every loss token of every validation row, read off the rows themselves."""
    parts = [_row_values(s.rows(np.arange(len(s)))) for s in sources.values()]
    return sum(t for t, _ in parts) / sum(c for _, c in parts)


def test_eval_loss_of_a_mixture_stands_for_every_source():
    """The overall eval loss with a few batches per source estimates the loss over all of them:
    sources whose rows are all alike give it exactly, where the sources' rows one after another
    would give the first source's (issue 30)."""
    from types import SimpleNamespace

    from named.trainer.loop.validation import eval_losses

    flat = {
        "small": Sequences(TokenStream([np.full(7 * SEQ, 10, np.uint32)], EOS), SEQ),
        "large": Sequences(TokenStream([np.full(60 * SEQ, 20, np.uint32)], EOS), SEQ),
    }
    for eval_batches in (1, 2, 0):
        got = eval_losses(
            _row_values, _validation(flat), SimpleNamespace(eval_batches=eval_batches, train_batch_size=4)
        )
        assert got == {"loss": pytest.approx(_exact(flat), rel=1e-12), "small/loss": 10.0, "large/loss": 20.0}
    # Rows that differ: with every batch evaluated, the overall loss is the loss over all rows.
    varied = {"a": labelled(1, 9), "b": labelled(2, 30)}
    got = eval_losses(_row_values, _validation(varied), SimpleNamespace(eval_batches=0, train_batch_size=4))
    assert got["loss"] == pytest.approx(_exact(varied), rel=1e-12)
    assert got["a/loss"] == pytest.approx(_exact({"a": varied["a"]}), rel=1e-12)


# --- through the config and build_data -------------------------------------------------------


def _files(tmp_path: Path) -> dict[str, Path]:
    docs = [f"document {i}: " + "abcdefgh" * (i % 5 + 1) for i in range(120)]
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pq.write_table(pa.table({"content": [d.upper() for d in docs]}), tmp_path / "code.parquet", row_group_size=50)
    return {"web": tmp_path / "web.jsonl", "code": tmp_path / "code.parquet"}


def test_build_data_gives_a_mixture_and_per_source_validation(tmp_path):
    f = _files(tmp_path)
    sources = [
        {"name": "web", "paths": [str(f["web"])], "weight": 3},
        {"name": "code", "paths": [str(f["code"])], "weight": 1, "text_field": "content"},
        {"name": "off", "paths": [str(tmp_path / "absent-but-unread.txt")], "weight": 0},
    ]
    common = {"seq_len": 16, "val_fraction": 0.1, "cache_dir": str(tmp_path / "cache")}
    data = build_data(DataConfig(train=sources, **common), ByteTokenizer())
    assert isinstance(data.train, Mixture) and data.train.names == ["web", "code"]
    # Each source alone, built as a plain source, is the reference for its split.
    alone = {s["name"]: build_data(DataConfig(train=[s], **common), ByteTokenizer()) for s in sources[:2]}
    for k, name in enumerate(["web", "code"]):
        ref = alone[name]
        assert len(data.train.sources[k]) == len(ref.train)
        rows = np.arange(len(ref.validation))
        assert same(data.validation_sources[name].rows(rows), ref.validation.rows(rows))
    n_web = len(alone["web"].validation)
    both = data.validation.rows(np.arange(len(data.validation)))
    assert same([x[:n_web] for x in both], alone["web"].validation.rows(np.arange(n_web)))
    assert same([x[n_web:] for x in both], alone["code"].validation.rows(np.arange(len(alone["code"].validation))))


def test_mixture_from_yaml_through_load_config(tmp_path):
    f = _files(tmp_path)
    yaml_text = (ROOT / "config/gpt2_nano.yaml").read_text()
    cfg_path = tmp_path / "mix.yaml"
    cfg_path.write_text(yaml_text)
    mix = (
        f"[{{name: web, paths: [{f['web']}], weight: 2}}, "
        f"{{name: code, paths: [{f['code']}], weight: 1, text_field: content}}]"
    )
    cfg = load_config(
        cfg_path, ["--data.train", mix, "--data.cache_dir", str(tmp_path / "cache"), "--data.seq_len", "16"]
    )
    assert [s.name for s in cfg.data.sources("train")] == ["web", "code"]
    data = build_data(cfg.data, ByteTokenizer())
    assert isinstance(data.train, Mixture) and data.train.weights == [2.0, 1.0]


def test_trainer_logs_tokens_and_eval_loss_per_source(tmp_path):
    from named.trainer.loop.train import train

    f = _files(tmp_path)
    mix = (
        f"[{{name: web, paths: [{f['web']}], weight: 3}}, "
        f"{{name: code, paths: [{f['code']}], weight: 1, text_field: content}}]"
    )
    over = {
        "trainer.num_train_steps": 2,
        "trainer.train_batch_size": 8,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 2,
        "trainer.eval_batches": 1,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(tmp_path / "run"),
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 16,
        "model.n_positions": 32,
        "data.train": mix,
        "data.seq_len": 16,
        "data.val_fraction": 0.1,
        "data.cache_dir": str(tmp_path / "cache"),
        "optimizer.warmup_steps": 0,
        "checkpoint.interval": 0,
        "checkpoint.save_at_end": "false",
        "tracker.console": "false",
    }
    args = [a for k, v in over.items() for a in (f"--{k}", str(v))]
    cfg = load_config(ROOT / "config/gpt2_nano.yaml", args)
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train/loss" in r]
    assert len(logged) == 2
    block = TrainBatches(build_data(cfg.data).train, batch_size=8, seed=cfg.trainer.seed)
    for r in logged:
        assert {k: v for k, v in r.items() if k.startswith("train/tokens/")} == {
            f"train/{k}": v for k, v in block.tokens_by_source(r["step"]).items()
        }
        assert sum(v for k, v in r.items() if k.startswith("train/tokens/")) == r["step"] * 8 * 16
    evals = [r for r in rows if "eval/loss" in r]
    assert evals and all(np.isfinite(r["eval/web/loss"]) and np.isfinite(r["eval/code/loss"]) for r in evals)
    for r in evals:  # both sources count in the overall loss, not the first one alone
        assert (
            min(r["eval/web/loss"], r["eval/code/loss"]) < r["eval/loss"] < max(r["eval/web/loss"], r["eval/code/loss"])
        )
