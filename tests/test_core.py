"""Axis and NamedArray basics, the pytree contract (jit, grad, eqx.filter_jit), and random."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis

Batch, Embed, Mlp = Axis("batch", 2), Axis("embed", 3), Axis("mlp", 4)


def test_axis_is_static_hashable_metadata():
    assert Axis("embed", 3) == Embed and hash(Axis("embed", 3)) == hash(Embed)
    assert Embed.resize(5) == Axis("embed", 5) and Embed.alias("e2") == Axis("e2", 3)
    assert Axis("n", np.int64(4)).size == 4 and type(Axis("n", np.int64(4)).size) is int
    assert repr(Embed) == "Axis('embed', 3)"


def test_named_wraps_and_reads_sizes_from_the_array():
    a = np.arange(6.0).reshape(2, 3)
    x = nm.named(a, ("batch", "embed"))
    assert x.axes == (Batch, Embed)
    assert nm.named(a, "batch embed").axes == x.axes
    assert nm.named(a, (Batch, "embed")).axes == x.axes
    assert x.shape == {"batch": 2, "embed": 3}
    assert x.names == ("batch", "embed") and x.ndim == 2 and x.size == 6
    assert x.dtype == a.dtype and x.nbytes == 48
    assert x.axis_size("embed") == 3 and x.index_of("embed") == 1
    assert x.has_axis("embed") and x.has_axis(("batch", "embed")) and not x.has_axis("mlp")
    assert x.resolve_axis("embed") == Embed and x.resolve_axis(("embed", "batch")) == (Embed, Batch)
    assert nm.axes_of(x) == (Batch, Embed) and nm.axes_of(2.0) == () and nm.axes_of(jnp.float32(1)) == ()
    assert nm.is_named_array(x) and not nm.is_named_array(a)


def test_scalar_rule():
    x = nm.named(jnp.arange(6.0).reshape(2, 3), "batch embed")
    total = x.sum()
    assert isinstance(total, nm.NamedArray) and total.axes == ()
    assert total.item() == 15.0 and isinstance(total.item(), float)
    s = total.scalar()
    assert isinstance(s, jax.Array) and s.shape == ()
    assert bool(total > 1.0)  # a 0-d comparison is usable in Python control flow
    per_row = x.sum("embed")
    assert per_row.names == ("batch",)


def test_repr_and_html_show_names():
    x = nm.zeros((Batch, Embed))
    assert "float32[batch=2 embed=3]" in repr(x)
    html = x._repr_html_()
    assert "batch" in html and "embed" in html and "float32" in html
    seen = []
    jax.jit(lambda y: seen.append(repr(y)) or y)(x)
    assert seen and "NamedArray(float32[batch=2 embed=3]" in seen[0]


def test_named_array_is_immutable_and_not_positional():
    x = nm.zeros((Batch,))
    with pytest.raises(AttributeError, match="immutable"):
        x.array = None
    with pytest.raises(TypeError, match="len"):
        len(x)
    with pytest.raises(TypeError, match="unbind"):
        list(x)
    with pytest.raises(TypeError, match="nm.dot"):
        x @ x


def test_astype_and_numpy_operands_defer_to_named():
    x = nm.named(np.ones((2,), np.float32), "batch")
    assert x.astype(jnp.int32).dtype == jnp.int32
    y = np.float32(2.0) * x
    assert isinstance(y, nm.NamedArray) and y.names == ("batch",)


def test_pytree_flatten_keeps_axes_static():
    x = nm.zeros((Batch, Embed))
    leaves, treedef = jax.tree.flatten(x)
    assert len(leaves) == 1 and leaves[0].shape == (2, 3)
    y = jax.tree.unflatten(treedef, [jnp.ones((2, 3))])
    assert y.axes == x.axes
    doubled = jax.tree.map(lambda a: a * 2, {"w": x + 1})
    assert doubled["w"].axes == x.axes and float(doubled["w"].array[0, 0]) == 2.0
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path({"w": x})[0]]
    assert paths == ["['w'].array"]


def test_jit_recompiles_per_axes_not_per_value():
    traces = []

    @jax.jit
    def f(x):
        traces.append(x.axes)
        return nm.exp(x).sum("embed")

    a = nm.ones((Batch, Embed))
    f(a)
    f(a * 2)
    assert len(traces) == 1
    f(a.rename({"batch": "b2"}))
    assert len(traces) == 2
    out = f(a)
    assert out.names == ("batch",)
    np.testing.assert_allclose(np.asarray(out.array), [3 * np.e] * 2, rtol=1e-6)


def test_grad_through_a_named_loss():
    key = jax.random.key(0)
    w = nm.random.normal(key, (Embed, Mlp))
    x = nm.random.normal(jax.random.key(1), (Batch, Embed))

    def loss(w, x):
        return (nm.dot(x, w, axis="embed") ** 2).mean().scalar()

    g = jax.grad(loss)(w, x)
    assert isinstance(g, nm.NamedArray) and g.axes == w.axes
    xa, wa = np.asarray(x.array), np.asarray(w.array)
    want = 2 * xa.T @ (xa @ wa) / (2 * 4)
    np.testing.assert_allclose(np.asarray(g.array), want, rtol=1e-5, atol=1e-6)
    v, g2 = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(np.asarray(g2.array), np.asarray(g.array))


class _Layer(eqx.Module):
    weight: nm.NamedArray
    bias: nm.NamedArray
    out_axis: str = eqx.field(static=True, default="mlp")

    def __call__(self, x):
        return nm.dot(x, self.weight, axis="embed") + self.bias


def test_equinox_module_with_named_arrays_under_filter_jit_and_filter_grad():
    layer = _Layer(nm.random.normal(jax.random.key(0), (Embed, Mlp)), nm.zeros((Mlp,)))
    x = nm.random.normal(jax.random.key(1), (Batch, Embed))
    out = eqx.filter_jit(lambda m, x: m(x))(layer, x)
    assert out.names == ("batch", "mlp")
    np.testing.assert_allclose(np.asarray(out.array), np.asarray(x.array) @ np.asarray(layer.weight.array), rtol=1e-5)

    @eqx.filter_grad
    def grads(m, x):
        return m(x).sum().scalar()

    g = grads(layer, x)
    assert g.weight.axes == layer.weight.axes and g.bias.axes == (Mlp,)
    np.testing.assert_allclose(np.asarray(g.bias.array), [2.0] * 4)


def test_random_draws_have_axes_and_respect_parameters():
    key = jax.random.key(0)
    A, B = Axis("a", 200), Axis("b", 3)
    n = nm.random.normal(key, (A, B), mean=nm.named(jnp.array([0.0, 10.0, -10.0]), "b"), stddev=0.1)
    assert n.axes == (A, B)
    np.testing.assert_allclose(np.asarray(n.mean("a").array), [0, 10, -10], atol=0.05)
    u = nm.random.uniform(key, (A, B), minval=2.0, maxval=3.0)
    assert float(u.min().item()) >= 2.0 and float(u.max().item()) < 3.0
    t = nm.random.truncated_normal(key, (A, B), lower=-1.0, upper=0.5)
    assert float(t.min().item()) >= -1.0 and float(t.max().item()) <= 0.5
    bern = nm.random.bernoulli(key, (A, B), p=nm.named(jnp.array([0.0, 1.0, 0.5]), "b"))
    col = np.asarray(bern.mean("a").array)
    assert col[0] == 0.0 and col[1] == 1.0 and 0.3 < col[2] < 0.7
    r = nm.random.randint(key, (A,), 3, 6)
    assert r.dtype == jnp.int32 and set(np.unique(np.asarray(r.array))) <= {3, 4, 5}
    logits = nm.named(jnp.log(jnp.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]) + 1e-30), "row b")
    c = nm.random.categorical(key, logits, "b")
    assert c.names == ("row",)
    np.testing.assert_array_equal(np.asarray(c.array), [1, 0])


def test_random_values_depend_on_key_and_axes_only():
    key = jax.random.key(42)
    eager = nm.random.normal(key, (Batch, Mlp))
    jitted = jax.jit(lambda k: nm.random.normal(k, (Batch, Mlp)))(key)
    np.testing.assert_array_equal(np.asarray(eager.array), np.asarray(jitted.array))
    np.testing.assert_array_equal(np.asarray(eager.array), np.asarray(jax.random.normal(key, (2, 4))))


def test_arange_over_several_axes_counts_row_major_like_numpy():
    X, Y, Z = nm.Axis("x", 2), nm.Axis("y", 3), nm.Axis("z", 4)
    out = nm.arange((X, Y, Z), start=5, step=3)
    assert out.axes == (X, Y, Z)
    np.testing.assert_array_equal(np.asarray(out.array), (5 + 3 * np.arange(24)).reshape(2, 3, 4))
    traced = jax.jit(lambda s: nm.arange((Y, Z), start=s))(jnp.int32(7))  # a traced start (Haliax's promise)
    np.testing.assert_array_equal(np.asarray(traced.array), np.arange(7, 19).reshape(3, 4))
    with pytest.raises(nm.AxisError, match="arange needs an Axis with a size"):
        nm.arange("x")
