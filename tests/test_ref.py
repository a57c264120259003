"""nm.NamedRef (Haliax's hax.new_ref) against a numpy array edited the same way: views that
compose (slices, nm.ds, ints, strides), writes broadcast by name, swap, jit and scan, and the
gradient through writes inside a scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis

X, Y = Axis("x", 10), Axis("y", 3)


def test_views_compose_and_write_through_like_numpy():
    ref_np = np.arange(30, dtype=np.float32).reshape(10, 3)
    ref = nm.new_ref(nm.named(jnp.asarray(ref_np), (X, Y)))
    assert ref.axes == (X, Y) and jax.tree_util.tree_leaves(ref) == [ref.ref]
    strided = ref.slice({"x": slice(1, 9, 2)})  # rows 1, 3, 5, 7
    assert strided.axes == (X.resize(4), Y)
    inner = strided.slice({"x": nm.ds(1, 2)})  # rows 3, 5
    inner[{"y": 0}] = nm.named(jnp.asarray([-1.0, -2.0]), "x")
    ref_np[[3, 5], 0] = [-1.0, -2.0]
    inner["x", 1] = 9.0  # a number fills the view
    ref_np[5] = 9.0
    row = nm.ones(Y) * 4
    strided[{"x": -1}] = row  # negative counts from the end of the view
    ref_np[7] = 4
    np.testing.assert_array_equal(np.asarray(ref.value().array), ref_np)
    np.testing.assert_array_equal(np.asarray(inner.value().array), ref_np[[3, 5]])
    assert inner.unsliced().axes == (X, Y)
    old = nm.swap(ref, {"x": 0}, nm.full(Y, 2.0))
    np.testing.assert_array_equal(np.asarray(old.array), ref_np[0])
    ref_np[0] = 2.0
    np.testing.assert_array_equal(np.asarray(nm.freeze(ref).array), ref_np)
    np.testing.assert_array_equal(np.asarray(nm.get(ref, {"y": 2}).array), ref_np[:, 2])


def test_refs_under_jit_scan_and_grad():
    ref = nm.new_ref(nm.zeros((X, Y)))

    @jax.jit
    def fill(ref, steps):
        def body(carry, i):  # a plain array is scanned along its first dimension (i is traced)
            ref.slice({"x": i})[{"y": 1}] = (i * i).astype(jnp.float32)
            return carry, i * 2

        return nm.scan(body, X)(None, steps)[1]

    doubled = fill(ref, jnp.arange(X.size))
    np.testing.assert_array_equal(np.asarray(doubled), np.arange(10) * 2)
    np.testing.assert_array_equal(np.asarray(ref.value().array)[:, 1], np.arange(10) ** 2)

    def f(s):
        r = nm.new_ref(nm.zeros(X))

        def body(carry, i):
            r.slice({"x": i})[...] = jnp.sin(s * i)
            return carry, None

        nm.scan(body, X)(None, jnp.arange(X.size))
        return r[...].sum().scalar()

    i = np.arange(10)
    assert float(jax.grad(f)(0.5)) == pytest.approx(float(np.sum(np.cos(0.5 * i) * i)), rel=1e-5)


def test_bad_indices_and_values_are_named():
    ref = nm.new_ref(nm.zeros((X, Y)))
    with pytest.raises(nm.AxisError, match="index 10 is out of range for axis 'x' of size 10"):
        ref[{"x": 10}]
    with pytest.raises(nm.AxisError, match="axis 'y' not found in array with axes \\(x=10\\)"):
        ref.slice({"y": 0})[{"y": 0}]
    with pytest.raises(nm.ArgumentError, match="a gather by a NamedArray"):
        ref[{"x": nm.arange(Axis("k", 2))}]
    with pytest.raises(nm.AxisError, match=r"the value has axes \(z=2\)"):
        ref[{"x": 0}] = nm.zeros(Axis("z", 2))
    with pytest.raises(nm.ArgumentTypeError, match="wrap it with nm.named"):
        ref[{"x": 0}] = jnp.zeros(3)
    with pytest.raises(nm.ArgumentTypeError, match="nm.new_ref takes a NamedArray"):
        nm.new_ref(jnp.zeros(3))
