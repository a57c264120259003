"""Low-precision Linears (``nn.quantize``): fp8 with delayed scaling, int8 dynamic and int8
weight-only, each against a numpy reference of its rounding (ml_dtypes for the float8 formats)
and against the float Linear within the tolerances stated below; the fp8 state under the
trainer's optimizer; a GPT-2 trained with fp8 under FSDP on 8 devices against the float run.

Tolerances (relative L2 error against the float Linear, 64-term dot products of normal data):
e4m3 keeps 3 mantissa bits (a rounding error of at most 2^-4 of a value), so fp8 outputs are
within 6 %; e5m2 keeps 2 (2^-3) for the gradient, so fp8 gradients are within 12 %; int8 rounds
to 1/254 of a row's or channel's range, within 2 %.
"""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_trainer import CORPUS, FSDP, tiny_args

import named as nm
from named import Axis, nn
from named.models import Gpt2Config, Gpt2LMHeadModel, LlamaConfig, LlamaLMHeadModel
from named.trainer.config import ConfigError, OptimizerConfig, load_config
from named.trainer.loop.checks import checked_setup
from named.trainer.loop.optim import build_optimizer
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
Batch, Embed, Mlp, Layers = Axis("batch", 8), Axis("embed", 64), Axis("mlp", 32), Axis("layers", 2)
FP8_FWD_TOL, FP8_GRAD_TOL, INT8_TOL = 0.06, 0.12, 0.02


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def np_fp8(a, amax: float, dtype) -> np.ndarray:
    """``a`` as the fp8 matmul sees it: scaled so ``amax`` is the format's largest value, rounded
    (saturating) to ``dtype``, scaled back."""
    top = float(ml_dtypes.finfo(dtype).max)
    s = np.float32(amax) / np.float32(top)
    return np.clip(np.asarray(a, np.float32) / s, -top, top).astype(dtype).astype(np.float32) * s


def np_int8(a, axis: int):
    """Symmetric int8 with one scale per slice along ``axis`` (the contracted one)."""
    a = np.asarray(a, np.float32)
    amax = np.abs(a).max(axis=axis, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1))
    return np.clip(np.round(a / s), -127, 127), s


@pytest.fixture(scope="module")
def data():
    k = jax.random.split(jax.random.key(0), 4)
    lin = nn.Linear.init(Embed, Mlp, key=k[0])
    lin = eqx.tree_at(lambda m: m.bias, lin, nm.random.normal(k[1], (Mlp,)) * 0.1)
    x = nm.random.normal(k[2], (Batch, Embed))
    r = nm.random.normal(k[3], (Batch, Mlp))  # the output's cotangent in loss = sum(y * r)
    return lin, x, r


def with_history(layer: nn.Fp8Linear, **amax) -> nn.Fp8Linear:
    """``layer`` with an amax of ``amax[name]`` one step back in the history ``name`` (x, w or g)."""
    for name, value in amax.items():
        old = getattr(layer.fp8, name)
        layer = eqx.tree_at(lambda m: getattr(m.fp8, name), layer, nm.named(old.array.at[1].set(value), old.axes))
    return layer


# ---- fp8 --------------------------------------------------------------------------------------------


def test_fp8_forward_rounds_as_numpy_with_delayed_scales(data):
    lin, x, _ = data
    w = np.asarray(lin.weight.array)
    # scales below the tensors' maxima: some entries saturate, as a delayed scale lets them
    q = with_history(nn.quantize(lin, "fp8"), x=2.0, w=0.8 * float(np.abs(w).max()))
    want = np_fp8(x.array, 2.0, E4M3) @ np_fp8(w, 0.8 * np.abs(w).max(), E4M3) + np.asarray(lin.bias.array)
    for y in (q(x), eqx.filter_jit(lambda m, v: m(v))(q, x)):
        assert y.axes == (Batch, Mlp)
        np.testing.assert_allclose(y.array, want, rtol=1e-5, atol=1e-5)


def test_fp8_first_call_scales_by_its_own_amax_and_tracks_float(data):
    lin, x, _ = data
    q = nn.quantize(lin, "fp8")  # empty histories
    w = np.asarray(lin.weight.array)
    want = np_fp8(x.array, np.abs(x.array).max(), E4M3) @ np_fp8(w, np.abs(w).max(), E4M3) + np.asarray(lin.bias.array)
    np.testing.assert_allclose(q(x).array, want, rtol=1e-5, atol=1e-5)
    assert rel(q(x).array, lin(x).array) < FP8_FWD_TOL


def test_fp8_gradients_are_e5m2_straight_through(data):
    lin, x, r = data
    amax_g = 0.5 * float(np.abs(r.array).max())
    q = with_history(nn.quantize(lin, "fp8"), g=amax_g)

    def loss(m, v):
        return (m(v) * r).sum().scalar()

    gm, gx = jax.grad(loss, argnums=(0, 1))(q, x)
    w = np.asarray(lin.weight.array)
    xq, wq = np_fp8(x.array, np.abs(x.array).max(), E4M3), np_fp8(w, np.abs(w).max(), E4M3)
    gq = np_fp8(r.array, amax_g, E5M2)
    np.testing.assert_allclose(gx.array, gq @ wq.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gm.weight.array, xq.T @ gq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gm.bias.array, np.asarray(r.array).sum(0), rtol=1e-6)
    fm, fx = jax.grad(loss, argnums=(0, 1))(lin, x)
    gm, gx = jax.grad(loss, argnums=(0, 1))(nn.quantize(lin, "fp8"), x)  # scaled by its own amax: nothing saturates
    assert rel(gx.array, fx.array) < FP8_GRAD_TOL and rel(gm.weight.array, fm.weight.array) < FP8_GRAD_TOL


def test_fp8_under_a_bf16_policy_keeps_its_state_float32(data):
    lin, x, _ = data
    half = nn.cast_for_compute(nn.quantize(lin, "fp8"), "bf16")
    assert half.weight.dtype == jnp.bfloat16 and half.fp8.x.dtype == jnp.float32
    y = half(x.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and rel(y.array.astype(np.float32), lin(x).array) < FP8_FWD_TOL


def test_fp8_state_after_steps_holds_the_observed_maxima():
    """Five AdamW steps (the trainer's optimizer: clipping, weight decay) of a two-layer stack
    with a history of four: each layer's histories are its last four amaxes of input, weight and
    output gradient, newest first, untouched by decay or moments."""
    keys = jax.random.split(jax.random.key(1), 12)
    stack = nn.quantize(
        nn.Stacked.init(Layers, nn.Linear.init, Embed, Mlp, key=keys[0]), nn.QuantConfig("fp8", history=4)
    )
    assert stack.stacked.fp8.x.axes == (Layers, Axis("amax_history", 4))
    opt = build_optimizer(OptimizerConfig(learning_rate=0.05, weight_decay=0.1, schedule="constant"), 10)
    opt_state = opt.init(stack)
    float_state = opt.init(nn.Stacked.init(Layers, nn.Linear.init, Embed, Mlp, key=keys[0]))
    assert len(jax.tree.leaves(opt_state)) == len(jax.tree.leaves(float_state))  # no moments for the state

    def loss(m, x, r):
        return (m.vmap(x) * r).sum().scalar()  # every layer on the same x: each one's cotangent is r[layer]

    @eqx.filter_jit
    def step(m, s, x, r):
        g = jax.grad(loss)(m, x, r)
        u, s = opt.update(g, s, m)
        return eqx.apply_updates(m, u), s

    seen = {"x": [], "w": [], "g": []}
    for t in range(5):
        x = nm.random.normal(keys[2 + 2 * t], (Batch, Embed)) * (t + 1)
        r = nm.random.normal(keys[3 + 2 * t], (Layers, Batch, Mlp)) * 10.0**-t
        seen["x"].append([float(np.abs(x.array).max())] * 2)
        seen["w"].append(np.abs(np.asarray(stack.stacked.weight.array)).max(axis=(1, 2)))
        seen["g"].append(np.abs(np.asarray(r.array)).max(axis=(1, 2)))
        stack, opt_state = step(stack, opt_state, x, r)
    for name, maxima in seen.items():
        want = np.asarray(maxima[::-1][:4]).T  # (layers, history), newest first
        np.testing.assert_allclose(getattr(stack.stacked.fp8, name).array, want, rtol=1e-6, err_msg=name)
    np.testing.assert_array_equal(stack.stacked.fp8.probe.array, 1.0)


def test_accumulated_gradients_give_the_mean_of_the_calls(data):
    """Two microbatches' gradients summed and divided by a token count, as the train step does:
    the new history starts with the mean of the two amaxes; a layer not called keeps its state."""
    lin, x, r = data
    q = nn.quantize(lin, "fp8")

    def grad(v):
        return jax.grad(lambda m: (m(v) * r).sum().scalar())(q)

    g = jax.tree.map(lambda a, b: (a + b) / 37.0, grad(x), grad(x * 3))
    u = nn.overwrite_updates(nn.without_overwrites(g), g, q)
    new = eqx.apply_updates(q.fp8, u.fp8)
    amax = float(np.abs(x.array).max())
    np.testing.assert_allclose(new.x.array[:2], [(amax + 3 * amax) / 2, 0.0], rtol=1e-6)
    zero = jax.tree.map(jnp.zeros_like, g)
    unused = nn.overwrite_updates(nn.without_overwrites(zero), zero, q)
    assert all(float(jnp.abs(v).max()) == 0 for v in jax.tree.leaves(unused.fp8))


# ---- int8 -------------------------------------------------------------------------------------------


def test_int8_dynamic_rounds_per_token_and_channel_with_float_gradients(data):
    lin, x, r = data
    q = nn.quantize(lin, "int8")
    qx, sx = np_int8(x.array, axis=1)  # per token: one scale per row of x
    qw, sw = np_int8(lin.weight.array, axis=0)  # per output channel: one per column of w
    want = (qx @ qw) * sx * sw + np.asarray(lin.bias.array)
    np.testing.assert_allclose(q(x).array, want, rtol=1e-5, atol=1e-5)
    assert rel(q(x).array, lin(x).array) < INT8_TOL

    def loss(m, v):
        return (m(v) * r).sum().scalar()

    (gq, gxq), (gf, gxf) = jax.grad(loss, argnums=(0, 1))(q, x), jax.grad(loss, argnums=(0, 1))(lin, x)
    np.testing.assert_allclose(gxq.array, gxf.array, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gq.weight.array, gf.weight.array, rtol=1e-6, atol=1e-6)


def test_int8_weight_only_forward_and_bytes(data):
    lin, x, _ = data
    q = nn.quantize(lin, "int8_weight")
    qw, sw = np_int8(lin.weight.array, axis=0)
    np.testing.assert_allclose(
        q(x).array, np.asarray(x.array) @ (qw * sw) + np.asarray(lin.bias.array), rtol=1e-5, atol=1e-5
    )
    assert rel(q(x).array, lin(x).array) < INT8_TOL
    np.testing.assert_allclose(q.dequantized().array, qw * sw, rtol=1e-6)

    cfg = Gpt2Config(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=128)
    model = Gpt2LMHeadModel.init(cfg, key=jax.random.key(2))
    small = nn.quantize(model, "int8_weight")

    def weight_bytes(m, kind):
        layers = [v for v in jax.tree.leaves(m, is_leaf=lambda v: isinstance(v, kind)) if isinstance(v, kind)]
        return sum(v.weight.nbytes for v in layers), sum(v.scale.nbytes for v in layers if hasattr(v, "scale"))

    (f32, _), (i8, scales) = weight_bytes(model, nn.Linear), weight_bytes(small, nn.Int8WeightLinear)
    # per layer: c_attn 64x(3*64), c_proj 64x64, mlp up 64x256, down 256x64; a float32 scale per output channel
    n_weights = 2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64)
    n_channels = 2 * (192 + 64 + 256 + 64)
    assert (f32, i8, scales) == (4 * n_weights, n_weights, 4 * n_channels)
    ids = nm.named(jax.random.randint(jax.random.key(3), (2, 16), 0, 128), ("batch", "position"))
    assert rel(small(ids).array, model(ids).array) < INT8_TOL


# ---- whole models -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
    )
    model = LlamaLMHeadModel.init(cfg, key=jax.random.key(4))
    ids = nm.named(jax.random.randint(jax.random.key(5), (2, 16), 0, 128), ("batch", "position"))
    return model, ids


def _layers(model, kind):
    return [v for v in jax.tree.leaves(model, is_leaf=lambda v: isinstance(v, kind)) if isinstance(v, kind)]


def test_quantize_swaps_every_linear_of_a_model_inside_its_stack(llama):
    model, ids = llama
    n = len(_layers(model, nn.Linear))
    assert n == 7  # q, k, v, o, gate, up, down in the stack (the lm_head is an Embedding: it stays float)
    for kind, cls in (("fp8", nn.Fp8Linear), ("int8", nn.Int8Linear)):
        q = nn.quantize(model, kind)
        assert len(_layers(q, cls)) == n and not _layers(q, nn.Linear)
        # the logits compound the rounding of about ten matmuls in a row (two layers of q/k/v, o, gate/up, down)
        assert rel(q(ids).array, model(ids).array) < (0.2 if kind == "fp8" else 2 * INT8_TOL)
    fp8 = nn.quantize(model, "fp8")
    assert fp8.layers.stacked.mlp.up.fp8.x.axes[0] == fp8.layers.Layers  # one state per layer
    only_mlp = nn.quantize(model, nn.QuantConfig("int8", targets=(r"\.mlp\.",)))
    assert {type(only_mlp.layers.stacked.mlp.up), type(only_mlp.layers.stacked.self_attn.q_proj)} == {
        nn.Int8Linear,
        nn.Linear,
    }


def test_quantize_leaves_lora_adapted_linears_as_they_are(llama):
    model, ids = llama
    adapted = nn.lora.apply(model, "q_proj", rank=2, key=jax.random.key(6))
    q = nn.quantize(adapted, "int8")
    assert type(q.layers.stacked.self_attn.q_proj) is nn.LoraLinear
    assert type(q.layers.stacked.self_attn.q_proj.linear) is nn.Linear
    assert type(q.layers.stacked.self_attn.k_proj) is nn.Int8Linear


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda m: nn.quantize(m, nn.QuantConfig("fp8", targets=("mlp", "attn_typo"))),
            r"\['attn_typo'\] match no Linear.*layers.stacked.mlp.gate",
        ),
        (lambda m: nn.quantize(nn.quantize(m, "int8"), "fp8"), r"quantized already"),
        (lambda m: nn.quantize(m, "fp4"), r"kind 'fp4' is not one of fp8, int8, int8_weight"),
        (
            lambda m: nn.quantize(m, nn.QuantConfig("fp8", targets=("mlp[",))),
            r"target 'mlp\[' is not a regular expression",
        ),
        (lambda m: nn.quantize(m, nn.QuantConfig("fp8", targets=())), r"targets is empty"),
        (lambda m: nn.quantize(m, nn.QuantConfig("fp8", history=0)), r"history must be an integer >= 1"),
    ],
)
def test_quantize_errors_name_the_culprit(llama, call, match):
    with pytest.raises(nm.NamedError, match=match):
        call(llama[0])


def test_a_stacked_fp8_state_outside_its_stack_is_refused(llama):
    up = nn.quantize(llama[0], "fp8").layers.stacked.mlp.up  # weight and state still (layers, ...)
    x = nm.random.normal(jax.random.key(7), (Batch, Axis("embed", 64)))
    with pytest.raises(nm.AxisError, match="call it through its Stacked"):
        up(x)


# ---- the trainer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.txt").write_text(CORPUS)
    return d


def _yaml(tmp: Path, section: str) -> Path:
    path = tmp / "quant.yaml"
    path.write_text((ROOT / "config/gpt2_nano.yaml").read_text() + section)
    return path


def test_fp8_training_under_fsdp_tracks_the_float_run(corpus, tmp_path):
    """GPT-2 (2 layers, embed 32) on 8 devices, parameters split over embed (FSDP), 8 AdamW steps:
    each step's loss within 0.05 of the float run's (measured: about 0.01)."""
    steps = {"trainer.num_train_steps": 8, **FSDP}
    path = _yaml(tmp_path, "quantization:\n  kind: fp8\n  amax_history: 4\n")
    cfg = load_config(path, tiny_args(corpus, tmp_path / "fp8", **steps))
    assert cfg.quantization.kind == "fp8" and cfg.quantization.amax_history == 4
    fp8 = train(cfg)
    ref = train(load_config(ROOT / "config/gpt2_nano.yaml", tiny_args(corpus, tmp_path / "float", **steps)))
    assert len(fp8.losses) == 8 and np.max(np.abs(np.subtract(fp8.losses, ref.losses))) < 0.05, (fp8.losses, ref.losses)
    assert fp8.losses != ref.losses  # the fp8 path ran
    attn = fp8.model.blocks.stacked.attn.c_attn
    assert isinstance(attn, nn.Fp8Linear) and "data" in str(attn.weight.array.sharding.spec)
    # every layer's histories are full (8 steps >= 4) and positive
    for name in ("x", "w", "g"):
        assert float(getattr(attn.fp8, name).array.min()) > 0, name


def test_quantization_config_composes_with_lora_or_refuses(corpus, tmp_path):
    lora = {"lora.rank": 2, "lora.targets": "[c_attn]"}
    int8 = load_config(_yaml(tmp_path, "quantization:\n  kind: int8\n"), tiny_args(corpus, tmp_path / "r", **lora))
    block = checked_setup(int8).shapes.blocks.stacked
    assert type(block.attn.c_attn) is nn.LoraLinear and type(block.attn.c_attn.linear) is nn.Linear
    assert type(block.attn.c_proj) is nn.Int8Linear and type(block.mlp.up) is nn.Int8Linear
    fp8 = load_config(_yaml(tmp_path, "quantization:\n  kind: fp8\n"), tiny_args(corpus, tmp_path / "r", **lora))
    with pytest.raises(ConfigError, match=r"quantization.kind=fp8 with lora"):
        checked_setup(fp8)
    typo = load_config(
        _yaml(tmp_path, "quantization:\n  kind: int8\n  targets: [mlpp]\n"), tiny_args(corpus, tmp_path / "r")
    )
    with pytest.raises(ConfigError, match=r"^quantization.targets: .*\['mlpp'\] match no Linear"):
        checked_setup(typo)
