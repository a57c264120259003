"""Sliding windows, soft-capping, segments and cache offsets in nn.dot_product_attention, combined,
against a numpy reference; per-layer rotary frequencies; the fused-kernel layout with a window;
and the logged choice between the fused and the XLA paths."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import nn
from named.nn._attention import fused_attention

Batch, Pos, KPos = nm.Axis("batch", 2), nm.Axis("position", 9), nm.Axis("key_position", 9)
Heads, KVHeads, HeadSize = nm.Axis("heads", 6), nm.Axis("kv_heads", 2), nm.Axis("head_size", 8)
QN, KN = ("batch", "position", "heads", "head_size"), ("batch", "key_position", "kv_heads", "head_size")


def randn(axes, seed, scale=1.0):
    v = np.random.default_rng(seed).standard_normal([a.size for a in axes]).astype(np.float32) * scale
    return nm.named(jnp.asarray(v), tuple(axes))


def qkv(T=Pos, S=KPos, scale=1.0):
    return (
        randn((Batch, T, Heads, HeadSize), 0, scale),
        randn((Batch, S, KVHeads, HeadSize), 1, scale),
        randn((Batch, S, KVHeads, HeadSize), 2),
    )


def reference(q, k, v, *, window=None, segments=None, softcap=None, offset=0, scale=None):
    """numpy, float64: q [b, t, h, d], k/v [b, s, kv, d], GQA by repeat; query i stands at offset + i."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    h, kv = q.shape[2], k.shape[2]
    k, v = np.repeat(k, h // kv, axis=2), np.repeat(v, h // kv, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    qi = offset + np.arange(q.shape[1])[:, None]
    kj = np.arange(k.shape[1])[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed = allowed & (qi - kj < window)
    allowed = np.broadcast_to(allowed, s.shape)
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    s = np.where(allowed, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", w / w.sum(-1, keepdims=True), v)


def arrays(q, k, v):
    return q.rearrange(QN).array, k.rearrange(KN).array, v.rearrange(KN).array


@pytest.mark.parametrize("window", [1, 3, 20])
def test_window_segments_and_softcap_combine(window):
    q, k, v = qkv(scale=2.0)
    seg = np.array([[0] * 4 + [1] * 5, [2] * 9], np.int32)
    out = jax.jit(
        lambda q, k, v, s: nn.dot_product_attention(q, k, v, causal=True, window=window, softcap=3.0, segment_ids=s)
    )(q, k, v, nm.named(jnp.asarray(seg), (Batch, Pos)))
    ref = reference(*arrays(q, k, v), window=window, segments=seg, softcap=3.0)
    np.testing.assert_allclose(np.asarray(out.rearrange(QN).array), ref, atol=2e-5)
    # each part matters where it binds: the window (shorter than a segment), the cap (with more
    # than one key to weigh; a window of 1 leaves each query only itself)
    if window < 9:
        assert np.abs(reference(*arrays(q, k, v), segments=seg, softcap=3.0) - ref).max() > 1e-2
    if window > 1:
        assert np.abs(reference(*arrays(q, k, v), window=window, segments=seg) - ref).max() > 1e-2


def test_a_traced_window_with_a_cache_offset():
    # queries 3..5 continuing a cache of 9 keys, the window a traced scalar as a scan slices it
    q, k, v = qkv(T=nm.Axis("position", 3))
    windows = nm.named(jnp.asarray([2, 4], jnp.int32), ("layers",))

    @jax.jit
    def run(q, k, v, windows, pos):
        return nm.stack(
            "layers",
            [
                nn.dot_product_attention(q, k, v, causal=True, q_offset=pos, window=windows["layers", i])
                for i in range(2)
            ],
        )

    out = run(q, k, v, windows, jnp.int32(3))
    for i, w in enumerate((2, 4)):
        ref = reference(*arrays(q, k, v), window=w, offset=3)
        np.testing.assert_allclose(np.asarray(out["layers", i].rearrange(QN).array), ref, atol=2e-5)


def test_the_fused_layout_takes_a_window():
    # jax.nn's own implementation (xla on CPU) with local_window_size, through our folding
    q, k, v = qkv()
    group = nm.Axis("heads_per_kv_heads", 3)
    qg = nm.unflatten_axis(q, "heads", (KVHeads, group))
    fused = jax.jit(
        lambda q, k, v: fused_attention(
            q, k, v, "position", "key_position", "head_size", True, None, None, None, "xla", 3
        )
    )(qg, k, v)
    ours = jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True, window=3))(q, k, v)
    np.testing.assert_allclose(
        np.asarray(nm.flatten_axes(fused, ("kv_heads", group.name), "heads").rearrange(QN).array),
        np.asarray(ours.rearrange(QN).array),
        atol=2e-5,
    )


def test_per_layer_rotary_frequencies_and_scale():
    x = randn((Pos, Heads, HeadSize), 5)
    positions = nm.arange(Pos)
    theta = 500.0
    inv = 1.0 / theta ** (np.arange(0, 8, 2) / 8)
    default = nn.rotary_embedding(x, positions, theta=theta)
    given = nn.rotary_embedding(x, positions, inv_freq=nm.named(jnp.asarray(inv, jnp.float32), ("rotary",)))
    np.testing.assert_allclose(np.asarray(given.array), np.asarray(default.array), atol=1e-5)
    scaled = nn.rotary_embedding(
        x,
        positions,
        inv_freq=nm.named(jnp.asarray(inv / 4, jnp.float32), ("rotary",)),
        scale=nm.named(jnp.asarray(1.5), ()),
    )
    # by hand: rotate-half with the quartered frequencies, cos and sin times 1.5
    ang = np.arange(9)[:, None] * (inv / 4)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    xa = np.asarray(x.array, np.float64)
    rot = np.concatenate([-xa[..., 4:], xa[..., :4]], -1)
    np.testing.assert_allclose(
        np.asarray(scaled.array), 1.5 * (xa * cos[:, None]) + 1.5 * (rot * sin[:, None]), atol=1e-5
    )
    with pytest.raises(nm.AxisError, match="inv_freq"):
        nn.rotary_embedding(x, positions, inv_freq=nm.named(jnp.ones(3), ("rotary",)))


def test_the_path_choice_is_logged(caplog):
    q, k, v = qkv()
    with caplog.at_level(logging.DEBUG, logger="named.nn"):
        jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True, softcap=5.0))(q, k, v)
    assert "xla path" in caplog.text and "softcap is given" in caplog.text
    with pytest.raises(nm.NamedError, match="sliding window needs causal"):
        nn.dot_product_attention(q, k, v, window=3)
    with pytest.raises(nm.NamedError, match="softcap is given"):
        nn.dot_product_attention(q, k, v, causal=True, softcap=5.0, implementation="cudnn")


def test_segments_and_masks_leave_auto_on_cudnn(caplog):
    """Packed rows (segment ids) and boolean masks do not turn the automatic choice away from
    cuDNN (they reach it as a dense bias): on CPU the backend is the only reason logged; an
    additive bias is still one."""
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv())
    T = q.axis_size("position")
    seg = nm.named(jnp.asarray(np.repeat([[0] * 3 + [1] * (T - 3)], q.axis_size("batch"), 0)), ("batch", "position"))
    keep = nm.named(jnp.ones((q.axis_size("batch"), k.axis_size("key_position")), bool), ("batch", "key_position"))
    with caplog.at_level(logging.DEBUG, logger="named.nn"):
        jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True, segment_ids=seg, mask=keep))(q, k, v)
    reasons = [r.getMessage() for r in caplog.records if "dot_product_attention" in r.getMessage()]
    assert reasons == ["dot_product_attention: xla path (the backend is 'cpu', not 'gpu')"]
    caplog.clear()
    bias = nm.named(jnp.zeros((q.axis_size("position"), k.axis_size("key_position"))), ("position", "key_position"))
    with caplog.at_level(logging.DEBUG, logger="named.nn"):
        jax.jit(lambda q, k, v: nn.dot_product_attention(q, k, v, causal=True, bias=bias))(q, k, v)
    assert "bias is given" in caplog.text
