"""GPT-2 in plain JAX + Equinox with hand-written PartitionSpecs: the baseline `named` is timed against.

The same math as ``models.Gpt2LMHeadModel``: tied embeddings, learned positions, pre-LN blocks
(LayerNorm statistics in float32), fused qkv, causal attention with float32 scores and softmax,
gelu_new MLP, layers stacked along a leading axis and run with ``lax.scan``, and the same
next-token loss (targets rolled by one, the last position masked, the target's logit picked by
a masked sum). FSDP is written out by hand: every weight with an ``embed`` dimension is split
along it over the ``data`` mesh axis, and every activation a layer creates is constrained to
``batch`` over ``data`` (without those constraints the partitioner copies the weights' layout
onto activations and the step runs several times slower; see /work/shared/DESIGN.md).

Shapes: B batch, T position, D embed, H heads, K head_size, M mlp, V vocab, L layers.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

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
    "ln1_w": P(None, DATA), "ln1_b": P(None, DATA),
    "attn_w": P(None, DATA, None), "attn_b": P(None, None),  # [L, D, 3D] / [L, 3D]
    "proj_w": P(None, None, DATA), "proj_b": P(None, DATA),  # [L, D, D] (in = heads*head_size) / [L, D]
    "ln2_w": P(None, DATA), "ln2_b": P(None, DATA),
    "up_w": P(None, DATA, None), "up_b": P(None, None),  # [L, D, M] / [L, M]
    "down_w": P(None, None, DATA), "down_b": P(None, DATA),  # [L, M, D] / [L, D]
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
        "ln1_w": jnp.ones((L, D)), "ln1_b": jnp.zeros((L, D)),
        "attn_w": normal(ks[0], (L, D, 3 * D), 1 / math.sqrt(D)), "attn_b": jnp.zeros((L, 3 * D)),
        "proj_w": normal(ks[1], (L, D, D), out_scale / math.sqrt(D)), "proj_b": jnp.zeros((L, D)),
        "ln2_w": jnp.ones((L, D)), "ln2_b": jnp.zeros((L, D)),
        "up_w": normal(ks[2], (L, D, M), 1 / math.sqrt(D)), "up_b": jnp.zeros((L, M)),
        "down_w": normal(ks[3], (L, M, D), 1 / math.sqrt(M)), "down_b": jnp.zeros((L, D)),
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


def next_token_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Mean over B × (T − 1) tokens of the cross-entropy of token t + 1 given position t."""
    logits = logits.astype(jnp.float32)
    targets = jnp.roll(ids, -1, axis=1)
    mask = (jnp.arange(ids.shape[1]) < ids.shape[1] - 1).astype(jnp.float32)[None, :]
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.where(targets[..., None] == jnp.arange(logits.shape[-1]), logits, 0.0).sum(-1)
    return ((lse - picked) * mask).sum() / (mask.sum() * ids.shape[0])


def make_train_step(optimizer, mesh, model: Gpt2, opt_state, *, compute_dtype=jnp.float32):
    """jit of loss, grads and the optimizer update; model and optimizer state donated and
    returned in their FSDP layouts (the optimizer state keeps the layout it was created with)."""
    def step(model, opt_state, ids):
        loss, grads = eqx.filter_value_and_grad(lambda m: next_token_loss(forward(m, ids, mesh, compute_dtype=compute_dtype), ids))(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return loss, eqx.apply_updates(model, updates), opt_state

    out = (NamedSharding(mesh, P()), shardings(model, mesh), shardings(opt_state, mesh))
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out)


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
