"""Generation with a KV cache: greedy decoding equals transformers' on the same weights, cached
decoding equals the full forward pass, and sampling follows its settings and its key."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _compiles import compiles
from _hf_models import build, random_ids, random_model

import named as nm
from named import models
from named.models import Gpt2Config, Gpt2LMHeadModel, LlamaConfig, LlamaLMHeadModel

NEW = 12


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``pairs(name)``: (transformers model, ours loaded from its folder, a prompt), built once."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = build(name, seed=3, scale=0.3)  # larger weights: a varied greedy continuation
            folder = tmp_path_factory.mktemp(name.replace("/", "-"))
            hf.save_pretrained(folder)
            config, model = models.load_pretrained(folder)
            cache[name] = hf, model, random_ids(config.vocab_size, (2, 5), seed=4)
        return cache[name]

    return get


def _named(ids):
    return nm.named(jnp.asarray(ids), ("batch", "position"))


def _greedy(model, prompt):
    return np.asarray(models.generate(model, _named(prompt), NEW, temperature=0).array)


@pytest.mark.parametrize("name", ["gpt2-untied-n_inner", "llama-gqa4/2-untied"])
def test_greedy_equals_transformers(pairs, name):
    hf, model, prompt = pairs(name)
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(prompt, dtype=torch.long),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
        ).numpy()
    ours = _greedy(model, prompt)
    assert ours.shape == (2, 5 + NEW)
    np.testing.assert_array_equal(ours, ref)
    assert len(np.unique(ours[:, 5:])) > 4, "degenerate continuation: the comparison would prove little"


def test_stop_ids_end_each_row_where_transformers_stops(pairs):
    hf, model, prompt = pairs("llama-gqa4/2-untied")
    greedy = _greedy(model, prompt)
    # a stop id that each row reaches at a different step: the third new token of row 0
    stop = int(greedy[0, 5 + 2])
    ours = np.asarray(models.generate(model, _named(prompt), NEW, temperature=0, stop_ids=[stop]).array)
    hf.generation_config.pad_token_id = stop
    with torch.no_grad():  # transformers pads a finished row with pad_token_id: here the stop id itself
        ref = hf.generate(
            torch.tensor(prompt, dtype=torch.long),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=stop,
        ).numpy()
    for row in range(2):
        hits = np.flatnonzero(greedy[row, 5:] == stop)
        cut = 5 + (hits[0] + 1 if len(hits) else NEW)
        np.testing.assert_array_equal(ours[row, :cut], greedy[row, :cut])  # identical up to the stop
        assert (ours[row, cut:] == stop).all()  # then the stop id repeated
        np.testing.assert_array_equal(ours[row, : ref.shape[1]][:cut], ref[row, :cut])
    assert ours[0, 5 + 3 :].tolist() == [stop] * (NEW - 3)


def test_top_k_1_and_tiny_top_p_are_greedy(pairs):
    _, model, prompt = pairs("llama-gqa4/2-untied")  # one model: each setting compiles a program
    greedy = _greedy(model, prompt)
    k1 = models.generate(model, _named(prompt), NEW, temperature=0.8, top_k=1, key=jax.random.key(5))
    np.testing.assert_array_equal(np.asarray(k1.array), greedy)
    p0 = models.generate(model, _named(prompt), NEW, temperature=0.8, top_p=1e-6, key=jax.random.key(6))
    np.testing.assert_array_equal(np.asarray(p0.array), greedy)


def test_sampling_is_reproducible_from_the_key(pairs):
    _, model, prompt = pairs("gpt2-untied-n_inner")

    def draw(seed):
        return np.asarray(models.generate(model, _named(prompt), NEW, temperature=1.5, key=jax.random.key(seed)).array)

    a, b, c = draw(0), draw(0), draw(1)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    np.testing.assert_array_equal(a[:, :5], prompt)
    assert a.min() >= 0 and a.max() < model.config.vocab_size
    one = models.generate(
        model, nm.named(jnp.asarray(prompt[0]), "position"), NEW, temperature=1.5, key=jax.random.key(0)
    )
    assert one.shape == {"position": 5 + NEW}
    np.testing.assert_array_equal(np.asarray(one.array)[:5], prompt[0])


def test_sample_token_follows_top_k_and_top_p():
    probs = np.array([0.05, 0.5, 0.15, 0.3], np.float32)
    logits = nm.named(jnp.broadcast_to(jnp.log(probs), (4000, 4)), ("batch", "vocab"))

    def draw(**kw):
        return np.asarray(models.sample_token(logits, jax.random.key(0), **kw).array)

    assert set(draw(top_k=2)) == {1, 3}
    assert abs((draw(top_k=2) == 1).mean() - 0.5 / 0.8) < 0.03
    assert set(draw(top_p=0.7)) == {1, 3}  # 0.5 + 0.3 reach 0.7
    assert set(draw(top_p=0.81)) == {1, 3, 2}
    assert set(draw()) == {0, 1, 2, 3}
    assert set(draw(temperature=0)) == {1}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cached_decoding_equals_the_full_forward(kind):
    if kind == "gpt2":
        model = random_model(Gpt2LMHeadModel, Gpt2Config(n_layer=2, n_head=4, n_embd=48, n_positions=32, vocab_size=97))
    else:
        model = random_model(
            LlamaLMHeadModel,
            LlamaConfig(
                hidden_size=48,
                intermediate_size=80,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=1,
                vocab_size=97,
                max_position_embeddings=32,
            ),
        )
    ids = _named(random_ids(97, (2, 8)))

    @eqx.filter_jit
    def run(model, ids):
        full = model(ids)
        cache = model.init_cache(ids.resolve_axis("batch"), 12)
        first, cache = model.decode(ids["position", 0:6], cache, 0)
        rest = []
        for t in (6, 7):
            logits, cache = model.decode(ids["position", t : t + 1], cache, jnp.int32(t))
            rest.append(logits)
        return full, nm.concatenate("position", [first, *rest])

    full, cached = run(model, ids)
    np.testing.assert_allclose(
        np.asarray(cached.rearrange(full.names).array), np.asarray(full.array), atol=1e-5, rtol=0
    )


def test_generate_checks_its_arguments():
    model = random_model(Gpt2LMHeadModel, Gpt2Config(n_layer=1, n_head=2, n_embd=8, n_positions=8, vocab_size=11))
    prompt = _named(np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="needs key="):
        models.generate(model, prompt, 2)
    with pytest.raises(ValueError, match="exceeds n_positions=8"):
        models.generate(model, prompt, 6, temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        models.generate(model, prompt, 2, top_p=0.0, key=jax.random.key(0))


def test_decoding_is_one_program_whatever_the_number_of_tokens(monkeypatch):
    """``generate`` is one compiled program per prompt shape and token count (the prefill, then a
    scan of one-token steps): ``model.decode`` is traced twice per program (the prompt, then the
    loop's body), never once per token, and a new prompt of the same shape compiles nothing."""
    model = random_model(
        LlamaLMHeadModel,
        LlamaConfig(
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=53,  # a size no other test uses: nothing comes from the jit caches
            max_position_embeddings=40,
        ),
    )
    traced = []
    decode = type(model).decode

    def counting_decode(self, input_ids, cache, pos, **kw):
        traced.append(input_ids.axis_size("position"))
        return decode(self, input_ids, cache, pos, **kw)

    monkeypatch.setattr(type(model), "decode", counting_decode)
    first, second = (_named(random_ids(53, (2, 5), seed=s)) for s in (1, 2))
    for n in (4, 24):
        traced.clear()
        with compiles() as seen:
            out = models.generate(model, first, n, temperature=0)
        assert out.shape == {"batch": 2, "position": 5 + n}
        assert [f for f in seen if "generate" in f] == ["jit(_generate)"], seen
        assert traced == [5, 1]  # the prompt once, one token once: not n times
        traced.clear()
        with compiles() as seen:
            models.generate(model, second, n, temperature=0)
        assert seen == [] and traced == []
