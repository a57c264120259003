"""``named-export``: our checkpoints as Hugging Face folders that ``transformers`` (and, for LoRA
adapters, ``peft``) load with the logits we compute.

Two tiny runs on 8 devices under FSDP start from a Llama saved by ``transformers``
(tests/_chat_folder.py): a full fine-tune whose first step has learning rate 0 (warmup), so its
step-1 checkpoint must export the folder's tensors bitwise, and a LoRA run on every linear
module. Bad input is refused before anything is written; a failed export leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from _chat_folder import hf_logits, make_chat_folder
from safetensors.numpy import load_file

import named as nm
from named.models.hf import save_pretrained
from named.trainer import checkpoint as ckpt
from named.trainer.commands import export as export_module
from named.trainer.commands.cli import main_export
from named.trainer.commands.sample import saved_model_config
from named.trainer.config import load_config
from named.trainer.loop.model_init import model_shapes
from named.trainer.loop.registry import model_class
from named.trainer.loop.train import train

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_chat_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")


def _config(folder, root: Path, name: str, **more):
    (root / "text.txt").write_text(
        "The quick brown fox jumps over the lazy dog. Paris is the capital of France.\n" * 60
    )
    over = {
        "model.init_from_hf": str(folder),
        "trainer.num_train_steps": 3,
        "trainer.train_batch_size": 8,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(root / name),
        "optimizer.learning_rate": 1e-2,
        "optimizer.warmup_steps": 1,
        "data.train": f"[{root / 'text.txt'}]",
        "data.seq_len": 32,
        "data.val_fraction": 0,
        "data.cache_dir": str(root / "cache"),
        "mesh.shape": "{data: 8}",
        "mesh.param_mapping": "{embed: data}",
        "checkpoint.interval": 1,
        "checkpoint.keep_last": 3,
        "tracker.console": "false",
        **more,
    }
    return load_config(None, [x for k, v in over.items() for x in (f"--{k}", str(v))])


@pytest.fixture(scope="module")
def full_run(folder, tmp_path_factory) -> Path:
    """Every weight trains; step 1 ran at learning rate 0 (the first warmup step)."""
    return train(_config(folder, tmp_path_factory.mktemp("full"), "run")).run_dir


@pytest.fixture(scope="module")
def lora_run(folder, tmp_path_factory) -> Path:
    more = {"lora": f"{{rank: {RANK}, alpha: 8, targets: [{', '.join(ALL_LINEARS)}]}}", "optimizer.warmup_steps": 0}
    return train(_config(folder, tmp_path_factory.mktemp("lora"), "run", **more)).run_dir


def _ours(run_dir: Path, ids: np.ndarray, step: int | None = None) -> np.ndarray:
    """Our logits for ``ids`` from the run's checkpoint (the model alone, read as named-sample reads it)."""
    cfg, model_cfg = load_config(run_dir / "config.yaml"), saved_model_config(run_dir)
    shapes = model_shapes(cfg, model_class(model_cfg), model_cfg)
    path = run_dir if step is None else run_dir / "checkpoints" / f"step_{step}"
    (model, _), _ = ckpt.restore(path, (shapes, None), partial=True)
    logits = model(nm.named(jnp.asarray(ids, jnp.int32), ("batch", "position")))
    return np.asarray(logits.rearrange(("batch", "position", "vocab")).array)


IDS = np.random.default_rng(0).integers(0, 300, (2, 16))


def _export(*args) -> int:
    return main_export([str(a) for a in args])


# ---- full fine-tunes ------------------------------------------------------------------------------


def test_init_from_hf_and_an_unchanged_step_export_the_folder_bitwise(full_run, folder, tmp_path):
    out = tmp_path / "step1"
    assert _export("--checkpoint", full_run, "--step", 1, "--out", out) == 0
    theirs, ours = load_file(folder / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    # config.json names the special tokens as the folder's does (transformers and vLLM read them there)
    written, base = json.loads((out / "config.json").read_text()), json.loads((folder / "config.json").read_text())
    assert {k: written[k] for k in TOKEN_IDS} == {k: base.get(k) for k in TOKEN_IDS}
    assert written["eos_token_id"] is not None and written["pad_token_id"] is not None
    theirs, ours = transformers.AutoConfig.from_pretrained(folder), transformers.AutoConfig.from_pretrained(out)
    assert [getattr(ours, k) for k in TOKEN_IDS] == [getattr(theirs, k) for k in TOKEN_IDS]


def test_config_json_names_the_run_tokenizers_special_tokens(folder, tmp_path):
    """Without a pretrained folder the ids come from the run's tokenizer; a token it does not have is
    null, never transformers' class default (GPT-2's 50256, outside a byte model's vocabulary)."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "config/gpt2_nano.yaml")
    model_cfg = cfg.model.model_config(vocab_size=384)
    out = tmp_path / "gpt2"
    save_pretrained(model_class(model_cfg).init(model_cfg, key=jax.random.key(0)), model_cfg, out)
    assert export_module.write_token_ids(cfg, 384, out) == []
    assert {k: json.loads((out / "config.json").read_text())[k] for k in TOKEN_IDS} == {
        "bos_token_id": None,
        "eos_token_id": 256,
        "pad_token_id": None,
    }
    read = transformers.AutoConfig.from_pretrained(out)
    assert (read.bos_token_id, read.eos_token_id, read.pad_token_id) == (None, 256, None)
    # a tokenizer folder: eos as the run read it, pad as its tokenizer_config.json names it
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok_dir / name).write_bytes((folder / name).read_bytes())
    hf = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(tok_dir)))
    ids, notes = export_module.token_ids(hf, 384, tmp_path / "empty")
    vocab = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    special = {t["content"]: t["id"] for t in vocab}
    assert notes == [] and ids == {
        "bos_token_id": None,
        "eos_token_id": special["<|im_end|>"],
        "pad_token_id": special["<|endoftext|>"],
    }


def test_the_export_keeps_every_tokenizer_file_and_writes_the_runs_chat_template(folder, tmp_path):
    """The source's chat_template.jinja and other tokenizer files are copied; data.chat_template is
    written as chat_template.jinja, which transformers renders as it renders the template given
    directly; a template transformers renders otherwise is refused naming the file."""
    source = tmp_path / "source"
    shutil.copytree(folder, source)
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    (source / "added_tokens.json").write_text("{}")
    given = tmp_path / "run_template.jinja"
    given.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] | upper }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>ASSISTANT\n{% endif %}"
    )
    out = tmp_path / "out"
    for chat_template, expected in ((None, source / "chat_template.jinja"), (given, given)):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        more = {"data.tokenizer": source} | ({"data.chat_template": chat_template} if chat_template else {})
        cfg = _config(source, tmp_path, "unused", **more)
        export_module.copy_tokenizer(cfg, out)
        export_module.write_template(cfg, out, out)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
            assert (out / name).read_bytes() == (source / name).read_bytes(), name
        assert (out / "chat_template.jinja").read_text() == expected.read_text()
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        theirs = transformers.AutoTokenizer.from_pretrained(source)
        assert transformers.AutoTokenizer.from_pretrained(out).apply_chat_template(
            chat, tokenize=False
        ) == theirs.apply_chat_template(chat, tokenize=False, chat_template=expected.read_text())
    other = export_module.find_template(None, str(source / "chat_template.jinja"))
    with pytest.raises(nm.NamedError, match="out/chat_template.jinja: transformers renders"):
        export_module.check_template(out, other, out / "chat_template.jinja")


def test_a_full_fine_tune_exports_a_sharded_folder_transformers_loads_with_our_logits(
    full_run, folder, tmp_path, capsys
):
    out = tmp_path / "final"
    assert _export("--checkpoint", full_run, "--out", out, "--max-shard-size", "40KB") == 0
    assert "from step 3" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    theirs = hf_logits(out, IDS)
    np.testing.assert_allclose(_ours(full_run, IDS), theirs, atol=1e-4, rtol=0)
    assert np.abs(theirs - hf_logits(folder, IDS)).max() > 1e-2  # the trained weights, not the folder's


# ---- LoRA runs ------------------------------------------------------------------------------------


def test_a_merged_lora_export_gives_the_lora_runs_logits(lora_run, folder, tmp_path):
    out = tmp_path / "merged"
    assert _export("--checkpoint", lora_run, "--out", out, "--merge") == 0
    assert not (out / "adapter_config.json").exists()
    theirs = hf_logits(out, IDS)
    np.testing.assert_allclose(_ours(lora_run, IDS), theirs, atol=1e-4, rtol=0)
    assert np.abs(theirs - hf_logits(folder, IDS)).max() > 1e-2  # the adapters changed the function


def test_the_peft_adapter_folder_loads_in_peft_with_the_lora_runs_logits(lora_run, folder, tmp_path):
    import peft
    import transformers

    out = tmp_path / "adapters"
    assert _export("--checkpoint", lora_run, "--out", out, "--adapters-only") == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == (
        "LORA",
        "CAUSAL_LM",
        RANK,
        8,
    )
    assert sorted(config["target_modules"]) == sorted(ALL_LINEARS) and config["base_model_name_or_path"] == str(folder)
    tensors, base = load_file(out / "adapter_model.safetensors"), load_file(folder / "model.safetensors")
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert len(tensors) == 2 * layers * len(ALL_LINEARS)
    for name, w in base.items():  # [out, in] weights: A is [r, in], B is [out, r]
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in ALL_LINEARS:
            module = "base_model.model." + name.removesuffix(".weight")
            assert tensors[f"{module}.lora_A.weight"].shape == (RANK, w.shape[1])
            assert tensors[f"{module}.lora_B.weight"].shape == (w.shape[0], RANK)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, out).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(IDS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(_ours(lora_run, IDS), theirs, atol=1e-4, rtol=0)
    assert np.abs(theirs - hf_logits(folder, IDS)).max() > 1e-2


# ---- bad input and atomic writes --------------------------------------------------------------------


def _refused(capsys, out: Path, match: str, *args) -> None:
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    assert _export(*args, "--out", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err, err
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before  # nothing written
    assert not list(out.parent.glob(f".{out.name}.*"))  # nor left half-written beside it


def test_bad_input_is_refused_naming_it_before_anything_is_written(full_run, lora_run, tmp_path, capsys):
    out = tmp_path / "out"
    _refused(capsys, out, "--merge: the run in", "--checkpoint", full_run, "--merge")
    _refused(capsys, out, "has no LoRA adapters", "--checkpoint", full_run, "--adapters-only")
    _refused(capsys, out, "give --merge (a plain Hugging Face folder", "--checkpoint", lora_run)
    _refused(capsys, out, "not allowed with argument", "--checkpoint", lora_run, "--merge", "--adapters-only")
    _refused(
        capsys, out, f"--checkpoint {tmp_path / 'nowhere'}: no such directory", "--checkpoint", tmp_path / "nowhere"
    )
    _refused(
        capsys,
        out,
        "has no committed checkpoint of step 7; its checkpoints: steps 1, 2, 3",
        "--checkpoint",
        full_run,
        "--step",
        7,
    )
    _refused(capsys, out, "--max-shard-size", "--checkpoint", full_run, "--max-shard-size", "lots")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _refused(capsys, out, "exists and is not empty; give another folder, or --overwrite", "--checkpoint", full_run)
    assert (out / "keep.txt").read_text() == "mine"
    _refused(capsys, full_run, f"is the run directory {full_run}", "--checkpoint", full_run, "--overwrite")


def test_an_export_replaces_a_folder_whole_or_not_at_all(full_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")

    def broken(model, config, folder, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(export_module, "save_pretrained", broken)
        assert _export("--checkpoint", full_run, "--out", out, "--overwrite") == 1
    assert "No space left" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]  # the old folder, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left beside it
    assert _export("--checkpoint", full_run, "--out", out, "--overwrite") == 0
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_killed_exports_folder_is_removed_by_the_next_and_named(full_run, tmp_path, capsys):
    """A killed export leaves its temporary folder beside --out; the next export to --out removes
    it and says so. A folder a live export works in (it holds the folder's lock) stays."""
    from named.trainer.data import working_in

    out = tmp_path / "out"
    dead, live = tmp_path / ".out.tmp-dead0000", tmp_path / ".out.tmp-live0000"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    with working_in(live, live.mkdir):
        assert _export("--checkpoint", full_run, "--out", out) == 0
        assert f"removed {dead}, left behind by an export to {out}" in capsys.readouterr().out
        assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-live0000", "out"]


def test_an_out_in_or_over_what_a_run_keeps_is_refused(full_run, tmp_path, capsys):
    # --overwrite used to delete every checkpoint of the run (--out RUN/checkpoints) and exit 0
    ckdir = full_run / "checkpoints"
    kept = [s for s, _ in ckpt.list_checkpoints(full_run)]
    _refused(
        capsys,
        ckdir,
        f"--out {ckdir} is the checkpoint folder {ckdir}; an export never writes into",
        "--checkpoint",
        full_run,
        "--overwrite",
    )
    _refused(capsys, ckdir / "step_2", f"is the checkpoint {ckdir / 'step_2'}", "--checkpoint", full_run, "--overwrite")
    _refused(capsys, full_run / "hf", f"lies inside the run directory {full_run}", "--checkpoint", full_run)
    # the parent of the run, spelled with '..' or reached through a link, holds it
    _refused(
        capsys,
        full_run / "..",
        f"holds the run directory {full_run}, which --overwrite would delete",
        "--checkpoint",
        full_run,
        "--overwrite",
    )
    link = tmp_path / "link"
    link.symlink_to(full_run)
    _refused(
        capsys,
        link,
        f"--out {link} (a link to {full_run}) is the run directory",
        "--checkpoint",
        full_run,
        "--overwrite",
    )
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link"]  # no .link.old-* left
    # a checkpoint folder of any run (a checkpoint.base's holds committed step_N)
    base = tmp_path / "base" / "checkpoints"
    shutil.copytree(ckdir / "step_1", base / "step_1")
    _refused(capsys, base / "hf", f"lies inside the checkpoint folder {base}", "--checkpoint", full_run)
    assert [s for s, _ in ckpt.list_checkpoints(full_run)] == kept
    for _, path in ckpt.list_checkpoints(full_run):
        ckpt.verify_checkpoint(path)


def test_a_failed_safetensors_write_names_the_file_and_leaves_nothing(full_run, tmp_path, capsys):
    # a real file-size limit (Python ignores SIGXFSZ, so the write fails with EFBIG): safetensors
    # raises its own error, which used to escape the CLI as a traceback
    out = tmp_path / "out"
    limit = 64 << 10  # above config.json, below the weights
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        code = _export("--checkpoint", full_run, "--out", out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err
    assert code == 1, err
    assert (
        err == f"error: cannot write {out / 'model.safetensors'}: File too large; --out is unchanged (an export "
        "is renamed into place whole, or not at all)\n"
    )
    assert list(tmp_path.iterdir()) == []  # neither --out nor a temporary folder


def test_named_sample_logprobs_are_transformers_and_top_k_1_or_a_tiny_top_p_is_greedy(full_run, tmp_path, capsys):
    """``named-sample --logprobs``: each new token's log-probability equals transformers' on the export;
    top-k 1 and a tiny top-p at temperature 1 draw the greedy tokens."""
    from named.trainer.commands.cli import main_sample

    out = tmp_path / "hf"
    assert _export("--checkpoint", full_run, "--out", out) == 0
    capsys.readouterr()
    args = ["--checkpoint", str(full_run), "--prompt", "The quick brown", "--tokens", "5"]
    assert main_sample([*args, "--logprobs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split("\t") for line in lines if line.count("\t") == 3]
    new, logprobs = [int(r[1]) for r in rows], [float(r[3]) for r in rows]
    assert len(new) == 5
    prompt = transformers.AutoTokenizer.from_pretrained(out)("The quick brown", add_special_tokens=False)["input_ids"]
    logits = torch.log_softmax(torch.tensor(hf_logits(out, np.asarray([prompt + new]))[0]), -1).numpy()
    want = [logits[len(prompt) - 1 + i, t] for i, t in enumerate(new)]
    np.testing.assert_allclose(logprobs, want, atol=1e-4)
    assert new == [int(np.argmax(logits[len(prompt) - 1 + i])) for i in range(5)]  # greedy by default
    for flags in (["--top-k", "1"], ["--top-p", "1e-6"]):
        assert main_sample([*args, "--temperature", "1", "--seed", "3", "--logprobs", *flags]) == 0
        drawn = [int(r.split("\t")[1]) for r in capsys.readouterr().out.splitlines() if r.count("\t") == 3]
        assert drawn == new, flags
    assert main_sample([*args, "--top-p", "0"]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
