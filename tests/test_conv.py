"""nn.Conv and nn.ConvTranspose against torch.nn.functional's conv{1,2,3}d and conv_transpose{1,2}d
(groups, dilation, stride, padding, output_padding), as the transpose of each other, under jit and
with a sharded batch axis; bad arguments raise our errors naming the culprit."""

import equinox as eqx
import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import named as nm
from named import Axis, nn

Batch, Extra = Axis("batch", 2), Axis("extra", 2)
Cin, Cout = Axis("cin", 4), Axis("cout", 6)
SPATIAL = {1: ("length",), 2: ("height", "width"), 3: ("depth", "height", "width")}
SIZES = {"length": 9, "depth": 5, "height": 7, "width": 6}


def randn(axes, seed):
    return nm.named(np.random.default_rng(seed).standard_normal([a.size for a in axes]).astype(np.float32), axes)


def _input(n, seed=0, batch=(Batch,)):
    """Channels last and spatial axes reversed: positions never match torch's (N, C, *spatial)."""
    spatial = tuple(Axis(s, SIZES[s]) for s in SPATIAL[n])
    return randn((*spatial[::-1], *batch, Cin), seed)


def _torch_layout(x: nm.NamedArray, n, batch=("batch",), channel="cin"):
    return torch.tensor(np.asarray(x.rearrange((*batch, channel, *SPATIAL[n])).array))


def _torch_padding(padding, n):
    """Our padding as F.pad's argument (last axis first) and what is left for torch's conv."""
    if isinstance(padding, str):
        return None, padding.lower()
    pairs = [p if isinstance(p, tuple) else (p, p) for p in (padding if isinstance(padding, tuple) else (padding,) * n)]
    return [v for p in pairs[::-1] for v in p], 0


TORCH_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}

CONV_CASES = [  # (spatial dims, Conv.init keywords)
    (1, dict(kernel_size=3)),
    (1, dict(kernel_size=4, stride=2, padding=((2, 1),), dilation=2, groups=2)),
    (1, dict(kernel_size=3, padding="SAME", use_bias=False)),
    (2, dict(kernel_size=3, padding=1)),
    (2, dict(kernel_size=(3, 2), stride=(2, 1), padding=((1, 2), 0), dilation=(1, 2), groups=2)),
    (2, dict(kernel_size={"width": 2, "height": 4}, padding="SAME", dilation=2)),
    (2, dict(kernel_size=3, stride=3, padding="VALID", groups=2, use_bias=False)),
    (3, dict(kernel_size=2, stride=(1, 2, 1), padding=(1, 0, (0, 1)), groups=2)),
]


@pytest.mark.parametrize("n,kw", CONV_CASES)
def test_conv_matches_torch(n, kw):
    conv = nn.Conv.init(SPATIAL[n], Cin, Cout, key=jax.random.key(n), **kw)
    assert conv.weight.names == ("cout", "cin", *SPATIAL[n])
    x = _input(n, seed=n)
    y = conv(x)
    # the output keeps the input's axis order, cin replaced by cout
    assert y.names == tuple("cout" if a == "cin" else a for a in x.names)
    xt = _torch_layout(x, n)
    pad, torch_padding = _torch_padding(kw.get("padding", 0), n)
    if pad is not None:
        xt = F.pad(xt, pad)
    weight = torch.tensor(np.asarray(conv.weight.array))
    bias = None if conv.bias is None else torch.tensor(np.asarray(conv.bias.array))
    dilation = kw.get("dilation", 1)
    if isinstance(dilation, dict):
        dilation = tuple(dilation[s] for s in SPATIAL[n])
    ks = kw["kernel_size"]
    assert conv.kernel_size == (tuple(ks[s] for s in SPATIAL[n]) if isinstance(ks, dict) else conv.kernel_size)
    want = TORCH_CONV[n](
        xt,
        weight,
        bias,
        stride=kw.get("stride", 1),
        padding=torch_padding,
        dilation=dilation,
        groups=kw.get("groups", 1),
    )
    got = y.rearrange(("batch", "cout", *SPATIAL[n])).array
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=1e-5)


def test_conv_carries_any_number_of_batch_axes():
    conv = nn.Conv.init("height width", Cin, Cout, kernel_size=3, padding=1, key=jax.random.key(0))
    x = _input(2, batch=(Batch, Extra))  # two batch axes, folded into one and back
    y = conv(x)
    assert y.names == ("width", "height", "batch", "extra", "cout")
    for i in range(Extra.size):
        np.testing.assert_allclose(y["extra", i].array, conv(x["extra", i]).array, atol=1e-6)
    single = conv(x["batch", 0]["extra", 1])  # no batch axis at all
    assert single.names == ("width", "height", "cout")
    np.testing.assert_allclose(single.array, y["batch", 0]["extra", 1].array, atol=1e-6)


def test_conv_in_and_out_may_share_a_name():
    Ch, Ch8 = Axis("channels", 4), Axis("channels", 8)
    conv = nn.Conv.init("length", Ch, Ch8, kernel_size=3, groups=2, key=jax.random.key(0))
    assert conv.weight.axes == (Ch8, Axis("channels_in", 2), Axis("length", 3))
    x = randn((Batch, Ch, Axis("length", 9)), seed=1)
    y = conv(x)
    assert y.axes == (Batch, Ch8, Axis("length", 7))
    want = F.conv1d(
        torch.tensor(np.asarray(x.array)),
        torch.tensor(np.asarray(conv.weight.array)),
        torch.tensor(np.asarray(conv.bias.array)),
        groups=2,
    )
    np.testing.assert_allclose(y.array, want.numpy(), atol=2e-5)


def test_conv_init_is_fan_in_uniform():
    # equinox's and torch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = in/groups * kernel
    conv = nn.Conv.init(
        "height width", Axis("cin", 8), Axis("cout", 64), kernel_size=3, groups=2, key=jax.random.key(3)
    )
    lim = 1 / np.sqrt(4 * 9)
    for w in (np.asarray(conv.weight.array), np.asarray(conv.bias.array)):
        assert np.abs(w).max() <= lim and np.abs(w).max() > 0.9 * lim
    w = np.asarray(conv.weight.array)
    assert abs(w.std() - lim / np.sqrt(3)) < 0.05 * lim
    ref = eqx.nn.Conv2d(8, 64, 3, groups=2, key=jax.random.key(3))  # same bound, so the same spread
    assert abs(float(ref.weight.std()) - w.std()) < 0.05 * lim


TRANSPOSE_CASES = [  # (spatial dims, ConvTranspose.init keywords)
    (1, dict(kernel_size=3)),
    (1, dict(kernel_size=3, stride=2, padding=1, output_padding=1, groups=2)),
    (1, dict(kernel_size=4, stride=3, padding=2, output_padding=2, dilation=2, use_bias=False)),
    (2, dict(kernel_size=3, stride=2, padding=1, output_padding=1)),
    (2, dict(kernel_size=(3, 2), stride=(2, 3), padding=(2, 0), output_padding=(1, 0), dilation=2, groups=2)),
]
TORCH_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d}


@pytest.mark.parametrize("n,kw", TRANSPOSE_CASES)
def test_conv_transpose_matches_torch(n, kw):
    ct = nn.ConvTranspose.init(SPATIAL[n], Cin, Cout, key=jax.random.key(n), **kw)
    assert ct.weight.names == ("cin", "cout", *SPATIAL[n])  # torch's (in, out / groups, *kernel)
    x = _input(n, seed=n + 10)
    y = jax.jit(lambda m, a: m(a))(ct, x)
    bias = None if ct.bias is None else torch.tensor(np.asarray(ct.bias.array))
    want = TORCH_TRANSPOSE[n](
        _torch_layout(x, n),
        torch.tensor(np.asarray(ct.weight.array)),
        bias,
        stride=kw.get("stride", 1),
        padding=kw.get("padding", 0),
        output_padding=kw.get("output_padding", 0),
        groups=kw.get("groups", 1),
        dilation=kw.get("dilation", 1),
    )
    got = y.rearrange(("batch", "cout", *SPATIAL[n])).array
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("padding,stride,kernel", [("SAME", 2, 3), ("SAME", 3, 2), ("VALID", 2, 3)])
def test_conv_transpose_is_the_transpose_of_conv(padding, stride, kernel):
    """ConvTranspose(In -> Out) with weight W is the linear transpose of Conv(Out -> In) with the
    same W; with "SAME" the output is ``stride`` times the input."""
    L = Axis("length", 5)
    ct = nn.ConvTranspose.init(
        "length",
        Cin,
        Cout,
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        groups=2,
        use_bias=False,
        key=jax.random.key(0),
    )
    # the transposed kernel's axes (cin, cout / groups, length) are those of a Conv from cout to cin
    conv = nn.Conv(ct.weight, None, ("length",), Cout, Cin, (kernel,), (stride,), padding, (1,), 2)
    x = randn((Batch, Cin, L), seed=2)
    y = ct(x)
    if padding == "SAME":
        assert y.axis_size("length") == L.size * stride
    probe = randn(y.axes, seed=3)
    (want,) = jax.linear_transpose(lambda v: conv(v), probe)(x)
    np.testing.assert_allclose(y.rearrange(want.axes).array, want.array, atol=2e-5)


def test_conv_gradients_match_torch():
    conv = nn.Conv.init("height width", Cin, Cout, kernel_size=3, stride=2, padding=1, groups=2, key=jax.random.key(7))
    x = _input(2, seed=7)
    r = randn((Batch, Cout, Axis("height", 4), Axis("width", 3)), seed=8)

    def loss(m, a):
        return (m(a) * r).sum().scalar()

    gm, gx = jax.grad(loss, argnums=(0, 1))(conv, x)
    xt = _torch_layout(x, 2).requires_grad_()
    wt = torch.tensor(np.asarray(conv.weight.array), requires_grad=True)
    bt = torch.tensor(np.asarray(conv.bias.array), requires_grad=True)
    rt = torch.tensor(np.asarray(r.rearrange(("batch", "cout", "height", "width")).array))
    (F.conv2d(xt, wt, bt, stride=2, padding=1, groups=2) * rt).sum().backward()
    np.testing.assert_allclose(gm.weight.array, wt.grad.numpy(), atol=2e-5)
    np.testing.assert_allclose(gm.bias.array, bt.grad.numpy(), atol=2e-5)
    np.testing.assert_allclose(gx.rearrange(("batch", "cin", "height", "width")).array, xt.grad.numpy(), atol=2e-5)


def test_conv_with_a_sharded_batch_axis_matches_one_device():
    B8 = Axis("batch", 8)
    conv = nn.Conv.init("height width", Cin, Cout, kernel_size=3, padding="SAME", key=jax.random.key(0))
    ct = nn.ConvTranspose.init("height width", Cout, Cin, kernel_size=2, stride=2, key=jax.random.key(1))
    x = randn((B8, Axis("height", 4), Axis("width", 4), Cin), seed=4)
    mesh, compute = nm.make_mesh({"data": 8}), {"batch": "data"}

    def both(c, t, a):
        return t(c(a))

    want = eqx.filter_jit(both)(conv, ct, x)
    got = nm.named_jit(both, mapping=compute, mesh=mesh)(conv, ct, nm.shard(x, compute, mesh))
    assert got.axes == want.axes == (B8, Axis("height", 8), Axis("width", 8), Cin)
    assert nm.layout(got) == "batch/data height width cin"
    np.testing.assert_allclose(got.array, want.array, atol=1e-5)


def test_bad_arguments_name_the_culprit():
    key = jax.random.key(0)
    conv = nn.Conv.init("height width", Cin, Cout, kernel_size=3, key=key)
    x = _input(2)
    with pytest.raises(nm.AxisError, match="'height'"):
        conv(x.rename({"height": "rows"}))
    with pytest.raises(nm.AxisError, match="'cin'"):
        conv(x.rename({"cin": "channels"}))
    with pytest.raises(nm.AxisError, match="cout"):
        conv(nm.broadcast_axis(x, Axis("cout", 2)))
    with pytest.raises(nm.ArgumentError, match="groups=3 does not divide the 4 channels of axis 'cin'"):
        nn.Conv.init("height", Cin, Cout, kernel_size=3, groups=3, key=key)
    with pytest.raises(nm.ArgumentError, match="groups=4 does not divide the 6 channels of axis 'cout'"):
        nn.ConvTranspose.init("height", Cin, Cout, kernel_size=3, groups=4, key=key)
    big = nn.Conv.init("height width", Cin, Cout, kernel_size=(3, 9), padding=(0, 1), key=key)
    with pytest.raises(nm.ArgumentError, match="axis 'width' is larger than the axis"):
        big(x)
    with pytest.raises(nm.ArgumentError, match="padding='FULL'"):
        nn.Conv.init("height", Cin, Cout, kernel_size=3, padding="FULL", key=key)
    with pytest.raises(nm.ArgumentError, match="kernel_size: axis 'width' needs an int >= 1"):
        nn.Conv.init("height width", Cin, Cout, kernel_size=(3, 0), key=key)
    with pytest.raises(nm.ArgumentError, match="kernel_size: no value for axis 'width'"):
        nn.Conv.init("height width", Cin, Cout, kernel_size={"height": 3}, key=key)
    with pytest.raises(nm.ArgumentError, match="stride"):
        nn.Conv.init("height width", Cin, Cout, kernel_size=3, stride=(1, 2, 3), key=key)
    with pytest.raises(nm.ArgumentError, match="padding of axis 'height'"):
        nn.Conv.init("height", Cin, Cout, kernel_size=3, padding=-1, key=key)
    with pytest.raises(nm.ArgumentError, match="output_padding 2 on axis 'height'"):
        nn.ConvTranspose.init("height", Cin, Cout, kernel_size=3, stride=2, output_padding=2, key=key)
    with pytest.raises(nm.AxisError, match="'cin'"):
        nn.Conv.init("cin width", Cin, Cout, kernel_size=3, key=key)
    with pytest.raises(nm.AxisError, match="In must be an Axis"):
        nn.Conv.init("height", "cin", Cout, kernel_size=3, key=key)
    with pytest.raises(nm.ArgumentTypeError, match="NamedArray"):
        conv(np.zeros((2, 4, 7, 6)))
    tight = nn.ConvTranspose.init("length", Cin, Cout, kernel_size=1, padding=1, key=key)
    with pytest.raises(nm.ArgumentError, match="axis 'length'"):
        tight(randn((Batch, Cin, Axis("length", 1)), seed=0))
