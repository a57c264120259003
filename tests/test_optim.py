"""Optimizer pieces: the weight-decay mask and the learning-rate schedules."""

import equinox as eqx
import jax
import numpy as np
import pytest

import named as nm
from named import models, nn
from named.trainer.config import OptimizerConfig
from named.trainer.loop.optim import decay_mask, schedule


def _mask_by_path(model):
    m = decay_mask(model)
    flat = jax.tree_util.tree_flatten_with_path(m, is_leaf=nm.is_named_array)[0]
    return {jax.tree_util.keystr(p): bool(x.array if isinstance(x, nm.NamedArray) else x) for p, x in flat}


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_decay_mask_skips_norms_and_biases(which):
    if which == "gpt2":
        cfg = models.Gpt2Config(n_layer=2, n_head=2, n_embd=16, n_positions=16, vocab_size=32)
        cls = models.Gpt2LMHeadModel
    else:
        cfg = models.LlamaConfig(
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            vocab_size=32,
        )
        cls = models.LlamaLMHeadModel
    model = jax.eval_shape(lambda k: cls.init(cfg, key=k), jax.random.key(0))
    mask = _mask_by_path(model)
    assert mask, "mask is empty"
    for path, decay in mask.items():
        is_norm_or_bias = "bias" in path or "ln" in path or "norm" in path
        assert decay == (not is_norm_or_bias), path
    assert any(mask.values()) and not all(mask.values())


def test_decay_goes_by_name_and_module_not_by_rank():
    # OptimizerConfig's rule: a bias (a field named bias) of any rank is skipped; a weight of one axis is not
    class Layer(eqx.Module):
        scale: nm.NamedArray
        bias: nm.NamedArray

    layer = Layer(nm.named(np.ones(4), "embed"), nm.named(np.zeros((2, 4)), "heads embed"))
    assert _mask_by_path(layer) == {".scale": True, ".bias": False}
    assert decay_mask(layer).scale.axes == layer.scale.axes  # laid out as the parameter is

    # ... and by module: every parameter of a norm (its one-axis weight too, not named bias) is skipped,
    # while the same weight held by another module is decayed; a class opts out by declaring no_weight_decay
    Embed = nm.Axis("embed", 4)

    class Holder(eqx.Module):
        norm: nn.RMSNorm
        same: Layer

    class Own(eqx.Module):
        no_weight_decay = True  # what the optimizer reads; keep_full_precision is the precision policy's
        w: nm.NamedArray

    norm = nn.RMSNorm.init(Embed)
    held = Holder(norm, Layer(norm.weight, nm.named(np.zeros(4), "embed")))
    assert _mask_by_path(held) == {".norm.weight": False, ".same.scale": True, ".same.bias": False}
    assert _mask_by_path(Own(nm.named(np.ones((2, 4)), "heads embed"))) == {".w": False}


def test_schedules():
    base = dict(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    n = 100
    cos = schedule(OptimizerConfig(schedule="cosine", **base), n)
    assert float(cos(0)) == 0.0 and float(cos(5)) == pytest.approx(0.5)
    assert float(cos(10)) == pytest.approx(1.0) and float(cos(n)) == pytest.approx(0.1, abs=1e-6)
    lin = schedule(OptimizerConfig(schedule="linear", **base), n)
    assert float(lin(55)) == pytest.approx(0.55, abs=1e-6)
    wsd = schedule(OptimizerConfig(schedule="wsd", decay_fraction=0.2, **base), n)
    assert float(wsd(50)) == pytest.approx(1.0) and float(wsd(79)) == pytest.approx(1.0)
    assert float(wsd(90)) == pytest.approx(0.55, abs=1e-6) and float(wsd(n)) == pytest.approx(0.1, abs=1e-6)
    const = schedule(OptimizerConfig(schedule="constant", **{**base, "warmup_steps": 0}), n)
    assert np.allclose([float(const(s)) for s in (0, 50, 100)], 1.0)


@pytest.mark.parametrize("n", [20, 300])
def test_warmup_below_one_is_a_fraction_of_the_run(n):
    frac = schedule(OptimizerConfig(schedule="constant", learning_rate=1.0, warmup_steps=0.1), n)
    steps = schedule(OptimizerConfig(schedule="constant", learning_rate=1.0, warmup_steps=n // 10), n)
    assert [float(frac(s)) for s in range(n // 10 + 2)] == [float(steps(s)) for s in range(n // 10 + 2)]
    assert float(frac(n // 10 - 1)) < 1.0 == float(frac(n // 10))


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd"])
def test_schedule_steps_fixes_the_horizon_whatever_the_run_length(kind):
    """A run of 100 steps whose schedule spans 40 follows the 40-step schedule, then its final rate
    (a resume that raises num_train_steps keeps the rate it was following)."""
    base = dict(schedule=kind, learning_rate=1.0, warmup_steps=0.1, min_lr_ratio=0.1)
    short = schedule(OptimizerConfig(**base), 40)
    kept = schedule(OptimizerConfig(**base, schedule_steps=40), 100)
    assert [float(kept(s)) for s in range(41)] == [float(short(s)) for s in range(41)]
    assert [float(kept(s)) for s in (41, 70, 100)] == pytest.approx([0.1] * 3, abs=1e-6)
    assert OptimizerConfig(**base).same_schedule(40, 100) is False
    assert OptimizerConfig(**{**base, "schedule": "constant", "warmup_steps": 5}).same_schedule(40, 100) is True
    assert OptimizerConfig(**{**base, "schedule": "constant"}).same_schedule(40, 100) is False  # warmup: 4 vs 10


def test_a_warmup_longer_than_schedule_steps_names_the_key():
    from named.trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"warmup_steps=30 is longer than optimizer.schedule_steps=20"):
        load_config(None, ["--optimizer.warmup_steps", "30", "--optimizer.schedule_steps", "20"])


def _optax_schedule(cfg: OptimizerConfig, num_steps: int):
    """The reference: the schedule built from optax's own schedules with Python numbers (what the
    trainer built before its numbers became inputs of the compiled step)."""
    import optax

    lr, warm = cfg.learning_rate, cfg.warmup(num_steps)
    horizon = cfg.horizon(num_steps)
    end, rest = lr * cfg.min_lr_ratio, max(horizon - warm, 1)
    if cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(lr, rest, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        main = optax.linear_schedule(lr, end, rest)
    elif cfg.schedule == "constant":
        main = optax.constant_schedule(lr)
    else:
        decay = max(int(round(horizon * cfg.decay_fraction)), 1)
        main = optax.join_schedules(
            [optax.constant_schedule(lr), optax.linear_schedule(lr, end, decay)], [max(rest - decay, 0)]
        )
    return main if warm == 0 else optax.join_schedules([optax.linear_schedule(0.0, lr, warm), main], [warm])


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
@pytest.mark.parametrize(
    "over,n",
    [
        ({}, 7),
        ({"warmup_steps": 0.1}, 300),
        ({"warmup_steps": 3, "learning_rate": 3e-4}, 50),
        ({"schedule_steps": 9}, 40),
    ],
)
def test_the_compiled_schedule_is_optaxs(kind, over, n):
    """The train step computes the learning rate from its numbers as inputs (``optim.numbers``);
    at every step it is the float32 optax's schedules compute with the numbers as constants of the
    program, warmup or none, within 1e-6 of its value (8 units in the last place): where the CPU has
    FMA, XLA fuses a product and a sum into one rounding in one program and not in the other (AMD
    EPYC: up to 5 units). What the loop logs is the step's own number, bit for bit."""
    import jax.numpy as jnp

    from named.trainer.loop.optim import as_inputs, numbers, schedule_of

    cfg = OptimizerConfig(schedule=kind, **{"learning_rate": 2e-3, "warmup_steps": 2, "min_lr_ratio": 0.1, **over})
    # one int32 count at a time, as the step reads its own (XLA:CPU computes a vector's cosines otherwise)
    ours, theirs = jax.jit(lambda nums, c: schedule_of(kind, nums)(c)), jax.jit(_optax_schedule(cfg, n))
    nums, logged = as_inputs(numbers(cfg, n)), schedule(cfg, n)  # logged: what the loop logs as "lr"
    for s in range(n + 5):
        a, b = ours(nums, jnp.int32(s)), theirs(jnp.int32(s))
        assert a.dtype == b.dtype == np.float32, s
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0, err_msg=str(s))
        assert np.asarray(logged(s)).view(np.uint32) == np.asarray(a).view(np.uint32), s


@pytest.mark.parametrize("max_grad_norm", [0.5, 100.0, None])  # clipped, not clipped, no clipping
def test_the_gradients_factor_is_applied_once_with_or_without_clipping(max_grad_norm):
    """The train step hands the optimizer its summed gradients and ``grad_scale`` (one over the token
    count): the update equals optax's clipping and AdamW on the gradients times that factor."""
    import jax.numpy as jnp
    import optax

    from named.trainer.loop.optim import build_optimizer

    # an epsilon as large as the gradients: AdamW's first update then shows their size, so clipping's
    cfg = OptimizerConfig(
        schedule="constant", learning_rate=1e-2, warmup_steps=0, epsilon=1.0, max_grad_norm=max_grad_norm
    )
    params = {"w": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3)}
    sums = {"w": jnp.array([[3.0, -1.0, 2.0], [0.5, 4.0, -2.0]]), "bias": jnp.array([1.0, -3.0, 0.25])}
    factor = 1 / 7.0  # seven tokens
    ours = build_optimizer(cfg, 10)
    got, _ = ours.update(sums, ours.init(params), params, grad_scale=jnp.float32(factor))
    clip = [] if max_grad_norm is None else [optax.clip_by_global_norm(max_grad_norm)]
    reference = optax.chain(
        *clip,
        optax.adamw(1e-2, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.epsilon, weight_decay=cfg.weight_decay, mask=decay_mask),
    )
    want, _ = reference.update(jax.tree.map(lambda g: g * factor, sums), reference.init(params), params)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=0, err_msg=k)
    if max_grad_norm == 0.5:  # clipping did act: the update is not the unclipped one
        free = optax.adamw(
            1e-2, b1=cfg.beta1, b2=cfg.beta2, eps=cfg.epsilon, weight_decay=cfg.weight_decay, mask=decay_mask
        )
        unclipped, _ = free.update(jax.tree.map(lambda g: g * factor, sums), free.init(params), params)
        assert not np.allclose(got["w"], unclipped["w"], rtol=1e-3)
