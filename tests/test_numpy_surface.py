"""The numpy surface by name (``named._numpy``) against numpy itself: every row of the one
table, and the functions with shapes of their own, on arrays whose axes are in a random
order (so a test fails if an op reads a position instead of a name)."""

from __future__ import annotations

import pathlib
import re
import warnings

import jax
import numpy as np
import pytest
from _reference import as_numpy, axis_subsets, expand, make, sizes, union_names
from hypothesis import given, settings
from hypothesis import strategies as st

import named as nm
from named import Axis
from named import _numpy as surface

FAST = settings(max_examples=10, deadline=None)
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "named_arrays.md"


def _float_with_nans(rng, names, size_of):
    x, a = make(rng, names, size_of)
    a = np.where(rng.random(a.shape) < 0.2, np.nan, a).astype(np.float32)
    return nm.named(a, names), a


# name -> (input kind for each operand, numpy reference). Kinds as in _reference.random_values.
ELEMENTWISE = {
    "bitwise_not": (("int",), np.bitwise_not),
    "bitwise_count": (("int",), np.bitwise_count),
    "left_shift": (("int", "small"), np.left_shift),
    "right_shift": (("int", "small"), np.right_shift),
    "gcd": (("int", "int"), np.gcd),
    "lcm": (("int", "int"), np.lcm),
    "fmax": (("nan", "nan"), np.fmax),
    "fmin": (("nan", "nan"), np.fmin),
    "fmod": (("float", "positive"), np.fmod),
    "copysign": (("float", "float"), np.copysign),
    "heaviside": (("float", "float"), np.heaviside),
    "logaddexp2": (("float", "float"), np.logaddexp2),
    "float_power": (("positive", "float"), np.float_power),
    "signbit": (("float",), np.signbit),
    "nan_to_num": (("nan",), lambda a: np.nan_to_num(a, nan=0.0)),
    "deg2rad": (("float",), np.deg2rad),
    "rad2deg": (("float",), np.rad2deg),
    "sinc": (("float",), np.sinc),
    "angle": (("float",), np.angle),
    "absolute": (("float",), np.absolute),
    "fabs": (("float",), np.fabs),
    "positive": (("float",), np.positive),
    "rint": (("float",), np.rint),
    "degrees": (("float",), np.degrees),
    "radians": (("float",), np.radians),
    "conjugate": (("float",), np.conjugate),
    "i0": (("unit",), np.i0),
    "isneginf": (("float",), np.isneginf),
    "isposinf": (("float",), np.isposinf),
    "isreal": (("float",), np.isreal),
    "iscomplex": (("float",), np.iscomplex),
    "nextafter": (("float", "float"), np.nextafter),
    "bitwise_invert": (("int",), np.bitwise_not),
    "bitwise_left_shift": (("int", "small"), np.left_shift),
    "bitwise_right_shift": (("int", "small"), np.right_shift),
}
REDUCE = {
    "nansum": np.nansum,
    "nanmean": np.nanmean,
    "nanprod": np.nanprod,
    "nanstd": np.nanstd,
    "nanvar": np.nanvar,
    "nanmax": np.nanmax,
    "nanmin": np.nanmin,
    "amax": np.amax,
    "amin": np.amin,
}
REDUCE_PLAIN = {"median": np.median, "nanmedian": np.nanmedian, "ptp": np.ptp, "count_nonzero": np.count_nonzero}
ARG = {"nanargmax": np.nanargmax, "nanargmin": np.nanargmin}
ALONG = {"nancumsum": np.nancumsum, "nancumprod": np.nancumprod}
FFT = {
    "fft": np.fft.fft,
    "ifft": np.fft.ifft,
    "rfft": np.fft.rfft,
    "irfft": np.fft.irfft,
    "hfft": np.fft.hfft,
    "ihfft": np.fft.ihfft,
}
FFTN = {"fft": np.fft.fftn, "ifft": np.fft.ifftn, "rfft": np.fft.rfftn, "irfft": np.fft.irfftn}
SHIFT = {"fftshift": np.fft.fftshift, "ifftshift": np.fft.ifftshift}


def test_every_row_of_the_table_has_a_numpy_reference_here():
    tested = set(ELEMENTWISE) | set(REDUCE) | set(REDUCE_PLAIN) | set(ARG) | set(ALONG) | set(FFT) | set(SHIFT)
    assert tested == set(surface.SURFACE)


def test_the_docs_list_every_function():
    text = DOCS.read_text()
    missing = [n for n in surface.__all__ if not re.search(rf"`(?:nm\.)?{n}[`(]", text)]
    assert not missing, f"docs/named_arrays.md does not list {missing}"
    assert all(callable(getattr(nm, n)) for n in surface.__all__)


def _values(rng, names, size_of, kind):
    if kind == "nan":
        return _float_with_nans(rng, names, size_of)
    if kind == "small":  # shift counts
        a = rng.integers(0, 4, tuple(size_of[n] for n in names)).astype(np.int32)
        return nm.named(a, names), a
    return make(rng, names, size_of, kind)


@pytest.mark.parametrize("name", list(ELEMENTWISE))
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_elementwise_rows_match_numpy_with_union_broadcasting(name, data):
    kinds, ref = ELEMENTWISE[name]
    size_of = data.draw(sizes())
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    groups = [data.draw(axis_subsets()) for _ in kinds]
    made = [_values(rng, g, size_of, k) for g, k in zip(groups, kinds)]
    out_names = union_names(*groups)
    out = getattr(nm, name)(*(m[0] for m in made))
    assert out.names == out_names
    with np.errstate(all="ignore"):
        want = ref(*(expand(m[1], g, out_names, size_of) for m, g in zip(made, groups)))
    np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(REDUCE) + list(REDUCE_PLAIN))
@FAST
@given(data=st.data())
def test_reduction_rows_match_numpy(name, data):
    size_of = data.draw(sizes())
    names = data.draw(axis_subsets(min_size=1))
    reduce = data.draw(st.one_of(st.none(), axis_subsets(names, min_size=1)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    x, a = _float_with_nans(rng, names, size_of)
    positions = None if reduce is None else tuple(names.index(n) for n in reduce)
    kwargs, ref_kwargs = {}, {}
    if name in REDUCE and data.draw(st.booleans()):
        wnames = data.draw(axis_subsets(names))
        where, wn = make(rng, wnames, size_of, "bool")
        kwargs["where"] = where
        ref_kwargs["where"] = expand(wn, wnames, names, size_of)
        if name in ("nanmax", "nanmin", "amax", "amin"):
            ref_kwargs["initial"] = -np.inf if name in ("nanmax", "amax") else np.inf
    ref = REDUCE.get(name) or REDUCE_PLAIN[name]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = ref(a.astype(np.float64), axis=positions, **ref_kwargs)
    out = getattr(nm, name)(x, reduce, **kwargs)
    assert out.names == (() if reduce is None else tuple(n for n in names if n not in reduce))
    np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(ARG) + list(ALONG))
@FAST
@given(data=st.data())
def test_arg_and_along_rows_match_numpy(name, data):
    size_of = data.draw(sizes())
    names = data.draw(axis_subsets(min_size=1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    x, a = make(rng, names, size_of)
    axis = data.draw(st.sampled_from(names))
    i = names.index(axis)
    if a.shape[i] >= 2:  # a NaN at the first place of every slice along the axis, never a whole slice
        np.moveaxis(a, i, 0)[0] = np.nan
    x = nm.named(a, names)
    ref = ARG.get(name) or ALONG[name]
    out = getattr(nm, name)(x, axis)
    if name in ARG:
        np.testing.assert_array_equal(np.asarray(out.array), ref(a, axis=i))
        assert out.names == tuple(n for n in names if n != axis)
        np.testing.assert_array_equal(np.asarray(getattr(nm, name)(x).array), ref(a))  # flat index
    else:
        np.testing.assert_allclose(np.asarray(out.array), ref(a, axis=i), rtol=1e-4, atol=1e-5)
        assert out.names == names


@pytest.mark.parametrize("name", list(FFT))
@FAST
@given(data=st.data())
def test_fft_rows_match_numpy_along_one_name(name, data):
    size_of = data.draw(sizes(min_size=2, max_size=4))
    names = data.draw(axis_subsets(min_size=1))
    axis = data.draw(st.sampled_from(names))
    n = data.draw(st.one_of(st.none(), st.integers(2, 6)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    x, a = make(rng, names, size_of)
    i = names.index(axis)
    want = FFT[name](a.astype(np.float64), n=n, axis=i)
    out = getattr(nm, name)(x, axis, n=n, new_axis="freq")
    assert out.names == tuple("freq" if m == axis else m for m in names)
    assert out.shape["freq"] == want.shape[i]
    np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-3, atol=1e-3)
    if name in FFTN and len(names) >= 2:
        pair = data.draw(st.permutations(names))[:2]
        want = FFTN[name](a.astype(np.float64), axes=[names.index(p) for p in pair])
        out = getattr(nm, name)(x, pair)
        assert out.names == names
        np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", list(SHIFT))
def test_shift_rows_match_numpy(name):
    x, a = make(np.random.default_rng(0), ("a", "b", "c"), {"a": 3, "b": 4, "c": 5})
    np.testing.assert_array_equal(np.asarray(getattr(nm, name)(x, ("c", "a")).array), SHIFT[name](a, axes=(2, 0)))
    np.testing.assert_array_equal(np.asarray(getattr(nm, name)(x).array), SHIFT[name](a))


def test_fftfreq_matches_the_transform_sizes():
    P = Axis("position", 8)
    np.testing.assert_allclose(np.asarray(nm.fftfreq(P, 0.5).array), np.fft.fftfreq(8, 0.5))
    half = nm.fftfreq(P, rfft=True, new_axis="freq")
    assert half.axes == (Axis("freq", 5),)
    np.testing.assert_allclose(np.asarray(half.array), np.fft.rfftfreq(8))


# ---- the functions with shapes of their own --------------------------------------------


def test_unique_sized_with_index_inverse_counts():
    rng = np.random.default_rng(1)
    a = rng.integers(0, 5, (3, 4)).astype(np.int32)
    x = nm.named(a, "rows cols")
    U = Axis("distinct", 7)
    vals, idx, inv, counts = nm.unique(x, U, fill_value=-1, return_index=True, return_inverse=True, return_counts=True)
    wv, wi, winv, wc = np.unique(a, return_index=True, return_inverse=True, return_counts=True)
    k = len(wv)
    assert vals.axes == (U,) and inv.axes == x.axes
    np.testing.assert_array_equal(np.asarray(vals.array)[:k], wv)
    assert (np.asarray(vals.array)[k:] == -1).all()
    np.testing.assert_array_equal(np.asarray(idx.array)[:k], wi)
    np.testing.assert_array_equal(np.asarray(inv.array), winv.reshape(a.shape))
    np.testing.assert_array_equal(np.asarray(counts.array)[:k], wc)
    assert nm.unique(x, U).axes == (U,)
    with pytest.raises(nm.ArgumentError, match=r"nm.unique needs the result's size as an Axis"):
        nm.unique(x, 7)


def test_nonzero_sized_indexes_back_by_name():
    a = np.array([[0, 3, 0, 1], [2, 0, 0, 5]], np.float32)
    x = nm.named(a, "rows cols")
    Found = Axis("found", 6)
    nz = nm.nonzero(x, Found)
    rows, cols = np.nonzero(a)
    assert set(nz) == {"rows", "cols"}
    np.testing.assert_array_equal(np.asarray(nz["rows"].array)[:4], rows)
    np.testing.assert_array_equal(np.asarray(nz["cols"].array)[:4], cols)
    assert (np.asarray(nz["rows"].array)[4:] == 0).all()
    picked = x[nz]  # a gather by name: the values at the nonzero positions
    np.testing.assert_array_equal(np.asarray(picked.array)[:4], a[rows, cols])
    # The axes of x in another order give the same indices, keyed by name.
    nz_t = nm.nonzero(x.rearrange("cols rows"), Found)
    order = np.lexsort((rows, cols))  # column-major order of the same hits
    np.testing.assert_array_equal(np.asarray(nz_t["rows"].array)[:4], rows[order])


def test_searchsorted_batched_by_name():
    rng = np.random.default_rng(2)
    edges = np.sort(rng.standard_normal((3, 5)), axis=1).astype(np.float32)  # [group, bins]
    vals = rng.standard_normal((4, 3)).astype(np.float32)  # [query, group]
    s = nm.named(edges, "group bins")
    v = nm.named(vals, "query group")
    for side in ("left", "right"):
        out = nm.searchsorted(s, v, "bins", side=side)
        assert set(out.names) == {"group", "query"}
        want = np.stack([np.searchsorted(edges[g], vals[:, g], side=side) for g in range(3)])  # [group, query]
        np.testing.assert_array_equal(as_numpy(out, ("group", "query")), want)
    flat = nm.named(edges[0], "bins")
    np.testing.assert_array_equal(np.asarray(nm.searchsorted(flat, v).array), np.searchsorted(edges[0], vals))
    assert nm.searchsorted(flat, 0.0).axes == ()


def test_bincount_per_row_and_weighted():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 6, (3, 7)).astype(np.int32)
    w = rng.random((3, 7)).astype(np.float32)
    x = nm.named(a, "rows tokens")
    Bins = Axis("bins", 6)
    per_row = nm.bincount(x, Bins, axis="tokens")
    assert per_row.names == ("rows", "bins")
    np.testing.assert_array_equal(np.asarray(per_row.array), np.stack([np.bincount(r, minlength=6) for r in a]))
    total = nm.bincount(x.rearrange("tokens rows"), Bins, weights=nm.named(w, "rows tokens"))
    np.testing.assert_allclose(np.asarray(total.array), np.bincount(a.ravel(), w.ravel(), minlength=6), rtol=1e-5)


def test_repeat_tile_ravel_trace():
    x, a = make(np.random.default_rng(4), ("a", "b", "c"), {"a": 2, "b": 3, "c": 3})
    np.testing.assert_array_equal(np.asarray(nm.repeat(x, 2, "b").array), np.repeat(a, 2, axis=1))
    assert nm.repeat(x, 2, "b").shape == {"a": 2, "b": 6, "c": 3}
    np.testing.assert_array_equal(np.asarray(nm.tile(x, {"c": 2, "a": 3}).array), np.tile(a, (3, 1, 2)))
    r = nm.ravel(x.rearrange("c a b"), "flat")
    np.testing.assert_array_equal(np.asarray(r.array), a.transpose(2, 0, 1).ravel())
    np.testing.assert_allclose(
        np.asarray(nm.trace(x, "c", "b", offset=1).array), np.trace(a, offset=1, axis1=2, axis2=1), rtol=1e-5
    )
    with pytest.raises(nm.ArgumentError, match=r"repeats must be an int >= 0, got -1"):
        nm.repeat(x, -1, "b")


def test_polyval_with_named_coefficients():
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((4,)).astype(np.float32)
    coeffs = rng.standard_normal((2, 3)).astype(np.float32)  # [curve, degree]
    out = nm.polyval(nm.named(coeffs, "curve degree"), nm.named(xs, "point"), axis="degree")
    assert set(out.names) == {"curve", "point"}
    want = np.stack([np.polyval(c, xs) for c in coeffs])
    np.testing.assert_allclose(as_numpy(out, ("curve", "point")), want, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(nm.polyval([2.0, -1.0, 0.5], nm.named(xs, "point")).array),
        np.polyval([2.0, -1.0, 0.5], xs),
        rtol=1e-5,
    )


def test_allclose_and_array_equal_by_name():
    x, a = make(np.random.default_rng(6), ("a", "b"), {"a": 2, "b": 3})
    assert nm.allclose(x, x.rearrange("b a") + 1e-7).item()
    assert not nm.allclose(x, x + 1.0).item()
    assert nm.array_equal(x, x.rearrange("b a")).item()
    assert not nm.array_equal(x, x["a", 0:1]).item()
    assert not nm.array_equal(x, x.rename({"a": "z"})).item()
    n = nm.named(np.array([np.nan, 1.0]), "a")
    assert not nm.array_equal(n, n).item() and nm.array_equal(n, n, equal_nan=True).item()


def test_argmax_argsort_over_all_axes_and_stable():
    a = np.array([[3, 1, 3], [0, 9, 1]], np.float32)
    x = nm.named(a, "r c")
    assert nm.argmax(x).item() == np.argmax(a) and nm.argmin(x).item() == np.argmin(a)
    assert x.argmax(None).axes == ()
    flat = nm.argsort(x, None, new_axis="flat")
    assert flat.axes == (Axis("flat", 6),)
    np.testing.assert_array_equal(np.asarray(flat.array), np.argsort(a, axis=None, kind="stable"))
    np.testing.assert_array_equal(np.asarray(nm.sort(x, None, new_axis="flat").array), np.sort(a, axis=None))
    ties = nm.named(np.array([2, 1, 2, 1, 2], np.int32), "i")
    np.testing.assert_array_equal(
        np.asarray(nm.argsort(ties, "i", stable=True).array), np.argsort(ties.array, kind="stable")
    )
    np.testing.assert_array_equal(
        np.asarray(nm.argsort(x, "c", descending=True).array), np.argsort(-a, axis=1, kind="stable")
    )
    with pytest.raises(
        nm.AxisError, match=r"argsort\(axis=None\) flattens \(r=2, c=3\): name the flat axis with new_axis="
    ):
        nm.argsort(x, None)


def test_standardize_where_uses_only_the_masked_statistics():
    rng = np.random.default_rng(7)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    m = rng.random((5,)) < 0.6
    m[0] = True
    x = nm.named(a, "r c")
    out = nm.standardize(x, "c", where=nm.named(m, "c"), epsilon=1e-6)
    mean = a[:, m].mean(axis=1, keepdims=True)
    var = a[:, m].var(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out.array), (a - mean) / np.sqrt(var + 1e-6), rtol=1e-4, atol=1e-5)


def test_the_new_functions_work_under_jit():
    x, a = make(np.random.default_rng(8), ("a", "b"), {"a": 3, "b": 4})
    f = jax.jit(
        lambda v: (
            nm.unique(v > 0, Axis("u", 2)),
            nm.nonzero(v > 0, Axis("hit", 12))["b"],
            nm.rfft(v, "b"),
            nm.nanmax(v),
        )
    )
    u, hits, spec, top = f(x)
    assert (a > 0).any() and (a <= 0).any()  # so that exactly two distinct values exist
    np.testing.assert_array_equal(np.asarray(u.array), np.unique(a > 0))
    np.testing.assert_array_equal(np.asarray(hits.array)[: int((a > 0).sum())], np.nonzero(a > 0)[1])
    np.testing.assert_allclose(np.asarray(spec.array), np.fft.rfft(a, axis=1), rtol=1e-4, atol=1e-4)
    assert top.item() == pytest.approx(np.nanmax(a))


# ---- Haliax's options and plain arrays ----------------------------------------------------------


def test_reductions_and_predicates_take_plain_arrays_whole():
    a = np.random.default_rng(9).standard_normal((3, 4)).astype(np.float32)
    for name, ref in [
        ("sum", np.sum),
        ("mean", np.mean),
        ("max", np.max),
        ("min", np.min),
        ("std", np.std),
        ("argmax", np.argmax),
        ("nansum", np.nansum),
        ("median", np.median),
    ]:
        out = getattr(nm, name)(jax.numpy.asarray(a))
        assert isinstance(out, nm.NamedArray) and out.axes == ()
        np.testing.assert_allclose(np.asarray(out.array), ref(a), rtol=1e-5, err_msg=name)
    assert bool(nm.all(jax.numpy.asarray(a) == a)) and not bool(nm.any(jax.numpy.asarray(a) > 10))
    assert nm.sum(a, where=a > 0).item() == pytest.approx(a[a > 0].sum(), rel=1e-5)
    assert nm.allclose(a, a + 1e-7).item() and not nm.array_equal(a, a[:2]).item()
    with pytest.raises(nm.ArgumentTypeError, match=r"nm.sum\(x, axis=0\) on a plain array of shape \(3, 4\)"):
        nm.sum(a, 0)


def test_array_equiv_unique_along_an_axis_and_packbits_match_numpy():
    x, a = make(np.random.default_rng(10), ("a", "b"), {"a": 2, "b": 3})
    assert nm.array_equiv(x, x["a", 0:1]).item() is np.array_equiv(a, a[0:1])  # both False: values differ
    row = nm.named(a[0], "b")
    assert nm.array_equiv(nm.broadcast_to(row, x.axes), row).item() and np.array_equiv(
        np.broadcast_to(a[0], a.shape), a[0]
    )
    assert not nm.array_equiv(x, nm.zeros(Axis("b", 5))).item()  # a name with two sizes: False, not an error
    rows = np.array([[1, 2], [3, 4], [1, 2], [0, 9]], np.int32)
    r = nm.named(rows, "row col").rearrange("col row")  # the axis is found by name, not position
    U = Axis("distinct", 4)
    vals, idx, inv, counts = nm.unique_all(r, U, axis="row", fill_value=-1)
    wv, wi, winv, wc = np.unique(rows, axis=0, return_index=True, return_inverse=True, return_counts=True)
    assert vals.names == ("col", "distinct") and inv.axes == (Axis("row", 4),)
    np.testing.assert_array_equal(np.asarray(vals.array).T[:3], wv)
    np.testing.assert_array_equal(np.asarray(idx.array)[:3], wi)
    np.testing.assert_array_equal(np.asarray(inv.array), winv.ravel())
    np.testing.assert_array_equal(np.asarray(counts.array)[:3], wc)
    bits = np.random.default_rng(11).random((3, 11)) < 0.5
    packed = nm.packbits(nm.named(bits, "r bit"), "bit", bitorder="little")
    np.testing.assert_array_equal(np.asarray(packed.array), np.packbits(bits, axis=1, bitorder="little"))
    back = nm.unpackbits(packed, "bit", count=11, bitorder="little")
    np.testing.assert_array_equal(
        np.asarray(back.array),
        np.unpackbits(np.packbits(bits, axis=1, bitorder="little"), axis=1, count=11, bitorder="little"),
    )


def test_repeat_by_array_tile_onto_new_axes_searchsorted_sorter_standardize_stats():
    x, a = make(np.random.default_rng(12), ("a", "b"), {"a": 2, "b": 3})
    counts = np.array([2, 0, 3])
    np.testing.assert_array_equal(
        np.asarray(nm.repeat(x, jax.numpy.asarray(counts), "b").array), np.repeat(a, counts, axis=1)
    )
    assert nm.repeat(x, nm.named(counts, "b"), "b").shape == {"a": 2, "b": 5}
    padded = jax.jit(lambda v, c: nm.repeat(v, c, "b", total_repeat_length=6))(x, jax.numpy.asarray(counts))
    np.testing.assert_array_equal(
        np.asarray(padded.array), np.asarray(jax.numpy.repeat(a, counts, axis=1, total_repeat_length=6))
    )
    with pytest.raises(nm.ArgumentError, match="traced per-entry repeats need total_repeat_length"):
        jax.jit(lambda v, c: nm.repeat(v, c, "b"))(x, jax.numpy.asarray(counts))
    tiled = nm.tile(x, {"copy": 2, "a": 2})
    assert tiled.shape == {"copy": 2, "a": 4, "b": 3}
    np.testing.assert_array_equal(np.asarray(tiled.array), np.tile(a, (2, 2, 1)))
    unsorted = np.array([3.0, 1.0, 2.0, 0.5], np.float32)
    s = nm.named(unsorted, "bins")
    v = nm.named(np.array([0.7, 2.5, 9.0], np.float32), "query")
    for sorter in (nm.argsort(s, "bins"), np.argsort(unsorted)):
        got = nm.searchsorted(s, v, "bins", side="right", sorter=sorter)
        np.testing.assert_array_equal(
            np.asarray(got.array), np.searchsorted(unsorted, v.array, side="right", sorter=np.argsort(unsorted))
        )
    mean, var = nm.named(np.array([0.5, -1.0], np.float32), "a"), 4.0
    out = nm.standardize(x, "b", mean=mean, variance=var, epsilon=0.0)
    np.testing.assert_allclose(as_numpy(out, ("a", "b")), (a - np.array([[0.5], [-1.0]])) / 2.0, rtol=1e-5)
