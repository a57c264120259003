"""Generation with a KV cache: greedy decoding equals transformers' on the same weights, cached
decoding equals the full forward pass, and sampling follows its settings and its key."""

from __future__ import annotations

import re

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
    with pytest.raises(ValueError, match="prompt_lengths has 2 entries for batch=1"):
        models.generate(model, prompt, 2, temperature=0, prompt_lengths=[3, 2])
    for bad in (0, 4):
        with pytest.raises(ValueError, match=rf"prompt_lengths: {bad} is not in \[1, 3\]"):
            models.generate(model, prompt, 2, temperature=0, prompt_lengths=[bad])


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


# ---- ragged batches, early stop, the compiled loop --------------------------------------------


@pytest.mark.parametrize("name", ["gpt2-untied-n_inner", "llama-gqa4/2-untied"])
def test_a_ragged_batch_decodes_each_prompt_as_alone_and_as_transformers(pairs, name):
    """Prompts of 5, 2 and 4 tokens in one batch (padded on the right, the padding junk): each row's
    new tokens are those of its prompt decoded alone, and those of transformers' greedy ``generate``
    on the batch padded on the left with an attention mask."""
    hf, model, _ = pairs(name)
    vocab = model.config.vocab_size
    lengths = [5, 2, 4]
    prompt = random_ids(vocab, (3, 5), seed=11)
    ours = np.asarray(models.generate(model, _named(prompt), NEW, temperature=0, prompt_lengths=lengths).array)
    np.testing.assert_array_equal(ours[:, :5], prompt)  # the prompt as given, then the new tokens
    for r, n in enumerate(lengths):
        alone = _greedy(model, prompt[r : r + 1, :n])
        np.testing.assert_array_equal(ours[r, 5:], alone[0, n:], err_msg=f"row {r}")
    left = np.zeros_like(prompt)
    mask = np.zeros_like(prompt)
    for r, n in enumerate(lengths):
        left[r, 5 - n :], mask[r, 5 - n :] = prompt[r, :n], 1
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(left, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
        ).numpy()
    np.testing.assert_array_equal(ours[:, 5:], ref[:, 5:])
    assert len(np.unique(ours[:, 5:])) > 4, "degenerate continuation: the comparison would prove little"


def test_the_loop_ends_when_every_row_has_stopped(monkeypatch):
    """Each row stops at its own stop id; once all have, no further step runs (the steps are
    counted as they execute), and the columns left repeat each row's stop id."""
    model = random_model(
        LlamaLMHeadModel,
        LlamaConfig(
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=59,  # a size no other test uses: the counting decode below is traced afresh
            max_position_embeddings=40,
        ),
        scale=1.0,
    )
    prompt = _named(random_ids(59, (2, 5), seed=7))
    n = 20
    greedy = np.asarray(models.generate(model, prompt, n, temperature=0).array)[:, 5:]
    # row 0 stops at its 3rd new token, row 1 at its 6th (or earlier, if it gives row 0's first)
    stops = {int(greedy[0, 2]), int(greedy[1, 5])}
    firsts = [next(k for k, t in enumerate(row) if t in stops) for row in greedy]
    assert max(firsts) < n - 4, firsts

    steps = []
    decode = type(model).decode

    def counting_decode(self, input_ids, cache, pos, **kw):
        jax.debug.callback(lambda: steps.append(1))
        return decode(self, input_ids, cache, pos, **kw)

    monkeypatch.setattr(type(model), "decode", counting_decode)
    out = np.asarray(models.generate(model, prompt, n, temperature=0, stop_ids=sorted(stops)).array)[:, 5:]
    assert len(steps) == 1 + max(firsts)  # the prefill, then one step per token after the first
    for row, first in enumerate(firsts):
        np.testing.assert_array_equal(out[row, : first + 1], greedy[row, : first + 1])
        assert (out[row, first:] == greedy[row, first]).all()


def _loop_bodies(hlo: str) -> list[list[tuple[str, str]]]:
    """``(opcode, result shape)`` of every instruction of each while loop's body, fused and called
    computations included."""
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", block)
        if m:
            comps[m.group(1)] = block

    def walk(name, seen, out):
        if name in seen or name not in comps:
            return out
        seen.add(name)
        for line in comps[name].splitlines()[1:]:
            m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(", line)
            if m:
                out.append((m.group(2), m.group(1)))
            for callee in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line):
                walk(callee, seen, out)
        return out

    return [walk(body, set(), []) for body in re.findall(r"\swhile\(.*?body=%?([\w.\-]+)", hlo)]


def _elements(shape: str) -> int:
    dims = re.match(r"\w+\[([\d,]*)\]", shape)
    return int(np.prod([int(d) for d in dims.group(1).split(",") if d])) if dims else 0


@pytest.mark.parametrize("name", ["gpt2-untied-n_inner", "llama-gqa4/2-untied"])
def test_the_decode_loop_writes_the_cache_in_place(pairs, name):
    """The optimized program's loop (a ragged batch, so the padding mask is in it) writes each
    layer's keys and values with one dynamic-update-slice each, on the cache buffer itself laid
    out (batch, heads, key_position, head_size); it copies, transposes or slices out no cache
    buffer (the contractions read it as it lies) and no weight (the layers are split before it)."""
    _, model, prompt = pairs(name)
    c = model.config
    layers = c.n_layer if name.startswith("gpt2") else c.num_hidden_layers
    heads = c.n_head if name.startswith("gpt2") else c.num_key_value_heads
    lengths = nm.named(jnp.asarray([5, 3], jnp.int32), "batch")

    def run(model, ids, lengths):
        return models.generate(model, ids, NEW, temperature=0, prompt_lengths=lengths, stop_ids=[0])

    hlo = jax.jit(run).lower(model, _named(prompt), lengths).compile().as_text()
    (body,) = _loop_bodies(hlo)
    cache = f"f32[2,{heads},{5 + NEW},{model.config.HeadSize.size}]"
    writes = [op for op, shape in body if op == "dynamic-update-slice" and shape.startswith(cache)]
    assert len(writes) == 2 * layers, (writes, cache)
    big = _elements(cache)  # every weight matrix of these models is larger than a cache buffer
    moved = [(op, s) for op, s in body if op in ("copy", "transpose", "slice", "dynamic-slice") and _elements(s) >= big]
    assert moved == [], moved
    assert sum(op == "dot" for op, _ in body) > 0, "the HLO parser found no matmul in the loop"
