"""Shared helpers for the named.nn tests: the two standard mappings, and reading the sharding
constraints a traced function puts on its activations."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from jax.sharding import PartitionSpec

import named as nm

# name -> (mesh shape, parameter mapping, compute mapping)
MAPPINGS = {
    "fsdp": ({"data": 8}, {"embed": "data"}, {"batch": "data"}),
    "tp": (
        {"data": 4, "model": 2},
        {"embed": "data", "mlp": "model", "heads": "model"},
        {"batch": "data", "mlp": "model", "heads": "model"},
    ),
}


def spec(p: PartitionSpec) -> tuple:
    """A PartitionSpec as a tuple without trailing Nones (P('data') == P('data', None))."""
    t = tuple(p)
    while t and t[-1] is None:
        t = t[:-1]
    return t


def _subjaxprs(params):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def all_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it (jit, scan, shard_map, custom VJPs)."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in _subjaxprs(eqn.params):
            yield from all_eqns(sub)


def constraint_specs(jaxpr) -> list[tuple[tuple[int, ...], tuple]]:
    """(shape, spec) of every sharding_constraint in a jaxpr, nested jaxprs included, in order."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            out.append((tuple(eqn.outvars[0].aval.shape), spec(eqn.params["sharding"].spec)))
        for sub in _subjaxprs(eqn.params):
            out.extend(constraint_specs(sub))
    return out


def run_sharded(fn, params, *inputs, mapping: str):
    """``fn(params, *inputs)`` under a named_jit with the compute mapping, params laid out by
    the parameter mapping. Returns (output, mesh, compute mapping)."""
    mesh_shape, param_map, compute = MAPPINGS[mapping]
    mesh = nm.make_mesh(mesh_shape)
    params = nm.shard(params, param_map, mesh)
    out = nm.named_jit(fn, mapping=compute, mesh=mesh)(params, *inputs)
    return out, mesh, compute


def traced_constraints(fn, *args, mesh, compute) -> list[tuple[tuple[int, ...], tuple]]:
    """The sharding constraints ``fn`` itself adds when traced under ``compute`` on ``mesh``."""
    with nm.set_mesh(mesh), nm.axis_mapping(compute):
        return constraint_specs(jax.make_jaxpr(fn)(*args))


def assert_follows_mapping(out: nm.NamedArray, mesh, compute, constraints=None):
    """The output lives where the mapping says; given the traced ``constraints`` of the function,
    also that the function itself (not just named_jit's output layout) put that constraint on an
    activation of the output's shape."""
    want = spec(nm.pspec_for(out, compute, mesh))
    assert spec(out.array.sharding.spec) == want, (out.axes, out.array.sharding.spec, want)
    if constraints is not None:
        shape = tuple(a.size for a in out.axes)
        assert (shape, want) in constraints, (shape, want, constraints)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


@eqx.filter_jit
def jcall(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` as one compiled program (modules and NamedArrays are traced,
    other arguments static): a test that runs eagerly compiles one program per op and shape."""
    return fn(*args, **kwargs)
