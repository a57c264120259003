"""muP (``nn.mup``): roles from axis names, the readout init and the per-parameter Adam learning
rates against hand-computed multipliers, and the coordinate check: after a few Adam steps the
activations of a tiny MLP stay flat as its width grows 64-fold under muP, and blow up under the
standard parametrization with the same learning rate (so the check can tell the two apart)."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import named as nm
from named import Axis, nn
from named.models import LlamaConfig, LlamaLMHeadModel

In, Out, Batch = Axis("feature", 16), Axis("out", 8), Axis("batch", 64)
BASE = {"mlp": 32, "mlp2": 32}


def mlp(width: int):
    # up: feature -> mlp (input), hidden[0]: mlp -> mlp2 (hidden), down: mlp2 -> out (readout)
    return nn.MLP.init(In, Out, width, 2, "relu", key=jax.random.key(0))


def test_roles_follow_the_axis_names():
    m = 4.0  # 128 / 32
    assert nn.mup.roles(mlp(128), BASE) == {"up": ("input", 1.0), "hidden.0": ("hidden", m), "down": ("readout", m)}
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    llama = jax.eval_shape(lambda: LlamaLMHeadModel.init(cfg, key=jax.random.key(1)))  # roles need only the axes
    # a 4x wider llama than its base: embed 16 -> 64, mlp 32 -> 128, heads 1 -> 4, kv_heads 1 -> 2
    roles = nn.mup.roles(llama, {"embed": 16, "mlp": 32, "heads": 1, "kv_heads": 1}, readouts=["lm_head"])
    assert roles["embed_tokens"] == ("input", 1.0) and roles["lm_head"] == ("readout", 4.0)
    assert roles["layers.stacked.self_attn.q_proj"] == ("hidden", 4.0)
    assert roles["layers.stacked.self_attn.o_proj"] == ("hidden", 4.0)  # In: heads (4x) and head_size (not a width)
    assert roles["layers.stacked.mlp.down"] == ("hidden", 4.0)


def test_readout_init_and_learning_rates_are_scaled_by_the_width_multiplier():
    model = mlp(128)
    scaled = nn.mup.rescale_init(model, BASE)
    np.testing.assert_allclose(scaled.down.weight.array, model.down.weight.array / 4.0, rtol=1e-6)
    for name in ("up", "hidden"):
        assert eqx.tree_equal(getattr(scaled, name), getattr(model, name))
    ones = jax.tree.map(lambda x: x * 0 + 1.0, model)
    u = nn.mup.scale_updates(ones, BASE)
    assert float(u.up.weight.array.max()) == 1.0  # input layer: unchanged
    np.testing.assert_array_equal(u.hidden[0].weight.array, 0.25)
    np.testing.assert_array_equal(u.down.weight.array, 0.25)
    for bias in (u.up.bias, u.hidden[0].bias, u.down.bias):
        np.testing.assert_array_equal(bias.array, 1.0)
    # at the base widths muP is the standard parametrization
    base = mlp(32)
    assert eqx.tree_equal(nn.mup.rescale_init(base, BASE), base)


def _coordinates(width: int, mup: bool, steps: int = 5, lr: float = 0.02) -> np.ndarray:
    """Mean |activation| of the three layers' outputs after ``steps`` Adam steps."""
    x = nm.random.normal(jax.random.key(2), (Batch, In))
    y = nm.random.normal(jax.random.key(3), (Batch, Out))
    model = mlp(width)
    opt = optax.adam(lr)
    if mup:
        model = nn.mup.rescale_init(model, BASE)
        opt = optax.chain(opt, optax.stateless(lambda u, _: nn.mup.scale_updates(u, BASE)))
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(m, s):
        g = jax.grad(lambda m: ((m(x) - y) ** 2).mean().scalar())(m)
        u, s = opt.update(g, s, m)
        return eqx.apply_updates(m, u), s

    for _ in range(steps):
        model, state = step(model, state)
    h1 = model.up(x)
    h2 = model.hidden[0](nn.relu(h1))
    out = model.down(nn.relu(h2))
    return np.array([float(nm.abs(h).mean().scalar()) for h in (h1, h2, out)])


def test_coordinate_check():
    widths = (32, 256, 2048)
    mup = np.stack([_coordinates(w, True) for w in widths])
    sp = np.stack([_coordinates(w, False) for w in widths])
    # muP: every layer's activation scale within 1.5x across a 64x range of widths (measured: <= 1.35x)
    assert (mup.max(0) / mup.min(0) < 1.5).all(), mup
    # the standard parametrization, same learning rate: the hidden and output layers grow with width
    assert (sp[-1, 1:] / sp[0, 1:] > 10).all(), sp


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: nn.mup.roles(m, {"mpl": 32}), r"base names \['mpl'\], which no Linear or Embedding.*mlp"),
        (lambda m: nn.mup.roles(m, {"mlp": 0}), r"base\['mlp'\] must be an axis name and a size >= 1"),
        (lambda m: nn.mup.roles(m, {}), r"base maps each width axis name"),
        (lambda m: nn.mup.rescale_init(m, BASE, readouts=["down"]), r"readouts \['down'\] are not Embeddings"),
    ],
)
def test_errors_name_the_culprit(call, match):
    with pytest.raises(nm.NamedError, match=match):
        call(mlp(64))


# ---- Haliax's absolute form: Linear.init(reparam_cls=...) -------------------------------------------


@pytest.mark.parametrize("out_first", [False, True])
def test_reparam_cls_scales_init_output_and_learning_rate(out_first):
    I, J, O = Axis("i", 3), Axis("j", 2), Axis("o", 5)
    key = jax.random.key(3)
    std = nn.Linear.init((I, J), O, key=key, use_bias=False, out_first=out_first)
    assert std.weight.axes == ((O, I, J) if out_first else (I, J, O)) and std.reparam.lr_scale == 1
    # the same draw, scaled: standard and hidden 1/sqrt(fan_in), input and output 1
    for cls, factor in [
        (nn.mup.HiddenLinearMup, 1.0),
        (nn.mup.InputLinearMup, np.sqrt(6)),
        (nn.mup.OutputLinearMup, np.sqrt(6)),
    ]:
        w = nn.Linear.init((I, J), O, key=key, use_bias=False, out_first=out_first, reparam_cls=cls).weight
        np.testing.assert_allclose(np.asarray(w.array), np.asarray(std.weight.array) * factor, rtol=1e-5)
    head = nn.Linear.init((I, J), O, key=key, reparam_cls=nn.mup.OutputLinearMup, out_first=out_first)
    head = eqx.tree_at(lambda l: l.bias, head, nm.full(O, 0.25))
    x = nm.random.normal(jax.random.key(4), (Batch.resize(2), I, J))
    w = np.asarray(head.weight.rearrange((I, J, O)).array).reshape(6, 5)
    want = np.asarray(x.array).reshape(2, 6) @ w / 6 + 0.25  # numpy: the readout's output times 1/fan_in
    np.testing.assert_allclose(np.asarray(head(x).array), want, rtol=1e-5, atol=1e-6)
    # the learning-rate column: hidden weights' updates times 1/fan_in, the rest untouched
    model = [nn.Linear.init(I, O, key=key, reparam_cls=nn.mup.HiddenLinearMup), head]
    updates = jax.tree.map(lambda v: v * 0 + 1.0, model)
    scaled = nn.mup.scale_reparam_updates(updates, model)
    np.testing.assert_allclose(np.asarray(scaled[0].weight.array), 1 / 3)
    np.testing.assert_allclose(np.asarray(scaled[0].bias.array), 1.0)
    np.testing.assert_allclose(np.asarray(scaled[1].weight.array), 1.0)
    with pytest.raises(nm.ArgumentError, match="reparam_cls must be a class from nn.mup"):
        nn.Linear.init(I, O, key=key, reparam_cls="mup")
    with pytest.raises(nm.ArgumentError, match=r"quantize: 1 scale their output"):
        nn.quantize(model, "int8")
