"""resize_axis (grow or shrink one axis across a tree, modules' static axes included) and
tree_map_layers (a map whose function sees each layer of a stack), against numpy."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis, nn

Vocab, Embed, Mlp = Axis("vocab", 5), Axis("embed", 4), Axis("mlp", 6)
Pos, Layers = Axis("position", 8), Axis("layers", 3)


class Lm(eqx.Module):
    tokens: nn.Embedding
    positions: nm.NamedArray  # (embed, position): the resized axis is not the first one
    head: nn.Linear  # embed -> vocab


@pytest.fixture(scope="module")
def lm():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return Lm(
        nn.Embedding.init(Vocab, Embed, key=k1),
        nm.random.normal(k2, (Embed, Pos)),
        nn.Linear.init(Embed, Vocab, key=k3),
    )


def _np(x):
    return np.asarray(x.array)


def test_grow_with_zeros_keeps_the_old_rows(lm):
    big = nm.resize_axis(lm, "vocab", 9)
    want = np.concatenate([_np(lm.tokens.weight), np.zeros((4, 4), np.float32)], axis=0)
    np.testing.assert_array_equal(_np(big.tokens.weight), want)
    head = np.concatenate([_np(lm.head.weight), np.zeros((4, 4), np.float32)], axis=1)
    np.testing.assert_array_equal(_np(big.head.weight), head)
    np.testing.assert_array_equal(_np(big.head.bias), np.concatenate([_np(lm.head.bias), np.zeros(4, np.float32)]))
    # the modules' static axes follow, so the grown model runs and sees the new ids
    assert big.tokens.Vocab == Axis("vocab", 9) and big.head.Out == Axis("vocab", 9)
    ids = nm.named(jnp.array([0, 8]), "batch")
    np.testing.assert_array_equal(_np(big.tokens(ids)), want[[0, 8]])
    assert big.head(big.tokens(ids)).axes == (Axis("batch", 2), Axis("vocab", 9))
    np.testing.assert_array_equal(_np(big.positions), _np(lm.positions))  # no vocab axis: untouched


def test_grow_a_position_table_with_normal_draws(lm):
    key = jax.random.key(7)
    longer = nm.resize_axis(lm.positions, "position", 12, key=key, std=0.5)
    old = _np(lm.positions)
    np.testing.assert_array_equal(_np(longer)[:, :8], old)
    # the documented draw: the first grown array uses fold_in(key, 0)
    want = np.asarray(jax.random.normal(jax.random.fold_in(key, 0), (4, 4))) * 0.5
    np.testing.assert_allclose(_np(longer)[:, 8:], want, rtol=1e-6)
    # without std the new entries take the scale of the existing ones
    same_scale = nm.resize_axis(lm.positions, "position", 12, key=key)
    np.testing.assert_allclose(_np(same_scale)[:, 8:], want / 0.5 * old.std(), rtol=1e-5)


def test_each_grown_array_draws_its_own_values(lm):
    big = nm.resize_axis(lm, "vocab", 9, key=jax.random.key(1), std=1.0)
    assert not np.allclose(_np(big.tokens.weight)[5:], _np(big.head.weight)[:, 5:].T)


def test_custom_init_and_shrink(lm):
    sevens = nm.resize_axis(
        lm, "vocab", 6, key=jax.random.key(0), init=lambda k, axes, dtype: nm.full(axes, 7.0, dtype)
    )
    np.testing.assert_array_equal(_np(sevens.tokens.weight)[5], np.full(4, 7.0))
    short = nm.resize_axis(lm, "position", 3)
    np.testing.assert_array_equal(_np(short.positions), _np(lm.positions)[:, :3])
    narrow = nm.resize_axis(lm, "embed", 2)
    np.testing.assert_array_equal(_np(narrow.head.weight), _np(lm.head.weight)[:2])
    assert narrow.head.In == Axis("embed", 2) and narrow.tokens.Embed == Axis("embed", 2)


def test_grow_the_layers_of_a_stack():
    stack = nn.Stacked.init(Layers, nn.Linear.init, Embed, Mlp, key=jax.random.key(0))
    deeper = nm.resize_axis(stack, "layers", 5)
    assert deeper.Layers == Axis("layers", 5)
    np.testing.assert_array_equal(_np(deeper.stacked.weight)[:3], _np(stack.stacked.weight))
    np.testing.assert_array_equal(_np(deeper.get_layer(4).weight), np.zeros((4, 6)))
    seq = nn.BlockSeq.from_layers(stack.unstacked())
    with pytest.raises(nm.NamedError, match="BlockSeq's layers are its blocks"):
        nm.resize_axis(seq, "layers", 5)


def test_resize_errors(lm):
    with pytest.raises(nm.ArgumentError, match="new_size"):
        nm.resize_axis(lm, "vocab", -1)
    ids = nm.named(jnp.arange(5), "vocab")
    with pytest.raises(nm.ArgumentError, match="int32.*floating-point"):
        nm.resize_axis(ids, "vocab", 7, key=jax.random.key(0))
    np.testing.assert_array_equal(_np(nm.resize_axis(ids, "vocab", 7)), [0, 1, 2, 3, 4, 0, 0])
    with pytest.raises(nm.ArgumentError, match="init returned"):
        nm.resize_axis(lm, "vocab", 7, key=jax.random.key(0), init=lambda k, axes, dtype: nm.zeros(Vocab))


# ---- tree_map_layers ---------------------------------------------------------------------------------


class Model(eqx.Module):
    embed: nn.Embedding
    layers: eqx.Module


def _model(stack):
    k1, k2 = jax.random.split(jax.random.key(3))
    return Model(nn.Embedding.init(Vocab, Embed, key=k1), stack.init(Layers, nn.Linear.init, Embed, Mlp, key=k2))


@pytest.mark.parametrize("stack", [nn.Stacked, nn.BlockSeq])
def test_tree_map_layers_sees_each_layer(stack):
    model = _model(stack)
    seen = []

    def unit(x):  # each array scaled to unit norm: per layer, not over the whole stack
        seen.append(x.names)
        return x / nm.sqrt((x * x).sum())

    out = nm.tree_map_layers(unit, model)
    assert seen and all("layers" not in names for names in seen)
    for i in range(3):
        w = _np(model.layers.get_layer(i).weight)
        np.testing.assert_allclose(_np(out.layers.get_layer(i).weight), w / np.linalg.norm(w), rtol=1e-5)
    e = _np(model.embed.weight)
    np.testing.assert_allclose(_np(out.embed.weight), e / np.linalg.norm(e), rtol=1e-5)
    assert type(out.layers) is stack


def test_tree_map_layers_on_modules():
    model = _model(nn.Stacked)
    sums = nm.tree_map_layers(lambda lin: lin.weight.sum(), model.layers, is_leaf=lambda x: isinstance(x, nn.Linear))
    want = _np(model.layers.stacked.weight).sum(axis=(1, 2))
    np.testing.assert_allclose(_np(sums.stacked), want, rtol=1e-5)
