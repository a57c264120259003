"""nm.vmap, nm.scan, nm.fold and nm.nmap against plain loops and numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import axis_subsets, make, sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import named as nm
from named import Axis

Batch, Pos, Embed, Layers = Axis("batch", 3), Axis("position", 4), Axis("embed", 5), Axis("layers", 2)


def _x(*axes, seed=0):
    return nm.random.normal(jax.random.key(seed), axes)


def test_vmap_maps_inputs_with_the_axis_and_shares_the_rest():
    x = _x(Pos, Batch, Embed)
    w = _x(Embed, seed=1)

    def per_example(x, w, scale=1.0):
        assert x.names == ("position", "embed")  # the mapped axis is gone inside
        return nm.dot(x, w, axis="embed") * scale, x.sum()

    y, s = nm.vmap(per_example, "batch")(x, w, scale=2.0)
    assert y.names == ("batch", "position") and s.names == ("batch",)
    want = np.einsum("pbe,e->bp", np.asarray(x.array), np.asarray(w.array)) * 2.0
    np.testing.assert_allclose(np.asarray(y.array), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s.array), np.asarray(x.array).sum(axis=(0, 2)), rtol=1e-5)


def test_vmap_over_several_axes_outermost_first():
    x = _x(Pos, Batch, Embed)
    out = nm.vmap(lambda v: nm.softmax(v, "embed"), ("batch", "position"))(x)
    assert out.names == ("batch", "position", "embed")
    np.testing.assert_allclose(
        np.asarray(out.array), np.asarray(jax.nn.softmax(x.array, axis=-1)).transpose(1, 0, 2), rtol=1e-6
    )
    assert nm.vmap(lambda v: v, "batch position")(x).names == ("batch", "position", "embed")


def test_vmap_over_a_new_axis_given_as_axis():
    Ens = Axis("ensemble", 4)
    w = _x(Embed)
    out = nm.vmap(lambda w: w * 2, Ens)(w)
    assert out.axes == (Ens, Embed)
    np.testing.assert_allclose(np.asarray(out.array), np.broadcast_to(np.asarray(w.array) * 2, (4, 5)))
    # with no inputs at all: each member gets its own key by lax.axis_index over the name
    keys = jax.random.split(jax.random.key(0), 4)
    inits = nm.vmap(lambda k: nm.random.normal(k, (Embed,)), Ens)(nm.named(keys, (Ens,)))
    assert inits.axes == (Ens, Embed)
    idx = nm.vmap(lambda: jax.lax.axis_index("ensemble"), Ens)()
    np.testing.assert_array_equal(np.asarray(idx), [0, 1, 2, 3])


def test_vmap_plain_array_outputs_get_a_leading_dimension_and_statics_pass_through():
    x = _x(Batch, Embed)
    arr, name = nm.vmap(lambda v: (v.array * 0 + 1, "static"), "batch")(x)
    assert arr.shape == (3, 5) and name == "static"


def test_vmap_under_jit_and_grad():
    x = _x(Batch, Embed)
    w = _x(Embed, seed=1)

    def loss(w):
        per = nm.vmap(lambda xb: nm.dot(xb, w, axis="embed") ** 2, "batch")(x)
        return per.sum().scalar()

    g = jax.jit(jax.grad(loss))(w)
    xa, wa = np.asarray(x.array), np.asarray(w.array)
    np.testing.assert_allclose(np.asarray(g.array), 2 * xa.T @ (xa @ wa), rtol=1e-5)


def test_scan_threads_a_carry_and_stacks_outputs():
    xs = _x(Embed, Layers)  # the scanned axis need not be first
    init = nm.zeros((Embed,))

    def step(carry, x):
        carry = carry + x
        return carry, carry * 2

    carry, ys = nm.scan(step, "layers")(init, xs)
    a = np.asarray(xs.array)
    np.testing.assert_allclose(np.asarray(carry.array), a.sum(axis=1), rtol=1e-6)
    assert ys.names == ("layers", "embed")
    np.testing.assert_allclose(np.asarray(ys.array), 2 * np.cumsum(a, axis=1).T, rtol=1e-6)
    carry_r, ys_r = nm.scan(step, "layers", reverse=True)(init, xs)
    np.testing.assert_allclose(np.asarray(ys_r.array), 2 * np.cumsum(a[:, ::-1], axis=1)[:, ::-1].T, rtol=1e-6)


def test_fold_over_a_stack_of_layers_with_shared_inputs():
    Mlp = Axis("mlp", 5)
    weights = _x(Layers, Embed, Mlp)
    bias = _x(Mlp, seed=3)  # no layers axis: shared by every step
    x0 = _x(Batch, Embed, seed=1)

    def layer(x, w, b):
        return nm.tanh(nm.dot(x, w, axis="embed") + b).rename({"mlp": "embed"})

    out = jax.jit(nm.fold(layer, "layers"))(x0, weights, bias)
    ref = np.asarray(x0.array)
    for i in range(2):
        ref = np.tanh(ref @ np.asarray(weights.array)[i] + np.asarray(bias.array))
    assert out.names == ("batch", "embed")
    np.testing.assert_allclose(np.asarray(out.array), ref, rtol=1e-5, atol=1e-6)


def test_scan_over_a_new_axis_given_as_axis():
    Steps = Axis("step", 3)
    carry, ys = nm.scan(lambda c: (c + 1, c), Steps)(nm.zeros((Embed,)))
    assert ys.axes == (Steps, Embed)
    np.testing.assert_array_equal(np.asarray(ys.array)[:, 0], [0, 1, 2])


def test_nmap_runs_positional_functions_over_unconsumed_axes():
    x = _x(Batch, Pos, Embed)
    out = nm.nmap(jnp.fft.rfft, consume="position", produce="freq")(x)
    assert out.names == ("batch", "embed", "freq")
    want = np.fft.rfft(np.asarray(x.array), axis=1).transpose(0, 2, 1)
    np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-4, atol=1e-4)
    c = nm.nmap(jnp.cumsum, consume="embed")(x)
    assert c.names == ("batch", "position", "embed")
    np.testing.assert_allclose(np.asarray(c.array), np.cumsum(np.asarray(x.array), axis=-1), rtol=1e-5, atol=1e-5)
    # A function that consumes everything and produces a scalar.
    n = nm.nmap(jnp.linalg.norm, consume="embed", produce=())(x)
    np.testing.assert_allclose(np.asarray(n.array), np.linalg.norm(np.asarray(x.array), axis=-1), rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_nmap_broadcasts_arguments_by_union(data):
    size_of = data.draw(sizes())
    na = data.draw(axis_subsets(("a", "b", "c")))
    nb = data.draw(axis_subsets(("a", "b", "c")))
    rng = np.random.default_rng(0)
    size_of["d"] = 3
    a, an = make(rng, na + ("d",), size_of)
    b, bn = make(rng, nb + ("d",), size_of)
    out = nm.nmap(lambda u, v, k: jnp.dot(u, v) * k, consume="d", produce=())(a, b, 2.0)
    batch = tuple(dict.fromkeys(na + nb))
    assert out.names == batch
    spec = f"{''.join(na)}d,{''.join(nb)}d->{''.join(batch)}"  # names are single letters
    want = np.einsum(spec, an, bn) * 2.0
    np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-5, atol=1e-5)


# ---- Haliax's rule for plain arrays, remat=, unroll= -----------------------------------------------


def test_plain_arrays_are_scanned_along_their_first_dimension():
    # Haliax's rule: jax.random.split(key, n) gives each step its own key; 0-d values go whole
    xs = np.arange(6.0, dtype=np.float32).reshape(3, 2)
    carry, ys = nm.scan(lambda c, row, k: (c + row.sum() * k, row * 2), Axis("step", 3))(
        0.0, jnp.asarray(xs), jnp.float32(10)
    )
    np.testing.assert_allclose(float(carry), xs.sum() * 10)
    assert ys.shape == (3, 2)  # a plain output gets a leading dimension
    np.testing.assert_allclose(np.asarray(ys), xs * 2)
    keys = jax.random.split(jax.random.key(0), 3)
    drawn = nm.fold(lambda c, k: c + jax.random.normal(k, ()), "step")(jnp.float32(0), keys)
    np.testing.assert_allclose(float(drawn), sum(float(jax.random.normal(k, ())) for k in keys), rtol=1e-6)
    # vmap follows the same rule, against a loop
    w = nm.random.normal(jax.random.key(1), (Batch, Embed))
    out = nm.vmap(lambda row, v: row * v.sum(), "batch")(w, jnp.asarray(xs))
    np.testing.assert_allclose(np.asarray(out.array), np.asarray(w.array) * xs.sum(axis=1)[:, None], rtol=1e-6)
    # is_scanned=False for plain leaves passes them whole; a mismatched plain array is named
    whole = nm.fold(lambda c, w_, v: c + v.sum(), "batch", is_scanned=nm.is_named_array)(0.0, w, jnp.asarray(xs))
    np.testing.assert_allclose(float(whole), 3 * xs.sum(), rtol=1e-6)
    try:
        nm.fold(lambda c, w_, v: c, "batch")(0.0, w, jnp.ones((4, 2)))
    except nm.AxisError as e:
        assert "has size 4 in the plain array at args[1]" in str(e) and "nm.named" in str(e)
    else:
        raise AssertionError("a plain array of the wrong length must be refused")


def test_scan_remat_and_unroll_keep_the_numbers():
    Steps = Axis("step", 4)
    ws = nm.random.normal(jax.random.key(2), (Steps, Embed, Axis("out", 5))) * 0.3
    x = nm.random.normal(jax.random.key(3), (Batch, Embed))

    def layer(h, w):
        return nm.tanh(nm.dot(h, w, axis="embed")).rename({"out": "embed"})

    def loss(ws, remat, unroll):
        return nm.fold(layer, "step", remat=remat, unroll=unroll)(x, ws).sum().scalar()

    h, wa = np.asarray(x.array), np.asarray(ws.array)
    for i in range(4):
        h = np.tanh(h @ wa[i])
    want = jax.grad(loss)(ws, None, 1)
    for remat, unroll in [
        (True, 2),
        ("full every=2", None),
        (nm.ScanCheckpointPolicy(nested=2), True),
        (nm.ScanCheckpointPolicy(save_block_internals=["x"]), 1),
    ]:
        np.testing.assert_allclose(float(loss(ws, remat, unroll)), h.sum(), rtol=1e-5)
        np.testing.assert_allclose(
            np.asarray(jax.grad(loss)(ws, remat, unroll).array), np.asarray(want.array), rtol=1e-5, atol=1e-6
        )
    with pytest.raises(nm.NamedError, match="every=3 groups steps 3 at a time, but 'step' has 4"):
        loss(ws, "full every=3", 1)

    # reversed, with the per-step outputs (nested_scan's own backward pass): steps 3, 2, 1, 0
    def scanned(ws, remat):
        def step(h, w):
            h = layer(h, w)
            return h, h * h

        h, ys = nm.scan(step, "step", remat=remat, reverse=True)(x, ws)
        return h.sum().scalar() + (ys * nm.arange(Steps).astype(jnp.float32)).sum().scalar()

    h, want_ys = np.asarray(x.array), []
    for i in reversed(range(4)):
        h = np.tanh(h @ wa[i])
        want_ys.append((h * h).sum() * i)
    np.testing.assert_allclose(float(scanned(ws, "full every=2")), h.sum() + sum(want_ys), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(jax.grad(scanned)(ws, "full every=2").array),
        np.asarray(jax.grad(scanned)(ws, None).array),
        rtol=1e-5,
        atol=1e-6,
    )


def test_map_linspace_family_and_tree_checkpoint_name_match_numpy():
    xs = nm.random.normal(jax.random.key(5), (Layers, Batch, Embed))
    norms = nm.map(lambda v: nm.sqrt((v * v).sum()), "layers")(xs)  # one slice at a time (lax.map)
    np.testing.assert_allclose(
        np.asarray(norms.array), np.linalg.norm(np.asarray(xs.array).reshape(2, -1), axis=1), rtol=1e-5
    )
    X = Axis("x", 7)
    np.testing.assert_allclose(
        np.asarray(nm.linspace(X, start=-1.0, stop=2.0).array), np.linspace(-1, 2, 7), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(
        np.asarray(nm.logspace(X, start=0.0, stop=2.0, base=2.0).array), np.logspace(0, 2, 7, base=2.0), rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(nm.geomspace(X, start=1.0, stop=64.0, endpoint=False).array),
        np.geomspace(1, 64, 7, endpoint=False),
        rtol=1e-5,
    )
    assert nm.linspace("s", start=0.0, stop=1.0).shape == {"s": 50}  # numpy's default count for a bare name
    tagged = nm.tree_checkpoint_name({"a": xs, "b": jnp.ones(2)}, "saved")
    jaxpr = str(jax.make_jaxpr(lambda t: nm.tree_checkpoint_name(t, "saved"))({"a": xs, "b": jnp.ones(2)}))
    assert jaxpr.count("name=saved") == 2 and isinstance(tagged["a"], nm.NamedArray)
