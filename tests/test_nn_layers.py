"""Linear, Embedding, LayerNorm, RMSNorm, Dropout, activations and MLP against independent
references (equinox, plain jnp/numpy), in float32 and bf16, and under FSDP and TP mappings."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nn_util import MAPPINGS, assert_follows_mapping, close, jcall, run_sharded, traced_constraints

import named as nm
from named import nn

Batch, Pos, Embed, Mlp = nm.Axis("batch", 8), nm.Axis("position", 4), nm.Axis("embed", 16), nm.Axis("mlp", 24)
Heads, HeadSize, Qkv = nm.Axis("heads", 2), nm.Axis("head_size", 8), nm.Axis("qkv", 3)
Vocab = nm.Axis("vocab", 40)


def keys(n, seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), n)


def randn(axes, seed=1, dtype=jnp.float32):
    # numpy draws: every new shape drawn with jax.random would compile its own threefry program
    axes = (axes,) if isinstance(axes, nm.Axis) else tuple(axes)
    v = np.random.default_rng(seed).standard_normal([a.size for a in axes]).astype(np.float32)
    return nm.named(jnp.asarray(v, dtype), axes)


def randint(axes, high, seed=3):
    return nm.named(jnp.asarray(np.random.default_rng(seed).integers(0, high, [a.size for a in axes]), jnp.int32), axes)


# ---- Linear --------------------------------------------------------------------------------


@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_matches_eqx_linear(use_bias):
    lin = nn.Linear.init(Embed, Mlp, key=keys(1)[0], use_bias=use_bias)
    if use_bias:  # a non-zero bias, so that adding it is tested
        lin = eqx.tree_at(lambda m: m.bias, lin, randn(Mlp, seed=7))
    ref = eqx.nn.Linear(Embed.size, Mlp.size, use_bias=use_bias, key=keys(1)[0])
    ref = eqx.tree_at(lambda m: m.weight, ref, lin.weight.rearrange(("mlp", "embed")).array)
    if use_bias:
        ref = eqx.tree_at(lambda m: m.bias, ref, lin.bias.array)
    x = randn((Batch, Pos, Embed))
    y = jcall(lin, x)
    assert y.axes == (Batch, Pos, Mlp)
    want = jcall(lambda r, a: jax.vmap(jax.vmap(r))(a), ref, x.array)
    close(y.array, want)


def test_linear_multi_axis_in_and_out_is_a_reshaped_matmul():
    # Out = (qkv, heads, head_size) as in a fused attention projection, and back.
    # built from their fields (init is tested above; each new weight shape costs a compile)
    up = nn.Linear(
        randn((Embed, Qkv, Heads, HeadSize), seed=2),
        randn((Qkv, Heads, HeadSize), seed=3),
        (Embed,),
        (Qkv, Heads, HeadSize),
    )
    down = nn.Linear(randn((Heads, HeadSize, Embed), seed=5), randn(Embed, seed=4), (Heads, HeadSize), (Embed,))
    x = randn((Batch, Pos, Embed))
    h = jcall(up, x)
    assert h.axes == (Batch, Pos, Qkv, Heads, HeadSize)
    w_up = np.asarray(up.weight.array).reshape(Embed.size, -1)
    want_h = np.asarray(x.array) @ w_up + np.asarray(up.bias.array).reshape(-1)
    close(h.array.reshape(Batch.size, Pos.size, -1), want_h)

    q = h["qkv", 0]
    y = jcall(down, q)
    assert y.axes == (Batch, Pos, Embed)
    w_down = np.asarray(down.weight.rearrange(("heads", "head_size", "embed")).array).reshape(-1, Embed.size)
    want_y = (
        np.asarray(q.rearrange(("batch", "position", "heads", "head_size")).array).reshape(Batch.size, Pos.size, -1)
        @ w_down
    )
    close(y.array, want_y + np.asarray(down.bias.array))


def test_linear_init_std_and_per_key():
    Big = nm.Axis("big", 512)
    lin = nn.Linear.init(Big, nm.Axis("out", 256), key=keys(1)[0], init_scale=0.5)
    w = np.asarray(lin.weight.array)
    want_std = 0.5 / math.sqrt(512)
    assert abs(w.std() / want_std - 1) < 0.02
    assert np.abs(w).max() <= 2 * want_std / 0.8796 * (1 + 1e-6)  # truncated at two (pre-scale) sigmas
    assert np.all(np.asarray(lin.bias.array) == 0)
    other = nn.Linear.init(Big, nm.Axis("out", 256), key=keys(2)[1], init_scale=0.5)
    assert not np.allclose(w, np.asarray(other.weight.array))


def test_linear_errors_name_the_axes():
    with pytest.raises(nm.AxisError, match="both input and output"):
        nn.Linear.init(Embed, Embed, key=keys(1)[0])
    lin = nn.Linear.init(Embed, Mlp, key=keys(1)[0])
    with pytest.raises(nm.AxisError, match=r"\['embed'\] missing"):
        lin(randn((Batch, Mlp)))
    # an output name already on the input would be silently matched elementwise
    with pytest.raises(nm.AxisError, match="already has"):
        lin(randn((Batch, Embed, Mlp)))
    with pytest.raises(nm.AxisError, match="Axis objects with sizes"):
        nn.Linear.init("embed", Mlp, key=keys(1)[0])


def test_linear_in_and_out_keep_the_callers_spelling():
    # Haliax's layer.Out.size: one Axis stays an Axis, several a tuple; the numbers do not change
    one = nn.Linear.init(Embed, Mlp, key=keys(1)[0])
    assert one.In == Embed and one.Out == Mlp and one.Out.size == 24
    many = nn.Linear(one.weight, one.bias, (Embed,), (Mlp,))
    assert many.Out == (Mlp,) and nm.axis_spec_to_tuple(one.Out) == many.Out
    x = randn((Batch, Embed))
    want = np.asarray(x.array) @ np.asarray(one.weight.array) + np.asarray(one.bias.array)
    close(one(x).array, want)
    close(many(x).array, want)


# ---- Embedding -------------------------------------------------------------------------------


def test_embedding_lookup_and_tied_unembed_match_jnp():
    emb = nn.Embedding.init(Vocab, Embed, key=keys(1)[0])
    ids = randint((Batch, Pos), Vocab.size)
    x = jcall(emb, ids)
    assert x.axes == (Batch, Pos, Embed)
    w = np.asarray(emb.weight.array)
    close(x.array, w[np.asarray(ids.array)])
    logits = jcall(lambda m, a: m.unembed(a), emb, x)
    assert logits.axes == (Batch, Pos, Vocab)
    close(logits.array, np.einsum("bpe,ve->bpv", np.asarray(x.array), w), tol=1e-5)
    assert abs(w.std() - 0.02) < 0.003
    with pytest.raises(nm.AxisError, match="integer token ids"):
        emb(ids.astype(jnp.float32))


# ---- norms -------------------------------------------------------------------------------------


def test_layernorm_matches_eqx_layernorm():
    ln = nn.LayerNorm.init(Embed, eps=1e-5)
    ln = eqx.tree_at(lambda m: (m.weight, m.bias), ln, (randn(Embed, seed=5), randn(Embed, seed=6)))
    ref = eqx.nn.LayerNorm(Embed.size, eps=1e-5)
    ref = eqx.tree_at(lambda m: (m.weight, m.bias), ref, (ln.weight.array, ln.bias.array))
    x = randn((Batch, Pos, Embed)) * 3 + 1
    y = jcall(ln, x)
    assert y.axes == x.axes
    close(y.array, jcall(lambda r, a: jax.vmap(jax.vmap(r))(a), ref, x.array))
    # no weight / bias: plain standardisation
    bare = nn.LayerNorm.init(Embed, use_weight=False, use_bias=False)
    assert bare.weight is None and bare.bias is None
    ref = eqx.nn.LayerNorm(Embed.size, use_weight=False, use_bias=False)
    close(jcall(bare, x).array, jcall(lambda r, a: jax.vmap(jax.vmap(r))(a), ref, x.array))


def test_layernorm_over_a_non_last_axis():
    ln = nn.LayerNorm.init(Embed)
    x = randn((Batch, Embed, Pos))
    ref = np.asarray(x.array)
    m, v = ref.mean(1, keepdims=True), ref.var(1, keepdims=True)
    close(jcall(ln, x).array, (ref - m) / np.sqrt(v + 1e-5))


def rms_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def test_rmsnorm_matches_formula():
    rms = nn.RMSNorm.init(Embed, eps=1e-6)
    rms = eqx.tree_at(lambda m: m.weight, rms, randn(Embed, seed=5))
    x = randn((Batch, Pos, Embed)) * 2
    close(jcall(rms, x).array, rms_reference(np.asarray(x.array), np.asarray(rms.weight.array), 1e-6))
    assert nn.RMSNorm.init(Embed, use_weight=False).weight is None


def test_rmsnorm_over_several_axes_and_with_a_unit_offset():
    # OLMo 2 normalises the whole q/k projection (heads, head_size); Gemma scales by (1 + w), w from 0
    x = randn((Batch, Pos, Heads, HeadSize)) * 2
    shape = np.asarray(x.array).shape
    flat = np.asarray(x.array).reshape(Batch.size, Pos.size, -1)
    w = randn((Heads, HeadSize), seed=5)
    rms = eqx.tree_at(lambda m: m.weight, nn.RMSNorm.init((Heads, HeadSize), eps=1e-5), w)
    close(jcall(rms, x).array, rms_reference(flat, np.asarray(w.array).reshape(-1), 1e-5).reshape(shape))
    gemma = nn.RMSNorm.init((Heads, HeadSize), eps=1e-5, unit_offset=True)
    assert np.all(np.asarray(gemma.weight.array) == 0)  # (1 + 0): the identity scale at init
    gemma = eqx.tree_at(lambda m: m.weight, gemma, w)
    close(jcall(gemma, x).array, rms_reference(flat, 1.0 + np.asarray(w.array).reshape(-1), 1e-5).reshape(shape))
    with pytest.raises(nm.ArgumentError, match="unit_offset"):
        nn.RMSNorm.init(Embed, unit_offset=True, use_weight=False)


def _reduce_input_dtypes(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return {str(e.invars[0].aval.dtype) for e in jaxpr.jaxpr.eqns if e.primitive.name.startswith("reduce_")}


def test_norm_statistics_are_float32_under_bf16():
    # Activations with a large common offset: bf16 statistics lose the signal entirely.
    x32 = randn((Batch, Pos, Embed)) + 30.0
    x16 = x32.astype(jnp.bfloat16)
    xin = np.asarray(x16.array, np.float64)  # the exact bf16 input values
    ln = nn.LayerNorm.init(Embed)
    ours = jcall(ln, x16)
    assert ours.dtype == jnp.bfloat16
    ref = (xin - xin.mean(-1, keepdims=True)) / np.sqrt(xin.var(-1, keepdims=True) + 1e-5)
    err = np.abs(np.asarray(ours.array, np.float64) - ref).max()

    def naive_bf16(a):  # the same formula with every intermediate in bf16
        m = jnp.mean(a, -1, keepdims=True, dtype=jnp.bfloat16)
        d = a - m
        v = jnp.mean(d * d, -1, keepdims=True, dtype=jnp.bfloat16)
        return d * jax.lax.rsqrt(v + jnp.bfloat16(1e-5))

    naive_err = np.abs(np.asarray(jax.jit(naive_bf16)(x16.array), np.float64) - ref).max()
    assert err <= 2**-8 * np.abs(ref).max()  # one bf16 rounding of the output
    assert err * 8 < naive_err, (err, naive_err)
    assert _reduce_input_dtypes(lambda a: ln(a), x16) == {"float32"}

    rms = nn.RMSNorm.init(Embed)
    ref = rms_reference(xin, 1.0, 1e-6)
    err = np.abs(np.asarray(jcall(rms, x16).array, np.float64) - ref).max()
    assert err <= 2**-8 * np.abs(ref).max()
    assert rms(x16).dtype == jnp.bfloat16
    assert _reduce_input_dtypes(lambda a: rms(a), x16) == {"float32"}


# ---- Dropout -------------------------------------------------------------------------------------


def test_dropout_needs_a_key_when_active_and_passes_through_otherwise():
    x = randn((Batch, Pos, Embed))
    d = nn.Dropout(0.5)
    with pytest.raises(nm.NamedError, match="needs key="):
        d(x)
    assert d(x, inference=True) is x
    assert nn.Dropout(0.0)(x) is x
    with pytest.raises(nm.NamedError, match=r"pdrop must be in \[0, 1\]"):
        nn.Dropout(1.5)
    assert np.all(np.asarray(nn.Dropout(1.0)(x, key=keys(1)[0]).array) == 0)
    g = jax.grad(lambda a: nn.Dropout(1.0)(a, key=keys(1)[0]).sum().scalar())(x)
    assert np.all(np.isfinite(np.asarray(g.array)))


def test_dropout_keep_rate_and_scaling():
    Big = nm.Axis("big", 200_000)
    x = nm.ones(Big) * 2.0
    p = 0.3
    y = np.asarray(nn.Dropout(p)(x, key=keys(1)[0]).array)
    kept = y != 0
    # 200k Bernoulli(0.7) draws: the kept fraction's std is ~0.001
    assert abs(kept.mean() - (1 - p)) < 0.005
    np.testing.assert_allclose(y[kept], 2.0 / (1 - p), rtol=1e-6)
    assert abs(y.mean() - 2.0) < 0.02  # the expectation is preserved
    y2 = np.asarray(nn.Dropout(p)(x, key=keys(2)[1]).array)
    assert (y2 != 0).mean() != kept.mean() or not np.array_equal(y2 != 0, kept)
    # bf16 stays bf16
    assert nn.Dropout(p)(x.astype(jnp.bfloat16), key=keys(1)[0]).dtype == jnp.bfloat16


# ---- activations and MLP -------------------------------------------------------------------------


def _erf(v):
    return np.vectorize(math.erf)(v)


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


REFERENCE_ACTIVATIONS = {
    "gelu": lambda v: 0.5 * v * (1 + _erf(v / math.sqrt(2))),
    "gelu_new": lambda v: 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))),
    "silu": lambda v: v * _sigmoid(v),
    "relu": lambda v: np.maximum(v, 0),
    "quick_gelu": lambda v: v * _sigmoid(1.702 * v),
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
}
REFERENCE_ACTIVATIONS["gelu_tanh"] = REFERENCE_ACTIVATIONS["gelu_pytorch_tanh"] = REFERENCE_ACTIVATIONS["gelu_new"]
REFERENCE_ACTIVATIONS["swish"] = REFERENCE_ACTIVATIONS["silu"]


def test_every_activation_matches_its_formula():
    assert set(REFERENCE_ACTIVATIONS) <= set(nn.ACTIVATIONS)  # the others: tests/test_nn_layers_more.py
    x = randn((Batch, Embed)) * 3
    v = np.asarray(x.array, np.float64)
    ours = jcall(lambda a: {name: nn.activation(name)(a) for name in REFERENCE_ACTIVATIONS}, x)
    for name, ref in REFERENCE_ACTIVATIONS.items():
        close(ours[name].array, ref(v))
    # exact and tanh GELU are different functions, and each is jax.nn's
    exact, approx = ours["gelu"].array, ours["gelu_new"].array
    assert np.abs(np.asarray(exact - approx)).max() > 1e-4
    close(exact, jax.nn.gelu(x.array, approximate=False))
    close(approx, jax.nn.gelu(x.array, approximate=True))
    with pytest.raises(nm.NamedError, match="unknown activation 'gleu'"):
        nn.activation("gleu")


def mlp_reference(m: nn.MLP, x: np.ndarray, act) -> np.ndarray:
    def lin(layer, a):
        w = np.asarray(layer.weight.array, np.float64)
        return a @ w + (np.asarray(layer.bias.array) if layer.bias is not None else 0)

    h = act(lin(m.gate, x)) * lin(m.up, x) if m.gate is not None else act(lin(m.up, x))
    return lin(m.down, h)


@pytest.mark.parametrize("gated,act", [(False, "gelu_new"), (True, "silu")])
@pytest.mark.parametrize("use_bias", [True, False])
def test_mlp_matches_plain_reference(gated, act, use_bias):
    m = nn.MLP.init(Embed, Mlp, key=keys(1)[0], activation=act, gated=gated, use_bias=use_bias)
    assert (m.gate is not None) == gated
    if use_bias:
        m = eqx.tree_at(lambda t: (t.up.bias, t.down.bias), m, (randn(Mlp, seed=8), randn(Embed, seed=9)))
    x = randn((Batch, Pos, Embed))
    y = jcall(m, x)
    assert y.axes == x.axes
    close(y.array, mlp_reference(m, np.asarray(x.array, np.float64), REFERENCE_ACTIVATIONS[act]))


def test_mlp_init_errors():
    with pytest.raises(nm.AxisError, match="own name"):
        nn.MLP.init(Embed, Embed, key=keys(1)[0])
    with pytest.raises(nm.NamedError, match="unknown activation"):
        nn.MLP.init(Embed, Mlp, key=keys(1)[0], activation="nope")


# ---- sharding: every module under FSDP and TP ------------------------------------------------------


def _modules():
    k = keys(4, seed=11)
    x = randn((Batch, Pos, Embed), seed=12)
    ids = randint((Batch, Pos), Vocab.size, seed=13)
    ln = nn.LayerNorm.init(Embed)
    ln = eqx.tree_at(lambda m: (m.weight, m.bias), ln, (randn(Embed, seed=5), randn(Embed, seed=6)))
    # (name, params, call, input, does the layer itself constrain its output?)
    return [
        ("linear", nn.Linear.init(Embed, Mlp, key=k[0]), lambda m, a: m(a), x, True),
        ("linear_heads", nn.Linear.init(Embed, (Heads, HeadSize), key=k[1]), lambda m, a: m(a), x, True),
        ("embedding", nn.Embedding.init(Vocab, Embed, key=k[2]), lambda m, a: m(a), ids, True),
        ("unembed", nn.Embedding.init(Vocab, Embed, key=k[2]), lambda m, a: m.unembed(a), x, True),
        ("layernorm", ln, lambda m, a: m(a), x, False),
        ("rmsnorm", nn.RMSNorm.init(Embed), lambda m, a: m(a), x, False),
        ("mlp", nn.MLP.init(Embed, Mlp, key=k[3], gated=True, activation="silu"), lambda m, a: m(a), x, True),
        ("dropout", nn.Dropout(0.25), lambda m, a: m(a, key=jax.random.PRNGKey(3)), x, False),
    ]


@pytest.mark.parametrize("mapping", sorted(MAPPINGS))
def test_modules_under_mappings_follow_the_mapping_and_match_unsharded(mapping):
    modules = _modules()
    params = {name: p for name, p, *_ in modules}
    inputs = {name: inp for name, _, _, inp, _ in modules}
    calls = {name: call for name, _, call, _, _ in modules}

    def run_all(params, inputs):  # one program for all modules
        return {name: call(params[name], inputs[name]) for name, call in calls.items()}

    want = jcall(run_all, params, inputs)
    out, mesh, compute = run_sharded(run_all, params, inputs, mapping=mapping)
    for name, p, call, inp, constrained in modules:
        assert out[name].axes == want[name].axes, name
        close(out[name].array, want[name].array)
        constraints = traced_constraints(call, p, inp, mesh=mesh, compute=compute) if constrained else None
        assert_follows_mapping(out[name], mesh, compute, constraints)
    # the parameter mapping really shards the weights (embed over data)
    _, param_map, _ = MAPPINGS[mapping]
    lin = nm.shard(params["linear"], param_map, mesh)
    assert lin.weight.array.sharding.spec[0] == "data"


def test_mlp_hidden_activation_is_sharded_over_model_under_tp():
    m = nn.MLP.init(Embed, Mlp, key=keys(1)[0])
    x = randn((Batch, Pos, Embed))
    mesh_shape, _, compute = MAPPINGS["tp"]
    constraints = traced_constraints(lambda p, a: p(a), m, x, mesh=nm.make_mesh(mesh_shape), compute=compute)
    hidden = ((Batch.size, Pos.size, Mlp.size), ("data", None, "model"))
    assert hidden in constraints, constraints
