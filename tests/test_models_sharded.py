"""GPT-2 and Llama on 8 fake devices: a checkpoint loaded straight into FSDP, tensor-parallel and
4×2 layouts computes the single-device logits."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest
from _hf_models import random_model

import named as nm
from named import models
from named.models import Gpt2Config, Gpt2LMHeadModel, LlamaConfig, LlamaLMHeadModel

TP = {"mlp": "model", "heads": "model"}
LAYOUTS = {  # mesh, parameter mapping, compute mapping
    "fsdp": ({"data": 8}, {"embed": "data"}, {"batch": "data"}),
    "tp": ({"model": 8}, TP, TP),
    "fsdp+tp-4x2": (
        {"data": 4, "model": 2},
        {"embed": "data", **TP, "kv_heads": "model"},
        {"batch": "data", **TP, "kv_heads": "model"},
    ),
}
CONFIGS = {  # 8 heads and an MLP width divisible by 8; 4 kv heads (sharded only on the 4×2 mesh)
    "gpt2": Gpt2Config(n_layer=2, n_head=8, n_embd=48, n_positions=16, vocab_size=97, tie_word_embeddings=False),
    "llama": LlamaConfig(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=97,
        max_position_embeddings=16,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    """(config, single-device model, its HF folder, ids, single-device logits)."""
    config = CONFIGS[request.param]
    cls = Gpt2LMHeadModel if isinstance(config, Gpt2Config) else LlamaLMHeadModel
    model = random_model(cls, config)
    folder = tmp_path_factory.mktemp(request.param)
    models.save_pretrained(model, config, folder)
    ids = nm.named(jax.random.randint(jax.random.key(1), (8, 12), 0, config.vocab_size), ("batch", "position"))
    logits = eqx.filter_jit(lambda m, x: m(x).rearrange(("batch", "position", "vocab")).array)(model, ids)
    return config, model, folder, ids, np.asarray(logits)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_load_and_forward_match_single_device(saved, layout, tmp_path):
    config, model, folder, ids, expected = saved
    mesh_shape, param_map, compute_map = LAYOUTS[layout]
    mesh = nm.make_mesh(mesh_shape)
    _, sharded = models.load_pretrained(folder, mapping=param_map, mesh=mesh)

    # every parameter arrives laid out by the parameter mapping
    for leaf in jax.tree.leaves(sharded, is_leaf=nm.is_named_array):
        assert leaf.array.sharding.is_equivalent_to(nm.sharding_for(leaf, param_map, mesh), leaf.ndim), leaf.axes
    some = [x for x in jax.tree.leaves(sharded, is_leaf=nm.is_named_array) if x.array.sharding.spec != (None,) * x.ndim]
    assert len(some) >= 4  # not everything stayed replicated

    forward = nm.named_jit(lambda m, x: m(x).rearrange(("batch", "position", "vocab")), mapping=compute_map, mesh=mesh)
    logits = forward(sharded, nm.shard(ids, compute_map, mesh))
    np.testing.assert_allclose(
        np.asarray(logits.array), expected, atol=1e-5, rtol=1e-5
    )  # f32 sums in another order: ~5e-6 relative seen
    if "batch" in compute_map:
        assert logits.array.sharding.spec[0] == "data"

    # and a sharded model saves to the same tensors
    models.save_pretrained(sharded, config, tmp_path)
    _, back = models.load_pretrained(tmp_path)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mapping_without_mesh_is_an_error(saved):
    _, _, folder, _, _ = saved
    with pytest.raises(ValueError, match="mesh="):
        models.load_pretrained(folder, mapping={"embed": "data"})
