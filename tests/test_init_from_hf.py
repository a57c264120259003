"""``model.init_from_hf``: a run starts from a Hugging Face folder's weights and tokenizer.

The folder (tests/_chat_folder.py) is saved by ``transformers``; the run's model config, its
tokenizer and every weight come from it; YAML may set only the safe keys; bad folders and
mismatched tokenizers are refused before anything compiles or is written; a resume restores
from our checkpoint and does not read the folder's weights again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from _chat_folder import make_chat_folder, make_tokenizer
from safetensors.numpy import load_file, save_file

import named as nm
from named.models import hf_state_dict
from named.trainer.config import ConfigError, load_config
from named.trainer.loop.checks import checked_setup
from named.trainer.loop.model_init import init_model
from named.trainer.loop.train import train


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_chat_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "text.txt").write_text("The quick brown fox jumps over the lazy dog. Paris is the capital of France.\n" * 60)
    return d


def _config(folder, corpus, run_dir, *, steps=4, **more):
    over = {
        "model.init_from_hf": str(folder),
        "trainer.num_train_steps": steps,
        "trainer.train_batch_size": 8,
        "trainer.log_interval": 1,
        "trainer.eval_interval": 0,
        "trainer.progress_bar": "false",
        "trainer.run_dir": str(run_dir),
        "optimizer.warmup_steps": 0,
        "optimizer.learning_rate": 3e-3,
        "data.train": f"[{corpus / 'text.txt'}]",
        "data.seq_len": 32,
        "data.val_fraction": 0,
        "data.cache_dir": str(corpus / "cache"),
        "mesh.shape": "{data: 8}",
        "mesh.param_mapping": "{embed: data}",
        "tracker.console": "false",
        **more,
    }
    return load_config(None, [x for k, v in over.items() for x in (f"--{k}", str(v))])


def test_the_model_section_is_the_folders(folder, corpus, tmp_path):
    cfg = _config(folder, corpus, tmp_path / "run", **{"model.remat": "full"})
    hf = json.loads((folder / "config.json").read_text())
    assert type(cfg.model).__name__ == "LlamaConfigSection"
    assert (
        cfg.model.hidden_size,
        cfg.model.num_hidden_layers,
        cfg.model.num_key_value_heads,
        cfg.model.vocab_size,
    ) == (hf["hidden_size"], hf["num_hidden_layers"], hf["num_key_value_heads"], hf["vocab_size"])
    assert cfg.model.remat == "full"  # a safe override
    assert cfg.data.tokenizer == str(folder)  # the folder's tokenizer unless data names another
    # repeating the folder's value is allowed; changing it is not
    assert _config(folder, corpus, tmp_path / "run", **{"model.hidden_size": hf["hidden_size"]}).model.hidden_size == 32
    for key, value in (("model.hidden_size", 64), ("model.rope_theta", 5.0), ("model.vocab_size", 512)):
        with pytest.raises(ConfigError, match=rf"{key}=.*init_from_hf.*config.json"):
            _config(folder, corpus, tmp_path / "run", **{key: value})
    with pytest.raises(ConfigError, match="model.type='gpt2'.*holds a llama model"):
        _config(folder, corpus, tmp_path / "run", **{"model.type": "gpt2"})


def test_the_weights_are_the_folders_laid_out_by_the_mapping(folder, corpus, tmp_path):
    cfg = _config(folder, corpus, tmp_path / "run")
    s = checked_setup(cfg)
    with nm.set_mesh(s.mesh):
        model = init_model(
            cfg, s.model_cls, s.model_cfg, param_mapping=s.param_mapping, mesh=s.mesh, key=jax.random.key(0)
        )
    saved = load_file(folder / "model.safetensors")
    ours = hf_state_dict(model)
    assert sorted(ours) == sorted(saved)
    for name, value in saved.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    embed = model.embed_tokens.weight
    assert embed.array.sharding.spec == nm.pspec_for(embed.axes, {"embed": "data"}, s.mesh)
    assert len({d for d in embed.array.sharding.device_set}) == 8


def test_a_fine_tune_from_the_folder_trains_on_8_devices(folder, corpus, tmp_path):
    result = train(_config(folder, corpus, tmp_path / "run", steps=6))
    assert len(result.losses) == 6 and result.losses[-1] < result.losses[0] - 0.2
    # the first loss is the pretrained model's: near log(vocab) for this random tiny model, not garbage
    assert abs(result.losses[0] - np.log(300)) < 0.5


def test_a_resume_restores_our_checkpoint_not_the_folder(folder, corpus, tmp_path):
    constant = {"optimizer.schedule": "constant"}  # so that a run of 2 steps is the first half of one of 4
    whole = train(_config(folder, corpus, tmp_path / "whole", steps=4, **constant))
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    train(_config(copy, corpus, tmp_path / "split", steps=2, **constant))
    # the folder's weights change (same shapes, so every header check passes): a resume must not read them
    tensors = {k: v + 1.0 for k, v in load_file(copy / "model.safetensors").items()}
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    resumed = train(_config(copy, corpus, tmp_path / "split", steps=4, **constant))
    assert resumed.losses == whole.losses[2:]


def _refused(cfg_fn, match, run_dir: Path):
    with pytest.raises(ConfigError, match=match):
        train(cfg_fn())
    assert not run_dir.exists()  # refused before anything was written


def test_bad_folders_are_refused_before_anything_is_written(folder, corpus, tmp_path):
    run = tmp_path / "run"
    no_weights = tmp_path / "no_weights"
    shutil.copytree(folder, no_weights)
    (no_weights / "model.safetensors").unlink()
    _refused(lambda: _config(no_weights, corpus, run), r"model.init_from_hf: .*no_weights", run)

    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(folder, wrong_shape)
    tensors = load_file(wrong_shape / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(7, np.float32)
    save_file(tensors, str(wrong_shape / "model.safetensors"), metadata={"format": "pt"})
    _refused(
        lambda: _config(wrong_shape, corpus, run), r"model.init_from_hf: .*'model.norm.weight' has shape \[7\]", run
    )

    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(folder, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    _refused(
        lambda: _config(no_tokenizer, corpus, run),
        "no_tokenizer has no tokenizer.json; name a tokenizer with data.tokenizer",
        run,
    )

    _refused(lambda: _config(tmp_path / "absent", corpus, run), r"model.init_from_hf: .*absent: not found", run)


def test_a_tokenizer_of_another_vocabulary_is_refused(folder, corpus, tmp_path):
    other = tmp_path / "other_tokenizer"
    other.mkdir()
    tok = make_tokenizer()
    tok.add_tokens([f"<extra_{i}>" for i in range(40)])  # 340 ids for a model of 300
    tok.save(str(other / "tokenizer.json"))
    run = tmp_path / "run"
    _refused(
        lambda: _config(folder, corpus, run, **{"data.tokenizer": str(other), "data.eos_token": "<|im_end|>"}),
        r"model.vocab_size=300 of .* \(model.init_from_hf\) is smaller than the tokenizer's 340 tokens",
        run,
    )
