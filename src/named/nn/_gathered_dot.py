"""FSDP weights gathered one at a time, where each is used, and their gradients reduce-scattered.

Under ``with nn.gather_per_use(param_mapping):`` a ``Linear`` whose weight the parameter mapping
splits along axes the activations keep whole (FSDP: ``{embed: data}`` with ``{batch: data}``)
computes its product per device, inside ``shard_map``, with a backward pass of its own:

- forward: the weight's shard is all-gathered, multiplied and dropped; what is saved for the
  backward pass is the input and the weight's *shard*, never the gathered weight;
- backward: the weight is gathered again (tied to the incoming cotangent, so that XLA neither
  hoists it nor merges it with the forward's gather), the input's cotangent computed, then (tied
  to it, so the gathered weight is gone) the weight's gradient made from this device's rows only
  and reduce-scattered (``psum_scatter``) at once; the input's cotangent is handed on only once
  that is done, so one full-size weight, gathered or as a gradient, lives at a time. On a GPU
  this keeps the reduce-scatter from overlapping the next weight's products: the price of the
  memory.

Under GSPMD a layer's weights are gathered as XLA schedules them, several at a time, and on a
CPU their gradients are all-reduced whole and then sliced (XLA:CPU forms no reduce-scatter).
Values and gradients are the plain product's; only the collectives and what is live differ.
A layer the rule does not cover (a weight axis the activations split, as tensor parallelism
does; no mesh; inside an explicit-mode body) computes as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from .. import _compat
from .._axis import ArgumentTypeError
from .._context import FrozenMapping, current_body, current_layer_driver, current_mapping, current_mesh, weight_gather
from .._core import NamedArray, unchecked
from ..partitioning import check_mapping_values, mesh_axes_of, pspec_for


def current() -> FrozenMapping | None:
    """The parameter mapping ``nn.gather_per_use`` set, or None (GSPMD places the gathers)."""
    return weight_gather.value


@contextlib.contextmanager
def gather_per_use(param_mapping: Mapping[str, Any] | None) -> Iterator[None]:
    """Inside, every ``Linear`` whose weight ``param_mapping`` splits FSDP-style gathers it where
    it is used and reduce-scatters its gradient there (module docstring). None: as usual. Part
    of every jit's cache key, like the compute mapping."""
    if param_mapping is not None:
        if not isinstance(param_mapping, Mapping):
            raise ArgumentTypeError(
                f"nn.gather_per_use takes a parameter mapping (axis name -> mesh axes) or None, "
                f"got {type(param_mapping).__name__}"
            )
        check_mapping_values(param_mapping)
        param_mapping = FrozenMapping(param_mapping)
    with weight_gather(param_mapping):
        yield


def _plan(x: NamedArray, w: NamedArray, kept: list[str]):
    """(mesh, x spec, w spec, y spec over ``kept``, the weight's gathered dims, the mesh axes summed
    beyond them, the mesh axes each gathered dim is split over), or None where the rule does not apply."""
    params = current()
    compute, mesh = current_mapping(), current_mesh()
    if compute is None or mesh is None or current_body() is not None:
        return None
    if current_layer_driver() is not None:
        return None
    xs, ws = pspec_for(x, compute, mesh), pspec_for(w, params, mesh)
    x_mesh = {n: tuple(mesh_axes_of(e)) for n, e in zip(x.names, xs)}
    w_mesh = {n: tuple(mesh_axes_of(e)) for n, e in zip(w.names, ws)}
    gathered = [i for i, n in enumerate(w.names) if w_mesh[n]]
    if not gathered:
        return None
    used_by_x = {m for v in x_mesh.values() for m in v}
    for n in w.names:
        if x_mesh.get(n):  # an axis the activations split as well: tensor parallelism
            return None
        if w_mesh[n] and not set(w_mesh[n]) <= used_by_x:
            return None  # the shard's rows would not be this device's rows of the batch
    w_axes = {m for v in w_mesh.values() for m in v}
    extra = tuple(sorted(used_by_x - w_axes))  # data-parallel mesh axes: a plain sum
    ys = PartitionSpec(*(_entry(x_mesh.get(n, ())) for n in kept))
    return mesh, xs, ws, ys, gathered, extra, [tuple(w_mesh[w.names[i]]) for i in gathered]


def _entry(over: tuple[str, ...]):
    """One mesh axis as its name, several as a tuple, none as None (a PartitionSpec entry, or the
    axis_name of a collective)."""
    return None if not over else over[0] if len(over) == 1 else over


def gathered_dot(x: NamedArray, w: NamedArray, contract: tuple[str, ...]) -> NamedArray | None:
    """``nm.dot(x, w, axis=contract)`` with ``w`` gathered where it is used (module docstring),
    or None where the rule does not apply (the caller then computes it as usual)."""
    if current() is None:  # the usual case: one context read, nothing else
        return None
    kept = [n for n in x.names if n not in contract] + [n for n in w.names if n not in contract]
    plan = _plan(x, w, kept)
    if plan is None:
        return None
    mesh, xs, ws, ys, dims, extra, overs = plan
    letters = {n: chr(ord("a") + i) for i, n in enumerate(dict.fromkeys(x.names + w.names))}
    # The weight's gathered axes go in front before the gather (a gather along a minor axis
    # would make XLA copy the whole gathered weight into the layout the product wants).
    perm = dims + [i for i in range(len(w.names)) if i not in dims]
    w_front = [w.names[i] for i in perm]
    sx, sw, sy = ("".join(letters[n] for n in names) for names in (x.names, w_front, kept))
    fwd_eq, dx_eq, dw_eq = f"{sx},{sw}->{sy}", f"{sy},{sw}->{sx}", f"{sx},{sy}->{sw}"
    back = [perm.index(i) for i in range(len(perm))]

    def gather(shard, after):
        shard = _after(jnp.transpose(shard, perm), after)
        for d, over in enumerate(overs):
            shard = lax.all_gather(shard, _entry(over), axis=d, tiled=True)
        return shard

    def local_fwd(xb, wb):
        return jnp.einsum(fwd_eq, xb, gather(wb, xb))  # gathered once its input exists, dropped after

    def local_bwd(xb, wb, dy):
        dx = jnp.einsum(dx_eq, dy, gather(wb, dy)).astype(xb.dtype)  # gathered again, once dy exists
        # this device's rows only, a partial sum, made once dx is done and the gathered weight gone
        dw = jnp.einsum(dw_eq, _after(xb, dx), dy).astype(wb.dtype)
        for d, over in reversed(list(enumerate(overs))):
            dw = lax.psum_scatter(dw, _entry(over), scatter_dimension=d, tiled=True)
        if extra:
            dw = lax.psum(dw, _entry(extra))
        # the input's cotangent waits for the scattered gradient: the backward pass goes on to the
        # next weight only once this one's full-size gradient is gone (XLA had two at once)
        return _after(dx, dw), jnp.transpose(dw, back)

    fwd_map = _compat.shard_map(local_fwd, mesh=mesh, in_specs=(xs, ws), out_specs=ys, check_vma=False)
    bwd_map = _compat.shard_map(local_bwd, mesh=mesh, in_specs=(xs, ws, ys), out_specs=(xs, ws), check_vma=False)

    @jax.custom_vjp
    def product(xa, wa):
        return fwd_map(xa, wa)

    def fwd(xa, wa):
        return fwd_map(xa, wa), (xa, wa)

    def bwd(saved, dy):
        return bwd_map(*saved, dy)

    product.defvjp(fwd, bwd)
    out = product(x.array, w.array)
    sizes = {a.name: a for a in x.axes + w.axes}
    return unchecked(out, tuple(sizes[n] for n in kept))


def _after(w, dep):
    """``w``, made to depend on ``dep`` so that XLA cannot gather it before ``dep`` exists (and so
    hold every weight of a layer gathered at once). An optimization barrier does not do this on
    CPU: XLA:CPU expands barriers away before it schedules. Adding ``0 * (one entry of dep)``
    is a real data dependence XLA does not fold (``x * 0`` is not 0 for a float x that is NaN or
    infinite; then the product is NaN, as it is anyway once its input holds one)."""
    zero = lax.index_in_dim(dep.reshape(-1), 0, keepdims=False).astype(w.dtype) * 0
    return w + zero
