"""Attention masks and biases beside causal: chunked (Llama 4), ALiBi (slopes against BLOOM's
transformers implementation), all under grouped-query attention, against numpy attention."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _nn_util import close, jcall
from test_attention import KN, QN, ref_attention

import named as nm
from named import nn

Batch, Pos, KPos = nm.Axis("batch", 2), nm.Axis("position", 10), nm.Axis("key_position", 10)
Heads, KVHeads, HeadSize = nm.Axis("heads", 6), nm.Axis("kv_heads", 2), nm.Axis("head_size", 8)


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(2, 10, 6, 8), (2, 10, 2, 8), (2, 10, 2, 8)])
    return (nm.named(jnp.asarray(q), QN), nm.named(jnp.asarray(k), KN), nm.named(jnp.asarray(v), KN)), (q, k, v)


@pytest.mark.parametrize("chunk, offset", [(3, 0), (4, 2)])
def test_chunked_mask_with_causal_is_attention_within_chunks(chunk, offset):
    (q, k, v), (qn, kn, vn) = qkv()
    Q = Pos.resize(8)
    q, qn = q["position", :8], qn[:, :8]
    m = nn.chunked_mask(Q, KPos, chunk, q_offset=offset)
    i, j = offset + np.arange(8)[:, None], np.arange(10)[None, :]
    allowed = (i // chunk == j // chunk) & (j <= i)
    np.testing.assert_array_equal(np.asarray((m & nn.causal_mask(Q, KPos, q_offset=offset)).array), allowed)
    out = jcall(nn.dot_product_attention, q, k, v, mask=m, causal=True, q_offset=offset)
    close(out.rearrange(QN).array, ref_attention(qn, kn, vn, mask=allowed[None, None]))
    with pytest.raises(nm.ArgumentError, match="chunk must be a positive int"):
        nn.chunked_mask(Q, KPos, 0)


@pytest.mark.parametrize("n_heads", [8, 6, 12])
def test_alibi_slopes_match_bloom(n_heads):
    torch = pytest.importorskip("torch")
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    # BLOOM's bias is slope * key_index (the same per query: it cancels in the softmax against ours)
    alibi = bloom.build_alibi_tensor(torch.ones(1, 5), n_heads, torch.float32)  # [heads, 1, key]
    slopes = alibi[:, 0, 1].numpy()
    close(nn.alibi_slopes(nm.Axis("heads", n_heads)).array, slopes, tol=1e-6)


def test_alibi_bias_under_gqa_and_causal_equals_the_reference():
    (q, k, v), (qn, kn, vn) = qkv(1)
    bias = nn.alibi_bias(Heads, Pos, KPos)
    assert bias.axes == (Heads, Pos, KPos) and bias.dtype == jnp.float32
    slopes = 2.0 ** (-8.0 * np.array([1, 2, 3, 4, 0.5, 1.5]) / 4)  # 4 heads, then every other of 8
    i, j = np.arange(10)[:, None], np.arange(10)[None, :]
    want_bias = slopes[:, None, None] * (j - i)
    close(bias.array, want_bias)
    out = jcall(nn.dot_product_attention, q, k, v, bias=bias, causal=True)
    close(out.rearrange(QN).array, ref_attention(qn, kn, vn, bias=want_bias[None], mask=(j <= i)[None, None]))
    # a continuing query (offset 7 in a cache of 10) with a sliding window of 4, the two combined
    q1 = q["position", 0:1]
    out = jcall(
        nn.dot_product_attention,
        q1,
        k,
        v,
        bias=nn.alibi_bias(Heads, Pos.resize(1), KPos, q_offset=7),
        causal=True,
        q_offset=7,
        window=4,
    )
    jj = np.arange(10)
    keep = (jj <= 7) & (jj > 7 - 4)
    close(
        out.rearrange(QN).array,
        ref_attention(
            qn[:, :1], kn, vn, bias=(slopes[:, None] * (jj - 7))[None, :, None, :], mask=keep[None, None, None, :]
        ),
    )
