"""Typed axes: ``nm.f32["batch position embed"]`` in signatures, checked by ``nm.typecheck``.

Built on jaxtyping: the dtype families are its (``Float32``, ``Float``, ...), and sizes are bound
by its per-call memo, so an axis name has one size across every argument and the return value
of a checked call, shared with plain-array annotations such as ``Int[Array, "batch position"]``.

Axis names are matched as a set: ``f32["batch embed"]`` accepts ``(embed, batch)``. Named code
never depends on axis order (every op resolves axes by name, and broadcasting may put them in
another order), so an order-sensitive check would reject arrays every op accepts. ``...`` allows
further axes; an ``Axis`` in the spec also fixes the size.
"""

from __future__ import annotations

import functools
import inspect
import os
import types
import typing
from collections.abc import Callable
from typing import Any, Union

import jax
import jaxtyping
import numpy as np

from ._axis import ArgumentTypeError, Axis, AxisError
from ._core import NamedArray

__all__ = [
    "Bool",
    "Float",
    "Int",
    "Named",
    "bf16",
    "f16",
    "f32",
    "f64",
    "i8",
    "i16",
    "i32",
    "i64",
    "typecheck",
    "u8",
    "u16",
    "u32",
    "u64",
]


class _AxesMeta(type):
    """The metaclass of ``f32["..."]`` classes: ``isinstance`` runs the check."""

    def __instancecheck__(cls, obj) -> bool:
        return cls._problem(obj) is None

    def __repr__(cls) -> str:
        return cls._text


class _TypedAxes(metaclass=_AxesMeta):
    _text = "Named"
    _dtypes: Any = jaxtyping.Shaped
    _family = "Named"
    _names: tuple[str, ...] = ()
    _sizes: dict[str, int] = {}
    _more = True

    @classmethod
    def _problem(cls, obj) -> str | None:
        """Why ``obj`` does not fit, or None."""
        if not isinstance(obj, NamedArray):
            return f"got a {type(obj).__name__}, not a NamedArray"
        have = f"the NamedArray ({' '.join(obj.names)})"
        missing = [n for n in cls._names if n not in obj.names]
        if missing:
            return f"{have} is missing axis {missing[0]!r}"
        extra = [n for n in obj.names if n not in cls._names]
        if extra and not cls._more:
            return f"{have} has unexpected axis {extra[0]!r} (add '...' to the spec to allow more axes)"
        for a in obj.axes:
            if a.name in cls._sizes and a.size != cls._sizes[a.name]:
                return f"axis {a.name!r} of {have} has size {a.size}, expected {cls._sizes[a.name]}"
        if not _fits(cls._dtypes, obj.array, "..."):
            return f"{have} has dtype {obj.dtype}, expected {cls._family}"
        if not _fits(cls._dtypes, obj.array, _dims(obj, cls._names)):
            for a in obj.axes:  # which name's size disagrees with the one bound earlier in this call
                if a.name in cls._names and not _fits(cls._dtypes, obj.array, _dims(obj, (a.name,))):
                    return f"axis {a.name!r} of {have} has size {a.size}, unlike in an earlier argument of this call"
            return f"{have} does not match the sizes bound earlier in this call"
        return None


def _symbol(name: str) -> str:
    # jaxtyping reads a leading "_" as "unchecked" and non-identifiers as expressions: such names
    # are checked for presence only, not bound
    return name if name.isidentifier() and not name.startswith("_") else "_"


def _dims(obj: NamedArray, bound: tuple[str, ...]) -> str:
    """A jaxtyping shape spec for ``obj`` in its own axis order, binding the names in ``bound``."""
    return " ".join(_symbol(a.name) if a.name in bound else "_" for a in obj.axes)


def _fits(dtypes, array, spec: str) -> bool:
    """jaxtyping's check of ``array`` (binding names in the current memo)."""
    kind = jax.Array if isinstance(array, jax.Array) else np.ndarray
    return isinstance(array, _jaxtyping_type(dtypes, kind, spec))


@functools.cache
def _jaxtyping_type(dtypes, kind, spec: str):
    # one type per array kind: jaxtyping turns a union of kinds into a typing.Union, which isinstance refuses
    return dtypes[kind, spec]


def _parse(spec) -> tuple[tuple[str, ...], dict[str, int], bool, str]:
    items = spec if isinstance(spec, tuple) else (spec,)
    names: list[str] = []
    sizes: dict[str, int] = {}
    more = False
    for item in items:
        if isinstance(item, Axis):
            tokens = [item]
        elif isinstance(item, str):
            tokens = item.split()
        elif item is Ellipsis:
            tokens = ["..."]
        else:
            raise AxisError(f"a typed-axes spec takes axis names, Axis objects and '...', got {item!r}")
        for t in tokens:
            if t == "...":
                more = True
                continue
            name = t.name if isinstance(t, Axis) else t
            if name in names:
                raise AxisError(f"axis {name!r} appears twice in the typed-axes spec {spec!r}")
            names.append(name)
            if isinstance(t, Axis):
                sizes[name] = t.size
    text = " ".join([f"{n}={sizes[n]}" if n in sizes else n for n in names] + (["..."] if more else []))
    return tuple(names), sizes, more, text


class _Family:
    """``f32``, ``Float``, ...: index with axis names to get an annotation class."""

    def __init__(self, name: str, dtypes):
        self._name, self._dtypes = name, dtypes

    def __repr__(self) -> str:
        return self._name

    def __getitem__(self, spec) -> type:
        try:
            hash(spec)
        except TypeError:
            raise AxisError(
                f"{self._name}[...] takes a string of axis names, or a tuple of names and Axis objects, got {spec!r}"
            ) from None
        if isinstance(spec, type) or (isinstance(spec, tuple) and spec and isinstance(spec[0], type)):
            # haliax.haxtyping's Float[NamedArray, "batch embed"]: the array type is implied here
            spec = spec if isinstance(spec, tuple) else (spec,)
            rest = spec[1:]
            ours = repr(rest[0]) if len(rest) == 1 else repr(rest) if rest else "'batch embed'"
            raise AxisError(
                f"{self._name}[{spec[0].__name__}, ...] is Haliax's spelling of a typed NamedArray; here the "
                f"array type is implied: write nm.{self._name}[{ours}]"
            )
        return _annotation(self._name, self._dtypes, " ".join(spec.split()) if isinstance(spec, str) else spec)


@functools.cache
def _annotation(family: str, dtypes, spec) -> type:
    """One class per (family, spec), so ``f32["a b"] is f32["a b"]``."""
    names, sizes, more, text = _parse(spec)
    return _AxesMeta(
        f"{family}[{text!r}]",
        (_TypedAxes,),
        {
            "_text": f"{family}[{text!r}]",
            "_dtypes": dtypes,
            "_family": family,
            "_names": names,
            "_sizes": sizes,
            "_more": more,
            "__module__": "named",
        },
    )


f16, bf16, f32, f64 = (
    _Family(n, d)
    for n, d in (
        ("f16", jaxtyping.Float16),
        ("bf16", jaxtyping.BFloat16),
        ("f32", jaxtyping.Float32),
        ("f64", jaxtyping.Float64),
    )
)
i8, i16, i32, i64 = (_Family(f"i{b}", getattr(jaxtyping, f"Int{b}")) for b in (8, 16, 32, 64))
u8, u16, u32, u64 = (_Family(f"u{b}", getattr(jaxtyping, f"UInt{b}")) for b in (8, 16, 32, 64))
Float, Int, Bool = _Family("Float", jaxtyping.Float), _Family("Int", jaxtyping.Int), _Family("Bool", jaxtyping.Bool)
Named = _Family("Named", jaxtyping.Shaped)  # any dtype


# ---- the checking decorator ---------------------------------------------------------------------------


def _checkable(ann) -> bool:
    if isinstance(ann, type) and issubclass(ann, (_TypedAxes, jaxtyping.AbstractArray)):
        return True
    return typing.get_origin(ann) in (Union, types.UnionType) and any(_checkable(a) for a in typing.get_args(ann))


def _problem(ann, value) -> str | None:
    if typing.get_origin(ann) in (Union, types.UnionType):
        options = typing.get_args(ann)
        if any(isinstance(value, a) for a in options):
            return None
        problems = [p for a in options if _checkable(a) and (p := _problem(a, value)) is not None]
        return problems[0] if problems else f"got {type(value).__name__}"
    if isinstance(ann, type) and issubclass(ann, _TypedAxes):
        return ann._problem(value)
    if isinstance(value, ann):
        return None
    shape = getattr(value, "shape", None)
    return f"got {getattr(value, 'dtype', type(value).__name__)}{list(shape) if shape is not None else ''}"


def _enabled_by_env() -> bool:
    return os.environ.get("NAMED_TYPECHECK", "").lower() in ("1", "true", "yes", "on")


def typecheck(fn: Callable | None = None, *, enabled: bool | None = None):
    """Check a function's typed-axes (and jaxtyping) annotations on every call, when enabled.

    Enabled by ``enabled=True`` or by the environment variable ``NAMED_TYPECHECK=1``, read when
    the function is decorated; otherwise the function itself is returned, so checks cost
    nothing. Checked, each annotated argument and the return value must fit their annotation,
    and each axis name has one size across them (jaxtyping's memo). Under ``jit`` the checks run
    once per trace.

    Raises:
        ArgumentTypeError: naming the argument (or the return value) and the axis.
    """
    if fn is None:
        return functools.partial(typecheck, enabled=enabled)
    if not callable(fn):
        raise ArgumentTypeError(f"nm.typecheck decorates a function, got {type(fn).__name__}")
    if not (_enabled_by_env() if enabled is None else enabled):
        return fn
    signature = inspect.signature(fn)
    what = getattr(fn, "__qualname__", repr(fn))

    @functools.cache
    def hints() -> dict[str, Any]:
        # resolved at the first call, when names a string annotation refers to exist
        try:
            return {k: v for k, v in typing.get_type_hints(fn).items() if _checkable(v)}
        except Exception as e:
            raise ArgumentTypeError(f"typecheck: cannot resolve the annotations of {what} ({e})") from None

    def check(ann, value, where: str):
        problem = _problem(ann, value)
        if problem is not None:
            raise ArgumentTypeError(f"{where} of {what}: expected {_describe(ann)}, but {problem}")

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # Python's own message for a call that does not fit the signature
        with jaxtyping.jaxtyped("context"):
            for name, value in bound.arguments.items():
                ann = hints().get(name)
                if ann is None:
                    continue
                kind = signature.parameters[name].kind
                values = (
                    value
                    if kind is inspect.Parameter.VAR_POSITIONAL
                    else (value.values() if kind is inspect.Parameter.VAR_KEYWORD else (value,))
                )
                for v in values:
                    check(ann, v, f"argument {name!r}")
            out = fn(*args, **kwargs)
            if "return" in hints():
                check(hints()["return"], out, "the return value")
        return out

    return checked


def _describe(ann) -> str:
    if typing.get_origin(ann) in (Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(ann))
    return repr(ann) if isinstance(ann, _AxesMeta) else getattr(ann, "__name__", repr(ann))
