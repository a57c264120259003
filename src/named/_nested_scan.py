"""Nested ("every k steps") checkpointing of a scan, with its own backward pass.

``nested_scan(step, init, xs, n, k)`` runs ``step(carry, x_slices) -> (carry, ys)`` over the
``n`` leading entries of ``xs`` and keeps only every ``k``-th carry for the backward pass. The
backward pass walks the groups from the last: it re-runs a group's ``k`` steps from its kept
carry (keeping their ``k`` inputs), then takes each step's VJP in reverse (which re-runs that
step once more, as full rematerialisation does). Every step reads its slice of ``xs`` at its own
index and writes its slice's gradient into the stacked gradient at that index, so nothing the
size of a group of slices is ever copied: a scan over groups of ``k`` (``xs`` reshaped
``[n/k, k, ...]``) slices a group's weights out and builds a group's weight gradients
before writing them back, ``2·k`` layers' worth of FSDP shards that outweigh the saved
layer inputs (docs/benchmarks.md section 4).

The kept state is ``n/k + k`` carries instead of ``n``: with ``k`` near ``sqrt(n)``, about
``2·sqrt(n)``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ._axis import NamedError


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def differentiable(tree) -> bool:
    """Whether every leaf of ``tree`` is a float (this backward pass differentiates all of them)."""
    return all(_inexact(x) for x in jax.tree.leaves(tree))


def _index(i, n: int, reverse: bool):
    return n - 1 - i if reverse else i


def _at(xs, i):
    return [lax.dynamic_index_in_dim(a, i, keepdims=False) for a in xs]


def nested_scan(step: Callable, init, xs: list, n: int, k: int, *, reverse: bool = False):
    """``lax.scan(step, init, xs, length=n, reverse=reverse)`` keeping every ``k``-th carry
    (``k`` divides ``n``). Returns the last carry and the stacked outputs, ``ys[i]`` made at
    ``xs[i]``; or None where the carry or an output is not a float (this backward pass
    differentiates all of them; the caller then scans groups whole)."""
    if k < 2 or n % k:
        raise NamedError(f"nested_scan keeps every k-th of n carries: k={k} must be at least 2 and divide n={n}")
    example = (init, _at(xs, 0))
    fn, consts = jax.closure_convert(lambda c, x: step(c, x), *example)
    if not differentiable(jax.eval_shape(fn, *example, *consts)):
        return None
    groups = n // k

    def run(consts, init, xs):
        def group(c, g):
            def one(c, j):
                return fn(c, _at(xs, _index(g * k + j, n, reverse)), *consts)

            end, ys = lax.scan(one, c, jnp.arange(k))
            return end, (c, ys)

        carry, (kept, ys) = lax.scan(group, init, jnp.arange(groups))
        ys = [y.reshape((n, *y.shape[2:])) for y in ys]
        return carry, [y[::-1] for y in ys] if reverse else ys, kept

    @jax.custom_vjp
    def scanned(consts, init, xs):
        carry, ys, _ = run(consts, init, xs)
        return carry, ys

    def fwd(consts, init, xs):
        carry, ys, kept = run(consts, init, xs)
        return (carry, ys), (consts, kept, xs)

    def bwd(res, cts):
        consts, kept, xs = res
        ct_carry, ct_ys = cts
        wants = [_inexact(a) for a in xs]
        c_wants = [_inexact(c) for c in consts]

        def pull(c, i, ct_c, ct_x_acc, ct_consts):
            x = _at(xs, i)

            def f(cs, c, xf):
                it = iter(xf)
                full = [next(it) if w else a for a, w in zip(x, wants)]
                it = iter(cs)
                every = [next(it) if w else a for a, w in zip(consts, c_wants)]
                return fn(c, full, *every)

            cs = [a for a, w in zip(consts, c_wants) if w]
            _, vjp = jax.vjp(f, cs, c, [a for a, w in zip(x, wants) if w])
            d_cs, d_c, d_x = vjp((ct_c, [lax.dynamic_index_in_dim(y, i, keepdims=False) for y in ct_ys]))
            it = iter(d_x)
            ct_x_acc = [
                lax.dynamic_update_index_in_dim(acc, next(it).astype(acc.dtype), i, 0) if w else acc
                for acc, w in zip(ct_x_acc, wants)
            ]
            return d_c, ct_x_acc, [a + b for a, b in zip(ct_consts, d_cs)]

        def group(state, g):
            ct_c, ct_x, ct_cs = state
            start = jax.tree.map(lambda a: a[g], kept)

            def again(c, j):
                return fn(c, _at(xs, _index(g * k + j, n, reverse)), *consts)[0], c

            _, inputs = lax.scan(again, start, jnp.arange(k))

            def back(state, j):
                ct_c, ct_x, ct_cs = state
                c = jax.tree.map(lambda a: a[j], inputs)
                return pull(c, _index(g * k + j, n, reverse), ct_c, ct_x, ct_cs), None

            state, _ = lax.scan(back, (ct_c, ct_x, ct_cs), jnp.arange(k), reverse=True)
            return state, None

        zeros_x = [jnp.zeros_like(a) if w else None for a, w in zip(xs, wants)]
        zeros_cs = [jnp.zeros_like(a) for a, w in zip(consts, c_wants) if w]
        (ct_init, ct_x, ct_cs), _ = lax.scan(group, (ct_carry, zeros_x, zeros_cs), jnp.arange(groups), reverse=True)
        it = iter(ct_cs)
        return [next(it) if w else None for w in c_wants], ct_init, ct_x

    scanned.defvjp(fwd, bwd)
    return scanned(list(consts), init, list(xs))
