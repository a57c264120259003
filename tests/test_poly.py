"""The polynomial family (named._poly, Haliax's haliax.poly) against numpy's, on the same coefficients."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis

P1 = np.array([2.0, -3.0, 0.5, 1.0], np.float32)
P2 = np.array([1.0, -1.0], np.float32)


def _np(x):
    return np.asarray(x.array)


def test_arithmetic_calculus_and_roots_match_numpy():
    p1, p2 = nm.named(jnp.asarray(P1), "coef"), nm.named(jnp.asarray(P2), "coef")
    for name in ("polyadd", "polysub", "polymul"):
        out = getattr(nm, name)(p1, p2)
        assert out.names == ("coef",)
        np.testing.assert_allclose(_np(out), getattr(np, name)(P1, P2), rtol=1e-6)
    q, r = nm.polydiv(p1, P2)  # a plain sequence mixes with a named one
    wq, wr = np.polydiv(P1, P2)
    np.testing.assert_allclose(_np(q), wq, rtol=1e-6)
    np.testing.assert_allclose(_np(r)[-len(wr) :], wr, atol=1e-6)
    np.testing.assert_allclose(_np(nm.polyder(p1, 2)), np.polyder(P1, 2), rtol=1e-6)
    np.testing.assert_allclose(_np(nm.polyint(p1, 2, k=[1.0, 2.0])), np.polyint(P1, 2, k=[1.0, 2.0]), rtol=1e-6)
    np.testing.assert_allclose(np.sort_complex(_np(nm.roots(p1))), np.sort_complex(np.roots(P1)), rtol=1e-4)
    assert nm.poly([1.0, 2.0]).names == ("degree",)  # no named input: the axis is `degree`
    np.testing.assert_allclose(_np(nm.poly([1.0, 2.0, -1.0])), np.poly([1.0, 2.0, -1.0]), rtol=1e-6)
    np.testing.assert_array_equal(_np(nm.trim_zeros(nm.named(jnp.array([0, 0, 1, 2, 0]), "c"), "f")), [1, 2, 0])
    with pytest.raises(nm.AxisError, match=r"a polynomial is a 1-d NamedArray of coefficients, got axes \(a=2, b=2\)"):
        nm.polyder(nm.zeros((Axis("a", 2), Axis("b", 2))))


def test_polyfit_polyval_and_vander_match_numpy():
    xs = np.linspace(-1, 2, 12).astype(np.float32)
    ys = (1.5 * xs**2 - xs + 0.25 + 0.01 * np.sin(7 * xs)).astype(np.float32)
    x, y = nm.named(jnp.asarray(xs), "sample"), nm.named(jnp.asarray(ys), "sample")
    coef = nm.polyfit(x, y, 2)
    assert coef.axes == (Axis("degree", 3),)
    np.testing.assert_allclose(_np(coef), np.polyfit(xs, ys, 2), rtol=1e-3, atol=1e-4)
    fitted = nm.polyval(coef, x)  # a 1-d NamedArray of coefficients needs no axis=
    np.testing.assert_allclose(_np(fitted), np.polyval(np.polyfit(xs, ys, 2), xs), rtol=1e-3, atol=1e-3)
    c, cov = nm.polyfit(x, y, 1, cov=True, new_axis="power")
    assert cov.axes == (Axis("power", 2), Axis("power_cov", 2))
    np.testing.assert_allclose(_np(cov), np.polyfit(xs, ys, 1, cov=True)[1], rtol=1e-2, atol=1e-5)
    v = nm.vander(x, Axis("power", 4))
    assert v.axes == (Axis("sample", 12), Axis("power", 4))
    np.testing.assert_allclose(_np(v), np.vander(xs, 4), rtol=1e-6)
    assert nm.vander(x, "power").shape == {"sample": 12, "power": 12}
