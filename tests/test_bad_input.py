"""Bad input fails fast, in our words, and leaves nothing behind.

Every case below raises an exception type of ours (ConfigError, DataError, a NamedError
such as AxisError or ShardingError, CheckpointError, CheckpointFormatError) whose message
names the culprit (the key, flag, file, tensor or axis), before anything is compiled (a
listener on JAX's compile events counts zero) and with nothing half-written on disk (the run
directory is never created, the token cache holds no partial file). Also here: the security
checks (no unpickling anywhere in src, safetensors headers size-checked before allocating,
no path from a config or a checkpoint leading outside the run directory).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from _compiles import compiles
from _procs import xla_flags
from safetensors.numpy import load_file, save_file

import named as nm
from named import models
from named.models import CheckpointFormatError, Gpt2Config, Gpt2LMHeadModel
from named.trainer import checkpoint as ckpt
from named.trainer.config import ConfigError, load_config
from named.trainer.data import DataError
from named.trainer.loop.optim import build_optimizer
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]
NANO = ROOT / "config/gpt2_nano.yaml"

# ---- compile counting --------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_compile():
    """Every test of this module: nothing at all is compiled while the bad input is rejected."""
    with compiles() as seen:
        yield
    assert seen == [], f"compiled {seen} before rejecting the input"


def _fails(exc_type, match: str, fn, *args, **kwargs):
    with pytest.raises(exc_type, match=match) as info:
        fn(*args, **kwargs)
    assert type(info.value).__module__.split(".")[0] == "named", type(info.value)
    print(f"{type(info.value).__name__}: {info.value}")
    return info.value


# ---- fixtures: a corpus and bad files --------------------------------------------------------

CORPUS = "\n".join(f"def f_{i}(x):\n    return x * {i} + {i % 5}\n" for i in range(300))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad-input")
    f = {"dir": d, "cache": d / "token-cache"}
    (d / "code.txt").write_text(CORPUS)
    (d / "empty.txt").write_text("")
    (d / "short.txt").write_text("x = 1\n")
    (d / "one_row.txt").write_text("a" * 40)
    (d / "sources").mkdir()
    np.arange(100, dtype=np.uint16).tofile(d / "odd.bin")
    with open(d / "odd.bin", "ab") as fh:
        fh.write(b"\x01")
    np.array([1, 2, 300, 4] * 50, dtype=np.uint16).tofile(d / "big_ids.bin")
    (d / "empty.bin").write_bytes(b"")
    (d / "bad_header.npy").write_bytes(b"\x93NUMPY\x01\x00garbage-not-a-header")
    np.save(d / "truncated.npy", np.arange(1000, dtype=np.uint16))
    (d / "truncated.npy").write_bytes((d / "truncated.npy").read_bytes()[:-10])
    np.save(d / "two_d.npy", np.zeros((10, 10), np.uint16))
    np.save(d / "floats.npy", np.zeros(100, np.float32))
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (d / "no_text.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    (d / "tok_dir").mkdir()
    (d / "tok_bad").mkdir()
    (d / "tok_bad" / "tokenizer.json").write_text("{not json")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    (d / "tok_no_eos").mkdir()
    Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(d / "tok_no_eos" / "tokenizer.json"))
    for name in (
        "code.txt",
        "empty.txt",
        "short.txt",
        "one_row.txt",
        "odd.bin",
        "big_ids.bin",
        "empty.bin",
        "bad_header.npy",
        "truncated.npy",
        "two_d.npy",
        "floats.npy",
        "bad.jsonl",
        "no_text.jsonl",
    ):
        f[name] = d / name
    return f


def _args(files, run_dir: Path, **over) -> list[str]:
    args = {
        "trainer.num_train_steps": 4,
        "trainer.train_batch_size": 8,
        "trainer.eval_interval": 0,
        "trainer.sample_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(run_dir),
        "model.n_layer": 1,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.n_positions": 64,
        "data.train": f"[{files['code.txt']}]",
        "data.seq_len": 32,
        "data.val_fraction": 0.0,
        "data.cache_dir": str(files["cache"]),
        "optimizer.warmup_steps": 0,
        "tracker.console": "false",
    }
    args.update({k: (v(files) if callable(v) else v) for k, v in over.items()})
    out = []
    for k, v in args.items():
        out += [f"--{k}", str(v)]
    return out


def _no_partial_files(files) -> None:
    cache = files["cache"]
    leftovers = [p.name for p in cache.iterdir() if p.name.startswith(".partial-")] if cache.exists() else []
    assert leftovers == [], leftovers


# ---- YAML files ---------------------------------------------------------------------------------

YAML_CASES = {
    "unknown section": ("trainr:\n  num_train_steps: 3\n", ConfigError, "trainr"),
    "unknown key": ("trainer:\n  num_trian_steps: 3\n", ConfigError, "num_trian_steps"),
    "unknown model key": ("model:\n  type: gpt2\n  n_layers: 3\n", ConfigError, "n_layers"),
    "unknown model type": ("model:\n  type: gpt3\n", ConfigError, "gpt3"),
    "wrong type: str for int": ("trainer:\n  num_train_steps: many\n", ConfigError, r"trainer\.num_train_steps.*many"),
    "wrong type: float for int": ("trainer:\n  num_train_steps: 2.5\n", ConfigError, r"trainer\.num_train_steps.*2\.5"),
    "wrong type: list for int": ("trainer:\n  train_batch_size: [1, 2]\n", ConfigError, r"trainer\.train_batch_size"),
    "wrong type: bool": ("trainer:\n  progress_bar: maybe\n", ConfigError, r"trainer\.progress_bar.*maybe"),
    "wrong type: str for float": (
        "optimizer:\n  learning_rate: fast\n",
        ConfigError,
        r"optimizer\.learning_rate.*fast",
    ),
    "wrong type: str for dict": ("mesh:\n  shape: data\n", ConfigError, r"mesh\.shape"),
    "wrong type in dict value": ("mesh:\n  shape: {data: x}\n", ConfigError, r"mesh\.shape\.data.*'x'"),
    "missing value": ("trainer:\n  num_train_steps:\n", ConfigError, r"trainer\.num_train_steps.*None"),
    "section not a mapping": ("trainer: 5\n", ConfigError, "section 'trainer'"),
    "empty file": ("", ConfigError, "is empty"),
    "comments only": ("# nothing here\n", ConfigError, "is empty"),
    "malformed YAML": ("trainer: [unclosed\n", ConfigError, r"not valid YAML at line 2"),
    "bad indentation": ("trainer:\n  seed: 1\n   log_interval: 2\n", ConfigError, r"not valid YAML at line 3"),
    "top level a list": ("- trainer\n- model\n", ConfigError, "mapping of sections"),
    "negative steps": ("trainer:\n  num_train_steps: -1\n", ConfigError, r"trainer\.num_train_steps.*-1"),
    "bad nan_policy": ("trainer:\n  nan_policy: ignore\n", ConfigError, r"trainer\.nan_policy.*ignore"),
    "bad precision": ("trainer:\n  precision: params=float33\n", ConfigError, r"trainer\.precision"),
    "bad schedule": ("optimizer:\n  schedule: sawtooth\n", ConfigError, r"optimizer\.schedule.*sawtooth"),
    "bad wandb mode": ("tracker:\n  wandb_mode: loud\n", ConfigError, r"tracker\.wandb_mode.*loud"),
    "data.seq_len": ("data:\n  seq_len: 1\n", ConfigError, r"data\.seq_len.*1"),
    "data.val_fraction": ("data:\n  val_fraction: 1.5\n", ConfigError, r"data\.val_fraction.*1\.5"),
    "data.bin_dtype": ("data:\n  bin_dtype: float32\n", ConfigError, r"data\.bin_dtype.*float32"),
    "model.n_layer zero": ("model:\n  type: gpt2\n  n_layer: 0\n", ConfigError, r"model\.n_layer.*0"),
    "model.dropout": ("model:\n  type: gpt2\n  dropout: 1.5\n", ConfigError, r"model\.dropout"),
    "model heads vs width (model __post_init__)": (
        "model:\n  type: gpt2\n  n_embd: 100\n  n_head: 3\n",
        ConfigError,
        r"model: n_embd=100 is not divisible by n_head=3",
    ),
    "llama kv heads": (
        "model:\n  type: llama\n  num_attention_heads: 4\n  num_key_value_heads: 3\n",
        ConfigError,
        r"model: num_attention_heads=4 is not a multiple of num_key_value_heads=3",
    ),
    "mapping value type": ("mesh:\n  param_mapping: {embed: 3}\n", ConfigError, r"mesh\.param_mapping\.embed"),
    "unknown mesh axis": (
        "mesh:\n  compute_mapping: {batch: dta}\n",
        ConfigError,
        r"mesh\.compute_mapping\.batch.*'dta'",
    ),
    "checkpoint.keep_last": ("checkpoint:\n  keep_last: 0\n", ConfigError, r"checkpoint\.keep_last"),
}


@pytest.mark.parametrize("name", list(YAML_CASES))
def test_yaml(tmp_path, name):
    text, exc, match = YAML_CASES[name]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    err = _fails(exc, match, load_config, path)
    if exc is ConfigError and "config file" in str(err):  # a message about the file names it
        assert str(path) in str(err)


def test_missing_config_file(tmp_path):
    _fails(ConfigError, re.escape(str(tmp_path / "nope.yaml")), load_config, tmp_path / "nope.yaml")


# ---- CLI overrides ----------------------------------------------------------------------------

CLI_CASES = {
    "unknown flag": (["--trainer.bogus", "3"], ConfigError, r"--trainer\.bogus"),
    "unknown section flag": (["--trainr.seed", "3"], ConfigError, r"--trainr\.seed"),
    "stray positional": (["bare"], ConfigError, "on the command line: unrecognized arguments: bare"),
    "bad int": (["--trainer.num_train_steps", "abc"], ConfigError, r"trainer\.num_train_steps.*abc"),
    "flag without value": (
        ["--trainer.num_train_steps"],
        ConfigError,
        r"on the command line: .*--trainer\.num_train_steps.*expected one argument",
    ),
    "bad choice": (["--model.type", "gpt3"], ConfigError, r"--model\.type.*gpt3"),
    "negative lr": (["--optimizer.learning_rate", "-1"], ConfigError, r"optimizer\.learning_rate"),
    "bad dict": (["--mesh.shape", "{data: x}"], ConfigError, r"mesh\.shape\.data"),
    "data.seq_len": (["--data.seq_len", "1"], ConfigError, r"data\.seq_len"),
    "warmup longer than run": (["--optimizer.warmup_steps", "1000"], ConfigError, r"optimizer\.warmup_steps=1000"),
    "batch vs microbatches": (["--trainer.microbatches", "3"], ConfigError, r"train_batch_size=16 .*microbatches=3"),
    "checkpoint outside run_dir": (
        ["--trainer.load_checkpoint", "/etc/x"],
        ConfigError,
        r"trainer\.load_checkpoint.*outside",
    ),
    "checkpoint escaping with ..": (
        ["--trainer.load_checkpoint", "../other/checkpoints/step_3"],
        ConfigError,
        "outside",
    ),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_override(name):
    args, exc, match = CLI_CASES[name]
    _fails(exc, match, load_config, NANO, args)


# ---- train(): mesh, mappings, batch, lengths, data, tokenizer -------------------------------------

TRAIN_CASES = {
    # mesh shape vs the 8 devices
    "mesh too small": ({"mesh.shape": "{data: 3}"}, nm.ShardingError, r"\{'data': 3\} needs 3 devices but 8"),
    "mesh too large": ({"mesh.shape": "{data: 4, model: 4}"}, nm.ShardingError, "needs 16 devices but 8"),
    "mesh wildcard": ({"mesh.shape": "{data: -1, model: 3}"}, nm.ShardingError, "8 is not divisible by 3"),
    "mesh zero": ({"mesh.shape": "{data: 0}"}, nm.ShardingError, "sizes must be positive"),
    # mappings: unknown names, unknown mesh axes, divisibility
    "unknown axis in param mapping": (
        {"mesh.param_mapping": "{embd: data}"},
        ConfigError,
        r"mesh\.param_mapping\.embd: the gpt2 model has no axis 'embd'",
    ),
    "unknown axis in compute mapping": (
        {"mesh.shape": "{data: 4, model: 2}", "mesh.compute_mapping": "{batch: data, hedas: model}"},
        ConfigError,
        r"mesh\.compute_mapping\.hedas",
    ),
    "llama axis in a gpt2 mapping": (
        {"mesh.shape": "{data: 4, model: 2}", "mesh.param_mapping": "{kv_heads: model}"},
        ConfigError,
        "no axis 'kv_heads'",
    ),
    "param mapping names a missing mesh axis": (
        {"mesh.param_mapping": "{embed: model}"},
        ConfigError,
        r"mesh\.param_mapping\.embed: axis 'embed' is mapped to mesh axis 'model', which "
        r"the mesh does not have \(mesh axes: \{'data': -1\}\)",
    ),
    "heads not divisible (param)": (
        {"mesh.shape": "{data: 2, model: 4}", "mesh.param_mapping": "{heads: model}"},
        ConfigError,
        r"mesh\.param_mapping: axis 'heads' of size 2 .* not divisible by 4",
    ),
    "heads not divisible (compute only)": (
        {"mesh.shape": "{data: 2, model: 4}", "mesh.compute_mapping": "{batch: data, heads: model}"},
        ConfigError,
        r"mesh\.compute_mapping: axis 'heads' of size 2 .* not divisible by 4",
    ),
    "mlp not divisible": (
        {"mesh.shape": "{data: 1, model: 8}", "model.n_inner": 36, "mesh.param_mapping": "{mlp: model}"},
        ConfigError,
        "axis 'mlp' of size 36",
    ),
    "vocab not divisible": (
        {"model.vocab_size": 260, "mesh.param_mapping": "{vocab: data}"},
        ConfigError,
        "axis 'vocab' of size 260",
    ),
    "position not divisible": (
        {"mesh.shape": "{data: 1, seq: 8}", "mesh.compute_mapping": "{position: seq}", "data.seq_len": 36},
        ConfigError,
        "axis 'position' of size 36",
    ),
    # batch vs data axis
    "batch not divisible by data axis": (
        {"trainer.train_batch_size": 6},
        ConfigError,
        r"trainer\.train_batch_size=6 .* 8 devices",
    ),
    "microbatch not divisible by data axis": (
        {"trainer.train_batch_size": 16, "trainer.microbatches": 4},
        ConfigError,
        r"microbatch of 4 sequences .*microbatches=4",
    ),
    # lengths and vocabulary
    "seq_len over positions": ({"data.seq_len": 128}, ConfigError, r"data\.seq_len=128 .* 64 positions"),
    "sample over positions": (
        {"trainer.sample_interval": 2, "trainer.sample_tokens": 70},
        ConfigError,
        r"trainer\.sample_tokens=70 .* 74 positions",
    ),
    "vocab smaller than tokenizer": ({"model.vocab_size": 100}, ConfigError, r"model\.vocab_size=100 .* 257"),
    "unknown remat policy": ({"model.remat": "sometimes"}, ConfigError, "model: unknown remat policy 'sometimes'"),
    # data
    "empty corpus": ({"data.train": lambda f: f"[{f['empty.txt']}]"}, DataError, r"corpus is empty.*empty\.txt"),
    "corpus shorter than a sequence": (
        {"data.train": lambda f: f"[{f['short.txt']}]"},
        DataError,
        r"fewer than one sequence of data\.seq_len=32",
    ),
    "corpus smaller than a batch": ({"trainer.train_batch_size": 4096}, DataError, "fewer than one batch of 4096"),
    "nothing left to train after validation": (
        {"data.train": lambda f: f"[{f['one_row.txt']}]", "data.val_fraction": 0.05},
        DataError,
        r"data\.val_fraction",
    ),
    "missing source": ({"data.train": lambda f: f"[{f['dir'] / 'nope.txt'}]"}, DataError, r"nope\.txt.*does not exist"),
    "glob matching nothing": (
        {"data.train": lambda f: f"[{f['dir'] / '*.parquet'}]"},
        DataError,
        r"no files match.*\.parquet",
    ),
    "directory as source": ({"data.train": lambda f: f"[{f['dir'] / 'sources'}]"}, DataError, "is a directory"),
    ".bin of odd size": (
        {"data.train": lambda f: f"[{f['odd.bin']}]"},
        DataError,
        r"odd\.bin.*201 bytes, not a multiple of 2",
    ),
    ".bin with ids over the vocabulary": (
        {"data.train": lambda f: f"[{f['big_ids.bin']}]"},
        DataError,
        r"big_ids\.bin.*token id 300 .* vocabulary of 257",
    ),
    "empty .bin": ({"data.train": lambda f: f"[{f['empty.bin']}]"}, DataError, r"empty\.bin.*no tokens"),
    ".npy with a bad header": (
        {"data.train": lambda f: f"[{f['bad_header.npy']}]"},
        DataError,
        r"bad_header\.npy.*not a readable \.npy",
    ),
    "truncated .npy": ({"data.train": lambda f: f"[{f['truncated.npy']}]"}, DataError, r"truncated\.npy.*truncated"),
    "2-D .npy": ({"data.train": lambda f: f"[{f['two_d.npy']}]"}, DataError, r"two_d\.npy.*1-D integer"),
    "float .npy": ({"data.train": lambda f: f"[{f['floats.npy']}]"}, DataError, r"floats\.npy.*float32"),
    "malformed JSONL": ({"data.train": lambda f: f"[{f['bad.jsonl']}]"}, DataError, r"bad\.jsonl:2: not valid JSON"),
    "JSONL without text": (
        {"data.train": lambda f: f"[{f['no_text.jsonl']}]"},
        DataError,
        r"no_text\.jsonl:2: .*'text'",
    ),
    # tokenizer files
    "missing tokenizer": (
        {"data.tokenizer": lambda f: f["dir"] / "nope" / "tokenizer.json"},
        DataError,
        r"nope/tokenizer\.json' does not exist",
    ),
    "tokenizer folder without tokenizer.json": (
        {"data.tokenizer": lambda f: f["dir"] / "tok_dir"},
        DataError,
        r"tok_dir/tokenizer\.json' does not exist",
    ),
    "malformed tokenizer.json": (
        {"data.tokenizer": lambda f: f["dir"] / "tok_bad"},
        DataError,
        r"tok_bad/tokenizer\.json' cannot be read",
    ),
    "tokenizer without an eos token": (
        {"data.tokenizer": lambda f: f["dir"] / "tok_no_eos"},
        DataError,
        r"data\.eos_token",
    ),
    "eos token not in the vocabulary": (
        {"data.tokenizer": lambda f: f["dir"] / "tok_no_eos", "data.eos_token": "</s>"},
        DataError,
        "has no token '</s>'",
    ),
    # resuming
    "explicit checkpoint that does not exist": (
        {"trainer.load_checkpoint": "checkpoints/step_5"},
        ckpt.CheckpointError,
        r"checkpoints/step_5 has no commit\.json",
    ),
}


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_train_rejects_before_compiling_or_writing(files, tmp_path, name):
    over, exc, match = TRAIN_CASES[name]
    run_dir = tmp_path / "run"
    _fails(exc, match, lambda: train(load_config(NANO, _args(files, run_dir, **over))))
    assert not run_dir.exists()  # no logs, no config.yaml, no checkpoints, no metrics
    _no_partial_files(files)


def _save_run(files, run_dir: Path, **over) -> Path:
    """A committed checkpoint for the model ``over`` describes, written from zeros (no compile)."""
    cfg = load_config(NANO, _args(files, run_dir, **over))
    model_cfg = cfg.model.model_config(vocab_size=384)
    shapes = jax.eval_shape(lambda: Gpt2LMHeadModel.init(model_cfg, key=jax.random.key(0)))
    opt = jax.eval_shape(build_optimizer(cfg.optimizer, cfg.trainer.num_train_steps).init, shapes)
    tree = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), (shapes, opt))
    return ckpt.save_checkpoint(run_dir, 2, tree, {"step": 2, "data_step": 2, "seed": 0})


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_resume_with_another_model_fails_before_compiling(files, tmp_path):
    run_dir = tmp_path / "run"
    _save_run(files, run_dir, **{"model.n_embd": 32})
    before = _listing(run_dir)
    cfg = load_config(NANO, _args(files, run_dir, **{"model.n_embd": 64, "trainer.load_checkpoint": "auto"}))
    _fails(ckpt.CheckpointError, r"leaf .*: the checkpoint has float32\[.*32.*\], the target float32\[.*64", train, cfg)
    cfg = load_config(
        NANO, _args(files, run_dir, **{"model.n_layer": 2, "trainer.load_checkpoint": "checkpoints/step_2"})
    )
    _fails(ckpt.CheckpointError, "leaf", train, cfg)
    assert _listing(run_dir) == before


def test_resume_from_a_corrupted_explicit_checkpoint_names_the_file(files, tmp_path):
    run_dir = tmp_path / "run"
    path = _save_run(files, run_dir)
    chunk = next(p for p in sorted((path / "arrays").rglob("*")) if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:-1])
    before = _listing(run_dir)
    cfg = load_config(NANO, _args(files, run_dir, **{"trainer.load_checkpoint": "checkpoints/step_2"}))
    _fails(ckpt.CheckpointError, re.escape(str(chunk)) + ".*truncated", train, cfg)
    assert _listing(run_dir) == before


# ---- named ops: mismatched and unknown axes ------------------------------------------------------


def _x(**axes):
    return nm.named(np.zeros(tuple(axes.values()), np.float32), tuple(axes))


NAMED_CASES = {
    "add with mismatched sizes": (lambda: _x(batch=2, embed=4) + _x(embed=5), nm.AxisError, r"embed.*4.*5|embed.*5.*4"),
    "dot with mismatched sizes": (
        lambda: nm.dot(_x(batch=2, embed=4), _x(embed=5, mlp=3), axis="embed"),
        nm.AxisError,
        "embed",
    ),
    "einsum with an unknown axis": (
        lambda: nm.einsum("batch nope -> batch", _x(batch=2, embed=4)),
        nm.AxisError,
        "nope",
    ),
    "reduce over an unknown axis": (lambda: _x(batch=2, embed=4).sum("embd"), nm.AxisError, "embd"),
    "index an unknown axis": (lambda: _x(batch=2, embed=4)["embd", 0], nm.AxisError, "embd"),
    "too few names": (lambda: nm.named(np.zeros((2, 3)), ("batch",)), nm.AxisError, "batch"),
    "duplicate names": (lambda: nm.named(np.zeros((2, 3)), ("batch", "batch")), nm.AxisError, "batch"),
    "rename onto an existing name": (lambda: _x(batch=2, embed=4).rename({"batch": "embed"}), nm.AxisError, "embed"),
    "concatenate with other axes mismatched": (
        lambda: nm.concatenate("batch", [_x(batch=2, embed=4), _x(batch=2, embed=5)]),
        nm.AxisError,
        "embed",
    ),
    "shard an axis that does not divide": (
        lambda: nm.shard(_x(batch=3, embed=4), {"batch": "data"}, nm.make_mesh({"data": -1})),
        nm.ShardingError,
        "axis 'batch' of size 3 .* 8",
    ),
    "mapping names a missing mesh axis": (
        lambda: nm.sharding_for(_x(batch=8).axes, {"batch": "dp"}, nm.make_mesh({"data": -1})),
        nm.ShardingError,
        "mesh axis 'dp'",
    ),
}


@pytest.mark.parametrize("name", list(NAMED_CASES))
def test_named_ops(name):
    fn, exc, match = NAMED_CASES[name]
    with pytest.raises(exc, match=match) as info:
        fn()
    assert isinstance(info.value, nm.NamedError)


# ---- Hugging Face folders ------------------------------------------------------------------------

HF_CONFIG = Gpt2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=64)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A valid GPT-2 folder, written from zeros (no compile)."""
    folder = tmp_path_factory.mktemp("hf") / "good"
    abstract = eqx.filter_eval_shape(Gpt2LMHeadModel.init, HF_CONFIG, key=jax.random.key(0))
    model = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)
    models.save_pretrained(model, HF_CONFIG, folder)
    return folder


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _edit_tensors(folder: Path, fn) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def _edit_config(folder: Path, fn) -> None:
    d = json.loads((folder / "config.json").read_text())
    fn(d)
    (folder / "config.json").write_text(json.dumps(d))


def _header(n: int, body: bytes = b"{}") -> bytes:
    return n.to_bytes(8, "little") + body


HF_CASES = {
    "missing tensor": (
        lambda f: _edit_tensors(f, lambda t: t.pop("transformer.h.0.mlp.c_fc.weight")),
        r"missing tensor 'transformer\.h\.0\.mlp\.c_fc\.weight'",
    ),
    "extra tensor": (
        lambda f: _edit_tensors(f, lambda t: t.update({"transformer.h.0.attn.extra": np.zeros(3, np.float32)})),
        r"unexpected tensor 'transformer\.h\.0\.attn\.extra'",
    ),
    "mis-shaped tensor": (
        lambda f: _edit_tensors(f, lambda t: t.update({"transformer.wte.weight": np.zeros((63, 16), np.float32)})),
        r"'transformer\.wte\.weight' has shape \[63, 16\], expected \[64, 16\]",
    ),
    "transposed tensor": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({"transformer.h.0.mlp.c_fc.weight": np.zeros((64, 16), np.float32)})
        ),
        r"'transformer\.h\.0\.mlp\.c_fc\.weight' has shape \[64, 16\], expected \[16, 64\]",
    ),
    "missing config.json": (lambda f: (f / "config.json").unlink(), r"config\.json: not found"),
    "config.json not JSON": (lambda f: (f / "config.json").write_text("{"), r"config\.json: not valid JSON"),
    "config.json missing a field": (
        lambda f: _edit_config(f, lambda d: d.pop("n_embd")),
        r"config\.json: missing field 'n_embd'",
    ),
    "config.json field of the wrong type": (
        lambda f: _edit_config(f, lambda d: d.update(n_head="2")),
        r"field 'n_head' should be int",
    ),
    "unsupported model type": (
        lambda f: _edit_config(f, lambda d: d.update(model_type="bert")),
        r"unsupported model_type 'bert'",
    ),
    "no safetensors, only a pickle": (
        lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
        r"pytorch_model\.bin: pickles are never loaded",
    ),
    "index lists a missing shard": (
        lambda f: (
            (f / "model.safetensors").unlink(),
            (f / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}})
            ),
        ),
        r"model-00001-of-00002\.safetensors: listed in model\.safetensors\.index\.json but not found",
    ),
    "huge header length": (
        lambda f: (f / "model.safetensors").write_bytes(_header(2**62)),
        r"model\.safetensors: corrupted safetensors header: it claims 4611686018427387904 bytes",
    ),
    "header past the end of the file": (
        lambda f: (f / "model.safetensors").write_bytes(_header(1000)),
        r"corrupted safetensors header: it claims 1000 bytes in a file of 10",
    ),
    "file shorter than a header": (lambda f: (f / "model.safetensors").write_bytes(b"\x01\x02"), "too short"),
    "truncated tensor data": (
        lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-100]),
        r"tensor '.*' lies outside the file",
    ),
}


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hf_folder(hf_folder, tmp_path, name):
    mutate, match = HF_CASES[name]
    folder = _copy(hf_folder, tmp_path / "hf")
    mutate(folder)
    _fails(CheckpointFormatError, match, models.load_pretrained, folder)


def test_hf_good_folder_is_good(hf_folder):
    # the control: each case above differs from this folder by one mutation
    assert models.config_from_hf(hf_folder) == HF_CONFIG
    assert "transformer.h.0.mlp.c_fc.weight" in load_file(hf_folder / "model.safetensors")


# ---- the CLI in a subprocess: exit code 2, `error: ...`, nothing written --------------------------

CLI_SUBPROCESS = {
    "unknown flag": ({"trainer.bogus_flag": 3}, "--trainer.bogus_flag"),
    "empty corpus": ({"data.train": lambda f: f"[{f['empty.txt']}]"}, "corpus is empty"),
    "mesh vs devices": ({"mesh.shape": "{data: 3}"}, "needs 3 devices but 2 are available"),
}


@pytest.mark.parametrize("name", list(CLI_SUBPROCESS))
@pytest.mark.procs
def test_cli_exit_code_and_nothing_written(files, tmp_path, name):
    over, needle = CLI_SUBPROCESS[name]
    run_dir = tmp_path / "run"
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from named.trainer.commands.cli import main_train; sys.exit(main_train())",
            "--config_path",
            str(NANO),
            *_args(files, run_dir, **{"trainer.train_batch_size": 2, **over}),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: ") and needle in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not run_dir.exists()
    _no_partial_files(files)


# ---- security --------------------------------------------------------------------------------------

UNPICKLING = re.compile(
    r"\bimport\s+(c?pickle|cloudpickle|dill|joblib|shelve|marshal|torch)\b|\bfrom\s+(c?pickle|cloudpickle|dill|joblib|shelve|marshal|torch)\b"
    r"|\b(c?pickle|cloudpickle|dill|joblib|marshal)\s*\.\s*(load|loads|Unpickler)\b|\btorch\s*\.\s*load\b"
    r"|allow_pickle\s*=\s*True|\byaml\s*\.\s*(load|unsafe_load|full_load)\s*\(|\bshelve\s*\.\s*open\b"
)


def _code_lines(path: Path) -> dict[int, str]:
    """The source without comments and string literals (docstrings may say 'pickle')."""
    lines: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type >= getattr(tokenize, "FSTRING_START", 1 << 30):
            continue
        lines[tok.start[0]] = lines.get(tok.start[0], "") + " " + tok.string
    return lines


# The one module that may import torch: the parity check runs transformers' model beside ours.
# transformers would fall back to a pickled pytorch_model.bin, so every load there must pass
# use_safetensors=True (checked below).
TORCH_ALLOWED = {"src/models/_parity.py"}
_TORCH_IMPORT = re.compile(r"^\s*(import\s+torch|from\s+torch\b)")


def test_nothing_in_src_unpickles():
    sources = sorted((ROOT / "src").rglob("*.py"))
    assert len(sources) > 20
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in sources
        for n, line in _code_lines(p).items()
        if UNPICKLING.search(line) and not (str(p.relative_to(ROOT)) in TORCH_ALLOWED and _TORCH_IMPORT.match(line))
    ]
    assert hits == []
    for name in TORCH_ALLOWED:
        code = " ".join(_code_lines(ROOT / name).values())
        assert code.count("from_pretrained") == code.count("use_safetensors = True") >= 1, name


def test_the_unpickling_grep_catches_what_it_should():
    for bad in (
        "import pickle",
        "from dill import loads",
        "x = torch.load(f)",
        "np.load(p, allow_pickle=True)",
        "cloudpickle.loads(b)",
        "yaml.load(s)",
        "import cloudpickle",
    ):
        assert UNPICKLING.search(bad), bad
    for fine in ("np.load(p)", "yaml.safe_load(s)", "json.loads(s)", "safe_open(path)"):
        assert not UNPICKLING.search(fine), fine


def test_checkpoint_subdir_cannot_leave_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for subdir in ("../elsewhere", "/tmp/abs", "a/../../b", ""):
        _fails(ckpt.CheckpointError, "inside the run directory", ckpt.Checkpointer, run_dir, subdir=subdir)
    (tmp_path / "outside").mkdir()
    (run_dir / "checkpoints").symlink_to(tmp_path / "outside")
    _fails(ckpt.CheckpointError, "outside the run directory", ckpt.Checkpointer, run_dir)
    _fails(ckpt.CheckpointError, "outside the run directory", ckpt.latest_checkpoint, run_dir)
    assert list((tmp_path / "outside").iterdir()) == []


def test_commit_file_paths_cannot_leave_the_checkpoint(tmp_path):
    path = ckpt.save_checkpoint(tmp_path / "run", 1, {"w": np.arange(4.0)})
    (tmp_path / "secret").write_bytes(b"x" * 8)
    commit = json.loads((path / "commit.json").read_text())
    body = {k: v for k, v in commit.items() if k != "commit_sha256"}
    body["files"]["../../../secret"] = {"sha256": "0" * 64, "size": 8}
    (path / "commit.json").write_text(json.dumps({**body, "commit_sha256": ckpt.store.self_digest(body)}))
    _fails(ckpt.CheckpointError, r"refuses file path '\.\./\.\./\.\./secret'", ckpt.verify_checkpoint, path)


def test_run_paths_from_the_config_stay_in_the_run_dir(files, tmp_path):
    # every path the trainer writes is under trainer.run_dir (the token cache is the one other
    # place, written atomically); load_checkpoint may only point inside it
    run_dir = tmp_path / "run"
    for target in (
        str(tmp_path / "other" / "checkpoints" / "step_2"),
        "../other/checkpoints/step_2",
        "checkpoints/../../x",
    ):
        _fails(
            ConfigError,
            "outside trainer.run_dir",
            load_config,
            NANO,
            _args(files, run_dir, **{"trainer.load_checkpoint": target}),
        )
    run_dir.mkdir()
    (tmp_path / "other").mkdir()
    (run_dir / "link").symlink_to(tmp_path / "other", target_is_directory=True)
    _fails(
        ConfigError,
        "outside trainer.run_dir",
        load_config,
        NANO,
        _args(files, run_dir, **{"trainer.load_checkpoint": "link/step_2"}),
    )
