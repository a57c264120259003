"""``nn.gather_per_use``: FSDP weights gathered where each Linear uses them, their gradients
reduce-scattered there (the trainer's ``mesh.gather: per_use``).

Checked on the 8-device FSDP mesh against a plain-jnp reference (values and every gradient),
in the compiled program (one reduce-scatter per weight, and a smaller temp than GSPMD's step),
and where the rule does not apply (tensor parallelism) the layer computes as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import named as nm
from named import Axis, nn

Batch, Embed, Mlp, Layers = Axis("batch", 16), Axis("embed", 64), Axis("mlp", 256), Axis("layers", 3)
FSDP = ({"data": 8}, {"embed": "data"}, {"batch": "data"})


class Block(eqx.Module):
    up: nn.Linear
    down: nn.Linear

    @staticmethod
    def init(*, key):
        k1, k2 = jax.random.split(key)
        return Block(nn.Linear.init(Embed, Mlp, key=k1), nn.Linear.init(Mlp, Embed, key=k2, out_first=True))

    def __call__(self, x):
        return x + self.down(nm.tanh(self.up(x)))


def _model(remat: str = "full"):
    stack = nn.Stacked.init(Layers, Block.init, key=jax.random.PRNGKey(0), remat=remat)
    # non-zero biases, so that their gradients are checked too
    return jax.tree.map(
        lambda w: w + 0.1 if isinstance(w, jax.Array) and w.ndim == 2 else w, stack, is_leaf=eqx.is_array
    )


def _x():
    v = np.random.default_rng(1).standard_normal((Batch.size, Embed.size)).astype(np.float32)
    return nm.named(jnp.asarray(v), (Batch, Embed))


def _loss(stack, x):
    y = stack.fold(x)
    return (y * y).sum().scalar() / Batch.size


def _reference(raw, x):
    """The same stack in plain jnp, one device: up weight [layers, embed, mlp], down [layers, embed, mlp]
    (out_first: torch's [out, in] order)."""

    def loss(raw, x):
        for i in range(Layers.size):
            h = jnp.tanh(x @ raw["up_w"][i] + raw["up_b"][i])
            x = x + h @ raw["down_w"][i].T + raw["down_b"][i]
        return jnp.sum(x * x) / Batch.size

    return jax.value_and_grad(loss)(raw, x)


def _raw(stack):
    b = stack.stacked
    return {
        "up_w": b.up.weight.rearrange(("layers", "embed", "mlp")).array,
        "up_b": b.up.bias.array,
        "down_w": b.down.weight.rearrange(("layers", "embed", "mlp")).array,
        "down_b": b.down.bias.array,
    }


def _run(gather: bool, mapping=FSDP, remat: str = "full"):
    mesh_shape, param_map, compute = mapping
    mesh = nm.make_mesh(mesh_shape)
    stack = nm.shard(_model(remat), param_map, mesh)

    def step(stack, x):
        with nn.gather_per_use(param_map if gather else None):
            return eqx.filter_value_and_grad(_loss)(stack, x)

    fn = nm.named_jit(step, mapping=compute, mesh=mesh, out_mapping=param_map)
    return fn(stack, _x()), fn, (stack, _x())


@pytest.mark.parametrize("remat", ["full", "none"])
def test_values_and_gradients_equal_a_plain_reference(remat):
    (value, grads), _, _ = _run(True, remat=remat)
    want_value, want = _reference(_raw(_model()), _x().array)
    assert abs(float(value) - float(want_value)) <= 1e-5 * abs(float(want_value))
    got = _raw(grads)
    for k in want:
        err = float(jnp.max(jnp.abs(got[k] - want[k])) / jnp.max(jnp.abs(want[k])))
        assert err < 1e-5, (k, err)
    # the gradients come out split like the weights
    assert nm.layout(grads.stacked.up.weight) == "layers embed/data mlp"


def test_each_weight_gradient_is_reduce_scattered_and_the_temp_is_smaller():
    reports = {}
    for gather in (False, True):
        _, fn, args = _run(gather)
        reports[gather] = nm.compiled_report(fn, *args)
    plain, per_use = reports[False], reports[True]
    # GSPMD on CPU all-reduces each layer's whole weight gradients and slices them
    assert plain.count("reduce-scatter", "data") == 0, str(plain)
    # per use: one reduce-scatter per weight and layer, and the weights are gathered twice per
    # layer (forward, and again in the backward pass; remat full recomputes the forward too)
    assert per_use.count("reduce-scatter", "data") == 2 * Layers.size, str(per_use)
    assert per_use.count("all-gather", "data") >= 2 * 2 * Layers.size, str(per_use)
    big = 4 * Embed.size * Mlp.size // 2  # half a whole weight gradient, in bytes
    assert not [c for c in per_use.collectives if c.kind == "all-reduce" and c.bytes >= big], str(per_use)
    assert per_use.memory["temp"] < plain.memory["temp"], (
        per_use.memory,
        plain.memory,
    )


def test_tensor_parallel_weights_compute_as_before():
    tp = (
        {"data": 4, "model": 2},
        {"embed": "data", "mlp": "model"},
        {"batch": "data", "mlp": "model"},
    )
    (value, grads), fn, args = _run(True, mapping=tp)
    (value0, grads0), fn0, args0 = _run(False, mapping=tp)
    assert float(value) == float(value0)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # no shard_map of ours in the program: the same collectives as without the context
    assert nm.compiled_report(fn, *args).count("reduce-scatter") == nm.compiled_report(fn0, *args0).count(
        "reduce-scatter"
    )


def test_a_bad_mapping_is_refused_before_tracing():
    with pytest.raises(nm.ArgumentTypeError, match="gather_per_use"):
        with nn.gather_per_use(["embed"]):
            pass


def test_the_trainer_refuses_per_use_in_explicit_mode():
    from test_bad_input import NANO

    from named.trainer.config import ConfigError, load_config

    assert load_config(NANO, ["--mesh.gather=per_use"]).mesh.gather == "per_use"
    with pytest.raises(ConfigError, match="mesh.gather: per_use is for mesh.mode: auto"):
        load_config(NANO, ["--mesh.gather=per_use", "--mesh.mode=explicit"])


def test_named_train_with_per_use_gathers_trains_as_with_gspmds(tmp_path_factory, tmp_path):
    # the trainer's key end to end: the same FSDP run (3 steps, one eval) with mesh.gather auto and per_use
    from test_loss_block import FSDP as FSDP_KEYS
    from test_loss_block import _run

    corpus = tmp_path_factory.mktemp("corpus")
    (corpus / "code.txt").write_text("\n".join(f"def g_{i}(a, b):\n    return a * {i} - b\n" for i in range(300)))
    losses, eval_loss = _run(corpus, tmp_path / "auto", "gpt2_nano.yaml", **FSDP_KEYS)
    per_use, per_use_eval = _run(
        corpus, tmp_path / "per_use", "gpt2_nano.yaml", **FSDP_KEYS, **{"mesh.gather": "per_use"}
    )
    assert len(per_use) == 3
    np.testing.assert_allclose(per_use, losses, rtol=1e-5)  # the loss, and through it every update
    np.testing.assert_allclose(per_use_eval, eval_loss, rtol=1e-5)
    # and the key reached the step: its layers' weight gradients are reduce-scattered, not all-reduced
    from test_loss_block import ROOT, TINY

    from named.trainer.commands.plan import train_step_report
    from named.trainer.config import load_config

    over = {
        **TINY["gpt2_nano.yaml"],
        **FSDP_KEYS,
        "data.seq_len": 32,
        "trainer.train_batch_size": 16,
        "trainer.sample_interval": 0,
    }
    args = [x for k, v in over.items() for x in (f"--{k}", str(v))]
    auto, use = (
        train_step_report(load_config(ROOT / "config/gpt2_nano.yaml", [*args, f"--mesh.gather={g}"]))
        for g in ("auto", "per_use")
    )
    assert use.count("reduce-scatter") > auto.count("reduce-scatter"), (
        auto.count("reduce-scatter"),
        use.count("reduce-scatter"),
    )


@pytest.mark.slow
@pytest.mark.procs
def test_one_full_size_weight_at_a_time_in_the_613m_step(tmp_path):
    """The backward pass makes a weight's gradient only once the input's cotangent is done (the
    gathered weight gone) and hands that cotangent on only once the gradient is reduce-scattered,
    so one full-size weight, gathered or as a gradient, is live at a time. docs/benchmarks.md
    section 4's 613M row (bench/memory.py: compiled on abstract inputs, nothing allocated), in a
    process of its own with XLA:CPU's default scheduler (the suite runs the plain one, under which
    both orders give 1.06): 1.060 x 16N/8 with that order, 1.079 without it."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["XLA_FLAGS"] = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
    row = "gpt2_48L_1024_b8_nested_per_use"
    cmd = [sys.executable, str(root / "bench" / "memory.py"), "--configs", row, "--out", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ratio = json.loads((tmp_path / "memory.json").read_text())["rows"][row]["ratio_peak_over_floor"]
    assert ratio < 1.07, ratio
