"""The contraction forms beyond per-operand specs, against np.einsum: the braces form
(``{embed heads} -> ...``), the output-only form (``-> batch out``, ``... -> batch out``) and
``nm.dot(..., out_axes=)``; and error text that names the caller's argument, never ours."""

from __future__ import annotations

import numpy as np
import pytest
from _reference import axis_subsets, first_seen_names, make, sizes
from hypothesis import given, settings
from hypothesis import strategies as st

import named as nm

FAST = settings(max_examples=25, deadline=None)


def _np_einsum(groups, arrays, out_names):
    every = first_seen_names(*groups)
    letters = {n: chr(ord("a") + i) for i, n in enumerate(every)}
    spec = ",".join("".join(letters[n] for n in g) for g in groups) + "->" + "".join(letters[n] for n in out_names)
    return np.einsum(spec, *(a.astype(np.float64) for a in arrays))


def _operands(data):
    size_of = data.draw(sizes())
    groups = [data.draw(axis_subsets(min_size=0)) for _ in range(data.draw(st.integers(1, 3)))]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    made = [make(rng, g, size_of) for g in groups]
    return size_of, groups, [m[0] for m in made], [m[1] for m in made]


def _check(out, want, out_names, size_of):
    assert out.names == tuple(out_names)
    assert out.shape == {n: size_of[n] for n in out_names}
    np.testing.assert_allclose(np.asarray(out.array), want, rtol=1e-4, atol=1e-4)


@FAST
@given(data=st.data())
def test_braces_contract_the_named_axes_and_keep_the_rest(data):
    size_of, groups, named, arrays = _operands(data)
    every = first_seen_names(*groups)
    listed = list(data.draw(axis_subsets(every)))
    rest_in_play = data.draw(st.booleans())  # '...' inside the braces
    kept = list(data.draw(axis_subsets(every)))
    unlisted = [n for n in every if n not in listed and n not in kept]
    use_out_ellipsis = data.draw(st.booleans()) or (unlisted and not rest_in_play)
    # The rule, restated: an axis the output names is kept; an unnamed axis goes to the
    # output's '...' if there is one; everything else is summed over.
    if use_out_ellipsis:
        k = data.draw(st.integers(0, len(kept)))
        out_tokens = kept[:k] + ["..."] + kept[k:]
        out_names = kept[:k] + [n for n in every if n not in listed and n not in kept] + kept[k:]
    else:
        out_tokens, out_names = kept, kept
    braces = "{" + " ".join(listed + (["..."] if rest_in_play else [])) + "}"
    out = nm.einsum(f"{braces} -> {' '.join(out_tokens)}", *named)
    _check(out, _np_einsum(groups, arrays, out_names), out_names, size_of)


@FAST
@given(data=st.data(), spelling=st.sampled_from(["", "...", "{...}"]))
def test_output_only_form_sums_everything_it_does_not_keep(data, spelling):
    size_of, groups, named, arrays = _operands(data)
    kept = data.draw(axis_subsets(first_seen_names(*groups)))
    out = nm.einsum(f"{spelling} -> {' '.join(kept)}", *named)
    _check(out, _np_einsum(groups, arrays, kept), kept, size_of)


def test_the_issue_spellings():
    rng = np.random.default_rng(0)
    x, xn = make(rng, ("batch", "position", "embed"), {"batch": 2, "position": 3, "embed": 4})
    w, wn = make(rng, ("embed", "heads", "out"), {"embed": 4, "heads": 2, "out": 5})
    out = nm.einsum("... -> batch out", x, w)
    np.testing.assert_allclose(np.asarray(out.array), np.einsum("bpe,eho->bo", xn, wn), rtol=1e-5)
    grouped = nm.einsum("{embed heads} -> ...", x, w)
    assert grouped.names == ("batch", "position", "out")
    np.testing.assert_allclose(np.asarray(grouped.array), np.einsum("bpe,eho->bpo", xn, wn), rtol=1e-5)


@FAST
@given(data=st.data())
def test_dot_out_axes_orders_the_result(data):
    size_of, groups, named, arrays = _operands(data)
    every = first_seen_names(*groups)
    contract = data.draw(axis_subsets(every))
    kept = [n for n in every if n not in contract]
    order = list(data.draw(st.permutations(kept)))
    if data.draw(st.booleans()):  # '...' for the ones out_axes leaves out
        listed = order[: data.draw(st.integers(0, len(order)))]
        k = data.draw(st.integers(0, len(listed)))
        spec = listed[:k] + [...] + listed[k:]
        order = listed[:k] + [n for n in kept if n not in listed] + listed[k:]
    else:
        spec = order
    out = nm.dot(*named, axis=contract, out_axes=spec)
    _check(out, _np_einsum(groups, arrays, order), order, size_of)


def test_dot_errors_name_the_callers_arguments():
    x = nm.zeros((nm.Axis("batch", 2), nm.Axis("embed", 3)))
    w = nm.zeros((nm.Axis("embed", 3), nm.Axis("mlp", 4)))
    with pytest.raises(
        nm.ArgumentTypeError, match=r"nm.dot got unexpected keyword arguments \['preferred_type'\]"
    ) as e:
        nm.dot(x, w, axis="embed", preferred_type=np.float32)
    assert "_contract" not in str(e.value)
    with pytest.raises(nm.AxisError, match=r"out_axes names 'embed', which axis= contracts"):
        nm.dot(x, w, axis="embed", out_axes=("embed", ...))
    with pytest.raises(nm.AxisError, match=r"nm.dot out_axes: .* leaves out axes \['batch'\]"):
        nm.dot(x, w, axis="embed", out_axes="mlp")
    with pytest.raises(nm.ArgumentTypeError, match=r"nm.einsum got unexpected keyword arguments \['out_axes'\]"):
        nm.einsum("batch embed, embed mlp -> batch mlp", x, w, out_axes="mlp")
    with pytest.raises(nm.AxisError, match=r"einsum has no groups"):
        nm.einsum("batch (embed) -> batch", x)
    with pytest.raises(nm.AxisError, match=r"axes \['heads'\] are in no operand"):
        nm.einsum("{heads} -> ...", x)
    with pytest.raises(nm.AxisError, match=r"more than one '\.\.\.'"):
        nm.einsum("{embed} -> ... ...", x)
    with pytest.raises(nm.AxisError, match=r"axes \['batch'\] come in through '\.\.\.'"):
        nm.einsum("{embed} -> mlp", x, w)
