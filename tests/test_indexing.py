"""Indexing by name against a numpy reference: ints, slices, traced ints, nm.ds, NamedArray
gathers (with the pointwise shared-axis rule), ``x.at[...]`` updates and updated_slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _reference import axis_subsets, expand, make, sizes, union_names
from hypothesis import given, settings
from hypothesis import strategies as st

import named as nm
from named import Axis

FAST = settings(max_examples=25, deadline=None)
X_NAMES = ("a", "b", "c")
IDX_NAMES = ("i", "j")


@st.composite
def index_cases(draw):
    """An array over a..c (random order) and an index: per axis nothing, an int, a slice, or an
    integer NamedArray over new names (i, j) and/or the array's own unindexed names."""
    size_of = draw(sizes(X_NAMES + IDX_NAMES, min_size=1, max_size=4))
    names = tuple(draw(st.permutations(X_NAMES)))
    idx = {}
    for n in names:
        kind = draw(st.sampled_from(["none", "int", "slice", "gather"]))
        if kind == "int":
            idx[n] = draw(st.integers(-size_of[n], size_of[n] - 1))
        elif kind == "slice":
            bound = st.one_of(st.none(), st.integers(-size_of[n] - 1, size_of[n] + 1))
            idx[n] = slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1, 2, -1, -2])))
        elif kind == "gather":
            idx[n] = ("gather", draw(axis_subsets(IDX_NAMES + X_NAMES, max_size=2)))
    # A gather's own axes may not include the axis it indexes nor another indexed axis.
    indexed = set(idx)
    for n, v in list(idx.items()):
        if isinstance(v, tuple):
            idx[n] = ("gather", tuple(m for m in v[1] if m == n or m not in indexed))
    order = draw(st.permutations(list(idx)))
    return size_of, names, {n: idx[n] for n in order}, draw(st.integers(0, 2**31))


def _materialise(size_of, names, spec, seed):
    rng = np.random.default_rng(seed)
    x, xn = make(rng, names, size_of)
    idx, idx_np = {}, {}
    for n, v in spec.items():
        if isinstance(v, tuple):
            inames = v[1]
            arr = rng.integers(
                -size_of[n], size_of[n], tuple(size_of[m] if m != n else size_of[n] for m in inames)
            ).astype(np.int32)
            idx[n] = nm.named(arr, inames)
            idx_np[n] = (arr, inames)
        else:
            idx[n] = v
            idx_np[n] = v
    return x, xn, idx, idx_np


def _expected(size_of, names, xn, idx_np):
    """Output names, sizes and values of ``x[idx]`` from the documented rule, by coordinates."""
    gathered = [(n, v) for n, v in idx_np.items() if isinstance(v, tuple)]
    idx_axes = union_names(*(v[1] for _, v in gathered))
    sizes_out = dict(size_of)
    for n, v in idx_np.items():
        if isinstance(v, slice):
            sizes_out[n] = len(range(*v.indices(size_of[n])))
    point = {n for n in idx_axes if n in names and n not in idx_np}  # matched pointwise
    # a 0-d index (a NamedArray without axes, such as an argmax) drops its axis as an int does, so it
    # does not decide where the gathered axes go
    block = {n for n, v in gathered if v[1]} | point
    dropped = {n for n, v in idx_np.items() if isinstance(v, (int, np.integer)) or (isinstance(v, tuple) and not v[1])}
    out: list[str] = []
    for n in names:
        if n in block:
            if n == next(m for m in names if m in block):
                out.extend(idx_axes)
        elif n not in dropped:
            out.append(n)
    out_t = tuple(out)
    grids = np.indices(tuple(sizes_out[n] for n in out_t), sparse=True)
    coords = []
    for n in names:
        v = idx_np.get(n)
        if isinstance(v, tuple):
            arr, inames = v
            coords.append(expand(arr, inames, out_t, sizes_out) % size_of[n])
        elif isinstance(v, slice):
            coords.append(np.arange(size_of[n])[v][grids[out_t.index(n)]])
        elif v is not None:
            coords.append(v % size_of[n])
        else:
            coords.append(grids[out_t.index(n)])
    shape = tuple(sizes_out[n] for n in out_t)
    return out_t, sizes_out, np.broadcast_to(xn[tuple(coords)], shape), tuple(coords)


@FAST
@given(case=index_cases())
def test_getitem_matches_numpy(case):
    size_of, names, spec, seed = case
    x, xn, idx, idx_np = _materialise(size_of, names, spec, seed)
    out_names, sizes_out, want, _ = _expected(size_of, names, xn, idx_np)
    out = x[idx]
    assert out.names == out_names
    assert out.shape == {n: sizes_out[n] for n in out_names}
    np.testing.assert_array_equal(np.asarray(out.array), want)
    # The tuple spelling is the same thing.
    flat = tuple(t for kv in idx.items() for t in kv)
    if flat:
        np.testing.assert_array_equal(np.asarray(x[flat].array), want)


@settings(max_examples=15, deadline=None)
@given(case=index_cases(), value=st.floats(-5, 5, width=32))
def test_at_set_and_add_match_numpy(case, value):
    size_of, names, spec, seed = case
    x, xn, idx, idx_np = _materialise(size_of, names, spec, seed)
    out_names, sizes_out, _, coords = _expected(size_of, names, xn, idx_np)
    # add with values over the indexed region's axes (np.add.at accumulates repeated indices).
    rng = np.random.default_rng(seed + 1)
    vn = rng.standard_normal(tuple(sizes_out[n] for n in out_names)).astype(np.float32)
    want = xn.copy()
    full = tuple(np.broadcast_to(c, vn.shape) for c in coords)
    np.add.at(want, full, vn)
    out = x.at[idx].add(nm.named(vn, out_names))
    assert out.names == names
    np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-5, atol=1e-5)
    # set with a scalar (repeated indices then agree whichever write wins).
    want = xn.copy()
    want[full] = value
    np.testing.assert_array_equal(np.asarray(x.at[idx].set(value).array), want)
    np.testing.assert_array_equal(np.asarray(x.at[idx].get().array), np.asarray(x[idx].array))


@FAST
@given(size_of=sizes(X_NAMES, max_size=4), names=st.permutations(X_NAMES).map(tuple), data=st.data())
def test_at_set_values_broadcast_by_name(size_of, names, data):
    x, xn = make(np.random.default_rng(0), names, size_of)
    axis = data.draw(st.sampled_from(names))
    sl = slice(0, data.draw(st.integers(1, size_of[axis])))
    region = [n for n in names]
    vnames = data.draw(axis_subsets(tuple(region)))
    sizes_r = dict(size_of, **{axis: sl.stop})
    vals, vn = make(np.random.default_rng(1), vnames, sizes_r)
    want = xn.copy()
    pos = names.index(axis)
    view = (slice(None),) * pos + (sl,)
    want[view] = expand(vn, vnames, names, sizes_r)
    np.testing.assert_array_equal(np.asarray(x.at[axis, sl].set(vals).array), want)
    want2 = xn.copy()
    want2[view] = np.maximum(want2[view], expand(vn, vnames, names, sizes_r))
    np.testing.assert_array_equal(np.asarray(x.at[axis, sl].max(vals).array), want2)
    want3 = xn.copy()
    want3[view] = np.minimum(want3[view], expand(vn, vnames, names, sizes_r))
    np.testing.assert_array_equal(np.asarray(x.at[axis, sl].min(vals).array), want3)
    want4 = xn.copy()
    want4[view] = want4[view] * expand(vn, vnames, names, sizes_r)
    np.testing.assert_allclose(np.asarray(x.at[axis, sl].multiply(vals).array), want4, rtol=1e-6)


def test_pointwise_gather_is_take_along_axis():
    # logits["vocab", targets] with targets[batch, position] picks one logit per token.
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (2, 5)).astype(np.int32)
    x = nm.named(logits, "batch position vocab")
    t = nm.named(targets, "batch position")
    out = x["vocab", t]
    assert out.names == ("batch", "position")
    np.testing.assert_array_equal(np.asarray(out.array), np.take_along_axis(logits, targets[..., None], -1)[..., 0])
    # The index may hold its axes in another order: matched by name, not position; the
    # gathered block takes the index's order.
    out2 = x["vocab", t.rearrange(("position", "batch"))]
    assert out2.names == ("position", "batch")
    np.testing.assert_array_equal(np.asarray(out2.array), np.asarray(out.array).T)
    # A gather over new axes replaces the indexed axis in place.
    ids = nm.named(np.array([[1, 2, 3], [0, 0, 6]], np.int32), "i j")
    g = x["position", nm.named(np.array([4, 0], np.int32), "k")]
    assert g.names == ("batch", "k", "vocab")
    g2 = x["vocab", ids]
    assert g2.names == ("batch", "position", "i", "j")
    np.testing.assert_array_equal(np.asarray(g2.array), logits[:, :, np.asarray(ids.array)])


def test_traced_int_index_under_jit():
    x = nm.named(np.arange(24.0, dtype=np.float32).reshape(2, 3, 4), "a b c")

    @jax.jit
    def pick(x, i):
        return x["b", i]

    for i in range(3):
        out = pick(x, jnp.int32(i))
        assert out.names == ("a", "c")
        np.testing.assert_array_equal(np.asarray(out.array), np.asarray(x.array)[:, i])
    # a 0-d NamedArray works as an int index too
    out = jax.jit(lambda x, i: x["c", i])(x, nm.named(jnp.int32(3), ()))
    np.testing.assert_array_equal(np.asarray(out.array), np.asarray(x.array)[..., 3])


@FAST
@given(size_of=sizes(X_NAMES, min_size=1, max_size=5), names=st.permutations(X_NAMES).map(tuple), data=st.data())
def test_ds_dynamic_slices_with_traced_starts(size_of, names, data):
    x, xn = make(np.random.default_rng(0), names, size_of)
    axis = data.draw(st.sampled_from(names))
    n = size_of[axis]
    length = data.draw(st.integers(1, n))
    start = data.draw(st.integers(-2, n + 2))
    i = names.index(axis)
    clamped = min(max(start + n if start < 0 else start, 0), n - length)  # lax.dynamic_slice's rule
    want = np.take(xn, range(clamped, clamped + length), axis=i)

    get = jax.jit(lambda x, s: x[axis, nm.ds(s, length)])
    out = get(x, jnp.int32(start))
    assert out.names == names and out.axis_size(axis) == length
    np.testing.assert_array_equal(np.asarray(out.array), want)
    # x[ds] and x.at[ds] agree on where the window is, in bounds or not.
    upd = jax.jit(lambda x, s: x.at[axis, nm.ds(s, length)].set(0.0))(x, jnp.int32(start))
    want_set = xn.copy()
    view = (slice(None),) * i + (slice(clamped, clamped + length),)
    want_set[view] = 0.0
    np.testing.assert_array_equal(np.asarray(upd.array), want_set)
    # ds combined with an int on another axis
    other = next(m for m in names if m != axis)
    mixed = jax.jit(lambda x, s: x[axis, nm.ds(s, length), other, 0])(x, jnp.int32(start))
    assert mixed.names == tuple(m for m in names if m != other)
    np.testing.assert_array_equal(np.asarray(mixed.array), np.take(want, 0, axis=names.index(other)))
    # a static start is checked instead of clamped: the same window when it fits, else an error
    if 0 <= (start + n if start < 0 else start) <= n - length:
        np.testing.assert_array_equal(np.asarray(x[axis, nm.ds(start, length)].array), want)
    else:
        with pytest.raises(nm.AxisError, match="does not fit"):
            x[axis, nm.ds(start, length)]


@FAST
@given(size_of=sizes(X_NAMES, min_size=1, max_size=4), names=st.permutations(X_NAMES).map(tuple), data=st.data())
def test_updated_slice_is_dynamic_update_slice(size_of, names, data):
    x, xn = make(np.random.default_rng(0), names, size_of)
    unames = data.draw(axis_subsets(names))
    usize = {n: data.draw(st.integers(1, size_of[n])) for n in unames}
    upd, un = make(np.random.default_rng(1), unames, usize)
    starts = {n: data.draw(st.integers(0, size_of[n] - usize.get(n, 1))) for n in names}
    out = jax.jit(lambda x, s, u: nm.updated_slice(x, s, u))(x, {n: jnp.int32(v) for n, v in starts.items()}, upd)
    want = xn.copy()
    block = expand(un, unames, names, {n: usize.get(n, 1) for n in names})
    view = tuple(slice(starts[n], starts[n] + usize.get(n, 1)) for n in names)
    want[view] = block
    assert out.names == names
    np.testing.assert_array_equal(np.asarray(out.array), want)


@FAST
@given(size_of=sizes(X_NAMES + ("i",), max_size=4), names=st.permutations(X_NAMES).map(tuple), data=st.data())
def test_take_is_getitem(size_of, names, data):
    x, xn = make(np.random.default_rng(0), names, size_of)
    axis = data.draw(st.sampled_from(names))
    k = data.draw(st.integers(0, size_of[axis] - 1))
    np.testing.assert_array_equal(np.asarray(nm.take(x, axis, k).array), np.take(xn, k, axis=names.index(axis)))
    ids = np.random.default_rng(2).integers(0, size_of[axis], (size_of["i"],)).astype(np.int32)
    out = x.take(axis, nm.named(ids, "i"))
    assert out.names == tuple("i" if n == axis else n for n in names)
    np.testing.assert_array_equal(np.asarray(out.array), np.take(xn, ids, axis=names.index(axis)))


def test_indexing_by_axis_object_and_mapping():
    A = Axis("a", 3)
    x = nm.named(np.arange(6).reshape(3, 2), (A, "b"))
    np.testing.assert_array_equal(np.asarray(x[A, 1].array), [2, 3])
    np.testing.assert_array_equal(np.asarray(x[{"b": 0, "a": slice(1, None)}].array), [2, 4])
    assert x["a", 0:2].shape == {"a": 2, "b": 2}


@pytest.mark.parametrize("bad", [[0, 1], np.array([0, 1]), 1.5, "x"])
def test_unsupported_index_values_are_refused(bad):
    x = nm.named(np.zeros((3, 2)), "a b")
    with pytest.raises(nm.AxisError, match="unsupported index"):
        x["a", bad]
