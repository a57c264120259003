"""Pooling by name, the depth-N MLP, the activations beyond test_nn_layers' and the binary and
soft-target losses, against independent references (torch CPU, numpy, equinox, jax.nn)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_nn_layers import REFERENCE_ACTIVATIONS

import named as nm
from named import Axis, nn

Batch, Ch = Axis("batch", 2), Axis("ch", 3)
SIZES = {"length": 9, "depth": 5, "height": 7, "width": 6}
SPATIAL = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}


def randn(axes, seed, scale=1.0):
    v = np.random.default_rng(seed).standard_normal([a.size for a in axes]).astype(np.float32) * scale
    return nm.named(v, axes)


def _input(n, seed=0):
    """Channels first in torch's layout; ours puts them last and reverses the spatial axes."""
    spatial = tuple(Axis(s, SIZES[s]) for s in SPATIAL[n])
    return randn((*spatial[::-1], Batch, Ch), seed)


def _torch(x, n):
    return torch.tensor(np.asarray(x.rearrange(("batch", "ch", *SPATIAL[n])).array))


def _ours(y, n):
    return np.asarray(y.rearrange(("batch", "ch", *SPATIAL[n])).array)


# ---- pooling -----------------------------------------------------------------------------------

TORCH_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
TORCH_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
POOL_CASES = [  # (dims, window, stride, padding, use_ceil), torch-expressible (symmetric padding <= window / 2)
    (1, 3, 2, 1, False),
    (1, 4, 3, 2, True),
    (2, (3, 2), 2, (1, 0), False),
    (2, (3, 3), (2, 3), 1, True),
    (3, 2, 2, 0, True),
]


@pytest.mark.parametrize("n,window,stride,padding,use_ceil", POOL_CASES)
def test_pools_match_torch(n, window, stride, padding, use_ceil):
    x = _input(n, seed=n)
    names = SPATIAL[n]
    win = dict(zip(names, window if isinstance(window, tuple) else (window,) * n))
    xt = _torch(x, n)
    got = nn.max_pool(x, win, stride, padding, use_ceil)
    assert got.names == x.names
    want = TORCH_MAX[n](xt, window, stride, padding, ceil_mode=use_ceil)
    np.testing.assert_array_equal(_ours(got, n), want.numpy())
    got = nn.min_pool(x, win, stride, padding, use_ceil)
    np.testing.assert_array_equal(
        _ours(got, n), -TORCH_MAX[n](-xt, window, stride, padding, ceil_mode=use_ceil).numpy()
    )
    for include in (True, False):
        got = nn.mean_pool(x, win, stride, padding, use_ceil, count_include_pad=include)
        want = TORCH_AVG[n](xt, window, stride, padding, ceil_mode=use_ceil, count_include_pad=include)
        np.testing.assert_allclose(_ours(got, n), want.numpy(), atol=1e-6)


@pytest.mark.parametrize("n,window,stride,padding,use_ceil", POOL_CASES[:2] + POOL_CASES[3:4])
def test_pool_gradients_under_jit_match_torch(n, window, stride, padding, use_ceil):
    """``jax.jit(jax.grad(...))`` of each pool, against torch's backward (it once failed to linearize)."""
    x = _input(n, seed=n + 10)
    win = dict(zip(SPATIAL[n], window if isinstance(window, tuple) else (window,) * n))
    ct = randn(nn.max_pool(x, win, stride, padding, use_ceil).axes, seed=n + 20)  # the output's cotangent
    pools = {
        "max": (
            lambda v: nn.max_pool(v, win, stride, padding, use_ceil),
            lambda t: TORCH_MAX[n](t, window, stride, padding, ceil_mode=use_ceil),
        ),
        "min": (
            lambda v: nn.min_pool(v, win, stride, padding, use_ceil),
            lambda t: -TORCH_MAX[n](-t, window, stride, padding, ceil_mode=use_ceil),
        ),
        "mean": (
            lambda v: nn.mean_pool(v, win, stride, padding, use_ceil, count_include_pad=False),
            lambda t: TORCH_AVG[n](t, window, stride, padding, ceil_mode=use_ceil, count_include_pad=False),
        ),
    }
    for name, (ours, theirs) in pools.items():
        got = jax.jit(jax.grad(lambda v: (ours(v) * ct).sum().scalar()))(x)
        xt = _torch(x, n).requires_grad_(True)
        (theirs(xt) * _torch(ct, n)).sum().backward()
        np.testing.assert_allclose(_ours(got, n), xt.grad.numpy(), atol=1e-6, err_msg=name)


def _numpy_pool(v, window, stride, pads, fill, reduce):
    """Sliding windows over the last two axes of ``v`` in numpy; ``count`` averages over the real entries."""
    padded = np.pad(v, [(0, 0)] * (v.ndim - 2) + list(pads), constant_values=fill)
    win = np.lib.stride_tricks.sliding_window_view(padded, window, axis=(-2, -1))[..., :: stride[0], :: stride[1], :, :]
    if reduce == "count":
        real = np.pad(np.ones(v.shape[-2:]), pads)
        real = np.lib.stride_tricks.sliding_window_view(real, window)[:: stride[0], :: stride[1]]
        return win.sum((-2, -1)) / real.sum((-2, -1))
    return getattr(win, reduce)((-2, -1))


def test_pools_by_name_match_numpy_with_same_and_asymmetric_padding():
    x = _input(2, seed=5)  # (width, height, batch, ch)
    v = np.asarray(x.rearrange(("batch", "ch", "height", "width")).array, np.float64)
    # "SAME" (as jax.lax): out = ceil(size / stride), the odd padding entry at the high end
    got = nn.min_pool(x, (Axis("height", 3), Axis("width", 2)), stride={"width": 2, "height": 2}, padding="SAME")
    assert got.shape == {"width": 3, "height": 4, "batch": 2, "ch": 3}
    want = _numpy_pool(v, (3, 2), (2, 2), [(1, 1), (0, 0)], np.inf, "min")
    np.testing.assert_array_equal(got.rearrange(("batch", "ch", "height", "width")).array, want)
    # asymmetric padding by name, mean over the real entries only
    got = nn.mean_pool(
        x,
        {"height": 3, "width": 3},
        stride=(1, 2),
        padding={"height": (2, 0), "width": (0, 1)},
        count_include_pad=False,
    )
    want = _numpy_pool(v, (3, 3), (1, 2), [(2, 0), (0, 1)], 0.0, "count")
    np.testing.assert_allclose(got.rearrange(("batch", "ch", "height", "width")).array, want, atol=1e-6)


def test_pools_keep_integer_dtypes_and_work_under_jit():
    ids = nm.named(np.arange(2 * 7, dtype=np.int32).reshape(2, 7) % 5, ("batch", "length"))
    got = jax.jit(lambda a: nn.max_pool(a, {"length": 2}, stride=2, padding=(1,)))(ids)
    assert got.dtype == jnp.int32  # integer padding is the dtype's lowest, never picked
    np.testing.assert_array_equal(
        got.array,
        F.max_pool1d(torch.tensor(np.asarray(ids.array))[:, None].float(), 2, 2, 1)[:, 0].numpy().astype(np.int32),
    )
    mean = nn.mean_pool(ids, {"length": 7})
    assert mean.dtype == jnp.float32 and mean.shape == {"batch": 2, "length": 1}
    np.testing.assert_allclose(mean.array[:, 0], np.asarray(ids.array).mean(1))


def test_pool_errors_name_the_axis():
    x = _input(2)
    with pytest.raises(nm.AxisError, match="window axis 'rows'"):
        nn.max_pool(x, {"rows": 2})
    with pytest.raises(nm.ArgumentError, match="window of 8 along axis 'height'"):
        nn.mean_pool(x, {"height": 8})
    with pytest.raises(nm.ArgumentError, match="padding \\(2, 2\\) on axis 'width' must be smaller than its window 2"):
        nn.max_pool(x, {"width": 2}, padding=2)
    with pytest.raises(nm.ArgumentError, match="stride: axis 'width' needs an int >= 1"):
        nn.min_pool(x, {"width": 2}, stride=0)
    with pytest.raises(nm.ArgumentTypeError, match="pool\\(x, Window\\)"):
        nn.max_pool({"width": 2}, x)  # Haliax's argument order
    with pytest.raises(nm.ArgumentError, match="padding='full'"):
        nn.max_pool(x, {"width": 2}, padding="full")


# ---- MLP of any depth ----------------------------------------------------------------------------

In, Out = Axis("features", 5), Axis("classes", 3)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_deep_mlp_matches_equinox(depth):
    m = nn.MLP.init(In, Out, 8, depth, "relu", key=jax.random.key(depth), use_final_bias=False)
    hidden = [nm.axis_spec_to_tuple(l.Out)[0].name for l in m.layers[:-1]]
    assert hidden == ["mlp", "mlp2", "mlp"][:depth]  # alternating, so no Linear maps an axis to itself
    assert len(m.layers) == depth + 1 and m.layers[-1].bias is None
    ref = eqx.nn.MLP(In.size, Out.size, 8, depth, activation=jax.nn.relu, use_final_bias=False, key=jax.random.key(0))
    for i, lin in enumerate(m.layers):  # our weights into equinox's (out, in) layout
        ref = eqx.tree_at(lambda r: r.layers[i].weight, ref, lin.weight.array.T)
        if lin.bias is not None:
            ref = eqx.tree_at(lambda r: r.layers[i].bias, ref, lin.bias.array)
    x = randn((Batch, In), seed=1)
    y = eqx.filter_jit(lambda mm, a: mm(a))(m, x)
    assert y.axes == (Batch, Out)
    np.testing.assert_allclose(y.array, jax.vmap(ref)(x.array), atol=1e-5)


def test_mlp_forms_and_their_errors():
    Embed, Width = Axis("embed", 4), Axis("hidden", 6)
    Mlp = Axis("mlp", 6)
    legacy = nn.MLP.init(Embed, Mlp, key=jax.random.key(0))
    same = nn.MLP.init(Embed, Embed, Mlp, 1, key=jax.random.key(0))
    # the two-axis (Transformer) form draws its weights as it always has (up, down from the first
    # two of three keys), and is the depth-1 form with Out = In, weight for weight
    k_up, k_down, _ = jax.random.split(jax.random.key(0), 3)
    old = (nn.Linear.init(Embed, Mlp, key=k_up), nn.Linear.init(Mlp, Embed, key=k_down))
    for m in (legacy, same):
        assert m.hidden == () and m.gate is None
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), (m.up, m.down), old))
    m = nn.MLP.init(Embed, Embed, Width, 2, activation=nn.relu_squared, key=jax.random.key(1))  # a callable activation
    x = randn((Batch, Embed), seed=2)
    h = np.asarray(x.array, np.float64)
    for i, lin in enumerate(m.layers):
        h = h @ np.asarray(lin.weight.array) + np.asarray(lin.bias.array)
        h = np.maximum(h, 0) ** 2 if i < len(m.layers) - 1 else h
    np.testing.assert_allclose(m(x).array, h, atol=1e-5)
    with pytest.raises(nm.ArgumentError, match="needs width="):
        nn.MLP.init(Embed, Embed, depth=2, key=jax.random.key(0))
    with pytest.raises(nm.ArgumentError, match="gated=True .* depth=2"):
        nn.MLP.init(Embed, Embed, 6, 2, gated=True, key=jax.random.key(0))
    with pytest.raises(nm.ArgumentError, match="depth must be an int >= 0"):
        nn.MLP.init(Embed, Embed, 6, -1, key=jax.random.key(0))
    with pytest.raises(nm.AxisError, match="hidden axis 'mlp2'"):
        nn.MLP.init(Axis("mlp2", 3), Embed, 6, 2, key=jax.random.key(0))
    with pytest.raises(nm.NamedError, match="unknown activation 'nope'"):
        nn.MLP.init(Embed, Embed, 6, 2, "nope", key=jax.random.key(0))


# ---- activations ---------------------------------------------------------------------------------

MORE_ACTIVATIONS = {  # name -> torch reference (torch's defaults are jax.nn's: slope 0.01, alpha 1)
    "relu6": F.relu6,
    "relu_squared": lambda t: F.relu(t) ** 2,
    "relu2": lambda t: F.relu(t) ** 2,
    "leaky_relu": F.leaky_relu,
    "elu": F.elu,
    "celu": F.celu,
    "selu": F.selu,
    "mish": F.mish,
    "log_sigmoid": F.logsigmoid,
    "softplus": F.softplus,
    "soft_sign": F.softsign,
    "hard_sigmoid": F.hardsigmoid,
    "hard_silu": F.hardswish,
    "hard_swish": F.hardswish,
    "hard_tanh": F.hardtanh,
    "linear": lambda t: t,
    "identity": lambda t: t,
}


def test_every_new_activation_matches_torch():
    # together with test_nn_layers' table, every name nn.activation knows has a reference
    assert set(nn.ACTIVATIONS) == set(REFERENCE_ACTIVATIONS) | set(MORE_ACTIVATIONS)
    x = randn((Batch, Axis("embed", 16)), seed=3, scale=4.0)
    ours = jax.jit(lambda a: {name: nn.activation(name)(a) for name in MORE_ACTIVATIONS})(x)
    xt = torch.tensor(np.asarray(x.array))
    for name, ref in MORE_ACTIVATIONS.items():
        np.testing.assert_allclose(ours[name].array, ref(xt).numpy(), atol=1e-6, rtol=1e-5, err_msg=name)
    # the functions by name are the table's, and Haliax's spellings exist
    for name in (
        "selu",
        "celu",
        "hard_sigmoid",
        "hard_silu",
        "hard_swish",
        "hard_tanh",
        "relu_squared",
        "mish",
        "soft_sign",
        "quick_gelu",
        "relu",
        "gelu",
        "silu",
        "swish",
        "sigmoid",
        "softplus",
        "log_sigmoid",
    ):
        fn = getattr(nn, name)
        np.testing.assert_allclose(fn(x).array, nn.activation(name)(x).array, err_msg=name)
    assert nn.activation(nn.selu) is nn.selu


def test_glu_splits_a_named_axis_like_torch():
    x = randn((Axis("feature", 6), Batch, Axis("position", 3)), seed=4)
    y = nn.glu(x, "feature")
    assert y.axes == (Axis("feature", 3), Batch, Axis("position", 3))
    np.testing.assert_allclose(y.array, F.glu(torch.tensor(np.asarray(x.array)), dim=0).numpy(), atol=1e-6)
    np.testing.assert_allclose(y.array, jax.nn.glu(x.array, axis=0), atol=1e-6)
    with pytest.raises(nm.ArgumentError, match="'position'.*odd"):
        nn.glu(x, "position")
    with pytest.raises(nm.AxisError, match="'hidden'"):
        nn.glu(x, "hidden")


# ---- losses --------------------------------------------------------------------------------------

Label = Axis("label", 5)


def _t(x, order):
    return torch.tensor(np.asarray(x.rearrange(order).array))


def test_binary_cross_entropy_matches_torch():
    logits = randn((Batch, Axis("position", 3), Label), seed=5, scale=60.0)
    assert np.abs(logits.array).max() > 100  # exp(-x) of a naive form overflows float32 past 88
    targets = nm.named(
        np.random.default_rng(6).uniform(size=(5, 2, 3)).astype(np.float32), ("label", "batch", "position")
    )
    pos = nm.named(np.linspace(0.5, 3.0, 5).astype(np.float32), "label")
    order = ("batch", "position", "label")
    lt, tt = _t(logits, order).requires_grad_(), _t(targets, order)
    for reduction in ("none", "mean", "sum"):
        for pw, pw_t in ((None, None), (pos, torch.tensor(np.asarray(pos.array))), (2.5, torch.tensor(2.5))):
            got = nn.binary_cross_entropy_loss(logits, targets, pos_weight=pw, reduction=reduction)
            want = F.binary_cross_entropy_with_logits(lt, tt, pos_weight=pw_t, reduction=reduction)
            assert np.all(np.isfinite(got.array))
            np.testing.assert_allclose(
                got.rearrange(order).array if reduction == "none" else got.array,
                want.detach().numpy(),
                rtol=1e-5,
                atol=1e-5,
            )
    g = jax.grad(lambda a: nn.binary_cross_entropy_loss(a, targets, pos_weight=pos).scalar())(logits)
    F.binary_cross_entropy_with_logits(lt, tt, pos_weight=torch.tensor(np.asarray(pos.array))).backward()
    np.testing.assert_allclose(g.rearrange(order).array, lt.grad.numpy(), rtol=1e-5, atol=1e-7)
    # where=: masked entries neither contribute nor count
    mask = nm.named(np.array([[1, 1, 0], [0, 1, 1]], bool), ("batch", "position"))
    got = nn.binary_cross_entropy_loss(logits, targets, where=mask)
    per = F.binary_cross_entropy_with_logits(lt, tt, reduction="none").detach().numpy()
    m = np.asarray(mask.array)[:, :, None] * np.ones(5)
    np.testing.assert_allclose(got.array, (per * m).sum() / m.sum(), rtol=1e-5)


def test_soft_target_cross_entropy_and_label_smoothing_match_torch():
    logits = randn((Batch, Axis("position", 3), Label), seed=7, scale=3.0)
    probs = nm.softmax(randn((Label, Batch, Axis("position", 3)), seed=8), "label")  # another axis order
    ids = nm.named(np.array([[0, 4, 2], [1, 3, 3]], np.int32), ("batch", "position"))
    lt = torch.tensor(np.asarray(logits.rearrange(("batch", "label", "position")).array))  # torch's class dim is 1
    pt = torch.tensor(np.asarray(probs.rearrange(("batch", "label", "position")).array))
    it = torch.tensor(np.asarray(ids.array)).long()
    for eps in (0.0, 0.2):
        for reduction in ("none", "mean"):
            got = nn.cross_entropy_loss(logits, probs, axis="label", label_smoothing=eps, reduction=reduction)
            want = F.cross_entropy(lt, pt, label_smoothing=eps, reduction=reduction).numpy()
            np.testing.assert_allclose(got.array, want, rtol=1e-5, atol=1e-6)
            got = nn.cross_entropy_loss(logits, ids, axis="label", label_smoothing=eps, reduction=reduction)
            want = F.cross_entropy(lt, it, label_smoothing=eps, reduction=reduction).numpy()
            np.testing.assert_allclose(got.array, want, rtol=1e-5, atol=1e-6)
    # one-hot probabilities are the ids; the z-loss is added to both alike
    one_hot = nm.one_hot(ids, Label)
    for z in (0.0, 1e-2):
        np.testing.assert_allclose(
            nn.cross_entropy_loss(logits, one_hot, axis="label", z_loss_weight=z).array,
            nn.cross_entropy_loss(logits, ids, axis="label", z_loss_weight=z).array,
            rtol=1e-6,
        )
    # next-token loss with smoothing: torch's on the shifted ids
    V, P = Axis("vocab", 7), Axis("position", 4)
    lg = randn((Batch, P, V), seed=9)
    tok = nm.named(np.random.default_rng(10).integers(0, 7, (2, 4)).astype(np.int32), ("batch", "position"))
    got = nn.next_token_loss(lg, tok, label_smoothing=0.1)
    want = F.cross_entropy(
        torch.tensor(np.asarray(lg.array))[:, :-1].reshape(-1, 7),
        torch.tensor(np.asarray(tok.array))[:, 1:].reshape(-1).long(),
        label_smoothing=0.1,
    )
    np.testing.assert_allclose(got.array, want.numpy(), rtol=1e-5)


def test_loss_errors_name_the_culprit():
    logits = randn((Batch, Label), seed=11)
    with pytest.raises(nm.AxisError, match="'label' is in only one"):
        nn.binary_cross_entropy_loss(logits, randn((Batch,), seed=1))
    with pytest.raises(nm.AxisError, match="targets axis label=4"):
        nn.binary_cross_entropy_loss(logits, randn((Batch, Label.resize(4)), seed=1))
    with pytest.raises(nm.AxisError, match="pos_weight axis other=2"):
        nn.binary_cross_entropy_loss(logits, logits, pos_weight=randn((Axis("other", 2),), seed=1))
    with pytest.raises(nm.ArgumentError, match="'mean', 'sum', 'none'"):
        nn.binary_cross_entropy_loss(logits, logits, reduction="avg")
    with pytest.raises(nm.ArgumentError, match="label_smoothing=1.5"):
        nn.cross_entropy_loss(logits, nm.named(np.zeros(2, np.int32), "batch"), axis="label", label_smoothing=1.5)
    with pytest.raises(nm.ArgumentTypeError, match="float probabilities over the vocab axis 'label'"):
        nn.cross_entropy_loss(logits, randn((Batch,), seed=1), axis="label")
    with pytest.raises(nm.AxisError, match="targets axis extra=3"):
        nn.cross_entropy_loss(logits, randn((Batch, Label, Axis("extra", 3)), seed=1), axis="label")
