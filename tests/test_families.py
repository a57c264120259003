"""The decoder families (Llama 3.x RoPE variants, Mistral, Qwen2, Qwen3, OLMo 2, Gemma 2, Gemma 3)
against transformers on the same weights: logits, gradients, greedy decoding with the KV cache
past the sliding window, export, the import check, and the config.json fields we refuse."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging

import equinox as eqx
import jax
import jax.extend
import numpy as np
import pytest
import torch
import transformers
from _hf_models import (
    FAMILY_CONFIGS,
    build,
    forward,
    gradient_errors,
    hf_logits,
    load_hf,
    named_ids,
    random_ids,
    random_model,
)

import named as nm
from named import models
from named.models import CheckpointFormatError, families
from named.models._rope import RopeScaling, rope_frequencies

BATCH, SEQ, PROMPT, NEW = 2, 13, 5, 20
NAMES = list(FAMILY_CONFIGS)
each = pytest.mark.parametrize("name", NAMES)
# settings each test model must show the effect of (turning one off changes the logits), so that
# a passing test cannot mean that the feature is absent
NO_WINDOW = dict(sliding_window=None, layer_types=None)
FEATURES = {
    "llama3.2-llama3rope-gqa6/2-tied": [dict(rope_scaling=RopeScaling())],
    "llama-linear-mqa3/1-bias": [dict(rope_scaling=RopeScaling())],
    "llama-yarn-mha5": [dict(rope_scaling=RopeScaling())],
    "mistral-window5-mqa5/1": [NO_WINDOW],
    "qwen2-bias-window4-gqa6/3-tied": [NO_WINDOW],
    "gemma2-softcap-window4-mqa3/1-untied": [
        NO_WINDOW,
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(query_pre_attn_scalar=None),
    ],
    "gemma3-local:global-window4-gqa4/2-untied": [
        NO_WINDOW,
        dict(rope_local_base_freq=None),
        dict(rope_scaling=RopeScaling()),
        dict(query_pre_attn_scalar=None),
    ],
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``pairs(name)``: (transformers model, its folder, our config, our model loaded from it)."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = build(name, seed=3, scale=0.3)  # large enough weights for a varied greedy continuation
            folder = tmp_path_factory.mktemp(name.replace("/", "-").replace(":", "-"))
            hf.save_pretrained(folder)
            cache[name] = (hf, folder, *models.load_pretrained(folder))
        return cache[name]

    return get


@each
def test_logits_match_transformers(pairs, name):
    hf, _, config, model = pairs(name)
    assert type(config).__name__ == type(hf.config).__name__.replace("Text", "")
    ids = random_ids(config.vocab_size, (BATCH, SEQ))
    ours = np.asarray(forward(model, named_ids(ids)))
    diff = np.abs(ours - hf_logits(hf, ids)).max()
    print(f"\n{name}: {type(hf).__name__} max |logit difference| = {diff:.2e}")
    assert diff < 1e-4
    for off in FEATURES.get(name, []):
        changed = dataclasses.replace(model, config=dataclasses.replace(config, **off))
        assert np.abs(np.asarray(forward(changed, named_ids(ids))) - ours).max() > 1e-3, f"{off} has no effect"


@each
def test_gradients_match_torch(pairs, name):
    hf, _, config, model = pairs(name)
    loss_diff, errors = gradient_errors(hf, model, random_ids(config.vocab_size, (BATCH, SEQ), seed=1))
    assert loss_diff < 1e-5
    worst = max(errors.values())
    print(f"\n{name}: worst relative gradient difference {worst:.1e}")
    assert worst < 1e-4


@each
def test_greedy_decoding_equals_transformers_past_the_window(pairs, name):
    hf, _, config, model = pairs(name)
    prompt = random_ids(config.vocab_size, (BATCH, PROMPT), seed=4)
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(prompt, dtype=torch.long),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
        ).numpy()
    ours = np.asarray(models.generate(model, named_ids(prompt), NEW, temperature=0).array)
    np.testing.assert_array_equal(ours, ref)
    assert len(np.unique(ours[:, PROMPT:])) > 8, "degenerate continuation: the comparison would prove little"
    if config.sliding_window is not None:
        assert PROMPT + NEW > 2 * config.sliding_window


@each
def test_export_loads_in_transformers(pairs, name, tmp_path):
    hf, _, config, model = pairs(name)
    models.save_pretrained(model, config, tmp_path)
    again = load_hf(tmp_path)
    assert type(again) is type(hf)
    ids = random_ids(config.vocab_size, (BATCH, SEQ), seed=2)
    np.testing.assert_allclose(hf_logits(again, ids), np.asarray(forward(model, named_ids(ids))), atol=1e-4, rtol=0)
    np.testing.assert_allclose(hf_logits(again, ids), hf_logits(hf, ids), atol=1e-6, rtol=0)
    assert models.config_from_hf(tmp_path) == config
    assert models.num_params(config) == sum(p.numel() for p in hf.parameters())


# ---- packing and windows -------------------------------------------------------------------


@pytest.mark.parametrize("cls", [families.MistralConfig, families.Gemma3Config])
def test_packed_documents_stay_separate_under_a_window(cls):
    config = cls(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=97,
        max_position_embeddings=32,
        sliding_window=3,
        sliding_window_pattern=None if cls is families.MistralConfig else 3,
    )
    model = random_model(models.DecoderLMHeadModel, config)
    docs = [random_ids(97, (n,), seed=n) for n in (5, 7, 4, 8)]
    packed = np.stack([np.concatenate(docs[:2]), np.concatenate(docs[2:])])
    segments = np.array([[0] * 5 + [1] * 7, [3] * 4 + [4] * 8], dtype=np.int32)
    together = np.asarray(
        eqx.filter_jit(lambda m, i, s: m(i, segment_ids=s).rearrange(("batch", "position", "vocab")).array)(
            model, named_ids(packed), named_ids(segments)
        )
    )
    alone = np.asarray(forward(model, named_ids(np.stack([np.pad(d, (0, 12 - len(d))) for d in docs]))))
    for d, (row, start) in enumerate([(0, 0), (0, 5), (1, 0), (1, 4)]):
        n = len(docs[d])
        np.testing.assert_allclose(together[row, start : start + n], alone[d, :n], atol=1e-5, rtol=0)
    # the window matters here: without it the documents (longer than 3) compute something else
    wide = dataclasses.replace(model, config=dataclasses.replace(config, sliding_window=None))
    assert (
        np.abs(np.asarray(forward(wide, named_ids(packed))) - np.asarray(forward(model, named_ids(packed)))).max()
        > 1e-3
    )


def test_per_layer_differences_are_scanned_data():
    # Gemma 3's local and global layers differ in window and RoPE: one stack of weights, one scan
    c = families.Gemma3Config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=97,
        max_position_embeddings=32,
        sliding_window=4,
    )
    assert c.layer_windows == (4, 4, 4, 4, 4, None)
    data = models.decoder.layer_data(c)
    assert data["window"].axes == (c.Layers,) and data["inv_freq"].axes == (c.Layers, c.Rotary)
    model = random_model(models.DecoderLMHeadModel, c)
    jaxpr = jax.make_jaxpr(lambda m, i: m(i).array)(model, named_ids(random_ids(97, (1, 9))))
    scans = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [6]


def _equations(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _equations(sub)


@pytest.mark.parametrize(
    "config",
    [
        families.Gemma3Config(num_hidden_layers=7, sliding_window=5),
        families.Gemma2Config(sliding_window=100),
        families.MistralConfig(sliding_window=100),
        families.LlamaConfig(),
        families.Qwen2Config(
            num_hidden_layers=3,
            sliding_window=4,
            layer_types=("full_attention", "sliding_attention", "sliding_attention"),
        ),
    ],
)
def test_flops_count_each_layers_keys(config):
    # the closed form equals the sum over layers of each one's keys (its window, or the sequence)
    d = config.num_attention_heads * config.HeadSize.size
    keys = sum(64 if w is None else min(64, w) for w in config.layer_windows)
    assert models.flops_per_token(config, 64) == models.flops_per_token(config, 0) + 12.0 * d * keys


# ---- config.json ---------------------------------------------------------------------------------

REAL = {  # config.json of published checkpoints (as on the hub), read without their weights
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "initializer_range": 0.02,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vocab_size": 262144,
    },
}


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _hf_rope(hf_config, layer_type):
    """transformers' own inverse frequencies and attention factor for a layer type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = hf_config.rope_parameters
    nested = layer_type in params
    kind = (params[layer_type] if nested else params)["rope_type"]
    kw = {"layer_type": layer_type} if nested else {}
    if kind == "default":
        theta = (params[layer_type] if nested else params)["rope_theta"]
        d = _head_dim(hf_config)
        return 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d)), 1.0
    inv, factor = ROPE_INIT_FUNCTIONS[kind](hf_config, None, **kw)
    return inv.numpy(), factor


@pytest.mark.parametrize("name", list(REAL))
def test_published_configs_read_as_transformers_reads_them(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(REAL[name]))
    config = models.config_from_hf(tmp_path)
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    hf_types = getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers
    assert [("sliding_attention" if local else "full_attention") for local in config.local_layers] == list(hf_types)
    for local in set(config.local_layers):
        layer_type = "sliding_attention" if local else "full_attention"
        if local and config.rope_local_base_freq is not None:
            ours = rope_frequencies(
                config.HeadSize.size, config.rope_local_base_freq, RopeScaling(), config.max_position_embeddings
            )
        else:
            ours = rope_frequencies(
                config.HeadSize.size, config.rope_theta, config.rope_scaling, config.max_position_embeddings
            )
        theirs = _hf_rope(hf_config, layer_type)
        np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6)
        assert ours[1] == pytest.approx(theirs[1])
    assert config.HeadSize.size == _head_dim(hf_config) and config.tie_word_embeddings == hf_config.tie_word_embeddings


def test_yarn_frequencies_match_transformers():
    hf_config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        max_position_embeddings=4096,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=8.0,
            original_max_position_embeddings=512,
            beta_fast=16.0,
            mscale=1.0,
            mscale_all_dim=0.5,
        ),
    )
    ours = rope_frequencies(
        32,
        10000.0,
        RopeScaling(
            "yarn", factor=8.0, original_max_position_embeddings=512, beta_fast=16.0, mscale=1.0, mscale_all_dim=0.5
        ),
        4096,
    )
    theirs = _hf_rope(hf_config, None)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-6)
    assert ours[1] == pytest.approx(theirs[1]) and ours[1] != 1.0


def _config_json(pairs, name) -> dict:
    return json.loads((pairs(name)[1] / "config.json").read_text())


@pytest.mark.parametrize(
    "name, field, value, expect",
    [
        ("qwen3-qknorm-gqa6/2-bias", "use_mrope", True, "unsupported field 'use_mrope'"),
        ("llama-yarn-mha5", "quantization_config", {"quant_method": "gptq"}, "unsupported field 'quantization_config'"),
        ("mistral-window5-mqa5/1", "attention_dropout", 0.1, "unsupported attention_dropout=0.1"),
        (
            "gemma2-softcap-window4-mqa3/1-untied",
            "use_bidirectional_attention",
            True,
            "unsupported use_bidirectional_attention=True",
        ),
        (
            "gemma3-local:global-window4-gqa4/2-untied",
            "attn_logit_softcapping",
            50.0,
            "unsupported attn_logit_softcapping=50.0",
        ),
        (
            "gemma3-local:global-window4-gqa4/2-untied",
            "hidden_activation",
            "gelu",
            "unsupported hidden_activation='gelu'",
        ),
        (
            "llama-linear-mqa3/1-bias",
            "rope_parameters",
            {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "beta_fast": 3},
            "unsupported rope_parameters.beta_fast",
        ),
        ("qwen2-bias-window4-gqa6/3-tied", "layer_types", ["full_attention"], "field 'layer_types'"),
    ],
)
def test_fields_we_do_not_implement_are_named(pairs, tmp_path, name, field, value, expect):
    d = {**_config_json(pairs, name), field: value}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointFormatError) as info:
        models.config_from_hf(tmp_path)
    assert expect in str(info.value) and "config.json" in str(info.value)


def test_a_config_round_trips_through_the_trainers_json():
    # a run directory keeps its model config as {"type": ..., **asdict(config)}; sampling reads it back
    from named.trainer.loop.registry import model_config_from_dict, model_type

    config = families.Gemma3Config(
        num_hidden_layers=3,
        sliding_window=8,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        rope_scaling=RopeScaling("linear", factor=8.0),
    )
    saved = json.loads(json.dumps({"type": model_type(config), **dataclasses.asdict(config)}))
    assert saved["type"] == "gemma3" and model_config_from_dict(saved) == config


def test_a_config_the_family_cannot_hold_is_not_saved(tmp_path):
    config = families.LlamaConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=11,
        max_position_embeddings=8,
        qk_norm="head",
    )
    model = random_model(models.DecoderLMHeadModel, config)
    with pytest.raises(
        CheckpointFormatError, match=r"LlamaConfig.qk_norm='head': LlamaForCausalLM has no such setting"
    ):
        models.save_pretrained(model, config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _small(family):
    if family.name == "gpt2":
        return family.config_cls(
            n_layer=2, n_head=2, n_embd=16, n_positions=8, vocab_size=11, n_inner=24, tie_word_embeddings=False
        )
    return family.config_cls(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=11,
        max_position_embeddings=8,
    )


@pytest.mark.parametrize("family", list(models.FAMILIES))
def test_every_family_answers_the_same_contract(family, tmp_path):
    """GPT-2 and every decoder family: an ``HfLayout`` that names each parameter of the model,
    one ``from_hf`` / ``to_hf`` path through its config.json format, and the library's norms."""
    from named.models.registry import FAMILIES

    f = FAMILIES[family]
    config = _small(f)
    model = eqx.filter_eval_shape(f.model_cls.init, config, key=jax.random.key(0))  # nothing allocated
    assert isinstance(f.layout, models.HfLayout)
    paths = {entry.path for entry in nm.state_dict_entries(model)}
    assert paths <= set(f.layout.keys), sorted(paths - set(f.layout.keys))
    written = json.loads(json.dumps(f.to_hf(config)))
    assert written["model_type"] == f.model_type and written["architectures"] == [f.architecture]
    read = f.from_hf(written, tmp_path / "config.json")
    assert type(read) is type(config) and f.to_hf(read) == written
    assert f.num_params(config) == sum(x.size for x in jax.tree.leaves(model))
    norm = model.ln_f if family == "gpt2" else model.norm
    assert type(norm) is (nm.nn.LayerNorm if family == "gpt2" else nm.nn.RMSNorm)
    assert models.forward_with_aux.__module__ == models.hidden_with_aux.__module__ == "named.models._common"


# ---- the import check ----------------------------------------------------------------------------


def test_load_with_check_reports_the_logit_difference(pairs, caplog):
    hf, folder, config, model = pairs("qwen3-qknorm-gqa6/2-bias")
    report = models.check_pretrained(folder, model)
    assert report.max_logit_diff is not None and report.max_logit_diff < 1e-4
    assert "Qwen3ForCausalLM" in report.reference and report.tensors == len(models.hf_state_dict(model))
    with caplog.at_level(logging.INFO, logger="named.models"):
        models.load_pretrained(folder, check=True)
    assert "max |logit difference|" in caplog.text
    # a wrong weight is caught: swap two layers' q_proj in the folder we then check
    _, loaded = models.load_pretrained(folder)
    q = loaded.layers.stacked.self_attn.q_proj.weight
    swapped = eqx.tree_at(
        lambda m: m.layers.stacked.self_attn.q_proj.weight, loaded, nm.NamedArray(q.array[::-1], q.axes)
    )
    assert models.check_pretrained(folder, swapped).max_logit_diff > 1e-3


def test_check_without_transformers_checks_shapes_and_keys(pairs, monkeypatch):
    _, folder, _, model = pairs("olmo2-gqa6/2")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a))
    report = models.check_pretrained(folder, model)
    assert report.max_logit_diff is None and "not installed" in report.reference
    assert report.tensors == len(models.hf_state_dict(model))
    smaller = families.Olmo2Config(**{**dataclasses.asdict(model.config), "num_hidden_layers": 1})
    with pytest.raises(CheckpointFormatError, match=r"unexpected \['model.layers.1."):
        models.check_pretrained(folder, random_model(models.DecoderLMHeadModel, smaller))
