"""Ragged decoding: every row of a batch at its own position. updated_slice and nm.ds with
per-row offsets, and attention with a per-row q_offset, against numpy loops over the rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nn_util import close
from test_attention import KN, QN, ref_attention

import named as nm
from named import nn

Batch, Seq, Embed = nm.Axis("batch", 4), nm.Axis("seq", 7), nm.Axis("embed", 3)


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def placed(offset: int, n: int, size: int) -> int:
    """Where lax puts a window of n at a traced offset: negative from the end, then clamped."""
    return min(max(offset + size if offset < 0 else offset, 0), size - n)


@pytest.mark.parametrize("update_has_batch", [True, False])
def test_updated_slice_with_per_row_offsets_is_a_loop_over_rows(update_has_batch):
    cache = rand((4, 7, 3), 0)
    offsets = np.array([0, 2, 6, -2])  # row 2 overflows and row 3 counts from the end: both traced
    up = rand((4, 2, 3) if update_has_batch else (2, 3), 1)
    up_axes = (Batch, Seq.resize(2), Embed) if update_has_batch else (Seq.resize(2), Embed)
    # the cache in another axis order, to check the result keeps the array's order
    x = nm.named(jnp.asarray(cache), (Batch, Seq, Embed)).rearrange(("seq", "embed", "batch"))
    out = jax.jit(lambda x, o, u: nm.updated_slice(x, {"seq": o}, u))(
        x, nm.named(jnp.asarray(offsets), (Batch,)), nm.named(jnp.asarray(up), up_axes)
    )
    assert out.names == ("seq", "embed", "batch")
    want = cache.copy()
    for b, o in enumerate(offsets):
        s = placed(int(o), 2, 7)
        want[b, s : s + 2] = up[b] if update_has_batch else up
    close(out.rearrange(("batch", "seq", "embed")).array, want)


def test_per_row_offsets_mix_with_a_shared_offset_and_check_static_ones():
    x = nm.named(jnp.asarray(rand((4, 7, 3), 2)), (Batch, Seq, Embed))
    u = nm.named(jnp.ones((4, 1, 2)), (Batch, Seq.resize(1), Embed.resize(2)))
    offsets = nm.named(jnp.array([6, 0, 3, 1]), (Batch,))
    out = nm.updated_slice(x, {"seq": offsets, "embed": 1}, u)  # eager: concrete, so checked
    want = np.asarray(x.array).copy()
    for b, o in enumerate([6, 0, 3, 1]):
        want[b, o, 1:3] = 1.0
    close(out.array, want)
    with pytest.raises(nm.AxisError, match="update of size 1 at offset 7 does not fit in axis 'seq' of size 7"):
        nm.updated_slice(x, {"seq": nm.named(jnp.array([0, 7, 1, 1]), (Batch,)), "embed": 1}, u)
    with pytest.raises(nm.AxisError, match=r"per-row offsets have axes \['beam'\]"):
        nm.updated_slice(x, {"seq": nm.named(jnp.array([0, 1]), "beam"), "embed": 1}, u)


def test_ds_with_per_row_starts_reads_and_writes_each_rows_window():
    cache = rand((4, 7, 3), 3)
    x = nm.named(jnp.asarray(cache), (Batch, Seq, Embed))
    starts = np.array([1, 5, -1, 0])

    @jax.jit
    def run(x, s):
        window = x["seq", nm.ds(s, 3)]
        return window, x.at["seq", nm.ds(s, 3)].set(0.0)

    window, zeroed = run(x, nm.named(jnp.asarray(starts), (Batch,)))
    want_window, want_zeroed = [], cache.copy()
    for b, o in enumerate(starts):
        s = placed(int(o), 3, 7)
        want_window.append(cache[b, s : s + 3])
        want_zeroed[b, s : s + 3] = 0.0
    assert dict(window.shape) == {"batch": 4, "seq": 3, "embed": 3}
    close(window.rearrange(("batch", "seq", "embed")).array, np.stack(want_window))
    close(zeroed.array, want_zeroed)


def test_a_ragged_decode_step_equals_per_row_attention():
    """One decoding step of a batch whose rows stand at different positions: write each row's
    new key/value at its position, attend causally from there (GQA), row by row in numpy."""
    B, T = nm.Axis("batch", 3), nm.Axis("position", 1)
    Heads, HeadSize = nm.Axis("heads", 4), nm.Axis("head_size", 8)
    kc, vc = rand((3, 6, 2, 8), 4), rand((3, 6, 2, 8), 5)
    q, k_new, v_new = rand((3, 1, 4, 8), 6), rand((3, 1, 2, 8), 7), rand((3, 1, 2, 8), 8)
    pos = np.array([0, 3, 5])

    @jax.jit
    def step(kc, vc, q, k_new, v_new, pos):
        kc = nm.updated_slice(kc, {"key_position": pos}, k_new.rename({"position": "key_position"}))
        vc = nm.updated_slice(vc, {"key_position": pos}, v_new.rename({"position": "key_position"}))
        return nn.dot_product_attention(q, kc, vc, causal=True, q_offset=pos), kc

    out, kc_after = step(
        nm.named(jnp.asarray(kc), KN),
        nm.named(jnp.asarray(vc), KN),
        nm.named(jnp.asarray(q), QN),
        nm.named(jnp.asarray(k_new), QN[:2] + KN[2:]),
        nm.named(jnp.asarray(v_new), QN[:2] + KN[2:]),
        nm.named(jnp.asarray(pos), (B,)),
    )
    assert out.axes == (B, T, Heads, HeadSize)
    for b, p in enumerate(pos):
        k_row, v_row = kc[b].copy(), vc[b].copy()
        k_row[p], v_row[p] = k_new[b, 0], v_new[b, 0]
        close(kc_after.array[b], k_row)
        # the row's query sees keys 0..p only: the reference is attention over exactly those
        want = ref_attention(q[b : b + 1].astype(np.float64), k_row[None, : p + 1], v_row[None, : p + 1])
        close(out.array[b : b + 1], want)
