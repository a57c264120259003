"""MoE: a sparse mixture of experts. A router scores every expert for each token and keeps the
top ``k``; each token's output is the weighted sum of its ``k`` experts (gated MLPs) plus, where
the family has one, a shared expert that every token goes through.

Axes (names; the token axes are every axis of the input but ``embed``, e.g. batch and position):

    experts   the experts; every expert weight carries it (``gate``, ``up``: experts embed mlp,
              ``down``: experts mlp embed), a Stacked of gated MLPs
    topk      the ``k`` experts chosen for a token (routing weights and expert ids)
    embed     the model width; ``mlp`` each expert's hidden units

Dispatch is dropless: a block of tokens is sorted by expert and run through grouped matmuls
(``jax.lax.ragged_dot``), so every token reaches every expert it chose and there is no capacity
factor. ``dispatch="dense"`` runs every expert on every token instead (the reference).

Expert parallelism is one line of the mapping: ``experts: <mesh axes>`` splits the experts over
those devices. Each block of tokens (one device's tokens) then sends each expert's rows to the
device holding it and receives the results back, two exchanges of a buffer ``(devices,
capacity, embed)``, where capacity is the block's ``tokens · k`` rows (the worst case: nothing is
dropped even if every token picks one device's experts). In explicit mode (``parallel="explicit"``)
the block code runs under ``nm.shard_map`` and the exchange is ``nm.all_to_all``; in auto mode
the same block code is vmapped over the blocks and the exchange is a change of sharding
constraint that GSPMD lowers to an all-to-all. Both give the numbers of one device.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .. import _ops as ops
from .. import partitioning
from .._axis import ArgumentError, Axis, AxisError, as_selectors, format_axes
from .._context import current_body, current_mapping, current_mesh
from .._core import NamedArray, expect_named, unchecked
from .._einsum import dot
from .._local import ShardedAxis, issue, split_over
from .._shape import one_hot
from ..explicit import all_gather, all_to_all, axis_index, psum, shard_map
from ..partitioning import mesh_axes_of, shard
from ._basic import MLP
from ._basic import activation as _activation
from ._linear import Linear
from ._stacked import Stacked

EXPERTS, TOPK = "experts", "topk"
ROUTINGS = ("softmax_topk", "topk_softmax")
DISPATCHES = ("dropless", "dense")
PARALLEL = ("auto", "explicit")


# ---- routing and its losses ---------------------------------------------------------------------


def route(logits: NamedArray, k: int, *, routing: str = "softmax_topk", normalize: bool = True):
    """``(weights, ids, probs)``: the top ``k`` experts of each token (``ids``, axis ``topk``),
    their weights, and every expert's softmax probability (axis ``experts``), all float32.

    ``softmax_topk`` (Mixtral, Qwen-MoE): softmax over all experts, then the ``k`` largest,
    renormalised to sum to 1 when ``normalize``. ``topk_softmax``: the ``k`` largest logits,
    softmax over those (the same numbers as ``softmax_topk`` with ``normalize``).
    """
    if routing not in ROUTINGS:
        raise ArgumentError(f"routing={routing!r} is not one of {', '.join(ROUTINGS)}")
    n = expect_named(logits, "nn.route", "logits").axis_size(EXPERTS)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ArgumentError(
            f"nn.route: k={k!r} experts per token; k must be an int in [1, {n}], the size of {EXPERTS!r}"
        )
    logits = logits.astype(jnp.float32)  # routing decisions in full precision: bf16 ties flip experts
    probs = ops.softmax(logits, EXPERTS)
    if routing == "topk_softmax":
        top, ids = _top_k(logits, k)
        return ops.softmax(top, TOPK), ids, probs
    weights, ids = _top_k(probs, k)
    if normalize:
        weights = weights / weights.sum(TOPK)
    return weights, ids, probs


def _top_k(x: NamedArray, k: int) -> tuple[NamedArray, NamedArray]:
    """The ``k`` largest along ``experts`` (the lower index first among equals, as ``lax.top_k``),
    by a stable sort: XLA does not split ``lax.top_k`` over the token axes, and GSPMD would
    gather every device's router logits for it."""
    arr = x.rearrange((..., EXPERTS)).array
    ids = jnp.argsort(-arr, axis=-1, stable=True)[..., :k]
    axes = x.rearrange((..., EXPERTS)).axes[:-1] + (Axis(TOPK, k),)
    return unchecked(jnp.take_along_axis(arr, ids, -1), axes), unchecked(ids, axes)


def router_stats(logits: NamedArray, probs: NamedArray, ids: NamedArray) -> dict[str, NamedArray]:
    """A router's statistics over the tokens, each a mean over them (and, on local blocks, over
    every device's tokens): ``expert_share`` (``experts``: the tokens sent to each expert over
    the number of tokens, so it sums to ``k``), ``expert_probability`` (``experts``: the mean
    router probability) and ``router_z`` (the mean of ``logsumexp(logits)²``).

    The losses are functions of these means (:func:`router_losses`). Kept apart, the statistics
    of equal parts of a batch average to the whole batch's, which the losses do not: explicit
    mode's batch split relies on it."""
    expect_named(logits, "nn.router_stats", "logits")
    share, probability = _load(probs, ids)
    return {"expert_share": share, "expert_probability": probability, "router_z": _mean_z(logits)}


def router_losses(stats: dict[str, NamedArray]) -> dict[str, jax.Array]:
    """``load_balancing`` (:func:`load_balancing_loss`) and ``router_z`` (:func:`router_z_loss`)
    from :func:`router_stats`, as raw arrays. Statistics stacked over layers give one value per layer."""
    missing = [k for k in ("expert_share", "expert_probability", "router_z") if k not in stats]
    if missing:
        raise ArgumentError(
            f"nn.router_losses needs nn.router_stats' statistics; {missing} missing from {sorted(stats)}"
        )
    return {
        "load_balancing": _balance(stats["expert_share"], stats["expert_probability"]).array,
        "router_z": stats["router_z"].array,
    }


def load_balancing_loss(probs: NamedArray, ids: NamedArray) -> jax.Array:
    """Switch Transformer's auxiliary loss, ``E · Σ_e f_e · P_e``: ``f_e`` the tokens sent to
    expert ``e`` over the number of tokens (so ``Σ f = k``), ``P_e`` its mean router probability.
    ``k`` when the load is even, larger as it gathers on few experts (Hugging Face's
    ``load_balancing_loss_func`` for one layer)."""
    return _balance(*_load(probs, ids)).scalar()


def router_z_loss(logits: NamedArray) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)²`` (keeps the logits small)."""
    return _mean_z(logits).scalar()


def _load(probs: NamedArray, ids: NamedArray) -> tuple[NamedArray, NamedArray]:
    """``(f, P)`` over ``experts``: the share of tokens each expert gets and its mean probability."""
    Experts = expect_named(probs, "the router's probs").resolve_axis(EXPERTS)
    expect_named(ids, "the router's ids")
    tokens = tuple(n for n in probs.names if n != EXPERTS)
    return _token_mean(one_hot(ids, Experts).sum(TOPK), tokens), _token_mean(probs, tokens)


def _balance(f: NamedArray, p: NamedArray) -> NamedArray:
    return f.resolve_axis(EXPERTS).size * (f * p).sum(EXPERTS)


def _mean_z(logits: NamedArray) -> NamedArray:
    expect_named(logits, "nn.router_z_loss", "logits")
    lse = ops.logsumexp(logits.astype(jnp.float32), EXPERTS)
    return _token_mean(ops.square(lse), lse.names)


def _token_mean(x: NamedArray, tokens: tuple[str, ...]) -> NamedArray:
    """The mean over ``tokens``; on local blocks (explicit mode) over every device's tokens, so a
    router's statistics, and the losses made of them, are the whole batch's as in auto mode."""
    m = x.mean(tokens)
    over = tuple(dict.fromkeys(a for n in tokens for a in split_over(x.resolve_axis(n))))
    if not over:
        return m
    return unchecked(issue(jax.lax.pmean, m.array, over[0] if len(over) == 1 else over), m.axes)


# ---- the layer ------------------------------------------------------------------------------------


class MoE(eqx.Module):
    """A mixture of gated-MLP experts with a top-k router; ``__call__`` returns ``(y, losses)``.

    ``losses`` holds this layer's ``load_balancing`` and ``router_z`` losses (unweighted
    scalars); a model weights them and adds them to its training loss.
    """

    router: Linear  # embed -> experts (Hugging Face's "gate")
    experts: Stacked[MLP]  # over experts: down(act(gate(x)) * up(x)), embed -> mlp -> embed
    shared_expert: MLP | None  # every token, beside its routed experts
    shared_expert_gate: Linear | None  # embed -> (): sigmoid of it scales the shared expert (Qwen2-MoE)
    top_k: int = eqx.field(static=True)
    routing: str = eqx.field(static=True, default="softmax_topk")
    normalize: bool = eqx.field(static=True, default=True)
    dispatch: str = eqx.field(static=True, default="dropless")
    parallel: str = eqx.field(static=True, default="auto")
    ROUTINGS: ClassVar[tuple[str, ...]] = ROUTINGS
    DISPATCHES: ClassVar[tuple[str, ...]] = DISPATCHES
    PARALLEL: ClassVar[tuple[str, ...]] = PARALLEL

    def __check_init__(self):
        if self.routing not in ROUTINGS:
            raise ArgumentError(f"MoE: routing={self.routing!r} is not one of {', '.join(ROUTINGS)}")
        if self.dispatch not in DISPATCHES:
            raise ArgumentError(f"MoE: dispatch={self.dispatch!r} is not one of {', '.join(DISPATCHES)}")
        if self.parallel not in PARALLEL:
            raise ArgumentError(f"MoE: parallel={self.parallel!r} is not one of {', '.join(PARALLEL)}")
        n = self.experts.Layers.size
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= n:
            raise ArgumentError(f"MoE: top_k={self.top_k!r} must be an int in [1, {n}] (the number of experts)")

    @staticmethod
    def init(
        Embed: Axis,
        Mlp: Axis,
        Experts: Axis,
        top_k: int,
        *,
        key,
        activation: str = "silu",
        routing: str = "softmax_topk",
        normalize: bool = True,
        shared_mlp: Axis | None = None,
        shared_gate: bool = False,
        dispatch: str = "dropless",
        parallel: str = "auto",
        dtype=jnp.float32,
    ) -> MoE:
        """``Experts.size`` gated MLPs ``Embed -> Mlp -> Embed`` and a router ``Embed -> Experts``.

        Args:
            top_k: experts per token.
            routing, normalize: see :func:`route`.
            shared_mlp: the hidden axis of a shared expert (Qwen2-MoE, DeepSeek); None: none.
            shared_gate: scale the shared expert by ``sigmoid(Linear(embed -> ()))`` (Qwen2-MoE).
            dispatch: ``dropless`` (sorted tokens, grouped matmuls) or ``dense`` (every expert on
                every token: the reference; the same numbers).
            parallel: how experts split over devices travel: ``auto`` (GSPMD) or ``explicit``
                (``nm.shard_map`` with ``nm.all_to_all``).
        """
        if Experts.name != EXPERTS:
            raise AxisError(f"MoE: the experts axis must be called {EXPERTS!r}, got {Experts.name!r}")
        _activation(activation)
        k_router, k_experts, k_shared, k_gate = jax.random.split(key, 4)
        router = Linear.init(Embed, Experts, key=k_router, use_bias=False, dtype=dtype)
        experts = Stacked.init(
            Experts, MLP.init, Embed, Mlp, key=k_experts, activation=activation, gated=True, use_bias=False, dtype=dtype
        )
        shared = gate = None
        if shared_mlp is not None:
            shared = MLP.init(
                Embed, shared_mlp, key=k_shared, activation=activation, gated=True, use_bias=False, dtype=dtype
            )
            if shared_gate:
                gate = Linear.init(Embed, (), key=k_gate, use_bias=False, dtype=dtype)
        elif shared_gate:
            raise ArgumentError("MoE: shared_gate=True needs a shared expert (shared_mlp=)")
        return MoE(router, experts, shared, gate, top_k, routing, normalize, dispatch, parallel)

    @property
    def Experts(self) -> Axis:
        return self.experts.Layers

    def __call__(self, x: NamedArray, *, key=None) -> tuple[NamedArray, dict[str, jax.Array]]:
        y, stats = self.with_stats(x, key=key)
        return y, router_losses(stats)

    def with_stats(self, x: NamedArray, *, key=None) -> tuple[NamedArray, dict[str, NamedArray]]:
        """``(y, stats)``: the output and the router's :func:`router_stats`, from which
        :func:`router_losses` makes the losses ``__call__`` returns (a model that stacks layers
        can return the statistics per layer and make the losses after the stack)."""
        x = expect_named(x, "MoE").astype(ops.floating(x.dtype))  # an int input is routed as floats, not truncated
        # not self.router(x): its output constraint would fail under expert parallelism, where
        # the compute mapping gives batch and experts one mesh axis (tokens and experts both split)
        router = self.router.weight
        if split_over(router.resolve_axis(EXPERTS)):  # on local blocks: every token scores every expert
            router = all_gather(router, EXPERTS)
        logits = dot(x, router, axis=tuple(a.name for a in as_selectors(self.router.In)))
        weights, ids, probs = route(logits, self.top_k, routing=self.routing, normalize=self.normalize)
        stats = router_stats(logits, probs, ids)
        y = self.dense(x, ids, weights) if self.dispatch == "dense" else self.dropless(x, ids, weights)
        if self.shared_expert is not None:
            s = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                s = s * ops.sigmoid(self.shared_expert_gate(x))
            y = y + s
        return shard(y), stats

    # -- the two dispatches --------------------------------------------------------------------------

    def dense(self, x: NamedArray, ids: NamedArray, weights: NamedArray) -> NamedArray:
        """Every expert on every token, summed with the routing weights (zero for experts not chosen)."""
        every = self.experts.vmap(x)  # (experts, *tokens, embed)
        combine = (one_hot(ids, self.Experts) * weights).sum(TOPK)
        return dot(combine, every.astype(jnp.float32), axis=EXPERTS).astype(x.dtype)

    def dropless(self, x: NamedArray, ids: NamedArray, weights: NamedArray) -> NamedArray:
        """Each token through exactly its ``k`` experts: sorted by expert, grouped matmuls, and
        all-to-alls where the mapping splits ``experts`` over devices."""
        e = self.experts.compute_stacked()
        Embed = as_selectors(e.down.Out)[0]
        ws = (e.gate.weight, e.up.weight, e.down.weight)
        names = _Names(
            Embed.name, as_selectors(e.up.Out)[0].name, tuple(a.name for a in x.axes if a.name != Embed.name)
        )
        block = functools.partial(_block, names=names, n_experts=self.Experts.size, act=e.act)
        if current_body() is not None:  # already per device (a caller's nm.shard_map): the blocks say the split
            return block(x, ids, weights, *ws)
        mapping, mesh = current_mapping(), current_mesh()
        if not mapping or mesh is None:
            return block(x, ids, weights, *ws)
        if self.parallel == "explicit":
            return shard_map(block, in_mapping=mapping)(x, ids, weights, *ws)
        return _auto(x, ids, weights, ws, names, self.Experts.size, e.act, mapping, mesh)


# ---- one block of tokens: pack, exchange, compute, exchange back, combine ------------------------------
# Raw arrays inside: ``x`` (T, D) the block's tokens, ``ids`` / ``w`` (T, k). ``n_dst`` devices
# hold ``E_l`` experts each (expert e lives on device e // E_l). The buffers are (n_dst, C, ...)
# with C = T * k rows per device: the worst case, so nothing is ever dropped.


class _Names:
    def __init__(self, embed: str, mlp: str, tokens: tuple[str, ...]):
        self.embed, self.mlp, self.tokens = embed, mlp, tokens


def _pack(x, ids, n_dst: int, E_l: int):
    """Each device's rows, sorted by expert: ``send`` (n_dst, C, D), their local expert ids
    ``send_ids`` (n_dst, C) with ``E_l`` marking padding, and where each assignment went."""
    T, k = ids.shape
    C = T * k
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(C, dtype=order.dtype), unique_indices=True)
    dst = flat // E_l  # each assignment's device
    counts = jnp.zeros((n_dst,), jnp.int32).at[dst].add(1)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(C)
    src = jnp.clip(starts[:, None] + slot[None, :], 0, C - 1)  # sorted position of each buffer slot
    valid = slot[None, :] < counts[:, None]
    assignment = order[src]  # the (token, choice) in each slot
    send = jnp.where(valid[..., None], x[assignment // k], 0)
    send_ids = jnp.where(valid, flat[assignment] % E_l, E_l)
    pos = rank - starts[dst]  # each assignment's slot in its device's buffer
    return send, send_ids, (dst, pos)


def _grouped_mlp(rows, ids, gate, up, down, act, *, presorted: bool):
    """``down(act(rows · gate) * (rows · up))`` with each row's expert by ``ids`` (``E_l`` = none),
    as three ``ragged_dot`` over the rows sorted by expert; rows in their given order."""
    E_l = gate.shape[0]
    if presorted:  # one device, every slot real: already sorted, no padding
        order = None
        xs = rows
    else:
        order = jnp.argsort(ids, stable=True)
        xs = rows[order]
    sizes = jnp.zeros((E_l + 1,), jnp.int32).at[ids].add(1)[:E_l]
    # rows past the last group (padding) are left out of every group; ragged_dot need not zero them
    live = (jnp.arange(xs.shape[0]) < sizes.sum())[:, None]
    g = jnp.where(live, jax.lax.ragged_dot(xs, gate, sizes), 0)
    u = jnp.where(live, jax.lax.ragged_dot(xs, up, sizes), 0)
    h = _activation(act)(unchecked(g, (Axis("rows", g.shape[0]), Axis("mlp", g.shape[1])))).array * u
    out = jnp.where(live, jax.lax.ragged_dot(h.astype(rows.dtype), down, sizes), 0)
    if order is None:
        return out
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
    return out[inverse]


def _combine(back, w, dst, pos):
    """Each token's ``Σ_k w_k · out_k`` from the returned buffers ``back`` (n_dst, C, D)."""
    T, k = w.shape
    out = back[dst, pos].reshape(T, k, back.shape[-1])  # not -1: a block of no tokens has nothing to infer it from
    return jnp.einsum("tk,tkd->td", w, out.astype(jnp.float32)).astype(back.dtype)


def _block(
    x: NamedArray,
    ids: NamedArray,
    w: NamedArray,
    gate: NamedArray,
    up: NamedArray,
    down: NamedArray,
    *,
    names: _Names,
    n_experts: int,
    act,
) -> NamedArray:
    """One block of tokens through their experts. Outside ``nm.shard_map`` the block is every
    token and every expert; inside, the experts axis of the weight blocks says which mesh axes
    split it (then rows travel by ``nm.all_to_all``), and a split ``mlp`` (TP) is summed by ``psum``."""
    D = x.axis_size(names.embed)
    xa = x.rearrange((*names.tokens, names.embed)).array.reshape(-1, D)
    k = ids.axis_size(TOPK)  # not -1: a block of no tokens has no size to infer it from
    ida = ids.rearrange((*names.tokens, TOPK)).array.reshape(xa.shape[0], k)
    wa = w.rearrange((*names.tokens, TOPK)).array.reshape(xa.shape[0], k)
    g = gate.rearrange((EXPERTS, names.embed, names.mlp))
    E_l = g.axis_size(EXPERTS)
    over = split_over(g.resolve_axis(EXPERTS))
    n_dst = n_experts // E_l
    # Tokens that are whole across some expert mesh axes (the same on each of those devices):
    # each device takes its share of them, and the results are gathered at the end.
    split_tokens = {m for n in names.tokens for m in split_over(x.resolve_axis(n))}
    copies = tuple(m for m in over if m not in split_tokens)
    T = xa.shape[0]
    if copies:
        n = math.prod(current_body().mesh.shape[m] for m in copies)
        if T % n:
            raise ArgumentError(
                f"MoE: a block of {T} tokens ({format_axes(x.axes)}) does not split over mesh axes "
                f"{copies} ({n} devices) of the experts that split no token axis"
            )
        start = axis_index(mesh_axes=copies) * (T // n)
        xa, ida, wa = (jax.lax.dynamic_slice_in_dim(a, start, T // n) for a in (xa, ida, wa))
    send, send_ids, (dst, pos) = _pack(xa, ida, n_dst, E_l)
    weights = (
        g.array,
        up.rearrange((EXPERTS, names.embed, names.mlp)).array,
        down.rearrange((EXPERTS, names.mlp, names.embed)).array,
    )
    if n_dst == 1:
        out = _grouped_mlp(send[0], send_ids[0], *weights, act, presorted=True)[None]
    else:
        exchange = functools.partial(_all_to_all, over=over)
        recv, recv_ids = exchange(send), exchange(send_ids)
        out = _grouped_mlp(recv.reshape(-1, D), recv_ids.reshape(-1), *weights, act, presorted=False)
        out = exchange(out.reshape(recv.shape))
    tp = split_over(down.resolve_axis(names.mlp))
    if tp:  # each device holds a slice of every expert's mlp: its down projection is a partial sum
        out = psum(unchecked(out, _raw_axes(out.shape)), mesh_axes=tp).array
    y = _combine(out, wa, dst, pos)
    if copies:
        rows = ShardedAxis("moe_rows", y.shape[0], copies)
        y = all_gather(unchecked(y, (rows, Axis("moe_embed", D))), "moe_rows", invariant=True).array
    y = y.reshape(tuple(x.axis_size(n) for n in names.tokens) + (D,))
    return unchecked(y, tuple(x.resolve_axis(n) for n in (*names.tokens, names.embed))).rearrange(x.axes)


def _raw_axes(shape) -> tuple[Axis, ...]:
    return tuple(Axis(f"moe_dim{i}", n) for i, n in enumerate(shape))


def _all_to_all(a, *, over):
    """Slice ``d`` of ``a`` (n, ...) to device ``d`` along ``over``; slice ``s`` of the result came
    from device ``s``."""
    n = a.shape[0]
    named = unchecked(a[None], (Axis("moe_src", 1), Axis("moe_dst", n)) + _raw_axes(a.shape[1:]))
    return all_to_all(named, split="moe_dst", concat="moe_src", mesh_axes=over).array[:, 0]


# ---- auto mode: the blocks as an array axis, the exchange as a change of layout -----------------------


def _auto(x, ids, w, weights, names: _Names, n_experts: int, act, mapping, mesh) -> NamedArray:
    """The block code vmapped over every device's block of tokens. A token axis split over mesh
    axes ``(m1, m2)`` is cut into ``(|m1|, |m2|, rest)``; those pieces (and the expert mesh axes
    that split no token axis, as copies) make the block axis, laid out over the same mesh axes,
    so every step of a block stays on its device; the exchanges are GSPMD's all-to-alls."""
    expert_axes = mesh_axes_of(mapping.get(EXPERTS))
    token_axes = [(x.resolve_axis(n), mesh_axes_of(mapping.get(n))) for n in names.tokens]
    split_tokens = [m for _, ms in token_axes for m in ms]
    copies = [m for m in expert_axes if m not in split_tokens]
    canon = split_tokens + copies
    size = dict(mesh.shape)
    n_blocks = math.prod(size[m] for m in canon)
    n_dst = math.prod(size[m] for m in expert_axes)
    E_l = n_experts // n_dst
    blocks_spec = tuple(canon) if canon else None
    lead = math.prod(size[m] for m in split_tokens)  # blocks of distinct tokens; the rest are copies
    # the token axes cut into their mesh pieces and the rest: where each piece lies in that shape
    shape, block_dims, local_dims = [], [], []
    for a, ms in token_axes:
        for m in ms:
            block_dims.append(len(shape))
            shape.append(size[m])
        local_dims.append(len(shape))
        shape.append(a.size // math.prod(size[m] for m in ms))
    order = block_dims + local_dims

    def constrain(a, *spec):
        return partitioning.constrain(a, mesh, PartitionSpec(*spec))

    def to_blocks(arr_named: NamedArray, last: str):
        """(*tokens, last) -> (blocks, tokens per block, last)."""
        arr = arr_named.rearrange((*names.tokens, last)).array
        arr = arr.reshape(*shape, arr.shape[-1]).transpose(*order, len(shape))
        arr = arr.reshape(lead, 1, -1, arr.shape[-1])
        arr = jnp.broadcast_to(arr, (lead, n_blocks // lead) + arr.shape[2:]).reshape(n_blocks, -1, arr.shape[-1])
        return constrain(arr, blocks_spec)

    def from_blocks(arr, template: NamedArray):
        arr = arr.reshape(lead, n_blocks // lead, *arr.shape[1:])[:, 0]  # the copies are equal: keep one
        arr = arr.reshape(*(shape[i] for i in order), arr.shape[-1])
        arr = arr.transpose(*(order.index(i) for i in range(len(shape))), len(shape))
        arr = arr.reshape(*(a.size for a, _ in token_axes), arr.shape[-1])
        axes = tuple(template.resolve_axis(n) for n in names.tokens) + (template.resolve_axis(names.embed),)
        return unchecked(arr, axes).rearrange(template.axes)

    def exchange(a):
        """(blocks, n_dst, ...): the expert mesh axes move from the blocks (sources) to n_dst."""
        if n_dst == 1:
            return a
        rest = a.shape[2:]
        a = a.reshape(*(size[m] for m in canon), *(size[m] for m in expert_axes), *rest)
        src_spec = list(canon) + [None] * (len(expert_axes) + len(rest))
        dst_spec = [None if m in expert_axes else m for m in canon] + list(expert_axes) + [None] * len(rest)
        a = constrain(constrain(a, *src_spec), *dst_spec)  # GSPMD's all-to-all
        perm = list(range(a.ndim))
        for j, m in enumerate(expert_axes):
            i, d = canon.index(m), len(canon) + j
            perm[i], perm[d] = perm[d], perm[i]
        a = a.transpose(perm)
        return constrain(a.reshape(n_blocks, n_dst, *rest), blocks_spec)

    def expert_blocks(weight: NamedArray, order: tuple[str, str, str]):
        """Each block's experts: device d's ``E_l`` experts for the blocks on d, copied along the rest."""
        arr = weight.rearrange(order).array
        arr = arr.reshape(*(size[m] for m in expert_axes), E_l, *arr.shape[1:])
        # the expert mesh axes in canonical order, size-1 axes for the others, then broadcast
        arr = arr.transpose(
            *sorted(range(len(expert_axes)), key=lambda j: canon.index(expert_axes[j])),
            *range(len(expert_axes), arr.ndim),
        )
        shape = [size[m] if m in expert_axes else 1 for m in canon]
        arr = arr.reshape(*shape, *arr.shape[len(expert_axes) :])
        arr = jnp.broadcast_to(arr, tuple(size[m] for m in canon) + arr.shape[len(canon) :])
        arr = arr.reshape(n_blocks, *arr.shape[len(canon) :])
        inner = [_free(mapping.get(n), canon) for n in order[1:]]
        return constrain(arr, blocks_spec, None, *inner)

    gate, up, down = weights
    xb, ib, wb = to_blocks(x, names.embed), to_blocks(ids, TOPK), to_blocks(w, TOPK)
    send, send_ids, (dst, pos) = jax.vmap(lambda a, b: _pack(a, b, n_dst, E_l))(xb, ib)
    g = expert_blocks(gate, (EXPERTS, names.embed, names.mlp))
    u = expert_blocks(up, (EXPERTS, names.embed, names.mlp))
    d = expert_blocks(down, (EXPERTS, names.mlp, names.embed))
    recv, recv_ids = exchange(send), exchange(send_ids)
    D = recv.shape[-1]
    mlp = jax.vmap(
        lambda r, i, a, b, c: _grouped_mlp(r.reshape(-1, D), i.reshape(-1), a, b, c, act, presorted=n_dst == 1).reshape(
            r.shape
        )
    )
    out = exchange(mlp(recv, recv_ids, g, u, d))
    y = jax.vmap(_combine)(out, wb, dst, pos)
    return shard(from_blocks(y, x), mapping, mesh)


def _free(entry, taken) -> str | tuple[str, ...] | None:
    """A weight axis' mesh axes under the mapping, less those the blocks already use."""
    left = tuple(m for m in mesh_axes_of(entry) if m not in taken)
    return left if left else None


__all__ = ["MoE", "load_balancing_loss", "route", "router_losses", "router_stats", "router_z_loss"]
