"""LoRA: ``named.nn.lora`` (adapters as named arrays, inside ``Stacked`` too) and the trainer's
``lora:`` section (adapters on the Hugging Face modules it names, the base frozen with no
gradients or optimizer state, resumed bitwise).

The library is compared with numpy on the same weights; the trainer runs ``named-train`` on a
tiny Llama saved by ``transformers`` (tests/_chat_folder.py), on 8 devices under FSDP. The
exports of LoRA runs (merged, PEFT) are in test_export.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _chat_folder import make_chat_folder
from safetensors.numpy import load_file

import named as nm
from named import nn
from named.models import hf_state_dict
from named.trainer import checkpoint as ckpt
from named.trainer.commands.cli import main_train
from named.trainer.commands.sample import saved_model_config
from named.trainer.config import ConfigError, load_config
from named.trainer.loop.checks import checked_setup
from named.trainer.loop.model_init import model_shapes
from named.trainer.loop.optim import init_opt_state
from named.trainer.loop.registry import model_class
from named.trainer.loop.train import train

E, H, D, M = nm.Axis("embed", 8), nm.Axis("heads", 2), nm.Axis("head_size", 3), nm.Axis("mlp", 5)
Batch = nm.Axis("batch", 4)


def _np(x: nm.NamedArray, *names: str) -> np.ndarray:
    return np.asarray(x.rearrange(names).array, np.float64)


# ---- the library ------------------------------------------------------------------------------


def test_a_lora_linear_starts_as_its_base_and_adds_scaled_a_times_b():
    lin = nn.Linear.init(E, (H, D), key=jax.random.key(0))
    lora = nn.LoraLinear.init(lin, 2, alpha=6.0, key=jax.random.key(1))
    assert lora.lora_a.axes == (E, nm.Axis(nn.lora.RANK, 2)) and lora.lora_b.axes == (nm.Axis(nn.lora.RANK, 2), H, D)
    assert not np.any(np.asarray(lora.lora_b.array))  # B = 0: the update starts at nothing
    assert np.all(np.abs(np.asarray(lora.lora_a.array)) <= 1 / math.sqrt(E.size))  # PEFT's kaiming-uniform bound
    x = nm.random.normal(jax.random.key(2), (Batch, E))
    np.testing.assert_array_equal(np.asarray(lora(x).array), np.asarray(lin(x).array))

    lora = eqx.tree_at(lambda m: m.lora_b, lora, nm.random.normal(jax.random.key(3), lora.lora_b.axes))
    w = _np(lin.weight, "embed", "heads", "head_size").reshape(8, 6)
    a, b = _np(lora.lora_a, "embed", "lora_rank"), _np(lora.lora_b, "lora_rank", "heads", "head_size").reshape(2, 6)
    bias = _np(lin.bias, "heads", "head_size").reshape(6)
    expected = _np(x, "batch", "embed") @ (w + 3.0 * a @ b) + bias  # scale = alpha / rank = 3
    np.testing.assert_allclose(
        _np(lora(x), "batch", "heads", "head_size").reshape(4, 6), expected, rtol=1e-5, atol=1e-5
    )
    merged = lora.merged()
    assert type(merged) is nn.Linear and merged.weight.axes == lin.weight.axes
    np.testing.assert_allclose(
        _np(merged(x), "batch", "heads", "head_size").reshape(4, 6), expected, rtol=1e-5, atol=1e-5
    )


class _Block(eqx.Module):
    up: nn.Linear
    down: nn.Linear

    @staticmethod
    def init(*, key):
        k1, k2 = jax.random.split(key)
        return _Block(nn.Linear.init(E, M, key=k1), nn.Linear.init(M, E, key=k2))

    def __call__(self, x):
        return x + self.down(nm.relu(self.up(x)))


def _randomised_b(model, key):
    """The adapters' B drawn at random (as after training), so that they change the output."""

    def node(m):
        if isinstance(m, nn.LoraLinear):
            return eqx.tree_at(lambda lin: lin.lora_b, m, nm.random.normal(key, m.lora_b.axes) * 0.3)
        return m

    return jax.tree.map(node, model, is_leaf=lambda m: isinstance(m, nn.LoraLinear))


def test_adapters_in_a_stack_are_per_layer_and_merge_folds_them():
    Layers = nm.Axis("layers", 3)
    stack = nn.Stacked.init(Layers, _Block.init, key=jax.random.key(0))
    x = nm.random.normal(jax.random.key(1), (Batch, E))
    adapted = nn.lora.apply(stack, ["up", "stacked.down"], rank=2, alpha=4.0, key=jax.random.key(2))
    up = adapted.stacked.up
    assert up.lora_a.axes == (Layers, E, nm.Axis("lora_rank", 2)) and up.lora_b.axes == (
        Layers,
        nm.Axis("lora_rank", 2),
        M,
    )
    assert not np.allclose(np.asarray(up.lora_a.array[0]), np.asarray(up.lora_a.array[1]))  # each layer its own draw
    np.testing.assert_array_equal(np.asarray(adapted.fold(x).array), np.asarray(stack.fold(x).array))

    adapted = _randomised_b(adapted, jax.random.key(3))
    h = _np(x, "batch", "embed")
    for i in range(Layers.size):  # numpy, layer by layer: W + 2 A B for both projections
        layer = adapted.get_layer(i)
        w_up = _np(layer.up.linear.weight, "embed", "mlp") + 2 * _np(layer.up.lora_a, "embed", "lora_rank") @ _np(
            layer.up.lora_b, "lora_rank", "mlp"
        )
        w_dn = _np(layer.down.linear.weight, "mlp", "embed") + 2 * _np(layer.down.lora_a, "mlp", "lora_rank") @ _np(
            layer.down.lora_b, "lora_rank", "embed"
        )
        u = np.maximum(h @ w_up + _np(layer.up.linear.bias, "mlp"), 0)
        h = h + u @ w_dn + _np(layer.down.linear.bias, "embed")
    np.testing.assert_allclose(_np(adapted.fold(x), "batch", "embed"), h, rtol=1e-5, atol=1e-5)
    merged = nn.lora.merge(adapted)
    assert not any(
        isinstance(m, nn.LoraLinear) for m in jax.tree.leaves(merged, is_leaf=lambda m: isinstance(m, nn.LoraLinear))
    )
    np.testing.assert_allclose(_np(merged.fold(x), "batch", "embed"), h, rtol=1e-5, atol=1e-5)


def test_only_the_adapters_are_trainable_and_get_gradients():
    stack = nn.Stacked.init(nm.Axis("layers", 2), _Block.init, key=jax.random.key(0))
    adapted = _randomised_b(nn.lora.apply(stack, "up", rank=2, key=jax.random.key(1)), jax.random.key(2))
    params, frozen = eqx.partition(adapted, nn.lora.trainable(adapted), is_leaf=nm.is_named_array)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params, is_leaf=nm.is_named_array)]
    assert paths == [".stacked.up.lora_a", ".stacked.up.lora_b"]
    x = nm.random.normal(jax.random.key(3), (Batch, E))

    def loss(p):
        return (eqx.combine(p, frozen, is_leaf=nm.is_named_array).fold(x) ** 2).sum().scalar()

    grads = jax.grad(loss)(params)
    assert jax.tree.structure(grads, is_leaf=nm.is_named_array) == jax.tree.structure(params, is_leaf=nm.is_named_array)
    assert all(np.any(np.asarray(g.array)) for g in jax.tree.leaves(grads, is_leaf=nm.is_named_array))


def test_lora_dropout_needs_its_keys_and_is_off_without_them():
    stack = nn.Stacked.init(nm.Axis("layers", 2), _Block.init, key=jax.random.key(0))
    adapted = _randomised_b(nn.lora.apply(stack, "up", rank=2, dropout=0.5, key=jax.random.key(1)), jax.random.key(2))
    no_dropout = _randomised_b(nn.lora.apply(stack, "up", rank=2, key=jax.random.key(1)), jax.random.key(2))
    x = nm.random.normal(jax.random.key(3), (Batch, E))
    plain = np.asarray(no_dropout.fold(x).array)
    np.testing.assert_array_equal(np.asarray(adapted.fold(x).array), plain)  # inference: no keys, no dropout
    k1, k2 = (nn.lora.with_dropout_keys(adapted, jax.random.key(s)) for s in (7, 8))
    assert k1.stacked.up.dropout_key.axes == (nm.Axis("layers", 2),)  # one key per layer
    out1, out2 = np.asarray(k1.fold(x).array), np.asarray(k2.fold(x).array)
    assert not np.allclose(out1, plain) and not np.allclose(out1, out2)
    np.testing.assert_array_equal(np.asarray(nn.lora.with_dropout_keys(adapted, jax.random.key(7)).fold(x).array), out1)


def test_the_library_refuses_bad_targets_and_ranks_naming_the_layer():
    stack = nn.Stacked.init(nm.Axis("layers", 2), _Block.init, key=jax.random.key(0))
    with pytest.raises(nm.NamedError, match=r"\['q_proj'\] match no Linear.*stacked.up, stacked.down"):
        nn.lora.apply(stack, ["up", "q_proj"], rank=2, key=jax.random.key(0))
    for rank in (0, 6, 2.0):  # mlp=5 is up's smaller side
        with pytest.raises(nm.NamedError, match=rf"rank {rank!r} for stacked.up.*smaller side, 5"):
            nn.lora.apply(stack, "up", rank=rank, key=jax.random.key(0))
    once = nn.lora.apply(stack, "up", rank=2, key=jax.random.key(0))
    with pytest.raises(nm.NamedError, match="stacked.up already have adapters"):
        nn.lora.apply(once, "up", rank=2, key=jax.random.key(0))


# ---- the trainer ------------------------------------------------------------------------------

TARGETS = ["q_proj", "v_proj", "down_proj"]
RANK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_chat_folder(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="module")
def yaml_file(folder, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lora")
    (d / "text.txt").write_text("The quick brown fox jumps over the lazy dog. Paris is the capital of France.\n" * 60)
    config = {
        "trainer": {
            "num_train_steps": 4,
            "train_batch_size": 8,
            "log_interval": 1,
            "eval_interval": 0,
            "progress_bar": False,
            "run_dir": str(d / "run"),
        },
        "model": {"init_from_hf": str(folder)},
        "optimizer": {"learning_rate": 1e-2, "warmup_steps": 0, "schedule": "constant"},
        "data": {"train": [str(d / "text.txt")], "seq_len": 32, "val_fraction": 0, "cache_dir": str(d / "cache")},
        "mesh": {"shape": {"data": 8}, "param_mapping": {"embed": "data"}},
        "checkpoint": {"interval": 2, "keep_last": 2},
        "tracker": {"console": False},
        "lora": {"rank": RANK, "alpha": 8, "dropout": 0.1, "targets": TARGETS},
    }
    path = d / "lora.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def lora_run(yaml_file) -> Path:
    """A LoRA fine-tune by the command line, as a user runs it."""
    assert main_train(["--config_path", str(yaml_file)]) == 0
    return yaml_file.parent / "run"


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def _restored(run_dir: Path, step: int | None = None):
    cfg, model_cfg = load_config(run_dir / "config.yaml"), saved_model_config(run_dir)
    shapes = model_shapes(cfg, model_class(model_cfg), model_cfg)
    target = (shapes, jax.eval_shape(lambda m: init_opt_state(cfg, m), shapes))
    path = run_dir if step is None else run_dir / "checkpoints" / f"step_{step}"
    return ckpt.restore(path, target)[0]


def _base(model):
    """The model without its adapters (each LoraLinear's frozen Linear)."""
    return jax.tree.map(
        lambda m: m.linear if isinstance(m, nn.LoraLinear) else m, model, is_leaf=lambda m: isinstance(m, nn.LoraLinear)
    )


def test_a_lora_run_from_the_cli_trains_the_adapters_and_leaves_the_base_bitwise(lora_run, folder):
    losses = _losses(lora_run)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.05
    model, _ = _restored(lora_run)
    saved = load_file(folder / "model.safetensors")
    base = hf_state_dict(_base(model))
    assert sorted(base) == sorted(saved)
    for name, value in saved.items():
        np.testing.assert_array_equal(base[name], value, err_msg=name)  # frozen: not one bit moved
    adapted = [
        m
        for m in jax.tree.leaves(model, is_leaf=lambda m: isinstance(m, nn.LoraLinear))
        if isinstance(m, nn.LoraLinear)
    ]
    assert len(adapted) == len(TARGETS)
    assert all(np.abs(np.asarray(m.lora_b.array)).max() > 0 for m in adapted)  # trained away from B = 0


def _adapter_bytes(folder: Path) -> int:
    """Bytes of the adapters, from the folder's config.json alone: per layer and target, r·(in + out) float32s."""
    c = json.loads((folder / "config.json").read_text())
    hd = c["hidden_size"] // c["num_attention_heads"]
    sides = {
        "q_proj": (c["hidden_size"], c["num_attention_heads"] * hd),
        "v_proj": (c["hidden_size"], c["num_key_value_heads"] * hd),
        "down_proj": (c["intermediate_size"], c["hidden_size"]),
    }
    return c["num_hidden_layers"] * sum(RANK * (i + o) for i, o in (sides[t] for t in TARGETS)) * 4


def test_the_optimizer_state_holds_only_the_adapters(lora_run, folder):
    commit = ckpt.read_commit(ckpt.latest_checkpoint(lora_run))
    arrays = [r for r in commit["leaves"] if r["kind"] == "array" and r["shape"]]
    opt = [r for r in arrays if r["path"].startswith("[1]")]
    model = [r for r in arrays if r["path"].startswith("[0]")]

    def nbytes(records):
        return sum(math.prod(r["shape"]) * np.dtype(r["dtype"]).itemsize for r in records)

    assert len(opt) == 2 * 2 * len(TARGETS)  # mu and nu of each A and B
    assert all(r["path"].endswith(("lora_a", "lora_b")) for r in opt)
    assert nbytes(opt) == 2 * _adapter_bytes(folder)  # two Adam moments of the adapters, nothing else
    assert nbytes(model) == sum(v.nbytes for v in load_file(folder / "model.safetensors").values()) + _adapter_bytes(
        folder
    )


def test_a_resumed_lora_run_is_bitwise_the_uninterrupted_one(lora_run, yaml_file, tmp_path):
    split = tmp_path / "split"
    first = train(load_config(yaml_file, ["--trainer.run_dir", str(split), "--trainer.num_train_steps", "2"]))
    second = train(load_config(yaml_file, ["--trainer.run_dir", str(split)]))
    assert first.losses + second.losses == _losses(lora_run)
    whole, resumed = _restored(lora_run), _restored(split)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bfloat16_base_keeps_adapters_and_norms_in_float32(yaml_file, folder, tmp_path):
    cfg = load_config(
        yaml_file,
        [
            "--trainer.run_dir",
            str(tmp_path / "bf16"),
            "--trainer.num_train_steps",
            "2",
            "--lora.base_dtype",
            "bfloat16",
        ],
    )
    result = train(cfg)
    assert all(math.isfinite(x) for x in result.losses)
    model = result.model
    dtypes = {
        jax.tree_util.keystr(p): x.dtype
        for p, x in jax.tree_util.tree_leaves_with_path(model, is_leaf=nm.is_named_array)
    }
    assert dtypes[".layers.stacked.self_attn.q_proj.linear.weight"] == jnp.bfloat16
    assert dtypes[".embed_tokens.weight"] == jnp.bfloat16
    assert dtypes[".layers.stacked.self_attn.q_proj.lora_a"] == jnp.float32
    assert dtypes[".layers.stacked.input_layernorm.weight"] == jnp.float32
    # laid out by the parameter mapping: A of an embed -> ... projection is split over the 8 devices
    a = model.layers.stacked.self_attn.q_proj.lora_a
    assert a.axes[1].name == "embed" and tuple(a.array.sharding.spec)[:2] == (None, "data")
    assert len(a.array.sharding.device_set) == 8
    saved = load_file(folder / "model.safetensors")
    base = hf_state_dict(_base(model))
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.embed_tokens.weight"):
        np.testing.assert_array_equal(base[name], saved[name].astype(jnp.bfloat16), err_msg=name)


def test_bad_lora_sections_are_refused_before_anything_is_written(yaml_file, tmp_path):
    run = tmp_path / "run"

    def refused(match, *args):
        with pytest.raises(ConfigError, match=match):
            train(load_config(yaml_file, ["--trainer.run_dir", str(run), *args]))
        assert not run.exists()

    refused(
        r"lora.targets: 'c_attn', 'wq' are not a linear module of the llama model; its linear modules: "
        r"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        "--lora.targets",
        "[q_proj, c_attn, wq]",
    )
    refused(r"lora.rank must be >= 1, got 0", "--lora.rank", "0")
    # v_proj maps hidden 32 -> kv_heads 2 x head_size 8 = 16
    refused(
        r"lora.rank=17 is larger than v_proj \(layers.stacked.self_attn.v_proj: in 32, out 16\)", "--lora.rank", "17"
    )
    refused(r"lora.base_dtype must be one of float32, bfloat16", "--lora.base_dtype", "float16")
    refused(r"lora.dropout must be in \[0, 1\)", "--lora.dropout", "1.0")
    refused(r"lora.targets must be non-empty", "--lora.targets", "[]")


def test_gpt2_targets_are_its_hf_module_names():
    cfg = load_config(
        "config/gpt2_nano.yaml",
        ["--lora.targets", "[c_attn, c_proj]", "--lora.rank", "2", "--trainer.sample_interval", "0"],
    )
    s = checked_setup(cfg)
    block = s.shapes.blocks.stacked
    # c_proj names both projections, as in PEFT's target_modules (attn.c_proj and mlp.c_proj)
    assert all(isinstance(m, nn.LoraLinear) for m in (block.attn.c_attn, block.attn.c_proj, block.mlp.down))
    assert isinstance(block.mlp.up, nn.Linear)  # c_fc, not targeted
    with pytest.raises(ConfigError, match="its linear modules: c_attn, c_proj, c_fc"):
        checked_setup(load_config("config/gpt2_nano.yaml", ["--lora.targets", "[q_proj]"]))


def test_named_plan_counts_the_adam_state_of_the_adapters_alone():
    from named.trainer.commands.plan import plan_report

    cfg = load_config("config/llama_tiny.yaml", ["--lora", "{rank: 2, targets: [q_proj, o_proj]}"])
    m = cfg.model
    heads = m.num_attention_heads * (m.head_dim or m.hidden_size // m.num_attention_heads)
    n = m.num_hidden_layers * 2 * 2 * (m.hidden_size + heads)  # q and o, each r * (in + out)
    report = plan_report(cfg)
    assert f"for the {n:,} trainable parameters (lora rank 2; {2 * 4 * n / 2**20:.2f} MiB in all)" in report
