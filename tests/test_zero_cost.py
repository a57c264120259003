"""Zero cost: under jit, named code compiles to the same optimized program as hand-written jnp.

We compare the opcode multiset of XLA's *optimized* HLO (every computation, fused bodies
included), ignoring instruction names and metadata. A transpose, copy or reshape that the
named version adds shows up as a count that differs, and the test fails.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import pytest

import named as nm
from named import Axis

Batch, Pos, Embed, Mlp = Axis("batch", 8), Axis("position", 16), Axis("embed", 32), Axis("mlp", 128)
Heads, HeadSize = Axis("heads", 4), Axis("head_size", 8)
KeyPos = Pos.alias("key_position")

# "%name = shape opcode(operands), attrs" — the shape may be a tuple "(f32[2]{0}, s32[])".
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")


def optimized_ops(fn, *args) -> collections.Counter:
    text = jax.jit(fn).lower(*args).compile().as_text()
    ops = collections.Counter()
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            ops[m.group(1)] += 1
    assert ops["parameter"] > 0, "the HLO parser found no instructions; has the text format changed?"
    return ops


def assert_same_program(named_fn, jnp_fn, named_args):
    got = optimized_ops(named_fn, *named_args)
    want = optimized_ops(jnp_fn, *(a.array for a in named_args))
    extra, missing = got - want, want - got
    assert got == want, f"named adds {dict(extra)} and lacks {dict(missing)} compared with plain jnp"


def _params(*axes_list, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(axes_list))
    return [nm.random.normal(k, axes) * 0.1 for k, axes in zip(keys, axes_list)]


# ---- MLP -----------------------------------------------------------------------------


def mlp_named(x, w_in, b_in, w_out, b_out):
    h = nm.gelu(nm.dot(x, w_in, axis="embed") + b_in, approximate=True)
    return nm.einsum("batch position mlp, mlp embed -> batch position embed", h, w_out) + b_out


def mlp_jnp(x, w_in, b_in, w_out, b_out):
    h = jax.nn.gelu(x @ w_in + b_in, approximate=True)
    return h @ w_out + b_out


def test_named_mlp_compiles_to_the_plain_jnp_program():
    args = _params((Batch, Pos, Embed), (Embed, Mlp), (Mlp,), (Mlp, Embed), (Embed,))
    assert_same_program(mlp_named, mlp_jnp, args)
    out_named, out_jnp = jax.jit(mlp_named)(*args), jax.jit(mlp_jnp)(*(a.array for a in args))
    assert out_named.names == ("batch", "position", "embed")
    assert jnp.allclose(out_named.array, out_jnp, atol=1e-5)


# ---- attention -----------------------------------------------------------------------


def _project(x, w):
    return nm.einsum("batch position embed, embed heads head_size -> batch position heads head_size", x, w)


def attention_named(x, w_q, w_k, w_v, w_o, *, mask_layout="scores"):
    q = _project(x, w_q)
    k = _project(x, w_k).rename({"position": "key_position"})
    v = _project(x, w_v).rename({"position": "key_position"})
    scores = nm.einsum(
        "... position heads head_size, ... key_position heads head_size -> ... heads position key_position", q, k
    )
    scores = scores / jnp.sqrt(jnp.float32(HeadSize.size))
    causal = nm.arange(Pos) >= nm.arange(KeyPos)  # [position, key_position] by the union rule
    if mask_layout == "scores":
        scores = nm.where(causal.broadcast_to(scores.axes), scores, -1e9)
    else:
        scores = nm.where(causal, scores, -1e9)
    weights = nm.softmax(scores, "key_position")
    out = nm.einsum(
        "... heads position key_position, ... key_position heads head_size -> ... position heads head_size", weights, v
    )
    return nm.einsum("batch position heads head_size, heads head_size embed -> batch position embed", out, w_o)


def attention_jnp(x, w_q, w_k, w_v, w_o):
    # The usual hand-written form (nanoGPT-style): fused head projections, [b, h, t, d] layout.
    b, t, e = x.shape
    _, h, d = w_q.shape

    def heads(w):
        return (x @ w.reshape(e, h * d)).reshape(b, t, h, d).transpose(0, 2, 1, 3)

    q, k, v = heads(w_q), heads(w_k), heads(w_v)
    scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(jnp.float32(d))
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    scores = jnp.where(causal, scores, -1e9)
    weights = jax.nn.softmax(scores, axis=-1)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, h * d)
    return out @ w_o.reshape(h * d, e)


def _attention_args():
    return _params(
        (Batch, Pos, Embed),
        (Embed, Heads, HeadSize),
        (Embed, Heads, HeadSize),
        (Embed, Heads, HeadSize),
        (Heads, HeadSize, Embed),
    )


def test_named_attention_compiles_to_the_plain_jnp_program():
    args = _attention_args()
    assert_same_program(attention_named, attention_jnp, args)
    out_named, out_jnp = jax.jit(attention_named)(*args), jax.jit(attention_jnp)(*(a.array for a in args))
    assert out_named.names == ("batch", "position", "embed")
    assert jnp.allclose(out_named.array, out_jnp, atol=1e-5)


def test_attention_with_where_on_the_bare_mask_is_free():
    # The operand with the most axes (the scores) sets the layout, so the mask is broadcast into
    # the scores' [batch, heads, position, key_position] order and nothing is transposed.
    assert_same_program(lambda *a: attention_named(*a, mask_layout="mask"), attention_jnp, _attention_args())


def test_the_comparison_notices_one_extra_op():
    args = _params((Batch, Pos, Embed), (Embed, Mlp), (Mlp,), (Mlp, Embed), (Embed,))

    def mlp_named_with_an_extra_transpose(x, w_in, b_in, w_out, b_out):
        h = nm.gelu(nm.dot(x, w_in, axis="embed") + b_in, approximate=True)
        h = h.rearrange(("mlp", "batch", "position")) * 1.5  # a transpose XLA cannot drop, and a multiply
        return nm.einsum("batch position mlp, mlp embed -> batch position embed", h, w_out) + b_out

    with pytest.raises(AssertionError, match="named adds"):
        assert_same_program(mlp_named_with_an_extra_transpose, mlp_jnp, args)
