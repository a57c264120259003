"""Issue 31: mistakes a model author makes at the library's edges used to give plausible numbers
with no error. Each test here failed (a wrong number or JAX's own error) before the fix; the
references are numpy or plain jnp, never the code under test."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import nn

TOL = dict(rtol=1e-5, atol=1e-5)


# ---- loss targets outside [0, vocab) --------------------------------------------------------------

B, T, V, E = 2, 5, 7, 4


def _loss_data(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((B, T, V)).astype(np.float32)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    return logits, ids


def _torch_like(logits, ids, ignore=-100, weight=None):
    """Mean NLL over the tokens whose id is not ``ignore`` (and whose weight is not 0), as torch's
    ``cross_entropy(ignore_index=-100)``: ignored tokens are out of the denominator too."""
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    keep = (ids != ignore).astype(np.float32) * (1.0 if weight is None else weight)
    nll = -np.take_along_axis(logp, np.where(ids == ignore, 0, ids)[..., None], axis=-1)[..., 0]
    return (nll * keep).sum() / keep.sum()


def test_ignore_index_minus_100_is_skipped_and_not_counted():
    logits, ids = _loss_data()
    labels = ids.copy()
    labels[0, :2] = -100  # a Hugging Face prompt, not scored
    labels[1, 4] = -100
    got = nn.cross_entropy_loss(nm.named(logits, "batch position vocab"), nm.named(labels, "batch position"))
    np.testing.assert_allclose(got.scalar(), _torch_like(logits, labels), **TOL)
    # with where= as well: both take tokens out of the mean
    w = np.array([[1, 1, 1, 0, 1], [1, 0, 1, 1, 1]], bool)
    got = nn.cross_entropy_loss(
        nm.named(logits, "batch position vocab"),
        nm.named(labels, "batch position"),
        where=nm.named(w, "batch position"),
    )
    np.testing.assert_allclose(got.scalar(), _torch_like(logits, labels, weight=w), **TOL)
    # next-token and blockwise take the same default
    h = np.random.default_rng(1).standard_normal((B, T, E)).astype(np.float32)
    wv = np.random.default_rng(2).standard_normal((E, V)).astype(np.float32)
    full = nn.next_token_loss(nm.named(h @ wv, "batch position vocab"), nm.named(labels, "batch position"))
    want = _torch_like((h @ wv)[:, :-1], labels[:, 1:])
    np.testing.assert_allclose(full.scalar(), want, **TOL)
    blocked = nn.blockwise_next_token_loss(
        nm.named(h, "batch position embed"),
        nm.named(wv, "embed vocab"),
        nm.named(labels, "batch position"),
        block_size=V,
    )
    np.testing.assert_allclose(blocked.scalar(), want, **TOL)


@pytest.mark.parametrize("bad", [V, -1, -100])
def test_ids_outside_the_vocab_are_refused_naming_the_first(bad):
    logits, ids = _loss_data()
    ids[1, 3] = bad
    lg, tg = nm.named(logits, "batch position vocab"), nm.named(ids, "batch position")
    ignore = None if bad == -100 else -100  # -100 is only an ignore label when ignore_index says so
    with pytest.raises(nm.ArgumentError, match=rf"target id {bad} at \(batch=1, position=3\) is outside \[0, {V}\)"):
        nn.cross_entropy_loss(lg, tg, ignore_index=ignore)
    hidden, w = (
        nm.named(np.ones((B, T, E), np.float32), "batch position embed"),
        nm.named(np.ones((E, V), np.float32), "embed vocab"),
    )
    with pytest.raises(
        nm.ArgumentError, match=rf"blockwise_cross_entropy_loss: target id {bad} at \(batch=1, position=3\)"
    ):
        nn.blockwise_cross_entropy_loss(hidden, w, tg, block_size=V, ignore_index=ignore)
    # masked out by where=, the same id is no mistake
    mask = np.ones((B, T), bool)
    mask[1, 3] = False
    got = nn.cross_entropy_loss(lg, tg, where=nm.named(mask, "batch position"), ignore_index=ignore)
    np.testing.assert_allclose(got.scalar(), _torch_like(logits, np.where(mask, ids, -100)), **TOL)


def test_ids_outside_the_vocab_under_jit_give_nan_not_a_number():
    logits, ids = _loss_data()
    ids[0, 2] = V
    lg, tg = nm.named(logits, "batch position vocab"), nm.named(ids, "batch position")
    per_token = jax.jit(lambda a, b: nn.cross_entropy_loss(a, b, reduction="none"))(lg, tg)
    assert np.isnan(per_token.array[0, 2]) and np.isfinite(np.delete(per_token.array.ravel(), 2)).all()
    assert np.isnan(jax.jit(nn.cross_entropy_loss)(lg, tg).scalar())
    hidden, w = (
        nm.named(np.ones((B, T, E), np.float32), "batch position embed"),
        nm.named(np.ones((E, V), np.float32), "embed vocab"),
    )
    assert np.isnan(
        jax.jit(lambda h, w, t: nn.blockwise_cross_entropy_loss(h, w, t, block_size=V))(hidden, w, tg).scalar()
    )
    # the gradient stays finite (the NaN is a constant), and -100 under jit is still skipped
    grad = jax.grad(lambda x: jax.jit(nn.cross_entropy_loss)(x, tg).scalar())(lg)
    assert np.isfinite(grad.array).all()
    ids[0, 2] = -100
    got = jax.jit(nn.cross_entropy_loss)(lg, nm.named(ids, "batch position"))
    np.testing.assert_allclose(got.scalar(), _torch_like(logits, ids), **TOL)


# ---- attention masks are boolean ------------------------------------------------------------------


def _qkv(seed=0, n=4, d=8):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))
    return (
        nm.named(q, "position head_size"),
        nm.named(k, "key_position head_size"),
        nm.named(v, "key_position head_size"),
        q,
        k,
        v,
    )


def _ref_attention(q, k, v, allowed):
    s = np.where(allowed, q @ k.T / np.sqrt(q.shape[-1]), -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def test_a_float_or_int_attention_mask_is_refused_and_bias_takes_the_additive_one():
    q, k, v, qn, kn, vn = _qkv()
    allowed = np.random.default_rng(1).random((4, 4)) < 0.6
    allowed[:, 0] = True
    additive = nm.named(np.where(allowed, 0.0, -np.inf).astype(np.float32), "position key_position")  # torch / HF
    for wrong in (additive, nm.named(allowed.astype(np.int32), "position key_position")):
        with pytest.raises(
            nm.ArgumentTypeError, match=r"mask must be a boolean mask \(True = attend\), got dtype .*bias="
        ):
            nn.dot_product_attention(q, k, v, mask=wrong)
    want = _ref_attention(qn, kn, vn, allowed)
    np.testing.assert_allclose(nn.dot_product_attention(q, k, v, bias=additive).array, want, **TOL)
    np.testing.assert_allclose(
        nn.dot_product_attention(q, k, v, mask=nm.named(allowed, "position key_position")).array, want, **TOL
    )
    # reductions and softmax take where= as a boolean mask too (numpy refuses a float one)
    x = nm.named(qn, "position head_size")
    with pytest.raises(nm.ArgumentTypeError, match="where= must be a boolean mask"):
        x.sum("head_size", where=nm.named(np.ones(8, np.float32), "head_size"))
    with pytest.raises(nm.ArgumentTypeError, match="where= must be a boolean mask"):
        nm.softmax(x, "head_size", where=nm.named(np.zeros(8, np.float32), "head_size"))


# ---- static indices and windows: in range or an error, as numpy ---------------------------------


def _grid():
    xn = np.arange(10, dtype=np.float32).reshape(2, 5)
    return nm.named(jnp.asarray(xn), "batch seq"), xn


@pytest.mark.parametrize("i", [2, 5, -3])
def test_a_static_index_past_the_end_is_an_error_not_a_clamp(i):
    x, _ = _grid()
    with pytest.raises(nm.AxisError, match=rf"index {i} is out of range for axis 'batch' of size 2"):
        x["batch", i]
    with pytest.raises(nm.AxisError, match=rf"index {i} is out of range"):
        x.at["batch", i].set(0.0)  # jax would drop the write
    with pytest.raises(nm.AxisError, match=rf"index {i} is out of range"):
        x["seq", nm.named(jnp.array([0, 1]), "k"), "batch", i]  # beside a gather too


def test_negative_static_indices_count_from_the_end_as_in_numpy():
    x, xn = _grid()
    np.testing.assert_array_equal(x["batch", -1].array, xn[-1])
    np.testing.assert_array_equal(x["batch", -2, "seq", -1].array, xn[-2, -1])
    want = xn.copy()
    want[-1] = 7.0
    np.testing.assert_array_equal(x.at["batch", -1].set(7.0).array, want)
    # a traced index keeps JAX's clamping (documented): it cannot be checked
    np.testing.assert_array_equal(jax.jit(lambda x, i: x["batch", i])(x, 5).array, xn[1])


def test_a_static_window_that_does_not_fit_is_an_error_everywhere():
    x, xn = _grid()
    u = nm.named(jnp.full((4,), 9.0), "seq")
    with pytest.raises(
        nm.AxisError, match=r"window of size 4 at offset 3 does not fit in axis 'seq' of size 5.*\[-5, 1\]"
    ):
        x["seq", nm.ds(3, 4)]  # lax would read [1, 5) instead
    with pytest.raises(nm.AxisError, match=r"window of size 4 at offset 3 does not fit.*overwrite"):
        x.at["seq", nm.ds(3, 4)].set(u)
    with pytest.raises(nm.AxisError, match=r"update of size 4 at offset 3 does not fit"):
        nm.updated_slice(x, {"seq": 3}, u)  # the same rule
    with pytest.raises(nm.AxisError, match=r"window of size 3 at offset 4 does not fit"):
        x["seq", nm.ds(nm.named(jnp.array([0, 4]), "batch"), 3)]  # per-row starts, known here
    # in range, a negative start counts from the end: nm.ds(-2, 2) is numpy's [-2:]
    np.testing.assert_array_equal(x["seq", nm.ds(-2, 2)].array, xn[:, -2:])
    np.testing.assert_array_equal(x.at["seq", nm.ds(-2, 2)].set(0.0).array, np.where(np.arange(5) >= 3, 0.0, xn))
    # a traced start keeps lax's clamping: the read and the write place it alike
    read = jax.jit(lambda x, s: x["seq", nm.ds(s, 4)])(x, 3)
    np.testing.assert_array_equal(read.array, xn[:, 1:5])


def test_updated_slice_broadcasts_an_update_that_lacks_an_axis_as_at_does():
    x, xn = _grid()
    u = nm.named(jnp.array([10.0, 20.0]), "seq")
    want = xn.copy()
    want[:, 1:3] = [10.0, 20.0]  # every row: batch is not addressed
    np.testing.assert_array_equal(nm.updated_slice(x, {"seq": 1}, u).array, want)
    np.testing.assert_array_equal(x.at["seq", nm.ds(1, 2)].set(u).array, want)
    # an offset on the missing axis addresses one entry of it, as x.at[axis, offset] does
    one = xn.copy()
    one[1, 1:3] = [10.0, 20.0]
    np.testing.assert_array_equal(nm.updated_slice(x, {"seq": 1, "batch": 1}, u).array, one)
    np.testing.assert_array_equal(x.at["batch", 1, "seq", nm.ds(1, 2)].set(u).array, one)


# ---- a plain jax array into a layer: one message everywhere ----------------------------------------

Emb, Mlp_, Voc, Bt, Ps = (
    nm.Axis("embed", 4),
    nm.Axis("mlp", 8),
    nm.Axis("vocab", 5),
    nm.Axis("batch", 2),
    nm.Axis("position", 3),
)
_K = jax.random.key(0)
_PLAIN, _IDS = jnp.ones((2, 3, 4)), jnp.ones((2, 3), jnp.int32)
_QKV = nm.ones((Bt, Ps, Emb.alias("head_size")))

LAYER_ENTRIES = {
    "Linear": lambda: nn.Linear.init(Emb, Mlp_, key=_K)(_PLAIN),
    "LoraLinear": lambda: nn.LoraLinear.init(nn.Linear.init(Emb, Mlp_, key=_K), rank=2, key=_K)(_PLAIN),
    "Int8Linear": lambda: nn.quantize(nn.Linear.init(Emb, Mlp_, key=_K), "int8")(_PLAIN),
    "Embedding": lambda: nn.Embedding.init(Voc, Emb, key=_K)(_IDS),
    "Embedding.unembed": lambda: nn.Embedding.init(Voc, Emb, key=_K).unembed(_PLAIN),
    "LayerNorm": lambda: nn.LayerNorm.init(Emb)(_PLAIN),
    "RMSNorm": lambda: nn.RMSNorm.init(Emb)(_PLAIN),
    "Dropout": lambda: nn.Dropout(0.5)(_PLAIN, key=_K),
    "MLP": lambda: nn.MLP.init(Emb, Mlp_, key=_K)(_PLAIN),
    "MoE": lambda: nn.MoE.init(Emb, Mlp_, nm.Axis("experts", 2), 1, key=_K)(_PLAIN),
    "Conv": lambda: nn.Conv.init(Ps, Emb, Emb.alias("out"), 3, key=_K)(_PLAIN),
    "max_pool": lambda: nn.max_pool(_PLAIN, {"position": 2}),
    "dot_product_attention": lambda: nn.dot_product_attention(_QKV, _PLAIN, _PLAIN),
    "rotary_embedding": lambda: nn.rotary_embedding(_PLAIN, _IDS),
    "cross_entropy_loss": lambda: nn.cross_entropy_loss(_PLAIN, nm.named(_IDS, "batch position")),
    "next_token_loss": lambda: nn.next_token_loss(nm.ones((Bt, Ps, Voc)), _IDS),
    "padding_mask": lambda: nn.padding_mask(_IDS),
    "checkpoint_name": lambda: nn.checkpoint_name(_PLAIN, "x"),
    "softmax": lambda: nm.softmax(_PLAIN, "embed"),
}


@pytest.mark.parametrize("entry", sorted(LAYER_ENTRIES))
def test_a_plain_array_into_a_layer_gets_the_wrap_it_message(entry):
    with pytest.raises(
        nm.ArgumentTypeError,
        match=r"takes a NamedArray.*got a positional array of shape \(2, 3(, 4)?\); "
        r"wrap it with nm.named\(array, axes\)",
    ):
        LAYER_ENTRIES[entry]()


# ---- messages in the library's words -----------------------------------------------------------------


def test_a_stacked_block_that_changes_its_carry_names_the_axes():
    Layers = nm.Axis("layers", 3)
    stack = nn.Stacked.init(Layers, nn.Linear.init, Emb, Mlp_, key=_K)  # embed -> mlp: cannot be a carry
    x = nm.ones((Bt, Emb))
    with pytest.raises(
        nm.AxisError,
        match=r"scan over 'layers': the step changed the carry it passes on: the carry "
        r"\(batch=2, embed=4\) -> \(batch=2, mlp=8\).*nn.BlockSeq",
    ):
        stack.fold(x)
    with pytest.raises(nm.AxisError, match=r"\['h'\] dtype float32 -> bfloat16"):
        nm.fold(lambda c, w: {"h": (c["h"] * w).astype(jnp.bfloat16)}, "layers")({"h": x}, nm.ones((Layers,)))
    with pytest.raises(
        nm.AxisError, match=r"the carry a NamedArray \(batch=2, embed=4\) -> a plain array of shape \(2, 4\)"
    ):
        nm.fold(lambda c, w: (c * w).array, "layers")(x, nm.ones((Layers,)))
    # the same axes in another order are put back in order, not refused
    out = nm.fold(lambda c, w: (c * w).rearrange(("embed", "batch")), "layers")(x, nm.ones((Layers,)))
    assert out.names == ("batch", "embed")


def test_per_row_offsets_of_the_wrong_size_name_the_argument_not_vmap():
    Bq, S = nm.Axis("batch", 4), nm.Axis("seq", 7)
    x = nm.zeros((Bq, S, Emb))
    off = nm.named(jnp.array([0, 1, 2]), "batch")
    with pytest.raises(
        nm.AxisError,
        match=r"updated_slice: the offsets for axis 'seq' are over batch=3 but the array "
        r"has batch=4",
    ):
        jax.jit(lambda x, o: nm.updated_slice(x, {"seq": o}, nm.ones((S.resize(1), Emb))))(x, off)
    with pytest.raises(
        nm.AxisError, match=r"the nm.ds starts for axis 'seq' are over batch=3 but the array has batch=4"
    ):
        x["seq", nm.ds(off, 2)]
    with pytest.raises(nm.AxisError, match=r"updated_slice: the update has batch=3 but the array has batch=4"):
        nm.updated_slice(x, {"seq": nm.named(jnp.arange(4), "batch")}, nm.ones((Bq.resize(3), S.resize(1), Emb)))
    q = nm.ones((Bq, Ps, Emb.alias("head_size")))
    k = nm.ones((Bq, nm.Axis("key_position", 7), Emb.alias("head_size")))
    with pytest.raises(
        nm.AxisError, match=r"dot_product_attention: q_offset has batch=3, but the query .* has batch=4"
    ):
        nn.dot_product_attention(q, k, k, causal=True, q_offset=off)


def test_grad_of_a_named_loss_takes_the_0d_array_and_names_the_axes_left():
    w, x = nm.named(np.arange(3.0, dtype=np.float32), "embed"), nm.named(np.ones((2, 3), np.float32), "batch embed")

    def loss(w, x):
        return (nm.dot(x, w, axis="embed") ** 2).mean()

    value, g = nm.value_and_grad(loss)(w, x)
    want = jax.grad(lambda wa: ((x.array @ wa) ** 2).mean())(w.array)
    assert isinstance(value, nm.NamedArray) and value.axes == () and np.isclose(value.item(), 9.0)
    np.testing.assert_allclose(g.array, want, **TOL)
    np.testing.assert_allclose(jax.jit(nm.grad(loss))(w, x).array, want, **TOL)
    with pytest.raises(
        nm.AxisError,
        match=r"nm.grad\(<lambda>\): the function returned a NamedArray with axes "
        r"\(batch=2\).*reduce it first",
    ):
        nm.grad(lambda w, x: nm.dot(x, w, axis="embed"))(w, x)
    with pytest.raises(nm.AxisError, match=r"scalar\(\) needs an array with no axes.*reduce it first"):
        nm.dot(x, w, axis="embed").scalar()


def test_haliax_typed_axes_spelling_names_ours():
    with pytest.raises(
        nm.AxisError, match=r"Float\[NamedArray, \.\.\.\] is Haliax's spelling.*write nm.Float\['batch embed'\]"
    ):
        nm.Float[nm.NamedArray, "batch embed"]


# ---- jax.make_mesh's Explicit axes -------------------------------------------------------------------


def test_named_jit_and_shard_accept_a_mesh_made_by_jax_make_mesh():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    explicit = jax.make_mesh((4, 2), ("data", "model"))  # jax's default axis types: Explicit
    assert set(explicit.axis_types) == {AxisType.Explicit}
    x = nm.random.normal(jax.random.key(1), (nm.Axis("batch", 8), Emb))
    w = nm.random.normal(jax.random.key(2), (Emb, Mlp_))
    w = nm.named(jax.device_put(w.array, NamedSharding(explicit, P("data"))), w.axes)  # FSDP, on that mesh

    def f(x, w):
        h = nm.relu(nm.dot(x, w, axis="embed"))
        return h * w.sum("embed")  # an FSDP weight broadcast into an activation

    want = np.maximum(np.asarray(x.array) @ np.asarray(w.array), 0) * np.asarray(w.array).sum(0)
    y = nm.named_jit(f, mapping={"batch": "data", "mlp": "model"}, mesh=explicit)(x, w)
    np.testing.assert_allclose(y.array, want, **TOL)
    assert nm.layout(y) == "batch/data mlp/model"
    with jax.set_mesh(explicit), nm.axis_mapping({"batch": "data"}):
        np.testing.assert_allclose(nm.named_jit(f)(x, w).array, want, **TOL)
        assert nm.layout(nm.shard(x)) == "batch/data embed"
        # a plain jax.jit traced under the Explicit mesh: shard sets the layout (jax.sharding.reshard)
        z = jax.jit(lambda v: nm.shard(v * 2.0))(x)
        assert z.array.sharding.spec == P("data", None)


# ---- nn.Stacked built directly -----------------------------------------------------------------------


def test_stacked_built_directly_refuses_leaves_it_cannot_slice():
    import equinox as eqx

    class Block(eqx.Module):
        w: object

        def __call__(self, x):
            return x * self.w

    Layers = nm.Axis("layers", 3)
    with pytest.raises(nm.AxisError, match=r"block leaf \.w is a plain array of shape \(3, 4\).*nm.named"):
        nn.Stacked(Block(jnp.ones((3, 4))), Layers)  # docs/nn.md: a plain array leaf raises
    with pytest.raises(nm.AxisError, match=r"block weight \.w \(embed=4\) lacks the layers axis 'layers'"):
        nn.Stacked(Block(nm.ones((Emb,))), Layers)  # get_layer would have returned it unsliced
    with pytest.raises(nm.AxisError, match=r"has layers=2, not the stack's 3"):
        nn.Stacked(Block(nm.ones((Layers.resize(2), Emb))), Layers)
    w = nm.named(np.arange(12.0, dtype=np.float32).reshape(3, 4), (Layers, Emb))
    stack = nn.Stacked(Block(w), Layers)
    np.testing.assert_array_equal(stack.get_layer(1).w.array, np.arange(4.0, 8.0))


# ---- positional-looking patterns: one reading, or an error ---------------------------------------------


def test_a_pattern_haliax_would_read_by_position_is_refused_not_read_otherwise():
    hn = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
    hw = nm.named(hn, "w h")
    # Haliax binds 'h' to the first axis (named w) and 'w' to the second, so 'h w -> w h' is a
    # transpose to (h, w) there; matching names, it would leave (w, h). Neither guess is made.
    with pytest.raises(
        nm.AxisError,
        match=r"rearrange: 'h w' names the axes of \(w=3, h=2\) in another order.*'h' would "
        r"be axis 'w'.*braces \('\{h w\}'\)",
    ):
        nm.rearrange(hw, "h w -> w h")
    with pytest.raises(nm.AxisError, match=r"'\.\.\. w' names the axes"):
        nm.rearrange(hw, "... w -> w ...")  # after '...' counts from the end: 'w' would be axis 'h'
    with pytest.raises(nm.AxisError, match=r"einsum operand 0: 'h w' names the axes of \(w=3, h=2\) in another order"):
        nm.einsum("h w -> h", hw)  # Haliax: sums the array's second axis (h), keeps w under the name 'h'
    with pytest.raises(nm.AxisError, match=r"einsum operand 1: 'h w'"):
        nm.einsum("w h, h w -> w", hw, hw)
    # one reading: the array's order, braces, or names after '...' that sit at the end
    np.testing.assert_array_equal(nm.rearrange(hw, "w h -> h w").array, hn.T)
    np.testing.assert_array_equal(nm.rearrange(hw, "{h w} -> h w").array, hn.T)
    np.testing.assert_array_equal(nm.rearrange(hw, "... h -> h ...").array, hn.T)
    np.testing.assert_allclose(nm.einsum("w h -> h", hw).array, hn.sum(0), **TOL)
    np.testing.assert_allclose(nm.einsum("{w} -> h", hw).array, hn.sum(0), **TOL)
    # names of more than one letter are names: any order, as before
    named_x = nm.named(hn, "width height")
    np.testing.assert_array_equal(nm.rearrange(named_x, "height width -> height width").array, hn.T)
    np.testing.assert_allclose(nm.einsum("height width -> height", named_x).array, hn.sum(0), **TOL)


# ---- safetensors: an optional digest per tensor ----------------------------------------------------------


def _flip_last_tensor_byte(path):
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0x40  # inside the data of the last tensor: the header (and every shape) stays valid
    path.write_bytes(bytes(raw))


def test_a_damaged_safetensors_file_is_caught_by_its_digest(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    lin = nn.Linear.init(Emb, Mlp_, key=_K, dtype=jnp.bfloat16)
    path = tmp_path / "lin.safetensors"
    nm.save_state_dict(lin, path, metadata={"note": "kept"})
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["note"] == "kept" and set(json.loads(f.metadata()["named.sha256"])) == {"bias", "weight"}
    np.testing.assert_array_equal(nm.load_state_dict_file(lin, path).weight.array, lin.weight.array)
    _flip_last_tensor_byte(path)
    with pytest.raises(
        nm.StateDictError, match=r"lin.safetensors: tensor 'weight' does not match the sha256 it was saved with"
    ):
        nm.load_state_dict_file(lin, path)
    # a file without digests (another writer's, or digest=False) loads as before: the flip goes unseen
    nm.save_state_dict(lin, path, digest=False)
    _flip_last_tensor_byte(path)
    assert not np.array_equal(nm.load_state_dict_file(lin, path).weight.array, lin.weight.array)
    # a digest table that does not cover the file is refused too
    save_file(
        {"weight": np.asarray(lin.weight.array), "bias": np.asarray(lin.bias.array)},
        str(path),
        metadata={"named.sha256": json.dumps({"weight": "0" * 64})},
    )
    with pytest.raises(nm.StateDictError, match=r"tensor 'bias' has no digest"):
        nm.load_state_dict_file(lin, path)
    with pytest.raises(nm.StateDictError, match=r"'named.sha256' holds the tensors' digests"):
        nm.save_state_dict(lin, path, metadata={"named.sha256": "mine"})
