"""Hugging Face Hub ids for ``model.init_from_hf``, ``data.tokenizer`` and data sources
(``{hf_dataset: org/name, split: ...}``), read offline from a Hub cache laid out as
huggingface_hub lays it out: ``models--org--name/`` (or ``datasets--``) with ``blobs/<sha256>``,
``snapshots/<commit>/<file>`` linking to the blobs, and ``refs/<branch>`` holding a commit.

No network: ``HF_HUB_OFFLINE=1`` and the cache in a temporary folder. A cached id trains, the
config records the commit it resolved to, a revision (branch or commit) picks its snapshot, and
an id that is not cached, a split that is not there or a missing huggingface_hub is one error
naming the key, raised by ``load_config``, before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _chat_folder import make_chat_folder
from safetensors.numpy import load_file

import named as nm
from named.models import hf_state_dict
from named.trainer.config import ConfigError, DataError, load_config
from named.trainer.config.data_section import SourceSpec
from named.trainer.data import build_data
from named.trainer.data._hub import dataset_paths
from named.trainer.loop.checks import checked_setup
from named.trainer.loop.model_init import init_model
from named.trainer.loop.train import train

MAIN, V1, OTHER = "1" * 40, "2" * 40, "3" * 40  # commits
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."


def cache_repo(cache: Path, kind: str, repo: str, commit: str, files: dict[str, bytes], refs=("main",)) -> Path:
    """``files`` as the snapshot ``commit`` of the ``kind`` repository ``repo``; each of ``refs``
    (branches or tags) points at it. Returns the snapshot folder."""
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    for rel, content in files.items():
        blob = root / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


def _parquet(texts: list[str]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": texts}), sink)
    return sink.getvalue().to_pybytes()


def _jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, bytes]:
    folder = make_chat_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache, offline. huggingface_hub reads its environment once, at import, so
    its constants are set too (another test may have imported it already)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def hub(cache, model_files) -> Path:
    """The tiny model as ``org/tiny-llama`` and a corpus as ``org/corpus``: Parquet train shards,
    a JSON Lines validation split, a README that is no data; ``org/corpus@v1`` another commit."""
    cache_repo(cache, "model", "org/tiny-llama", MAIN, model_files)
    cache_repo(
        cache,
        "dataset",
        "org/corpus",
        MAIN,
        {
            "README.md": b"# corpus\n",
            "data/train-00000-of-00002.parquet": _parquet([TEXT] * 40),
            "data/train-00001-of-00002.parquet": _parquet([TEXT.upper()] * 40),
            "data/validation-00000-of-00001.jsonl": _jsonl([TEXT] * 10),
        },
    )
    cache_repo(cache, "dataset", "org/corpus", V1, {"train.jsonl": _jsonl(["v1 " * 50] * 30)}, refs=("v1",))
    return cache


def _config(tmp_path: Path, **more):
    over = {
        "model.init_from_hf": "org/tiny-llama",
        "trainer.num_train_steps": 1,
        "trainer.train_batch_size": 8,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(tmp_path / "run"),
        "optimizer.warmup_steps": 0,
        "data.train": "[{hf_dataset: org/corpus}]",
        "data.validation": "[{hf_dataset: org/corpus, name: held_out}]",
        "data.seq_len": 32,
        "data.cache_dir": str(tmp_path / "tokens"),
        "mesh.shape": "{data: 8}",
        "mesh.param_mapping": "{embed: data}",
        "tracker.console": "false",
        **more,
    }
    return load_config(None, [x for k, v in over.items() for x in (f"--{k}", str(v))])


@pytest.mark.slow  # end to end: pinned, tokenised, compiled on 8 devices, one step (about 15 s)
def test_a_cached_model_and_dataset_train_offline_and_the_commits_are_recorded(hub, model_files, tmp_path):
    cfg = _config(tmp_path)
    assert cfg.model.init_from_hf == cfg.data.tokenizer == f"org/tiny-llama@{MAIN}"
    assert cfg.data.train == [{"hf_dataset": f"org/corpus@{MAIN}"}]
    assert cfg.data.validation == [{"hf_dataset": f"org/corpus@{MAIN}", "name": "held_out"}]
    (train_source,) = cfg.data.sources("train")
    assert (train_source.name, train_source.split) == ("org/corpus", "train")
    assert cfg.data.sources("validation")[0].split == "validation"
    data = build_data(cfg.data)  # the splits are the dataset's: 80 train rows, 10 validation rows
    per_doc = len(data.tokenizer.encode(TEXT)) + 1  # and its end of document
    assert len(data.validation.stream) == 10 * per_doc
    assert len(data.train.stream) == 40 * per_doc + 40 * (len(data.tokenizer.encode(TEXT.upper())) + 1)
    result = train(cfg)
    assert len(result.losses) == 1
    assert abs(result.losses[0] - np.log(300)) < 0.5  # the pretrained model's loss (test_init_from_hf)
    recorded = load_config(tmp_path / "run" / "config.yaml")  # a rerun of the recorded config is exact
    assert recorded.model.init_from_hf == f"org/tiny-llama@{MAIN}"
    assert recorded.data.train == [{"hf_dataset": f"org/corpus@{MAIN}"}]
    # main moves on: the same id is now another snapshot, and resuming with it is refused naming the key
    cache_repo(hub, "model", "org/tiny-llama", OTHER, model_files)
    with pytest.raises(ConfigError, match=rf"model.init_from_hf .*@{MAIN}.* -> .*@{OTHER}"):
        train(_config(tmp_path))
    # the recorded commit resumes (here: finds the run already at its last step)
    again = train(_config(tmp_path, **{"model.init_from_hf": f"org/tiny-llama@{MAIN}"}))
    assert again.message.startswith("already at step 1")


def test_the_weights_are_the_snapshots(hub, tmp_path):
    cfg = _config(tmp_path)
    s = checked_setup(cfg)
    with nm.set_mesh(s.mesh):
        model = init_model(
            cfg, s.model_cls, s.model_cfg, param_mapping=s.param_mapping, mesh=s.mesh, key=jax.random.key(0)
        )
    saved = load_file(hub / "models--org--tiny-llama" / "snapshots" / MAIN / "model.safetensors")
    ours = hf_state_dict(model)
    for name, value in saved.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


def test_a_revision_picks_its_snapshot(hub):
    spec = SourceSpec("c", (), hf_dataset=f"org/corpus@{V1}")
    assert [Path(p).name for p in dataset_paths(spec)] == ["train.jsonl"]
    main = dataset_paths(SourceSpec("c", (), hf_dataset=f"org/corpus@{MAIN}"))
    assert [Path(p).name for p in main] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    cfg = load_config(None, ["--data.train", "[{hf_dataset: org/corpus@v1}]", "--model.type", "gpt2"])
    assert cfg.data.train == [{"hf_dataset": f"org/corpus@{V1}"}]  # the branch, pinned to its commit
    cfg = load_config(None, ["--data.train", f"[{{hf_dataset: org/corpus@{V1}}}]", "--model.type", "gpt2"])
    assert cfg.data.train == [{"hf_dataset": f"org/corpus@{V1}"}]


def test_splits_and_subsets_are_found_as_datasets_finds_them(cache):
    files = {
        "README.md": b"x",
        "en/train/0000.parquet": _parquet(["a"]),
        "en/dev.jsonl": _jsonl(["b"]),
        "en/eval-part0.jsonl.gz": b"",
        "fr/train/0000.parquet": _parquet(["c"]),
        "fr/pretraining_notes.txt": b"not a split of its own",
    }
    snapshot = cache_repo(cache, "dataset", "org/multi", MAIN, files)

    def paths(split, subset=None):
        spec = SourceSpec("m", (), hf_dataset=f"org/multi@{MAIN}", split=split, subset=subset)
        return [Path(p).relative_to(snapshot).as_posix() for p in dataset_paths(spec)]

    assert paths("train") == ["en/train/0000.parquet", "fr/train/0000.parquet"]
    assert paths("train", "en") == ["en/train/0000.parquet"]
    assert paths("validation", "en") == ["en/dev.jsonl"]
    assert paths("test", "en") == ["en/eval-part0.jsonl.gz"]
    assert paths("train", "fr") == ["fr/train/0000.parquet"]
    with pytest.raises(DataError, match=r"no files of the split 'validation'; its splits: train$"):
        paths("validation", "fr")
    with pytest.raises(DataError, match=r"has no folder 'de' \(subset\)"):
        paths("train", "de")
    # a repository whose paths name no split is all train
    cache_repo(cache, "dataset", "org/plain", MAIN, {"a.jsonl": _jsonl(["a"]), "b/c.parquet": _parquet(["c"])})
    plain = dataset_paths(SourceSpec("p", (), hf_dataset=f"org/plain@{MAIN}"))
    assert [Path(p).name for p in plain] == ["a.jsonl", "c.parquet"]
    with pytest.raises(DataError, match=r"no files of the split 'test'; its splits: train \(no file names a split\)"):
        dataset_paths(SourceSpec("p", (), hf_dataset=f"org/plain@{MAIN}", split="test"))


def test_a_snapshot_file_that_leads_outside_its_repository_is_refused(cache, tmp_path):
    snapshot = cache_repo(cache, "dataset", "org/escape", MAIN, {"train.jsonl": _jsonl(["ok"])})
    outside = tmp_path / "secret.jsonl"
    outside.write_bytes(_jsonl(["not the repository's"]))
    (snapshot / "train-1.jsonl").symlink_to(outside)
    with pytest.raises(DataError, match=r"train-1.jsonl resolves to .*secret.jsonl, which is not inside the folder"):
        dataset_paths(SourceSpec("e", (), hf_dataset=f"org/escape@{MAIN}"))


def test_what_is_not_cached_is_one_config_error_naming_the_key(hub, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"model.init_from_hf='org/absent': .*not in the Hub cache .*hf download org/absent`",
    ):
        _config(tmp_path, **{"model.init_from_hf": "org/absent"})
    with pytest.raises(
        ConfigError,
        match=r"data.train\[1\].hf_dataset=.org/corpus@v2.: .*hf download org/corpus --repo-type dataset --revision v2",
    ):
        _config(tmp_path, **{"data.train": "[{hf_dataset: org/corpus}, {hf_dataset: org/corpus@v2, name: b}]"})
    with pytest.raises(ConfigError, match=r"data.tokenizer='org/no-tokenizer': .*not in the Hub cache"):
        _config(tmp_path, **{"data.tokenizer": "org/no-tokenizer"})
    assert not (tmp_path / "run").exists()


def test_bad_source_keys_name_the_key(hub, tmp_path):
    for train_value, match in (
        ("[{hf_dataset: org/corpus, paths: [a.txt]}]", r"data.train\[0\]: give either paths .* or hf_dataset"),
        ("[{name: a, paths: [a.txt], split: train}]", r"data.train\[0\].split belongs to a Hugging Face dataset"),
        ("[{hf_dataset: 'org/a b'}]", r"data.train\[0\].hf_dataset must be a Hugging Face dataset id"),
        ("[{hf_dataset: org/corpus, subset: ../up}]", r"data.train\[0\].subset must be a folder"),
        ("[{hf_dataset: org/corpus, split: 'a b'}]", r"data.train\[0\].split must be a split name"),
    ):
        with pytest.raises((ConfigError, DataError), match=match):
            _config(tmp_path, **{"data.train": train_value})


def test_without_huggingface_hub_an_id_asks_for_the_extra(cache, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    local = tmp_path / "local.jsonl"
    local.write_bytes(_jsonl([TEXT]))
    # local paths never import it
    load_config(None, ["--model.type", "gpt2", "--data.train", f"[{{name: a, paths: [{local}]}}]"])
    with pytest.raises(ConfigError, match=r"model.init_from_hf='org/tiny-llama' is no local path.*named-jax\[hub\]"):
        _config(tmp_path)


def test_an_adapter_export_names_the_hub_base_by_id_and_commit():
    from named.trainer.commands.export import peft_base_model

    assert peft_base_model(f"org/tiny-llama@{MAIN}") == {"base_model_name_or_path": "org/tiny-llama", "revision": MAIN}
    assert peft_base_model("/models/tiny-llama") == {"base_model_name_or_path": "/models/tiny-llama"}


@pytest.mark.parametrize(
    "name, match",
    [
        ("RepositoryNotFoundError", r"no such local path, and the Hugging Face Hub has no model org/x .*set HF_TOKEN"),
        ("GatedRepoError", r".*Hub has no model org/x that this machine may read.*hf auth login"),
        ("RevisionNotFoundError", r".*the Hugging Face model org/x has no revision .v9."),
    ],
)
def test_what_the_hub_refuses_is_one_config_error_naming_the_key(cache, monkeypatch, name, match):
    import huggingface_hub
    from huggingface_hub import errors

    def refuse(*args, **kwargs):
        cls = getattr(errors, name)
        e = cls.__new__(cls)  # as the Hub's answer raises it, without an HTTP response to build
        Exception.__init__(e, "refused")
        raise e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    value = "org/x@v9" if name == "RevisionNotFoundError" else "org/x"
    with pytest.raises(ConfigError, match=rf"model.init_from_hf='{value}': {match}"):
        load_config(None, ["--model.init_from_hf", value])


def test_a_revision_is_a_name_never_a_path(hub, cache, tmp_path):
    # huggingface_hub reads a branch's commit from refs/<revision>: this revision reads a file
    # outside the Hub cache, which here names a snapshot that is there
    (cache.parent / "x").write_text(MAIN)
    for key, value in (
        ("model.init_from_hf", "org/tiny-llama@../../../x"),
        ("data.tokenizer", "org/tiny-llama@../../../x"),
        ("data.train[0].hf_dataset", "org/corpus@../../../x"),
    ):
        over = {key: value} if key != "data.train[0].hf_dataset" else {"data.train": f"[{{hf_dataset: '{value}'}}]"}
        with pytest.raises(
            (ConfigError, DataError), match=rf"{re.escape(key)}=.{re.escape(value)}.: the revision '../../../x' is not"
        ):
            _config(tmp_path, **over)
    assert not (tmp_path / "run").exists()
