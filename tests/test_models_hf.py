"""GPT-2 and Llama against transformers on the same weights: import, export, gradients, packing,
parameter counts, and the errors a bad Hugging Face folder raises."""

from __future__ import annotations

import json
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _hf_models import (
    CONFIGS,
    GPT2,
    build,
    forward,
    gradient_errors,
    hf_logits,
    load_hf,
    named_ids,
    random_ids,
    random_model,
)
from safetensors.numpy import load_file, save_file

from named import models
from named.models import CheckpointFormatError, Gpt2Config, Gpt2LMHeadModel, LlamaConfig, LlamaLMHeadModel

BATCH, SEQ = 2, 13


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``pairs(name)``: (name, transformers model, its folder, our config, our model loaded from
    that folder), built once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = build(name)
            folder = tmp_path_factory.mktemp(name.replace("/", "-"))
            hf.save_pretrained(folder, safe_serialization=True)
            cache[name] = (name, hf, folder, *models.load_pretrained(folder))
        return cache[name]

    return get


each_config = pytest.mark.parametrize("name", list(CONFIGS))


@each_config
def test_logits_match_transformers(pairs, name):
    name, hf, _, config, model = pairs(name)
    ids = random_ids(config.vocab_size, (BATCH, SEQ))
    diff = np.abs(np.asarray(forward(model, named_ids(ids))) - hf_logits(hf, ids)).max()
    print(f"\n{name}: max |logit difference| vs transformers = {diff:.2e}")
    assert diff < 1e-4


@each_config
def test_config_read_from_hf(pairs, name):
    name, hf, _, config, _ = pairs(name)
    if name in GPT2:
        assert isinstance(config, Gpt2Config)
        assert (config.n_layer, config.n_head, config.n_embd) == (hf.config.n_layer, hf.config.n_head, hf.config.n_embd)
    else:
        assert isinstance(config, LlamaConfig)
        assert config.num_key_value_heads == hf.config.num_key_value_heads
        assert config.rope_theta == hf.config.rope_parameters["rope_theta"]
        assert config.HeadSize.size == hf.config.head_dim
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings


# three configurations: compiling a backward pass takes seconds on CPU
GRADIENT_CONFIGS = ("gpt2-tied", "llama-gqa4/2-untied", "llama-gqa4/1-tied")


@pytest.mark.parametrize("name", GRADIENT_CONFIGS)
def test_gradients_match_torch(pairs, name):
    name, hf, _, config, model = pairs(name)
    loss_diff, errors = gradient_errors(hf, model, random_ids(config.vocab_size, (BATCH, SEQ), seed=1))
    assert loss_diff < 1e-5
    for n, rel in errors.items():
        assert rel < 1e-4, f"{name}: gradient of {n} differs by {rel:.1e} (relative)"


@each_config
def test_export_loads_in_transformers(pairs, name, tmp_path):
    name, hf, _, config, model = pairs(name)
    models.save_pretrained(model, config, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    again = load_hf(tmp_path)
    assert type(again) is type(hf)
    ids = random_ids(config.vocab_size, (BATCH, SEQ), seed=2)
    ours = np.asarray(forward(model, named_ids(ids)))
    np.testing.assert_allclose(hf_logits(again, ids), ours, atol=1e-4, rtol=0)
    np.testing.assert_allclose(hf_logits(again, ids), hf_logits(hf, ids), atol=1e-6, rtol=0)
    assert sum(p.numel() for p in again.parameters()) == sum(p.numel() for p in hf.parameters())


@each_config
def test_sharded_export_round_trips(pairs, name, tmp_path):
    name, hf, _, config, model = pairs(name)
    models.save_pretrained(model, config, tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((tmp_path / f).is_file() for f in files)
    assert not (tmp_path / "model.safetensors").exists()
    _, back = models.load_pretrained(tmp_path)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = random_ids(config.vocab_size, (BATCH, SEQ), seed=3)
    np.testing.assert_allclose(hf_logits(load_hf(tmp_path), ids), hf_logits(hf, ids), atol=1e-6, rtol=0)


def test_loads_folders_transformers_sharded(tmp_path):
    hf = build("llama-gqa4/2-untied")
    hf.save_pretrained(tmp_path, max_shard_size="30KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, model = models.load_pretrained(tmp_path)
    ids = random_ids(97, (BATCH, SEQ))
    assert np.abs(np.asarray(forward(model, named_ids(ids))) - hf_logits(hf, ids)).max() < 1e-4


def test_bfloat16_checkpoint(tmp_path):
    hf = build("gpt2-tied").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    _, kept = models.load_pretrained(tmp_path, dtype=None)
    _, upcast = models.load_pretrained(tmp_path)
    assert kept.wte.weight.dtype == jnp.bfloat16 and upcast.wte.weight.dtype == jnp.float32
    ref = hf.transformer.wte.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(upcast.wte.weight.array), ref)
    np.testing.assert_array_equal(np.asarray(kept.wte.weight.array, dtype=np.float32), ref)


# ---- packing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_packed_documents_equal_separate_documents(kind):
    if kind == "gpt2":
        config = Gpt2Config(n_layer=2, n_head=4, n_embd=48, n_positions=32, vocab_size=97)
        model = random_model(Gpt2LMHeadModel, config)
    else:
        config = LlamaConfig(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=97,
            max_position_embeddings=32,
        )
        model = random_model(LlamaLMHeadModel, config)
    docs = [random_ids(97, (n,), seed=n) for n in (5, 7, 4, 8)]
    packed = np.stack([np.concatenate(docs[:2]), np.concatenate(docs[2:])])  # two rows of 12
    segments = np.array([[0] * 5 + [1] * 7, [3] * 4 + [4] * 8], dtype=np.int32)
    together = eqx.filter_jit(
        lambda m, ids, seg: m(ids, segment_ids=seg).rearrange(("batch", "position", "vocab")).array
    )(model, named_ids(packed), named_ids(segments))
    together = np.asarray(together)
    # each document alone, at the start of a row: the filler after it cannot reach it (causal)
    alone = np.stack([np.concatenate([d, np.zeros(12 - len(d), np.int32)]) for d in docs])
    alone = np.asarray(forward(model, named_ids(alone)))
    for d, (row, start) in enumerate([(0, 0), (0, 5), (1, 0), (1, 4)]):
        n = len(docs[d])
        np.testing.assert_allclose(together[row, start : start + n], alone[d, :n], atol=1e-5, rtol=0)
    # without segment ids the second document would see the first: the test can fail
    unsegmented = np.asarray(forward(model, named_ids(packed)))
    assert np.abs(unsegmented[0, 5:] - alone[1, :7]).max() > 1e-3


# ---- sizes --------------------------------------------------------------------------------------


def _leaf_count(model) -> int:
    return sum(x.size for x in jax.tree.leaves(model))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_num_params_counts_the_model(name, tmp_path):
    hf = build(name)
    hf.save_pretrained(tmp_path)
    config = models.config_from_hf(tmp_path)
    cls = Gpt2LMHeadModel if name in GPT2 else LlamaLMHeadModel
    shapes = eqx.filter_eval_shape(cls.init, config, key=jax.random.key(0))
    assert models.num_params(config) == _leaf_count(shapes) == sum(p.numel() for p in hf.parameters())


def test_num_params_and_flops_closed_forms():
    # GPT-2 small: the well-known 124M (tied head, 1024 positions)
    g = Gpt2Config()
    D, V, L, P = 768, 50257, 12, 1024
    assert models.num_params(g) == V * D + P * D + L * (12 * D * D + 13 * D) + 2 * D == 124_439_808
    assert models.flops_per_token(g, 1024) == 6 * (L * 12 * D * D + D * V) + 12 * L * D * 1024
    untied = Gpt2Config(tie_word_embeddings=False, n_inner=1000)
    M = 1000
    assert models.num_params(untied) == 2 * V * D + P * D + L * (4 * D * D + 2 * D * M + 9 * D + M) + 2 * D
    assert models.flops_per_token(untied, 7) == 6 * (L * (4 * D * D + 2 * D * M) + D * V) + 12 * L * D * 7
    # Llama-2 7B: 6.74B parameters
    lcfg = LlamaConfig()
    assert models.num_params(lcfg) == 6_738_415_616
    D, I, L, V = 4096, 11008, 32, 32000
    assert models.flops_per_token(lcfg, 4096) == 6 * (L * (4 * D * D + 3 * D * I) + D * V) + 12 * L * D * 4096
    # GQA and a head_dim of its own: q/o use heads*head_dim, k/v kv_heads*head_dim
    gqa = LlamaConfig(
        hidden_size=64,
        intermediate_size=100,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=50,
        tie_word_embeddings=True,
    )
    per_layer = 64 * 128 + 2 * 64 * 32 + 128 * 64 + 3 * 64 * 100
    assert models.num_params(gqa) == 50 * 64 + 3 * (per_layer + 2 * 64) + 64
    assert models.flops_per_token(gqa, 10) == 6 * (3 * per_layer + 64 * 50) + 12 * 3 * 128 * 10


# ---- bad folders ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    config = Gpt2Config(n_layer=2, n_head=2, n_embd=8, n_positions=8, vocab_size=11)
    models.save_pretrained(random_model(Gpt2LMHeadModel, config), config, folder)
    models.load_pretrained(folder)  # it is good
    return folder


def _copy(src, dst, *, edit_tensors=None, edit_config=None):
    dst.mkdir(exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _error(folder) -> str:
    with pytest.raises(CheckpointFormatError) as info:
        models.load_pretrained(folder)
    return str(info.value)


def test_missing_tensor(good_folder, tmp_path):
    msg = _error(_copy(good_folder, tmp_path, edit_tensors=lambda t: t.pop("transformer.h.1.mlp.c_fc.bias")))
    assert "missing tensor 'transformer.h.1.mlp.c_fc.bias'" in msg


def test_unexpected_tensor(good_folder, tmp_path):
    def add(t):
        t["transformer.h.0.attn.q_norm.weight"] = np.ones(8, np.float32)

    msg = _error(_copy(good_folder, tmp_path, edit_tensors=add))
    assert "unexpected tensor 'transformer.h.0.attn.q_norm.weight'" in msg and "model.safetensors" in msg


def test_wrong_shape(good_folder, tmp_path):
    def bad(t):
        t["transformer.h.0.attn.c_attn.weight"] = np.zeros((24, 8), np.float32)  # [out, in]: transposed

    msg = _error(_copy(good_folder, tmp_path, edit_tensors=bad))
    assert "'transformer.h.0.attn.c_attn.weight' has shape [24, 8], expected [8, 24]" in msg


@pytest.mark.parametrize(
    "field, value, expect",
    [
        ("model_type", "deepseek_v3", "unsupported model_type 'deepseek_v3'"),
        ("architectures", ["GPT2ForSequenceClassification"], "unsupported architectures"),
        ("scale_attn_by_inverse_layer_idx", True, "unsupported scale_attn_by_inverse_layer_idx=True"),
        ("activation_function", "swiglu_v9", "unsupported activation_function='swiglu_v9'"),
        ("n_embd", "eight", "field 'n_embd' should be int"),
    ],
)
def test_unsupported_config(good_folder, tmp_path, field, value, expect):
    msg = _error(_copy(good_folder, tmp_path, edit_config=lambda c: c.__setitem__(field, value)))
    assert expect in msg and "config.json" in msg


@pytest.mark.parametrize("field", ["n_embd", "model_type", "vocab_size"])
def test_missing_config_field(good_folder, tmp_path, field):
    msg = _error(_copy(good_folder, tmp_path, edit_config=lambda c: c.pop(field)))
    assert f"missing field {field!r}" in msg and "config.json" in msg


def test_llama_config_fields(tmp_path):
    base = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=10,
        max_position_embeddings=8,
    )
    (tmp_path / "config.json").write_text(json.dumps({**base, "rope_theta": 123.0}))  # pre-v5 layout
    config = models.config_from_hf(tmp_path)
    assert config.rope_theta == 123.0 and config.num_key_value_heads == 2 and not config.tie_word_embeddings
    (tmp_path / "config.json").write_text(json.dumps({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(CheckpointFormatError, match=r"missing field 'rope_scaling.low_freq_factor'"):
        models.config_from_hf(tmp_path)  # llama3 reads four fields, all required
    (tmp_path / "config.json").write_text(
        json.dumps({**base, "rope_scaling": {"rope_type": "longrope", "factor": 8.0}})
    )
    with pytest.raises(CheckpointFormatError, match=r"unsupported rope_scaling.rope_type='longrope'"):
        models.config_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**base, "mlp_bias": True}))
    with pytest.raises(CheckpointFormatError, match="unsupported mlp_bias=True"):
        models.config_from_hf(tmp_path)


def test_original_openai_gpt2_names_load(good_folder, tmp_path):
    # the hub's "gpt2" was saved from GPT2Model: no "transformer." prefix, causal-mask buffers,
    # and (in some conversions) a tied lm_head copy
    def openai(t):
        for name in list(t):
            t[name.removeprefix("transformer.")] = t.pop(name)
        for i in range(2):
            t[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
            t[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
        t["lm_head.weight"] = t["wte.weight"]

    _, ours = models.load_pretrained(good_folder)
    _, theirs = models.load_pretrained(_copy(good_folder, tmp_path, edit_tensors=openai))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_corrupted_safetensors_header(good_folder, tmp_path):
    folder = _copy(good_folder, tmp_path)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 2**62)  # a header "larger" than the file: must not be allocated
    path.write_bytes(bytes(data))
    msg = _error(folder)
    assert str(path) in msg and "corrupted safetensors header" in msg
    path.write_bytes(b"\x05\x00")
    assert "too short for a safetensors file" in _error(folder)


def test_missing_files(good_folder, tmp_path):
    assert "config.json: not found" in _error(tmp_path)
    (tmp_path / "config.json").write_text((good_folder / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle we would ever open")
    msg = _error(tmp_path)
    assert "no model.safetensors" in msg and "pytorch_model.bin" in msg and "never loaded" in msg


def test_sharded_index_names_a_missing_file(good_folder, tmp_path):
    config = Gpt2Config(n_layer=2, n_head=2, n_embd=8, n_positions=8, vocab_size=11)
    _, model = models.load_pretrained(good_folder)
    models.save_pretrained(model, config, tmp_path, max_shard_size=600)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    assert f"{victim}: listed in model.safetensors.index.json but not found" in _error(tmp_path)


def test_save_checks_the_config(good_folder, tmp_path):
    _, model = models.load_pretrained(good_folder)
    with pytest.raises(ValueError, match="has axes"):
        models.save_pretrained(model, Gpt2Config(n_layer=2, n_head=2, n_embd=8, n_positions=8, vocab_size=12), tmp_path)
