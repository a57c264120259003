"""Gradients under jit of every public differentiable layer and op, against finite differences.

Each case is a function of float arrays (a layer's parameters and its input). ``fd_check`` takes
its VJP under ``jax.jit`` (``nm.named_jit`` where a case needs a mesh) and compares it, with
``jax.test_util.check_vjp``, to central differences of the jitted function along a random
direction. The cases run in float64 (x64 is on for this module only), so that the differences
are exact to many digits; norms, attention scores and losses compute in float64 for float64
inputs and are checked at float64's tolerance. Where a layer computes in float32 on purpose
(routing, rotary angles, a mixed-precision policy) the case says so and is checked at float32's
tolerance. Inputs sit away from kinks and ties (``grid``), where a derivative exists.
A quantized Linear's rounding has no derivative: its cases check what its gradient is
documented to be (straight-through for fp8, the float gradient for int8).

``test_every_public_name_has_a_gradient_case`` walks the public surface of ``named`` (with
``explicit``, ``random`` and ``debug``) and ``named.nn`` (with ``lora``, ``mup``, ``loss`` and
``precision``), as tests/_surface.py lists it:
a new public function or class needs a case here, or an entry in ``EXCLUDED`` that says why it
has no gradient to check.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _surface import public_surface
from jax.test_util import check_vjp

import named as nm
from named import Axis, nn

A, B, C = Axis("a", 3), Axis("b", 4), Axis("c", 2)
Batch, Pos, KPos, HeadSize = Axis("batch", 2), Axis("position", 4), Axis("key_position", 4), Axis("head_size", 4)
Heads, KVHeads = Axis("heads", 4), Axis("kv_heads", 2)
Embed, Mlp, Vocab, Layers = Axis("embed", 4), Axis("mlp", 6), Axis("vocab", 8), Axis("layers", 2)
Experts = Axis("experts", 4)
F64 = {"tol": 1e-6, "eps": 1e-5}
F32 = {"tol": 2e-3, "eps": 1e-3}  # a float32 computation inside: its rounding over eps sets the error


@pytest.fixture(autouse=True, scope="module")
def x64():
    with jax.enable_x64(True):
        yield


# ---- inputs ------------------------------------------------------------------------------------------


def grid(axes, seed: int = 0, offset: float = 0.1, scale: float = 1.0) -> nm.NamedArray:
    """Distinct values ``scale * (0.25 k + offset)``. With offset 0.1 every value is at least 0.1
    from 0, the integers and the half-integers (the kinks of abs, relu, relu6, hard_tanh, floor,
    round, ...), and entries never tie (max, sort, top_k); a grid of offset 0.2 stays 0.1 from it."""
    axes = tuple(axes)
    n = math.prod(a.size for a in axes)
    k = np.random.default_rng(seed).permutation(n) - n // 2
    return nm.named(jnp.asarray((0.25 * k + offset) * scale, jnp.float64).reshape([a.size for a in axes]), axes)


def positive(axes, seed: int = 0, offset: float = 0.1) -> nm.NamedArray:
    """Distinct values from 0.45 up."""
    return nm.abs(grid(axes, seed, offset)) + 0.4


def unit(axes, seed: int = 0, offset: float = 0.1) -> nm.NamedArray:
    """Distinct values in (-0.9, 0.9)."""
    g = grid(axes, seed, offset)
    return g * (0.9 / (float(nm.abs(g).max().array) + 0.05))


def above_one(axes, seed: int = 0, offset: float = 0.1) -> nm.NamedArray:
    return positive(axes, seed, offset) + 1.0


def randn(axes, seed: int, scale: float = 1.0) -> nm.NamedArray:
    axes = tuple(axes)
    return nm.named(jnp.asarray(np.random.default_rng(seed).standard_normal([a.size for a in axes]) * scale), axes)


def ids(axes, high: int, seed: int = 0) -> nm.NamedArray:
    axes = tuple(axes)
    return nm.named(jnp.asarray(np.random.default_rng(seed).integers(0, high, [a.size for a in axes]), jnp.int32), axes)


def key(i: int = 0):
    return jax.random.key(i)


def split(tree):
    """``(params, rebuild)``: the float arrays of ``tree`` (a layer, or any pytree) and the function
    that puts new values in their place; integer and static leaves stay as they are."""
    params, static = eqx.partition(tree, eqx.is_inexact_array)
    return params, lambda p: eqx.combine(p, static)


def f64(module):
    """``module`` with its float arrays in float64."""
    return jax.tree.map(lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, module)


# ---- the check -----------------------------------------------------------------------------------------


def fd_check(f: Callable, params, *, tol: float = F64["tol"], eps: float = F64["eps"], jit: Callable = jax.jit) -> None:
    """The VJP of ``f`` at ``params``, computed by ``jit(vjp)``, against finite differences of ``jit(f)``."""
    forward = jit(f)
    pullback = jit(lambda p, ct: jax.vjp(f, p)[1](ct))
    check_vjp(forward, lambda p: (forward(p), lambda ct: pullback(p, ct)), (params,), atol=tol, rtol=tol, eps=eps)


def same_vjp(f: Callable, reference: Callable, params, cotangent, *, tol: float = 1e-12) -> None:
    """``jit(vjp(f))`` equals ``jit(vjp(reference))`` for ``cotangent``: for layers whose gradient is
    defined to be another function's (a quantized Linear's is the float Linear's)."""

    def vjp(fn):
        return jax.jit(lambda p, ct: jax.vjp(fn, p)[1](ct)[0])(params, cotangent)

    got, want = vjp(f), vjp(reference)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


# ---- the cases -----------------------------------------------------------------------------------------

CASES: dict[str, tuple[tuple[str, ...], Callable[[], None]]] = {}


def case(*covers: str, name: str | None = None):
    """Register a gradient case; ``covers``: the public names (``nm.exp``, ``nn.Linear``) it differentiates."""

    def register(fn):
        CASES[name or fn.__name__] = (covers, fn)
        return fn

    return register


# elementwise, one input: name -> the inputs' domain
REAL, POS, UNIT, ABOVE_ONE = grid, positive, unit, above_one
UNARY = {
    "nm.abs": REAL,
    "nm.negative": REAL,
    "nm.sign": REAL,
    "nm.exp": REAL,
    "nm.exp2": REAL,
    "nm.expm1": REAL,
    "nm.log": POS,
    "nm.log2": POS,
    "nm.log10": POS,
    "nm.log1p": POS,
    "nm.sqrt": POS,
    "nm.rsqrt": POS,
    "nm.cbrt": REAL,
    "nm.square": REAL,
    "nm.reciprocal": POS,
    "nm.sin": REAL,
    "nm.cos": REAL,
    "nm.tan": UNIT,
    "nm.arcsin": UNIT,
    "nm.arccos": UNIT,
    "nm.arctan": REAL,
    "nm.sinh": REAL,
    "nm.cosh": REAL,
    "nm.tanh": REAL,
    "nm.arcsinh": REAL,
    "nm.arccosh": ABOVE_ONE,
    "nm.arctanh": UNIT,
    "nm.floor": REAL,
    "nm.ceil": REAL,
    "nm.round": REAL,
    "nm.trunc": REAL,
    "nm.erf": REAL,
    "nm.erfc": REAL,
    "nm.sigmoid": REAL,
    "nm.log_sigmoid": REAL,
    "nm.softplus": REAL,
    "nm.relu": REAL,
    "nm.relu6": REAL,
    "nm.silu": REAL,
    "nm.elu": REAL,
    "nm.leaky_relu": REAL,
    "nm.gelu": REAL,
    "nm.deg2rad": REAL,
    "nm.rad2deg": REAL,
    "nm.sinc": REAL,
    "nm.nan_to_num": REAL,
    "nm.absolute": REAL,
    "nm.fabs": REAL,
    "nm.positive": REAL,
    "nm.rint": REAL,
    "nm.degrees": REAL,
    "nm.radians": REAL,
    "nm.i0": REAL,
    "nn.celu": REAL,
    "nn.selu": REAL,
    "nn.hard_sigmoid": REAL,
    "nn.hard_silu": REAL,
    "nn.hard_tanh": REAL,
    "nn.soft_sign": REAL,
    "nn.mish": REAL,
    "nn.relu_squared": REAL,
    "nn.quick_gelu": REAL,
}
COMPLEX_UNARY = ("nm.conj", "nm.conjugate", "nm.real", "nm.imag", "nm.angle")
# elementwise, two inputs: name -> (x's domain, y's domain); "mod" keeps x / y away from the integers
BINARY = {
    "nm.add": (REAL, REAL),
    "nm.subtract": (REAL, REAL),
    "nm.multiply": (REAL, REAL),
    "nm.divide": (REAL, POS),
    "nm.power": (POS, REAL),
    "nm.maximum": (REAL, REAL),
    "nm.minimum": (REAL, REAL),
    "nm.arctan2": (REAL, REAL),
    "nm.hypot": (REAL, REAL),
    "nm.logaddexp": (REAL, REAL),
    "nm.fmax": (REAL, REAL),
    "nm.fmin": (REAL, REAL),
    "nm.copysign": (REAL, REAL),
    "nm.heaviside": (REAL, REAL),
    "nm.logaddexp2": (REAL, REAL),
    "nm.float_power": (POS, REAL),
    "nm.mod": "mod",
    "nm.floor_divide": "mod",
    "nm.fmod": "mod",
}
# reductions over names: name -> (takes where=, skips NaN: its input then holds one)
REDUCTIONS = {
    "nm.sum": (True, False),
    "nm.mean": (True, False),
    "nm.prod": (True, False),
    "nm.max": (True, False),
    "nm.min": (True, False),
    "nm.std": (True, False),
    "nm.var": (True, False),
    "nm.logsumexp": (True, False),
    "nm.nansum": (True, True),
    "nm.nanmean": (True, True),
    "nm.nanprod": (True, True),
    "nm.nanstd": (True, True),
    "nm.nanvar": (True, True),
    "nm.nanmax": (True, True),
    "nm.nanmin": (True, True),
    "nm.median": (False, False),
    "nm.nanmedian": (False, True),
    "nm.ptp": (False, False),
    "nm.amax": (True, False),
    "nm.amin": (True, False),
}
# along one name, the shape kept
ALONG = {
    "nm.softmax": lambda x: nm.softmax(x, "b", where=mask()),
    "nm.log_softmax": lambda x: nm.log_softmax(x, "b", where=mask()),
    "nm.standardize": lambda x: nm.standardize(x, "b", where=mask()),
    "nm.cumsum": lambda x: nm.cumsum(x, "b"),
    "nm.cumprod": lambda x: nm.cumprod(x, "b", reverse=True),
    "nm.nancumsum": lambda x: nm.nancumsum(x, "b"),
    "nm.nancumprod": lambda x: nm.nancumprod(x, "b"),
    "nm.sort": lambda x: nm.sort(x, "b", descending=True),
    "nm.fftshift": lambda x: nm.fftshift(x, "b"),
    "nm.ifftshift": lambda x: nm.ifftshift(x, ("a", "b")),
}


def mask():
    return nm.named(np.arange(12).reshape(3, 4) % 3 != 1, (A, B))


def _fn(name: str):
    module, attr = name.split(".")
    return getattr({"nm": nm, "nn": nn}[module], attr)


def _unary(name, domain):
    def check():
        fd_check(lambda x: _fn(name)(x), domain((A, B)))

    return check


def _binary(name, domains):
    def check():
        op = _fn(name)
        if domains == "mod":  # x = y (k + f), f between 0.3 and 0.45: x / y stays 0.3 from the integers
            y = positive((A, B), 1) * nm.sign(grid((A, B), 2))
            x = y * (nm.floor(grid((A, B), 3)) + 0.3 + 0.1 * nm.abs(grid((A, B), 4)))
        else:  # y over (c, b): the result has both operands' axes; y's grid never ties with x's
            x, y = domains[0]((A, B), 1), domains[1]((C, B), 2, offset=0.2)
        fd_check(lambda p: op(*p), (x, y))

    return check


def _complex(name):
    def check():
        z = grid((A, B), 1) + 1j * grid((A, B), 2, offset=0.2)
        fd_check(lambda v: _fn(name)(v), z)

    return check


def _reduction(name, takes_where, skips_nan):
    def check():
        op = _fn(name)
        x = grid((A, B), 1)
        if skips_nan:
            # where mask() keeps it, so that where= and NaN-skipping both act; every row keeps two other entries
            # under mask() (the std of a single entry has an infinite derivative)
            x = nm.where(nm.named(np.arange(12).reshape(3, 4) == 0, (A, B)), jnp.nan, x)

        def f(v):
            out = {"a": op(v, "a"), "all": op(v)}
            return {**out, "where": op(v, "b", where=mask())} if takes_where else out

        fd_check(f, x)

    return check


for _name, _domain in UNARY.items():
    case(_name, name=_name)(_unary(_name, _domain))
for _name in COMPLEX_UNARY:
    case(_name, name=_name)(_complex(_name))
for _name, _domains in BINARY.items():
    case(_name, name=_name)(_binary(_name, _domains))
for _name, (_where, _nan) in REDUCTIONS.items():
    case(_name, name=_name)(_reduction(_name, _where, _nan))
for _name, _op in ALONG.items():
    case(_name, name=_name)(lambda op=_op: fd_check(op, grid((A, B), 1)))


@case("nm.where", "nm.clip")
def where_and_clip():
    cond = nm.named(np.arange(8).reshape(2, 4) % 3 == 0, (C, B))
    lo, hi = grid((B,), 3, offset=0.2) - 1.0, grid((C,), 4, offset=0.2) + 1.0
    fd_check(
        lambda p: {
            "where": nm.where(cond, p[0], p[1]),
            "clip": nm.clip(p[0], p[2], p[3]),
            "below": nm.clip(p[0], upper=0.3),
        },
        (grid((A, B), 1), grid((B,), 2, offset=0.2), lo, hi),
    )


@case("nm.fft", "nm.ifft", "nm.rfft", "nm.irfft", "nm.hfft", "nm.ihfft")
def fourier():
    z = grid((A, B), 1) + 1j * grid((A, B), 2, offset=0.2)
    fd_check(
        lambda v: {
            "fft": nm.fft(v, "b"),
            "fft2": nm.fft(v, ("a", "b")),
            "irfft": nm.irfft(v, "b"),
            "ifft": nm.ifft(v, "b", norm="ortho"),
            "hfft": nm.hfft(v, "a", n=4),
        },
        z,
    )
    fd_check(
        lambda v: {"rfft": nm.rfft(v, "b"), "rfft2": nm.rfft(v, ("a", "b")), "ihfft": nm.ihfft(v, "a")}, grid((A, B), 3)
    )


@case(
    "nm.top_k",
    "nm.unique",
    "nm.unique_values",
    "nm.unique_counts",
    "nm.unique_inverse",
    "nm.unique_all",
    "nm.ravel",
    "nm.repeat",
    "nm.tile",
    "nm.trace",
    "nm.polyval",
    "nm.bincount",
)
def numpy_shapes():
    x, w = grid((A, B), 1), grid((A, B), 2)
    counted = ids((A, B), 5)
    Found = Axis("found", 12)

    def f(p):
        x, w, coeffs = p
        # the distinct values carry the gradient of the entries they are; counts, indices, inverse are integers
        shortcuts = {
            n: getattr(nm, n)(x, Found) for n in ("unique_values", "unique_counts", "unique_inverse", "unique_all")
        }
        return {
            **{n: v if isinstance(v, nm.NamedArray) else v[0] for n, v in shortcuts.items()},
            "top_k": nm.top_k(x, "b", 2)[0],
            "unique": nm.unique(x, Found),
            "ravel": nm.ravel(x, "flat"),
            "repeat": nm.repeat(x, 2, "a"),
            "tile": nm.tile(x, {"b": 2}),
            "trace": nm.trace(x, "a", "b", offset=1),
            "bincount": nm.bincount(counted, Axis("bin", 5), weights=w),
            "polyval": nm.polyval(coeffs, x, "c") + nm.polyval([0.5, -1.0, 2.0], x),
        }

    fd_check(f, (x, w, grid((C,), 3)))


@case(
    "nm.rename",
    "nm.rearrange",
    "nm.flatten_axes",
    "nm.unflatten_axis",
    "nm.split",
    "nm.unbind",
    "nm.stack",
    "nm.concatenate",
    "nm.broadcast_axis",
    "nm.broadcast_to",
    "nm.pad",
    "nm.roll",
    "nm.tril",
    "nm.triu",
    "nm.named",
    "nm.full",
    "nm.full_like",
)
def shapes():
    def f(p):
        x, y = p  # (a, b) and (c, b)
        return {
            "rename": nm.rename(x, {"a": "z"}),
            "rearrange": nm.rearrange(x, ("b", "a")),
            "unflatten": nm.unflatten_axis(nm.flatten_axes(x, ("a", "b"), "ab"), "ab", (A, B)),
            "split": nm.split(x, "b", (Axis("b", 1), Axis("b", 3)))[1] * 2.0,
            "unbind": nm.unbind(x, "a")[2],
            "stack": nm.stack("s", [x, x * x]),
            "concatenate": nm.concatenate("a", [x, y.rename({"c": "a"})]),
            "broadcast": nm.broadcast_axis(y, A) + nm.broadcast_to(nm.unbind(y, "c")[0], (A, B)),
            "pad": nm.pad(x, {"b": (1, 2)}, constant_values=0.5),
            "reflect": nm.pad(x, {"a": (1, 1)}, mode="reflect"),
            "roll": nm.roll(x, 2, "b"),
            "tril": nm.tril(x, "a", "b", k=1),
            "triu": nm.triu(x, "a", "b"),
            "named": nm.named(x.array * 2.0, ("a", "b")),
            # the fill value is a raw 0-d array: nm.full does not take a 0-d NamedArray
            "full": nm.full((A, C), y["b", 1, "c", 0].array) + nm.full_like(x, x["a", 0, "b", 2].array),
        }

    fd_check(f, (grid((A, B), 1), grid((C, B), 2)))


@case("nm.NamedArray", "nm.take", "nm.ds", "nm.updated_slice")
def indexing():
    where, start = ids((C,), 3), jnp.asarray(1)  # a traced start: the jitted functions close over it

    def f(p):
        x, u = p  # (a, b) and (a, b=2)
        return {
            "int": x["a", 1],
            "slice": x["b", 1:3],
            "ids": x["a", where],
            "take": nm.take(x, "a", where),
            "ds": x["b", nm.ds(start, 2)],
            "rows": x["b", nm.ds(nm.named(jnp.asarray([0, 2, 1]), (A,)), 2)],
            "set": x.at["b", 1:3].set(u),
            "add": x.at["a", 0].add(x["a", 2] * 3.0),
            "updated_slice": nm.updated_slice(x, {"b": start}, u),
            "operators": (x * 2.0 - x / 3.0) ** 2 + abs(-x) + x % 7.0,
        }

    fd_check(f, (grid((A, B), 1), grid((A, B.resize(2)), 2)))


@case("nm.dot", "nm.einsum")
def contractions():
    def f(p):
        x, w, v = p  # (a, b), (b, c), (c,)
        return {
            "dot": nm.dot(x, w, axis="b"),
            "dot3": nm.dot(x, w, v, axis=("b", "c")),
            "outer": nm.dot(x, v, axis=None),
            "einsum": nm.einsum("a b, b c -> c a", x, w),
            "trace": nm.einsum("a b, b c, c ->", x, w, v),
        }

    fd_check(f, (grid((A, B), 1), grid((B, C), 2), grid((C,), 3)))


@case("nm.vmap", "nm.scan", "nm.fold", "nm.nmap")
def transforms():
    def f(p):
        x, w = p  # (a, b), (b, c)

        def step(carry, row):
            h = nm.tanh(nm.dot(row + carry, w, axis="b"))
            return carry * 0.5 + nm.dot(h, w, axis="c"), h

        carry, ys = nm.scan(step, "a")(nm.zeros((B,)), x)
        return {
            "vmap": nm.vmap(lambda row: nm.dot(nm.sin(row), w, axis="b"), "a")(x),
            "scan": carry,
            "ys": ys,
            "fold": nm.fold(lambda c, row: c * row + 1.0, "a", reverse=True)(nm.ones((B,)), x),
            "nmap": nm.nmap(lambda v: jnp.cumsum(v**2), consume="b")(x),
        }

    fd_check(f, (grid((A, B), 1, scale=0.5), grid((B, C), 2, scale=0.5)))


def _mesh_case(f, params, mapping, mesh_shape=None, **tol):
    mesh = nm.make_mesh(mesh_shape or {"data": 8})
    fd_check(f, params, jit=lambda fn: nm.named_jit(fn, mapping=mapping, mesh=mesh), **tol)


@case("nm.named_jit", "nm.shard")
def sharded():
    """Under named_jit, the constraints shard puts on activations are differentiated too."""
    Rows, Wide = Axis("batch", 8), Axis("embed", 8)

    def f(p):
        x, w = p
        h = nm.shard(nm.tanh(nm.dot(x, w, axis="embed")))
        return nm.shard(nm.dot(h, w, axis="mlp"), {"embed": "data"})

    _mesh_case(f, (grid((Rows, Wide), 1, scale=0.1), grid((Wide, Mlp), 2, scale=0.1)), {"batch": "data", "mlp": None})


@case(
    "nm.shard_map",
    "nm.all_gather",
    "nm.psum_scatter",
    "nm.psum",
    "nm.pmean",
    "nm.pmax",
    "nm.all_to_all",
    "nm.einsum_unreduced",
    "nm.with_layout",
    "nm.Unreduced",
)
def explicit_collectives():
    Rows, Wide = Axis("batch", 8), Axis("embed", 8)

    def body(x, w):  # x: batch/data embed, w: embed/data mlp
        wg = nm.all_gather(w, "embed")
        h = nm.tanh(nm.einsum("batch embed, embed mlp -> batch mlp", x, wg))
        u = nm.einsum_unreduced("batch mlp, embed mlp -> batch embed", h, wg)  # batch is split: owed nothing
        owed = nm.einsum_unreduced("batch mlp, mlp -> mlp", h, nm.named(jnp.ones(8), ("mlp",)))
        flat = nm.with_layout(h.flatten_axes(("mlp",), "m"), "batch/data m")
        return {
            "h": h + nm.pmean(h, "batch") * 0.5 + nm.pmax(h, "batch") * 0.25,
            "u": u,
            "sum": nm.psum(owed),
            "total": nm.psum(h, "batch"),
            "flat": flat,
            "scattered": nm.psum_scatter(h.sum("batch"), "mlp", mesh_axes="data"),  # partial sums in
            "a2a": nm.all_to_all(x, split="embed", concat="batch"),
        }

    def f(p):
        return nm.shard_map(body, in_mapping=({"batch": "data"}, {"embed": "data"}))(*p)

    _mesh_case(f, (grid((Rows, Wide), 1, scale=0.1), grid((Wide, Mlp.resize(8)), 2, scale=0.1)), {"batch": "data"})


@case("nm.tree_map_layers")
def tree_map_layers():
    stack = f64(nn.Stacked.init(Layers, nn.Linear.init, Embed, Mlp, key=key(1)))
    params, rebuild = split(stack)
    x = grid((Batch, Embed), 2)

    def f(p):
        def rescale(lin):  # each layer's weight times its own squared norm
            return eqx.tree_at(lambda m: m.weight, lin, lin.weight * nm.sum(lin.weight**2))

        return nm.tree_map_layers(rescale, rebuild(p), is_leaf=lambda m: isinstance(m, nn.Linear)).vmap(x)

    fd_check(f, params)


@case("nm.resize_axis")
def resize_axis():
    """Shrinking keeps entries; growing with a key draws new ones at the old entries' standard deviation."""
    fd_check(
        lambda p: {"shrink": nm.resize_axis(p, "b", 2), "grow": nm.resize_axis(p, "b", 6, key=key(1))},
        {"x": grid((A, B), 1), "y": grid((B, C), 2)},
        **F32,
    )  # the new entries are drawn in float32


@case("nm.random.permutation", "nm.random.choice")
def random_gathers():
    """Draws of a NamedArray's entries carry those entries' gradients."""
    p = nm.named(jnp.asarray([0.1, 0.2, 0.3, 0.4]), (B,))
    fd_check(
        lambda x: {
            "permutation": nm.random.permutation(key(1), x, "b", independent=True),
            "choice": nm.random.choice(key(2), x, (Axis("draw", 5),), axis="b", p=p),
        },
        grid((A, B), 1),
    )


@case(
    "nm.random.normal", "nm.random.uniform", "nm.random.truncated_normal", "nm.random.pareto", "nm.random.weibull_min"
)
def reparameterised_draws():
    """Draws whose parameters enter by a transform of the key's noise: a draw is a smooth function of them."""

    def f(p):
        mean, std, lo, hi = p
        return {
            "normal": nm.random.normal(key(1), (A, B), jnp.float64, mean=mean, stddev=std),
            "uniform": nm.random.uniform(key(2), (A, B), jnp.float64, minval=lo, maxval=hi),
            "truncated": nm.random.truncated_normal(key(3), (A, B), jnp.float64, lower=lo, upper=hi),
            "pareto": nm.random.pareto(key(4), (A, B), std, dtype=jnp.float64),
            "weibull": nm.random.weibull_min(key(5), (A, B), std, hi, dtype=jnp.float64),
        }

    fd_check(f, (grid((A,), 1), positive((B,), 2), grid((A, B), 3) - 2.0, positive((A, B), 4) + 0.5))


# ---- named.nn: layers ----------------------------------------------------------------------------------


def layer_check(layer, x, call=None, **tol) -> None:
    """Gradients of ``call(layer, x)`` (default ``layer(x)``) with respect to the layer's float arrays and ``x``."""
    params, rebuild = split(f64(layer))
    call = call or (lambda m, v: m(v))
    fd_check(lambda p: call(rebuild(p[0]), p[1]), (params, x), **tol)


@case("nn.Linear")
def linear():
    layer_check(nn.Linear.init((Batch, Embed), (Mlp, C), key=key(1)), grid((Pos, Batch, Embed), 2))


@case("nn.Embedding")
def embedding():
    emb = nn.Embedding.init(Vocab, Embed, key=key(1), init_scale=1.0, check_ids=True)
    tokens = ids((Batch, Pos), Vocab.size)
    layer_check(emb, grid((Batch, Embed), 2), lambda m, h: {"lookup": m(tokens), "unembed": m.unembed(h)})


@case("nn.LayerNorm", "nn.RMSNorm")
def norms():
    ln = eqx.tree_at(lambda m: (m.weight, m.bias), nn.LayerNorm.init(Embed), (randn((Embed,), 1), randn((Embed,), 2)))
    rms = eqx.tree_at(lambda m: m.weight, nn.RMSNorm.init(Embed), randn((Embed,), 3))
    layer_check((ln, rms), randn((Batch, Embed), 4), lambda m, v: {"ln": m[0](v), "rms": m[1](v * 2.0)}, **F64)


@case("nn.MLP", "nn.activation", "nn.glu")
def mlp():
    blocks = (
        nn.MLP.init(Embed, Mlp, activation="gelu_new", gated=True, key=key(1)),
        nn.MLP.init(Embed, C, width=3, depth=2, activation="silu", key=key(2)),
    )

    def call(m, v):
        acts = {name: nn.activation(name)(v) for name in nn.ACTIVATIONS}  # every activation by name
        return {"gated": m[0](v), "deep": m[1](v), "glu": nn.glu(v, "embed"), **acts}

    layer_check(blocks, grid((Batch, Embed), 2), call)


@case("nn.Dropout")
def dropout():
    layer_check(
        nn.Dropout(0.5),
        grid((Batch, Embed), 1),
        lambda m, v: {
            "drop": m(v, key=key(3)),
            "named_key": m(v, key=nm.named(key(4), ())),
            "all": nn.Dropout(1.0)(v, key=key(5)),
        },
    )


@case("nn.Conv", "nn.ConvTranspose")
def convolutions():
    H, W, Ch, Out = Axis("height", 5), Axis("width", 6), Axis("ch", 4), Axis("out", 2)
    convs = (
        nn.Conv.init(
            ("height", "width"), Ch, Out, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2), groups=2, key=key(1)
        ),
        nn.Conv.init("width", Ch, Ch, 3, padding="SAME", key=key(2)),
        nn.ConvTranspose.init(("height", "width"), Ch, Out, 3, stride=2, padding=1, output_padding=1, key=key(3)),
    )
    layer_check(convs, randn((Batch, H, W, Ch), 4), lambda m, v: [c(v) for c in m])


@case("nn.max_pool", "nn.min_pool", "nn.mean_pool")
def pools():
    H, W = Axis("height", 5), Axis("width", 6)
    fd_check(
        lambda v: {
            "max": nn.max_pool(v, {"height": 2, "width": 3}, stride=2, padding=1, use_ceil=True),
            "min": nn.min_pool(v, {"height": 3}, padding="SAME"),
            "mean": nn.mean_pool(v, {"width": 2, "height": 2}, padding=(1, 0), count_include_pad=False),
        },
        grid((Batch, H, W), 1),
    )


# ---- named.nn: attention -------------------------------------------------------------------------------


def qkv(kv_heads: Axis | None = None, k_len: int = KPos.size):
    """Query (batch, position, heads, head_size), key and value over key_position (and kv_heads for GQA)."""
    Kv, K = kv_heads or Axis("heads", 2), KPos.resize(k_len)
    Q = Heads if kv_heads else Axis("heads", 2)
    return randn((Batch, Pos, Q, HeadSize), 1), randn((Batch, K, Kv, HeadSize), 2), randn((Batch, K, Kv, HeadSize), 3)


def attention_check(params=None, **kwargs):
    params = qkv() if params is None else params
    fd_check(lambda p: nn.dot_product_attention(*p, **kwargs), params, **F64)


ATTENTION = {  # case name -> (dot_product_attention's arguments, the inputs)
    "attention": ({}, None),
    "attention_causal": ({"causal": True, "scale": 0.3}, None),
    "attention_mask": ({"mask": "padding"}, None),
    "attention_segments": ({"segment_ids": "segments", "causal": True}, None),
    "attention_window": ({"causal": True, "window": 2}, None),
    "attention_softcap": ({"softcap": 2.0}, None),
    "attention_gqa": ({"causal": True}, "gqa"),
    "attention_offset": ({"causal": True, "q_offset": 2}, "longer"),
    "attention_traced": ({"causal": True, "window": "traced", "q_offset": "per_row"}, "longer"),
}


def _attention(name):
    def check():
        kw, inputs = ATTENTION[name]
        kw = dict(kw)
        if kw.get("mask") == "padding":
            kw["mask"] = nn.padding_mask(nm.named(jnp.asarray([3, 4]), (Batch,)), KPos)
        if kw.get("window") == "traced":  # a jax array, as a layer's entry of per-layer windows is
            kw["window"] = jnp.asarray(3)
        if kw.get("q_offset") == "per_row":  # each row continues its own cache
            kw["q_offset"] = nm.named(jnp.asarray([2, 1]), (Batch,))
        if kw.get("segment_ids") == "segments":
            kw["segment_ids"] = nm.named(jnp.asarray([[0, 0, 1, 1], [0, 1, 1, 1]]), (Batch, Pos))
        params = {"gqa": qkv(KVHeads), "longer": qkv(k_len=6), None: None}[inputs]
        attention_check(params, **kw)

    return check


for _name in ATTENTION:
    case("nn.dot_product_attention", name=_name)(_attention(_name))


@case("nn.alibi_bias", "nn.dot_product_attention")
def attention_bias():
    """ALiBi with learned slopes under GQA, and a chunked mask beside it."""

    def f(p):
        q, k, v, slopes = p
        bias = nn.alibi_bias(Heads, Pos, KPos, slopes=slopes)
        return nn.dot_product_attention(q, k, v, causal=True, bias=bias, mask=nn.chunked_mask(Pos, KPos, 2))

    fd_check(f, (*qkv(KVHeads), positive((Heads,), 4)), **F32)


@case("nn.rotary_embedding")
def rotary():
    positions = nm.named(jnp.asarray([[0, 1, 2, 3], [5, 6, 7, 8]]), (Batch, Pos))
    scale = nm.named(jnp.asarray(1.3), ())
    fd_check(
        lambda p: {
            "theta": nn.rotary_embedding(p[0], positions),
            "scaled": nn.rotary_embedding(p[0], positions, inv_freq=p[1], scale=p[2]),
        },
        (randn((Batch, Pos, Heads, HeadSize), 1), positive((Axis("freq", 2),), 2), scale),
        **F32,
    )


# ---- named.nn: mixture of experts ----------------------------------------------------------------------


def _moe(name, **kwargs):
    def check():
        moe = nn.MoE.init(Embed, Mlp, Experts, 2, key=key(1), **kwargs)
        layer_check(moe, randn((Batch, Pos, Embed), 2), **F32)

    case("nn.MoE", name=name)(check)


_moe("moe_dropless")
_moe("moe_dense", dispatch="dense", routing="topk_softmax")
_moe("moe_shared_expert", shared_mlp=Axis("shared", 3), shared_gate=True, normalize=False)


@case("nn.route", "nn.router_stats", "nn.router_losses", "nn.load_balancing_loss", "nn.router_z_loss")
def routing():
    def f(logits):
        weights, chosen, probs = nn.route(logits, 2)
        top_weights = nn.route(logits, 2, routing="topk_softmax")[0]
        stats = nn.router_stats(logits, probs, chosen)
        return {
            "weights": weights,
            "topk_softmax": top_weights,
            "probs": probs,
            "stats": stats,
            "losses": nn.router_losses(stats),
            "balance": nn.load_balancing_loss(probs, chosen),
            "z": nn.router_z_loss(logits),
        }

    fd_check(f, grid((Batch, Pos, Experts), 1), **F32)


# ---- named.nn: losses ----------------------------------------------------------------------------------


@case("nn.cross_entropy_loss", "nn.next_token_loss", "nn.next_token_targets", "nn.binary_cross_entropy_loss")
def losses():
    tokens = ids((Batch, Pos), Vocab.size, 1)
    keep = nm.named(jnp.asarray([[True, True, False, True], [True, True, True, False]]), (Batch, Pos))

    def f(p):
        logits, probs, labels = p
        return {
            "targets": nn.next_token_targets(tokens, loss_mask=keep)[0].astype(logits.dtype) * logits["vocab", 0],
            "ids": nn.cross_entropy_loss(logits, tokens, where=keep, z_loss_weight=1e-2, label_smoothing=0.1),
            "sum": nn.cross_entropy_loss(logits, tokens, reduction="none"),
            "probs": nn.cross_entropy_loss(logits, nm.softmax(probs, "vocab")),
            "next": nn.next_token_loss(logits, tokens, loss_mask=keep, reduction="sum"),
            "binary": nn.binary_cross_entropy_loss(
                logits, nm.sigmoid(labels), pos_weight=nm.exp(probs["batch", 0, "position", 0])
            ),
        }

    fd_check(f, tuple(randn((Batch, Pos, Vocab), seed) for seed in (1, 2, 3)), **F64)  # float64 all through


@case("nn.blockwise_cross_entropy_loss", "nn.blockwise_next_token_loss")
def blockwise_losses():
    tokens = ids((Batch, Pos), Vocab.size, 1)

    def f(p):
        hidden, w = p
        return {
            "ce": nn.blockwise_cross_entropy_loss(hidden, w, tokens, block_size=2, z_loss_weight=1e-2, softcap=3.0),
            "next": nn.blockwise_next_token_loss(hidden, w, tokens, block_size=4, reduction="none"),
        }

    fd_check(f, (randn((Batch, Pos, Embed), 2), randn((Vocab, Embed), 3)), **F32)


# ---- named.nn: quantized Linears, LoRA, mixed precision -----------------------------------------------


def powers_of_two(axes, seed: int) -> nm.NamedArray:
    """``±2^-k`` (k in 0..4), the first entry 1: values fp8 holds exactly once scaled by their amax
    (e4m3 and e5m2 both hold ``1.75 · 2^e``, which is what ``2^-k · fp8 max`` is)."""
    rng = np.random.default_rng(seed)
    shape = [a.size for a in axes]
    v = rng.choice([-1.0, 1.0], shape) * 2.0 ** -rng.integers(0, 5, shape)
    v.flat[0] = 1.0
    return nm.named(jnp.asarray(v), tuple(axes))


@case("nn.Fp8Linear", "nn.Fp8State", "nn.quantize")
def fp8_straight_through():
    """fp8's backward is straight-through: on values fp8 holds exactly, rounding changes nothing
    and its gradients are the float Linear's; the state's gradient carries the new amax history."""
    lin = eqx.tree_at(
        lambda m: (m.weight, m.bias),
        nn.Linear.init(Embed, Mlp, key=key(0)),
        (powers_of_two((Embed, Mlp), 1), powers_of_two((Mlp,), 2)),
    )
    params, rebuild = split(lin)
    x, ct = powers_of_two((Batch, Embed), 3), powers_of_two((Batch, Mlp), 4)
    # to 1e-6: the scales are float32 (amax / fp8 max), as the state is
    same_vjp(
        lambda p: nn.quantize(rebuild(p[0]), "fp8")(p[1]), lambda p: rebuild(p[0])(p[1]), (params, x), ct, tol=1e-6
    )
    fp8 = nn.quantize(lin, nn.QuantConfig("fp8", history=3))
    state = jax.jit(jax.grad(lambda m: (m(x) * ct).sum().scalar()))(fp8).fp8
    for got, amax in ((state.x, 1.0), (state.w, 1.0), (state.g, 1.0)):
        np.testing.assert_array_equal(got.array, np.asarray([amax, 0.0, 0.0]) * 2.0**-16)
    assert float(state.probe.array) == 2.0**-16
    fd_check(lambda p: rebuild(p[0])(p[1]), (params, x))


@case("nn.Int8Linear", "nn.Int8WeightLinear")
def int8():
    """int8's backward is the float gradient (the rounding is not differentiated); int8_weight
    differentiates in its float scale, bias and input (its int8 weight takes no gradient)."""
    params, rebuild = split(f64(nn.Linear.init((Embed, C), Mlp, key=key(1))))
    x = randn((Batch, C, Embed), 2)
    same_vjp(
        lambda p: nn.quantize(rebuild(p[0]), "int8")(p[1]),
        lambda p: rebuild(p[0])(p[1]),
        (params, x),
        randn((Batch, Mlp), 3),
        tol=1e-10,
    )
    layer_check(nn.quantize(rebuild(params), "int8_weight"), x)


@case("nn.LoraLinear", "nn.lora.apply", "nn.lora.merge", "nn.lora.with_dropout_keys")
def lora():
    Rank = Axis("lora_rank", 2)
    model = nn.lora.apply(
        nn.MLP.init(Embed, Mlp, key=key(1), dtype=jnp.float64),
        ("up", "down"),
        rank=Rank.size,
        key=key(2),
        alpha=4.0,
        dropout=0.25,
    )
    # B starts at zero, which would zero A's gradient
    model = eqx.tree_at(lambda m: (m.up.lora_b, m.down.lora_b), model, (randn((Rank, Mlp), 3), randn((Rank, Embed), 4)))
    layer_check(
        model,
        randn((Batch, Embed), 5),
        lambda m, v: {"dropout": nn.lora.with_dropout_keys(m, key(6))(v), "merged": nn.lora.merge(m)(v)},
    )


@case("nn.cast_for_compute", "nn.cast_output", "nn.cast_to_param")
def mixed_precision():
    policy = "params=float64,compute=float32,output=float64"
    block = (nn.MLP.init(Embed, Mlp, key=key(1), dtype=jnp.float64), nn.LayerNorm.init(Embed))

    def call(m, v):
        half = nn.cast_for_compute(m, policy)
        y = nn.cast_output(half[1](half[0](v.astype(jnp.float32))), policy)
        return {"y": y, "params": nn.cast_to_param(half[0].up.weight, policy)}

    layer_check(block, randn((Batch, Embed), 2), call, **F32)


# ---- named.nn: stacks of layers and gradient checkpointing --------------------------------------------


class Block(eqx.Module):
    """A residual MLP block with a dropout and a tagged activation, for the stacks' cases."""

    up: nn.Linear
    down: nn.Linear
    drop: nn.Dropout

    @staticmethod
    def init(E: Axis = Embed, M: Axis = Mlp, *, key):
        k1, k2 = jax.random.split(key)
        up, down = nn.Linear.init(E, M, key=k1, dtype=jnp.float64), nn.Linear.init(M, E, key=k2, dtype=jnp.float64)
        return Block(up, down, nn.Dropout(0.25))

    def __call__(self, x, key=None):
        h = nn.checkpoint_name(nm.tanh(self.up(x)), "hidden")
        return x + self.down(self.drop(h, key=key, inference=key is None))


# every policy that runs on CPU; "offload" needs host memory spaces (GPU/TPU) and is refused here
REMATS = {
    "none": "none",
    "full": "full",
    "save_dots": "save_dots",
    "save_names": "save_names:hidden",
    "every2": "full every=2",
    "save_and_dots": nn.Remat(save=("hidden",), dots="save"),
    "scan_policy": nm.ScanCheckpointPolicy(save_carries=True, save_block_internals=("hidden",)),
}


def _stack(kind, policy):
    def check():
        stack = kind.init(Layers, Block.init, key=key(1), remat=REMATS[policy])
        keys = nm.named(jax.random.split(key(2), Layers.size), (Layers,))  # a dropout key per layer

        def call(s, v):
            carry, ys = s.scan_via(lambda b, x: (b(x), x.sum("embed")))(v)
            out = {"fold": s.fold(v, keys), "scan": carry, "ys": ys}
            return {**out, "vmap": s.vmap(v)} if policy == "none" else out

        layer_check(stack, randn((Batch, Embed), 3), call)

    return check


for _kind in (nn.Stacked, nn.BlockSeq):
    for _policy in REMATS:
        _covers = (
            (f"nn.{_kind.__name__}",)
            + (("nn.Remat", "nn.checkpoint_name") if _policy == "save_and_dots" else ())
            + (("nm.ScanCheckpointPolicy",) if _policy == "scan_policy" else ())
        )
        case(*_covers, name=f"{_kind.__name__}_{_policy}")(_stack(_kind, _policy))


@case("nn.ExplicitStack", "nn.explicit_layers")
def explicit_stack():
    """The explicit driver's own backward (a custom VJP over the scan, gathers and reduce-scatters)."""
    Rows, Wide = Axis("batch", 16), Axis("embed", 8)
    stack = nn.Stacked.init(Layers, Block.init, Wide, Mlp, key=key(1))
    param, compute = {"embed": "data"}, {"batch": "data"}
    params, rebuild = split(stack)

    def f(p):
        out = {}
        for pieces in (1, 2):  # batch_split=2 orders the two pieces' collectives in a custom VJP of its own
            with nn.explicit_layers(nn.ExplicitStack(param, compute, batch_split=pieces)):
                out[pieces] = rebuild(p[0]).fold(p[1])
        return out

    _mesh_case(f, (params, randn((Rows, Wide), 2)), compute)


# ---- the rest of the numpy surface, refs, gradients of gradients ----------------------------------------


@case("nm.linspace", "nm.logspace", "nm.geomspace")
def spaced():
    """Evenly (log-, geometrically) spaced values are smooth functions of their end points."""
    fd_check(
        lambda p: {
            "lin": nm.linspace(B, start=p[0], stop=p[1]),
            "log": nm.logspace(B, start=p[0], stop=p[1]),
            "geom": nm.geomspace(B, start=p[0] + 1.0, stop=p[1], endpoint=False),
        },
        (jnp.asarray(0.3), jnp.asarray(1.7)),
    )


P3, P2, Roots, Samples = Axis("p", 3), Axis("q", 2), Axis("r", 3), Axis("s", 6)


@case(
    "nm.poly",
    "nm.polyadd",
    "nm.polysub",
    "nm.polymul",
    "nm.polydiv",
    "nm.polyint",
    "nm.polyder",
    "nm.polyfit",
    "nm.vander",
)
def polynomials():
    def f(p):
        a, b, zeros, xs, ys = p  # coefficients over p and q, roots, samples
        return {
            "poly": nm.poly(zeros),
            "add": nm.polyadd(a, b),
            "sub": nm.polysub(a, b),
            "mul": nm.polymul(a, b),
            "div": nm.polydiv(a, b),
            "int": nm.polyint(a, 2, k=[0.5, -1.0]),
            "der": nm.polyder(nm.polymul(a, a)),
            "fit": nm.polyfit(xs, ys, 2),
            "vander": nm.vander(xs, Axis("power", 3)),
        }

    fd_check(f, (grid((P3,), 1), positive((P2,), 2), grid((Roots,), 3), grid((Samples,), 4), grid((Samples,), 5)))


@case("nm.roots", "nm.trim_zeros")
def eager_polynomials():
    """Sizes that depend on the values (leading zeros dropped): eager only, so checked without jit.
    Distinct real roots: the roots move smoothly with the coefficients."""
    coeffs = nm.poly(nm.named(jnp.asarray([0.5, 1.5, -1.0]), (Roots,)))
    edge = nm.zeros((Axis("r", 1),), jnp.float64)  # exact zeros, outside the perturbed parameters: the size stays

    def f(c):
        return {
            "roots": nm.sort(nm.real(nm.roots(c)), "r"),
            "trim": nm.trim_zeros(nm.concatenate("r", [edge, c, edge, edge])),
        }

    fd_check(f, coeffs, jit=lambda fn: fn)


@case("nm.NamedRef", "nm.new_ref", "nm.get", "nm.swap", "nm.freeze")
def refs():
    """Reads and writes of a ref inside the differentiated function carry the values' gradients."""

    def f(v):
        ref = nm.new_ref(v)  # (a, b)
        ref[{"a": 0}] = ref[{"a": 1}] * 3.0
        old = nm.swap(ref, {"a": 2, "b": nm.ds(1, 2)}, v["a", 0, "b", 0:2] ** 2)
        view = ref.slice({"b": slice(0, 3)})
        return {"frozen": nm.freeze(ref) * 2.0, "got": nm.get(view, {"a": 1}), "old": old}

    fd_check(f, grid((A, B), 1))


@case("nm.map")
def lax_map():
    fd_check(
        lambda p: nm.map(lambda row: nm.tanh(nm.dot(row, p[1], axis="b")), "a")(p[0]),
        (grid((A, B), 1, scale=0.5), grid((B, C), 2, scale=0.5)),
    )


@case("nm.grad", "nm.value_and_grad")
def gradients_of_gradients():
    """nm.grad's gradient (a Hessian-vector product under jit) against finite differences of nm.grad."""

    def loss(w, x):
        return (nm.tanh(nm.dot(x, w, axis="b")) ** 2).mean()  # a 0-d NamedArray

    x = grid((A, B), 3, scale=0.5)
    fd_check(
        lambda w: {"grad": nm.grad(loss)(w, x), "value_and_grad": nm.value_and_grad(loss)(w * 2.0, x)},
        grid((B, C), 2, scale=0.5),
    )


@case("nm.tree_checkpoint_name")
def tree_checkpoint_name():
    stack = f64(nn.Stacked.init(Layers, Block.init, key=key(1), remat="save_names:tagged"))
    params, rebuild = split(stack)

    def f(p):
        def block(b, h):
            return nm.tree_checkpoint_name({"h": b(h["h"]), "plain": h["plain"] * 2.0}, "tagged")

        return rebuild(p[0]).fold_via(block)({"h": p[1], "plain": p[2]})

    fd_check(f, (params, grid((Batch, Embed), 2), jnp.asarray([0.3, -0.2])))


@case("nm.flatten_modules_for_export", "nm.unflatten_modules_from_export")
def export_layouts():
    """torch's layout of a Linear (a transpose) and back: the gradient of each entry follows it."""
    lin = f64(nn.Linear.init((Embed, C), Mlp, key=key(1)))
    params, rebuild = split(lin)

    def f(p):
        flat = nm.flatten_modules_for_export(rebuild(p))
        return {"flat": flat.weight * 2.0, "back": nm.unflatten_modules_from_export(flat, lin).weight}

    fd_check(f, params)


@case("nn.MoELinear")
def moe_linear():
    """Rows grouped by expert (3, then 3) through one ragged_dot; the group sizes are integers."""
    Rows = Axis("rows", 6)
    layer = nn.MoELinear.init(Experts.resize(2), Embed, Mlp, key=key(1))
    layer_check(layer, grid((Rows, Embed), 2), lambda m, v: m(v, jnp.asarray([3, 3])), **F32)


@case("nn.dot_product_attention_weights")
def attention_weights():
    fd_check(lambda p: nn.dot_product_attention_weights(p[0], p[1], causal=True, softcap=2.0), qkv(KVHeads)[:2], **F64)


@case("nn.mup.LinearStandardParam", "nn.mup.InputLinearMup", "nn.mup.HiddenLinearMup", "nn.mup.OutputLinearMup")
def mup_linears():
    """A Linear under each parametrization: its init scale and its output multiplier (the readout's 1/fan_in)."""
    layers = [
        nn.Linear.init(Embed, Mlp, key=key(i), reparam_cls=cls)
        for i, cls in enumerate(
            (nn.mup.LinearStandardParam, nn.mup.InputLinearMup, nn.mup.HiddenLinearMup, nn.mup.OutputLinearMup)
        )
    ]
    layer_check(layers, grid((Batch, Embed), 2), lambda m, v: [layer(v) for layer in m])


@case("nn.mup.AbstractEmbeddingReparam", "nn.mup.EmbeddingStandardParam", "nn.mup.EmbeddingMup")
def mup_embeddings():
    """An Embedding over two axes under each parametrization: lookup and unembed (EmbeddingMup's 1/embed size)."""
    two = (Embed, Axis("extra", 2))
    layers = [
        nn.Embedding.init(Vocab, two, key=key(i), reparam_cls=cls)
        for i, cls in enumerate((nn.mup.AbstractEmbeddingReparam, nn.mup.EmbeddingStandardParam, nn.mup.EmbeddingMup))
    ]
    tokens = ids((Batch, Pos), Vocab.size)
    layer_check(layers, randn((Batch, *two), 2), lambda m, h: [(e(tokens), e.unembed(h)) for e in m])


# ---- the tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_under_jit_matches_finite_differences(name):
    CASES[name][1]()


def test_the_checks_fail_on_a_wrong_gradient():
    @jax.custom_vjp
    def cube(x):
        return x**3

    cube.defvjp(lambda x: (x**3, x), lambda x, ct: (3.03 * x**2 * ct,))  # 1 % off
    x = grid((A, B), 1)
    with pytest.raises(AssertionError, match="cotangent projection"):
        fd_check(lambda v: nm.named(cube(v.array), v.axes), x)
    with pytest.raises(AssertionError):
        same_vjp(lambda v: nm.named(cube(v.array), v.axes), lambda v: v**3, x, x, tol=1e-3)
    fd_check(lambda v: v**3, x)


def test_every_public_name_has_a_gradient_case():
    surface = public_surface()
    covered = {n for covers, _ in CASES.values() for n in covers}
    missing = sorted(set(surface) - covered - set(EXCLUDED))
    assert not missing, f"public names without a gradient case or a reason in EXCLUDED: {missing}"
    stale = sorted((covered | set(EXCLUDED)) - set(surface))
    assert not stale, f"names in CASES or EXCLUDED that are not public (any more): {stale}"
    both = sorted(covered & set(EXCLUDED))
    assert not both, f"names both covered and excluded: {both}"


_NOT_AN_OP = "a type, an error or an annotation"
_DISCRETE = "boolean or integer results: nothing to differentiate"
_CONSTANT = "builds an array from axes (and a dtype) alone: no float input"
_LAYOUT = "mesh, mapping and layout machinery: no array computation of its own"
_NO_PARAMETER = "a draw that depends on the key alone: no parameter to differentiate"
_IMPLICIT = (
    "jax.random's implicit reparameterisation gradient: right in distribution, not equal to "
    "the finite differences of one draw (the sampler is a rejection loop)"
)
_MASK = "a boolean mask for dot_product_attention (the attention cases use them): nothing to differentiate"
EXCLUDED: dict[str, str] = {
    **dict.fromkeys(
        [
            "nm.ArgumentError",
            "nm.FileWriteError",
            "nm.ArgumentTypeError",
            "nm.Axis",
            "nm.AxisError",
            "nm.AxisSelection",
            "nm.AxisSelector",
            "nm.NamedError",
            "nm.ResourceMapping",
            "nm.ShardedAxis",
            "nm.ShardingCheck",
            "nm.ShardingError",
            "nm.StateDictEntry",
            "nm.StateDictError",
            "nm.UnreducedError",
        ],
        _NOT_AN_OP,
    ),
    **dict.fromkeys(
        [
            "nm.all",
            "nm.any",
            "nm.allclose",
            "nm.array_equal",
            "nm.argmax",
            "nm.argmin",
            "nm.argsort",
            "nm.nanargmax",
            "nm.nanargmin",
            "nm.count_nonzero",
            "nm.nonzero",
            "nm.searchsorted",
            "nm.equal",
            "nm.not_equal",
            "nm.greater",
            "nm.greater_equal",
            "nm.less",
            "nm.less_equal",
            "nm.isclose",
            "nm.isfinite",
            "nm.isinf",
            "nm.isnan",
            "nm.signbit",
            "nm.logical_and",
            "nm.logical_not",
            "nm.logical_or",
            "nm.logical_xor",
            "nm.invert",
            "nm.bitwise_and",
            "nm.bitwise_or",
            "nm.bitwise_xor",
            "nm.bitwise_not",
            "nm.bitwise_count",
            "nm.left_shift",
            "nm.right_shift",
            "nm.gcd",
            "nm.lcm",
            "nm.axis_index",
            "nn.positions_from_segments",
            "nm.array_equiv",
            "nm.packbits",
            "nm.unpackbits",
            "nm.bitwise_invert",
            "nm.bitwise_left_shift",
            "nm.bitwise_right_shift",
            "nm.iscomplex",
            "nm.isreal",
            "nm.isneginf",
            "nm.isposinf",
        ],
        _DISCRETE,
    ),
    **dict.fromkeys(
        [
            "nm.arange",
            "nm.zeros",
            "nm.ones",
            "nm.zeros_like",
            "nm.ones_like",
            "nm.one_hot",
            "nm.fftfreq",
            "nn.alibi_slopes",
        ],
        _CONSTANT,
    ),
    **dict.fromkeys(
        [
            "nm.axes_of",
            "nm.is_named_array",
            "nm.axis_mapping",
            "nm.current_mapping",
            "nm.current_mesh",
            "nm.make_mesh",
            "nm.mesh_sizes",
            "nm.set_mesh",
            "nm.check_mapping",
            "nm.check_sharding",
            "nm.infer_shardings",
            "nm.pspec_for",
            "nm.sharding_for",
            "nm.layout",
            "nm.parse_layout",
            "nm.explicit.block_layout",
            "nm.typecheck",
            "nm.axis_spec_to_tuple",
            "nm.axis_spec_to_shape_dict",
            "nm.concat_axes",
            "nm.eliminate_axes",
            "nm.without_axes",
            "nm.replace_axis",
            "nm.field",
        ],
        _LAYOUT,
    ),
    **dict.fromkeys(["nm.compiled_report", "nm.param_report"], "reports on a compiled program or a model's layout"),
    **dict.fromkeys(
        [
            "nm.state_dict",
            "nm.state_dict_entries",
            "nm.load_state_dict",
            "nm.load_state_dict_file",
            "nm.save_state_dict",
            "nm.save_safetensors",
            "nm.square_keys",
            "nm.stack_state_dict",
            "nm.unstack_state_dict",
        ],
        "moves a model's arrays to and from files and flat dicts",
    ),
    "nm.inspect": "reports; its public functions are re-exported at the top (nm.layout, nm.compiled_report, ...)",
    "nm.partitioning": "mesh and mapping machinery; its differentiable parts (nm.shard, nm.named_jit) are at the top",
    **dict.fromkeys(
        [
            "nm.random.gumbel",
            "nm.random.laplace",
            "nm.random.logistic",
            "nm.random.exponential",
            "nm.random.cauchy",
            "nm.random.maxwell",
            "nm.random.block_draw",
        ],
        _NO_PARAMETER,
    ),
    **dict.fromkeys(
        [
            "nm.random.gamma",
            "nm.random.beta",
            "nm.random.loggamma",
            "nm.random.chisquare",
            "nm.random.t",
            "nm.random.dirichlet",
        ],
        _IMPLICIT,
    ),
    **dict.fromkeys(
        [
            "nm.random.bernoulli",
            "nm.random.binomial",
            "nm.random.poisson",
            "nm.random.geometric",
            "nm.random.rademacher",
            "nm.random.randint",
            "nm.random.categorical",
            "nm.random.split",
        ],
        _DISCRETE,
    ),
    **dict.fromkeys(
        ["nn.causal_mask", "nn.chunked_mask", "nn.padding_mask", "nn.segment_mask", "nn.forgetful_causal_mask"], _MASK
    ),
    "nn.attention_implementation": (
        "a trace-time switch; on CPU every implementation it may name but 'cudnn' (refused "
        "without a GPU) is the XLA path that the attention cases differentiate"
    ),
    "nn.gather_per_use": (
        "a trace-time switch for the Linears under it; tests/test_gather_per_use.py compares their values and "
        "every gradient with plain jnp on the 8-device mesh"
    ),
    "nn.QuantConfig": "a configuration for nn.quantize",
    "nn.remat_policy": "jax's checkpoint policy for a Remat; the stack cases differentiate each policy through a stack",
    "nn.get_policy": "parses a precision policy",
    "nn.keeps_full_precision": "says whether a module keeps float32 parameters under a policy",
    "nn.attention_keeps_scores": "says whether an attention path keeps its scores (a memory model's input)",
    "nn.auto_attention": "names the attention path implementation='auto' takes",
    "nn.DynamicLossScale": "a float16 step's loss scale: a multiplication by a power of two and its update rule",
    "nn.all_finite": _DISCRETE,
    **dict.fromkeys(
        ["nn.is_overwrite_state", "nn.without_overwrites", "nn.overwrite_updates"],
        "the optimizer's side of fp8's state: tree surgery on gradients, not a differentiated function",
    ),
    "nn.lora.linear_paths": "lists a model's Linears by path",
    "nn.mup.AbstractLinearReparam": "the base class of the parametrizations; the mup_linears case differentiates "
    "a Linear under each of its subclasses",
    **dict.fromkeys(
        ["nm.debug.ModuleProblems", "nm.debug.diagnose_common_issues", "nm.debug.visualize_shardings"],
        "debug reports on a module or on where a tree's arrays live",
    ),
    "nm.nextafter": (
        "jax defines no derivative for nextafter (the adjacent float: a step, 1 almost everywhere); "
        "jax.grad raises its NotImplementedError"
    ),
    "nn.lora.trainable": "a boolean tree that marks the adapters (for eqx.partition)",
    **dict.fromkeys(
        ["nn.mup.rescale_init", "nn.mup.scale_updates", "nn.mup.roles", "nn.mup.scale_reparam_updates"],
        "muP's scaling of an init and of optimizer updates, applied outside the differentiated function",
    ),
}
