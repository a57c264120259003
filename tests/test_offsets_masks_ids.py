"""Offsets, attention masks and embedding ids, each against numpy (issue 23's four silent or needless failures):
a 0-d NamedArray (an argmax) as an offset under jit; updated_slice refusing a static offset
that would be clamped; attention refusing a mask or bias without the key axis (and
padding_mask, which builds the right one); Embedding's checked mode for ids outside the vocab."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nn_util import close, jcall
from test_attention import KN, QN, ref_attention

import named as nm
from named import nn

H, W = nm.Axis("H", 6), nm.Axis("W", 3)


def data(seed=0):
    v = np.random.default_rng(seed).standard_normal((H.size, W.size)).astype(np.float32)
    return nm.named(jnp.asarray(v), (H, W)), v


# ---- a 0-d NamedArray is an offset ---------------------------------------------------------------


def test_argmax_result_is_an_offset_everywhere_under_jit():
    x, xn = data()
    xn = xn.copy()
    xn[:, 0] = np.arange(H.size) == 2  # column 0 peaks at row 2: argmax gives 2
    x = nm.named(jnp.asarray(xn), (H, W))
    u = nm.named(jnp.full((2, W.size), 9.0), (H.resize(2), W))

    @jax.jit
    def run(x, u):
        s = nm.argmax(x["W", 0], "H")  # a traced 0-d NamedArray
        return (
            nm.roll(x, s, "H"),
            x["H", nm.ds(s, 2)],
            nm.updated_slice(x, {"H": s}, u),
            x.at["H", nm.ds(s, 2)].set(u),
            nm.roll(x, (s, 1), ("H", "W")),
        )

    rolled, window, updated, at_set, rolled2 = run(x, u)
    close(rolled.array, np.roll(xn, 2, axis=0))
    close(window.array, xn[2:4])
    want = xn.copy()
    want[2:4] = 9.0
    close(updated.array, want)
    close(at_set.array, want)
    close(rolled2.array, np.roll(xn, (2, 1), axis=(0, 1)))


def test_offsets_that_are_not_integers_are_named_errors():
    x, _ = data()
    with pytest.raises(nm.AxisError, match="roll shift must be a single integer"):
        nm.roll(x, nm.named(jnp.array([1, 2]), "n"), "H")
    with pytest.raises(nm.AxisError, match="offset for axis 'H' must be an integer"):
        nm.updated_slice(x, {"H": 1.5}, x["H", 0:1])
    with pytest.raises(nm.AxisError, match="nm.ds start for axis 'H' must be an integer"):
        x["H", nm.ds(nm.named(jnp.float32(1.0), ()), 2)]


# ---- updated_slice refuses a static overflow, documents a traced one ---------------------------


def test_updated_slice_static_overflow_is_an_error_naming_the_axis():
    S = nm.Axis("seq", 4)
    cache, update = nm.zeros((S,)), nm.ones(S.resize(3))
    with pytest.raises(
        nm.AxisError, match=r"update of size 3 at offset 2 does not fit in axis 'seq' of size 4.*\[-4, 1\]"
    ):
        nm.updated_slice(cache, {"seq": 2}, update)
    with pytest.raises(nm.AxisError, match="at offset 5 does not fit"):
        nm.updated_slice(cache, {"seq": jnp.int32(5)}, update)  # a concrete array is static too
    # in range, a negative offset counts from the end (as lax does): -3 is 1
    close(nm.updated_slice(cache, {"seq": -3}, update).array, [0, 1, 1, 1])
    close(nm.updated_slice(cache, {"seq": 1}, update).array, [0, 1, 1, 1])


@pytest.mark.parametrize("offset", [-6, -1, 0, 2, 3, 7])
def test_updated_slice_traced_offset_clamps_as_documented(offset):
    S = nm.Axis("seq", 5)
    base = np.arange(5, dtype=np.float32)
    out = jax.jit(lambda c, o: nm.updated_slice(c, {"seq": o}, nm.named(jnp.array([10.0, 20.0]), "seq")))(
        nm.named(jnp.asarray(base), (S,)), jnp.int32(offset)
    )
    start = min(max(offset + 5 if offset < 0 else offset, 0), 5 - 2)  # the docstring's rule
    want = base.copy()
    want[start : start + 2] = [10.0, 20.0]
    close(out.array, want)


# ---- attention masks and biases must be over keys ---------------------------------------------------

Batch, Pos, KPos = nm.Axis("batch", 2), nm.Axis("position", 8), nm.Axis("key_position", 8)
Heads, KVHeads, HeadSize = nm.Axis("heads", 4), nm.Axis("kv_heads", 2), nm.Axis("head_size", 8)


def qkv():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2, 8)])
    return (nm.named(jnp.asarray(q), QN), nm.named(jnp.asarray(k), KN), nm.named(jnp.asarray(v), KN)), (q, k, v)


def test_a_mask_over_the_query_axis_is_refused_with_the_fix():
    (q, k, v), _ = qkv()
    over_queries = nm.named(jnp.asarray(np.arange(8) < 5), (Pos,))
    with pytest.raises(nm.AxisError, match=r"mask \(position=8\) lacks the key axis 'key_position'.*nn.padding_mask"):
        jcall(nn.dot_product_attention, q, k, v, mask=over_queries)
    with pytest.raises(nm.AxisError, match="bias .* lacks the key axis 'key_position'"):
        jcall(nn.dot_product_attention, q, k, v, bias=nm.zeros((Heads, Pos)))
    with pytest.raises(nm.AxisError, match="lacks the key axis"):  # the fused layout code checks first too
        jcall(nn.dot_product_attention, q, k, v, mask=over_queries, implementation="cudnn")


def test_padding_mask_from_lengths_or_flags_masks_keys():
    (q, k, v), (qn, kn, vn) = qkv()
    lengths = np.array([3, 8])
    keep = np.arange(8)[None, :] < lengths[:, None]  # [batch, key]
    want = ref_attention(qn, kn, vn, mask=keep[:, None, None, :])
    from_lengths = nn.padding_mask(nm.named(jnp.asarray(lengths), (Batch,)), KPos)
    from_flags = nn.padding_mask(nm.named(jnp.asarray(keep), (Batch, Pos)))  # per token, over position
    assert from_lengths.names == ("batch", "key_position") and from_flags.names == ("batch", "key_position")
    for m in (from_lengths, from_flags):
        close(jcall(nn.dot_product_attention, q, k, v, mask=m).rearrange(QN).array, want)
    with pytest.raises(nm.AxisError, match="needs KPos as an Axis"):
        nn.padding_mask(nm.named(jnp.asarray(lengths), (Batch,)))
    with pytest.raises(nm.AxisError, match="needs axis 'position' or 'key_position'"):
        nn.padding_mask(nm.named(jnp.asarray(keep), (Batch, nm.Axis("tokens", 8))))


# ---- Embedding: ids outside the vocab ----------------------------------------------------------------

Vocab, Embed, B = nm.Axis("vocab", 5), nm.Axis("embed", 3), nm.Axis("batch", 4)


def test_embedding_default_clamps_and_wraps_as_documented():
    emb = nn.Embedding.init(Vocab, Embed, key=jax.random.key(0))
    table = np.asarray(emb.weight.array)
    out = jcall(emb, nm.named(jnp.array([0, 7, -1, 2]), (B,)))
    close(out.array, table[[0, 4, 4, 2]])  # 7 reads the last row; -1 counts from the end


def test_embedding_check_ids_raises_eagerly_and_under_jit():
    emb = nn.Embedding.init(Vocab, Embed, key=jax.random.key(0), check_ids=True)
    bad = nm.named(jnp.array([[0, 1], [5, -2]]), (B.resize(2), nm.Axis("position", 2)))
    with pytest.raises(nm.NamedError, match=r"token id 5 at \(batch=1, position=0\) is outside \[0, 5\).*2 id\(s\)"):
        emb(bad)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"outside \[0, 5\)"):
        jax.block_until_ready(eqx.filter_jit(emb)(bad))
    good = nm.named(jnp.array([4, 0, 3, 1]), (B,))
    close(jcall(emb, good).array, np.asarray(emb.weight.array)[[4, 0, 3, 1]])
    # a loaded model switches the check on without re-initialising
    unchecked = dataclasses.replace(emb, check_ids=False)
    close(jcall(unchecked, bad).array[1, 0], np.asarray(emb.weight.array)[4])
