"""Haliax's axis-spec helpers (concat_axes/concat_axis_specs, without_axes, eliminate_axes,
replace_axis, axis_spec_to_shape_dict), NamedArray.axis_indices and broadcast_to's Haliax keywords,
against Haliax's documented behaviour and numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis

A, B, C = Axis("a", 2), Axis("b", 3), Axis("c", 4)


def test_shape_dict_and_concat_keep_the_kind_of_spec():
    assert nm.axis_spec_to_shape_dict((A, "b")) == {"a": 2, "b": None}
    assert nm.axis_spec_to_shape_dict(A) == {"a": 2} and nm.axis_spec_to_shape_dict("a b") == {"a": None, "b": None}
    assert nm.concat_axes(A, B) == (A, B) and nm.concat_axis_specs((A,), (B, C)) == (A, B, C)
    assert nm.concat_axes({"a": 2}, (B,)) == {"a": 2, "b": 3}
    assert nm.concat_axes((A,), {"b": 3}) == (A, B)
    with pytest.raises(nm.AxisError, match="'a'"):  # Haliax: ValueError; AxisError is one
        nm.concat_axes((A, B), (C, A))
    with pytest.raises(ValueError):
        nm.concat_axes(A, A)


def test_without_and_eliminate_axes():
    assert nm.without_axes((A, B, C), (B, "z")) == (A, C)  # an absent name is ignored
    assert nm.without_axes({"a": 2, "b": 3}, "a") == {"b": 3}
    with pytest.raises(nm.AxisError, match="'b'"):
        nm.without_axes((A, B), B.resize(5))
    assert nm.without_axes((A, B), B.resize(5), allow_mismatched_sizes=True) == (A,)
    assert nm.eliminate_axes((A, B, C), (C, A)) == (B,)
    with pytest.raises(nm.AxisError, match="'z'"):  # eliminate_axes: every axis must be there
        nm.eliminate_axes((A, B), "z")
    with pytest.raises(nm.AxisError, match="'a'"):
        nm.eliminate_axes((A, B), A.resize(7))


def test_replace_axis_in_place():
    D, E = Axis("d", 5), Axis("e", 6)
    assert nm.replace_axis((A, B, C), B, (D, E)) == (A, D, E, C)
    assert nm.replace_axis({"a": 2, "b": 3}, "a", D) == {"d": 5, "b": 3}
    assert nm.replace_axis((A, B), "b", B) == (A, B)  # the same name again is fine
    with pytest.raises(nm.AxisError, match="'z'"):
        nm.replace_axis((A, B), "z", D)
    with pytest.raises(nm.AxisError, match="'a'"):  # the new name clashes with another axis
        nm.replace_axis((A, B), B, A)


def test_axis_indices_is_index_or_none():
    x = nm.zeros((A, B, C))
    assert x.axis_indices(B) == 1 and x.axis_indices("c") == 2 and x.axis_indices("z") is None
    assert x.axis_indices((C, "z", A)) == (2, None, 0) and x.axis_indices("a c") == (0, 2)
    with pytest.raises(nm.AxisError, match="b=3"):
        x.axis_indices(B.resize(9))


def test_broadcast_to_with_extra_axes_kept_as_haliax_does():
    v = np.arange(8.0).reshape(2, 4)
    x = nm.named(jnp.asarray(v), (A, C))
    with pytest.raises(nm.AxisError, match="c=4"):
        nm.broadcast_to(x, (A, B))
    y = nm.broadcast_to(x, (A, B), enforce_no_extra_axes=False)
    assert y.axes == (A, B, C)
    np.testing.assert_array_equal(np.asarray(y.array), np.broadcast_to(v[:, None, :], (2, 3, 4)))
    z = x.broadcast_to((B, A), ensure_order=False, enforce_no_extra_axes=False)
    assert z.axes == (B, A, C)  # the new axis in front, x's own in its order
    np.testing.assert_array_equal(np.asarray(z.array), np.broadcast_to(v, (3, 2, 4)))
