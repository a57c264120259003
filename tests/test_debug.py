"""named.debug (Haliax's hax.debug): the module problems it finds, by path, and the layouts
visualize_shardings prints, eagerly and from inside jit, against the arrays' own shardings."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import named as nm
from named import debug


class Pair(eqx.Module):
    a: jax.Array
    b: jax.Array


class Outer(eqx.Module):
    pair: Pair
    c: nm.NamedArray
    frozen: jax.Array = eqx.field(static=True)


def test_diagnose_common_issues_names_reused_and_static_arrays():
    shared = jnp.zeros(2)
    named = nm.zeros(nm.Axis("x", 3))
    with pytest.warns(UserWarning, match="static"):  # equinox warns, and goes on
        bad = Outer(Pair(shared, shared), named, jnp.ones(1))
    with pytest.raises(debug.ModuleProblems) as e:
        debug.diagnose_common_issues(bad)
    assert [paths for _, paths in e.value.reused_arrays] == [[".pair.a", ".pair.b"]]
    assert e.value.static_arrays == [".frozen"]
    assert isinstance(e.value, nm.NamedError) and ".frozen is a static field holding an array" in str(e.value)
    # a NamedArray sharing its buffer with a plain leaf is one array stored twice too
    with pytest.raises(debug.ModuleProblems, match=r"stored at \.pair\.a, \.c"):
        debug.diagnose_common_issues(Outer(Pair(named.array, jnp.ones(2)), named, None))
    debug.diagnose_common_issues(Outer(Pair(jnp.zeros(2), jnp.ones(2)), named, None))  # nothing wrong: no error


def test_visualize_shardings_prints_each_arrays_layout(capsys):
    mesh = nm.make_mesh({"data": 4, "model": 2})
    x = nm.shard(nm.zeros((nm.Axis("batch", 8), nm.Axis("embed", 4))), {"batch": "data", "embed": "model"}, mesh)
    tree = {"x": x, "plain": jnp.ones(3)}
    debug.visualize_shardings(tree)
    spec = x.array.sharding.spec  # the reference: the placed array's own PartitionSpec
    assert (spec[0], spec[1]) == ("data", "model")
    assert capsys.readouterr().out.splitlines() == ["['plain']: dim0", "['x']: batch/data embed/model"]
    jax.jit(lambda t: (debug.visualize_shardings(t), t)[1])({"x": x})
    assert capsys.readouterr().out.splitlines() == ["['x']: batch/data embed/model"]
