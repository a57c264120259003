"""Gradients under jit of every public differentiable layer and op, against finite differences.

Each case is a function of float arrays (a layer's parameters and its input). ``fd_check`` takes
its VJP under ``jax.jit`` (``nm.named_jit`` where a case needs a mesh) and compares it, with
``jax.test_util.check_vjp``, to central differences of the jitted function along a random
direction. The cases run in float64 (x64 is on for this module only), so that the differences
are exact to many digits; where a layer computes in float32 on purpose (norm statistics,
attention scores, losses, routing, a mixed-precision policy) the case says so and is checked at
float32's tolerance. Inputs sit away from kinks and ties (``grid``), where a derivative exists.
A quantized Linear's rounding has no derivative: its cases check what its gradient is
documented to be (straight-through for fp8, the float gradient for int8).

``test_every_public_name_has_a_gradient_case`` walks the public surface of ``named``,
``named.nn`` (with ``lora`` and ``mup``) and ``named.random``: a new public function or class
needs a case here, or an entry in ``EXCLUDED`` that says why it has no gradient to check.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_vjp

import named as nm
from named import Axis, nn

A, B, C = Axis("a", 3), Axis("b", 4), Axis("c", 2)
Batch, Pos, KPos, HeadSize = Axis("batch", 2), Axis("position", 4), Axis("key_position", 4), Axis("head_size", 4)
Heads, KVHeads = Axis("heads", 4), Axis("kv_heads", 2)
Embed, Mlp, Vocab, Layers, Experts = Axis("embed", 4), Axis("mlp", 6), Axis("vocab", 8), Axis("layers", 2), Axis("experts", 4)
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


def positive(axes, seed: int = 0) -> nm.NamedArray:
    return nm.abs(grid(axes, seed)) + 0.4


def unit(axes, seed: int = 0) -> nm.NamedArray:
    """Distinct values in (-0.9, 0.9)."""
    g = grid(axes, seed)
    return g * (0.9 / (float(nm.abs(g).max().array) + 0.05))


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
    """Register a gradient case; ``covers`` are the public names (``nm.exp``, ``nn.Linear``) it differentiates."""
    def register(fn):
        CASES[name or fn.__name__] = (covers, fn)
        return fn

    return register


# elementwise, one input: name -> the inputs' domain
REAL, POS, UNIT, ABOVE_ONE = grid, positive, unit, lambda axes, seed=0: positive(axes, seed) + 1.0
UNARY = {
    "nm.abs": REAL, "nm.negative": REAL, "nm.sign": REAL, "nm.exp": REAL, "nm.exp2": REAL, "nm.expm1": REAL,
    "nm.log": POS, "nm.log2": POS, "nm.log10": POS, "nm.log1p": POS, "nm.sqrt": POS, "nm.rsqrt": POS, "nm.cbrt": REAL,
    "nm.square": REAL, "nm.reciprocal": POS, "nm.sin": REAL, "nm.cos": REAL, "nm.tan": UNIT, "nm.arcsin": UNIT,
    "nm.arccos": UNIT, "nm.arctan": REAL, "nm.sinh": REAL, "nm.cosh": REAL, "nm.tanh": REAL, "nm.arcsinh": REAL,
    "nm.arccosh": ABOVE_ONE, "nm.arctanh": UNIT, "nm.floor": REAL, "nm.ceil": REAL, "nm.round": REAL, "nm.trunc": REAL,
    "nm.erf": REAL, "nm.erfc": REAL, "nm.sigmoid": REAL, "nm.log_sigmoid": REAL, "nm.softplus": REAL, "nm.relu": REAL,
    "nm.relu6": REAL, "nm.silu": REAL, "nm.elu": REAL, "nm.leaky_relu": REAL, "nm.gelu": REAL, "nm.deg2rad": REAL,
    "nm.rad2deg": REAL, "nm.sinc": REAL, "nm.nan_to_num": REAL,
    "nn.celu": REAL, "nn.selu": REAL, "nn.hard_sigmoid": REAL, "nn.hard_silu": REAL, "nn.hard_tanh": REAL,
    "nn.soft_sign": REAL, "nn.mish": REAL, "nn.relu_squared": REAL, "nn.quick_gelu": REAL,
}
COMPLEX_UNARY = ("nm.conj", "nm.real", "nm.imag", "nm.angle")
# elementwise, two inputs: name -> (x's domain, y's domain); "mod" keeps x / y away from the integers
BINARY = {
    "nm.add": (REAL, REAL), "nm.subtract": (REAL, REAL), "nm.multiply": (REAL, REAL), "nm.divide": (REAL, POS),
    "nm.power": (POS, REAL), "nm.maximum": (REAL, REAL), "nm.minimum": (REAL, REAL), "nm.arctan2": (REAL, REAL),
    "nm.hypot": (REAL, REAL), "nm.logaddexp": (REAL, REAL), "nm.fmax": (REAL, REAL), "nm.fmin": (REAL, REAL),
    "nm.copysign": (REAL, REAL), "nm.heaviside": (REAL, REAL), "nm.logaddexp2": (REAL, REAL),
    "nm.float_power": (POS, REAL), "nm.mod": "mod", "nm.floor_divide": "mod", "nm.fmod": "mod",
}
# reductions over names: which take where=, which skip NaN (their input then holds one)
REDUCTIONS = {
    "nm.sum": "where", "nm.mean": "where", "nm.prod": "where", "nm.max": "where", "nm.min": "where", "nm.std": "where",
    "nm.var": "where", "nm.logsumexp": "where", "nm.nansum": "nan", "nm.nanmean": "nan", "nm.nanprod": "nan",
    "nm.nanstd": "nan", "nm.nanvar": "nan", "nm.nanmax": "nan", "nm.nanmin": "nan", "nm.median": "", "nm.nanmedian": "nan",
    "nm.ptp": "",
}
# along one name, the shape kept
ALONG = {
    "nm.softmax": lambda x: nm.softmax(x, "b"), "nm.log_softmax": lambda x: nm.log_softmax(x, "b", where=MASK()),
    "nm.standardize": lambda x: nm.standardize(x, "b", where=MASK()), "nm.cumsum": lambda x: nm.cumsum(x, "b"),
    "nm.cumprod": lambda x: nm.cumprod(x, "b", reverse=True), "nm.nancumsum": lambda x: nm.nancumsum(x, "b"),
    "nm.nancumprod": lambda x: nm.nancumprod(x, "b"), "nm.sort": lambda x: nm.sort(x, "b", descending=True),
    "nm.fftshift": lambda x: nm.fftshift(x, "b"), "nm.ifftshift": lambda x: nm.ifftshift(x, ("a", "b")),
}


def MASK():
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
        if domains == "mod":  # x = y (k + f) with f in [0.3, 0.7]: x / y stays 0.3 from the integers
            y = positive((A, B), 1) * nm.sign(grid((A, B), 2))
            x = y * (nm.floor(grid((A, B), 3)) + 0.3 + 0.4 * (positive((A, B), 4) - 0.4) / 3.5)
        else:
            x, y = domains[0]((A, B), 1), domains[1]((C, B), 2, offset=0.2) if domains[1] is REAL else domains[1]((C, B), 2)
        fd_check(lambda p: op(*p), (x, y))

    return check


def _complex(name):
    def check():
        z = grid((A, B), 1) + 1j * grid((A, B), 2, offset=0.2)
        fd_check(lambda v: _fn(name)(v), z)

    return check


def _reduction(name, kind):
    def check():
        op = _fn(name)
        x = grid((A, B), 1)
        if kind == "nan":
            x = nm.where(nm.named(np.arange(12).reshape(3, 4) == 5, (A, B)), jnp.nan, x)
        fd_check(lambda v: {"a": op(v, "a"), "all": op(v), **({"where": op(v, "b", where=MASK())} if kind == "where" else {})}, x)

    return check


for _name, _domain in UNARY.items():
    case(_name, name=_name)(_unary(_name, _domain))
for _name in COMPLEX_UNARY:
    case(_name, name=_name)(_complex(_name))
for _name, _domains in BINARY.items():
    case(_name, name=_name)(_binary(_name, _domains))
for _name, _kind in REDUCTIONS.items():
    case(_name, name=_name)(_reduction(_name, _kind))
for _name, _op in ALONG.items():
    case(_name, name=_name)(lambda op=_op: fd_check(op, grid((A, B), 1)))


@case("nm.where", "nm.clip")
def where_and_clip():
    cond = nm.named(np.arange(8).reshape(2, 4) % 3 == 0, (C, B))
    lo, hi = grid((B,), 3, offset=0.2) - 1.0, grid((C,), 4, offset=0.2) + 1.0
    fd_check(lambda p: {"where": nm.where(cond, p[0], p[1]), "clip": nm.clip(p[0], p[2], p[3]),
                        "below": nm.clip(p[0], upper=0.3)}, (grid((A, B), 1), grid((B,), 2, offset=0.2), lo, hi))


@case("nm.fft", "nm.ifft", "nm.rfft", "nm.irfft", "nm.hfft", "nm.ihfft")
def fourier():
    z = grid((A, B), 1) + 1j * grid((A, B), 2, offset=0.2)
    fd_check(lambda v: {"fft": nm.fft(v, "b"), "fft2": nm.fft(v, ("a", "b")), "ifft": nm.ifft(v, "b", norm="ortho"),
                        "irfft": nm.irfft(v, "b"), "hfft": nm.hfft(v, "a", n=4)}, z)
    fd_check(lambda v: {"rfft": nm.rfft(v, "b"), "rfft2": nm.rfft(v, ("a", "b")), "ihfft": nm.ihfft(v, "a")},
             grid((A, B), 3))


@case("nm.top_k", "nm.unique", "nm.ravel", "nm.repeat", "nm.tile", "nm.trace", "nm.polyval", "nm.bincount")
def numpy_shapes():
    x, w = grid((A, B), 1), grid((A, B), 2)
    counted = ids((A, B), 5)
    fd_check(lambda p: {"top_k": nm.top_k(p[0], "b", 2)[0], "unique": nm.unique(p[0], Axis("found", 12)),
                        "ravel": nm.ravel(p[0], "flat"), "repeat": nm.repeat(p[0], 2, "a"), "tile": nm.tile(p[0], {"b": 2}),
                        "trace": nm.trace(p[0], "a", "b", offset=1), "bincount": nm.bincount(counted, Axis("bin", 5), weights=p[1]),
                        "polyval": nm.polyval(p[2], p[0], "c") + nm.polyval([0.5, -1.0, 2.0], p[0])},
             (x, w, grid((C,), 3)))


@case("nm.rename", "nm.rearrange", "nm.flatten_axes", "nm.unflatten_axis", "nm.split", "nm.unbind", "nm.stack",
      "nm.concatenate", "nm.broadcast_axis", "nm.broadcast_to", "nm.pad", "nm.roll", "nm.tril", "nm.triu", "nm.named")
def shapes():
    def f(p):
        x, y = p  # (a, b) and (c, b)
        return {"rename": nm.rename(x, {"a": "z"}), "rearrange": nm.rearrange(x, ("b", "a")),
                "unflatten": nm.unflatten_axis(nm.flatten_axes(x, ("a", "b"), "ab"), "ab", (A, B)),
                "split": nm.split(x, "b", (Axis("b", 1), Axis("b", 3)))[1] * 2.0, "unbind": nm.unbind(x, "a")[2],
                "stack": nm.stack("s", [x, x * x]), "concatenate": nm.concatenate("a", [x, y.rename({"c": "a"})]),
                "broadcast": nm.broadcast_axis(y, A) + nm.broadcast_to(nm.unbind(y, "c")[0], (A, B)),
                "pad": nm.pad(x, {"b": (1, 2)}, constant_values=0.5), "reflect": nm.pad(x, {"a": (1, 1)}, mode="reflect"),
                "roll": nm.roll(x, 2, "b"), "tril": nm.tril(x, "a", "b", k=1), "triu": nm.triu(x, "a", "b"),
                "named": nm.named(x.array * 2.0, ("a", "b"))}

    fd_check(f, (grid((A, B), 1), grid((C, B), 2)))


@case("nm.NamedArray", "nm.take", "nm.ds", "nm.updated_slice")
def indexing():
    where, start = ids((C,), 3), jnp.asarray(1)  # a traced start: the jitted functions close over it

    def f(p):
        x, u = p  # (a, b) and (a, b=2)
        return {"int": x["a", 1], "slice": x["b", 1:3], "ids": x["a", where], "take": nm.take(x, "a", where),
                "ds": x["b", nm.ds(start, 2)], "rows": x["b", nm.ds(nm.named(jnp.asarray([0, 2, 1]), (A,)), 2)],
                "set": x.at["b", 1:3].set(u), "add": x.at["a", 0].add(x["a", 2] * 3.0),
                "updated_slice": nm.updated_slice(x, {"b": start}, u),
                "operators": (x * 2.0 - x / 3.0) ** 2 + abs(-x) + x % 7.0}

    fd_check(f, (grid((A, B), 1), grid((A, B.resize(2)), 2)))


@case("nm.dot", "nm.einsum")
def contractions():
    def f(p):
        x, w, v = p  # (a, b), (b, c), (c,)
        return {"dot": nm.dot(x, w, axis="b"), "dot3": nm.dot(x, w, v, axis=("b", "c")),
                "outer": nm.dot(x, v, axis=None), "einsum": nm.einsum("a b, b c -> c a", x, w),
                "trace": nm.einsum("a b, b c, c ->", x, w, v)}

    fd_check(f, (grid((A, B), 1), grid((B, C), 2), grid((C,), 3)))


@case("nm.vmap", "nm.scan", "nm.fold", "nm.nmap")
def transforms():
    def f(p):
        x, w = p  # (a, b), (b, c)

        def step(carry, row):
            h = nm.tanh(nm.dot(row + carry, w, axis="b"))
            return carry * 0.5 + nm.dot(h, w, axis="c"), h

        carry, ys = nm.scan(step, "a")(nm.zeros((B,)), x)
        return {"vmap": nm.vmap(lambda row: nm.dot(nm.sin(row), w, axis="b"), "a")(x), "scan": carry, "ys": ys,
                "fold": nm.fold(lambda c, row: c * row + 1.0, "a", reverse=True)(nm.ones((B,)), x),
                "nmap": nm.nmap(lambda v: jnp.cumsum(v ** 2), consume="b")(x)}

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


@case("nm.shard_map", "nm.all_gather", "nm.psum_scatter", "nm.psum", "nm.pmean", "nm.pmax", "nm.all_to_all",
      "nm.einsum_unreduced", "nm.with_layout", "nm.Unreduced")
def explicit_collectives():
    Rows, Wide = Axis("batch", 8), Axis("embed", 8)

    def body(x, w):  # x: batch/data embed, w: embed/data mlp
        wg = nm.all_gather(w, "embed")
        h = nm.tanh(nm.einsum("batch embed, embed mlp -> batch mlp", x, wg))
        u = nm.einsum_unreduced("batch mlp, embed mlp -> batch embed", h, wg)  # batch is split: owed nothing
        owed = nm.einsum_unreduced("batch mlp, mlp -> mlp", h, nm.named(jnp.ones(8), ("mlp",)))
        flat = nm.with_layout(h.flatten_axes(("mlp",), "m"), "batch/data m")
        return {"h": h + nm.pmean(h, "batch") * 0.5 + nm.pmax(h, "batch") * 0.25, "u": u,
                "sum": nm.psum(owed), "total": nm.psum(h, "batch"), "flat": flat,
                "scattered": nm.psum_scatter(h.sum("batch"), "mlp", mesh_axes="data"),  # partial sums in
                "a2a": nm.all_to_all(x, split="embed", concat="batch")}

    def f(p):
        return nm.shard_map(body, in_mapping=({"batch": "data"}, {"embed": "data"}))(*p)

    _mesh_case(f, (grid((Rows, Wide), 1, scale=0.1), grid((Wide, Mlp.resize(8)), 2, scale=0.1)), {"batch": "data"})


@case("nm.tree_map_layers")
def tree_map_layers():
    stack = f64(nn.Stacked.init(Layers, nn.Linear.init, Embed, Mlp, key=key(1)))
    params, rebuild = split(stack)
    x = grid((Batch, Embed), 2)

    def f(p):
        scaled = nm.tree_map_layers(lambda lin: eqx.tree_at(lambda m: m.weight, lin, lin.weight * nm.sum(lin.weight ** 2)),
                                    rebuild(p), is_leaf=lambda m: isinstance(m, nn.Linear))
        return scaled.vmap(x)

    fd_check(f, params)


@case("nm.random.normal", "nm.random.uniform", "nm.random.truncated_normal", "nm.random.pareto",
      "nm.random.weibull_min")
def reparameterised_draws():
    """Draws whose parameters enter by a transform of the key's noise: a draw is a smooth function of them."""
    def f(p):
        mean, std, lo, hi = p
        return {"normal": nm.random.normal(key(1), (A, B), jnp.float64, mean=mean, stddev=std),
                "uniform": nm.random.uniform(key(2), (A, B), jnp.float64, minval=lo, maxval=hi),
                "truncated": nm.random.truncated_normal(key(3), (A, B), jnp.float64, lower=lo, upper=hi),
                "pareto": nm.random.pareto(key(4), (A, B), std, dtype=jnp.float64),
                "weibull": nm.random.weibull_min(key(5), (A, B), std, hi, dtype=jnp.float64)}

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
    layer_check((ln, rms), randn((Batch, Embed), 4), lambda m, v: {"ln": m[0](v), "rms": m[1](v * 2.0)}, **F32)


@case("nn.MLP", "nn.activation", "nn.glu")
def mlp():
    blocks = (nn.MLP.init(Embed, Mlp, activation="gelu_new", gated=True, key=key(1)),
              nn.MLP.init(Embed, C, width=3, depth=2, activation="silu", key=key(2)))

    def call(m, v):
        acts = {name: nn.activation(name)(v) for name in nn.ACTIVATIONS}  # every activation by name
        return {"gated": m[0](v), "deep": m[1](v), "glu": nn.glu(v, "embed"), **acts}

    layer_check(blocks, grid((Batch, Embed), 2), call)


@case("nn.Dropout")
def dropout():
    layer_check(nn.Dropout(0.5), grid((Batch, Embed), 1),
                lambda m, v: {"drop": m(v, key=key(3)), "named_key": m(v, key=nm.named(key(4), ())), "all": nn.Dropout(1.0)(v, key=key(5))})


@case("nn.Conv", "nn.ConvTranspose")
def convolutions():
    H, W, Ch, Out = Axis("height", 5), Axis("width", 6), Axis("ch", 4), Axis("out", 2)
    convs = (nn.Conv.init(("height", "width"), Ch, Out, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2), groups=2, key=key(1)),
             nn.Conv.init("width", Ch, Ch, 3, padding="SAME", key=key(2)),
             nn.ConvTranspose.init(("height", "width"), Ch, Out, 3, stride=2, padding=1, output_padding=1, key=key(3)))
    layer_check(convs, randn((Batch, H, W, Ch), 4), lambda m, v: [c(v) for c in m])


@case("nn.max_pool", "nn.min_pool", "nn.mean_pool")
def pools():
    H, W = Axis("height", 5), Axis("width", 6)
    fd_check(lambda v: {"max": nn.max_pool(v, {"height": 2, "width": 3}, stride=2, padding=1, use_ceil=True),
                        "min": nn.min_pool(v, {"height": 3}, padding="SAME"),
                        "mean": nn.mean_pool(v, {"width": 2, "height": 2}, padding=(1, 0), count_include_pad=False)},
             grid((Batch, H, W), 1))


# ---- the tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_under_jit_matches_finite_differences(name):
    CASES[name][1]()
