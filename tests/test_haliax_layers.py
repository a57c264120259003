"""Haliax users' layer pieces: state dicts of Stacked layers stacked and unstacked, LayerNorm over
several axes (against torch) with its torch-layout export, Embedding over several axes and
EmbeddingMup (against numpy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import named as nm
from named import Axis, nn

D, E, L = Axis("d", 3), Axis("e", 4), Axis("layers", 2)


def test_stack_and_unstack_state_dicts_by_prefix():
    sd = {
        "block.0.weight": np.array([1, 2]),
        "block.0.bias": np.array([3]),
        "block.1.weight": np.array([4, 5]),
        "block.1.bias": np.array([6.0]),
        "unrelated.item": np.array([7]),
    }
    stacked = nm.stack_state_dict(sd, "block")
    assert set(stacked) == {"block.weight", "block.bias", "unrelated.item"}
    np.testing.assert_array_equal(stacked["block.weight"], np.stack([sd["block.0.weight"], sd["block.1.weight"]]))
    np.testing.assert_array_equal(stacked["block.bias"], [[3.0], [6.0]])
    back = nm.unstack_state_dict(stacked, "block")
    assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)
    assert nm.stack_state_dict({"m.0.p": np.ones(1)}, "block") == {"m.0.p": np.ones(1)}  # nothing under the prefix
    with pytest.raises(nm.StateDictError, match="block.1.weight"):
        nm.stack_state_dict({"block.0.weight": np.ones(2), "block.2.weight": np.ones(2)}, "block")


def test_a_stacked_state_dict_is_the_stack_of_the_per_layer_one():
    stack = nn.Stacked.init(L, nn.Linear)(D, E, key=jax.random.key(0))
    per_layer = {f"layers.{k}": v for k, v in nm.state_dict(stack).items()}
    stacked = nm.stack_state_dict(per_layer, "layers")
    np.testing.assert_array_equal(np.asarray(stacked["layers.weight"]), np.asarray(stack.stacked.weight.array))


def test_layer_norm_over_two_axes_is_torchs_and_exports_flat():
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    w, b = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    ln = nn.LayerNorm(nm.named(jnp.asarray(w), (D, E)), nm.named(jnp.asarray(b), (D, E)), (D, E))
    got = ln(nm.named(jnp.asarray(x), (Axis("batch", 2), D, E)))
    want = torch.nn.functional.layer_norm(torch.from_numpy(x), (3, 4), torch.from_numpy(w), torch.from_numpy(b), 1e-5)
    np.testing.assert_allclose(np.asarray(got.array), want.numpy(), rtol=1e-5, atol=1e-5)
    flat = nm.state_dict(ln, flatten=True)
    assert flat["weight"].shape == (12,) and flat["bias"].shape == (12,)
    back = nm.load_state_dict(nn.LayerNorm.init((D, E)), flat, flatten=True)
    np.testing.assert_array_equal(np.asarray(back.weight.array), np.asarray(ln.weight.array))
    norms = nn.Stacked.init(L, nn.LayerNorm)((D, E))
    per_layer = nm.state_dict(norms, flatten=True)
    assert per_layer["0.weight"].shape == (12,) and per_layer["1.bias"].shape == (12,)


def test_embedding_over_two_axes_and_embedding_mup():
    V = Axis("vocab", 5)
    emb = nn.Embedding.init(V, (D, E), key=jax.random.key(0))
    w = np.asarray(emb.weight.array)
    ids = nm.named(jnp.asarray([[0, 4], [2, 2]]), (Axis("batch", 2), Axis("position", 2)))
    out = emb(ids)
    np.testing.assert_array_equal(
        np.asarray(out.rearrange(("batch", "position", "d", "e")).array), w[np.asarray(ids.array)]
    )
    x = out["batch", 0]
    logits = emb.unembed(x)
    np.testing.assert_allclose(
        np.asarray(logits.rearrange(("position", "vocab")).array),
        np.einsum("pde,vde->pv", np.asarray(x.rearrange(("position", "d", "e")).array), w),
        rtol=1e-5,
        atol=1e-6,
    )
    mup = nn.Embedding.init(V, (D, E), key=jax.random.key(0), reparam_cls=nn.mup.EmbeddingMup)
    np.testing.assert_array_equal(np.asarray(mup.weight.array), w)  # the init is unchanged
    np.testing.assert_allclose(
        np.asarray(mup.unembed(x).rearrange(("position", "vocab")).array),
        np.asarray(logits.rearrange(("position", "vocab")).array) / 12,
        rtol=1e-6,
    )
    with pytest.raises(nm.ArgumentTypeError, match="EmbeddingMup"):
        nn.Embedding.init(V, D, key=jax.random.key(0), reparam_cls=nn.mup.OutputLinearMup)
