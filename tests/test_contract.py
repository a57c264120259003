"""The edge-case contract of the public surface (docs/named_arrays.md, "The edge-case contract").

Every public function and class that tests/_surface.py walks belongs to exactly one kind of
``KINDS``. A kind names its members and says, for each class of input in ``COLUMNS``, the one
rule they all follow (the text of the docs' table) and holds the probe that checks that rule on
every member with generated inputs: a plain array, an axis the array lacks, an extra axis, one
name with two sizes, a zero-size axis, a wrong dtype, an out-of-range static value. A rule
is either an error (a ``NamedError`` subclass whose message names the culprit) or a result, and
the results are checked against numpy, jnp or the member itself on slices, never taken on
trust. A column a kind has no input for is ``—`` in the table and has no probe.

``test_every_public_name_has_a_row`` fails for a public name that no kind lists; the docs' table
is rendered from ``KINDS`` (``render``) and ``python tests/test_contract.py`` rewrites it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import pathlib
import re
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _surface import public_surface

import named as nm
from named import Axis, nn

COLUMNS = {
    "plain": "plain array",
    "missing": "missing axis",
    "extra": "extra axis",
    "size": "size mismatch",
    "zero": "zero-size axis",
    "dtype": "wrong dtype",
    "range": "out of range",
}

A, B, C, Z = Axis("a", 3), Axis("b", 4), Axis("c", 2), Axis("z", 0)


# ---- generated inputs ------------------------------------------------------------------------------------


def values(*axes: Axis, dtype=jnp.float32, seed: int = 0, offset: float = 0.1) -> nm.NamedArray:
    """Distinct values ``0.25 k + offset`` (k a permutation around 0): no ties and no kinks at the
    integers; integer and bool dtypes get ``1 .. n`` and alternating truth values."""
    n = math.prod(a.size for a in axes)
    k = np.random.default_rng(seed).permutation(n)
    if jnp.issubdtype(dtype, jnp.bool_):
        v = k % 2 == 0
    elif jnp.issubdtype(dtype, jnp.integer):
        v = k + 1
    else:
        v = 0.25 * (k - n // 2) + offset
    return nm.named(jnp.asarray(v.reshape([a.size for a in axes]), dtype), axes)


X = values(A, B)
KEY = jax.random.key(0)


def plain(x: nm.NamedArray = X):
    return x.array


def renamed(x: nm.NamedArray, old: str, new: str) -> nm.NamedArray:
    return x.rename({old: new})


def resized(x: nm.NamedArray, name: str, size: int, seed: int = 1) -> nm.NamedArray:
    return values(*(a.resize(size) if a.name == name else a for a in x.axes), dtype=x.dtype, seed=seed)


def with_extra(x: nm.NamedArray, seed: int = 2) -> nm.NamedArray:
    """``x`` with the bystander axis ``c`` in front, each of its slices different."""
    return values(C, *x.axes, dtype=x.dtype, seed=seed)


# ---- checks ----------------------------------------------------------------------------------------------


def describe(out) -> str:
    leaves = jax.tree.leaves(out, is_leaf=nm.is_named_array)
    return (
        ", ".join(
            repr(leaf)[:80] if not isinstance(leaf, nm.NamedArray) else f"NamedArray{leaf.shape}" for leaf in leaves[:3]
        )
        or repr(out)[:80]
    )


def refused(thunk: Callable[[], Any], exc: type = nm.NamedError, *words: str) -> None:
    """``thunk()`` raises ``exc`` (a NamedError) whose message holds every one of ``words``."""
    try:
        out = thunk()
    except nm.NamedError as e:
        if not isinstance(e, exc):
            raise AssertionError(f"raised {type(e).__name__}, not {exc.__name__}: {e}") from None
        missing = [w for w in words if w not in str(e)]
        if missing:
            raise AssertionError(f"the message does not name {missing}: {e}") from None
        return
    except Exception as e:  # noqa: BLE001 - what is being checked: no raw error gets out
        raise AssertionError(f"a raw {type(e).__name__} instead of a NamedError: {str(e)[:300]}") from None
    raise AssertionError(f"no error: returned {describe(out)}")


def runs(thunk: Callable[[], Any]):
    """``thunk()``; a raw (non-NamedError) exception is a failure of the contract."""
    try:
        return thunk()
    except nm.NamedError:
        raise
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"a raw {type(e).__name__}: {str(e)[:300]}") from None


def _named_leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=nm.is_named_array)


def as_numpy(v) -> np.ndarray:
    v = np.asarray(v.array if isinstance(v, nm.NamedArray) else v)
    return v.astype(np.complex128 if np.iscomplexobj(v) else np.float64)


def same(got, want, what: str = "result", tol: float = 1e-5) -> None:
    """Two trees of NamedArrays with the same axes (any order) and entries (NaN equals NaN)."""
    g, w = _named_leaves(got), _named_leaves(want)
    assert len(g) == len(w), f"{what}: {len(g)} leaves, expected {len(w)}"
    for a, b in zip(g, w):
        if isinstance(b, nm.NamedArray):
            assert isinstance(a, nm.NamedArray), f"{what}: {describe(a)} is not a NamedArray"
            assert set(a.axes) == set(b.axes), f"{what}: axes {a.shape}, expected {b.shape}"
            a = a.rearrange(b.names)
        np.testing.assert_allclose(as_numpy(a), as_numpy(b), rtol=tol, atol=tol, equal_nan=True, err_msg=what)


def per_slice(call: Callable[[nm.NamedArray], Any], x: nm.NamedArray, axis: str = "c") -> None:
    """An axis ``call`` does not act on is carried through: every NamedArray of ``call(x)`` has it, and
    slice ``i`` of the result is ``call`` of slice ``i`` of ``x``."""
    out = runs(lambda: call(x))
    leaves = _named_leaves(out)
    assert leaves and all(isinstance(v, nm.NamedArray) and axis in v.names for v in leaves), (
        f"the extra axis {axis!r} is not in every result: {describe(out)}"
    )
    for i in range(x.axis_size(axis)):
        same(jax.tree.map(lambda v: v[axis, i], out, is_leaf=nm.is_named_array), call(x[axis, i]), f"slice {axis}={i}")


def numpy_or_refused(ours: Callable[[], Any], reference: Callable[[], Any], exc: type, *words: str) -> None:
    """``ours()`` gives what the numpy (or jnp) ``reference()`` gives; where the reference refuses
    (raises), ours raises ``exc`` naming ``words`` instead of a raw error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = reference()
    except Exception:  # noqa: BLE001 - the reference's refusal, whatever its class
        refused(ours, exc, *words)
        return
    got = runs(ours)
    np.testing.assert_allclose(as_numpy(got), as_numpy(want), rtol=1e-5, atol=1e-5, equal_nan=True)


# ---- the table -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """One cell of the table: what the docs say, and ``probe(name, member)``, which checks it."""

    text: str
    probe: Callable[[str, Any], None]


@dataclasses.dataclass(frozen=True)
class Kind:
    title: str
    members: tuple[str, ...]
    rules: dict[str, Rule]  # column -> rule; a column a kind takes no input for is absent ("—")


KINDS: list[Kind] = []


def kind(title: str, members: str, **rules: Rule) -> Kind:
    """Register a kind; ``members``: public names separated by spaces (``nm.add nn.celu``)."""
    assert set(rules) <= set(COLUMNS), sorted(set(rules) - set(COLUMNS))
    k = Kind(title, tuple(members.split()), {c: rules[c] for c in COLUMNS if c in rules})
    KINDS.append(k)
    return k


def takes(fn, keyword: str) -> bool:
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


WRAP = "wrap it with nm.named"
MASK_B = nm.named(jnp.asarray([True, False, True, True]), (B,))


# ---- members with cases of their own ---------------------------------------------------------------------


def must(thunk: Callable[[], Any], exc: type = nm.NamedError, *words: str) -> Callable[[], None]:
    """A check: ``thunk()`` raises ``exc`` naming ``words``."""
    return lambda: refused(thunk, exc, *words)


def gives(thunk: Callable[[], Any], want: Callable[[], Any]) -> Callable[[], None]:
    """A check: ``thunk()`` gives what ``want()`` gives (a NamedArray: the same axes and entries; else the
    same entries, as numpy's reference)."""

    def check():
        got, expected = runs(thunk), want()
        if isinstance(expected, nm.NamedArray):
            same(got, expected)
        else:
            np.testing.assert_allclose(as_numpy(got), as_numpy(expected), rtol=1e-6, atol=1e-6)

    return check


def checks(*cs: Callable[[], None]) -> Callable[[], None]:
    def run():
        for c in cs:
            c()

    return run


def by_member(table: dict[str, dict[str, Callable[[], None]]], column: str):
    """A column's probe that runs each member's own check for it (a member without one has no such input)."""

    def probe(name, fn):
        case = table[name].get(column)
        if case is not None:
            case()

    return probe


def cases_kind(title: str, table: dict, **texts: str) -> Kind:
    """A kind whose members each give their own check per column (``table[name][column]``); every
    column with a text must be checked by at least one member."""
    for column in texts:
        assert any(column in t for t in table.values()), f"{title}: no member checks {column}"
    return kind(title, " ".join(table), **{c: Rule(t, by_member(table, c)) for c, t in texts.items()})


# ---- elementwise -----------------------------------------------------------------------------------------

DTYPES = (jnp.float32, jnp.int32, jnp.bool_)


def abstract(fn: Callable, *args):
    """``fn(*args)`` traced, not compiled (``jax.eval_shape``): its axes and dtypes, and any error it raises
    before computing, at no compile's cost."""
    return runs(lambda: jax.eval_shape(fn, *args))


def _takes_dtype(ref, dtype, n: int) -> bool:
    try:
        jax.eval_shape(ref, *[jax.ShapeDtypeStruct((), dtype)] * n)
        return True
    except Exception:  # noqa: BLE001 - jnp does not take this dtype
        return False


def _arity(name: str) -> int:
    return 1 if name in UNARY.members else {"nm.where": 3, "nm.clip": 3}.get(name, 2)


def _operands(name, fn, *axes_each, dtype=None) -> list[nm.NamedArray]:
    """One operand over each tuple of ``axes_each``, in the first dtype of DTYPES that the op's jnp
    function (``__wrapped__``) takes (integers for a bitwise op)."""
    ref = getattr(fn, "__wrapped__", None)
    dt = dtype or next((d for d in DTYPES if ref is None or _takes_dtype(ref, d, len(axes_each))), None)
    assert dt is not None, "jnp's function takes none of DTYPES"
    return [values(*axes, dtype=dt, seed=i) for i, axes in enumerate(axes_each)]


def _elementwise_plain(name, fn):
    ops = _operands(name, fn, *[(A, B)] * _arity(name))
    refused(lambda: fn(*[plain(o) for o in ops]), nm.AxisError, WRAP)
    _same_names(abstract(fn, *[o.array[0, 0] for o in ops]), ())  # 0-d: a scalar


def _elementwise_dtype(name, fn):
    """Each dtype of DTYPES gives the dtype jnp's function gives; where jnp refuses the dtype, an
    ArgumentTypeError names it."""
    ref = getattr(fn, "__wrapped__", None)
    for dt in DTYPES:
        ops = [values(A, B, dtype=dt, seed=i) for i in range(_arity(name))]
        if ref is None or not _takes_dtype(ref, dt, len(ops)):
            if ref is None:
                abstract(fn, *ops)
            else:
                refused(lambda: fn(*ops), nm.ArgumentTypeError, jnp.dtype(dt).name)
            continue
        got, want = abstract(fn, *ops), jax.eval_shape(ref, *(o.array for o in ops))
        assert (got.dtype, got.names) == (want.dtype, ("a", "b")), f"{jnp.dtype(dt).name}: {got}, jnp gives {want}"


def _unary_extra(name, fn):
    x = with_extra(_operands(name, fn, (A, B))[0])
    ref = getattr(fn, "__wrapped__", None)
    if ref is None:
        per_slice(fn, x)
        return
    out = runs(lambda: fn(x))  # entry by entry against jnp on the positional array (the same compiled program)
    same(out, nm.named(ref(x.array), x.axes))


def _same_names(out, names) -> None:
    assert isinstance(out, (nm.NamedArray, jax.ShapeDtypeStruct)) or hasattr(out, "names"), describe(out)
    got = tuple(out.names) if hasattr(out, "names") else None
    assert got == tuple(names), f"{describe(out)}: expected axes {tuple(names)}"


UNARY = kind(
    "elementwise, one operand",
    "nm.abs nm.negative nm.sign nm.exp nm.exp2 nm.expm1 nm.log nm.log2 nm.log10 nm.log1p nm.sqrt nm.rsqrt nm.cbrt "
    "nm.square nm.reciprocal nm.sin nm.cos nm.tan nm.arcsin nm.arccos nm.arctan nm.sinh nm.cosh nm.tanh nm.arcsinh "
    "nm.arccosh nm.arctanh nm.floor nm.ceil nm.round nm.trunc nm.isnan nm.isinf nm.isfinite nm.logical_not nm.invert "
    "nm.conj nm.real nm.imag nm.erf nm.erfc nm.sigmoid nm.log_sigmoid nm.softplus nm.relu nm.relu6 nm.silu nm.elu "
    "nm.leaky_relu nm.gelu nm.bitwise_not nm.bitwise_count nm.signbit nm.nan_to_num nm.deg2rad nm.rad2deg nm.sinc "
    "nm.angle nm.absolute nm.fabs nm.positive nm.rint nm.degrees nm.radians nm.conjugate nm.i0 nm.isneginf "
    "nm.isposinf nm.isreal nm.iscomplex nm.bitwise_invert nn.celu nn.selu nn.hard_sigmoid nn.hard_silu nn.hard_tanh "
    "nn.soft_sign nn.mish nn.relu_squared nn.quick_gelu",
    plain=Rule(
        "an array with dimensions: `AxisError` (wrap it with `nm.named`); a 0-d array or a number is a scalar",
        _elementwise_plain,
    ),
    extra=Rule("kept: computed entry by entry", _unary_extra),
    zero=Rule(
        "an empty result with the same axes",
        lambda name, fn: _same_names(abstract(fn, *_operands(name, fn, (A, Z))), ("a", "z")),
    ),
    dtype=Rule(
        "jnp's promotion; a dtype jnp refuses (a float into a bitwise op, a bool into `negative`): "
        "`ArgumentTypeError` naming the dtype",
        _elementwise_dtype,
    ),
)


def _union_case(name, fn):
    """``op(x[a, b], y[c, b], ...)`` has axes (a, b, c), each entry jnp's on the entries it broadcasts from
    (laid out here by numpy indexing, as a reference independent of the library's)."""
    n = _arity(name)
    x, y, *rest = _operands(name, fn, (A, B), (C, B), *[(B,)] * (n - 2))
    out = runs(lambda: fn(x, y, *rest))
    _same_names(out, ("a", "b", "c"))
    ref = getattr(fn, "__wrapped__", None)
    if ref is None:
        per_slice(lambda v: fn(x, v, *rest), y)
        return
    want = ref(x.array[:, :, None], y.array.T[None], *(r.array[None, :, None] for r in rest))
    same(out, nm.named(want, ("a", "b", "c")))


def _mismatch_case(name, fn):
    n = _arity(name)
    ops = _operands(name, fn, (A, B), *[(B.resize(5),)] * (n - 1))
    refused(lambda: fn(*ops), nm.AxisError, "'b'", "size 4", "5")


kind(
    "elementwise, several operands (the broadcasting rule)",
    "nm.add nm.subtract nm.multiply nm.divide nm.floor_divide nm.mod nm.power nm.maximum nm.minimum nm.arctan2 "
    "nm.hypot nm.logaddexp nm.equal nm.not_equal nm.less nm.less_equal nm.greater nm.greater_equal nm.logical_and "
    "nm.logical_or nm.logical_xor nm.bitwise_and nm.bitwise_or nm.bitwise_xor nm.isclose nm.where nm.clip "
    "nm.left_shift nm.right_shift nm.gcd nm.lcm nm.fmax nm.fmin nm.fmod nm.copysign nm.heaviside nm.logaddexp2 "
    "nm.float_power nm.nextafter nm.bitwise_left_shift nm.bitwise_right_shift",
    plain=UNARY.rules["plain"],
    extra=Rule("the union of the operands' axes, each entry from the entries it broadcasts from", _union_case),
    size=Rule("`AxisError` naming the axis and both sizes", _mismatch_case),
    zero=Rule(
        "an empty result over the union of the axes",
        lambda name, fn: _same_names(
            abstract(fn, *_operands(name, fn, (A, Z), *[(Z,)] * (_arity(name) - 1))), ("a", "z")
        ),
    ),
    dtype=UNARY.rules["dtype"],
)


# ---- reductions ------------------------------------------------------------------------------------------


def _np_reduction(name: str):
    short = name.split(".")[1]
    if short == "logsumexp":
        return lambda a, axis=None: np.log(np.sum(np.exp(np.asarray(a, np.float64)), axis=axis))
    return getattr(np, short)


def _where_probe(check):
    """A probe for the members that take ``where=``; the others have no such input."""

    def probe(name, fn):
        if takes(fn, "where"):
            check(name, fn)

    return probe


def _reduction_plain(name, fn):
    numpy_or_refused(lambda: fn(plain()), lambda: _np_reduction(name)(np.asarray(plain())), nm.ArgumentTypeError)
    refused(lambda: fn(plain(), "a"), nm.ArgumentTypeError, "axis='a'", "nm.named")


def _reduction_extra(name, fn):
    per_slice(lambda v: fn(v, "b"), with_extra(X))
    if takes(fn, "where"):
        refused(lambda: fn(X, "b", where=nm.broadcast_axis(MASK_B, C)), nm.AxisError, "where=", "c=2")


kind(
    "reductions over names",
    "nm.sum nm.mean nm.prod nm.max nm.min nm.std nm.var nm.logsumexp nm.any nm.all nm.nansum nm.nanmean nm.nanprod "
    "nm.nanstd nm.nanvar nm.nanmax nm.nanmin nm.amax nm.amin nm.median nm.nanmedian nm.ptp nm.count_nonzero",
    plain=Rule(
        "reduced whole to a 0-d NamedArray (Haliax's `nm.all(a == b)`); an `axis` is refused "
        "(`ArgumentTypeError`: a plain array has no names)",
        _reduction_plain,
    ),
    missing=Rule(
        "`AxisError` naming it and the array's axes; a name given twice too",
        lambda name, fn: (
            refused(lambda: fn(X, "nope"), nm.AxisError, "'nope'", "a=3, b=4"),
            refused(lambda: fn(X, ("a", "a")), nm.AxisError, "'a'", "twice"),
        ),
    ),
    extra=Rule("kept; a `where=` mask with an axis the array lacks: `AxisError`", _reduction_extra),
    size=Rule(
        "a `where=` mask with another size: `AxisError` naming the axis",
        _where_probe(
            lambda name, fn: refused(lambda: fn(X, "b", where=resized(MASK_B, "b", 5) > 0), nm.AxisError, "'b'")
        ),
    ),
    zero=Rule(
        "numpy's result (sum 0, prod 1, any False, all True, logsumexp -inf, count 0; mean, var, std and "
        "median NaN); where numpy has none (max, min, ptp of nothing): `AxisError` naming the axis",
        lambda name, fn: numpy_or_refused(
            lambda: fn(values(A, Z), "z"),
            lambda: _np_reduction(name)(np.ones((3, 0), np.float32), axis=1),
            nm.AxisError,
            "'z'",
        ),
    ),
    dtype=Rule(
        "a bool or int array reduces as in numpy; a `where=` mask that is not boolean: `ArgumentTypeError`",
        lambda name, fn: (
            numpy_or_refused(
                lambda: fn(values(A, B, dtype=jnp.bool_), "b"),
                lambda: _np_reduction(name)(np.asarray(values(A, B, dtype=jnp.bool_).array), axis=1),
                nm.ArgumentTypeError,
            ),
            _where_probe(
                lambda n, f: refused(
                    lambda: f(X, "b", where=MASK_B.astype(jnp.float32)), nm.ArgumentTypeError, "boolean"
                )
            )(name, fn),
        ),
    ),
)

kind(
    "arg reductions",
    "nm.argmax nm.argmin nm.nanargmax nm.nanargmin",
    plain=Rule(
        "numpy's flat index over the whole array; an `axis` is refused (`ArgumentTypeError`)",
        lambda name, fn: (
            numpy_or_refused(
                lambda: fn(plain()), lambda: getattr(np, name[3:])(np.asarray(plain())), nm.ArgumentTypeError
            ),
            refused(lambda: fn(plain(), "a"), nm.ArgumentTypeError, "nm.named"),
        ),
    ),
    missing=Rule(
        "`AxisError` naming it; several names too (one axis, or None for the flat index)",
        lambda name, fn: (
            refused(lambda: fn(X, "nope"), nm.AxisError, "'nope'"),
            refused(lambda: fn(X, ("a", "b")), nm.AxisError, "one axis"),
        ),
    ),
    extra=Rule("kept", lambda name, fn: per_slice(lambda v: fn(v, "b"), with_extra(X))),
    zero=Rule(
        "`AxisError` naming the axis: an empty axis has no largest entry (numpy's ValueError)",
        lambda name, fn: refused(lambda: fn(values(A, Z), "z"), nm.AxisError, "'z'"),
    ),
)


def _along_zero(name, fn):
    out = runs(lambda: fn(values(A, Z), "z"))
    _same_names(out, ("a", "z"))


kind(
    "along one axis, the shape kept",
    "nm.softmax nm.log_softmax nm.standardize nm.cumsum nm.cumprod nm.nancumsum nm.nancumprod nm.sort nm.argsort "
    "nm.fftshift nm.ifftshift",
    plain=Rule(
        "`ArgumentTypeError`: wrap it with `nm.named`",
        lambda name, fn: refused(lambda: fn(plain(), "b"), nm.ArgumentTypeError, WRAP),
    ),
    missing=Rule("`AxisError` naming it", lambda name, fn: refused(lambda: fn(X, "nope"), nm.AxisError, "'nope'")),
    extra=Rule(
        "kept: each slice on its own; a `where=` mask with an axis the array lacks: `AxisError`",
        lambda name, fn: (
            per_slice(lambda v: fn(v, "b"), with_extra(X)),
            _where_probe(
                lambda n, f: refused(lambda: f(X, "b", where=nm.broadcast_axis(MASK_B, C)), nm.AxisError, "c=2")
            )(name, fn),
        ),
    ),
    size=Rule(
        "a `where=` mask with another size: `AxisError` naming the axis",
        _where_probe(
            lambda name, fn: refused(lambda: fn(X, "b", where=resized(MASK_B, "b", 5) > 0), nm.AxisError, "'b'")
        ),
    ),
    zero=Rule("an empty result with the same axes", _along_zero),
    dtype=Rule(
        "an int or bool array computes as jnp computes it; a `where=` mask that is not boolean: `ArgumentTypeError`",
        lambda name, fn: (
            _same_names(runs(lambda: fn(values(A, B, dtype=jnp.int32), "b")), ("a", "b")),
            _where_probe(
                lambda n, f: refused(lambda: f(X, "b", where=MASK_B.astype(jnp.int32)), nm.ArgumentTypeError, "boolean")
            )(name, fn),
        ),
    ),
)


X1 = values(A, B.resize(1))


def _fft_reference(name):
    return getattr(np.fft, name[3:])


kind(
    "Fourier transforms",
    "nm.fft nm.ifft nm.rfft nm.irfft nm.hfft nm.ihfft",
    plain=Rule(
        "`ArgumentTypeError`: wrap it with `nm.named`",
        lambda name, fn: refused(lambda: fn(plain(), "b"), nm.ArgumentTypeError, WRAP),
    ),
    missing=Rule("`AxisError` naming it", lambda name, fn: refused(lambda: fn(X, "nope"), nm.AxisError, "'nope'")),
    extra=Rule("kept: each slice on its own", lambda name, fn: per_slice(lambda v: fn(v, "b"), with_extra(X))),
    zero=Rule(
        "`AxisError` naming the axis (numpy: no FFT of 0 points)",
        lambda name, fn: refused(lambda: fn(values(A, Z), "z"), nm.AxisError, "'z'"),
    ),
    dtype=Rule(
        "numpy's: an int array is transformed as float; a complex one into a real transform: `ArgumentTypeError`",
        lambda name, fn: [
            numpy_or_refused(
                lambda: fn(v, "b"), lambda: getattr(jnp.fft, name[3:])(v.array, axis=1), nm.ArgumentTypeError, "complex"
            )
            for v in (values(A, B, dtype=jnp.int32), values(A, B).astype(jnp.complex64) * 1j)
        ],
    ),
    range=Rule(
        "`n=` below 1 (no points) or a result axis of no points: `ArgumentError` naming it",
        lambda name, fn: (
            refused(lambda: fn(X, "b", n=0), nm.ArgumentError, "n=0"),
            numpy_or_refused(
                lambda: fn(X1, "b"), lambda: _fft_reference(name)(X1.array, axis=1), nm.ArgumentError, "'b'"
            ),
        ),
    ),
)


# ---- shape ops -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Op:
    """How the probes call a member: ``call(x, axis)`` acts on ``axis`` of ``x`` (the other axes are
    bystanders). ``missing``: the member takes an axis the array must have (False: it names a new
    one). ``clash`` (a new axis the array has), ``size``, ``dtype``, ``range``: the member's own
    check for that column, where it has one. ``zero``: what a zero-size axis gives, when not the
    axes it gives for any other size."""

    call: Callable[[nm.NamedArray, str], Any]
    missing: bool = True
    clash: Callable[[], None] | None = None
    size: Callable[[], None] | None = None
    dtype: Callable[[], None] | None = None
    range: Callable[[], None] | None = None
    zero: Callable[[Any], None] | str | None = None  # "refused": an AxisError naming the axis
    keeps_dtype: bool = True
    per_slice: bool = True  # False: the op merges every axis (ravel), a bystander too


def _size(x, axis: str, default: int = 4) -> int:
    return x.axis_size(axis) if isinstance(x, nm.NamedArray) and axis in x.names else default


def _halves(x: nm.NamedArray, axis: str) -> tuple[Axis, Axis]:
    n = _size(x, axis)
    return Axis("p", 2 if n else 0), Axis("q", n // 2)


def _parts(x: nm.NamedArray, axis: str) -> tuple[int, int]:
    n = _size(x, axis)
    return n // 2, n - n // 2


def _numpy_equal(ours: Callable[[], Any], want) -> Callable[[], None]:
    def check():
        got = runs(ours)
        np.testing.assert_allclose(as_numpy(got), as_numpy(want), rtol=1e-6, atol=1e-6)

    return check


U8 = values(A, B, dtype=jnp.uint8)
X_NP = np.asarray(X.array)
SHAPE_OPS: dict[str, Op] = {
    "nm.rename": Op(
        lambda x, ax: nm.rename(x, {ax: "r"}), clash=must(lambda: nm.rename(X, {"a": "b"}), nm.AxisError, "'b'")
    ),
    "nm.rearrange": Op(lambda x, ax: nm.rearrange(x, (ax, ...))),
    "nm.flatten_axes": Op(
        lambda x, ax: nm.flatten_axes(x, ("a", ax), "f"),
        clash=must(lambda: nm.flatten_axes(with_extra(X), ("a", "b"), "c"), nm.AxisError, "'c'"),
    ),
    "nm.unflatten_axis": Op(
        lambda x, ax: nm.unflatten_axis(x, ax, _halves(x, ax)),
        size=must(lambda: nm.unflatten_axis(X, "b", (Axis("p", 3), Axis("q", 2))), nm.AxisError, "'b'"),
        clash=must(lambda: nm.unflatten_axis(X, "b", (Axis("a", 2), Axis("q", 2))), nm.AxisError, "'a'"),
    ),
    "nm.split": Op(
        lambda x, ax: nm.split(x, ax, [Axis(ax, n) for n in _parts(x, ax)]),
        size=must(lambda: nm.split(X, "b", [Axis("b", 1), Axis("b", 2)]), nm.AxisError, "'b'"),
    ),
    "nm.unbind": Op(lambda x, ax: nm.unbind(x, ax), zero=lambda out: _assert(out == [], f"{out} is not []")),
    "nm.stack": Op(
        lambda x, ax: nm.stack("s", [x, x]),
        missing=False,
        clash=must(lambda: nm.stack("a", [X, X]), nm.AxisError, "'a'"),
        size=must(lambda: nm.stack("s", [X, resized(X, "b", 5)]), nm.AxisError, "'b'"),
    ),
    "nm.concatenate": Op(
        lambda x, ax: nm.concatenate(ax, [x, x]),
        size=must(lambda: nm.concatenate("b", [X, resized(X, "a", 2)]), nm.AxisError, "'a'"),
    ),
    "nm.broadcast_axis": Op(
        lambda x, ax: nm.broadcast_axis(x, Axis("n", 2)),
        missing=False,
        size=must(lambda: nm.broadcast_axis(X, Axis("a", 5)), nm.AxisError, "'a'"),
    ),
    "nm.broadcast_to": Op(
        lambda x, ax: nm.broadcast_to(x, (Axis("n", 2), *(x.axes if nm.is_named_array(x) else (A, B)))),
        missing=False,
        clash=must(lambda: nm.broadcast_to(X, (A,)), nm.AxisError, "b=4"),
        size=must(lambda: nm.broadcast_to(X, (A, B.resize(5))), nm.AxisError, "'b'"),
    ),
    "nm.pad": Op(
        lambda x, ax: nm.pad(x, {ax: (1, 2)}), range=must(lambda: nm.pad(X, {"b": (-1, 0)}), nm.ArgumentError, "-1")
    ),
    "nm.roll": Op(
        lambda x, ax: nm.roll(x, 1, ax), range=_numpy_equal(lambda: nm.roll(X, 9, "b"), np.roll(X_NP, 9, axis=1))
    ),
    "nm.tril": Op(
        lambda x, ax: nm.tril(x, "a", ax), range=_numpy_equal(lambda: nm.tril(X, "a", "b", k=-7), np.tril(X_NP, -7))
    ),
    "nm.triu": Op(
        lambda x, ax: nm.triu(x, "a", ax), range=_numpy_equal(lambda: nm.triu(X, "a", "b", k=9), np.triu(X_NP, 9))
    ),
    "nm.ravel": Op(lambda x, ax: nm.ravel(x, "f"), missing=False, per_slice=False),
    "nm.repeat": Op(
        lambda x, ax: nm.repeat(x, 2, ax),
        range=must(lambda: nm.repeat(X, -1, "b"), nm.ArgumentError, "-1"),
        size=must(lambda: nm.repeat(X, jnp.asarray([1, 2, 3]), "b"), nm.AxisError, "'b'"),
    ),
    "nm.tile": Op(
        lambda x, ax: nm.tile(x, {ax: 2}),
        missing=False,
        range=must(lambda: nm.tile(X, {"b": -1}), nm.ArgumentError, "-1"),
    ),
    "nm.top_k": Op(
        lambda x, ax: nm.top_k(x, ax, 2),
        range=must(lambda: nm.top_k(X, "b", 5), nm.AxisError, "k=5"),
        zero="refused",
        keeps_dtype=False,
    ),
    "nm.trace": Op(
        lambda x, ax: nm.trace(x, "a", ax),
        keeps_dtype=False,
        range=_numpy_equal(lambda: nm.trace(X, "a", "b", offset=9), np.trace(X_NP, 9)),
    ),
    "nm.packbits": Op(
        lambda x, ax: nm.packbits(x > 0.3, ax),
        keeps_dtype=False,
        dtype=must(lambda: nm.packbits(X, "b"), nm.ArgumentTypeError, "float32"),
    ),
    "nm.unpackbits": Op(
        lambda x, ax: nm.unpackbits(x.astype(jnp.uint8), ax),
        keeps_dtype=False,
        dtype=must(lambda: nm.unpackbits(X, "b"), nm.ArgumentTypeError, "float32"),
        range=_numpy_equal(
            lambda: nm.unpackbits(U8, "b", count=-3), np.unpackbits(np.asarray(U8.array), axis=1, count=-3)
        ),
    ),
    "nn.glu": Op(
        lambda x, ax: nn.glu(x, ax),
        keeps_dtype=False,
        size=must(lambda: nn.glu(values(A, B.resize(3)), "b"), nm.ArgumentError, "'b'"),
    ),
}


def _assert(ok: bool, message: str) -> None:
    assert ok, message


def _leaf_names(out) -> list:
    return [v.names for v in _named_leaves(out)]


def _shape_zero(name, fn):
    """A zero-size axis behaves as any other size: the result has the axes it has for size 2."""
    op = SHAPE_OPS[name]
    if op.zero == "refused":
        refused(lambda: op.call(values(A, Z), "z"), nm.AxisError, "'z'")
        return
    out = runs(lambda: op.call(values(A, Z), "z"))
    if op.zero is not None:
        op.zero(out)
        return
    assert _leaf_names(out) == _leaf_names(op.call(values(A, Z.resize(2)), "z")), describe(out)


def _shape_dtype(name, fn):
    op = SHAPE_OPS[name]
    if op.dtype is not None:
        op.dtype()
    for dt in (jnp.int32, jnp.bool_):
        try:
            out = runs(lambda: op.call(values(A, B, dtype=dt), "b"))
        except nm.ArgumentTypeError as e:  # a dtype jnp's function refuses (glu's sigmoid of ints)
            assert not op.keeps_dtype and jnp.dtype(dt).name in str(e), str(e)
            continue
        if op.keeps_dtype:
            assert all(v.dtype == dt for v in _named_leaves(out)), f"{jnp.dtype(dt).name} in, {describe(out)} out"


kind(
    "shape ops",
    " ".join(SHAPE_OPS),
    plain=Rule(
        "`ArgumentTypeError`: wrap it with `nm.named`",
        lambda name, fn: refused(lambda: SHAPE_OPS[name].call(plain(), "b"), nm.ArgumentTypeError, WRAP),
    ),
    missing=Rule(
        "`AxisError` naming it (an axis the op acts on)",
        lambda name, fn: (
            SHAPE_OPS[name].missing and refused(lambda: SHAPE_OPS[name].call(X, "nope"), nm.AxisError, "'nope'")
        ),
    ),
    extra=Rule(
        "kept, each slice on its own; a new axis name the array already has: `AxisError`",
        lambda name, fn: (
            SHAPE_OPS[name].per_slice and per_slice(lambda v: SHAPE_OPS[name].call(v, "b"), with_extra(X)),
            SHAPE_OPS[name].clash and SHAPE_OPS[name].clash(),
        ),
    ),
    size=Rule(
        "sizes that do not add up (split, unflatten, per-entry repeats, an odd `glu` axis) or one name with two "
        "sizes (stack, concatenate, broadcast): `AxisError`/`ArgumentError` naming the axis",
        lambda name, fn: SHAPE_OPS[name].size and SHAPE_OPS[name].size(),
    ),
    zero=Rule(
        "as any other size: the same axes, empty (unbind: no slices; top_k's k > 0: refused as out of range)",
        _shape_zero,
    ),
    dtype=Rule(
        "any dtype, kept; `packbits` takes bool or integers and `unpackbits` uint8: `ArgumentTypeError`", _shape_dtype
    ),
    range=Rule(
        "counts and widths as numpy checks them (a negative count or width, `top_k`'s k outside `[0, size]`: "
        "`ArgumentError`/`AxisError` naming it); offsets as numpy takes them (`roll` wraps, `tril`/`triu`'s "
        "k and `trace`'s offset may lie past the edge)",
        lambda name, fn: SHAPE_OPS[name].range and SHAPE_OPS[name].range(),
    ),
)


# ---- indexing ----------------------------------------------------------------------------------------------

IDX = nm.named(jnp.asarray([2, 0]), "k")
U2 = values(A, B.resize(2), seed=3)


def _ref(x=X):
    return nm.new_ref(x)


def _ref_write(ref, idx, value):
    ref[idx] = value


INDEXING = {
    "nm.NamedArray": {
        "plain": checks(
            must(lambda: X["b", jnp.asarray([0, 1])], nm.AxisError, "integer NamedArray"),
            must(lambda: nm.NamedArray(plain(), (A, B.resize(5))), nm.AxisError, "does not match"),
        ),
        "missing": checks(
            must(lambda: X["nope", 0], nm.AxisError, "'nope'"),
            must(lambda: X.at["nope", 0].set(1.0), nm.AxisError, "'nope'"),
        ),
        "extra": checks(
            lambda: per_slice(lambda v: v["b", IDX], with_extra(X)),
            lambda: per_slice(lambda v: v.at["b", 1:3].add(1.0), with_extra(X)),
        ),
        "size": must(lambda: X["b", nm.named(jnp.asarray([0, 1]), "a")], nm.AxisError, "'a'"),
        "zero": checks(
            must(lambda: values(A, Z)["z", 0], nm.AxisError, "'z'"),
            must(lambda: values(A, Z)["z", IDX], nm.AxisError, "'z'"),
            lambda: _same_names(runs(lambda: values(A, Z)["z", 0:2]), ("a", "z")),
        ),
        "dtype": checks(
            must(lambda: X["b", 1.0], nm.AxisError, "1.0"),
            must(lambda: X["b", True], nm.AxisError, "bool"),
            must(lambda: X["b", IDX.astype(jnp.float32)], nm.AxisError, "float32"),
        ),
        "range": checks(
            must(lambda: X["b", 4], nm.AxisError, "index 4", "'b'"),
            must(lambda: X["b", nm.named(jnp.asarray([0, 7]), "k")], nm.AxisError, "index 7", "k=1"),
            must(lambda: X.at["b", -5].set(0.0), nm.AxisError, "index -5"),
            gives(
                lambda: X["b", nm.named(jnp.asarray([-1]), "k")],
                lambda: nm.named(np.asarray(X.array)[:, [-1]], (A, Axis("k", 1))),
            ),
        ),
    },
    "nm.take": {
        "plain": checks(
            must(lambda: nm.take(plain(), "b", IDX), nm.ArgumentTypeError, WRAP),
            must(lambda: nm.take(X, "b", jnp.asarray([0, 1])), nm.AxisError, "integer NamedArray"),
        ),
        "missing": must(lambda: nm.take(X, "nope", IDX), nm.AxisError, "'nope'"),
        "extra": lambda: per_slice(lambda v: nm.take(v, "b", IDX), with_extra(X)),
        "zero": must(lambda: nm.take(values(A, Z), "z", IDX), nm.AxisError, "'z'"),
        "dtype": must(lambda: nm.take(X, "b", IDX.astype(jnp.float32)), nm.AxisError, "float32"),
        "range": must(lambda: nm.take(X, "b", nm.named(jnp.asarray([9]), "k")), nm.AxisError, "index 9"),
    },
    "nm.ds": {
        "extra": lambda: per_slice(lambda v: v["b", nm.ds(1, 2)], with_extra(X)),
        "size": must(lambda: X["b", nm.ds(nm.named(jnp.asarray([0, 1]), "a"), 2)], nm.AxisError, "a=2", "a=3"),
        "zero": lambda: _same_names(runs(lambda: values(A, Z)["z", nm.ds(0, 0)]), ("a", "z")),
        "dtype": must(lambda: X["b", nm.ds(1.0, 2)], nm.AxisError, "integer"),
        "range": checks(
            must(lambda: X["b", nm.ds(3, 2)], nm.AxisError, "offset 3", "'b'"),
            must(lambda: X["b", nm.ds(0, 5)], nm.AxisError, "'b'"),
        ),
    },
    "nm.updated_slice": {
        "plain": checks(
            must(lambda: nm.updated_slice(plain(), {"b": 0}, U2), nm.ArgumentTypeError, WRAP),
            must(lambda: nm.updated_slice(X, {"b": 0}, plain(U2)), nm.ArgumentTypeError, WRAP),
        ),
        "missing": must(lambda: nm.updated_slice(X, {"nope": 0}, U2), nm.AxisError, "'nope'"),
        "extra": checks(
            lambda: per_slice(lambda v: nm.updated_slice(v, {"b": 1}, U2), with_extra(X)),
            must(lambda: nm.updated_slice(X, {"b": 1}, with_extra(U2)), nm.AxisError, "'c'"),
        ),
        "size": must(lambda: nm.updated_slice(X, {"b": 0}, values(A.resize(5), B.resize(2))), nm.AxisError, "'a'"),
        "zero": lambda: _same_names(runs(lambda: nm.updated_slice(values(A, Z), {"z": 0}, values(Z))), ("a", "z")),
        "dtype": must(lambda: nm.updated_slice(X, {"b": 0.5}, U2), nm.AxisError, "integer"),
        "range": must(lambda: nm.updated_slice(X, {"b": 3}, U2), nm.AxisError, "offset 3", "'b'"),
    },
    "nm.NamedRef": {
        "plain": must(lambda: _ref_write(_ref(), {"b": 0}, jnp.ones(3)), nm.ArgumentTypeError, "wrap it with nm.named"),
        "missing": must(lambda: _ref()[{"nope": 0}], nm.AxisError, "'nope'"),
        "extra": must(lambda: _ref_write(_ref(), {"b": 0}, values(C)), nm.AxisError, "c=2"),
        "size": must(lambda: _ref_write(_ref(), {"b": 0}, values(A.resize(5))), nm.AxisError, "'a'"),
        "zero": must(lambda: _ref(values(A, Z))[{"z": 0}], nm.AxisError, "'z'"),
        "dtype": must(lambda: _ref()[{"b": 1.0}], nm.AxisError, "1.0"),
        "range": checks(
            must(lambda: _ref()[{"b": 7}], nm.AxisError, "index 7"),
            must(lambda: _ref()[{"b": nm.ds(3, 2)}], nm.AxisError, "offset 3"),
            must(lambda: _ref().slice({"b": 9}), nm.AxisError, "index 9"),
        ),
    },
    "nm.new_ref": {
        "plain": must(lambda: nm.new_ref(plain()), nm.ArgumentTypeError, "NamedArray"),
        "zero": lambda: _same_names(_ref(values(A, Z)).value(), ("a", "z")),
    },
    "nm.get": {
        "plain": must(lambda: nm.get(plain(), {"a": 0}), nm.ArgumentTypeError, "NamedRef"),
        "missing": must(lambda: nm.get(_ref(), {"nope": 0}), nm.AxisError, "'nope'"),
        "range": must(lambda: nm.get(_ref(), {"b": 4}), nm.AxisError, "index 4"),
    },
    "nm.swap": {
        "plain": must(lambda: nm.swap(plain(), {"a": 0}, 1.0), nm.ArgumentTypeError, "NamedRef"),
        "size": must(lambda: nm.swap(_ref(), {"b": 0}, values(A.resize(5))), nm.AxisError, "'a'"),
        "range": must(lambda: nm.swap(_ref(), {"b": 9}, 1.0), nm.AxisError, "index 9"),
    },
    "nm.freeze": {"plain": must(lambda: nm.freeze(plain()), nm.ArgumentTypeError, "NamedRef")},
}

cases_kind(
    "indexing and refs",
    INDEXING,
    plain=(
        "the array: `ArgumentTypeError` (wrap it with `nm.named`); a plain index or value with dimensions: "
        "`AxisError`/`ArgumentTypeError` (indices are integer NamedArrays)"
    ),
    missing="`AxisError` naming it",
    extra=(
        "kept, each slice on its own; a gather's index axes replace the indexed axis; an update or a written "
        "value with an axis the target lacks: `AxisError`"
    ),
    size="`AxisError` naming the axis (per-row starts, gathers and updates over an axis of the array, at its size)",
    zero="nothing to index: an int or a gather is out of range (`AxisError`); a slice or `ds` of size 0 is empty",
    dtype="an index, start or offset must be an integer: a float or a bool is an `AxisError`",
    range=(
        "known before tracing: numpy's rule (an int or gathered index in `[-size, size)`, a `ds` window or an "
        "update inside the axis), else `AxisError` naming the axis, its size and the index; traced: clamped as "
        "XLA clamps (documented under Indexing)"
    ),
)


# ---- contraction -------------------------------------------------------------------------------------------

D = Axis("d", 2)
W = values(B, D, seed=4)


CONTRACTIONS = {
    "nm.dot": {
        "plain": must(lambda: nm.dot(plain(), W, axis="b"), nm.ArgumentTypeError, WRAP),
        "missing": checks(
            must(lambda: nm.dot(X, W, axis="nope"), nm.AxisError, "'nope'"),
            # in one operand only: summed over, as einsum (and Haliax's dot) does
            gives(
                lambda: nm.dot(X, W, axis="a"),
                lambda: nm.named(np.einsum("ab,bd->bd", np.asarray(X.array), np.asarray(W.array)), (B, D)),
            ),
        ),
        "extra": lambda: per_slice(lambda v: nm.dot(v, W, axis="b"), with_extra(X)),
        "size": must(lambda: nm.dot(X, resized(W, "b", 5), axis="b"), nm.AxisError, "'b'", "4", "5"),
        "zero": gives(lambda: nm.dot(values(A, Z), values(Z, D), axis="z"), lambda: nm.zeros((A, D))),
        "dtype": lambda: [
            abstract(lambda u, v: nm.dot(u, v, axis="b"), values(A, B, dtype=dt), values(B, D, dtype=dt))
            for dt in (jnp.int32, jnp.bool_)
        ],
    },
    "nm.einsum": {
        "plain": must(lambda: nm.einsum("a b, b d -> a d", plain(), W), nm.ArgumentTypeError, "NamedArray"),
        "missing": must(lambda: nm.einsum("a nope, b d -> a d", X, W), nm.AxisError, "'nope'"),
        "extra": lambda: per_slice(lambda v: nm.einsum("... a b, b d -> ... a d", v, W), with_extra(X)),
        "size": must(lambda: nm.einsum("a b, b d -> a d", X, resized(W, "b", 5)), nm.AxisError, "'b'", "4", "5"),
        "zero": gives(lambda: nm.einsum("a z, z d -> a d", values(A, Z), values(Z, D)), lambda: nm.zeros((A, D))),
        "dtype": lambda: abstract(
            lambda u, v: nm.einsum("a b, b d -> a d", u, v),
            values(A, B, dtype=jnp.int32),
            values(B, D, dtype=jnp.int32),
        ),
    },
}

cases_kind(
    "contraction",
    CONTRACTIONS,
    plain="`ArgumentTypeError`: wrap it with `nm.named`",
    missing=(
        "an axis in none of the operands: `AxisError`; in some of them: summed over there, as einsum (and "
        "Haliax's `dot`) does"
    ),
    extra="kept, each slice on its own",
    size="`AxisError` naming the axis and both sizes",
    zero="a sum over nothing: zeros",
    dtype="jnp's promotion (ints and bools contract as in `jnp.einsum`)",
)


# ---- search, counting and sized results ----------------------------------------------------------------

IDS = values(A, B, dtype=jnp.int32) % 3
Found = Axis("found", 5)


def _sorted_b():
    return nm.sort(X, "b")


SEARCH = {
    "nm.unique": {
        "plain": must(lambda: nm.unique(plain(), Found), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nm.unique(X, Found, axis="nope"), nm.AxisError, "'nope'"),
        "extra": must(lambda: nm.unique(X, Axis("a", 2), axis="b"), nm.AxisError, "'a'"),
        "zero": checks(
            must(lambda: nm.unique(values(A, Z), Found), nm.ArgumentError, "fill_value"),
            gives(lambda: nm.unique(values(A, Z), Found, fill_value=-1.0), lambda: nm.full((Found,), -1.0)),
        ),
    },
    "nm.unique_values": {
        "plain": must(lambda: nm.unique_values(plain(), Found), nm.ArgumentTypeError, WRAP),
        "zero": must(lambda: nm.unique_values(values(A, Z), Found), nm.ArgumentError, "fill_value"),
    },
    "nm.unique_counts": {"plain": must(lambda: nm.unique_counts(plain(), Found), nm.ArgumentTypeError, WRAP)},
    "nm.unique_inverse": {"plain": must(lambda: nm.unique_inverse(plain(), Found), nm.ArgumentTypeError, WRAP)},
    "nm.unique_all": {
        "plain": must(lambda: nm.unique_all(plain(), Found), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nm.unique_all(X, Found, axis="nope"), nm.AxisError, "'nope'"),
    },
    "nm.nonzero": {
        "plain": must(lambda: nm.nonzero(plain(), Found), nm.ArgumentTypeError, WRAP),
        "extra": must(lambda: nm.nonzero(X, Axis("a", 3)), nm.AxisError, "'a'"),
        "zero": gives(lambda: nm.nonzero(values(A, Z), Found)["a"], lambda: nm.zeros((Found,), jnp.int32)),
    },
    "nm.searchsorted": {
        "plain": must(lambda: nm.searchsorted(plain(), 1.0, "b"), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nm.searchsorted(X, 1.0, "nope"), nm.AxisError, "'nope'"),
        "extra": lambda: per_slice(lambda v: nm.searchsorted(_sorted_b(), v, "b"), values(C, seed=5)),
        "size": must(lambda: nm.searchsorted(_sorted_b(), values(A.resize(5)), "b"), nm.AxisError, "'a'"),
        "zero": gives(lambda: nm.searchsorted(values(A, Z), 1.0, "z"), lambda: nm.zeros((A,), jnp.int32)),
    },
    "nm.bincount": {
        "plain": must(lambda: nm.bincount(plain(IDS), Found), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nm.bincount(IDS, Found, axis="nope"), nm.AxisError, "'nope'"),
        "extra": lambda: per_slice(lambda v: nm.bincount(v, Found, axis="b"), with_extra(IDS) % 3),
        "size": must(lambda: nm.bincount(IDS, Found, weights=resized(X, "b", 5)), nm.AxisError, "weights"),
        "zero": gives(lambda: nm.bincount(values(A, Z, dtype=jnp.int32), Found), lambda: nm.zeros((Found,), jnp.int32)),
        "dtype": must(lambda: nm.bincount(X, Found), nm.ArgumentTypeError, "float32"),
        # numpy refuses a negative value; the documented rule drops values outside [0, n) (a fixed length)
        "range": gives(
            lambda: nm.bincount(nm.named(jnp.asarray([-1, 2, 7, 0]), "k"), Axis("n", 3)), lambda: np.asarray([1, 0, 1])
        ),
    },
    "nm.one_hot": {
        "plain": gives(lambda: nm.one_hot(jnp.asarray(2), Axis("v", 3)), lambda: np.asarray([0.0, 0.0, 1.0])),
        "extra": checks(
            lambda: per_slice(lambda v: nm.one_hot(v, Axis("v", 3)), with_extra(IDS) % 3),
            must(lambda: nm.one_hot(IDS, Axis("a", 3)), nm.AxisError, "'a'"),
        ),
        "zero": lambda: _same_names(
            runs(lambda: nm.one_hot(values(A, Z, dtype=jnp.int32), Axis("v", 3))), ("a", "z", "v")
        ),
        "dtype": must(lambda: nm.one_hot(X, Axis("v", 3)), nm.ArgumentTypeError, "float32"),
        "range": checks(
            must(
                lambda: nm.one_hot(nm.named(jnp.asarray([1, 5]), "k"), Axis("v", 3)),
                nm.ArgumentError,
                "index 5",
                "k=1",
                "[0, 3)",
            ),
            gives(
                lambda: jax.jit(lambda i: nm.one_hot(i, Axis("v", 3)))(nm.named(jnp.asarray([1, 5, -1]), "k")),
                lambda: np.asarray([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
            ),
        ),
    },
}

cases_kind(
    "search, counting and sized results",
    SEARCH,
    plain=("`ArgumentTypeError`: wrap it with `nm.named` (`one_hot` of a number or a 0-d array is one row)"),
    missing="`AxisError` naming it",
    extra="kept, each slice on its own; a result axis the array already has: `AxisError`",
    size="`AxisError` naming the axis (weights, values and sorted arrays share their axes at one size)",
    zero=(
        "as any size (counts 0, `searchsorted` 0); `unique` of nothing needs `fill_value=` for its sized result "
        "(`ArgumentError`)"
    ),
    dtype="ids, values to count and one-hot indices are integers: a float is an `ArgumentTypeError`",
    range=(
        "`bincount` drops values outside `[0, n)`; `one_hot` refuses an index outside `[0, n)` known before "
        "tracing (`ArgumentError`) and gives a row of zeros for a traced one (`jax.nn.one_hot`'s)"
    ),
)

PREDICATES = {
    name: {
        "plain": checks(
            must(lambda f=f: f(X, plain()), nm.AxisError, WRAP),
            gives(lambda f=f: f(plain(), plain()), lambda: np.asarray(True)),
        ),
        "extra": gives(lambda f=f: f(nm.broadcast_axis(X, C), X), lambda f=f: np.asarray(f.__name__ != "array_equal")),
        "size": (
            must(lambda f=f: f(X, resized(X, "b", 5)), nm.AxisError, "'b'")
            if name == "nm.allclose"
            else gives(lambda f=f: f(X, resized(X, "b", 5)), lambda: np.asarray(False))
        ),
        "zero": gives(lambda f=f: f(values(A, Z), values(A, Z)), lambda: np.asarray(True)),
    }
    for name, f in (
        ("nm.allclose", nm.allclose),
        ("nm.array_equal", nm.array_equal),
        ("nm.array_equiv", nm.array_equiv),
    )
}
cases_kind(
    "predicates over whole arrays",
    PREDICATES,
    plain="two plain arrays: numpy's positional answer; one mixed with a NamedArray: `AxisError` (wrap it)",
    extra="broadcast by name (`array_equal`: false, the axes differ)",
    size="`allclose`: `AxisError` naming the axis; `array_equal` and `array_equiv`: false",
    zero="true (all of nothing)",
)


# ---- polynomials -------------------------------------------------------------------------------------------

P3 = nm.named(jnp.asarray([1.0, -3.0, 2.0]), "p")  # (x - 1)(x - 2)
P2 = nm.named(jnp.asarray([1.0, 1.0]), "q")
S4 = nm.named(jnp.asarray([0.0, 1.0, 2.0, 3.0]), "s")


def _np_poly(fn, *args, **kwargs):
    return lambda: fn(*[np.asarray(a.array) if isinstance(a, nm.NamedArray) else a for a in args], **kwargs)


POLYS = {
    "nm.poly": {
        "plain": gives(lambda: nm.poly(jnp.asarray([1.0, 2.0])), _np_poly(np.poly, [1.0, 2.0])),
        "extra": must(lambda: nm.poly(X), nm.AxisError, "1-d"),
        "zero": gives(lambda: nm.poly(values(Z)), _np_poly(np.poly, np.zeros(0))),
    },
    "nm.polyadd": {
        "plain": gives(lambda: nm.polyadd(P3, [1.0]), _np_poly(np.polyadd, P3, [1.0])),
        "extra": must(lambda: nm.polyadd(X, P3), nm.AxisError, "1-d"),
        "size": gives(lambda: nm.polyadd(P3, P2), _np_poly(np.polyadd, P3, P2)),
        "dtype": gives(lambda: nm.polyadd(P3.astype(jnp.int32), P2), _np_poly(np.polyadd, P3.astype(jnp.int32), P2)),
    },
    "nm.polysub": {
        "plain": gives(lambda: nm.polysub(P3, [1.0]), _np_poly(np.polysub, P3, [1.0])),
        "size": gives(lambda: nm.polysub(P3, P2), _np_poly(np.polysub, P3, P2)),
    },
    "nm.polymul": {
        "plain": gives(lambda: nm.polymul(P3, [2.0]), _np_poly(np.polymul, P3, [2.0])),
        "size": gives(lambda: nm.polymul(P3, P2), _np_poly(np.polymul, P3, P2)),
    },
    "nm.polydiv": {
        "plain": gives(
            lambda: nm.polydiv(P3, [1.0, -1.0])[0], _np_poly(lambda a, b: np.polydiv(a, b)[0], P3, [1.0, -1.0])
        )
    },
    "nm.polyint": {
        "range": must(lambda: nm.polyint(P3, -1), nm.ArgumentError, "m=-1"),
        "zero": gives(lambda: nm.polyint(values(Z)), _np_poly(np.polyint, np.zeros(0))),
    },
    "nm.polyder": {
        "range": checks(
            must(lambda: nm.polyder(P3, -1), nm.ArgumentError, "m=-1"),
            gives(lambda: nm.polyder(P3, 5), _np_poly(np.polyder, P3, 5)),
        )
    },
    "nm.polyfit": {
        "size": must(lambda: nm.polyfit(S4, values(Axis("s", 3)), 1), nm.AxisError, "s=3"),
        "extra": must(lambda: nm.polyfit(values(A, B), values(A, B), 1), nm.AxisError, "one axis"),
        "zero": must(lambda: nm.polyfit(values(Z), values(Z), 1), nm.ArgumentError, "'z'"),
        "range": must(lambda: nm.polyfit(S4, S4, -1), nm.ArgumentError, "deg=-1"),
    },
    "nm.roots": {
        "plain": gives(
            lambda: np.sort(np.asarray(nm.roots([1.0, -3.0, 2.0]).array).real), lambda: np.asarray([1.0, 2.0])
        ),
        "zero": gives(lambda: nm.roots(values(Z)), _np_poly(np.roots, np.zeros(0))),
    },
    "nm.trim_zeros": {
        "plain": gives(lambda: nm.trim_zeros([0.0, 1.0, 0.0]), _np_poly(np.trim_zeros, np.asarray([0.0, 1.0, 0.0])))
    },
    "nm.vander": {
        "plain": must(lambda: nm.vander(jnp.arange(3.0), "d"), nm.ArgumentTypeError, WRAP),
        "extra": must(lambda: nm.vander(X, "d"), nm.AxisError, "1-d"),
        "zero": lambda: _same_names(runs(lambda: nm.vander(values(Z), "d")), ("z", "d")),
    },
    "nm.polyval": {
        "plain": gives(lambda: nm.polyval(jnp.asarray([1.0, 2.0]), 3.0), lambda: np.asarray(5.0)),
        "missing": must(lambda: nm.polyval(values(A, B), X, "nope"), nm.AxisError, "'nope'"),
        "extra": lambda: per_slice(lambda v: nm.polyval(P3, v), with_extra(X)),
        "size": must(lambda: nm.polyval(values(A.resize(5), B), X, "b"), nm.AxisError, "'a'"),
    },
}
cases_kind(
    "polynomials",
    POLYS,
    plain="a sequence or a 1-d plain array is a polynomial (numpy's form); `vander` takes a 1-d NamedArray",
    missing="`AxisError` naming it (`polyval`'s coefficient axis)",
    extra=(
        "a polynomial has one axis: more is an `AxisError`; `polyval` broadcasts its points and the other axes of "
        "its coefficients by name"
    ),
    size="coefficients of different lengths combine as in numpy; `polyfit`'s samples share one axis (`AxisError`)",
    zero="numpy's (the empty polynomial); `polyfit` of no points: `ArgumentError`",
    dtype="numpy's promotion",
    range="`m` and `deg` below 0: `ArgumentError` naming them; past the degree: numpy's (the zero polynomial)",
)


# ---- creation ----------------------------------------------------------------------------------------------

CREATION = {
    "nm.zeros": {
        "missing": must(lambda: nm.zeros(("a", "b")), nm.AxisError, "'a'"),
        "zero": lambda: _same_names(nm.zeros((A, Z)), ("a", "z")),
        "plain": must(lambda: nm.zeros(plain()), nm.AxisError, "Axis"),
    },
    "nm.ones": {
        "missing": must(lambda: nm.ones("a"), nm.AxisError, "'a'"),
        "zero": lambda: _same_names(nm.ones((Z,)), ("z",)),
    },
    "nm.full": {
        "zero": lambda: _same_names(nm.full((A, Z), 1.0), ("a", "z")),
        "plain": must(lambda: nm.full((A,), jnp.ones(3)), nm.ArgumentTypeError, "fill_value"),
        "extra": must(lambda: nm.full((A,), values(B)), nm.ArgumentTypeError, "fill_value"),
        "dtype": gives(lambda: nm.full((A,), 2.5, jnp.int32), lambda: np.full(3, 2)),
    },
    "nm.full_like": {
        "plain": must(lambda: nm.full_like(plain(), 1.0), nm.ArgumentTypeError, WRAP),
        "zero": lambda: _same_names(nm.full_like(values(A, Z), 1.0), ("a", "z")),
        "extra": must(lambda: nm.full_like(X, values(C)), nm.ArgumentTypeError, "fill_value"),
    },
    "nm.zeros_like": {"plain": must(lambda: nm.zeros_like(plain()), nm.ArgumentTypeError, WRAP)},
    "nm.ones_like": {"plain": must(lambda: nm.ones_like(plain()), nm.ArgumentTypeError, WRAP)},
    "nm.arange": {
        "missing": must(lambda: nm.arange("a"), nm.AxisError, "'a'"),
        "zero": lambda: _same_names(nm.arange(Z), ("z",)),
    },
    "nm.linspace": {
        "missing": gives(lambda: nm.linspace("a", start=0.0, stop=1.0), lambda: np.linspace(0.0, 1.0)),
        "zero": gives(lambda: nm.linspace(Z, start=0.0, stop=1.0), lambda: np.linspace(0.0, 1.0, 0)),
    },
    "nm.logspace": {"zero": gives(lambda: nm.logspace(Z, start=0.0, stop=1.0), lambda: np.logspace(0.0, 1.0, 0))},
    "nm.geomspace": {
        "zero": gives(lambda: nm.geomspace(Z, start=1.0, stop=2.0), lambda: np.geomspace(1.0, 2.0, 0)),
        "range": must(lambda: nm.geomspace(B, start=0.0, stop=1.0), nm.ArgumentError, "0"),
    },
    "nm.fftfreq": {
        "missing": must(lambda: nm.fftfreq("b"), nm.AxisError, "'b'"),
        "zero": lambda: numpy_or_refused(lambda: nm.fftfreq(Z), lambda: np.fft.fftfreq(0), nm.AxisError, "'z'"),
    },
    "nm.named": {
        "plain": gives(lambda: nm.named(plain(), ("a", "b")), lambda: X),
        "missing": must(lambda: nm.named(plain(), ("a",)), nm.AxisError, "2 dimensions", "1 axes"),
        "extra": must(lambda: nm.named(plain(), ("a", "b", "c")), nm.AxisError, "3 axes"),
        "size": must(lambda: nm.named(plain(), (A, B.resize(5))), nm.AxisError, "'b'", "5"),
        "zero": lambda: _same_names(nm.named(jnp.zeros((3, 0)), ("a", "z")), ("a", "z")),
    },
}
cases_kind(
    "creation",
    CREATION,
    plain=(
        "`nm.named` wraps it (the way in); the `*_like` functions: `ArgumentTypeError`; a fill value with "
        "dimensions: `ArgumentTypeError`"
    ),
    missing=(
        "a bare name where a size is needed: `AxisError` naming it (`linspace` and friends: numpy's 50 samples, "
        "as Haliax); `nm.named`'s names must count the dimensions"
    ),
    extra=(
        "a fill value with axes: `ArgumentTypeError` (use `nm.broadcast_to`); `nm.named` with more names than "
        "dimensions: `AxisError`"
    ),
    size="`nm.named`: an Axis whose size is not the dimension's: `AxisError`",
    zero="an empty array (numpy's); `fftfreq` of no points: `AxisError`, as numpy refuses",
    dtype="`dtype=` as jnp takes it (a fill value is cast)",
    range="`geomspace` from or to 0: `ArgumentError` (numpy's)",
)


# ---- layers ------------------------------------------------------------------------------------------------

Batch, Pos, Embed, Mlp, Vocab = (
    Axis("batch", 2),
    Axis("position", 3),
    Axis("embed", 4),
    Axis("mlp", 6),
    Axis("vocab", 5),
)
Experts, Layers, Out = Axis("experts", 2), Axis("layers", 2), Axis("out", 4)
H = values(Batch, Pos, Embed, seed=7)


@dataclasses.dataclass(frozen=True)
class Layer:
    """How the probes call a layer: ``call(make(), x)`` with ``x`` over ``inp``; ``In``: the axis it
    consumes (None: any input); ``clash``: an axis it produces (which the input must not have);
    ``per_slice``: False where the rows of a batch are not independent (a dropout mask over more axes
    draws other numbers, fp8's scale is the whole input's amax, MoELinear's groups are rows of the
    whole input); ``sized``: whether the layer holds ``In`` at a size; ``range``, ``dtype``: its own
    case for that column."""

    make: Callable[[], Any]
    call: Callable[[Any, nm.NamedArray], Any] = lambda m, x: m(x)
    inp: tuple[Axis, ...] = (Batch, Pos, Embed)
    In: str | None = "embed"
    clash: str | None = "mlp"
    per_slice: bool = True
    sized: bool = True
    range: Callable[[], None] | None = None
    dtype: Callable[[], None] | None = None


def _block(E: Axis = Embed, *, key):
    return nn.MLP.init(E, E, width=Mlp, key=key)


def _moe():
    return nn.MoE.init(Embed, Mlp, Experts, 1, key=KEY)


def _group_sizes(x: nm.NamedArray) -> jax.Array:
    rows = x.size // x.axis_size("embed")
    return jnp.asarray([rows // 2, rows - rows // 2])


LAYERS: dict[str, Layer] = {
    "nn.Linear": Layer(lambda: nn.Linear.init(Embed, Mlp, key=KEY)),
    "nn.MLP": Layer(lambda: nn.MLP.init(Embed, Mlp, key=KEY)),
    "nn.LoraLinear": Layer(lambda: nn.LoraLinear.init(nn.Linear.init(Embed, Mlp, key=KEY), 2, key=KEY)),
    "nn.Int8Linear": Layer(lambda: nn.quantize(nn.Linear.init(Embed, Mlp, key=KEY), "int8")),
    "nn.Int8WeightLinear": Layer(lambda: nn.quantize(nn.Linear.init(Embed, Mlp, key=KEY), "int8_weight")),
    "nn.Fp8Linear": Layer(lambda: nn.quantize(nn.Linear.init(Embed, Mlp, key=KEY), "fp8"), per_slice=False),
    "nn.MoELinear": Layer(
        lambda: nn.MoELinear.init(Experts, Embed, Mlp, key=KEY),
        lambda m, x: m(x, _group_sizes(x) if nm.is_named_array(x) else jnp.asarray([3, 3])),
        per_slice=False,
        range=must(
            lambda: nn.MoELinear.init(Experts, Embed, Mlp, key=KEY)(H, jnp.asarray([1, 1])), nm.ArgumentError, "6"
        ),
    ),
    "nn.MoE": Layer(_moe, lambda m, x: m(x)[0], clash=None),
    "nn.LayerNorm": Layer(lambda: nn.LayerNorm.init(Embed), clash=None),
    "nn.RMSNorm": Layer(lambda: nn.RMSNorm.init(Embed), clash=None),
    "nn.Dropout": Layer(
        lambda: nn.Dropout(0.5),
        lambda m, x: m(x, key=KEY),
        In=None,
        clash=None,
        per_slice=False,
        sized=False,
        range=must(lambda: nn.Dropout(1.5)(H, key=KEY), nm.ArgumentError, "1.5"),
    ),
    "nn.Conv": Layer(
        lambda: nn.Conv.init("position", Embed, Out, 2, key=KEY),
        clash="out",
        range=must(lambda: nn.Conv.init("position", Embed, Out, 5, key=KEY)(H), nm.ArgumentError, "5"),
    ),
    "nn.ConvTranspose": Layer(lambda: nn.ConvTranspose.init("position", Embed, Out, 2, key=KEY), clash="out"),
    "nn.Stacked": Layer(
        lambda: nn.Stacked.init(Layers, _block, key=KEY),
        lambda m, x: m.fold(x),
        clash=None,
        # a scanned carry keeps its dtype: float blocks on an int input are refused, naming it
        dtype=must(lambda: _layer("nn.Stacked")[1].fold(H.astype(jnp.int32)), nm.AxisError, "int32 -> float32"),
    ),
    "nn.BlockSeq": Layer(lambda: nn.BlockSeq.init(Layers, _block, key=KEY), lambda m, x: m.fold(x), clash=None),
    "nn.max_pool": Layer(
        lambda: None,
        lambda m, x: nn.max_pool(x, {"position": 2}),
        In="position",
        clash=None,
        sized=False,
        range=must(lambda: nn.max_pool(H, {"position": 4}), nm.ArgumentError, "4"),
    ),
    "nn.min_pool": Layer(
        lambda: None,
        lambda m, x: nn.min_pool(x, {"position": 2}),
        In="position",
        clash=None,
        sized=False,
        range=must(lambda: nn.min_pool(H, {"position": 0}), nm.ArgumentError, "0"),
    ),
    "nn.mean_pool": Layer(
        lambda: None, lambda m, x: nn.mean_pool(x, {"position": 2}), In="position", clash=None, sized=False
    ),
    "nn.Embedding": Layer(
        lambda: nn.Embedding.init(Vocab, Embed, key=KEY),
        lambda m, x: m.unembed(x),
        clash="vocab",
        range=must(
            lambda: nn.Embedding.init(Vocab, Embed, key=KEY)(nm.named(jnp.asarray([1, 5]), "k")),
            nm.AxisError,
            "index 5",
            "'vocab'",
        ),
    ),
}
_BUILT: dict[str, Any] = {}


def _layer(name) -> tuple[Layer, Any]:
    spec = LAYERS[name]
    if name not in _BUILT:
        _BUILT[name] = spec.make()
    return spec, _BUILT[name]


def _jitted(name) -> Callable[[nm.NamedArray], Any]:
    """The layer's call under one ``eqx.filter_jit`` (a compile per input shape, where an eager call
    compiles each of its ops): for the columns that look at results, not at eager-only checks."""
    spec, m = _layer(name)
    if ("jit", name) not in _BUILT:
        _BUILT["jit", name] = eqx.filter_jit(spec.call)
    return lambda x: _BUILT["jit", name](m, x)


def _layer_input(spec: Layer, **sizes) -> nm.NamedArray:
    return values(*(a.resize(sizes.get(a.name, a.size)) for a in spec.inp), seed=7)


def _layer_extra(name, fn):
    spec, m = _layer(name)
    x, call = with_extra(_layer_input(spec)), _jitted(name)
    if spec.per_slice:
        per_slice(call, x)
    else:
        assert "c" in runs(lambda: call(x)).names
    if spec.clash:
        refused(
            lambda: spec.call(m, nm.broadcast_axis(_layer_input(spec), Axis(spec.clash, 2))),
            nm.AxisError,
            f"{spec.clash!r}",
        )


def _layer_zero(name, fn):
    spec, m = _layer(name)
    got = runs(lambda: _jitted(name)(_layer_input(spec, batch=0)))
    assert _leaf_names(got) == _leaf_names(_jitted(name)(_layer_input(spec))), describe(got)


def _layer_dtype(name, fn):
    """An integer input computes as its float value (never truncated to the input's dtype)."""
    spec, m = _layer(name)
    if spec.dtype is not None:
        spec.dtype()
        return
    x = _layer_input(spec)
    ints = nm.named(jnp.round(x.array * 4).astype(jnp.int32), x.axes)
    got = runs(lambda: _jitted(name)(ints))
    if spec.per_slice:  # the values of the float input (max and min pools may keep the ints: they are exact)
        same(got, _jitted(name)(ints.astype(jnp.float32)), "an int32 input")
    else:
        assert all(jnp.issubdtype(v.dtype, jnp.floating) for v in _named_leaves(got)), describe(got)


kind(
    "layers",
    " ".join(LAYERS),
    plain=Rule(
        "`ArgumentTypeError`: wrap it with `nm.named`",
        lambda name, fn: refused(
            lambda: _layer(name)[0].call(_layer(name)[1], plain(_layer_input(_layer(name)[0]))),
            nm.ArgumentTypeError,
            WRAP,
        ),
    ),
    missing=Rule(
        "an input without the axis the layer consumes: `AxisError` naming it",
        lambda name, fn: (
            _layer(name)[0].In
            and refused(
                lambda: _layer(name)[0].call(
                    _layer(name)[1], renamed(_layer_input(_layer(name)[0]), _layer(name)[0].In, "other")
                ),
                nm.AxisError,
                f"'{_layer(name)[0].In}'",
            )
        ),
    ),
    extra=Rule(
        "a batch axis: kept, each slice on its own; an input that already has an axis the layer makes: `AxisError`",
        _layer_extra,
    ),
    size=Rule(
        "the consumed axis at another size than the layer's: `AxisError` naming it",
        lambda name, fn: (
            _layer(name)[0].sized
            and refused(
                lambda: _layer(name)[0].call(
                    _layer(name)[1], resized(_layer_input(_layer(name)[0]), _layer(name)[0].In, 5)
                ),
                nm.AxisError,
                f"'{_layer(name)[0].In}'",
            )
        ),
    ),
    zero=Rule("a batch of 0: an empty result with the axes of any batch", _layer_zero),
    dtype=Rule(
        "an int or bool input computes as its float value (the result is floating, never truncated); "
        "`Embedding` ids must be integers (`AxisError`); `Stacked`'s carry keeps its dtype (`AxisError` naming "
        "the change)",
        _layer_dtype,
    ),
    range=Rule(
        "`Dropout`'s rate outside [0, 1], a window larger than the padded axis: `ArgumentError`; "
        "`Embedding` ids: the gather rule (`AxisError` when known before tracing)",
        lambda name, fn: LAYERS[name].range and LAYERS[name].range(),
    ),
)


# ---- losses ------------------------------------------------------------------------------------------------

LOGITS = values(Batch, Pos, Vocab, seed=8)
TOKENS = (values(Batch, Pos, dtype=jnp.int32, seed=9) - 1) % Vocab.size
WV = values(Embed, Vocab, seed=10)


def _per_token(loss: Callable[..., nm.NamedArray]):
    """``loss(..., reduction="none")`` per slice of an extra axis ``c`` on every input."""
    return lambda *xs: loss(*xs, reduction="none")


def _ce(lg, t, **kw):
    return nn.cross_entropy_loss(lg, t, **kw)


def _bw(h, t, **kw):
    return nn.blockwise_cross_entropy_loss(h, WV, t, block_size=5, **kw)


def _extra_pair(f, a, b):
    """An extra axis ``c`` on both inputs: each slice on its own."""
    xa, xb = with_extra(a), nm.named(jnp.stack([b.array, (b.array + 1) % Vocab.size]), (C, *b.axes))
    out = runs(lambda: f(xa, xb))
    assert "c" in out.names, describe(out)
    for i in range(2):
        same(out["c", i], f(xa["c", i], xb["c", i]), f"slice c={i}")


LOSSES = {
    "nn.cross_entropy_loss": {
        "plain": must(lambda: _ce(plain(LOGITS), TOKENS), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: _ce(renamed(LOGITS, "vocab", "v"), TOKENS), nm.AxisError, "'vocab'"),
        "extra": checks(
            lambda: _extra_pair(_per_token(_ce), LOGITS, TOKENS),
            must(lambda: _ce(LOGITS, nm.broadcast_axis(TOKENS, C)), nm.AxisError, "c=2"),
            must(lambda: _ce(LOGITS, TOKENS, where=values(C) > 0), nm.AxisError, "c=2"),
        ),
        "size": must(lambda: _ce(LOGITS, resized(TOKENS, "position", 4) % 5), nm.AxisError, "position=4"),
        "zero": checks(
            gives(
                lambda: _ce(values(Batch.resize(0), Pos, Vocab), values(Batch.resize(0), Pos, dtype=jnp.int32)),
                lambda: np.asarray(0.0),
            ),
            gives(lambda: _ce(LOGITS, nm.full((Batch, Pos), -100, jnp.int32)), lambda: np.asarray(0.0)),
        ),
        "dtype": checks(
            must(lambda: _ce(LOGITS, TOKENS.astype(jnp.float32)), nm.ArgumentTypeError, "float32"),
            must(lambda: _ce(LOGITS, TOKENS > 0), nm.ArgumentTypeError, "bool"),
        ),
        "range": checks(
            must(lambda: _ce(LOGITS, TOKENS + 3), nm.ArgumentError, "outside [0, 5)"),
            lambda: _assert(bool(np.isnan(jax.jit(_ce)(LOGITS, TOKENS + 3).scalar())), "not NaN under jit"),
            must(lambda: _ce(LOGITS, TOKENS, label_smoothing=2.0), nm.ArgumentError, "label_smoothing"),
        ),
    },
    "nn.next_token_loss": {
        "plain": must(lambda: nn.next_token_loss(LOGITS, plain(TOKENS)), nm.ArgumentTypeError, WRAP),
        "missing": must(
            lambda: nn.next_token_loss(renamed(LOGITS, "position", "p"), renamed(TOKENS, "position", "p")),
            nm.AxisError,
            "'position'",
        ),
        "extra": lambda: _extra_pair(_per_token(nn.next_token_loss), LOGITS, TOKENS),
        "zero": gives(
            lambda: nn.next_token_loss(
                values(Batch, Pos.resize(1), Vocab), values(Batch, Pos.resize(1), dtype=jnp.int32) % 5
            ),
            lambda: np.asarray(0.0),
        ),
        "range": must(lambda: nn.next_token_loss(LOGITS, TOKENS + 3), nm.ArgumentError, "outside [0, 5)"),
    },
    "nn.next_token_targets": {
        "plain": must(lambda: nn.next_token_targets(plain(TOKENS)), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nn.next_token_targets(renamed(TOKENS, "position", "p")), nm.AxisError, "'position'"),
    },
    "nn.blockwise_cross_entropy_loss": {
        "plain": must(lambda: _bw(plain(H), TOKENS), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: _bw(renamed(H, "embed", "e"), TOKENS), nm.AxisError, "'embed'"),
        "extra": lambda: _extra_pair(_per_token(_bw), H, TOKENS),
        "size": must(
            lambda: nn.blockwise_cross_entropy_loss(H, resized(WV, "embed", 5), TOKENS, block_size=5),
            nm.AxisError,
            "'embed'",
        ),
        "zero": gives(
            lambda: _bw(values(Batch.resize(0), Pos, Embed), values(Batch.resize(0), Pos, dtype=jnp.int32)),
            lambda: np.asarray(0.0),
        ),
        "range": checks(
            must(lambda: _bw(H, TOKENS + 3), nm.ArgumentError, "outside [0, 5)"),
            must(
                lambda: nn.blockwise_cross_entropy_loss(H, WV, TOKENS, block_size=3), nm.ArgumentError, "block_size=3"
            ),
        ),
    },
    "nn.blockwise_next_token_loss": {
        "plain": must(
            lambda: nn.blockwise_next_token_loss(H, WV, plain(TOKENS), block_size=5), nm.ArgumentTypeError, WRAP
        ),
        "extra": lambda: _extra_pair(
            _per_token(lambda h, t, **kw: nn.blockwise_next_token_loss(h, WV, t, block_size=5, **kw)), H, TOKENS
        ),
        "range": must(
            lambda: nn.blockwise_next_token_loss(H, WV, TOKENS + 3, block_size=5), nm.ArgumentError, "[0, 5)"
        ),
    },
    "nn.binary_cross_entropy_loss": {
        "plain": must(lambda: nn.binary_cross_entropy_loss(plain(LOGITS), LOGITS > 0), nm.ArgumentTypeError, WRAP),
        "extra": checks(
            lambda: per_slice(
                lambda v: nn.binary_cross_entropy_loss(v, nm.sigmoid(v * 2.0), reduction="none"), with_extra(LOGITS)
            ),
            must(lambda: nn.binary_cross_entropy_loss(with_extra(LOGITS), nm.sigmoid(LOGITS)), nm.AxisError, "'c'"),
        ),
        "size": must(
            lambda: nn.binary_cross_entropy_loss(LOGITS, resized(LOGITS, "vocab", 4)), nm.AxisError, "vocab=4"
        ),
        "zero": gives(
            lambda: nn.binary_cross_entropy_loss(values(Batch.resize(0), Vocab), values(Batch.resize(0), Vocab)),
            lambda: np.asarray(0.0),
        ),
        "dtype": gives(
            lambda: nn.binary_cross_entropy_loss(LOGITS, (LOGITS > 0).astype(jnp.int32)),
            lambda: nn.binary_cross_entropy_loss(LOGITS, (LOGITS > 0).astype(jnp.float32)),
        ),
    },
}
cases_kind(
    "losses",
    LOSSES,
    plain="`ArgumentTypeError`: wrap it with `nm.named`",
    missing="`AxisError` naming the axis the loss reads (`vocab`, `position`, `embed`)",
    extra=(
        'a batch axis on the inputs: kept by `reduction="none"`, each slice on its own; a target or `where=` '
        "axis the logits lack: `AxisError`"
    ),
    size="`AxisError` naming the axis and both sizes",
    zero="no token to score (a batch of 0, all ignored or masked): a mean of 0, not NaN",
    dtype=(
        "targets are integer ids (or, for `cross_entropy_loss`, float probabilities over `vocab`): a bool or a "
        "float without `vocab` is an `ArgumentTypeError`; binary targets may be 0/1 integers"
    ),
    range=(
        "an id outside `[0, vocab)` other than `ignore_index` (-100): `ArgumentError` naming the first, when known "
        "before tracing; NaN under `jit`; a `block_size` that does not divide the vocab, a smoothing outside "
        "[0, 1]: `ArgumentError`"
    ),
)


# ---- attention, masks and positions ----------------------------------------------------------------------

Heads, HeadSize, KPos = Axis("heads", 2), Axis("head_size", 4), Axis("key_position", 3)
Q = values(Batch, Pos, Heads, HeadSize, seed=11)
KV = values(Batch, KPos, Heads, HeadSize, seed=12)
POSITIONS = nm.named(jnp.asarray([[0, 1, 2], [4, 5, 6]]), (Batch, Pos))


def _attend(q=Q, k=KV, v=KV, **kw):
    return nn.dot_product_attention(q, k, v, **kw)


def _weights(q=Q, k=KV, **kw):
    return nn.dot_product_attention_weights(q, k, **kw)


ATTENTION = {
    "nn.dot_product_attention": {
        "plain": must(lambda: _attend(k=plain(KV)), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: _attend(q=renamed(Q, "head_size", "d")), nm.AxisError, "'head_size'"),
        "extra": lambda: per_slice(lambda v: _attend(q=v), with_extra(Q)),
        "size": must(lambda: _attend(k=resized(KV, "head_size", 3)), nm.AxisError, "'head_size'"),
        "zero": checks(
            lambda: _same_names(runs(lambda: _attend(Q["batch", 0:0], KV["batch", 0:0], KV["batch", 0:0])), Q.names),
            gives(lambda: _attend(k=KV["key_position", 0:0], v=KV["key_position", 0:0]), lambda: nm.zeros(Q.axes)),
        ),
        "dtype": checks(
            must(lambda: _attend(mask=nm.ones((Pos, KPos))), nm.ArgumentTypeError, "boolean"),
            must(lambda: _attend(mask=nm.ones((Pos, KPos), jnp.int32)), nm.ArgumentTypeError, "boolean"),
        ),
        "range": must(lambda: _attend(causal=True, window=0), nm.ArgumentError, "window=0"),
    },
    "nn.dot_product_attention_weights": {
        "plain": must(lambda: _weights(q=plain(Q)), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: _weights(k=renamed(KV, "key_position", "kp")), nm.AxisError, "'key_position'"),
        "extra": lambda: per_slice(lambda v: _weights(q=v), with_extra(Q)),
        "size": must(lambda: _weights(k=resized(KV, "heads", 3)), nm.AxisError, "'heads'"),
        "dtype": must(lambda: _weights(mask=nm.ones((Pos, KPos))), nm.ArgumentTypeError, "boolean"),
    },
    "nn.rotary_embedding": {
        "plain": must(lambda: nn.rotary_embedding(plain(Q), POSITIONS), nm.ArgumentTypeError, WRAP),
        "missing": must(
            lambda: nn.rotary_embedding(renamed(Q, "head_size", "d"), POSITIONS), nm.AxisError, "'head_size'"
        ),
        "extra": lambda: per_slice(lambda v: nn.rotary_embedding(v, POSITIONS), with_extra(Q)),
        "size": checks(
            must(lambda: nn.rotary_embedding(Q, resized(POSITIONS, "position", 4)), nm.AxisError, "'position'"),
            must(lambda: nn.rotary_embedding(resized(Q, "head_size", 3), POSITIONS), nm.AxisError, "even"),
        ),
        "zero": lambda: _same_names(
            runs(lambda: nn.rotary_embedding(Q["batch", 0:0], POSITIONS["batch", 0:0])), Q.names
        ),
    },
    "nn.alibi_bias": {
        "zero": lambda: _same_names(
            runs(lambda: nn.alibi_bias(Heads.resize(0), Pos, KPos)), ("heads", "position", "key_position")
        ),
        "size": must(lambda: nn.alibi_bias(Heads, Pos, KPos, slopes=values(Heads.resize(3))), nm.AxisError, "'heads'"),
    },
    "nn.alibi_slopes": {"zero": lambda: _same_names(runs(lambda: nn.alibi_slopes(Heads.resize(0))), ("heads",))},
    "nn.causal_mask": {
        "zero": lambda: _same_names(runs(lambda: nn.causal_mask(Pos, KPos.resize(0))), ("position", "key_position")),
        "range": must(lambda: nn.causal_mask(Pos, KPos, window=0), nm.ArgumentError, "window=0"),
    },
    "nn.chunked_mask": {"range": must(lambda: nn.chunked_mask(Pos, KPos, 0), nm.ArgumentError, "chunk")},
    "nn.forgetful_causal_mask": {
        "range": must(lambda: nn.forgetful_causal_mask(KPos, 2.0, key=KEY), nm.ArgumentError, "mask_prob")
    },
    "nn.padding_mask": {
        "plain": must(lambda: nn.padding_mask(jnp.asarray([1, 2]), KPos), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nn.padding_mask(POSITIONS > 0, "kp", Pos="p"), nm.AxisError, "'p'"),
        "dtype": must(
            lambda: nn.padding_mask(nm.named(jnp.asarray([1.0, 2.0]), (Batch,)), KPos), nm.ArgumentTypeError, "float32"
        ),
    },
    "nn.segment_mask": {
        "plain": must(lambda: nn.segment_mask(plain(POSITIONS), POSITIONS), nm.ArgumentTypeError, WRAP),
        "size": must(lambda: nn.segment_mask(POSITIONS, resized(POSITIONS, "batch", 3)), nm.AxisError, "'batch'"),
    },
    "nn.positions_from_segments": {
        "plain": must(lambda: nn.positions_from_segments(plain(POSITIONS)), nm.ArgumentTypeError, WRAP),
        "missing": must(
            lambda: nn.positions_from_segments(renamed(POSITIONS, "position", "p")), nm.AxisError, "'position'"
        ),
        "extra": lambda: per_slice(nn.positions_from_segments, with_extra(POSITIONS) % 2),
        "dtype": must(
            lambda: nn.positions_from_segments(POSITIONS.astype(jnp.float32)), nm.ArgumentTypeError, "float32"
        ),
    },
}
cases_kind(
    "attention, masks and positions",
    ATTENTION,
    plain="`ArgumentTypeError`: wrap it with `nm.named`",
    missing="`AxisError` naming the axis (`head_size`, `key_position`, `position`)",
    extra="batch and head axes: kept, each slice on its own",
    size="`AxisError` naming the axis (`head_size`, `heads`, per-row offsets, positions)",
    zero=(
        "an empty batch: an empty result; no key at all: zeros; every key masked: uniform weights (documented "
        "under `dot_product_attention`), never NaN"
    ),
    dtype="masks are boolean, lengths and segment ids integers: otherwise `ArgumentTypeError`",
    range="a `window`, `chunk` below 1 or a probability outside [0, 1]: `ArgumentError` naming it",
)


# ---- routing -------------------------------------------------------------------------------------------------

ROUTER = values(Batch, Pos, Experts, seed=13)

ROUTING = {
    "nn.route": {
        "plain": must(lambda: nn.route(plain(ROUTER), 1), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nn.route(renamed(ROUTER, "experts", "e"), 1), nm.AxisError, "'experts'"),
        "extra": lambda: per_slice(lambda v: nn.route(v, 1), with_extra(ROUTER)),
        "zero": lambda: _same_names(runs(lambda: nn.route(ROUTER["batch", 0:0], 1)[0]), ("batch", "position", "topk")),
        "range": checks(
            must(lambda: nn.route(ROUTER, 3), nm.ArgumentError, "k=3"),
            must(lambda: nn.route(ROUTER, 0), nm.ArgumentError, "k=0"),
        ),
    },
    "nn.router_stats": {
        "plain": must(
            lambda: nn.router_stats(plain(ROUTER), *nn.route(ROUTER, 1)[::-1][:2][::-1]), nm.ArgumentTypeError, WRAP
        )
    },
    "nn.router_losses": {"missing": must(lambda: nn.router_losses({}), nm.ArgumentError, "expert_share")},
    "nn.load_balancing_loss": {
        "plain": must(lambda: nn.load_balancing_loss(plain(ROUTER), nn.route(ROUTER, 1)[1]), nm.ArgumentTypeError, WRAP)
    },
    "nn.router_z_loss": {
        "plain": must(lambda: nn.router_z_loss(plain(ROUTER)), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nn.router_z_loss(renamed(ROUTER, "experts", "e")), nm.AxisError, "'experts'"),
    },
}
cases_kind(
    "routing",
    ROUTING,
    plain="`ArgumentTypeError`: wrap it with `nm.named`",
    missing="`AxisError` naming `experts` (or the statistic a loss needs: `ArgumentError`)",
    extra="token axes: kept, each token routed on its own",
    zero="no token: empty weights and ids (the statistics are means: NaN over no token, as numpy's)",
    range="`k` outside `[1, experts]`: `ArgumentError`",
)


# ---- transforms ------------------------------------------------------------------------------------------


def _step(c, r):
    return c + r.sum(), r * 2.0


TRANSFORMS = {
    "nm.vmap": {
        "plain": checks(
            gives(
                lambda: nm.vmap(lambda r, q: r * q, "a")(X, jnp.arange(3.0)),
                lambda: np.asarray(X.array) * np.arange(3.0)[:, None],
            ),
            must(lambda: nm.vmap(lambda r, q: r, "a")(X, jnp.ones(5)), nm.AxisError, "'a'", "5"),
        ),
        "missing": must(lambda: nm.vmap(lambda r: r, "nope")(X), nm.AxisError, "'nope'"),
        "extra": lambda: per_slice(nm.vmap(lambda r: nm.softmax(r, "b"), "a"), with_extra(X)),
        "size": must(lambda: nm.vmap(lambda r, q: r, "a")(X, values(A.resize(5))), nm.AxisError, "'a'", "5"),
        "zero": lambda: _same_names(runs(lambda: nm.vmap(lambda r: r * 2.0, "z")(values(Z, A))), ("z", "a")),
    },
    "nm.scan": {
        "plain": must(lambda: nm.scan(_step, "a")(0.0, X, jnp.ones(5)), nm.AxisError, "'a'", "5"),
        "missing": must(lambda: nm.scan(_step, "nope")(0.0, X), nm.AxisError, "'nope'"),
        "extra": must(
            lambda: nm.scan(lambda c, r: (c * r, r), "a")(nm.zeros((B,)), with_extra(X)), nm.AxisError, "carry"
        ),
        "size": must(lambda: nm.scan(lambda c, r, q: (c, r), "a")(0.0, X, values(A.resize(5))), nm.AxisError, "'a'"),
        "zero": gives(
            lambda: nm.scan(_step, "z")(nm.named(jnp.float32(1.0), ()), values(Z, A))[0], lambda: np.asarray(1.0)
        ),
        "dtype": must(lambda: nm.fold(lambda c, r: c * r, "a")(nm.zeros((B,), jnp.int32), X), nm.AxisError, "int32"),
    },
    "nm.fold": {
        "missing": must(lambda: nm.fold(lambda c, r: c, "nope")(0.0, X), nm.AxisError, "'nope'"),
        "zero": gives(
            lambda: nm.fold(lambda c, r: c + r.sum(), "z")(nm.named(jnp.float32(1.0), ()), values(Z, A)),
            lambda: np.asarray(1.0),
        ),
    },
    "nm.map": {
        "missing": must(lambda: nm.map(lambda r: r, "nope")(X), nm.AxisError, "'nope'"),
        "extra": lambda: per_slice(nm.map(lambda r: nm.softmax(r, "b"), "a"), with_extra(X)),
        "zero": lambda: _same_names(runs(lambda: nm.map(lambda r: r * 2.0, "z")(values(Z, A))), ("z", "a")),
    },
    "nm.nmap": {
        "plain": must(lambda: nm.nmap(jnp.sum, consume="b", produce=())(plain()), nm.AxisError, "NamedArray"),
        "missing": must(lambda: nm.nmap(jnp.sum, consume="nope", produce=())(X), nm.AxisError, "'nope'"),
        "extra": lambda: per_slice(nm.nmap(jnp.cumsum, consume="b"), with_extra(X)),
        "zero": gives(lambda: nm.nmap(jnp.sum, consume="z", produce=())(values(A, Z)), lambda: np.zeros(3)),
    },
    "nm.grad": {
        "extra": must(lambda: nm.grad(lambda w: w * 2.0)(X), nm.AxisError, "a=3, b=4"),
        "zero": lambda: _same_names(runs(lambda: nm.grad(lambda w: (w * 2.0).sum())(values(A, Z))), ("a", "z")),
        "dtype": must(lambda: nm.grad(lambda w: w.sum())(X.astype(jnp.int32)), nm.ArgumentTypeError, "int32"),
    },
    "nm.value_and_grad": {"extra": must(lambda: nm.value_and_grad(lambda w: w)(X), nm.AxisError, "reduce it first")},
    "nm.tree_map_layers": {
        "plain": gives(lambda: nm.tree_map_layers(lambda v: v, plain()), lambda: plain()),
        "dtype": must(lambda: nm.tree_map_layers(3, X), nm.ArgumentTypeError, "function"),
    },
    "nm.resize_axis": {
        "missing": must(lambda: nm.resize_axis(X, "nope", 2), nm.AxisError, "'nope'"),
        "plain": gives(lambda: nm.resize_axis({"x": X, "p": plain()}, "b", 2)["p"], lambda: plain()),
        "zero": lambda: _same_names(runs(lambda: nm.resize_axis(X, "b", 0)), ("a", "b")),
        "range": must(lambda: nm.resize_axis(X, "b", -1), nm.ArgumentError, "-1"),
    },
    "nn.checkpoint_name": {
        "plain": must(lambda: nn.checkpoint_name(plain(), "h"), nm.ArgumentTypeError, WRAP),
        "dtype": must(lambda: nn.checkpoint_name(X, 3), nm.ArgumentTypeError, "3"),
    },
    "nm.tree_checkpoint_name": {
        "plain": lambda: runs(lambda: nm.tree_checkpoint_name(plain(), "h")),
        "dtype": must(lambda: nm.tree_checkpoint_name(X, 3), nm.ArgumentTypeError, "3"),
    },
}
cases_kind(
    "transforms and tree utilities",
    TRANSFORMS,
    plain=(
        "mapped (`vmap`, `scan`, `fold`, `map`) along its first dimension, whose size must be the axis' (else "
        "`AxisError`); a tree utility leaves a plain leaf as it is; `nmap` and `checkpoint_name` need NamedArrays"
    ),
    missing="an axis that no input has (or that `nmap` consumes, `resize_axis` resizes): `AxisError` naming it",
    extra=(
        "inputs without the mapped axis are passed whole; `vmap` and `map` keep an extra axis per slice; a scan "
        "carry must keep its axes, and a loss to differentiate must have none (`AxisError`)"
    ),
    size="the mapped axis at two sizes: `AxisError` naming it and both sizes",
    zero="a mapped axis of size 0: no step runs (an empty result, the initial carry)",
    dtype=(
        "a scan carry keeps its dtype (`AxisError` naming the change); a loss to differentiate is floating, a "
        "checkpoint name a string, a mapped function callable (`ArgumentTypeError`)"
    ),
    range="`resize_axis` to a negative size: `ArgumentError`",
)


# ---- random ------------------------------------------------------------------------------------------------

# name -> (the draw's keyword parameters, each a valid number; one parameter outside its domain, or None)
DRAW_PARAMS = {
    "normal": ({"mean": 0.0, "stddev": 1.0}, {"stddev": -1.0}),
    "uniform": ({"minval": 0.0, "maxval": 1.0}, {"minval": 2.0}),
    "truncated_normal": ({"lower": -1.0, "upper": 1.0}, {"lower": 3.0}),
    "bernoulli": ({"p": 0.5}, {"p": 1.5}),
    "randint": ({"minval": 0, "maxval": 5}, {"minval": 9}),
    **{n: ({p: 1.0 for p in nm.random.DRAWS[n][1]}, None) for n in nm.random.DRAWS},
    "beta": ({"a": 1.0, "b": 1.0}, {"a": -1.0}),
    "gamma": ({"a": 1.0}, {"a": 0.0}),
    "loggamma": ({"a": 1.0}, {"a": -2.0}),
    "poisson": ({"lam": 2.0}, {"lam": -1.0}),
    "t": ({"df": 3.0}, {"df": 0.0}),
    "chisquare": ({"df": 3.0}, {"df": -1.0}),
    "pareto": ({"b": 2.0}, {"b": 0.0}),
    "geometric": ({"p": 0.5}, {"p": 2.0}),
    "weibull_min": ({"scale": 1.0, "concentration": 1.0}, {"scale": -1.0}),
    "binomial": ({"n": 5.0, "p": 0.5}, {"p": -0.5}),
    "block_draw": (None, None),
}


def _draw(name, axes, **params):
    if name == "nm.random.block_draw":
        return nm.random.block_draw(lambda shape: jax.random.normal(KEY, shape), axes)
    short = name.split(".")[-1]
    return getattr(nm.random, short)(KEY, axes, **{**DRAW_PARAMS[short][0], **params})


def _with_param(check):
    """A probe for the draws that take parameters: ``check(name, first parameter's name)``."""

    def probe(n, fn):
        params = DRAW_PARAMS[n.split(".")[-1]][0]
        if params:
            check(n, next(iter(params)))

    return probe


def _param_value(name, pname, axes):
    base = DRAW_PARAMS[name.split(".")[-1]][0][pname]
    return nm.full(axes, base)


def _draw_zero(name, fn):
    out = abstract(lambda: _draw(name, (A, Z)))
    shape = out.shape if isinstance(out, nm.NamedArray) else dict(zip("az", out.shape))
    assert shape == {"a": 3, "z": 0}, describe(out)


kind(
    "random draws over axes",
    " ".join(f"nm.random.{n}" for n in DRAW_PARAMS),
    plain=Rule(
        "a parameter with dimensions: `AxisError` (wrap it with `nm.named`); a number or a 0-d array is one "
        "value for every entry",
        _with_param(lambda n, p: refused(lambda: _draw(n, (A, B), **{p: jnp.ones((3, 4))}), nm.AxisError, WRAP)),
    ),
    missing=Rule(
        "an axis given by name alone (a draw needs its size): `AxisError` naming it",
        lambda name, fn: refused(lambda: _draw(name, ("a", "b")), nm.AxisError, "'a'"),
    ),
    extra=Rule(
        "a parameter's axes must be among the drawn ones: another is an `AxisError` naming it",
        _with_param(lambda n, p: refused(lambda: _draw(n, (A,), **{p: _param_value(n, p, (C,))}), nm.AxisError, "c=2")),
    ),
    size=Rule(
        "a parameter axis of another size: `AxisError` naming it",
        _with_param(
            lambda n, p: refused(
                lambda: _draw(n, (A, B), **{p: _param_value(n, p, (B.resize(5),))}), nm.AxisError, "'b'"
            )
        ),
    ),
    zero=Rule("an empty draw with the requested axes (`block_draw`: the raw array, of their sizes)", _draw_zero),
    dtype=Rule(
        "a dtype `jax.random` cannot draw (an int normal, a float randint): `ArgumentTypeError` naming it",
        lambda name, fn: (
            name in ("nm.random.normal", "nm.random.randint")
            and refused(
                lambda: fn(
                    KEY,
                    (A,),
                    **DRAW_PARAMS[name.split(".")[-1]][0],
                    dtype=jnp.int32 if name.endswith("normal") else jnp.float32,
                ),
                nm.ArgumentTypeError,
                "dtype",
            )
        ),
    ),
    range=Rule(
        "a parameter known before tracing outside its domain (a probability outside [0, 1], a shape or scale "
        "<= 0, an interval in the wrong order): `ArgumentError` naming it; traced: jax.random's",
        lambda name, fn: (
            DRAW_PARAMS[name.split(".")[-1]][1]
            and refused(
                lambda: _draw(name, (A,), **DRAW_PARAMS[name.split(".")[-1]][1]),
                nm.ArgumentError,
                next(iter(DRAW_PARAMS[name.split(".")[-1]][1])),
            )
        ),
    ),
)

KEYS = nm.named(jax.random.split(KEY, 3), (A,))
FROM_ARRAYS = {
    "nm.random.permutation": {
        "plain": must(lambda: nm.random.permutation(KEY, plain(), "b"), nm.ArgumentTypeError, "NamedArray"),
        "missing": must(lambda: nm.random.permutation(KEY, X, "nope"), nm.AxisError, "'nope'"),
        "zero": lambda: _same_names(runs(lambda: nm.random.permutation(KEY, Z)), ("z",)),
    },
    "nm.random.choice": {
        "plain": must(lambda: nm.random.choice(KEY, plain(), (C,), axis="b"), nm.ArgumentTypeError, "NamedArray"),
        "missing": must(lambda: nm.random.choice(KEY, X, (C,), axis="nope"), nm.AxisError, "'nope'"),
        "size": must(lambda: nm.random.choice(KEY, X, (C,), axis="b", p=values(B.resize(5))), nm.AxisError, "b=5"),
        "zero": must(lambda: nm.random.choice(KEY, values(A, Z), (C,), axis="z"), nm.AxisError, "'z'"),
        "range": must(
            lambda: nm.random.choice(KEY, X, (Axis("d", 9),), axis="b", replace=False), nm.ArgumentError, "d=9"
        ),
    },
    "nm.random.categorical": {
        "plain": must(lambda: nm.random.categorical(KEY, plain(), "b"), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nm.random.categorical(KEY, X, "nope"), nm.AxisError, "'nope'"),
        "zero": must(lambda: nm.random.categorical(KEY, values(A, Z), "z"), nm.AxisError, "'z'"),
    },
    "nm.random.dirichlet": {
        "plain": must(lambda: nm.random.dirichlet(KEY, jnp.ones(3), "a"), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nm.random.dirichlet(KEY, X + 2.0, "nope"), nm.AxisError, "'nope'"),
        "range": must(lambda: nm.random.dirichlet(KEY, X, "b"), nm.ArgumentError, "> 0"),
    },
    "nm.random.split": {
        "plain": must(lambda: nm.random.split(jax.random.split(KEY, 3)), nm.ArgumentTypeError, "nm.named"),
        "extra": must(lambda: nm.random.split(KEYS, A), nm.AxisError, "'a'"),
        "dtype": must(
            lambda: nm.random.split(nm.named(jnp.zeros((3, 2), jnp.uint32), (A, C))), nm.ArgumentTypeError, "uint32"
        ),
        "range": must(lambda: nm.random.split(KEY, -1), nm.ArgumentError, "-1"),
    },
}
cases_kind(
    "random draws from arrays and keys",
    FROM_ARRAYS,
    plain="`ArgumentTypeError` (wrap it with `nm.named`; keys to split each: `nm.named(keys, names)`)",
    missing="`AxisError` naming it",
    extra="a new axis the array (or the keys) already has: `AxisError`",
    size="`p=` over the chosen axis at another size: `AxisError`",
    zero="drawing from an axis of size 0: `AxisError`; a permutation of nothing is empty",
    dtype="keys are typed keys (`jax.random.key`): raw uint32 key data is an `ArgumentTypeError`",
    range=(
        "more draws without replacement than entries, a negative count, concentrations <= 0 known before "
        "tracing: `ArgumentError`"
    ),
)


# ---- explicit mode -----------------------------------------------------------------------------------------

Rows, Wide = Axis("batch", 8), Axis("embed", 8)
XR = values(Rows, Wide, seed=14)


def _in_block(body: Callable[[nm.NamedArray], Any]) -> Callable[[], Any]:
    """``body`` on the local blocks of ``XR`` split over ``data`` (8 devices); a refusal comes while tracing."""
    return lambda: nm.shard_map(body, mesh=_mesh8(), in_mapping={"batch": "data"})(XR)


EXPLICIT = {
    "nm.psum": {
        "plain": must(_in_block(lambda v: nm.psum(v.array, "batch")), nm.ArgumentTypeError, WRAP),
        "missing": must(_in_block(lambda v: nm.psum(v, "nope")), nm.AxisError, "'nope'"),
    },
    "nm.pmean": {
        "plain": must(_in_block(lambda v: nm.pmean(v.array, "batch")), nm.ArgumentTypeError, WRAP),
        "missing": must(_in_block(lambda v: nm.pmean(v, "nope")), nm.AxisError, "'nope'"),
    },
    "nm.pmax": {"missing": must(_in_block(lambda v: nm.pmax(v, "nope")), nm.AxisError, "'nope'")},
    "nm.all_gather": {
        "plain": must(_in_block(lambda v: nm.all_gather(v.array, "batch")), nm.ArgumentTypeError, WRAP),
        "missing": must(_in_block(lambda v: nm.all_gather(v, "nope")), nm.AxisError, "'nope'"),
    },
    "nm.psum_scatter": {"missing": must(_in_block(lambda v: nm.psum_scatter(v, "nope")), nm.NamedError, "'nope'")},
    "nm.all_to_all": {
        "missing": must(_in_block(lambda v: nm.all_to_all(v, split="nope", concat="batch")), nm.AxisError, "'nope'")
    },
    "nm.axis_index": {"missing": must(lambda: nm.axis_index("batch"), nm.NamedError, "shard_map")},
    "nm.einsum_unreduced": {
        "plain": must(
            lambda: nm.einsum_unreduced("batch embed -> batch", plain(XR)), nm.ArgumentTypeError, "NamedArray"
        )
    },
    "nm.with_layout": {
        "plain": must(lambda: nm.with_layout(plain(XR), "batch embed"), nm.ArgumentTypeError, WRAP),
        "missing": must(lambda: nm.with_layout(XR, "batch nope"), nm.AxisError, "'nope'"),
    },
    "nm.explicit.block_layout": {
        "plain": must(lambda: nm.explicit.block_layout(plain(XR)), nm.ArgumentTypeError, WRAP)
    },
    "nm.shard_map": {
        "size": must(
            lambda: nm.shard_map(lambda v: v, mesh=_mesh8(), in_mapping={"embed": "data"})(values(Rows, Embed)),
            nm.ShardingError,
            "'embed'",
        )
    },
    "nm.Unreduced": {"plain": must(lambda: nm.Unreduced(plain(XR), ("data",)), nm.ArgumentTypeError, "NamedArray")},
    "nm.ShardedAxis": {"range": must(lambda: nm.ShardedAxis("a", -1), nm.AxisError, "-1")},
}
cases_kind(
    "explicit mode",
    EXPLICIT,
    plain="`ArgumentTypeError`: wrap it with `nm.named`",
    missing="an axis the block lacks: `AxisError` naming it; a collective outside `nm.shard_map`: `NamedError`",
    size="an axis the mapping splits over mesh axes that do not divide it: `ShardingError` naming it",
    range="a negative size: `AxisError`",
)


# ---- layout and partitioning -------------------------------------------------------------------------------


def _mesh8():
    return nm.make_mesh({"data": 8})  # made when a probe runs (the test session has 8 devices), not on import


PARTITIONING = {
    "nm.shard": {
        "plain": gives(lambda: nm.shard(plain(XR), {"batch": "data"}, _mesh8()), lambda: plain(XR)),
        "missing": lambda: _same_names(runs(lambda: nm.shard(XR, {"nope": "data"}, _mesh8())), XR.names),
        "size": must(lambda: nm.shard(values(Rows, Embed), {"embed": "data"}, _mesh8()), nm.ShardingError, "'embed'"),
        "zero": lambda: _same_names(
            runs(lambda: nm.shard(values(Rows.resize(0), Wide), {"batch": "data"}, _mesh8())), XR.names
        ),
    },
    "nm.named_jit": {
        "size": must(
            lambda: nm.named_jit(lambda v: v, mapping={"embed": "data"}, mesh=_mesh8())(values(Rows, Embed)),
            nm.ShardingError,
            "'embed'",
        )
    },
    "nm.sharding_for": {
        "size": must(
            lambda: nm.sharding_for(values(Rows, Embed), {"embed": "data"}, _mesh8()), nm.ShardingError, "'embed'"
        ),
        "missing": must(lambda: nm.sharding_for(XR, {"batch": "nope"}, _mesh8()), nm.ShardingError, "'nope'"),
    },
    "nm.pspec_for": {
        "missing": must(lambda: nm.pspec_for(XR, {"batch": "nope"}, _mesh8()), nm.ShardingError, "'nope'"),
        "plain": lambda: _assert(nm.pspec_for(plain(XR), {"batch": "data"}, _mesh8()) == jax.P(), "not P()"),
    },
    "nm.infer_shardings": {
        "size": must(
            lambda: nm.infer_shardings({"w": values(Rows, Embed)}, {"embed": "data"}, _mesh8()),
            nm.ShardingError,
            "'embed'",
        )
    },
    "nm.check_sharding": {
        "size": must(
            lambda: nm.check_sharding({"w": values(Rows, Embed)}, {"embed": "data"}, _mesh8()),
            nm.ShardingError,
            "'embed'",
        )
    },
    "nm.check_mapping": {
        "missing": must(lambda: nm.check_mapping({"batch": "nope"}, _mesh8()), nm.ShardingError, "'nope'")
    },
    "nm.make_mesh": {"size": must(lambda: nm.make_mesh({"data": 3}), nm.ShardingError, "3")},
    "nm.mesh_sizes": {"size": must(lambda: nm.mesh_sizes({"data": -1, "model": 3}, 8), nm.ShardingError, "3")},
    "nm.set_mesh": {"dtype": must(lambda: nm.set_mesh(3), nm.ArgumentTypeError, "Mesh")},
    "nm.axis_mapping": {"dtype": must(lambda: nm.axis_mapping(3).__enter__(), nm.ShardingError, "mapping")},
    "nm.current_mapping": {},
    "nm.current_mesh": {},
    "nm.layout": {"plain": must(lambda: nm.layout(plain(XR)), nm.ArgumentTypeError, WRAP)},
    "nm.parse_layout": {"missing": must(lambda: nm.parse_layout("batch/ embed"), nm.AxisError, "batch/")},
    "nm.compiled_report": {"dtype": must(lambda: nm.compiled_report(3), nm.ArgumentTypeError, "int")},
    "nm.param_report": {"plain": lambda: runs(lambda: nm.param_report({"w": plain(XR)}, {"batch": "data"}, _mesh8()))},
    "nm.field": {"missing": must(lambda: nm.field(axis_names=3), nm.AxisError, "3")},
    "nm.debug.visualize_shardings": {"plain": lambda: runs(lambda: nm.debug.visualize_shardings({"w": plain(XR)}))},
    "nm.partitioning": {},
    "nm.inspect": {},
}
cases_kind(
    "layout and partitioning",
    PARTITIONING,
    plain="a plain leaf has no names: it is left as it is, replicated (`P()`)",
    missing=(
        "a mapping may name axes an array lacks (they are skipped); a mesh axis the mesh lacks: `ShardingError` "
        "naming it"
    ),
    size="an axis whose size its mesh axes do not divide, a mesh shape the devices do not fill: `ShardingError`",
    zero="as any size (0 divides)",
    dtype="a mesh, mapping or program of another type: `ArgumentTypeError` / `ShardingError`",
)


# ---- state dicts and files -----------------------------------------------------------------------------------

LIN = nn.Linear.init(Embed, Mlp, key=KEY)
SD = nm.state_dict(LIN)
STATE = {
    "nm.state_dict": {
        "plain": gives(lambda: nm.state_dict({"w": plain()})["w"], lambda: plain()),
        "zero": lambda: _assert(
            nm.state_dict(nn.Linear.init(Embed.resize(0), Mlp, key=KEY))["weight"].shape == (0, 6), "not (0, 6)"
        ),
    },
    "nm.state_dict_entries": {"plain": lambda: _assert(nm.state_dict_entries({"w": plain()})[0].path == "w", "no 'w'")},
    "nm.load_state_dict": {
        "missing": must(lambda: nm.load_state_dict(LIN, {"weight": SD["weight"]}), nm.StateDictError, "'bias'"),
        "extra": must(lambda: nm.load_state_dict(LIN, {**SD, "zzz": np.ones(3)}), nm.StateDictError, "'zzz'"),
        "size": must(lambda: nm.load_state_dict(LIN, {**SD, "weight": np.ones((3, 6))}), nm.StateDictError, "'weight'"),
        "zero": lambda: runs(
            lambda: nm.load_state_dict(
                nn.Linear.init(Embed.resize(0), Mlp, key=KEY),
                nm.state_dict(nn.Linear.init(Embed.resize(0), Mlp, key=KEY)),
            )
        ),
        "dtype": must(
            lambda: nm.load_state_dict(LIN, {**SD, "weight": np.ones((4, 6), np.int32)}), nm.StateDictError, "integer"
        ),
    },
    "nm.load_state_dict_file": {
        "missing": must(lambda: nm.load_state_dict_file(LIN, "no-such-file.safetensors"), nm.NamedError, "no-such-file")
    },
    "nm.save_state_dict": {},
    "nm.square_keys": {
        "plain": gives(lambda: nm.square_keys({"w": plain()}), lambda: np.zeros(0)),
        "zero": gives(lambda: nm.square_keys(nn.Linear.init(Embed.resize(0), Mlp, key=KEY)), lambda: np.zeros(0)),
    },
    "nm.stack_state_dict": {
        "missing": must(
            lambda: nm.stack_state_dict({"b.0.w": np.ones(2), "b.2.w": np.ones(2)}, "b"), nm.StateDictError, "b.1.w"
        ),
        "dtype": must(lambda: nm.stack_state_dict({}, 3), nm.ArgumentTypeError, "3"),
    },
    "nm.unstack_state_dict": {
        "zero": lambda: _assert(nm.unstack_state_dict({"b.w": np.ones((0, 2))}, "b") == {}, "layers from none"),
        "dtype": must(lambda: nm.unstack_state_dict({}, None), nm.ArgumentTypeError, "None"),
    },
    "nm.save_safetensors": {
        "dtype": must(lambda: nm.save_safetensors(plain(), "unused.safetensors"), nm.ArgumentTypeError, "mapping")
    },
    "nm.flatten_modules_for_export": {"plain": gives(lambda: nm.flatten_modules_for_export(plain()), lambda: plain())},
    "nm.unflatten_modules_from_export": {
        "extra": must(lambda: nm.unflatten_modules_from_export({"x": 1}, LIN), nm.StateDictError, "template")
    },
    "nm.StateDictEntry": {},
}
cases_kind(
    "state dicts and files",
    STATE,
    plain="a plain leaf is an entry under its path, as it is",
    missing="a key the module needs and the dict lacks, a file that is not there, a layer missing from a stack: "
    "`StateDictError` naming it",
    extra="a key the module has no parameter for (`strict=True`), a tree not shaped as the template: `StateDictError`",
    size="a tensor of another shape: `StateDictError` naming the key, both shapes and the axes",
    zero="zero-size parameters round-trip as any",
    dtype="integers for a float parameter: `StateDictError`; not a mapping of arrays: `ArgumentTypeError`",
)


# ---- model transforms ----------------------------------------------------------------------------------------

POLICY = "params=float32,compute=bfloat16,output=float32"
MODEL_TRANSFORMS = {
    "nn.quantize": {
        "plain": gives(lambda: nn.quantize(plain(), "int8"), lambda: plain()),
        "range": must(lambda: nn.quantize(LIN, "fp4"), nm.ArgumentError, "fp4"),
    },
    "nn.lora.apply": {
        "missing": must(lambda: nn.lora.apply({"l": LIN}, "nope", rank=2, key=KEY), nm.ArgumentError, "nope"),
        "range": must(lambda: nn.lora.apply({"l": LIN}, "l", rank=0, key=KEY), nm.ArgumentError, "rank 0"),
    },
    "nn.lora.merge": {"plain": gives(lambda: nn.lora.merge(plain()), lambda: plain())},
    "nn.lora.trainable": {},
    "nn.lora.with_dropout_keys": {},
    "nn.lora.linear_paths": {
        "plain": lambda: _assert(nn.lora.linear_paths(plain()) == [], "a Linear in a plain array")
    },
    "nn.mup.roles": {"missing": must(lambda: nn.mup.roles(LIN, {"nope": 2}), nm.ArgumentError, "nope")},
    "nn.mup.rescale_init": {"missing": must(lambda: nn.mup.rescale_init(LIN, {"nope": 2}), nm.ArgumentError, "nope")},
    "nn.mup.scale_updates": {"missing": must(lambda: nn.mup.scale_updates(LIN, {"nope": 2}), nm.ArgumentError, "nope")},
    "nn.mup.scale_reparam_updates": {
        "plain": gives(lambda: nn.mup.scale_reparam_updates(plain(), plain()), lambda: plain())
    },
    "nn.cast_for_compute": {"dtype": must(lambda: nn.cast_for_compute(LIN, "params=foo"), nm.ArgumentError, "foo")},
    "nn.cast_output": {"plain": lambda: _assert(nn.cast_output(plain(), POLICY).dtype == jnp.float32, "not float32")},
    "nn.cast_to_param": {
        "plain": lambda: _assert(nn.cast_to_param(plain(), POLICY).dtype == jnp.float32, "not float32")
    },
    "nn.get_policy": {"dtype": must(lambda: nn.get_policy("params=foo"), nm.ArgumentError, "foo")},
    "nn.keeps_full_precision": {"plain": lambda: _assert(nn.keeps_full_precision(plain()) is False, "a plain array")},
    "nn.is_overwrite_state": {"plain": lambda: _assert(nn.is_overwrite_state(plain()) is False, "a plain array")},
    "nn.without_overwrites": {"plain": gives(lambda: nn.without_overwrites(plain()), lambda: plain())},
    "nn.overwrite_updates": {"plain": gives(lambda: nn.overwrite_updates(plain(), plain(), plain()), lambda: plain())},
    "nm.debug.diagnose_common_issues": {"plain": lambda: runs(lambda: nm.debug.diagnose_common_issues({"w": plain()}))},
}
cases_kind(
    "model transforms",
    MODEL_TRANSFORMS,
    plain="a plain array is a leaf like any other: nothing to transform, returned as it is",
    missing="targets or base widths that match no layer: `ArgumentError` naming them",
    dtype="an unknown dtype in a precision policy: `ArgumentError` naming it",
    range="a rank, a kind or a history outside what the transform takes: `ArgumentError`",
)


# ---- types, errors and configuration ---------------------------------------------------------------------

CONFIG = {
    "nm.Axis": {
        "range": must(lambda: Axis("a", -1), nm.AxisError, "-1"),
        "dtype": must(lambda: Axis("a", 2.5), nm.AxisError, "2.5"),
    },
    "nm.AxisSelection": {},
    "nm.AxisSelector": {},
    "nm.ResourceMapping": {},
    "nm.NamedError": {},
    "nm.AxisError": {},
    "nm.ArgumentError": {},
    "nm.ArgumentTypeError": {},
    "nm.FileWriteError": {},
    "nm.ShardingError": {},
    "nm.StateDictError": {},
    "nm.UnreducedError": {},
    "nm.ShardingCheck": {},
    "nm.debug.ModuleProblems": {},
    "nm.axes_of": {
        "plain": must(lambda: nm.axes_of(plain()), nm.AxisError, WRAP),
        "dtype": must(lambda: nm.axes_of([1, 2]), nm.ArgumentTypeError, "list"),
    },
    "nm.is_named_array": {"plain": lambda: _assert(nm.is_named_array(plain()) is False, "a plain array")},
    "nm.axis_spec_to_tuple": {"dtype": must(lambda: nm.axis_spec_to_tuple(3), nm.AxisError, "3")},
    "nm.axis_spec_to_shape_dict": {
        "dtype": must(lambda: nm.axis_spec_to_shape_dict({"a": 2.5}), nm.AxisError, "2.5"),
        "range": must(lambda: nm.axis_spec_to_shape_dict({"a": -1}), nm.AxisError, "-1"),
    },
    "nm.concat_axes": {"size": must(lambda: nm.concat_axes((A, B), (B,)), nm.AxisError, "'b'")},
    "nm.eliminate_axes": {
        "missing": must(lambda: nm.eliminate_axes((A, B), "z"), nm.AxisError, "'z'"),
        "size": must(lambda: nm.eliminate_axes((A, B), B.resize(9)), nm.AxisError, "'b'"),
    },
    "nm.without_axes": {"size": must(lambda: nm.without_axes((A, B), B.resize(9)), nm.AxisError, "'b'")},
    "nm.replace_axis": {"missing": must(lambda: nm.replace_axis((A, B), "z", C), nm.AxisError, "'z'")},
    "nn.DynamicLossScale": {"range": must(lambda: nn.DynamicLossScale(period=0), nm.ArgumentError, "period")},
    "nn.all_finite": {"plain": lambda: _assert(bool(nn.all_finite(plain())), "a finite plain array")},
    "nm.typecheck": {"dtype": must(lambda: nm.typecheck(3), nm.ArgumentTypeError, "int")},
    "nn.QuantConfig": {"range": must(lambda: nn.QuantConfig("fp8", history=0), nm.ArgumentError, "history")},
    "nn.Fp8State": {"range": must(lambda: nn.Fp8State.init(0), nm.ArgumentError, "history")},
    "nn.Remat": {"range": must(lambda: nn.Remat(every=0), nm.ArgumentError, "every=0")},
    "nm.ScanCheckpointPolicy": {"dtype": must(lambda: nm.ScanCheckpointPolicy(save_carries=3), nm.ArgumentError, "3")},
    "nn.remat_policy": {"missing": must(lambda: nn.remat_policy("whatever"), nm.ArgumentError, "whatever")},
    "nn.ExplicitStack": {
        "range": must(lambda: nn.ExplicitStack({}, {}, batch_split=0), nm.ArgumentError, "batch_split")
    },
    "nn.explicit_layers": {"dtype": must(lambda: nn.explicit_layers(3).__enter__(), nm.ArgumentTypeError, "int")},
    "nn.gather_per_use": {
        "dtype": must(lambda: nn.gather_per_use(["embed"]).__enter__(), nm.ArgumentTypeError, "list")
    },
    "nn.attention_implementation": {
        "missing": must(lambda: nn.attention_implementation("nope").__enter__(), nm.ArgumentError, "nope")
    },
    "nn.attention_keeps_scores": {"missing": must(lambda: nn.attention_keeps_scores("nope"), nm.ArgumentError, "nope")},
    "nn.auto_attention": {},
    "nn.activation": {"missing": must(lambda: nn.activation("nope"), nm.ArgumentError, "nope")},
    "nn.mup.AbstractLinearReparam": {"dtype": must(lambda: nn.mup.AbstractLinearReparam(3, 4), nm.AxisError, "3")},
    "nn.mup.LinearStandardParam": {},
    "nn.mup.InputLinearMup": {},
    "nn.mup.HiddenLinearMup": {},
    "nn.mup.OutputLinearMup": {},
    "nn.mup.AbstractEmbeddingReparam": {},
    "nn.mup.EmbeddingStandardParam": {},
    "nn.mup.EmbeddingMup": {},
}
cases_kind(
    "types, errors and configuration",
    CONFIG,
    plain="`axes_of` refuses an array with dimensions (`AxisError`: wrap it); `is_named_array` says False; "
    "`all_finite` checks it as any leaf",
    missing="an unknown name (a policy, an activation, an implementation): `ArgumentError` listing the known ones; "
    "an axis an axis spec lacks (`eliminate_axes`, `replace_axis`): `AxisError` naming it",
    size="one name at two sizes in two axis specs (or in both of `concat_axes`'): `AxisError` naming it",
    dtype="a value of the wrong type (a float size, a number for a function or an axis): a `NamedError` naming it",
    range="a value outside its range (a negative size, `every=0`, a history of 0): `ArgumentError`/`AxisError`",
)


# ---- argument kinds -------------------------------------------------------------------------------------
# A mask, a bias, weights, a pair of axes whose order matters and a square weight's orientation are
# kinds of argument that a value of the right shape can fill with the wrong meaning (a 0/1 mask as a
# bias, an additive mask as where=, the key axis where the query's goes, a torch-layout file into our
# layout): nothing about the shape tells. ARG_KINDS says what each kind accepts and what the refusal of
# each other input names (the right argument); ARGUMENTS gives, for every public function that takes
# one, a call of it per argument. test_every_kinded_argument_is_declared walks the signatures, so a new
# mask=, where=, bias=, weights= or query/key pair fails until it has a row here.


@dataclasses.dataclass(frozen=True)
class ArgKind:
    """``accepts``: the docs' text; ``right(axes)``: an input of the kind, which every member takes;
    ``wrong``: description -> an input every member refuses with ``exc`` naming ``names``."""

    accepts: str
    right: Callable[[tuple], Any]
    wrong: dict[str, Callable[[tuple], Any]]
    exc: type = nm.NamedError
    names: str = ""


def _keep(axes) -> nm.NamedArray:
    """A boolean over ``axes`` with both values, True first (no row is empty)."""
    n = math.prod(a.size for a in axes)
    return nm.named(jnp.asarray(np.arange(n).reshape([a.size for a in axes]) % 3 != 1), axes)


ARG_KINDS = {
    "mask": ArgKind(
        "boolean, True = keep (attend, count the token); its dtype is the whole rule",
        _keep,
        {
            "0/1 floats": lambda axes: _keep(axes).astype(jnp.float32),
            "0/1 integers": lambda axes: _keep(axes).astype(jnp.int32),
            "an additive 0/-inf mask": lambda axes: nm.where(_keep(axes), 0.0, -jnp.inf),
        },
        nm.ArgumentTypeError,
        "`mask != 0`",
    ),
    "no mask": ArgKind(
        "none: an elementwise op takes no where= (write nm.where(mask, op(...), fallback))",
        lambda axes: None,
        {"a boolean mask": _keep},
        nm.ArgumentTypeError,
        "nm.where(",
    ),
    "bias": ArgKind(
        "floats added to the scores (0 = unchanged, -inf = blocked)",
        lambda axes: nm.where(_keep(axes), 0.0, -1.5),
        {"a boolean mask": _keep, "0/1 integers": lambda axes: _keep(axes).astype(jnp.int32)},
        nm.ArgumentTypeError,
        "mask=",
    ),
    "weights": ArgKind(
        "numbers over (some of) the input's axes, used as numpy uses them (a boolean counts as 0/1)",
        lambda axes: _keep(axes).astype(jnp.float32) * 2.5,
        {},
    ),
    "query/key axes": ArgKind(
        "the query's axis as QPos, the key's as KPos (positionally: query first)",
        lambda axes: axes,
        {"the two swapped": lambda axes: axes[::-1]},
        nm.AxisError,
        "QPos",
    ),
    "square weight orientation": ArgKind(
        "the layout the file records (save_state_dict writes it) or flatten= given; a square weight from "
        "a source that records none (torch's) needs flatten=",
        lambda axes: "ours",
        {"a torch-layout square weight without a record": lambda axes: "torch"},
        nm.StateDictError,
        "flatten=True",
    ),
}

SQ_IN, SQ_OUT = Axis("embed", 4), Axis("out", 4)


def _square() -> nn.Linear:
    return nn.Linear.init(SQ_IN, SQ_OUT, key=KEY)


def _load_square(source: str, loader, tmp=None):
    """Load a square Linear from our own file or dict (``"ours"``, checked equal) or from a torch-layout
    one that does not say so (``"torch"``: the member must refuse it)."""
    lin = _square()
    torch_sd = {k: np.asarray(v) for k, v in nm.state_dict(lin, flatten=True).items()}
    template = nn.Linear.init(SQ_IN, SQ_OUT, key=jax.random.key(1))
    if loader is nm.load_state_dict:
        if source == "torch":
            import torch

            return nm.load_state_dict(template, {k: torch.from_numpy(v.copy()) for k, v in torch_sd.items()})
        out = nm.load_state_dict(template, nm.state_dict(lin))
    else:
        import tempfile

        from safetensors.numpy import save_file

        with tempfile.TemporaryDirectory() as d:
            path = pathlib.Path(d) / "m.safetensors"
            if source == "torch":
                save_file(torch_sd, str(path))  # another writer: no layout record
                return nm.load_state_dict_file(template, path)
            nm.save_state_dict(lin, path, flatten=True)
            out = nm.load_state_dict_file(template, path)
    np.testing.assert_array_equal(
        np.asarray(out.weight.rearrange(lin.weight.names).array), np.asarray(lin.weight.array)
    )
    return out


def _ids_b() -> nm.NamedArray:
    return nm.named(jnp.asarray([0, 2, 2, 1]), (B,))


def _bincount_checked(w):
    got = nm.bincount(_ids_b(), Axis("found", 3), weights=w)
    want = np.bincount(np.asarray(_ids_b().array), weights=np.asarray(w.array), minlength=3)
    np.testing.assert_allclose(as_numpy(got), want, rtol=1e-6)
    return got


# member -> [(argument, kind, the axes its values are over, use(value))]
ARGUMENTS: dict[str, list[tuple[str, str, tuple, Callable[[Any], Any]]]] = {
    "nn.dot_product_attention": [
        ("mask", "mask", (KPos,), lambda v: _attend(mask=v)),
        ("bias", "bias", (Pos, KPos), lambda v: _attend(bias=v)),
        ("QPos, KPos", "query/key axes", (Pos, KPos), lambda ax: _attend(QPos=ax[0], KPos=ax[1])),
    ],
    "nn.dot_product_attention_weights": [
        ("mask", "mask", (KPos,), lambda v: _weights(mask=v)),
        ("bias", "bias", (Pos, KPos), lambda v: _weights(bias=v)),
        ("QPos, KPos", "query/key axes", (Pos, KPos), lambda ax: _weights(QPos=ax[0], KPos=ax[1])),
    ],
    "nn.causal_mask": [("QPos, KPos", "query/key axes", (Pos, KPos), lambda ax: nn.causal_mask(*ax))],
    "nn.chunked_mask": [("QPos, KPos", "query/key axes", (Pos, KPos), lambda ax: nn.chunked_mask(*ax, 2))],
    "nn.alibi_bias": [("QPos, KPos", "query/key axes", (Pos, KPos), lambda ax: nn.alibi_bias(Heads, *ax))],
    "nn.cross_entropy_loss": [("where", "mask", (Pos,), lambda v: _ce(LOGITS, TOKENS, where=v))],
    "nn.binary_cross_entropy_loss": [
        ("where", "mask", (Pos,), lambda v: nn.binary_cross_entropy_loss(LOGITS, nm.sigmoid(LOGITS), where=v)),
        (
            "pos_weight",
            "weights",
            (Vocab,),
            lambda v: nn.binary_cross_entropy_loss(LOGITS, nm.sigmoid(LOGITS), pos_weight=v),
        ),
    ],
    "nn.blockwise_cross_entropy_loss": [("where", "mask", (Pos,), lambda v: _bw(H, TOKENS, where=v))],
    "nn.next_token_loss": [("loss_mask", "mask", (Pos,), lambda v: nn.next_token_loss(LOGITS, TOKENS, loss_mask=v))],
    "nn.next_token_targets": [("loss_mask", "mask", (Pos,), lambda v: nn.next_token_targets(TOKENS, loss_mask=v))],
    "nn.blockwise_next_token_loss": [
        (
            "loss_mask",
            "mask",
            (Pos,),
            lambda v: nn.blockwise_next_token_loss(H, WV, TOKENS, block_size=5, loss_mask=v),
        )
    ],
    "nm.bincount": [("weights", "weights", (B,), _bincount_checked)],
    "nm.load_state_dict": [("flatten", "square weight orientation", (), lambda v: _load_square(v, nm.load_state_dict))],
    "nm.load_state_dict_file": [
        ("flatten", "square weight orientation", (), lambda v: _load_square(v, nm.load_state_dict_file))
    ],
}


def _where_members() -> None:
    """Every public function with numpy's where=: a reduction (it has an axis) takes a mask; an
    elementwise op takes none."""
    for name, fn in public_surface().items():
        if name in ARGUMENTS or not takes(fn, "where"):
            continue
        if takes(fn, "axis"):
            needs_axis = inspect.signature(fn).parameters["axis"].default is inspect.Parameter.empty
            ARGUMENTS[name] = [
                ("where", "mask", (A, B), lambda v, fn=fn, ax=needs_axis: fn(X, "b", where=v) if ax else fn(X, where=v))
            ]
        else:
            ARGUMENTS[name] = [("where", "no mask", (A, B), lambda v, fn=fn: fn(X, X, where=v))]


_where_members()
KINDED = ("mask", "where", "loss_mask", "bias", "weights", "pos_weight")


def kinded_arguments(name: str, fn) -> set[str]:
    """The arguments of ``fn`` that ARG_KINDS covers: masks, biases, weights, a query/key pair and a
    loader's ``flatten``. A class is asked about its call (its constructor's ``bias`` or ``weight``
    is a parameter array, not an argument of a kind)."""
    fn = fn.__call__ if inspect.isclass(fn) else fn
    found = {k for k in KINDED if takes(fn, k)}
    if takes(fn, "QPos") and takes(fn, "KPos"):
        found.add("QPos, KPos")
    if name.startswith("nm.load") and takes(fn, "flatten"):
        found.add("flatten")
    return found


def _kind_probe(name: str) -> list[str]:
    broken = []
    for arg, kind_name, axes, use in ARGUMENTS[name]:
        k = ARG_KINDS[kind_name]
        try:
            if kind_name != "no mask":
                runs(lambda: use(k.right(axes)))
            for what, wrong in k.wrong.items():
                try:
                    refused(lambda: use(wrong(axes)), k.exc, k.names)
                except AssertionError as e:
                    raise AssertionError(f"{what}: {e}") from None
        except AssertionError as e:
            broken.append(f"{name}({arg}=, {kind_name}): {str(e).strip().splitlines()[0][:300]}")
    return broken


# ---- the docs' table ---------------------------------------------------------------------------------------

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "named_arrays.md"
_BLOCK = re.compile(r"(<!-- contract:table -->\n).*?(<!-- /contract:table -->)", re.S)


def render() -> str:
    """The docs' table of KINDS (one row per kind, a cell per column, "—" where a kind takes no such
    input) and the list of each kind's members."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    head = "| kind | " + " | ".join(COLUMNS.values()) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for k in KINDS:
        lines.append(
            f"| **{k.title}** | " + " | ".join(cell(k.rules[c].text) if c in k.rules else "—" for c in COLUMNS) + " |"
        )
    lines += ["", "The members of each kind:", ""]
    lines += [f"- **{k.title}**: " + ", ".join(f"`{m}`" for m in k.members) for k in KINDS]
    return "\n".join(lines) + "\n"


_KINDS_BLOCK = re.compile(r"(<!-- contract:kinds -->\n).*?(<!-- /contract:kinds -->)", re.S)


def render_kinds() -> str:
    """The docs' table of ARG_KINDS: what each kind accepts, what is refused (and what the refusal
    names), and the members' arguments of that kind."""
    lines = ["| argument kind | accepts | refused | the refusal | arguments |", "|---|---|---|---|---|"]
    for kind_name, k in ARG_KINDS.items():
        args = sorted(
            f"`{n}({a}=)`" if "," not in a else f"`{n}({a})`"
            for n, rows in ARGUMENTS.items()
            for a, kn, _, _ in rows
            if kn == kind_name
        )
        named = k.names if "`" in k.names else f"`{k.names}`"
        refusal = f"`{k.exc.__name__}` naming {named}" if k.wrong else "—"
        lines.append(f"| **{kind_name}** | {k.accepts} | {'; '.join(k.wrong) or '—'} | {refusal} | {', '.join(args)} |")
    return "\n".join(lines) + "\n"


def write_docs() -> None:
    text = DOCS.read_text()
    assert _BLOCK.search(text), f"{DOCS.name} has no <!-- contract:table --> block"
    assert _KINDS_BLOCK.search(text), f"{DOCS.name} has no <!-- contract:kinds --> block"
    text = _BLOCK.sub(lambda m: m.group(1) + render() + m.group(2), text)
    DOCS.write_text(_KINDS_BLOCK.sub(lambda m: m.group(1) + render_kinds() + m.group(2), text))


# ---- the tests -------------------------------------------------------------------------------------------

SURFACE = public_surface()
CELLS = [(k.title, c) for k in KINDS for c in k.rules]


@pytest.mark.parametrize("title, column", CELLS, ids=[f"{t}-{c}" for t, c in CELLS])
def test_the_contract(title, column):
    """Every member of the kind follows the kind's rule for the column."""
    k = next(k for k in KINDS if k.title == title)
    broken = []
    for name in k.members:
        try:
            k.rules[column].probe(name, SURFACE[name])
        except AssertionError as e:
            broken.append(f"{name}: {str(e).strip().splitlines()[0][:400]}")
        except Exception as e:  # noqa: BLE001 - an error the probe did not expect (a NamedError in a result check)
            broken.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:400]}")
    assert not broken, f"{title}, {COLUMNS[column]} ({k.rules[column].text}):\n" + "\n".join(broken)


def test_every_public_name_has_a_row():
    listed = [n for k in KINDS for n in k.members]
    twice = sorted({n for n in listed if listed.count(n) > 1})
    assert not twice, f"names in two kinds: {twice}"
    missing = sorted(set(SURFACE) - set(listed))
    assert not missing, f"public names without a row in the contract (tests/test_contract.py KINDS): {missing}"
    stale = sorted(set(listed) - set(SURFACE))
    assert not stale, f"names in the contract that are not public (any more): {stale}"


def test_the_docs_table_is_the_contract():
    """docs/named_arrays.md shows KINDS as they are here: ``python tests/test_contract.py`` rewrites it."""
    found = _BLOCK.search(DOCS.read_text())
    assert found, f"{DOCS.name} has no <!-- contract:table --> block"
    shown = found.group(0)[len(found.group(1)) : -len(found.group(2))]
    assert shown == render(), "the contract's table in docs/named_arrays.md is stale: run python tests/test_contract.py"


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_argument_kinds(name):
    """Each argument of a kind takes the kind's input and refuses every other with the kind's error,
    whose message names the right argument."""
    broken = _kind_probe(name)
    assert not broken, "\n".join(broken)


def test_every_kinded_argument_is_declared():
    """A public function that takes a mask, a bias, weights, a query/key pair or a loader's flatten=
    has each such argument in ARGUMENTS (and ARGUMENTS lists nothing that is not public)."""
    undeclared = []
    for name, fn in SURFACE.items():
        declared = {a for a, *_ in ARGUMENTS.get(name, [])}
        missing = kinded_arguments(name, fn) - declared
        if missing:
            undeclared.append(f"{name}: {sorted(missing)}")
    assert not undeclared, f"arguments without a kind (tests/test_contract.py ARGUMENTS): {undeclared}"
    assert set(ARGUMENTS) <= set(SURFACE), sorted(set(ARGUMENTS) - set(SURFACE))


def test_the_docs_kinds_table_is_arg_kinds():
    found = _KINDS_BLOCK.search(DOCS.read_text())
    assert found, f"{DOCS.name} has no <!-- contract:kinds --> block"
    shown = found.group(0)[len(found.group(1)) : -len(found.group(2))]
    assert shown == render_kinds(), (
        "the argument kinds in docs/named_arrays.md are stale: run python tests/test_contract.py"
    )


def test_every_rule_is_checked():
    """A rule (a cell of the table) is a probe that can fail: a member that raises a raw error, returns a
    clamped value or refuses with another class is caught, and every kind checks each column it states."""
    with pytest.raises(AssertionError, match="a raw ValueError"):
        refused(lambda: np.zeros(2)[np.asarray([0])].reshape(3))
    with pytest.raises(AssertionError, match="no error"):
        refused(lambda: jnp.zeros(3)[7], nm.AxisError)  # jax clamps the index
    with pytest.raises(AssertionError, match="not AxisError"):
        refused(lambda: (_ for _ in ()).throw(nm.ArgumentError("x")), nm.AxisError)
    with pytest.raises(AssertionError, match="does not name"):
        refused(lambda: (_ for _ in ()).throw(nm.AxisError("axis 'b'")), nm.AxisError, "'c'")
    with pytest.raises(AssertionError, match="slice c=0"):  # an op that mixes the slices of an extra axis
        per_slice(lambda v: v - v.mean(), with_extra(X))
    for k in KINDS:
        for column, rule in k.rules.items():
            assert rule.text and callable(rule.probe), (k.title, column)


if __name__ == "__main__":
    write_docs()
