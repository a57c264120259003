"""Issue 42's six silent wrong results, each now an error naming the right argument or the right
number against numpy: a boolean mask as an attention bias, a float mask on the losses, a square
Linear loaded in the other layout, ``updated_slice`` with a short update on an axis without an
offset, a causal mask with its axes swapped, and float64 inputs rounded to float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import named as nm
from named import Axis, nn

Batch, Pos, KPos, Heads, HeadSize = (
    Axis("batch", 2),
    Axis("position", 3),
    Axis("key_position", 3),
    Axis("heads", 2),
    Axis("head_size", 4),
)
Vocab, Embed = Axis("vocab", 5), Axis("embed", 4)


def rand(axes, seed, dtype=np.float32):
    v = np.random.default_rng(seed).standard_normal([a.size for a in axes]).astype(dtype)
    return nm.named(jnp.asarray(v), axes)


# ---- 1. a boolean mask is not a bias -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.int32])
def test_a_boolean_or_integer_bias_is_refused_naming_mask(dtype):
    q, kv = rand((Batch, Pos, Heads, HeadSize), 0), rand((Batch, KPos, Heads, HeadSize), 1)
    keep = nm.named(jnp.asarray([True, False, True]), (KPos,)).astype(dtype)
    for call in (
        lambda: nn.dot_product_attention(q, kv, kv, bias=keep),
        lambda: nn.dot_product_attention_weights(q, kv, bias=keep),
    ):
        with pytest.raises(nm.ArgumentTypeError, match="mask="):
            call()


def test_the_float_mask_error_does_not_send_a_boolean_mask_to_bias():
    q, kv = rand((Batch, Pos, Heads, HeadSize), 0), rand((Batch, KPos, Heads, HeadSize), 1)
    zero_one = nm.named(jnp.asarray([1.0, 0.0, 1.0]), (KPos,))
    with pytest.raises(nm.ArgumentTypeError) as e:
        nn.dot_product_attention(q, kv, kv, mask=zero_one)
    assert "mask != 0" in str(e.value) and "pass an additive mask as bias=" not in str(e.value)


# ---- 2. a float where= on the losses ---------------------------------------------------------------------


def _ce_args():
    logits = rand((Batch, Pos, Vocab), 2)
    ids = nm.named(jnp.asarray(np.arange(6).reshape(2, 3) % Vocab.size, jnp.int32), (Batch, Pos))
    return logits, ids


@pytest.mark.parametrize("mask", [[0.0, -np.inf, 0.0], [1.0, 0.0, 1.0], [0.5, 0.5, 1.0], [1, 0, 1]])
def test_the_losses_refuse_a_mask_that_is_not_boolean(mask):
    logits, ids = _ce_args()
    where = nm.named(jnp.asarray(mask), (Pos,))
    calls = {
        "cross_entropy_loss": lambda: nn.cross_entropy_loss(logits, ids, where=where),
        "next_token_loss": lambda: nn.next_token_loss(logits, ids, loss_mask=where),
        "next_token_targets": lambda: nn.next_token_targets(ids, loss_mask=where),
        "binary_cross_entropy_loss": lambda: nn.binary_cross_entropy_loss(logits, nm.sigmoid(logits), where=where),
        "blockwise_cross_entropy_loss": lambda: nn.blockwise_cross_entropy_loss(
            rand((Batch, Pos, Embed), 3), rand((Embed, Vocab), 4), ids, block_size=5, where=where
        ),
    }
    for name, call in calls.items():
        with pytest.raises(nm.ArgumentTypeError, match="boolean mask") as e:
            call()
        assert "reduction='none'" in str(e.value), name


def test_a_boolean_where_on_the_loss_is_numpys_masked_mean():
    logits, ids = _ce_args()
    keep = np.array([True, False, True])
    got = nn.cross_entropy_loss(logits, ids, where=nm.named(jnp.asarray(keep), (Pos,)))
    lg, t = np.asarray(logits.array, np.float64), np.asarray(ids.array)
    lse = np.log(np.exp(lg).sum(-1))
    per = lse - np.take_along_axis(lg, t[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(got.array), per[:, keep].mean(), rtol=1e-6)


# ---- 3. a square Linear keeps its orientation through files ---------------------------------------------


def _square():
    return nn.Linear.init(Embed, Embed.alias("out"), key=jax.random.key(0))


def _equal(a, b):
    np.testing.assert_array_equal(np.asarray(a.weight.array), np.asarray(b.weight.rearrange(a.weight.names).array))


@pytest.mark.parametrize("flatten", [True, False])
def test_a_file_we_write_loads_back_equal_whatever_its_layout(tmp_path, flatten):
    lin = _square()
    nm.save_state_dict(lin, tmp_path / "m.safetensors", flatten=flatten)
    template = nn.Linear.init(Embed, Embed.alias("out"), key=jax.random.key(1))
    _equal(nm.load_state_dict_file(template, tmp_path / "m.safetensors"), lin)
    with pytest.raises(nm.StateDictError, match=f"flatten={flatten}"):
        nm.load_state_dict_file(template, tmp_path / "m.safetensors", flatten=not flatten)


def test_a_square_torch_file_without_a_record_is_refused_or_resolved(tmp_path):
    from safetensors.torch import save_file

    t = torch.nn.Linear(Embed.size, Embed.size)
    save_file({"weight": t.weight.detach(), "bias": t.bias.detach()}, str(tmp_path / "torch.safetensors"))
    template = _square()
    with pytest.raises(nm.StateDictError, match="'weight'.*flatten=True"):
        nm.load_state_dict_file(template, tmp_path / "torch.safetensors")
    loaded = nm.load_state_dict_file(template, tmp_path / "torch.safetensors", flatten=True)
    x = torch.randn(Embed.size)
    want = t(x).detach().numpy()
    got = loaded(nm.named(jnp.asarray(x.numpy()), (Embed,)))
    np.testing.assert_allclose(np.asarray(got.array), want, rtol=1e-5, atol=1e-6)
    # a dict of torch tensors is the same question
    with pytest.raises(nm.StateDictError, match="square"):
        nm.load_state_dict(template, {"weight": t.weight.detach(), "bias": t.bias.detach()})
    assert nm.square_keys(template) == ["weight"]
    assert nm.square_keys(nn.Linear.init(Embed, Vocab, key=jax.random.key(0))) == []


# ---- 4. updated_slice: a short update needs an offset ------------------------------------------------------


def test_updated_slice_refuses_a_short_update_on_an_axis_without_offset():
    H, W = Axis("h", 3), Axis("w", 4)
    x = nm.zeros((H, W))
    short = nm.ones((H, W.resize(3)))
    with pytest.raises(nm.AxisError, match="'w'"):
        nm.updated_slice(x, {"h": 0}, short)
    with pytest.raises(nm.AxisError):  # what .at[...].set says to the same update
        x.at[{"h": 0}].set(short)
    got = nm.updated_slice(x, {"w": 1}, short)  # with an offset it is a window
    want = np.zeros((3, 4), np.float32)
    want[:, 1:] = 1
    np.testing.assert_array_equal(np.asarray(got.array), want)


# ---- 5. a causal mask knows which axis is the query's ------------------------------------------------------


def test_causal_mask_refuses_its_axes_swapped_and_takes_keywords():
    with pytest.raises(nm.AxisError, match="QPos"):
        nn.causal_mask(KPos, Pos)
    with pytest.raises(nm.AxisError, match="QPos"):
        nn.chunked_mask(Axis("k", 3), Axis("q", 3), 2)
    m = nn.causal_mask(KPos=KPos, QPos=Pos)
    np.testing.assert_array_equal(
        np.asarray(m.rearrange(("position", "key_position")).array), np.tril(np.ones((3, 3), bool))
    )


# ---- 6. float64 in, float64 computed ----------------------------------------------------------------------


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def test_rms_and_layer_norm_keep_float64(x64):
    x = rand((Batch, Embed), 5, np.float64)
    v = np.asarray(x.array)
    rms = nn.RMSNorm.init(Embed)(x)
    want = v / np.sqrt((v**2).mean(-1, keepdims=True) + 1e-6)
    assert rms.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(rms.array), want, rtol=0, atol=1e-12)
    ln = nn.LayerNorm.init(Embed)(x)
    c = v - v.mean(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(ln.array), c / np.sqrt((c**2).mean(-1, keepdims=True) + 1e-5), atol=1e-12)


def test_losses_and_attention_keep_float64(x64):
    logits = rand((Batch, Pos, Vocab), 6, np.float64)
    ids = nm.named(jnp.asarray(np.arange(6).reshape(2, 3) % Vocab.size), (Batch, Pos))
    loss = nn.cross_entropy_loss(logits, ids)
    lg, t = np.asarray(logits.array), np.asarray(ids.array)
    lse = np.log(np.exp(lg).sum(-1))
    want = (lse - np.take_along_axis(lg, t[..., None], -1)[..., 0]).mean()
    assert loss.dtype == jnp.float64
    np.testing.assert_allclose(float(loss.array), want, rtol=1e-13)
    bce = nn.binary_cross_entropy_loss(logits, nm.sigmoid(logits * 0.5))
    assert bce.dtype == jnp.float64
    q, kv = rand((Batch, Pos, Heads, HeadSize), 7, np.float64), rand((Batch, KPos, Heads, HeadSize), 8, np.float64)
    out = nn.dot_product_attention(q, kv, kv, causal=True)
    qa, ka = np.asarray(q.array), np.asarray(kv.array)
    s = np.einsum("bthd,bshd->bhts", qa, ka) / 2.0 + np.where(np.tril(np.ones((3, 3))), 0, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshd->bthd", w, ka)
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(
        np.asarray(out.rearrange(("batch", "position", "heads", "head_size")).array), want, atol=1e-12
    )


# ---- the smaller ones: Stacked's differing field, the missing vocab axis, array_equiv -------------------


def test_stacked_names_the_field_where_blocks_differ():
    import equinox as eqx

    class Block(eqx.Module):
        norm: nn.LayerNorm
        act: str = eqx.field(static=True)

    blocks = [Block(nn.LayerNorm.init(Embed), "gelu"), Block(nn.LayerNorm.init(Embed, eps=1e-3), "gelu")]
    with pytest.raises(nm.NamedError, match=r"\.norm\.eps is 1e-05 in one, 0\.001 in the other"):
        nn.Stacked.from_layers(blocks, Axis("layers", 2))
    stack = nn.Stacked.from_layers([blocks[0], blocks[0]], Axis("layers", 2))
    with pytest.raises(nm.NamedError, match=r"\.act is 'gelu' in one, 'relu' in the other"):
        stack.set_layer(1, Block(nn.LayerNorm.init(Embed), "relu"))


def test_a_loss_without_the_vocab_axis_says_which_keyword_names_it():
    Classes = Axis("classes", 5)
    logits = rand((Batch, Pos, Classes), 9)
    ids = nm.named(jnp.zeros((2, 3), jnp.int32), (Batch, Pos))
    with pytest.raises(nm.AxisError, match="axis='classes'"):
        nn.cross_entropy_loss(logits, ids)
    with pytest.raises(nm.AxisError, match="axis="):
        nn.next_token_loss(logits, ids)
    with pytest.raises(nm.AxisError, match="Vocab='classes'"):
        nn.blockwise_cross_entropy_loss(rand((Batch, Pos, Embed), 3), rand((Embed, Classes), 4), ids, block_size=5)
    want = nn.cross_entropy_loss(logits.rename({"classes": "vocab"}), ids)
    np.testing.assert_allclose(float(nn.cross_entropy_loss(logits, ids, axis="classes").array), float(want.array))


def test_array_equiv_is_numpys_broadcast_rule_by_name():
    A, B, C = Axis("a", 2), Axis("b", 3), Axis("c", 4)
    x = nm.ones((A, B))
    # numpy: equivalent when one broadcasts to the other; disjoint names do not (Haliax says False too)
    assert bool(nm.array_equiv(x, nm.ones(()))) is bool(np.array_equiv(np.ones((2, 3)), np.ones(())))
    assert bool(nm.array_equiv(x, nm.ones((B,)))) is bool(np.array_equiv(np.ones((2, 3)), np.ones((3,))))
    assert bool(nm.array_equiv(x, nm.ones((C,)))) is False
    assert bool(nm.array_equiv(nm.ones((C,)), x)) is False
    assert bool(nm.array_equiv(x, nm.ones((B.resize(2),)))) is False
