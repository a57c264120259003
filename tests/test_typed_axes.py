"""Typed axes: ``nm.f32["batch position embed"]`` annotations checked by ``nm.typecheck`` (on
jaxtyping): names as a set, dtypes, one size per name across a call, and nothing when off."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jaxtyping import Array, Int

import named as nm
from named import Axis

Batch, Pos, Embed, Hidden = Axis("batch", 2), Axis("position", 3), Axis("embed", 4), Axis("hidden", 5)
X = nm.ones((Batch, Pos, Embed))
W = nm.ones((Embed, Hidden))


def project(x: nm.f32["batch position embed"], w: nm.Float["embed hidden"]) -> nm.f32["batch position hidden"]:
    return nm.dot(x, w, axis="embed")


checked = nm.typecheck(project, enabled=True)


def test_a_correct_call_passes_in_any_axis_order():
    want = nm.dot(X, W, axis="embed")
    got = checked(X.rearrange(("embed", "batch", "position")), W)
    assert set(got.names) == set(want.names)
    assert jnp.allclose(got.rearrange(want.names).array, want.array)


def test_a_wrong_axis_name_names_the_axis_and_the_argument():
    with pytest.raises(nm.ArgumentTypeError, match=r"argument 'x' of project: .* missing axis 'embed'"):
        checked(X.rename({"embed": "features"}), W)
    with pytest.raises(nm.ArgumentTypeError, match=r"argument 'w' .* unexpected axis 'heads'"):
        checked(X, nm.ones((Embed, Hidden, Axis("heads", 2))))


def test_dtype_and_size_mismatches():
    with pytest.raises(nm.ArgumentTypeError, match=r"argument 'x' .* dtype int32, expected f32"):
        checked(X.astype(jnp.int32), W)
    checked(X, W.astype(jnp.bfloat16))  # Float is any floating dtype
    with pytest.raises(nm.ArgumentTypeError, match=r"argument 'w' .* axis 'embed' .* size 3, unlike in an earlier"):
        checked(X, nm.ones((Axis("embed", 3), Hidden)))


def test_the_return_value_is_checked():
    def wrong(x: nm.f32["batch position embed"]) -> nm.f32["batch hidden"]:
        return x

    with pytest.raises(nm.ArgumentTypeError, match=r"the return value of .*wrong: .* missing axis 'hidden'"):
        nm.typecheck(wrong, enabled=True)(X)


def test_ellipsis_fixed_sizes_optional_and_plain_jaxtyping():
    @nm.typecheck(enabled=True)
    # the strings in the brackets are axis names, not forward references (what ruff's F821 and UP037 take them for)
    def f(x: nm.f32["embed ..."], y: nm.f32[Axis("batch", 2), "position"] | None, ids: Int[Array, "batch"]):  # noqa: F821, UP037
        return x

    f(X, None, jnp.zeros(2, jnp.int32))
    f(X, nm.ones((Batch, Pos)), jnp.zeros(2, jnp.int32))
    with pytest.raises(nm.ArgumentTypeError, match=r"argument 'y' .* axis 'batch' .* size 3, expected 2"):
        f(X, nm.ones((Axis("batch", 3), Pos)), jnp.zeros(3, jnp.int32))
    f(X, None, jnp.zeros(7, jnp.int32))  # x lets "batch" through "..." unbound
    # y binds "batch" for this call, and the plain array's jaxtyping annotation must agree
    with pytest.raises(
        nm.ArgumentTypeError, match=r"argument 'ids' of .*f: expected Int\[.*Array, 'batch'\], but got int32\[7\]"
    ):
        f(X, nm.ones((Batch, Pos)), jnp.zeros(7, jnp.int32))


def test_checks_run_under_jit_at_trace_time():
    assert jax.jit(checked)(X, W).axes == (Batch, Pos, Hidden)
    with pytest.raises(nm.ArgumentTypeError, match="missing axis 'embed'"):
        jax.jit(checked)(X.rename({"embed": "features"}), W)


def test_off_costs_nothing(monkeypatch):
    monkeypatch.delenv("NAMED_TYPECHECK", raising=False)
    assert nm.typecheck(project) is project
    assert nm.typecheck(enabled=False)(project) is project
    monkeypatch.setenv("NAMED_TYPECHECK", "1")
    on = nm.typecheck(project)
    assert on is not project
    with pytest.raises(nm.ArgumentTypeError):
        on(X.rename({"embed": "features"}), W)


def test_annotations_are_types():
    assert nm.f32["batch position embed"] is nm.f32["batch  position embed"]
    assert isinstance(X, nm.f32["embed batch position"]) and isinstance(X, nm.Named["batch ..."])
    assert not isinstance(X, nm.f32["batch embed"]) and not isinstance(X.array, nm.f32["batch position embed"])
    assert repr(nm.i32["batch position"]) == "i32['batch position']"
    with pytest.raises(nm.AxisError, match="twice"):
        nm.f32["batch batch"]
