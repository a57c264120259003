"""The per-token cross-entropy of ``hidden · weight`` fused into one pass over vocabulary blocks,
with a gradient rule of its own (``nn.blockwise_cross_entropy_loss`` calls it).

Forward: each block's logits are made, folded into a running log-sum-exp (max and rescaled sum)
and searched for the target's logit, then dropped; the log-sum-exp of every token is the only
thing kept for the backward pass. Backward (``jax.custom_vjp``): each block's logits are made
again from the same weight, turned into ``d loss / d logits`` with that log-sum-exp, and
multiplied into the hidden states' gradient (summed over blocks) and the block's columns of the
weight's gradient. Neither pass holds more than ``tokens × block`` logits.

The weight is used as ``[embed, vocab]`` (a device's slice turned so before any gather, so that
gathering along ``embed`` concatenates whole rows and needs no copy after it), each block a slice
of its columns. It runs per
device (``nm.shard_map`` around it under a mesh and a mapping, or as it is inside a body), so
every collective is one the code asks for:

- a weight stored split along ``embed`` (FSDP) is all-gathered once, after the hidden states
  exist (the weight is made to depend on them, so XLA does not gather it at the start of the step
  and hold it through the model; the backward pass's sums start likewise from its residuals); the
  gathered weight is the one both passes use (not gathered again for the backward's
  recomputation), and the transpose of that one gather, a reduce-scatter, returns its gradient,
  made whole on each device from its own tokens. That holds the whole head and its whole
  gradient on every device at once (while the loss runs); where that is more than
  ``WHOLE_HEAD_BYTES`` (``gather="auto"``) or ``gather="blocks"`` asks, each block of the head is
  gathered instead, in the forward pass and again in the backward pass, and each block's
  gradient is reduce-scattered as it is made: twice the gathered bytes, in ``2 x blocks``
  collectives, for a ``block x embed`` slice in place of the ``vocab x embed`` head and gradient;
- a weight split along ``vocab`` over mesh axes that do not split the tokens (Megatron's
  vocab-parallel head) stays split: each device makes the blocks of its own vocabulary slice,
  and the log-sum-exp and the target's logit are combined across those devices with one max and
  one sum of ``[tokens]``-sized values; the hidden states' gradient is summed over them once;
- a weight used against tokens split over mesh axes it is not split over (data parallelism)
  has its gradient summed over them once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import _compat
from .._axis import Axis
from .._context import current_body
from .._core import NamedArray, unchecked
from .._local import issue, split_over
from ..explicit import all_gather, shard_map
from ..partitioning import ShardingError, current_mapping, current_mesh


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """The static half of the fused loss: how the device's vocabulary slice is cut, and what the
    loss adds to each logit and token."""

    n_blocks: int
    softcap: float | None
    z_loss_weight: float
    vocab_mesh_axes: tuple[str, ...]  # the mesh axes the vocab is split over (vocab-parallel), or ()
    embed_mesh_axes: tuple[str, ...] = ()  # gathered block by block along embed over these (or () : whole)
    vocab_rows: bool = False  # ``w`` is ``[vocab, embed]`` (a block-gathered head, as stored), else ``[embed, vocab]``

    @property
    def vocab_dim(self) -> int:
        return 0 if self.vocab_rows else 1

    def group(self):
        axes = self.vocab_mesh_axes
        return axes[0] if len(axes) == 1 else axes

    def embed_group(self):
        axes = self.embed_mesh_axes
        return axes[0] if len(axes) == 1 else axes

    def first_id(self, w) -> jax.Array:
        """The vocab id of this device's first column of ``w``."""
        if not self.vocab_mesh_axes:
            return jnp.zeros((), jnp.int32)
        return lax.axis_index(self.group()) * w.shape[self.vocab_dim]

    def logits(self, h, w, b):
        """Block ``b``'s columns of ``w`` (gathered along embed in the blocks mode), its (capped)
        float32 logits, and ``tanh`` of the cap (None without one) for the cap's derivative."""
        size = w.shape[self.vocab_dim] // self.n_blocks
        wb = lax.dynamic_slice_in_dim(w, b * size, size, axis=self.vocab_dim)
        wb = wb.T if self.vocab_rows else wb  # one block turned, never the whole head
        if self.embed_mesh_axes:
            wb = lax.all_gather(wb, self.embed_group(), axis=0, tiled=True)
        raw = jnp.dot(h, wb, preferred_element_type=jnp.float32).astype(jnp.float32)
        if self.softcap is None:
            return wb, raw, None
        t = jnp.tanh(raw / self.softcap)
        return wb, t * self.softcap, t

    def is_target(self, ids, first, size):
        # a compare with the block's ids, not a gather: it fuses into the block's elementwise work,
        # and a target in another block (or outside the vocab) matches nothing
        return ids[:, None] - first == jnp.arange(size, dtype=ids.dtype)[None, :]


def _to(x, axes: frozenset):
    """``x`` typed as varying over mesh axes ``axes`` too (outside ``shard_map`` nothing varies)."""
    missing = tuple(sorted(axes - _compat.varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _varying(x, like):
    """``x`` typed as varying where ``like`` varies: a scan's carry must keep its type."""
    return _to(x, _compat.varying_axes(like))


def _forward(spec: _Blocks, h, w, ids):
    size = w.shape[spec.vocab_dim] // spec.n_blocks
    first = spec.first_id(w)

    def block(carry, b):
        top, total, picked = carry
        _, logits, _ = spec.logits(h, w, b)
        # the max only shifts the exponent: any value keeps the sum exact
        new_top = jnp.maximum(top, logits.max(axis=1))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[:, None]).sum(axis=1)
        picked = picked + jnp.where(spec.is_target(ids, first + b * size, size), logits, 0.0).sum(axis=1)
        return (new_top, total, picked), None

    n = h.shape[0]
    start = (jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32), jnp.zeros((n,), jnp.float32))
    init = tuple(_varying(x, h) for x in start)
    (top, total, picked), _ = lax.scan(block, init, jnp.arange(spec.n_blocks))
    if spec.vocab_mesh_axes:  # each device saw its own slice of the vocab: combine them, once
        overall = issue(lax.pmax, top, spec.group())
        total, picked = issue(lax.psum, jnp.stack([total * jnp.exp(top - overall), picked]), spec.group())
        top = overall
    lse = top + jnp.log(total)
    loss = lse - picked
    if spec.z_loss_weight:
        loss = loss + spec.z_loss_weight * jnp.square(lse)
    return loss, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_token_loss(spec: _Blocks, h, w, ids):
    """Per-token ``lse - logit[target] (+ z * lse²)`` of ``h [tokens, embed] · w [embed, vocab]``
    (raw arrays; ``w [vocab, embed]`` where ``spec.vocab_rows``, and this device's embed slice where
    ``spec.embed_mesh_axes`` says the blocks are gathered; ``ids [tokens]`` global vocab ids),
    float32, one vocabulary block at a time."""
    return _forward(spec, h, w, ids)[0]


def _fwd(spec, h, w, ids):
    loss, lse = _forward(spec, h, w, ids)
    return loss, (h, w, ids, lse)


def _bwd(spec, res, g):
    h, w, ids, lse = res
    size = w.shape[spec.vocab_dim] // spec.n_blocks
    first = spec.first_id(w)
    g = g.astype(jnp.float32)
    # d loss / d lse: 1, plus the z-loss's 2 z lse; d lse / d logit is the softmax
    at_lse = g * (1.0 + 2.0 * spec.z_loss_weight * lse) if spec.z_loss_weight else g

    def block(carry, b):
        dh, dw = carry
        wb, logits, t = spec.logits(h, w, b)
        d = at_lse[:, None] * jnp.exp(logits - lse[:, None])
        d = d - jnp.where(spec.is_target(ids, first + b * size, size), g[:, None], 0.0)
        if t is not None:
            d = d * (1.0 - jnp.square(t))
        d = d.astype(w.dtype)  # the two products below in the weight's dtype (bf16 stays bf16), summed in f32
        dh = dh + jnp.dot(d, wb.T, preferred_element_type=jnp.float32)
        dwb = jnp.dot(h.T.astype(w.dtype), d, preferred_element_type=jnp.float32)
        if spec.embed_mesh_axes:  # each device keeps its embed slice of the block's gradient, summed over tokens
            dwb = lax.psum_scatter(dwb, spec.embed_group(), scatter_dimension=0, tiled=True)
        dwb = dwb.T if spec.vocab_rows else dwb
        return (dh, lax.dynamic_update_slice_in_dim(dw, dwb.astype(dw.dtype), b * size, axis=spec.vocab_dim)), None

    # the sums start at a zero made from the log-sum-exp, so XLA does not allocate them (the whole
    # head's gradient) at the start of the step and hold them through the model
    zero = _zero_after(lse)
    init = (
        _varying(jnp.zeros(h.shape, jnp.float32) + zero, h),
        _varying(jnp.zeros(w.shape, w.dtype) + zero.astype(w.dtype), w),
    )
    (dh, dw), _ = lax.scan(block, init, jnp.arange(spec.n_blocks))
    return dh.astype(h.dtype), dw, None


fused_token_loss.defvjp(_fwd, _bwd)


# ---- named blocks in, named per-token losses out ------------------------------------------------


def whole_axis(a: Axis) -> Axis:
    """``a`` at its size across the devices: inside a ``shard_map`` body a split axis has its
    local size (``block_size`` counts vocab entries of the whole vocabulary)."""
    body, over = current_body(), split_over(a)
    if body is None or not over:
        return Axis(a.name, a.size)
    n = 1
    for m in over:
        n *= body.mesh.shape[m]
    return Axis(a.name, a.size * n)


def _gather(x: NamedArray, name: str, tokens_over: set[str]) -> NamedArray:
    """``x`` whole along ``name``. Typed varying over the gathered mesh axes when the tokens are
    split over them too (so the gradient is one reduce-scatter); typed replicated otherwise (the
    result is the same on those devices and the per-token loss must be too)."""
    over = split_over(x.resolve_axis(name))
    if not over:
        return x
    return all_gather(x, name, invariant=not set(over) <= tokens_over)


# Above this many bytes per device, ``gather="auto"`` gathers the head a block at a time rather
# than whole (the whole head and its whole gradient are then held at once): the f32 head of a
# 4096-entry vocabulary at width 1024, of GPT-2's 50304 x 768 about a ninth.
WHOLE_HEAD_BYTES = 16 * 2**20

GATHERS = ("auto", "once", "blocks")


def _whole(gather: str, head_bytes: int) -> bool:
    """Whether a head that could go either way is gathered whole: ``head_bytes`` is its size
    gathered, on one device."""
    return gather == "once" or (gather == "auto" and head_bytes <= WHOLE_HEAD_BYTES)


def head_bytes_held(
    rows: int, embed: int, itemsize: int, *, block_size: int, embed_shards: int, blocks_possible: bool, gather="auto"
) -> int:
    """Bytes one device holds of an embed-split head while the loss runs, beyond its stored
    slice: ``rows`` vocab entries (the device's) x ``embed`` (whole) gathered and their gradient
    made whole before its reduce-scatter, or, gathering block by block (where
    ``blocks_possible``: the head's embed split also splits the tokens and its vocab is not
    split), a ``block_size``-row block of each plus the reduce-scattered gradient of the
    device's slice. What ``named-plan`` counts for the loss path (the one rule of
    ``_local_loss``)."""
    whole = rows * embed * itemsize
    if not blocks_possible or _whole(gather, whole):
        return 2 * whole
    return 2 * block_size * embed * itemsize + whole // max(embed_shards, 1)


def _gathers_blocks(gather: str, weight: NamedArray, Embed: str, Vocab: str, tokens_over: set[str]) -> bool:
    """Whether the head is gathered block by block: it is split along ``Embed`` over mesh axes
    that also split the tokens (FSDP; its gradient is then a reduce-scatter), its vocabulary is
    not split, and ``gather`` asks for it (``"auto"``: the gathered head would exceed
    ``WHOLE_HEAD_BYTES``)."""
    over = split_over(weight.resolve_axis(Embed))
    if not over or not set(over) <= tokens_over or split_over(weight.resolve_axis(Vocab)):
        return False
    whole = whole_axis(weight.resolve_axis(Embed)).size * weight.resolve_axis(Vocab).size
    return not _whole(gather, whole * weight.dtype.itemsize)


def _zero_after(x) -> jax.Array:
    """A float32 ``0.0`` that the compiled program can make only once ``x`` exists: the sign bit
    of ``x``'s first element, shifted out. Adding it orders what follows after ``x`` without
    changing a value. (An optimisation barrier does not: XLA:CPU removes barriers before it
    schedules, and its scheduler then gathered the head and zero-filled its gradient's sum at the
    start of the step, holding both through the model; ``test_loss_block`` checks the order.)"""
    if x.size == 0:
        return jnp.zeros((), jnp.float32)
    bits = lax.bitcast_convert_type(x.reshape(-1)[0].astype(jnp.float32), jnp.uint32)
    sign = lax.shift_right_logical(bits, jnp.uint32(31))
    return lax.shift_right_logical(sign, jnp.uint32(1)).astype(jnp.float32)


def _tied(hidden: NamedArray, weight: NamedArray) -> tuple[NamedArray, NamedArray]:
    """``weight`` made to depend on ``hidden`` (its value unchanged): nothing made from the weight
    (its gather) can be scheduled before the hidden states exist."""
    w = weight.array + _zero_after(hidden.array).astype(weight.dtype)
    return hidden, unchecked(w, weight.axes)


def _local_loss(
    spec: _Blocks, Embed: str, Vocab: str, gather: str, hidden: NamedArray, weight: NamedArray, ids: NamedArray
):
    """The per-token loss of local blocks (a ``shard_map`` body's, or whole arrays): the token
    axes laid out as ``hidden``'s."""
    hidden, weight = _tied(hidden, weight)
    token_axes = tuple(a for a in hidden.axes if a.name != Embed)
    tokens_over = {m for a in token_axes for m in split_over(a)}
    for a in ids.axes:
        if split_over(a) != split_over(hidden.resolve_axis(a.name)):
            raise ShardingError(
                f"blockwise_cross_entropy_loss: the targets' axis {a.name!r} is split over {split_over(a)} "
                f"but the hidden states' over {split_over(hidden.resolve_axis(a.name))}; lay both out alike"
            )
    vocab_over = split_over(weight.resolve_axis(Vocab))
    if set(vocab_over) & tokens_over:  # a device's tokens need every vocab entry: no vocab-parallel here
        weight, vocab_over = _gather(weight, Vocab, tokens_over), ()
    # a weight used against tokens split where it is not: its gradient is summed over them (a
    # replicated weight's all-reduce), on the stored block, before the gather makes it whole
    weight = unchecked(_to(weight.array, frozenset(tokens_over)), weight.axes)
    blocks = _gathers_blocks(gather, weight, Embed, Vocab, tokens_over)
    embed_over = split_over(weight.resolve_axis(Embed)) if blocks else ()
    # whole: the device's slice turned to [embed, vocab] before the gather, so that the gather
    # concatenates whole rows and needs no copy after it; blocks: as stored, each block turned
    rows = blocks and weight.axes[0].name == Vocab
    weight = weight.rearrange((Vocab, Embed) if rows else (Embed, Vocab))
    weight = weight if blocks else _gather(weight, Embed, tokens_over)
    hidden = _gather(hidden, Embed, tokens_over)
    Local = weight.resolve_axis(Vocab)
    if Local.size % spec.n_blocks:
        raise ShardingError(
            f"blockwise_cross_entropy_loss: the vocab axis {Vocab!r} is split over {vocab_over}, "
            f"{Local.size} entries per device, which do not cut into the {spec.n_blocks} blocks of the loss; "
            "block_size must split over those devices as the vocab does"
        )
    spec = dataclasses.replace(
        spec, vocab_mesh_axes=tuple(vocab_over), embed_mesh_axes=tuple(embed_over), vocab_rows=rows
    )
    n = 1
    for a in token_axes:
        n *= a.size
    E = hidden.resolve_axis(Embed)
    h = hidden.rearrange((*token_axes, E)).array.reshape(n, E.size)  # no -1: there may be no token
    w = weight.array
    t = ids.rearrange(token_axes).array.reshape(n)
    # every input typed alike: where one varies and another does not, the pcast's transpose is
    # the gradient's sum (the hidden states' over the vocab slices, Megatron's)
    every = _compat.varying_axes(h) | _compat.varying_axes(w) | _compat.varying_axes(t)
    h, w, t = (_to(x, every) for x in (h, w, t))
    loss = fused_token_loss(spec, h, w, t)
    return unchecked(loss.reshape(tuple(a.size for a in token_axes)), token_axes)


def fused_per_token_loss(
    hidden: NamedArray,
    weight: NamedArray,
    ids: NamedArray,
    *,
    Embed: Axis,
    Vocab: Axis,
    block_size: int,
    softcap: float | None,
    z_loss_weight: float,
    weight_mapping=None,
    gather: str = "auto",
) -> NamedArray:
    """The float32 loss of each token of ``hidden`` (its axes but ``Embed``); ``ids`` have exactly
    those axes. Under a mesh and a compute mapping it runs under ``nm.shard_map``: ``hidden`` and
    ``ids`` laid out by the compute mapping, ``weight`` by ``weight_mapping`` (where the weight
    is stored: the parameter mapping; default: the compute mapping). Inside a body it runs on the
    blocks it is given. ``gather``: how an FSDP head is gathered (``GATHERS``; the module's text)."""
    spec = _Blocks(Vocab.size // block_size, softcap, float(z_loss_weight), ())
    run = functools.partial(_local_loss, spec, Embed.name, Vocab.name, gather)
    mesh, mapping = current_mesh(), current_mapping()
    if current_body() is not None or mesh is None or (mapping is None and weight_mapping is None):
        return run(hidden, weight, ids)
    compute = dict(mapping or {})
    return shard_map(run, mesh=mesh, in_mapping=(compute, dict(weight_mapping or compute), compute))(
        hidden, weight, ids
    )
