"""GPT-2 and the trainer's step in plain JAX + Equinox + optax with hand-written PartitionSpecs:
the baseline `named` is timed against (``bench/overhead.py``).

The same math as ``models.Gpt2LMHeadModel``: tied embeddings, learned positions, pre-LN blocks
(LayerNorm statistics in float32), fused qkv, causal attention with float32 scores and softmax,
gelu_new MLP, layers stacked along a leading axis and run with ``lax.scan``. The same step as
``named.trainer.loop.train.make_train_step``: the next-token loss of every token that ``loss_mask``
keeps (targets rolled by one, the last position masked, the target's logit picked by a masked
sum), summed over microbatches in a ``lax.scan`` and divided by the token count; the global
gradient norm; global-norm clipping and AdamW with weight decay off the biases and norms
(``optimizer``, built by the caller with optax); the finite checks of the loss, the gradient
norm, the update, the new parameters and the new optimizer state; and the stop flags agreed
over the devices. FSDP is written out by hand: every weight with an ``embed`` dimension is
split along it over the ``data`` mesh axis, and every activation a layer creates is
constrained to ``batch`` over ``data`` (without those constraints the partitioner copies the
weights' layout onto activations and the step runs several times slower).

Shapes: B batch, T position, D embed, H heads, K head_size, M mlp, V vocab, L layers.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"


class Gpt2(eqx.Module):
    wte: jax.Array  # [V, D]
    wpe: jax.Array  # [T, D]
    blocks: dict  # name -> [L, ...]
    ln_f: tuple  # ([D], [D])
    n_head: int = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=1e-5)


# The PartitionSpec of every weight (and so of its gradient and Adam moments): embed over data.
BLOCK_SPECS = {
    "ln1_w": P(None, DATA),
    "ln1_b": P(None, DATA),
    "attn_w": P(None, DATA, None),
    "attn_b": P(None, None),  # [L, D, 3D] / [L, 3D]
    "proj_w": P(None, None, DATA),
    "proj_b": P(None, DATA),  # [L, D, D] (in = heads*head_size) / [L, D]
    "ln2_w": P(None, DATA),
    "ln2_b": P(None, DATA),
    "up_w": P(None, DATA, None),
    "up_b": P(None, None),  # [L, D, M] / [L, M]
    "down_w": P(None, None, DATA),
    "down_b": P(None, DATA),  # [L, M, D] / [L, D]
}


def param_specs(model: Gpt2) -> Gpt2:
    return Gpt2(P(None, DATA), P(None, DATA), dict(BLOCK_SPECS), (P(DATA), P(DATA)), model.n_head, model.eps)


def init(key, *, n_layer, n_head, n_embd, n_positions, vocab_size) -> Gpt2:
    L, D, M = n_layer, n_embd, 4 * n_embd
    ks = jax.random.split(key, 6)

    def normal(k, shape, std):
        return std * jax.random.truncated_normal(k, -2.0, 2.0, shape, jnp.float32) / 0.8796256610342398

    out_scale = 1 / math.sqrt(2 * L)
    blocks = {
        "ln1_w": jnp.ones((L, D)),
        "ln1_b": jnp.zeros((L, D)),
        "attn_w": normal(ks[0], (L, D, 3 * D), 1 / math.sqrt(D)),
        "attn_b": jnp.zeros((L, 3 * D)),
        "proj_w": normal(ks[1], (L, D, D), out_scale / math.sqrt(D)),
        "proj_b": jnp.zeros((L, D)),
        "ln2_w": jnp.ones((L, D)),
        "ln2_b": jnp.zeros((L, D)),
        "up_w": normal(ks[2], (L, D, M), 1 / math.sqrt(D)),
        "up_b": jnp.zeros((L, M)),
        "down_w": normal(ks[3], (L, M, D), 1 / math.sqrt(M)),
        "down_b": jnp.zeros((L, D)),
    }
    wte = 0.02 * jax.random.normal(ks[4], (vocab_size, D))
    wpe = 0.02 * jax.random.normal(ks[5], (n_positions, D))
    return Gpt2(wte, wpe, blocks, (jnp.ones(D), jnp.zeros(D)), n_head)


def sharded_init(mesh, key, **config) -> Gpt2:
    """Init compiled with the parameter layouts as outputs, so no device ever holds a whole weight."""
    shapes = jax.eval_shape(lambda k: init(k, **config), key)
    return jax.jit(lambda k: init(k, **config), out_shardings=shardings(shapes, mesh))(key)


# ---- forward ------------------------------------------------------------------------------


def _act(x: jax.Array, mesh) -> jax.Array:
    """Constrain an activation to batch over data, every other dimension whole."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(DATA, *([None] * (x.ndim - 1)))))


def _layer_norm(x, w, b, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def _attention(q, k, v):  # [B, T, H, K] each
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32) * scale
    T = q.shape[1]
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", weights, v)


def _block(x, p, *, n_head, eps, mesh):
    B, T, D = x.shape
    h = _layer_norm(x, p["ln1_w"], p["ln1_b"], eps)
    qkv = _act(jnp.einsum("btd,de->bte", h, p["attn_w"]) + p["attn_b"], mesh)
    q, k, v = (a.reshape(B, T, n_head, D // n_head) for a in jnp.split(qkv, 3, axis=-1))
    a = _act(_attention(q, k, v), mesh).reshape(B, T, D)
    x = x + _act(jnp.einsum("btd,de->bte", a, p["proj_w"]) + p["proj_b"], mesh)
    h = _layer_norm(x, p["ln2_w"], p["ln2_b"], eps)
    h = jax.nn.gelu(_act(jnp.einsum("btd,dm->btm", h, p["up_w"]) + p["up_b"], mesh), approximate=True)
    return x + _act(jnp.einsum("btm,md->btd", h, p["down_w"]) + p["down_b"], mesh)


def forward(model: Gpt2, ids: jax.Array, mesh, *, compute_dtype=jnp.float32) -> jax.Array:
    """Logits [B, T, V] for token ids [B, T]. Weights are cast to ``compute_dtype`` (norms excepted)."""
    cast = lambda w: w.astype(compute_dtype)  # noqa: E731
    wte = cast(model.wte)
    x = _act(jnp.take(wte, ids, axis=0) + cast(model.wpe)[: ids.shape[1]][None], mesh)
    blocks = {k: (v if k.startswith("ln") else cast(v)) for k, v in model.blocks.items()}

    def body(x, p):
        return _block(x, p, n_head=model.n_head, eps=model.eps, mesh=mesh), None

    x, _ = jax.lax.scan(body, x, blocks)
    x = _layer_norm(x, *model.ln_f, model.eps)
    return _act(jnp.einsum("btd,vd->btv", x, wte), mesh)


def token_losses(logits: jax.Array, ids: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """The cross-entropy of token t + 1 given position t, [B, T], zero where the last position or
    ``loss_mask`` (aligned with the predicting positions) leaves a token out."""
    logits = logits.astype(jnp.float32)
    targets = jnp.roll(ids, -1, axis=1)
    weight = (jnp.arange(ids.shape[1]) < ids.shape[1] - 1).astype(jnp.float32)[None, :] * loss_mask.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.where(targets[..., None] == jnp.arange(logits.shape[-1]), logits, 0.0).sum(-1)
    return jnp.where(weight != 0, (lse - picked) * weight, 0.0)


def decay_mask(model: Gpt2) -> Gpt2:
    """Weight decay for the matrices and embeddings, not for the biases and LayerNorm parameters."""
    return Gpt2(
        True,
        True,
        {k: not (k.startswith("ln") or k.endswith("_b")) for k in model.blocks},
        (False, False),
        model.n_head,
        model.eps,
    )


def make_optimizer(
    learning_rate: float, *, b1: float, b2: float, eps: float, weight_decay: float, max_grad_norm: float | None
):
    """Global-norm clipping (unless ``max_grad_norm`` is None), then AdamW at a constant rate with
    ``decay_mask``."""
    clip = [] if max_grad_norm is None else [optax.clip_by_global_norm(max_grad_norm)]
    return optax.chain(
        *clip,
        optax.adamw(
            optax.constant_schedule(learning_rate), b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask
        ),
    )


def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]  # not Adam's step count
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def make_train_step(optimizer, mesh, model: Gpt2, opt_state, *, microbatches: int = 1, compute_dtype=jnp.float32):
    """jit of ``(model, opt_state, batch, flags) -> (model, opt_state, metrics)``: ``batch`` holds
    ``input_ids`` and ``loss_mask`` [B, T], ``flags`` one int32 row per device; model and optimizer
    state donated and returned in their FSDP layouts."""

    def loss_sum(m, ids, mask):
        per_token = token_losses(forward(m, ids, mesh, compute_dtype=compute_dtype), ids, mask)
        return per_token.sum(), mask[:, :-1].astype(jnp.float32).sum()

    grad_fn = eqx.filter_value_and_grad(loss_sum, has_aux=True)

    def step(model, opt_state, batch, flags):
        split = {k: v.reshape(microbatches, v.shape[0] // microbatches, *v.shape[1:]) for k, v in batch.items()}

        def accumulate(acc, mb):
            (s, c), g = grad_fn(model, _act(mb["input_ids"], mesh), _act(mb["loss_mask"], mesh))
            return jax.tree.map(jnp.add, acc, (s, c, g)), None

        zero = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, model))
        (total, count, grads), _ = jax.lax.scan(accumulate, zero, split)
        count = jnp.maximum(count, 1.0)
        loss = total / count
        grads = jax.tree.map(lambda g: g / count, grads)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        updates, new_opt = optimizer.update(grads, opt_state, model)
        new_model = eqx.apply_updates(model, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite((updates, new_model, new_opt))
        agreed = jax.lax.with_sharding_constraint(flags.max(axis=0), NamedSharding(mesh, P()))
        return (
            new_model,
            new_opt,
            {"loss": loss, "grad_norm": grad_norm, "finite": finite, "tokens": count, "stop_flags": agreed},
        )

    replicated = NamedSharding(mesh, P())
    metrics = {k: replicated for k in ("loss", "grad_norm", "finite", "tokens", "stop_flags")}
    out = (shardings(model, mesh), shardings(opt_state, mesh), metrics)
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out)


def flags(mesh) -> jax.Array:
    """The step's ``flags`` input: one zero int32 row (signal, periods) per device, split over them."""
    return jax.device_put(jnp.zeros((mesh.devices.size, 2), jnp.int32), NamedSharding(mesh, P(mesh.axis_names)))


def shardings(tree, mesh):
    """NamedShardings for a pytree holding Gpt2 modules (a model, Adam moments): FSDP specs for
    their weights, replicated for everything else (step counts)."""

    def leaf(x):
        if isinstance(x, Gpt2):
            return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(x), is_leaf=lambda s: isinstance(s, P))
        return NamedSharding(mesh, P())

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, Gpt2))


def init_optimizer(optimizer, model: Gpt2, mesh) -> object:
    """Optimizer state with every moment in its weight's layout."""
    return jax.jit(optimizer.init, out_shardings=shardings(jax.eval_shape(optimizer.init, model), mesh))(model)
