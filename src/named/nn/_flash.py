"""Blockwise ("flash") attention: an online softmax over key blocks with its own VJP.

The forward pass walks query blocks and, inside each, key blocks, keeping per query row the
running maximum ``m``, the running sum ``l`` of ``exp(score - m)`` and the running weighted
sum of values; only the output and ``(m, l)`` (the row's logsumexp in two parts) are saved. The
backward pass recomputes each block's scores from them and accumulates dQ, dK, dV (and the
bias' gradient), so no array of ``[query, key]`` size outlives one block.

It computes exactly what the XLA path does, in the same float32: ``softcap``, then ``bias``,
then masked scores set to ``finfo(float32).min`` (so a row whose keys are all masked gets the
mean of the values); keys added to pad the key axis to whole blocks get ``-inf`` and count for
nothing. Blocks that causality (and an int window) mask entirely are skipped when no row can be
masked entirely (no ``mask``, queries from position 0).

The raw kernel works on ``q [*B, *G, T, D]``, ``k [*B, S, D]``, ``v [*B, S, Dv]``: ``B`` the
axes the query shares with the key (batch, kv heads), ``G`` the query's own (the GQA group),
so each kv head serves its group without repeating K/V.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .._compat import is_tracer, varying_axes
from .._core import NamedArray, unchecked
from .._index import concrete
from .._shape import arange, rename
from ._masks import check_window

# Key/query block size: the largest divisor of the length in [BLOCK / 4, BLOCK], or BLOCK with
# the length padded to a multiple. 256 beat 512 on CPU at T = 512 to 2048 (smaller blocks skip
# more of the causal triangle; docs/benchmarks.md, "Blockwise attention on CPU").
BLOCK = 256
_NEG = float(jnp.finfo(jnp.float32).min)


def block_size(n: int) -> tuple[int, int]:
    """(block, padded length) for an axis of ``n`` positions."""
    target = BLOCK
    if n <= target:
        return n, n
    for b in range(target, max(2, target // 4) - 1, -1):
        if n % b == 0:
            return b, n
    return target, -(-n // target) * target


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the kernel needs to know statically (the jit cache key of one attention)."""

    T: int  # query positions, before padding
    S: int  # key positions, before padding
    bq: int
    bk: int
    Tp: int
    Sp: int
    scale: float
    softcap: float | None
    causal: bool
    offset: int | None  # the queries' static place among the keys (None: a traced one in aux)
    window: int | None  # a static sliding window (a traced one is in aux)
    skip: bool  # whether causally masked blocks may be skipped
    vary: frozenset = frozenset()  # inside shard_map: the mesh axes the inputs vary over

    def full(self, shape, fill, dtype):
        """A loop's starting value, of the inputs' type inside shard_map (a carry keeps its type)."""
        return _varying(jnp.full(shape, fill, dtype), self.vary)


def _varying(x, vary: frozenset):
    """``x`` typed as varying over ``vary`` (a relabelling inside shard_map; no data moves)."""
    missing = vary - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


@dataclasses.dataclass(frozen=True)
class _Aux:
    """The non-differentiable traced inputs (None where absent), laid out against the scores
    ``[*B, *G, T, S]`` with size-1 dimensions where they do not vary."""

    mask: jax.Array | None  # bool [.., T|1, S]
    qseg: jax.Array | None  # int [.., T]
    kseg: jax.Array | None  # int [.., S]
    qposn: jax.Array | None  # int [.., T]: each query's place among the keys
    window: jax.Array | None  # a traced window


jax.tree_util.register_dataclass(_Aux, data_fields=["mask", "qseg", "kseg", "qposn", "window"], meta_fields=[])


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _rows(x, start, size):
    """The rows of a ``[.., T|1, S]`` mask or bias for a query block (all of a size-1 one)."""
    return x if x.shape[-2] == 1 else _slice(x, start, size, -2)


def _block_scores(plan: _Plan, qi, kj, bias, aux: _Aux, i0, j0):
    """The float32 scores of query block ``i0`` against key block ``j0`` as the XLA path makes
    them (masked ones at finfo.min, padding keys at -inf), the validity mask, and the softcap's
    tanh (for the backward pass; None without softcap)."""
    nb = kj.ndim - 2
    ng = qi.ndim - 2 - nb
    kj = lax.expand_dims(kj, tuple(range(nb, nb + ng)))
    s = jnp.einsum("...td,...sd->...ts", qi, kj, preferred_element_type=jnp.float32)
    s = s.astype(jnp.float32) * jnp.float32(plan.scale)
    t = None
    if plan.softcap is not None:
        t = jnp.tanh(s / jnp.float32(plan.softcap))
        s = t * jnp.float32(plan.softcap)
    if bias is not None:
        s = s + _slice(_rows(bias, i0, plan.bq), j0, plan.bk, -1).astype(jnp.float32)
    kp = j0 + jnp.arange(plan.bk, dtype=jnp.int32)
    valid = None

    def both(a, b):
        return b if a is None else a & b

    if plan.causal:
        if aux.qposn is None:
            qp = (plan.offset + i0 + jnp.arange(plan.bq, dtype=jnp.int32))[:, None]
        else:
            qp = _slice(aux.qposn, i0, plan.bq, -1)[..., None]
        d = qp - kp
        valid = d >= 0
        w = plan.window if aux.window is None else aux.window
        if w is not None:
            valid = valid & (d < w)
    if aux.qseg is not None:
        same = _slice(aux.qseg, i0, plan.bq, -1)[..., :, None] == _slice(aux.kseg, j0, plan.bk, -1)[..., None, :]
        valid = both(valid, same)
    if aux.mask is not None:
        valid = both(valid, _slice(_rows(aux.mask, i0, plan.bq), j0, plan.bk, -1))
    if valid is not None:
        s = jnp.where(valid, s, jnp.float32(_NEG))
    if plan.Sp != plan.S:
        real = kp < plan.S
        s = jnp.where(real, s, -jnp.inf)
        valid = real if valid is None else valid & real
    return s, valid, t


def _key_blocks(plan: _Plan, i):
    """The key blocks query block ``i`` needs: [lo, hi)."""
    nk = plan.Sp // plan.bk
    if not plan.skip:
        return 0, nk
    hi = jnp.minimum(nk, ((i + 1) * plan.bq - 1) // plan.bk + 1)
    lo = 0 if plan.window is None else jnp.maximum(0, (i * plan.bq - plan.window + 1) // plan.bk)
    return lo, hi


def _query_blocks(plan: _Plan, j):
    """The query blocks that need key block ``j``: [lo, hi) (the inverse of ``_key_blocks``)."""
    nq = plan.Tp // plan.bq
    if not plan.skip:
        return 0, nq
    lo = (j * plan.bk) // plan.bq
    hi = nq if plan.window is None else jnp.minimum(nq, ((j + 1) * plan.bk + plan.window - 1 + plan.bq - 1) // plan.bq)
    return lo, hi


def _finite(m):
    """The running maximum to subtract: 0 where no finite score was seen (avoids inf - inf)."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _forward(plan: _Plan, q, k, v, bias, aux: _Aux):
    rows = q.shape[:-1]  # [*B, *G, Tp]
    out = plan.full(rows + (v.shape[-1],), 0, v.dtype)
    M = plan.full(rows, 0, jnp.float32)
    L = plan.full(rows, 0, jnp.float32)
    nb = k.ndim - 2
    ng = q.ndim - 2 - nb
    vexp = lax.expand_dims(v, tuple(range(nb, nb + ng)))

    def per_query_block(i, carry):
        out, M, L = carry
        i0 = i * plan.bq
        qi = _slice(q, i0, plan.bq, -2)

        def per_key_block(j, st):
            m, l, acc = st
            j0 = j * plan.bk
            s, _, _ = _block_scores(plan, qi, _slice(k, j0, plan.bk, -2), bias, aux, i0, j0)
            m_new = jnp.maximum(m, s.max(-1))
            base = _finite(m_new)
            p = jnp.exp(s - base[..., None])
            alpha = jnp.exp(m - base)
            vj = _slice(vexp, j0, plan.bk, -2)
            pv = jnp.einsum("...ts,...sd->...td", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

        init = (
            plan.full(qi.shape[:-1], -jnp.inf, jnp.float32),
            plan.full(qi.shape[:-1], 0, jnp.float32),
            plan.full(qi.shape[:-1] + (v.shape[-1],), 0, jnp.float32),
        )
        lo, hi = _key_blocks(plan, i)
        m, l, acc = lax.fori_loop(lo, hi, per_key_block, init)
        o = (acc / l[..., None]).astype(v.dtype)
        return (
            lax.dynamic_update_slice_in_dim(out, o, i0, axis=-2),
            lax.dynamic_update_slice_in_dim(M, m, i0, axis=-1),
            lax.dynamic_update_slice_in_dim(L, l, i0, axis=-1),
        )

    return lax.fori_loop(0, plan.Tp // plan.bq, per_query_block, (out, M, L))


def _reduce_to(x, shape):
    """Sum ``x`` over the dimensions where ``shape`` has 1 (a broadcast bias' gradient)."""
    axes = tuple(i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 and a != 1)
    return x.sum(axes, keepdims=True) if axes else x


def _add_at(acc, x, start, axis):
    size = x.shape[axis]
    return lax.dynamic_update_slice_in_dim(acc, _slice(acc, start, size, axis) + x, start, axis=axis)


def _backward(plan: _Plan, q, k, v, bias, aux: _Aux, out, M, L, dout):
    nb = k.ndim - 2
    ng = q.ndim - 2 - nb
    gdims = tuple(range(nb, nb + ng))
    delta = jnp.einsum("...d,...d->...", dout.astype(jnp.float32), out.astype(jnp.float32))
    base, inv_l = _finite(M), 1.0 / L
    dq = plan.full(q.shape, 0, jnp.float32)
    dk = plan.full(k.shape, 0, jnp.float32)
    dv = plan.full(v.shape, 0, jnp.float32)
    db = None if bias is None else plan.full(bias.shape, 0, jnp.float32)
    vexp = lax.expand_dims(v, gdims)
    kexp_all = lax.expand_dims(k, gdims)

    def per_key_block(j, carry):
        dq, dk, dv, db = carry
        j0 = j * plan.bk
        kj = _slice(k, j0, plan.bk, -2)
        vj = _slice(vexp, j0, plan.bk, -2)
        kje = _slice(kexp_all, j0, plan.bk, -2)

        def per_query_block(i, st):
            dq, dkj, dvj, db = st
            i0 = i * plan.bq
            qi = _slice(q, i0, plan.bq, -2)
            doi = _slice(dout, i0, plan.bq, -2)
            s, valid, t = _block_scores(plan, qi, kj, bias, aux, i0, j0)
            p = jnp.exp(s - _slice(base, i0, plan.bq, -1)[..., None]) * _slice(inv_l, i0, plan.bq, -1)[..., None]
            pv = jnp.einsum("...ts,...td->...sd", p.astype(dout.dtype), doi, preferred_element_type=jnp.float32)
            dvj = dvj + pv.sum(gdims)
            dp = jnp.einsum("...td,...sd->...ts", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - _slice(delta, i0, plan.bq, -1)[..., None])
            if valid is not None:
                ds = jnp.where(valid, ds, 0.0)
            if db is not None:
                whole = db.shape[-2] != 1  # else one row for every query
                g = _reduce_to(ds, db.shape[:-2] + ((plan.bq if whole else 1), plan.bk))
                start = i0 if whole else 0
                db = lax.dynamic_update_slice(
                    db,
                    lax.dynamic_slice(db, (0,) * (db.ndim - 2) + (start, j0), g.shape) + g,
                    (0,) * (db.ndim - 2) + (start, j0),
                )
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = ds * jnp.float32(plan.scale)
            dqi = jnp.einsum("...ts,...sd->...td", ds, kje.astype(jnp.float32))
            dkj = dkj + jnp.einsum("...ts,...td->...sd", ds, qi.astype(jnp.float32)).sum(gdims)
            return _add_at(dq, dqi, i0, -2), dkj, dvj, db

        init = (dq, plan.full(kj.shape, 0, jnp.float32), plan.full(kj.shape[:-1] + (v.shape[-1],), 0, jnp.float32), db)
        lo, hi = _query_blocks(plan, j)
        dq, dkj, dvj, db = lax.fori_loop(lo, hi, per_query_block, init)
        dk = lax.dynamic_update_slice_in_dim(dk, dkj, j0, axis=-2)
        dv = lax.dynamic_update_slice_in_dim(dv, dvj, j0, axis=-2)
        return dq, dk, dv, db

    dq, dk, dv, db = lax.fori_loop(0, plan.Sp // plan.bk, per_key_block, (dq, dk, dv, db))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None if db is None else db.astype(bias.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, q, k, v, bias, aux):
    return _forward(plan, q, k, v, bias, aux)[0]


def _attend_fwd(plan, q, k, v, bias, aux):
    out, M, L = _forward(plan, q, k, v, bias, aux)
    return out, (q, k, v, bias, aux, out, M, L)


def _attend_bwd(plan, res, dout):
    q, k, v, bias, aux, out, M, L = res
    dq, dk, dv, db = _backward(plan, q, k, v, bias, aux, out, M, L, dout)
    return dq, dk, dv, db, jax.tree.map(lambda _: None, aux)


_attend.defvjp(_attend_fwd, _attend_bwd)


# ---- the named wrapper ----------------------------------------------------------------------


def flash_unmet(query: NamedArray, key: NamedArray, value: NamedArray, kpos: str, hs: str, scale, softcap) -> list[str]:
    """Why the blockwise path cannot take these arguments (empty when it can)."""
    why = []
    extra = sorted({n for n in (*key.names, *value.names) if n not in query.names and n not in (kpos, hs)})
    if extra:
        why.append(f"key/value axes {extra} are not in the query")
    why += [f"the {what} is traced" for what, x in (("scale", scale), ("softcap", softcap)) if is_tracer(x)]
    return why


def flash_attention(
    query, key, value, qpos, kpos, hs, *, causal, mask, bias, segment_ids, q_offset, window, scale, softcap
):
    """``dot_product_attention``'s blockwise path on named inputs (after GQA's split of the
    heads): folds them to the kernel's layout and back."""
    shared = [n for n in query.names if n in key.names and n not in (hs, qpos, kpos)]
    q_only = [n for n in query.names if n not in key.names and n not in (qpos, hs)]
    lead = shared + q_only
    T, S = query.axis_size(qpos), key.axis_size(kpos)
    bq, Tp = block_size(T)
    bk, Sp = block_size(S)

    def lay(x, names):
        """A NamedArray over some of ``names`` as a raw array over all of them (1 where absent)."""
        present = [n for n in names if n in x.names]
        a = x.rearrange(tuple(present)).array
        return a.reshape(tuple(a.shape[present.index(n)] if n in present else 1 for n in names))

    def pad(a, axis, to, value=0):
        n = a.shape[axis]
        if n in (1, to):
            return a
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, to - n)
        return jnp.pad(a, widths, constant_values=value)

    q = pad(query.rearrange(tuple(lead + [qpos, hs])).array, -2, Tp)
    k = pad(key.rearrange(tuple(shared + [kpos, hs])).array, -2, Sp)
    v = pad(value.rearrange(tuple(shared + [kpos, hs])).array, -2, Sp)
    scores = lead + [qpos, kpos]
    b = None if bias is None else pad(pad(lay(bias, scores), -2, Tp), -1, Sp)
    m = None if mask is None else pad(pad(lay(mask, scores), -2, Tp, False), -1, Sp, False)
    qseg = kseg = qposn = None
    if segment_ids is not None:
        qseg = pad(lay(segment_ids, lead + [qpos]), -1, Tp)
        kseg = pad(lay(rename(segment_ids, {qpos: kpos}), lead + [kpos]), -1, Sp)
    offset = q_offset if isinstance(q_offset, int) and not isinstance(q_offset, bool) else None
    if causal and offset is None:
        positions = arange(query.resolve_axis(qpos)) + q_offset
        # padding queries continue the count (they are cut off again; any place is fine)
        qposn = pad(lay(positions, lead + [qpos]).astype(jnp.int32), -1, Tp)
        qposn = qposn if Tp == T else qposn.at[..., T:].set(qposn[..., T - 1 : T] + 1)
    static_window, traced_window = None, None
    if window is not None:
        w = check_window(window)
        known = concrete(w)
        if known is not None and known.ndim == 0:
            static_window = int(known)
        else:
            traced_window = jnp.asarray(w, jnp.int32)
    # Inside shard_map every input (and every loop carry) gets the type of the most varying one,
    # so that autodiff, not this VJP, sums the gradient of an input that the others outvary.
    arrays = [x for x in (q, k, v, b, m, qseg, kseg, qposn, traced_window) if x is not None]
    vary = frozenset().union(*(varying_axes(x) for x in arrays))
    q, k, v, b, m, qseg, kseg, qposn, traced_window = (
        None if x is None else _varying(x, vary) for x in (q, k, v, b, m, qseg, kseg, qposn, traced_window)
    )
    plan = _Plan(
        T=T,
        S=S,
        bq=bq,
        bk=bk,
        Tp=Tp,
        Sp=Sp,
        scale=1.0 / math.sqrt(query.axis_size(hs)) if scale is None else float(scale),
        softcap=None if softcap is None else float(softcap),
        causal=bool(causal),
        offset=offset,
        window=static_window,
        skip=bool(causal) and mask is None and offset == 0 and traced_window is None,
        vary=vary,
    )
    aux = _Aux(mask=m, qseg=qseg, kseg=kseg, qposn=qposn, window=traced_window)
    out = _attend(plan, q, k, v, b, aux)[..., :T, :]
    # the key's own axes where it has them: in explicit mode they carry the split of a kv head
    # (GQA's split of the query's heads does not)
    axes = tuple((key if n in key.names else query).resolve_axis(n) for n in lead + [qpos]) + (value.resolve_axis(hs),)
    return unchecked(out, axes).rearrange(query.names)
