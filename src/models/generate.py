"""Sampling from GPT-2 or any decoder family with a KV cache over named axes.

One compiled program per (model, prompt shape, settings): a prefill that runs the whole prompt
through ``model.decode`` at position 0, then a ``lax.scan`` of one-token decode steps, each
writing its keys and values into the cache (``(layers, batch, key_position, heads, head_size)``)
at the current position.
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

import named as nm
from named import Axis, NamedArray

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
) -> NamedArray:
    """Continue ``prompt_ids`` by ``max_new_tokens`` tokens.

    Args:
        model: a ``Gpt2LMHeadModel`` or ``DecoderLMHeadModel`` (anything with ``init_cache``
            and ``decode``).
        prompt_ids: integer ids with axes ``(batch, position)`` (or just ``position``); every
            row is a prompt of the same length (no padding).
        max_new_tokens: how many tokens to add.
        temperature: divides the logits; ``0`` is greedy decoding (argmax, no key needed).
        top_k: sample only among the ``top_k`` most likely tokens.
        top_p: sample only from the smallest set of most likely tokens whose probability
            reaches ``top_p`` (nucleus sampling).
        key: a PRNG key; required when sampling. The same key gives the same tokens.
        stop_ids: token ids that end a row (an eos, a chat template's end-of-turn token): once
            a row has given one, its later positions repeat it. The scan still runs all
            ``max_new_tokens`` steps (one compiled loop for every row); callers cut each row
            at its first stop id.

    Returns:
        The prompt followed by the new tokens: axes ``(batch, position)`` with
        ``position = prompt length + max_new_tokens``.
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
    if max_new_tokens == 0:
        return prompt_ids
    unbatched = "batch" not in prompt_ids.names
    prompt = prompt_ids.broadcast_axis(Axis("batch", 1)) if unbatched else prompt_ids
    prompt = prompt.rearrange(("batch", "position"))
    cache = model.init_cache(prompt.resolve_axis("batch"), prompt.axis_size("position") + max_new_tokens)
    key = jax.random.key(0) if key is None else key
    stops = tuple(sorted({int(i) for i in stop_ids}))
    new = _generate(model, prompt, cache, key, max_new_tokens, float(temperature), top_k, top_p, stops)
    out = nm.concatenate("position", [prompt, new.astype(prompt.dtype)])
    return out["batch", 0] if unbatched else out


@eqx.filter_jit
def _generate(
    model, prompt: NamedArray, cache, key, n: int, temperature: float, top_k, top_p, stops: tuple[int, ...]
) -> NamedArray:
    P = prompt.axis_size("position")
    keys = split_key(key, n)
    logits, cache = model.decode(prompt, cache, 0)
    first = sample_token(logits["position", P - 1], keys[0], temperature=temperature, top_k=top_k, top_p=top_p)

    def stopped(token: NamedArray) -> jax.Array:
        return jnp.isin(token.array, jnp.asarray(stops, jnp.int32)) if stops else jnp.zeros(token.array.shape, bool)

    def step(carry, k):
        cache, token, pos, done = carry
        logits, cache = model.decode(token.broadcast_axis(Axis("position", 1)), cache, pos)
        new = sample_token(logits["position", 0], k, temperature=temperature, top_k=top_k, top_p=top_p)
        new = NamedArray(jnp.where(done, token.array, new.array), new.axes)  # a finished row repeats its stop id
        return (cache, new, pos + 1, done | stopped(new)), new.array

    _, rest = jax.lax.scan(step, (cache, first, jnp.int32(P), stopped(first)), keys[1:])
    tokens = jnp.concatenate([first.array[None], rest], axis=0)  # [new, batch]
    return NamedArray(tokens.T, (first.resolve_axis("batch"), Axis("position", n)))


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
