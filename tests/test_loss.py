"""Cross-entropy losses against a plain-jnp reference, blockwise against naive, and vocab-parallel.

The reference (``ref_loss``) is positional jnp + ``jax.nn.log_softmax``; it never calls named.
Tolerances are 1e-5 (float32) throughout.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named.nn.loss import (
    blockwise_cross_entropy_loss,
    blockwise_next_token_loss,
    cross_entropy_loss,
    next_token_loss,
    next_token_targets,
)

TOL = dict(rtol=1e-5, atol=1e-5)


# ---- an independent reference ------------------------------------------------------------


def ref_loss(logits, targets, mask=None, reduction="mean", z=0.0):
    """Positional: ``logits[..., V]``, ``targets[...]``, ``mask[...]`` (0/1 or bool)."""
    logits = jnp.asarray(logits, jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
    nll = nll + z * jax.scipy.special.logsumexp(logits, axis=-1) ** 2
    m = jnp.ones_like(nll) if mask is None else jnp.asarray(mask, jnp.float32)
    nll = nll * m
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / m.sum()


def _data(B=3, T=7, E=8, V=24, seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((B, T, E)).astype(np.float32)
    w = (rng.standard_normal((E, V)) / np.sqrt(E)).astype(np.float32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    mask = rng.random((B, T)) < 0.7
    return hidden, w, targets, mask


def _named(hidden, w, targets, mask):
    return (
        nm.named(hidden, "batch position embed"),
        nm.named(w, "embed vocab"),
        nm.named(targets, "batch position"),
        nm.named(mask, "batch position"),
    )


# ---- cross_entropy_loss ----------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_cross_entropy_matches_reference(reduction, use_mask, z):
    hidden, w, targets, mask = _data()
    logits = hidden @ w * 3.0
    # vocab in the middle: the loss must find it by name, not by position
    nlogits = nm.named(np.transpose(logits, (0, 2, 1)), "batch vocab position")
    got = cross_entropy_loss(
        nlogits,
        nm.named(targets, "batch position"),
        where=nm.named(mask, "batch position") if use_mask else None,
        reduction=reduction,
        z_loss_weight=z,
    )
    want = ref_loss(logits, targets, mask if use_mask else None, reduction, z)
    assert got.dtype == jnp.float32
    if reduction == "none":
        assert got.names == ("batch", "position")
    else:
        assert got.names == ()
    np.testing.assert_allclose(got.array, want, **TOL)


def test_cross_entropy_gradient_matches_reference():
    hidden, w, targets, mask = _data()
    logits = hidden @ w
    tg, m = nm.named(targets, "batch position"), nm.named(mask, "batch position")
    got = jax.grad(lambda x: cross_entropy_loss(x, tg, where=m, z_loss_weight=1e-3).array)(
        nm.named(logits, "batch position vocab")
    )
    want = jax.grad(lambda x: ref_loss(x, targets, mask, z=1e-3))(logits)
    assert got.names == ("batch", "position", "vocab")
    np.testing.assert_allclose(got.array, want, **TOL)


def test_bf16_logits_are_reduced_in_float32():
    hidden, w, targets, _ = _data()
    logits16 = jnp.asarray(hidden @ w * 4.0, jnp.bfloat16)
    got = cross_entropy_loss(nm.named(logits16, "batch position vocab"), nm.named(targets, "batch position"))
    assert got.dtype == jnp.float32
    # Same bf16 values, upcast first: only the float32 arithmetic of the reference remains.
    np.testing.assert_allclose(got.array, ref_loss(logits16.astype(jnp.float32), targets), **TOL)


def test_masked_out_padding_ids_and_all_masked_batch():
    hidden, w, targets, mask = _data()
    logits = nm.named(hidden @ w, "batch position vocab")
    padded = np.where(mask, targets, -100)  # the usual ignore id, outside the vocab
    got = cross_entropy_loss(logits, nm.named(padded, "batch position"), where=nm.named(mask, "batch position"))
    np.testing.assert_allclose(got.array, ref_loss(hidden @ w, targets, mask), **TOL)

    nothing = nm.zeros(logits.resolve_axis(("batch", "position")), bool)

    def loss(x):
        return cross_entropy_loss(x, nm.named(targets, "batch position"), where=nothing).array

    value, grad = jax.value_and_grad(loss)(logits)
    assert float(value) == 0.0 and np.all(np.isfinite(grad.array)) and not np.any(grad.array)


def test_errors_name_the_problem():
    hidden, w, targets, _ = _data()
    logits = nm.named(hidden @ w, "batch position vocab")
    with pytest.raises(TypeError, match="integer"):
        cross_entropy_loss(logits, nm.named(targets.astype(np.float32), "batch position"))
    with pytest.raises(nm.AxisError, match="vocab"):
        cross_entropy_loss(logits, nm.named(np.zeros((3, 24), np.int32), "batch vocab"))
    with pytest.raises(nm.AxisError, match="seq"):
        cross_entropy_loss(logits, nm.named(np.zeros((3, 7), np.int32), "batch seq"))
    with pytest.raises(ValueError, match="'mean', 'sum', 'none'"):
        cross_entropy_loss(logits, nm.named(targets, "batch position"), reduction="avg")
    with pytest.raises(ValueError, match=r"block_size=7 does not divide the size 24 of axis 'vocab'; try 6 or 8"):
        blockwise_cross_entropy_loss(*_named(hidden, w, targets, _)[:3], block_size=7)


# ---- next-token -------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_next_token_loss_matches_shifted_reference(reduction):
    hidden, w, ids, mask = _data()
    logits = hidden @ w
    got = next_token_loss(
        nm.named(logits, "batch position vocab"),
        nm.named(ids, "batch position"),
        loss_mask=nm.named(mask, "batch position"),
        reduction=reduction,
        z_loss_weight=1e-3,
    )
    # position t predicts ids[t + 1]; the loss mask is aligned with the predicting position
    want = ref_loss(logits[:, :-1], ids[:, 1:], mask[:, :-1], reduction, 1e-3)
    if reduction == "none":
        assert got.names == ("batch", "position")
        assert not np.any(got.array[:, -1])
        got = got.array[:, :-1]
    else:
        got = got.array
    np.testing.assert_allclose(got, want, **TOL)


def test_next_token_targets_roll_and_mask():
    ids = nm.named(np.arange(10, dtype=np.int32).reshape(2, 5), "batch position")
    targets, mask = next_token_targets(ids)
    np.testing.assert_array_equal(targets.array[:, :-1], ids.array[:, 1:])
    np.testing.assert_array_equal(mask.array, np.array([[1, 1, 1, 1, 0]] * 2, np.float32))


# ---- blockwise --------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [24, 8, 4, 1])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_blockwise_value_and_gradients_equal_naive(block_size, reduction):
    hidden, w, targets, mask = _data()
    nh, nw, nt, nmask = _named(hidden, w, targets, mask)
    z = 1e-3

    def blockwise(h, w_):
        out = blockwise_cross_entropy_loss(
            h, w_, nt, where=nmask, block_size=block_size, reduction=reduction, z_loss_weight=z
        )
        return out.array if reduction == "mean" else (out.array * cot).sum()

    def reference(h, w_):  # positional, independent of named
        out = ref_loss(jnp.einsum("bte,ev->btv", h, w_), targets, mask, reduction, z)
        return out if reduction == "mean" else (out * cot).sum()

    cot = np.random.default_rng(1).standard_normal(targets.shape).astype(np.float32)
    value, (gh, gw) = jax.value_and_grad(blockwise, argnums=(0, 1))(nh, nw)
    ref_value, (rh, rw) = jax.value_and_grad(reference, argnums=(0, 1))(hidden, w)
    np.testing.assert_allclose(value, ref_value, **TOL)
    assert gh.names == nh.names and gw.names == nw.names
    np.testing.assert_allclose(gh.array, rh, **TOL)
    np.testing.assert_allclose(gw.array, rw, **TOL)

    # and the naive named loss on materialised logits agrees with it too
    naive = cross_entropy_loss(nm.dot(nh, nw, axis="embed"), nt, where=nmask, reduction=reduction, z_loss_weight=z)
    np.testing.assert_allclose(
        naive.array,
        blockwise_cross_entropy_loss(
            nh, nw, nt, where=nmask, block_size=block_size, reduction=reduction, z_loss_weight=z
        ).array,
        **TOL,
    )


def test_blockwise_with_tied_embedding_layout_and_next_token():
    hidden, w, ids, mask = _data()
    nh = nm.named(hidden, "batch position embed")
    table = nm.named(w.T.copy(), "vocab embed")  # Embedding.weight layout: (vocab, embed)
    got = blockwise_next_token_loss(
        nh, table, nm.named(ids, "batch position"), loss_mask=nm.named(mask, "batch position"), block_size=6
    )
    want = ref_loss((hidden @ w)[:, :-1], ids[:, 1:], mask[:, :-1])
    np.testing.assert_allclose(got.array, want, **TOL)


def test_blockwise_softcap_equals_the_capped_reference():
    # Gemma 2's final_logit_softcapping: each logit x is tanh(x / cap) * cap before the loss
    hidden, w, targets, mask = _data()
    nh, nw, nt, nmask = _named(hidden, w, targets, mask)
    cap = 1.5  # below the largest logits (|x| up to ~4), so the cap changes the loss

    def blockwise(h, w_):
        return blockwise_cross_entropy_loss(h, w_, nt, where=nmask, block_size=6, softcap=cap).array

    def reference(h, w_):
        return ref_loss(jnp.tanh(jnp.einsum("bte,ev->btv", h, w_) / cap) * cap, targets, mask)

    value, (gh, gw) = jax.value_and_grad(blockwise, argnums=(0, 1))(nh, nw)
    ref_value, (rh, rw) = jax.value_and_grad(reference, argnums=(0, 1))(hidden, w)
    np.testing.assert_allclose(value, ref_value, **TOL)
    np.testing.assert_allclose(gh.array, rh, **TOL)
    np.testing.assert_allclose(gw.array, rw, **TOL)
    assert abs(value - ref_loss(hidden @ w, targets, mask)) > 1e-2  # the cap mattered
    with pytest.raises(nm.ArgumentError, match=r"softcap=0; it must be a positive number"):
        blockwise_cross_entropy_loss(nh, nw, nt, block_size=6, softcap=0)


def _all_avals(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for p in eqn.params.values():
            subs = p if isinstance(p, (tuple, list)) else [p]
            for s in subs:
                if isinstance(s, jax.extend.core.ClosedJaxpr):
                    yield from _all_avals(s.jaxpr)
                elif isinstance(s, jax.extend.core.Jaxpr):
                    yield from _all_avals(s)


def _all_reduces_of(hlo, shape):
    """The all-reduce instructions of ``hlo`` whose result holds an f32 array of ``shape``."""
    pattern = "f32[" + ",".join(map(str, shape)) + "]"
    return [
        ln
        for ln in hlo.splitlines()
        if " all-reduce(" in ln and pattern in ln.split(" all-reduce(")[0].split("=", 1)[-1]
    ]


def _hlo_shapes(text):
    """Every array shape in an HLO module's text, as tuples of dims."""
    return [
        tuple(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"\b(?:f32|bf16|f16|s32|pred)\[([\d,]*)\]", text)
    ]


def test_blockwise_never_materialises_tokens_by_vocab():
    B, T, E, V, BS = 4, 16, 8, 512, 64
    hidden, w, targets, mask = _data(B, T, E, V)
    nh, nw, nt, nmask = _named(hidden, w, targets, mask)
    full = B * T * V  # 32768 elements; the weight has E * V = 4096, one block of logits B * T * BS = 4096

    def grads(loss_fn):
        return jax.value_and_grad(loss_fn, argnums=(0, 1))

    blockwise = grads(
        lambda h, w_: blockwise_cross_entropy_loss(h, w_, nt, where=nmask, block_size=BS, z_loss_weight=1e-4).array
    )
    naive = grads(
        lambda h, w_: cross_entropy_loss(nm.dot(h, w_, axis="embed"), nt, where=nmask, z_loss_weight=1e-4).array
    )

    def largest_in_jaxpr(f):
        return max(int(np.prod(a.shape)) for a in _all_avals(jax.make_jaxpr(f)(nh, nw).jaxpr) if hasattr(a, "shape"))

    compiled = {name: jax.jit(f).lower(nh, nw).compile() for name, f in (("naive", naive), ("blockwise", blockwise))}

    def largest_in_hlo(name):
        return max(int(np.prod(s)) for s in _hlo_shapes(compiled[name].as_text()))

    # the detector works: the naive loss does hold [batch, position, vocab]
    assert largest_in_jaxpr(naive) >= full and largest_in_hlo("naive") >= full
    # forward and backward of the blockwise loss never hold more than a block of logits
    assert largest_in_jaxpr(blockwise) <= B * T * BS
    assert largest_in_hlo("blockwise") <= B * T * BS
    (value, (gh, gw)), (ref_value, (ref_gh, ref_gw)) = compiled["blockwise"](nh, nw), compiled["naive"](nh, nw)
    np.testing.assert_allclose(value, ref_value, **TOL)
    np.testing.assert_allclose(gh.array, ref_gh.array, **TOL)
    np.testing.assert_allclose(gw.array, ref_gw.array, **TOL)


# ---- vocab-parallel ---------------------------------------------------------------------------

B, T, E, V = 4, 6, 24, 320  # V appears in no other dimension, so a full-vocab buffer is easy to spot

MESHES = {
    "data2_model4": ({"data": 2, "model": 4}, {"batch": "data", "vocab": "model"}),
    "model8": ({"model": 8}, {"vocab": "model"}),
}


def _losses(block_size):
    def naive(h, w, t, m):
        logits = nm.shard(nm.dot(h, w, axis="embed"))  # what Linear / Embedding.unembed do
        return cross_entropy_loss(logits, t, where=m, z_loss_weight=1e-3).array

    def blockwise(h, w, t, m):
        return blockwise_cross_entropy_loss(h, w, t, where=m, block_size=block_size, z_loss_weight=1e-3).array

    return {"naive": naive, "blockwise": blockwise}


def _value_and_grads(loss):
    """(loss, d/d hidden, d/d weight) as plain arrays."""

    def step(h, w, t, m):
        value, (gh, gw) = jax.value_and_grad(loss, argnums=(0, 1))(h, w, t, m)
        return value, gh.array, gw.array

    return step


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("kind", ["naive", "blockwise"])
def test_vocab_parallel_equals_single_device(mesh_name, kind):
    mesh_shape, compute = MESHES[mesh_name]
    mesh = nm.make_mesh(mesh_shape)
    tp = mesh_shape["model"]
    param = {"vocab": "model"}
    h, w, t, m = _named(*_data(B, T, E, V, seed=3))
    step = _value_and_grads(_losses(block_size=V // 4)[kind])

    want_value, want_gh, want_gw = jax.jit(step)(h, w, t, m)  # single device, no mapping

    sharded = nm.named_jit(step, mapping=compute, mesh=mesh)
    hs, ts, ms = nm.shard((h, t, m), compute, mesh)
    ws = nm.shard(w, param, mesh)
    value, gh, gw = sharded(hs, ws, ts, ms)
    np.testing.assert_allclose(value, want_value, **TOL)
    np.testing.assert_allclose(gh, want_gh, **TOL)
    np.testing.assert_allclose(gw, want_gw, **TOL)
    # the weight's gradient comes back vocab-sharded, like the weight
    assert gw.sharding.shard_shape(gw.shape) == (E, V // tp)

    # No device ever holds a buffer with the full vocab: only V / tp slices. The loss is
    # Megatron's fused one: the [batch, position] partial max and sums are all-reduced over
    # `model`, and nothing is all-gathered.
    hlo = sharded.lower(hs, ws, ts, ms).compile().as_text()
    shapes = _hlo_shapes(hlo)
    assert not [s for s in shapes if V in s], f"a full-vocab buffer: {sorted({s for s in shapes if V in s})}"
    assert any(V // tp in s for s in shapes)
    assert "all-gather" not in hlo
    local = B // mesh_shape.get("data", 1)
    # the naive loss all-reduces [batch, position] statistics, the fused one the same tokens flattened
    assert _all_reduces_of(hlo, (local, T)) or _all_reduces_of(hlo, (local * T,)), (
        "no [batch, position] all-reduce: not vocab-parallel"
    )


def test_vocab_parallel_naive_logits_stay_sharded_in_the_hlo():
    """The compiled program's local logits are [B/dp, T, V/tp]; the loss all-reduces a max and sums."""
    mesh_shape, compute = MESHES["data2_model4"]
    mesh = nm.make_mesh(mesh_shape)
    h, w, t, m = _named(*_data(B, T, E, V, seed=3))
    step = nm.named_jit(_value_and_grads(_losses(V)["naive"]), mapping=compute, mesh=mesh)
    args = (*nm.shard((h,), compute, mesh), nm.shard(w, {"vocab": "model"}, mesh), *nm.shard((t, m), compute, mesh))
    hlo = step.lower(*args).compile().as_text()
    shapes = set(_hlo_shapes(hlo))
    assert (B // 2, T, V // 4) in shapes  # the local logits
    assert not any(V in s for s in shapes)
    # the reductions over the vocab shards: [B/dp, T] all-reduces over the model axis
    # (replica groups of 4 devices), one a max (the log-sum-exp shift), the others sums.
    reduce_lines = _all_reduces_of(hlo, (B // 2, T))
    assert reduce_lines, "no [batch, position] all-reduce: the loss was not computed vocab-parallel"
    computations = {
        name: body for name, body in re.findall(r"^(%?[\w.\-]+)[^\n]*\{\n(.*?)\n\}", hlo, flags=re.S | re.M)
    }
    kinds = set()
    for ln in reduce_lines:
        target = re.search(r"to_apply=(%?[\w.\-]+)", ln).group(1)
        body = computations.get(target, computations.get(target.lstrip("%"), ""))
        kinds |= {op for op in ("maximum", "add") if f" {op}(" in body}
    assert kinds == {"maximum", "add"}, (kinds, reduce_lines)
