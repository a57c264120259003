"""Stacked beyond scan, and BlockSeq: per-layer access and editing (get_layer, set_layer,
from_layers), vmap over layers, fold_via/scan_via with other methods and per-layer arguments,
BlockSeq (different blocks, same interface) and Remat policies (every-k, names, dots), each
against a Python loop over the blocks or, for remat, the residuals read from the jaxpr."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nn_util import close, jcall
from test_stacked import remat_eqns, saved_residuals

import named as nm
from named import nn

Batch, Embed, Mlp, Layers = nm.Axis("batch", 2), nm.Axis("embed", 4), nm.Axis("mlp", 6), nm.Axis("layers", 4)


class Block(eqx.Module):
    up: nn.Linear
    down: nn.Linear

    @staticmethod
    def init(Embed, Mlp, *, key):
        k1, k2 = jax.random.split(key)
        return Block(nn.Linear.init(Embed, Mlp, key=k1), nn.Linear.init(Mlp, Embed, key=k2))

    def __call__(self, x, scale=1.0):
        h = nn.checkpoint_name(nm.tanh(self.up(x)), "hidden")
        return x + self.down(h) * scale

    def decode(self, x, cache, *, shift):
        """A second entry point: reads and updates this layer's (per-layer) cache."""
        y = self(x) + cache + shift
        return y, cache + nm.sum(y, "embed")


def stack(remat="none", n=Layers.size):
    return nn.Stacked.init(Layers.resize(n), Block.init, Embed, Mlp, key=jax.random.key(0), remat=remat)


def x_input():
    return nm.named(jnp.asarray(np.random.default_rng(1).standard_normal((2, 4)), jnp.float32), (Batch, Embed))


def loop(blocks, x, *args):
    for b in blocks:
        x = b(x, *args)
    return x


def leaves(tree):
    return [
        np.asarray(x.array) for x in jax.tree.leaves(tree, is_leaf=nm.is_named_array) if isinstance(x, nm.NamedArray)
    ]


# ---- per-layer access and editing ------------------------------------------------------------------


def test_get_layer_is_the_block_made_with_that_key_and_set_layer_edits_it():
    s, x = stack(), x_input()
    keys = jax.random.split(jax.random.key(0), Layers.size)
    for i in (0, 2, -1):
        for got, want in zip(leaves(s.get_layer(i)), leaves(Block.init(Embed, Mlp, key=keys[i]))):
            np.testing.assert_array_equal(got, want)
    edited = s.get_layer(1)
    edited = eqx.tree_at(lambda b: b.down.weight, edited, edited.down.weight * 0.0)
    s2 = s.set_layer(1, edited)
    blocks = s.unstacked()
    blocks[1] = edited
    close(jcall(lambda s, x: s.fold(x), s2, x).array, jcall(loop, blocks, x).array)
    np.testing.assert_array_equal(s2.stacked.up.weight.array, s.stacked.up.weight.array)  # the rest untouched
    with pytest.raises(nm.AxisError, match="layer 4 is out of range for 'layers' of size 4"):
        s.get_layer(4)
    wrong = eqx.tree_at(lambda b: b.up.weight, edited, edited.up.weight.rename({"mlp": "hidden"}))
    with pytest.raises(nm.AxisError, match=r"\.up\.weight needs axes \(embed=4, mlp=6\), got \(embed=4, hidden=6\)"):
        s.set_layer(0, wrong)
    with pytest.raises(nm.NamedError, match="differs in structure"):
        s.set_layer(0, Block.init(Embed, Mlp.resize(5), key=keys[0]))  # other static sizes


def test_from_layers_puts_edited_unstacked_blocks_back():
    s, x = stack(), x_input()
    blocks = [eqx.tree_at(lambda b: b.up.bias, b, b.up.bias + i) for i, b in enumerate(s.unstacked())]
    rebuilt = nn.Stacked.from_layers(blocks, "layers", remat="full")
    assert rebuilt.Layers == Layers and rebuilt.stacked.up.weight.axes == (Layers, Embed, Mlp)
    close(jcall(lambda s, x: s.fold(x), rebuilt, x).array, jcall(loop, blocks, x).array)
    for a, b in zip(leaves(nn.Stacked.from_layers(s.unstacked(), Layers)), leaves(s)):
        np.testing.assert_array_equal(a, b)
    other = eqx.tree_at(lambda b: b.up.bias, blocks[1], nm.zeros(Mlp.resize(5)))
    with pytest.raises(nm.AxisError, match=r"\.up\.bias has axes \(mlp=6\) in layer 0 but \(mlp=5\) in layer 1"):
        nn.Stacked.from_layers([blocks[0], other])
    with pytest.raises(nm.NamedError, match="differs in structure.*use BlockSeq"):
        nn.Stacked.from_layers([blocks[0], nn.Linear.init(Embed, Mlp, key=jax.random.key(2))])
    with pytest.raises(nm.AxisError, match="2 layers given but 'layers' has size 4"):
        nn.Stacked.from_layers(blocks[:2], Layers)


# ---- vmap, fold_via, scan_via --------------------------------------------------------------------------


def test_vmap_applies_every_layer_to_the_same_input():
    s, x = stack(), x_input()
    out = jcall(lambda s, x: s.vmap(x, 2.0), s, x)
    assert out.axes == (Layers, Batch, Embed)
    close(out.array, np.stack([b(x, 2.0).array for b in s.unstacked()]))
    per_layer_x = nm.named(jnp.arange(4 * 2 * 4, dtype=jnp.float32).reshape(4, 2, 4) / 10, (Layers, Batch, Embed))
    out = jcall(lambda s, x: s.vmap(x), s, per_layer_x)
    close(out.array, np.stack([b(per_layer_x["layers", i]).array for i, b in enumerate(s.unstacked())]))


@pytest.mark.parametrize("via", ["decode", Block.decode])
def test_scan_via_another_method_with_per_layer_and_shared_arguments(via):
    s, x = stack(), x_input()
    cache = nm.named(jnp.arange(8, dtype=jnp.float32).reshape(4, 2), (Layers, Batch))  # one entry per layer
    out, new_cache = jcall(lambda s, x, c: s.scan_via(via)(x, c, shift=0.5), s, x, cache)
    want, want_cache = x, []
    for i, b in enumerate(s.unstacked()):
        want, c = b.decode(want, cache["layers", i], shift=0.5)
        want_cache.append(np.asarray(c.array))
    close(out.array, want.array)
    assert new_cache.axes == (Layers, Batch)
    close(new_cache.array, np.stack(want_cache))
    folded = jcall(lambda s, x, c: s.fold_via(lambda b, x, c: b.decode(x, c, shift=0.5)[0])(x, c), s, x, cache)
    close(folded.array, out.array)
    with pytest.raises(nm.NamedError, match="the block Block has no method 'encode'"):
        s.fold_via("encode")(x)


# ---- BlockSeq --------------------------------------------------------------------------------------------


def test_blockseq_init_matches_stacked_and_runs_the_same_interface():
    s, x = stack(), x_input()
    seq = nn.BlockSeq.init(Layers, Block.init, Embed, Mlp, key=jax.random.key(0))
    for a, b in zip(leaves(seq.unstacked()), leaves(s.unstacked())):
        np.testing.assert_array_equal(a, b)
    scale = nm.named(jnp.array([1.0, -1.0, 0.5, 2.0]), (Layers,))  # sliced per layer in both
    close(
        jcall(lambda m, x, sc: m.fold(x, sc), seq, x, scale).array,
        jcall(lambda m, x, sc: m.fold(x, sc), s, x, scale).array,
    )
    cache = nm.named(jnp.ones((4, 2)), (Layers, Batch))
    got = jcall(lambda m, x, c: m.scan_via("decode")(x, c, shift=1.0), seq, x, cache)
    want = jcall(lambda m, x, c: m.scan_via("decode")(x, c, shift=1.0), s, x, cache)
    for a, b in zip(leaves(got), leaves(want), strict=True):
        close(a, b)
    close(jcall(lambda m, x: m.vmap(x), seq, x).array, jcall(lambda m, x: m.vmap(x), s, x).array)
    assert seq.get_layer(-1) is seq.blocks[3]


def test_blockseq_holds_different_blocks():
    x = x_input()
    sizes = [3, 5, 7]
    seq = nn.BlockSeq.init(
        Layers.resize(3),
        [lambda *, key, m=m: Block.init(Embed, Mlp.resize(m), key=key) for m in sizes],
        key=jax.random.key(4),
        remat="full",
    )
    assert [b.up.weight.axis_size("mlp") for b in seq.unstacked()] == sizes
    out = jcall(lambda m, x: m.fold(x), seq, x)
    close(out.array, jcall(loop, seq.unstacked(), x).array)
    with pytest.raises(nm.NamedError, match="differs in structure|has axes"):
        nn.Stacked.from_layers(seq.unstacked())
    swapped = seq.set_layer(0, seq.get_layer(2))
    close(jcall(lambda m, x: m.fold(x), swapped, x).array, jcall(loop, [seq.blocks[2], *seq.blocks[1:]], x).array)


# ---- Remat: one policy object ----------------------------------------------------------------------------


def test_remat_strings_are_shorthands_for_the_object():
    R = nn.Remat
    assert R.parse("full") == R() and R.parse("save_dots") == R(dots="save") and R.parse("offload") == R(dots="offload")
    assert R.parse("save_names:a,b") == R(save=("a", "b")) == R.parse(("save_names", "a", "b"))
    assert R.parse("full every=2") == R(every=2)
    assert R.parse("save=a offload=b,c dots=save every=4") == R(save=("a",), offload=("b", "c"), dots="save", every=4)
    assert R.parse("none") is None and R.parse(None) is None
    with pytest.raises(nm.NamedError, match="both saved and offloaded"):
        R(save=("a",), offload=("a",))
    with pytest.raises(nm.NamedError, match="every=0"):
        R.parse("full every=0")
    with pytest.raises(nm.NamedError, match="unknown remat policy 'full often=2' \\(at 'often=2'\\)"):
        R.parse("full often=2")
    with pytest.raises(nm.NamedError, match="offloads to host memory.*CPU backend has none"):
        stack(R(offload=("hidden",)))
    with pytest.raises(nm.NamedError, match="every=3 groups layers 3 at a time, but 'layers' has 4"):
        stack("full every=3")


def stack_loss(s, x):
    return s.fold(x).sum().scalar()


L, B, E, M = Layers.size, Batch.size, Embed.size, Mlp.size


def test_remat_every_k_keeps_only_every_kth_layer_input():
    x = x_input()
    full = saved_residuals(stack_loss, stack("full"), x)
    assert [shape for shape, _ in full] == [(L, B, E)]
    for k in (2, 4):
        grouped = saved_residuals(stack_loss, stack(nn.Remat(every=k)), x)
        # The weights' grouped view [groups, k, ...] is listed too: a reshape of the parameters
        # (a bitcast in XLA), not an activation.
        activations = [shape for shape, d in grouped if not d.startswith("output of reshape")]
        assert activations == [(L // k, B, E)], (k, grouped)
    # a Stacked's groups re-run every layer inside them whatever it saves (its own backward pass,
    # no remat equation): tagged activations are not kept either
    kept = saved_residuals(stack_loss, stack(nn.Remat(save=("hidden",), every=2)), x)
    assert [shape for shape, _ in kept] == [(L // 2, B, E)], kept
    assert remat_eqns(jax.make_jaxpr(stack_loss)(stack(nn.Remat(save=("hidden",), every=2)), x).jaxpr) == []
    # BlockSeq groups the same way: the inputs of its 2 groups are x itself (an argument, not
    # listed) and the output of layer 2; without groups, the 3 inner layer inputs too
    seq = nn.BlockSeq.from_layers(stack().unstacked(), Layers, remat="full every=2")
    assert [s for s, _ in saved_residuals(stack_loss, seq, x)] == [(B, E)]
    seq = nn.BlockSeq.from_layers(stack().unstacked(), Layers, remat="full")
    assert [s for s, _ in saved_residuals(stack_loss, seq, x)] == [(B, E)] * 3


def test_remat_saves_names_and_dots_together():
    x = x_input()
    blk = stack().unstacked()[0]

    def kept(remat):
        fn = jax.checkpoint(lambda b, x: b(x).sum().scalar(), policy=nn.remat_policy(remat))
        return sorted(d.split(" from ")[0] for _, d in saved_residuals(fn, blk, x))

    assert kept(nn.Remat(save=("hidden",))) == ["named 'hidden'"]
    assert kept(nn.Remat(dots="save")) == ["output of dot_general"]
    assert kept(nn.Remat(save=("hidden",), dots="save")) == ["named 'hidden'", "output of dot_general"]


@pytest.mark.parametrize("remat", ["full every=2", nn.Remat(save=("hidden",), dots="save", every=4)])
def test_gradients_do_not_depend_on_the_policy(remat):
    x = x_input()
    want = leaves(jcall(jax.grad(stack_loss, argnums=(0, 1)), stack("none"), x))
    for model in (stack(remat), nn.BlockSeq.from_layers(stack().unstacked(), Layers, remat=remat)):
        got = leaves(jcall(jax.grad(stack_loss, argnums=(0, 1)), model, x))
        if isinstance(model, nn.BlockSeq):  # one gradient per block: stack them like Stacked's
            n = len(leaves(model.blocks[0]))
            got = [np.stack(got[j:-1:n]) for j in range(n)] + got[-1:]
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
