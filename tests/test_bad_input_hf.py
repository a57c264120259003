"""Hugging Face folders: no file outside the folder is read, and every safetensors header,
index and config.json field is checked, naming the file and the culprit, before anything
is read or compiled.

Every bad case starts from a good tiny GPT-2 folder saved by ``save_pretrained`` (one file,
or sharded with an index) and changes one thing. Each asserts our exception type, a message
naming the file and the tensor or field, that nothing was compiled, and for the escapes that
no file outside the folder was opened (an audit hook sees Python's opens, a spy safetensors').
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compiles import compiles
from _hf_models import random_ids, random_model
from safetensors.numpy import load_file, save_file

import named as nm
from named import models
from named.models import CheckpointFormatError, Gpt2Config, Gpt2LMHeadModel, hf

CONFIG = Gpt2Config(n_layer=2, n_head=2, n_embd=16, n_positions=16, vocab_size=64)
LLAMA = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=10,
    max_position_embeddings=8,
)

# ---- watching what is opened and compiled ---------------------------------------------------------

_OPENED: list[list[Path]] = []


def _audit(event: str, args) -> None:
    if event == "open" and _OPENED and isinstance(args[0], (str, bytes, Path)):
        path = Path(args[0].decode() if isinstance(args[0], bytes) else args[0])
        if path.suffix not in (".py", ".pyc", ".so"):  # lazy imports are not the folder's business
            _OPENED[-1].append(path)


sys.addaudithook(_audit)  # hooks cannot be removed: it records only inside _watch()


@contextlib.contextmanager
def _watch(monkeypatch):
    """Yields the list of files opened inside the block (by Python or by safetensors)."""
    opened: list[Path] = []
    real = hf.safe_open

    def spy(path, *args, **kwargs):
        opened.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(hf, "safe_open", spy)
    _OPENED.append(opened)
    try:
        yield opened
    finally:
        _OPENED.pop()
        monkeypatch.setattr(hf, "safe_open", real)


def _rejects(monkeypatch, folder: Path, *needles: str, load=models.load_pretrained) -> tuple[str, list[Path]]:
    """Loading ``folder`` raises our error naming every needle, without compiling; returns the
    message and the files opened."""
    with compiles() as seen, _watch(monkeypatch) as opened, pytest.raises(CheckpointFormatError) as info:
        load(folder)
    msg = str(info.value)
    assert type(info.value).__module__.startswith("named"), type(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert seen == [], f"compiled {seen} before rejecting the folder"
    return msg, opened


def _outside(opened: list[Path], folder: Path) -> list[Path]:
    """Files opened outside ``folder``, but for jax's compilation cache (tests/conftest.py), which
    the test session, not the library, set up."""
    inside, cache = folder.resolve(), Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).resolve()
    return [p for p in opened if inside not in p.resolve().parents and cache not in p.resolve().parents]


# ---- good folders ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """The model, a one-file folder and a sharded folder (index + shards) holding it."""
    model = random_model(Gpt2LMHeadModel, CONFIG)
    root = tmp_path_factory.mktemp("hf-good")
    models.save_pretrained(model, CONFIG, root / "single")
    models.save_pretrained(model, CONFIG, root / "sharded", max_shard_size=5000)
    assert len(list((root / "sharded").glob("model-*.safetensors"))) >= 3
    return model, root / "single", root / "sharded"


@pytest.fixture
def single(good, tmp_path) -> Path:
    return Path(shutil.copytree(good[1], tmp_path / "single"))


@pytest.fixture
def sharded(good, tmp_path) -> Path:
    return Path(shutil.copytree(good[2], tmp_path / "sharded"))


@eqx.filter_jit
def _forward(model, ids):
    return model(ids).rearrange(("batch", "position", "vocab")).array


def _logits(model) -> np.ndarray:
    ids = nm.named(jnp.asarray(random_ids(CONFIG.vocab_size, (2, 7))), ("batch", "position"))
    return np.asarray(_forward(model, ids))


def _hub_snapshot(src: Path, root: Path) -> Path:
    """``src`` laid out as the Hugging Face hub cache does: snapshot files are symlinks into blobs/."""
    repo = root / "models--tiny--gpt2"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, p in enumerate(sorted(src.iterdir())):
        shutil.copy(p, repo / "blobs" / f"blob{i}")
        (snapshot / p.name).symlink_to(Path("../../blobs") / f"blob{i}")
    return snapshot


@pytest.mark.parametrize("layout", ["single", "sharded", "hub cache snapshot"])
def test_good_folders_still_load_with_the_same_logits(good, tmp_path, monkeypatch, layout):
    model, single, sharded = good
    folder = {
        "single": single,
        "sharded": sharded,
        "hub cache snapshot": _hub_snapshot(sharded, tmp_path) if layout.startswith("hub") else None,
    }[layout]
    with _watch(monkeypatch) as opened:
        config, loaded = models.load_pretrained(folder)
    assert config == CONFIG
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(_logits(loaded), _logits(model))
    if layout != "hub cache snapshot":
        assert _outside(opened, folder) == []


# ---- files outside the folder ----------------------------------------------------------------------


def _point_shard_elsewhere(folder: Path, outside: Path, make_name) -> tuple[str, str]:
    """Moves the first shard out of ``folder`` (it stays a valid file) and points the index's
    entries for it at ``make_name(moved)``; returns a tensor key so redirected and the name used."""
    index = folder / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    shard = sorted(set(d["weight_map"].values()))[0]
    outside.mkdir(exist_ok=True)
    moved = outside / shard
    shutil.move(folder / shard, moved)
    name = make_name(moved, folder)
    keys = [k for k, v in d["weight_map"].items() if v == shard]
    d["weight_map"].update({k: name for k in keys})
    index.write_text(json.dumps(d))
    return keys[0], name


def _symlink_in(folder: Path, target: Path, link: str = "link.safetensors") -> str:
    (folder / link).symlink_to(target)
    return link


ESCAPES = {
    "absolute path": lambda moved, folder: str(moved),
    "../ path": lambda moved, folder: f"../outside/{moved.name}",
    "symlink inside leading out": lambda moved, folder: _symlink_in(folder, moved),
    "subfolder symlink leading out": lambda moved, folder: (
        (folder / "sub").symlink_to(moved.parent, target_is_directory=True),
        f"sub/{moved.name}",
    )[1],
}


@pytest.mark.parametrize("how", list(ESCAPES))
def test_index_cannot_name_a_file_outside_the_folder(sharded, tmp_path, monkeypatch, how):
    # the moved shard is valid: before the fix the model loaded from outside the folder
    key, name = _point_shard_elsewhere(sharded, tmp_path / "outside", ESCAPES[how])
    index = sharded / "model.safetensors.index.json"
    _, opened = _rejects(monkeypatch, sharded, f"{index}: weight_map[{key!r}] names {name!r}", "not inside the folder")
    assert _outside(opened, sharded) == []
    # nothing but config.json and the index was opened: the check precedes every shard
    assert {p.name for p in opened} <= {"config.json", "model.safetensors.index.json"}, opened


def test_index_naming_an_outside_file_with_a_bad_header_is_refused_as_an_escape(sharded, tmp_path, monkeypatch):
    garbage = tmp_path / "secret.txt"
    garbage.write_text("root:x:0:0:root:/root:/bin/bash\n")
    index = sharded / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    d["weight_map"]["transformer.wte.weight"] = str(garbage)
    index.write_text(json.dumps(d))
    msg, opened = _rejects(monkeypatch, sharded, str(index), "'transformer.wte.weight'", str(garbage))
    assert "corrupted" not in msg and garbage not in opened


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_folder_file_that_is_a_symlink_leading_out_is_refused(single, tmp_path, monkeypatch, name):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(single / name, outside / name)
    (single / name).symlink_to(outside / name)
    _, opened = _rejects(monkeypatch, single, f"{single / name} resolves to {outside / name}", "not inside the folder")
    assert _outside(opened, single) == []


def test_a_lookalike_of_the_hub_cache_gets_no_exception(good, tmp_path, monkeypatch):
    # only snapshots/<rev> of a models--* repository may read the repository's blobs/
    snapshot = _hub_snapshot(good[1], tmp_path)
    fake = tmp_path / "not-a-repo" / "snapshots" / "rev"
    shutil.copytree(snapshot, fake, symlinks=True)
    shutil.copytree(snapshot.parent.parent / "blobs", tmp_path / "not-a-repo" / "blobs")
    _, opened = _rejects(monkeypatch, fake, "config.json resolves to", "not inside the folder")
    assert _outside(opened, fake) == []


# ---- safetensors headers -----------------------------------------------------------------------------


def _rewrite_header(path: Path, edit) -> None:
    """Edits the JSON header of a safetensors file in place, keeping its data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    body = json.dumps(header).encode()
    path.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])


def _set(name: str, field: str, value):
    return lambda h: h[name].__setitem__(field, value)


WTE, BIAS = "transformer.wte.weight", "transformer.h.0.mlp.c_fc.bias"


def _swap_offsets(h):
    # two tensors of equal size trade places: still a valid tiling, so only the values move
    a, b = "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias"
    h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]


def _overlap(h):
    h["transformer.h.0.ln_1.weight"]["data_offsets"] = [o - 4 for o in h["transformer.h.0.ln_1.weight"]["data_offsets"]]


HEADER_CASES = {
    # dtype vs the parameter, and vs the bytes
    "I32 over a float parameter's bytes": (_set(WTE, "dtype", "I32"), [repr(WTE), "dtype I32", "floating-point"]),
    "I16 over bytes of another length": (_set(WTE, "dtype", "I16"), [repr(WTE), "needs 2048 bytes", "give 4096"]),
    "F64 over bytes of another length": (_set(BIAS, "dtype", "F64"), [repr(BIAS), "needs 512 bytes", "give 256"]),
    "BOOL over a float parameter": (lambda h: h[BIAS].update(dtype="BOOL", shape=[256]), [repr(BIAS), "dtype BOOL"]),
    "unknown dtype": (_set(WTE, "dtype", "F33"), [repr(WTE), "unsupported dtype F33"]),
    "dtype not a string": (_set(WTE, "dtype", ["F32"]), [repr(WTE), "'dtype'"]),
    # malformed fields
    "entry not an object": (lambda h: h.__setitem__(WTE, [1, 2]), [repr(WTE), "expected an object"]),
    "shape not a list": (_set(WTE, "shape", "64x16"), [repr(WTE), "'shape'"]),
    "shape of floats": (_set(WTE, "shape", [64.0, 16.0]), [repr(WTE), "'shape'"]),
    "shape with a bool": (_set(BIAS, "shape", [True, 64]), [repr(BIAS), "'shape'"]),
    "negative shape": (_set(WTE, "shape", [-64, -16]), [repr(WTE), "'shape'"]),
    "shape missing": (lambda h: h[WTE].pop("shape"), [repr(WTE), "'shape'"]),
    "data_offsets of three": (lambda h: h[WTE]["data_offsets"].append(0), [repr(WTE), "'data_offsets'"]),
    "data_offsets of strings": (
        lambda h: h[WTE].update(data_offsets=[str(o) for o in h[WTE]["data_offsets"]]),
        [repr(WTE), "'data_offsets'"],
    ),
    "data_offsets of floats": (
        lambda h: h[WTE].update(data_offsets=[float(o) for o in h[WTE]["data_offsets"]]),
        [repr(WTE), "'data_offsets'"],
    ),
    "data_offsets reversed": (lambda h: h[WTE].update(data_offsets=h[WTE]["data_offsets"][::-1]), [repr(WTE)]),
    "metadata not strings": (lambda h: h.__setitem__("__metadata__", {"format": 1}), ["'__metadata__'"]),
    # the layout of the bytes
    "overlapping tensors": (_overlap, ["'transformer.h.0.ln_1.weight' overlaps"]),
    "a gap": (lambda h: h.pop(BIAS), ["unused"]),
    "shape and offsets of a tensor shrunk": (
        lambda h: h[BIAS].update(shape=[63], data_offsets=[h[BIAS]["data_offsets"][0], h[BIAS]["data_offsets"][1] - 4]),
        ["unused"],
    ),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_bad_safetensors_header(single, monkeypatch, case):
    edit, needles = HEADER_CASES[case]
    path = single / "model.safetensors"
    _rewrite_header(path, edit)
    _rejects(monkeypatch, single, str(path), *needles)


def test_bytes_after_the_last_tensor(single, monkeypatch):
    path = single / "model.safetensors"
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    _rejects(monkeypatch, single, str(path), "8 bytes after the last tensor")


def test_a_valid_reordering_of_the_bytes_still_loads(good, single):
    # the control for the layout cases: safetensors allows any order, and the entries follow
    path = single / "model.safetensors"
    _rewrite_header(path, _swap_offsets)
    _, loaded = models.load_pretrained(single)
    t = load_file(good[1] / "model.safetensors")
    got = models.hf_state_dict(loaded)
    np.testing.assert_array_equal(got["transformer.h.0.ln_1.weight"], t["transformer.h.0.ln_1.bias"])
    np.testing.assert_array_equal(got["transformer.h.0.ln_1.bias"], t["transformer.h.0.ln_1.weight"])


def test_layers_of_different_dtypes_need_a_dtype(good, single, monkeypatch):
    path = single / "model.safetensors"
    tensors = load_file(path)
    name = "transformer.h.1.mlp.c_fc.weight"
    tensors[name] = tensors[name].astype(np.float16)
    save_file(tensors, path)
    _rejects(
        monkeypatch,
        single,
        str(path),
        repr(name),
        "F16",
        "transformer.h.0.mlp.c_fc.weight",
        load=lambda f: models.load_pretrained(f, dtype=None),
    )
    _, loaded = models.load_pretrained(single)  # converted to float32: fine
    np.testing.assert_array_equal(models.hf_state_dict(loaded)[name], tensors[name].astype(np.float32))


# ---- index files -------------------------------------------------------------------------------------


def _edit_index(folder: Path, edit) -> Path:
    index = folder / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    edit(d)
    index.write_text(json.dumps(d))
    return index


INDEX_CASES = {
    "weight_map a list": (lambda d: d.update(weight_map=list(d["weight_map"].items())), ["'weight_map'"]),
    "weight_map missing": (lambda d: d.pop("weight_map"), ["'weight_map'"]),
    "file name a number": (lambda d: d["weight_map"].update({WTE: 3}), [f"weight_map[{WTE!r}]", "got 3"]),
    "file name a list": (lambda d: d["weight_map"].update({WTE: ["a.safetensors"]}), [f"weight_map[{WTE!r}]"]),
    "file name null": (lambda d: d["weight_map"].update({WTE: None}), [f"weight_map[{WTE!r}]", "got None"]),
    "file name empty": (lambda d: d["weight_map"].update({WTE: ""}), [f"weight_map[{WTE!r}]"]),
    "the folder itself": (lambda d: d["weight_map"].update({WTE: "."}), [f"weight_map[{WTE!r}] names '.'"]),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_bad_index(sharded, monkeypatch, case):
    edit, needles = INDEX_CASES[case]
    index = _edit_index(sharded, edit)
    _, opened = _rejects(monkeypatch, sharded, str(index), *needles)
    assert {p.name for p in opened} <= {"config.json", "model.safetensors.index.json"}, opened


def test_index_not_an_object(sharded, monkeypatch):
    index = sharded / "model.safetensors.index.json"
    index.write_text("[]")
    _rejects(monkeypatch, sharded, str(index), "expected a JSON object")


# ---- OS errors -----------------------------------------------------------------------------------


def _replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def test_a_directory_where_a_file_is_expected(single, sharded, monkeypatch):
    for folder, name in (
        (single, "config.json"),
        (single, "model.safetensors"),
        (sharded, sorted(p.name for p in sharded.glob("model-*.safetensors"))[1]),
        (sharded, "model.safetensors.index.json"),
    ):
        path = folder / name
        backup = path.read_bytes()
        _replace_with_dir(path)
        _rejects(monkeypatch, folder, f"{path}: is a directory, expected a file")
        path.rmdir()
        path.write_bytes(backup)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_an_unreadable_file_is_named(single, monkeypatch, name):
    # the tests run as root, for whom chmod 000 changes nothing: the OS error is injected
    victim, real = single / name, builtins.open

    def refusing(file, *args, **kwargs):
        if Path(file) == victim:
            raise PermissionError(13, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: refusing(self).read())
    _rejects(monkeypatch, single, f"{victim}: cannot be read (Permission denied)")


def test_the_folder_itself_must_be_a_folder(single, tmp_path, monkeypatch):
    _rejects(monkeypatch, tmp_path / "nope", f"{tmp_path / 'nope'}: not found")
    _rejects(monkeypatch, single / "config.json", f"{single / 'config.json'}: not a directory")


# ---- config.json -------------------------------------------------------------------------------------

GPT2_CONFIG_CASES = {
    "n_head zero (was ZeroDivisionError)": ({"n_head": 0}, ["'n_head'", "positive int"]),
    "n_layer negative": ({"n_layer": -1}, ["'n_layer'", "positive int"]),
    "n_inner zero": ({"n_inner": 0}, ["'n_inner'"]),
    "n_embd a bool": ({"n_embd": True}, ["'n_embd'", "True"]),
    "n_embd a float": ({"n_embd": 16.0}, ["'n_embd'", "16.0"]),
    "n_head a string": ({"n_head": "2"}, ["'n_head'", "'2'"]),
    "n_embd not divisible by n_head": ({"n_head": 3}, ["n_embd=16 is not divisible by n_head=3"]),
    "layer_norm_epsilon NaN": ({"layer_norm_epsilon": float("nan")}, ["'layer_norm_epsilon'", "nan"]),
    "layer_norm_epsilon inf": ({"layer_norm_epsilon": float("inf")}, ["'layer_norm_epsilon'", "inf"]),
    "layer_norm_epsilon a string": ({"layer_norm_epsilon": "1e-5"}, ["'layer_norm_epsilon'"]),
    "layer_norm_epsilon an int past float": ({"layer_norm_epsilon": 10**400}, ["'layer_norm_epsilon'", "inf"]),
    "resid_pdrop 1.5": ({"resid_pdrop": 1.5}, ["'resid_pdrop'", "[0, 1)"]),
    "tie_word_embeddings an int": ({"tie_word_embeddings": 1}, ["'tie_word_embeddings'"]),
    "add_cross_attention a string": ({"add_cross_attention": "no"}, ["'add_cross_attention'"]),
    "activation_function a number": ({"activation_function": 3}, ["'activation_function'"]),
    "model_type a list (was TypeError)": ({"model_type": ["gpt2"]}, ["'model_type'"]),
    "model_type unknown": ({"model_type": "gpt5"}, ["unsupported model_type 'gpt5'"]),
    "architectures a string": ({"architectures": "GPT2LMHeadModel"}, ["'architectures'"]),
    "architectures of numbers": ({"architectures": [1]}, ["'architectures'"]),
}

LLAMA_CONFIG_CASES = {
    "heads not a multiple of kv heads": (
        {"num_key_value_heads": 3},
        ["num_attention_heads=4 is not a multiple of num_key_value_heads=3"],
    ),
    "hidden_size not divisible by heads": (
        {"hidden_size": 18},
        ["hidden_size=18 is not divisible by num_attention_heads=4"],
    ),
    "head_dim zero (was silently the default)": ({"head_dim": 0}, ["'head_dim'"]),
    "num_key_value_heads zero": ({"num_key_value_heads": 0}, ["'num_key_value_heads'"]),
    "rope_theta a string": ({"rope_theta": "10000"}, ["'rope_theta'"]),
    "rope_theta inf": ({"rope_theta": float("inf")}, ["'rope_theta'"]),
    "rope_parameters.rope_theta a string (was ValueError)": (
        {"rope_parameters": {"rope_theta": "1e4"}},
        ["'rope_parameters.rope_theta'"],
    ),
    "rope_parameters.rope_theta zero": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
        ["'rope_parameters.rope_theta'"],
    ),
    "rope_scaling a string (was AttributeError)": ({"rope_scaling": "linear"}, ["'rope_scaling'"]),
    "rope_scaling.rope_type a list": ({"rope_scaling": {"rope_type": ["default"]}}, ["'rope_scaling.rope_type'"]),
    "rope_scaling unsupported": (
        {"rope_scaling": {"type": "longrope", "factor": 2.0}},
        ["unsupported rope_scaling.rope_type='longrope'"],
    ),
    "rms_norm_eps negative": ({"rms_norm_eps": -1e-6}, ["'rms_norm_eps'"]),
    "mlp_bias a string": ({"mlp_bias": "false"}, ["'mlp_bias'"]),
    "hidden_act unsupported": ({"hidden_act": "gelu"}, ["unsupported hidden_act='gelu'"]),
    "vocab_size missing": ({"vocab_size": None}, ["missing field 'vocab_size'"]),
}


def _write_config(folder: Path, d: dict) -> None:
    (folder / "config.json").write_text(json.dumps({k: v for k, v in d.items() if v is not None}))


@pytest.mark.parametrize("case", list(GPT2_CONFIG_CASES))
def test_bad_gpt2_config(single, monkeypatch, case):
    change, needles = GPT2_CONFIG_CASES[case]
    _write_config(single, {**json.loads((single / "config.json").read_text()), **change})
    where = str(single / "config.json")
    _rejects(monkeypatch, single, where, *needles, load=models.config_from_hf)
    _rejects(monkeypatch, single, where, *needles)


@pytest.mark.parametrize("case", list(LLAMA_CONFIG_CASES))
def test_bad_llama_config(tmp_path, monkeypatch, case):
    change, needles = LLAMA_CONFIG_CASES[case]
    _write_config(tmp_path, {**LLAMA, **change})
    _rejects(monkeypatch, tmp_path, str(tmp_path / "config.json"), *needles, load=models.config_from_hf)


@pytest.mark.parametrize(
    "text",
    [b"[" * 100_000, b'{"n_embd": 1' + b"0" * 5000 + b"}", b'{"model_type": "\xff"}'],
    ids=["nested too deep", "an int of 5001 digits", "not UTF-8"],
)
def test_config_json_python_cannot_parse(single, monkeypatch, text):
    (single / "config.json").write_bytes(text)
    _rejects(monkeypatch, single, f"{single / 'config.json'}: not valid JSON")


def test_header_nested_too_deep(single, monkeypatch):
    path = single / "model.safetensors"
    body = b"[" * 100_000
    path.write_bytes(len(body).to_bytes(8, "little") + body)
    _rejects(monkeypatch, single, f"{path}: corrupted safetensors header")


def test_a_symlink_loop(single, monkeypatch):
    path = single / "model.safetensors"
    path.unlink()
    path.symlink_to(single / "loop")
    (single / "loop").symlink_to(path)
    _rejects(monkeypatch, single, str(path), "cannot follow 'model.safetensors'")


def test_good_llama_configs_read_as_before(tmp_path):
    # the controls for the cases above: each layout transformers writes
    for extra, theta in (
        ({}, 10000.0),
        ({"rope_theta": 500}, 500.0),
        ({"rope_scaling": None, "rope_theta": 7.0}, 7.0),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 123.0}}, 123.0),
        ({"rope_scaling": {"type": "default"}, "head_dim": 8}, 10000.0),
    ):
        _write_config(tmp_path, {**LLAMA, **extra})
        config = models.config_from_hf(tmp_path)
        assert (config.rope_theta, config.num_key_value_heads, config.num_attention_heads) == (theta, 2, 4)
        assert config.HeadSize.size == extra.get("head_dim", 4)
    _write_config(tmp_path, {**LLAMA, "num_key_value_heads": None})
    assert models.config_from_hf(tmp_path).num_key_value_heads == 4
