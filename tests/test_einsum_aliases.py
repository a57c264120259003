"""Haliax's einsum aliases and partial orders with several '...' (nm.dot out_axes=, rearrange),
against numpy's einsum on the same arrays."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import named as nm
from named import Axis

H, W, D = Axis("height", 2), Axis("width", 3), Axis("depth", 4)


def _arrays():
    return nm.random.normal(jax.random.key(0), (H, W, D)), nm.random.normal(jax.random.key(1), (D, W, H))


def test_einsum_aliases_stand_for_axes():
    a, b = _arrays()
    na, nb = np.asarray(a.array), np.asarray(b.array)
    out = nm.einsum("x y z, z y x -> x y", a, b, x=H, y="width", z=D)  # generic code, written once
    assert out.axes == (H, W)
    np.testing.assert_allclose(np.asarray(out.array), np.einsum("hwd,dwh->hw", na, nb), rtol=1e-5, atol=1e-5)
    kept = nm.einsum("{x} -> ... y", a, b, x=H, y=W, preferred_element_type=np.float32)
    assert kept.axes == (D, W)
    np.testing.assert_allclose(np.asarray(kept.array), np.einsum("hwd,dwh->dw", na, nb), rtol=1e-5, atol=1e-5)
    with pytest.raises(nm.ArgumentTypeError, match=r"unexpected keyword arguments \['q'\]: not einsum options"):
        nm.einsum("{x} -> ...", a, b, x=H, q=W)
    with pytest.raises(nm.AxisError, match=r"alias x=Axis\('height', 5\): operand 0 has 'height' of size 2"):
        nm.einsum("{x} -> ...", a, b, x=H.resize(5))
    with pytest.raises(nm.ArgumentTypeError, match="a keyword is an einsum option"):
        nm.einsum("{x} -> ...", a, b, x=3)


@pytest.mark.parametrize(
    "out_axes, letters",
    [
        ((D, H, ...), "dhw"),
        ((..., D, H), "wdh"),
        ((..., D, ...), "hwd"),
        ((..., D, H, ...), "dhw"),
        ((W, ..., H, ...), "whd"),
    ],
)
def test_several_ellipses_are_a_partial_order(out_axes, letters):
    a, b = _arrays()
    out = nm.dot(a, b, axis=(), out_axes=out_axes)  # an outer product, ordered by the partial order
    assert "".join(x.name[0] for x in out.axes) == letters
    want = np.einsum(f"hwd,dwh->{letters}", np.asarray(a.array), np.asarray(b.array))
    np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-6)
    moved = a.rearrange(out_axes)
    assert "".join(x.name[0] for x in moved.axes) == letters
    np.testing.assert_array_equal(
        np.asarray(moved.array), np.transpose(np.asarray(a.array), ["hwd".index(c) for c in letters])
    )
