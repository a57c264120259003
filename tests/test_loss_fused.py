"""The fused loss (``nn.blockwise_cross_entropy_loss``: logits a vocab block at a time, its own
gradient rule) against the plain full-logits loss of a positional jnp reference (``ref_loss``,
which never calls named): the value and both gradients (hidden states, head) within 1e-5 in
float32, on one device over drawn shapes, blocks, masks, ignored ids, z-loss and soft-cap, and on
the 8-device mesh under the mappings ``named-plan --search`` chooses (data parallel, FSDP, tensor
parallel with the vocabulary or the embedding split). Then the compiled gradient: the head is
all-gathered once and its gradient reduce-scattered once, whatever the number of blocks, and no
collective runs inside the block loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_loss import TOL, ref_loss

import named as nm
from named.inspect import parse_collectives
from named.nn.loss import IGNORE_INDEX, blockwise_cross_entropy_loss

Z, CAP = 1e-2, 1.5


def reference(hidden, w, targets, mask, *, reduction="mean", z=Z, softcap=CAP):
    """The loss of the full logits ``hidden @ w`` (``w`` is ``[embed, vocab]``), ignored ids masked out."""
    logits = jnp.einsum("...e,ev->...v", hidden, w)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    keep = jnp.asarray(mask, jnp.float32) * (targets != IGNORE_INDEX)
    return ref_loss(logits, jnp.where(targets == IGNORE_INDEX, 0, targets), keep, reduction, z)


def _draw(rng, B, T, E, V, ignored=0.15):
    hidden = rng.standard_normal((B, T, E)).astype(np.float32)
    w = (rng.standard_normal((E, V)) * 2 / np.sqrt(E)).astype(np.float32)  # logits of a few units: the cap bites
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[rng.random((B, T)) < ignored] = IGNORE_INDEX
    mask = rng.random((B, T)) < 0.8
    mask.flat[0], targets.flat[0] = True, 0  # at least one token counts
    return hidden, w, targets, mask


def _named(hidden, w, targets, mask, head_layout="embed vocab"):
    weight = nm.named(w if head_layout == "embed vocab" else w.T.copy(), head_layout)
    return (
        nm.named(hidden, "batch position embed"),
        weight,
        nm.named(targets, "batch position"),
        nm.named(mask, "batch position"),
    )


def _check(got, want):
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), **TOL)


# ---- one device -------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 6)),
    blocks=st.tuples(st.integers(1, 4), st.integers(1, 5)),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    z=st.sampled_from([0.0, Z]),
    softcap=st.sampled_from([None, CAP]),
    head_layout=st.sampled_from(["embed vocab", "vocab embed"]),
    seed=st.integers(0, 2**16),
)
def test_value_and_gradients_equal_the_full_logits(shape, blocks, reduction, z, softcap, head_layout, seed):
    (B, T, E), (n_blocks, block) = shape, blocks
    rng = np.random.default_rng(seed)
    hidden, w, targets, mask = _draw(rng, B, T, E, n_blocks * block)
    nh, nw, nt, nmask = _named(hidden, w, targets, mask, head_layout)
    cot = rng.standard_normal((B, T)).astype(np.float32)  # "none": a cotangent per token

    def fused(h, w_):
        out = blockwise_cross_entropy_loss(
            h, w_, nt, where=nmask, block_size=block, reduction=reduction, z_loss_weight=z, softcap=softcap
        )
        return out.array if reduction != "none" else (out.array * cot).sum()

    def plain(h, w_):
        out = reference(h, w_, targets, mask, reduction=reduction, z=z, softcap=softcap)
        return out if reduction != "none" else (out * cot).sum()

    value, (gh, gw) = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(nh, nw)
    want, (rh, rw) = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(hidden, w)
    assert gh.names == nh.names and gw.names == nw.names
    _check((value, gh.array, gw.rearrange(("embed", "vocab")).array), (want, rh, rw))


# ---- the 8-device mesh --------------------------------------------------------------------------

B, T, E, V, BLOCK = 8, 6, 16, 256, 32
# name: (mesh, compute mapping, parameter mapping: where the head is stored)
LAYOUTS = {
    "DP (8,)": ({"data": 8}, {"batch": "data"}, {}),
    "FSDP (8,)": ({"data": 8}, {"batch": "data"}, {"embed": "data"}),
    "FSDP (4,2)": ({"data": 4, "model": 2}, {"batch": "data"}, {"embed": "data"}),
    "DP over both (4,2)": ({"data": 4, "model": 2}, {"batch": ("data", "model")}, {"embed": "data"}),
    "FSDP+TP vocab (4,2)": (
        {"data": 4, "model": 2},
        {"batch": "data", "vocab": "model"},
        {"embed": "data", "vocab": "model"},
    ),
    "TP vocab (8,)": ({"model": 8}, {"vocab": "model"}, {"vocab": "model"}),
    "TP embed (4,2)": ({"data": 4, "model": 2}, {"batch": "data", "embed": "model"}, {"embed": "model"}),
}


def _sharded_step(compute, param, mesh, block_size=BLOCK, gather="auto"):
    """value_and_grad of the mean fused loss, jitted under ``compute``; the gradients come back laid
    out as their arguments (the hidden states' embed renamed so that one out mapping says both)."""

    def step(h, w, t, m):
        def loss(h, w):
            return blockwise_cross_entropy_loss(
                h,
                w,
                t,
                where=m,
                block_size=block_size,
                z_loss_weight=Z,
                softcap=CAP,
                weight_mapping=param,
                gather=gather,
            ).scalar()

        value, (gh, gw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w)
        return value, gh.rename({"embed": "d_embed"}), gw

    out = {**compute, **param, **({"d_embed": compute["embed"]} if "embed" in compute else {})}
    return nm.named_jit(step, mapping=compute, out_mapping=out, mesh=mesh)


def _on_mesh(layout, seed=0, head_layout="embed vocab", block_size=BLOCK, gather="auto"):
    mesh_shape, compute, param = LAYOUTS[layout]
    mesh = nm.make_mesh(mesh_shape)
    hidden, w, targets, mask = _draw(np.random.default_rng(seed), B, T, E, V)
    h, wn, t, m = _named(hidden, w, targets, mask, head_layout)
    args = (*nm.shard((h,), compute, mesh), nm.shard(wn, param, mesh), *nm.shard((t, m), compute, mesh))
    return _sharded_step(compute, param, mesh, block_size, gather), args, (hidden, w, targets, mask), mesh


@pytest.mark.parametrize("gather", ["auto", "blocks"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_on_the_mesh_equals_the_full_logits(layout, gather):
    # "blocks" gathers an FSDP head a block at a time; elsewhere it changes nothing
    step, args, (hidden, w, targets, mask), _ = _on_mesh(layout, seed=1, gather=gather)
    value, gh, gw = step(*args)
    want, (rh, rw) = jax.value_and_grad(lambda h, w_: reference(h, w_, targets, mask), argnums=(0, 1))(hidden, w)
    _check((value, gh.array, gw.array), (want, rh, rw))
    # the head's gradient comes back in the head's own layout
    assert gw.array.sharding.shard_shape(gw.array.shape) == args[1].array.sharding.shard_shape(w.shape)


def test_in_a_shard_map_body_it_runs_on_the_blocks_it_is_given():
    mesh_shape, compute, param = LAYOUTS["FSDP+TP vocab (4,2)"]
    mesh = nm.make_mesh(mesh_shape)
    hidden, w, targets, mask = _draw(np.random.default_rng(2), B, T, E, V, ignored=0.0)
    h, wn, t, _ = _named(hidden, w, targets, mask)

    def body(h, w_, t):
        assert nm.layout(w_) == "embed/data vocab/model" and nm.layout(h) == "batch/data position embed"
        return blockwise_cross_entropy_loss(h, w_, t, block_size=BLOCK, reduction="none", z_loss_weight=Z, softcap=CAP)

    per_token = nm.shard_map(body, mesh=mesh, in_mapping=(compute, param, compute))

    def loss(h, w_):
        return (per_token(h, w_, t).array * mask).sum()

    value, (gh, gw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
        nm.shard(h, compute, mesh), nm.shard(wn, param, mesh)
    )

    def plain(h, w_):
        return (reference(h, w_, targets, np.ones_like(mask), reduction="none") * mask).sum()

    want, (rh, rw) = jax.value_and_grad(plain, argnums=(0, 1))(hidden, w)
    _check((value, gh.array, gw.array), (want, rh, rw))


# ---- the compiled gradient's collectives ----------------------------------------------------------


def _collectives(layout, block_size, gather="auto"):
    step, args, _, mesh = _on_mesh(layout, head_layout="vocab embed", block_size=block_size, gather=gather)
    return parse_collectives(step.lower(*args).compile().as_text(), mesh)


def test_fsdp_gathers_the_head_once_and_reduce_scatters_its_gradient_once():
    many, few = (_collectives("FSDP (8,)", b) for b in (V // 16, V // 2))
    for cs in (many, few):
        # the whole head, gathered once; its gradient, reduce-scattered once (shard_map's psum_scatter:
        # XLA:CPU forms no reduce-scatter under GSPMD, so an all-reduce would show the old way)
        assert [(c.kind, c.shape) for c in cs if c.kind == "all-gather"] == [("all-gather", f"f32[{E},{V}]")]
        assert [(c.kind, c.shape) for c in cs if c.kind == "reduce-scatter"] == [
            ("reduce-scatter", f"f32[{E // 8},{V}]")
        ]
        # what else crosses devices is the mean's token count: no [tokens, vocab]-sized all-reduce
        assert all(c.bytes <= 8 for c in cs if c.kind == "all-reduce")
        assert not [c for c in cs if c.in_loop]  # nothing per block
    # sixteen blocks or two: the same collectives
    assert [(c.kind, c.shape) for c in many] == [(c.kind, c.shape) for c in few]


def test_vocab_parallel_keeps_the_head_split_and_combines_tokens_sized_statistics():
    cs = _collectives("FSDP+TP vocab (4,2)", BLOCK)
    assert not [c for c in cs if c.in_loop]
    # the head gathered along embed only (its vocab stays split over model), its gradient scattered back
    assert [(c.shape, c.mesh_axes) for c in cs if c.kind == "all-gather"] == [(f"f32[{E},{V // 2}]", ("data",))]
    assert [(c.shape, c.mesh_axes) for c in cs if c.kind == "reduce-scatter"] == [
        (f"f32[{E // 4},{V // 2}]", ("data",))
    ]
    tokens = B // 4 * T
    over_model = sorted(c.bytes for c in cs if c.kind == "all-reduce" and c.mesh_axes == ("model",))
    # the max and the two sums of the log-sum-exp and the target's logit, then the hidden states'
    # gradient (float32; XLA may keep the hidden states' [batch, position] for their tokens)
    assert over_model == sorted([4 * tokens, 4 * 2 * tokens, 4 * tokens * E])


def test_fsdp_gathering_blocks_holds_one_block_of_the_head():
    cs = _collectives("FSDP (8,)", BLOCK, gather="blocks")
    # no whole head: each block gathered in the forward and again in the backward pass, each
    # block's gradient reduce-scattered as it is made, all inside the block loops
    assert sorted((c.kind, c.shape, c.in_loop) for c in cs if c.kind != "all-reduce") == sorted(
        [("all-gather", f"f32[{E},{BLOCK}]", True)] * 2 + [("reduce-scatter", f"f32[{E // 8},{BLOCK}]", True)]
    )
    assert all(c.bytes <= 8 for c in cs if c.kind == "all-reduce")


def test_auto_gathers_blocks_above_the_whole_head_budget(monkeypatch):
    from named.nn import _fused_loss

    def gathers(budget):
        monkeypatch.setattr(_fused_loss, "WHOLE_HEAD_BYTES", budget)
        return sorted((c.shape, c.in_loop) for c in _collectives("FSDP (8,)", BLOCK) if c.kind == "all-gather")

    head = V * E * 4
    assert gathers(head) == [(f"f32[{E},{V}]", False)]  # the whole head fits: gathered once
    assert gathers(head - 1) == [(f"f32[{E},{BLOCK}]", True)] * 2


def test_an_unknown_gather_is_refused():
    hidden, w, targets, mask = _named(*_draw(np.random.default_rng(0), 1, 2, 4, 8))
    with pytest.raises(nm.ArgumentError, match="gather='whole'"):
        blockwise_cross_entropy_loss(hidden, w, targets, block_size=4, gather="whole")
