"""einops-style ``nm.rearrange`` by name against numpy written by hand (einops is not a
dependency): splits by reshape, orders by transpose, merges by reshape, and a patch
extraction checked entry by entry with index arithmetic."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import named as nm
from named import Axis

FAST = settings(max_examples=40, deadline=None)


def _named(shape_by_name: dict[str, int], seed=0):
    arr = np.random.default_rng(seed).standard_normal(tuple(shape_by_name.values())).astype(np.float32)
    return nm.named(arr, tuple(shape_by_name)), arr


def test_the_issue_example_splits_an_axis_the_left_side_does_not_name():
    x, a = _named({"b": 2, "p": 3, "embed": 8})
    y = nm.rearrange(x, "b p (h d) -> b h p d", h=2)
    assert y.axes == (Axis("b", 2), Axis("h", 2), Axis("p", 3), Axis("d", 4))
    np.testing.assert_array_equal(np.asarray(y.array), a.reshape(2, 3, 2, 4).transpose(0, 2, 1, 3))


def test_the_left_side_is_matched_by_name_not_position():
    x, a = _named({"batch": 2, "position": 3, "embed": 8})
    # The same pattern with the left side in any order gives the same result.
    for left in (
        "batch position (embed: heads hd)",
        "(embed: heads hd) batch position",
        "position (embed: heads hd) batch",
    ):
        y = x.rearrange(f"{left} -> batch heads position hd", heads=4)
        np.testing.assert_array_equal(np.asarray(y.array), a.reshape(2, 3, 4, 2).transpose(0, 2, 1, 3))


def test_merge_needs_a_name_and_round_trips():
    x, a = _named({"batch": 2, "heads": 4, "position": 3, "hd": 2})
    y = nm.rearrange(x, "batch heads position hd -> batch position (embed: heads hd)")
    assert y.axes == (Axis("batch", 2), Axis("position", 3), Axis("embed", 8))
    np.testing.assert_array_equal(np.asarray(y.array), a.transpose(0, 2, 1, 3).reshape(2, 3, 8))
    back = y.rearrange("(embed: heads hd) ... -> batch heads position hd", heads=4)
    np.testing.assert_array_equal(np.asarray(back.array), a)
    with pytest.raises(nm.AxisError, match=r"a merged axis needs a name: '\(name: heads hd\)'"):
        nm.rearrange(x, "batch heads position hd -> batch position (heads hd)")


def test_patches_entry_by_entry():
    # An image [batch, height, width, channel] cut into 2x2 patches: each output entry is
    # located by index arithmetic, independently of any reshape.
    x, a = _named({"batch": 2, "height": 4, "width": 6, "channel": 3})
    y = x.rearrange(
        "batch (height: ph hh) (width: pw ww) channel -> batch (patch: ph pw) (pixel: hh ww channel)", hh=2, ww=2
    )
    assert y.axes == (Axis("batch", 2), Axis("patch", 6), Axis("pixel", 12))
    got = np.asarray(y.array)
    for b in range(2):
        for ph in range(2):
            for pw in range(3):
                for hh in range(2):
                    for ww in range(2):
                        for c in range(3):
                            patch, pixel = ph * 3 + pw, (hh * 2 + ww) * 3 + c
                            assert got[b, patch, pixel] == a[b, ph * 2 + hh, pw * 2 + ww, c]


def test_ellipses_on_both_sides_and_inside_a_merge():
    x, a = _named({"batch": 2, "position": 3, "embed": 4, "extra": 5})
    y = x.rearrange("batch ... -> ... batch")
    assert y.names == ("position", "embed", "extra", "batch")
    np.testing.assert_array_equal(np.asarray(y.array), a.transpose(1, 2, 3, 0))
    z = x.rearrange("embed ... -> embed (flat: ...)")
    np.testing.assert_array_equal(np.asarray(z.array), a.transpose(2, 0, 1, 3).reshape(4, 30))
    # A right-side name may pick out an axis the left side's '...' covers.
    w = x.rearrange("batch ... -> extra ... batch")
    np.testing.assert_array_equal(np.asarray(w.array), a.transpose(3, 1, 2, 0))
    # Haliax's unordered spelling: braces select by name and imply '...'.
    v = x.rearrange("{extra position} -> ... extra position")
    np.testing.assert_array_equal(np.asarray(v.array), a.transpose(0, 2, 3, 1))


def test_keywords_bind_axes_and_names():
    x, a = _named({"batch": 2, "embed": 6})
    y = x.rearrange("b (e: h d) -> b d (m: h)", b="batch", e=Axis("embed", 6), h=Axis("heads", 3), m="merged")
    assert y.axes == (Axis("batch", 2), Axis("d", 2), Axis("merged", 3))
    np.testing.assert_array_equal(np.asarray(y.array), a.reshape(2, 3, 2).transpose(0, 2, 1))


def test_the_sequence_form_is_unchanged():
    x, a = _named({"batch": 2, "position": 3, "embed": 4})
    assert x.rearrange(("embed", ...)).names == ("embed", "batch", "position")
    assert nm.rearrange(x, "position batch embed").names == ("position", "batch", "embed")
    with pytest.raises(nm.ArgumentError, match=r"sizes \['h'\] are for a pattern with '->'"):
        nm.rearrange(x, "batch ...", h=2)


def test_under_jit_a_split_is_one_reshape_and_no_transpose():
    x, a = _named({"batch": 2, "embed": 8})
    f = jax.jit(lambda v: v.rearrange("(embed: heads hd) ... -> batch heads hd", heads=2))
    np.testing.assert_array_equal(np.asarray(f(x).array), a.reshape(2, 2, 4))
    prims = [
        e.primitive.name
        for e in jax.make_jaxpr(lambda v: v.rearrange("(embed: heads hd) ... -> batch heads hd", heads=2).array)(x).eqns
    ]
    assert prims == ["reshape"]


@st.composite
def _case(draw):
    """An array, one axis split into two parts, the left side in random order (some names
    hidden behind '...'), and a right side in random order with a random merge."""
    names = draw(st.lists(st.sampled_from("abcde"), unique=True, min_size=1, max_size=4))
    sizes = {n: draw(st.integers(1, 3)) for n in names}
    target = draw(st.sampled_from(names))
    p, q = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    sizes[target] = p * q
    mid = []
    for n in names:
        mid += [(f"{n}1", p), (f"{n}2", q)] if n == target else [(n, sizes[n])]
    left = [f"({target}: {target}1 {target}2)"] + [n for n in names if n != target]
    left = draw(st.permutations(left))
    hidden = (
        draw(st.lists(st.sampled_from([n for n in names if n != target] or ["-"]), unique=True))
        if len(names) > 1
        else []
    )
    left = [t for t in left if t not in hidden] + (["..."] if hidden or draw(st.booleans()) else [])
    order = draw(st.permutations([m for m, _ in mid]))
    k = draw(st.integers(0, len(order)))
    length = draw(st.integers(0, len(order) - k))
    return names, sizes, target, p, q, mid, left, list(order), k, length


@FAST
@given(case=_case(), seed=st.integers(0, 2**31))
def test_split_transpose_merge_match_numpy(case, seed):
    names, sizes, target, p, q, mid, left, order, k, length = case
    x, a = _named({n: sizes[n] for n in names}, seed)
    merged = order[k : k + length]
    right = order[:k] + ([f"(merged: {' '.join(merged)})"] if merged else []) + order[k + length :]
    listed = [t.strip("(").split(":")[0] for t in left if t != "..."]
    if listed != names[: len(listed)]:  # one-letter names out of the array's order: by name only in braces
        left = ["{"] + left + ["}"]
    pattern = f"{' '.join(left)} -> {' '.join(right)}"
    out = nm.rearrange(x, pattern, **{f"{target}1": p})
    # numpy by hand: split the target axis in place, transpose to the right side's order,
    # then merge the chosen run of axes.
    mid_names = [m for m, _ in mid]
    want = a.reshape(tuple(s for _, s in mid)).transpose([mid_names.index(m) for m in order])
    sizes_mid = dict(mid)
    out_shape = (
        [sizes_mid[m] for m in order[:k]]
        + ([int(np.prod([sizes_mid[m] for m in merged]))] if merged else [])
        + [sizes_mid[m] for m in order[k + length :]]
    )
    want = want.reshape(out_shape)
    expected_names = tuple(order[:k]) + (("merged",) if merged else ()) + tuple(order[k + length :])
    assert out.names == expected_names
    np.testing.assert_array_equal(np.asarray(out.array), want)


ERRORS = [
    (
        "b p (h d) -> b h p d",
        {},
        nm.ArgumentError,
        r"splitting 'embed' \(size 8\) into \(h d\) needs the sizes of all parts but one",
    ),
    ("b p (h d) -> b h p d", {"h": 3}, nm.AxisError, r"'embed' of size 8 does not split into \(h d\)"),
    ("b p (h d) -> b h p d", {"h": 2, "d": 2}, nm.AxisError, r"multiply to 4, not to the size 8 of 'embed'"),
    ("b p -> b p", {}, nm.AxisError, r"leaves out axes \['embed'\] .*name them or add '\.\.\.'"),
    ("b ... (h d) -> b h d ...", {"h": 2}, nm.AxisError, r"with '\.\.\.' on the left, say which axis a group splits"),
    ("b p embed -> b p", {}, nm.AxisError, r"axes \['embed'\] are not on the right side .* does not drop axes"),
    ("b p embed -> b p embed b", {}, nm.AxisError, r"axes \['b'\] appear twice on the right side"),
    ("b p embed -> b p heads", {}, nm.AxisError, r"'heads' on the right side .* is not an axis of the left side"),
    ("b b p embed -> b p embed", {}, nm.AxisError, r"axis 'b' appears twice on the left side"),
    ("b p nope -> b p nope", {}, nm.AxisError, r"'nope' not found in array with axes \(b=2, p=3, embed=8\)"),
    ("b p embed -> b p embed", {"h": 2}, nm.ArgumentError, r"keywords \['h'\] name nothing"),
    ("b p embed -> b p embed", {"b": 2.5}, nm.ArgumentTypeError, r"b= must be a size \(int\), an Axis or an axis name"),
    ("b p (embed: (h d)) -> b p h d", {}, nm.AxisError, r"groups do not nest"),
    ("b p embed -> b -> p", {}, nm.AxisError, r"needs exactly one '->'"),
    ("b p embed -> {b p embed}", {}, nm.AxisError, r"braces select axes on the left side only"),
    ("... ... -> ...", {}, nm.AxisError, r"left side .* has more than one '\.\.\.'"),
    ("... -> ... (f: ...)", {}, nm.AxisError, r"right side .* has more than one '\.\.\.'"),
    (
        "b p (embed: h d) -> b p (e: h d)",
        {"h": 2, "e": Axis("e", 9)},
        nm.AxisError,
        r"merged axis 'e' has size 8, not the 9 given",
    ),
]


@pytest.mark.parametrize("pattern, kwargs, exc, message", ERRORS, ids=[e[0] + str(sorted(e[1])) for e in ERRORS])
def test_errors_name_the_pattern_and_the_axis(pattern, kwargs, exc, message):
    x, _ = _named({"b": 2, "p": 3, "embed": 8})
    with pytest.raises(exc, match=message):
        nm.rearrange(x, pattern, **kwargs)
