"""Sampling from GPT-2 or any decoder family with a KV cache over named axes.

One compiled program per (model, prompt shape, settings): the stacked layers are split into
their blocks once, a prefill runs the whole prompt through ``model.decode`` at position 0, then
a ``lax.while_loop`` of one-token decode steps runs until every row has given a stop id or
``max_new_tokens`` are out. Each step writes its keys and values into each layer's cache buffer
(``(batch, heads | kv_heads, key_position, head_size)``) in place, at the current position.
Prompts of different lengths share a batch: each is padded on the left inside the program and
the cache knows where each row begins (``KVCache.start``).
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import named as nm
from named import Axis, NamedArray, nn
from named.internal import is_tracer

from ._common import split_key


def generate(
    model,
    prompt_ids: NamedArray,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    key=None,
    stop_ids: Sequence[int] = (),
    prompt_lengths: Sequence[int] | NamedArray | None = None,
) -> NamedArray:
    """Continue ``prompt_ids`` by ``max_new_tokens`` tokens.

    Args:
        model: a ``Gpt2LMHeadModel`` or ``DecoderLMHeadModel`` (anything with ``init_cache``
            and ``decode``).
        prompt_ids: integer ids with axes ``(batch, position)`` (or just ``position``).
        max_new_tokens: how many tokens to add.
        temperature: divides the logits; ``0`` is greedy decoding (argmax, no key needed).
        top_k: sample only among the ``top_k`` most likely tokens.
        top_p: sample only from the smallest set of most likely tokens whose probability
            reaches ``top_p`` (nucleus sampling).
        key: a PRNG key; required when sampling. The same key gives the same tokens.
        stop_ids: token ids that end a row (an eos, a chat template's end-of-turn token): once
            a row has given one, its later positions repeat it, and the decoding loop ends as
            soon as every row has given one.
        prompt_lengths: one length per row (a sequence, or an integer NamedArray over ``batch``)
            when the prompts differ in length: row ``r``'s prompt is its first
            ``prompt_lengths[r]`` ids, the rest is padding that is never attended to. Each row
            is decoded as it would be alone. None: every row is a whole prompt.

    Returns:
        The prompt followed by the new tokens: axes ``(batch, position)`` with
        ``position = prompt length + max_new_tokens``. With ``prompt_lengths`` too, the new tokens
        of every row start at the padded prompt's length: ``out["position", P:]`` are they.
    """
    if temperature < 0:
        raise nm.ArgumentError(f"temperature={temperature} must be >= 0 (0 is greedy)")
    if temperature > 0 and key is None:
        raise nm.ArgumentError("sampling (temperature > 0) needs key=; temperature=0 decodes greedily")
    if top_k is not None and top_k < 1:
        raise nm.ArgumentError(f"top_k={top_k} must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise nm.ArgumentError(f"top_p={top_p} must be in (0, 1]")
    if max_new_tokens < 0:
        raise nm.ArgumentError(f"max_new_tokens={max_new_tokens} must be >= 0")
    unbatched = "batch" not in prompt_ids.names
    prompt = prompt_ids.broadcast_axis(Axis("batch", 1)) if unbatched else prompt_ids
    prompt = prompt.rearrange(("batch", "position"))
    Batch, P = prompt.resolve_axis("batch"), prompt.axis_size("position")
    lengths = _lengths(prompt_lengths, Batch, P)
    if max_new_tokens == 0:
        return prompt_ids
    key = jax.random.key(0) if key is None else key
    stops = tuple(sorted({int(i) for i in stop_ids}))
    new = _generate(
        model, prompt, lengths, key, max_new_tokens, float(temperature), top_k, top_p, stops, lengths is None
    )
    out = nm.concatenate("position", [prompt, new.astype(prompt.dtype)])
    return out["batch", 0] if unbatched else out


def _lengths(prompt_lengths, Batch: Axis, P: int) -> NamedArray | None:
    """The rows' prompt lengths as int32 over ``batch``, checked (when known) to lie in [1, P]."""
    if prompt_lengths is None:
        return None
    if isinstance(prompt_lengths, NamedArray):
        if prompt_lengths.names != ("batch",) or prompt_lengths.axis_size("batch") != Batch.size:
            raise nm.AxisError(
                f"prompt_lengths has axes {prompt_lengths.names}; it needs one entry per row, batch={Batch.size}"
            )
        lengths = prompt_lengths.astype(jnp.int32)
    else:
        values = np.asarray(prompt_lengths)
        if values.shape != (Batch.size,):
            raise nm.ArgumentError(f"prompt_lengths has {values.size} entries for batch={Batch.size}")
        lengths = nm.named(jnp.asarray(values, jnp.int32), (Batch,))
    if not is_tracer(lengths.array):
        bad = [int(n) for n in np.asarray(lengths.array) if not 1 <= n <= P]
        if bad:
            raise nm.ArgumentError(f"prompt_lengths: {bad[0]} is not in [1, {P}] (the prompt's positions)")
    return lengths


def unstacked_layers(model):
    """``model`` with each ``nn.Stacked`` replaced by an ``nn.BlockSeq`` of its blocks: inside a
    program, the weights are sliced into their layers once, not at every step of a loop."""

    def split(x):
        return nn.BlockSeq.from_layers(x.unstacked(), x.Layers) if isinstance(x, nn.Stacked) else x

    return jax.tree.map(split, model, is_leaf=lambda x: isinstance(x, nn.Stacked))


@eqx.filter_jit
def _generate(
    model,
    prompt: NamedArray,
    lengths: NamedArray | None,
    key,
    n: int,
    temperature: float,
    top_k,
    top_p,
    stops: tuple[int, ...],
    whole: bool,
) -> NamedArray:
    Batch, P = prompt.resolve_axis("batch"), prompt.axis_size("position")
    model = unstacked_layers(model)
    if whole:
        start = None
    else:  # right-padded rows moved to the right end: row r's tokens at P - length_r ... P - 1
        start = P - lengths
        cols = (nm.arange(prompt.resolve_axis("position")) - start) % P
        prompt = NamedArray(
            jnp.take_along_axis(prompt.array, cols.rearrange(("batch", "position")).array, 1), prompt.axes
        )
    keys = split_key(key, n)
    logits, cache = model.decode(prompt, model.init_cache(Batch, P + n, start), 0, last=True)
    first = sample_token(logits, keys[0], temperature=temperature, top_k=top_k, top_p=top_p).array
    stop_ids = jnp.asarray(stops, jnp.int32)

    def stopped(token: jax.Array) -> jax.Array:
        return jnp.isin(token, stop_ids) if stops else jnp.zeros(token.shape, bool)

    def running(carry) -> jax.Array:
        i, _, _, done, _ = carry
        return (i < n) & ~jnp.all(done)

    def step(carry):
        i, cache, token, done, tokens = carry
        ids = NamedArray(token[:, None], (Batch, Axis("position", 1)))
        logits, cache = model.decode(ids, cache, P + i - 1, last=True)
        new = sample_token(logits, keys[i], temperature=temperature, top_k=top_k, top_p=top_p).array
        new = jnp.where(done, token, new)  # a finished row repeats its stop id
        tokens = jax.lax.dynamic_update_slice(tokens, new[:, None], (0, i))
        return i + 1, cache, new, done | stopped(new), tokens

    tokens = jnp.zeros((Batch.size, n), jnp.int32).at[:, 0].set(first)
    init = (jnp.int32(1), cache, first, stopped(first), tokens)
    i, _, last, _, tokens = jax.lax.while_loop(running, step, init)
    # the loop ended early only when every row had stopped: the columns it did not reach repeat each row's stop id
    tokens = jnp.where(jnp.arange(n) >= i, last[:, None], tokens)
    return NamedArray(tokens, (Batch, Axis("position", n)))


def sample_token(
    logits: NamedArray, key, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> NamedArray:
    """One token id per row of ``logits`` (axes ``(..., vocab)``); ``temperature=0`` is argmax."""
    if temperature == 0:
        return logits.argmax("vocab").astype(jnp.int32)
    rows = logits.rearrange((..., "vocab"))
    x = rows.array.astype(jnp.float32) / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if top_p is not None and top_p < 1:
        desc = -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # of the strictly more likely tokens
        smallest_kept = jnp.min(jnp.where(mass_before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < smallest_kept, -jnp.inf, x)
    token = jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
    return NamedArray(token, rows.axes[:-1])
