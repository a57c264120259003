"""Mixture of experts: the nn.MoE layer against a numpy reference (routing, dropless and dense
dispatch, shared expert, router losses against transformers' own), expert parallelism on the 8
fake devices (auto and explicit mode, with FSDP and TP) equal to one device with the all-to-alls
counted in the HLO, the Mixtral / Qwen3-MoE / Qwen2-MoE families against transformers (logits,
gradients, decoding, export, config.json), FLOPs of the active experts only, and expert-parallel
training from the shipped YAMLs equal to one device over 10 steps."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from _hf_models import _SMALL, forward, hf_logits, load_hf, named_ids, random_ids

import named as nm
from named import models, nn
from named.models import CheckpointFormatError
from named.trainer.commands import cli
from named.trainer.config import load_config
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]
Embed, Mlp, Experts = nm.Axis("embed", 16), nm.Axis("mlp", 24), nm.Axis("experts", 8)
Batch, Pos = nm.Axis("batch", 8), nm.Axis("position", 6)


# ---- the layer against numpy ------------------------------------------------------------------------


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _silu(z):
    return z / (1 + np.exp(-z))


def _arrays(moe: nn.MoE):
    e = moe.experts.stacked
    return (
        np.asarray(moe.router.weight.rearrange(("embed", "experts")).array),
        np.asarray(e.gate.weight.rearrange(("experts", "embed", "mlp")).array),
        np.asarray(e.up.weight.rearrange(("experts", "embed", "mlp")).array),
        np.asarray(e.down.weight.rearrange(("experts", "mlp", "embed")).array),
    )


def numpy_moe(moe: nn.MoE, x: np.ndarray) -> np.ndarray:
    """Token by token: its k experts by router probability, each run on it alone."""
    router, gate, up, down = _arrays(moe)
    logits = x @ router
    probs = _softmax(logits)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[: moe.top_k]
        w = _softmax(logits[t, top]) if moe.routing == "topk_softmax" else probs[t, top]
        if moe.routing == "softmax_topk" and moe.normalize:
            w = w / w.sum()
        for e, we in zip(top, w):
            y[t] += we * ((_silu(x[t] @ gate[e]) * (x[t] @ up[e])) @ down[e])
    if moe.shared_expert is not None:
        s = moe.shared_expert
        h = _silu(x @ np.asarray(s.gate.weight.array)) * (x @ np.asarray(s.up.weight.array))
        out = h @ np.asarray(s.down.weight.array)
        if moe.shared_expert_gate is not None:
            out = out / (1 + np.exp(-(x @ np.asarray(moe.shared_expert_gate.weight.array))))[:, None]
        y += out
    return y


def _layer(**kw) -> nn.MoE:
    return nn.MoE.init(Embed, Mlp, Experts, kw.pop("top_k", 2), key=jax.random.key(0), **kw)


def _tokens(seed=1) -> nm.NamedArray:
    return nm.random.normal(jax.random.key(seed), (Batch, Pos, Embed))


def _flat(y: nm.NamedArray) -> np.ndarray:
    return np.asarray(y.rearrange(("batch", "position", "embed")).array).reshape(-1, Embed.size)


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=2),
        dict(top_k=3, normalize=False),
        dict(top_k=2, routing="topk_softmax"),
        dict(top_k=1, shared_mlp=nm.Axis("mlp", 12), shared_gate=True),
        dict(top_k=2, shared_mlp=nm.Axis("mlp", 12)),
    ],
)
@pytest.mark.parametrize("dispatch", ["dropless", "dense"])
def test_layer_equals_numpy_token_by_token(kw, dispatch):
    moe = dataclasses.replace(_layer(**kw), dispatch=dispatch)
    x = _tokens()
    y, losses = eqx.filter_jit(lambda m, x: m(x))(moe, x)
    want = numpy_moe(moe, _flat(x))
    np.testing.assert_allclose(_flat(y), want, atol=1e-5, rtol=0)
    assert set(losses) == {"load_balancing", "router_z"}
    # top-k really selects: with every expert the answer is another one
    if kw.get("top_k") in (1, 2) and "shared_mlp" not in kw:
        every = dataclasses.replace(moe, top_k=Experts.size)
        assert np.abs(_flat(every(x)[0]) - want).max() > 1e-3


def test_router_losses_equal_transformers_and_st_moe():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    moe = _layer(top_k=2)
    x = _tokens(seed=2)
    _, losses = moe(x)
    logits = _flat(x) @ _arrays(moe)[0]
    theirs = load_balancing_loss_func((torch.tensor(logits),), Experts.size, 2)
    assert float(losses["load_balancing"]) == pytest.approx(float(theirs), rel=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    assert float(losses["router_z"]) == pytest.approx(float((lse**2).mean()), rel=1e-5)
    # the loss is k when the load is even and grows as it gathers on few experts
    even = nm.named(jnp.zeros((64, 8)), ("tokens", "experts"))
    ids = nm.named(jnp.stack([jnp.arange(64) % 8, (jnp.arange(64) + 1) % 8], -1), ("tokens", "topk"))
    assert float(nn.load_balancing_loss(nm.softmax(even, "experts"), ids)) == pytest.approx(2.0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(top_k=9), "top_k=9 must be an int in"),
        (dict(routing="sigmoid"), "routing='sigmoid'"),
        (dict(dispatch="capacity"), "dispatch='capacity'"),
        (dict(shared_gate=True), "shared_gate=True needs"),
    ],
)
def test_bad_settings_are_named(bad, match):
    with pytest.raises(nm.NamedError, match=match):
        _layer(**bad)


# ---- expert parallelism on 8 devices -----------------------------------------------------------------

EP = {  # name: (mesh, compute mapping, parameter mapping)
    "ep4 tokens over all": (
        {"data": 2, "expert": 4},
        {"batch": ("data", "expert"), "experts": "expert"},
        {"experts": "expert"},
    ),
    "ep4 + fsdp": (
        {"data": 2, "expert": 4},
        {"batch": ("data", "expert"), "experts": "expert"},
        {"experts": "expert", "embed": "data"},
    ),
    "ep4 tokens whole over expert": (
        {"data": 2, "expert": 4},
        {"batch": "data", "experts": "expert"},
        {"experts": "expert"},
    ),
    "ep8 over two mesh axes": (
        {"data": 2, "expert": 4},
        {"batch": ("data", "expert"), "experts": ("expert", "data")},
        {"experts": ("expert", "data")},
    ),
    "ep4 + tp inside experts": (
        {"expert": 4, "model": 2},
        {"batch": "expert", "experts": "expert", "mlp": "model"},
        {"experts": "expert", "mlp": "model"},
    ),
}


def _objective(m, x):
    y, losses = m(x)
    return jnp.sum(y.array**2) + losses["load_balancing"] + losses["router_z"], y


# The layer's output and the objective's gradient from one program (one compile per layout, not
# two): the output is the forward pass the gradient differentiates.
_output_and_grad = eqx.filter_grad(_objective, has_aux=True)


@pytest.fixture(scope="module")
def one_device():
    moe = _layer(top_k=2, shared_mlp=nm.Axis("mlp", 12), shared_gate=True)
    x = _tokens()
    g, y = eqx.filter_jit(_output_and_grad)(moe, x)
    return moe, x, y, g


def _sharded(moe, x, parallel, layout):
    shape, compute, param = EP[layout]
    mesh = nm.make_mesh(shape)
    m = dataclasses.replace(moe, parallel=parallel)
    with nm.set_mesh(mesh), nm.axis_mapping(compute):
        m = nm.shard(m, param)
        fwd = nm.named_jit(lambda m, x: m(x)[0], mapping=compute)
        both = nm.named_jit(_output_and_grad, mapping=compute)
        return m, mesh, fwd, both


@pytest.mark.parametrize("layout", list(EP))
@pytest.mark.parametrize("parallel", ["auto", "explicit"])
def test_expert_parallel_layer_equals_one_device(one_device, parallel, layout):
    moe, x, y1, g1 = one_device
    m, mesh, _, both = _sharded(moe, x, parallel, layout)
    with nm.set_mesh(mesh):
        g, y = both(m, x)
    experts_spec = m.experts.stacked.gate.weight.array.sharding.spec
    assert experts_spec[0] is not None, "the experts are not split: the test would prove nothing"
    np.testing.assert_allclose(_flat(y), _flat(y1), atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(g, is_leaf=nm.is_named_array), jax.tree.leaves(g1, is_leaf=nm.is_named_array)):
        np.testing.assert_allclose(
            np.asarray(a.rearrange(b.axes).array), np.asarray(b.array), atol=1e-5 * float(np.abs(b.array).max()), rtol=0
        )


@pytest.mark.parametrize("parallel", ["auto", "explicit"])
def test_the_hlo_holds_the_expected_all_to_alls(one_device, parallel):
    # forward: the rows out, their expert ids out, the results back; the gradient of the layer's
    # weights adds the transpose of the way back (the way out carries no weight). Auto mode's are
    # GSPMD's lowering of the sharding constraints. Each is a tuple of 4 pieces, one per device of
    # the expert axis (compiled_report names auto mode's groups by the whole mesh: it does not read
    # the "mesh[...] {'axis_2'}" form of replica groups, so the pieces are what is checked there).
    moe, x, _, _ = one_device
    m, mesh, fwd, both = _sharded(moe, x, parallel, "ep4 + fsdp")
    with nm.set_mesh(mesh):
        for fn, n in ((fwd, 3), (both, 4)):  # both: the gradient program (it returns the output too)
            a2a = [c for c in nm.compiled_report(fn, m, x).collectives if c.kind == "all-to-all"]
            assert len(a2a) == n, a2a
            assert all(len(re.findall(r"\w+\[[\d,]*\]", c.shape)) == 4 for c in a2a), a2a
            if parallel == "explicit":
                assert all(c.mesh_axes == ("expert",) for c in a2a), a2a
    # without experts in the mapping there is none: each device's tokens go through whole experts
    compute = {"batch": ("data", "expert")}
    with nm.set_mesh(mesh), nm.axis_mapping(compute):
        plain = nm.shard(dataclasses.replace(moe, parallel=parallel), {"embed": "data"})
        report = nm.compiled_report(nm.named_jit(lambda m, x: m(x)[0], mapping=compute), plain, x)
    assert not [c for c in report.collectives if c.kind == "all-to-all"]


# ---- the families against transformers --------------------------------------------------------------

MOE_CONFIGS = {
    "mixtral-window5-mqa5/1": (
        "MixtralConfig",
        dict(
            _SMALL,
            hidden_size=40,
            intermediate_size=24,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=8,
            num_local_experts=6,
            num_experts_per_tok=2,
            sliding_window=5,
        ),
    ),
    "qwen3moe-qknorm-normtopk": (
        "Qwen3MoeConfig",
        dict(
            _SMALL,
            hidden_size=36,
            intermediate_size=64,
            moe_intermediate_size=20,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
        ),
    ),
    "qwen2moe-shared-gated": (
        "Qwen2MoeConfig",
        dict(
            _SMALL,
            hidden_size=36,
            intermediate_size=64,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=28,
            num_attention_heads=6,
            num_key_value_heads=3,
            num_experts=5,
            num_experts_per_tok=2,
        ),
    ),
}
NAMES = list(MOE_CONFIGS)
# a setting of each test model's MoE layers that must show (changing it changes the logits)
FEATURES = {
    "mixtral-window5-mqa5/1": dict(top_k=1),
    "qwen3moe-qknorm-normtopk": dict(normalize=False),
    "qwen2moe-shared-gated": dict(shared_expert_gate=None),
}


def _transformers_model(name: str):
    """A transformers MoE model of MOE_CONFIGS, eager attention, weights perturbed as _hf_models.build does."""
    cls, kwargs = MOE_CONFIGS[name]
    torch.manual_seed(3)
    config = getattr(transformers, cls)(bos_token_id=0, eos_token_id=None, pad_token_id=None, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``pairs(name)``: (transformers model, its folder, our config, our model loaded from it)."""
    cache = {}

    def get(name):
        if name not in cache:
            hf = _transformers_model(name)
            folder = tmp_path_factory.mktemp(re.sub(r"[/:]", "-", name))
            hf.save_pretrained(folder)
            cache[name] = (hf, folder, *models.load_pretrained(folder))
        return cache[name]

    return get


def _fused(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint names (one tensor per expert, as files hold them) -> transformers' parameters
    in memory (each layer's experts in one gate_up_proj [E, 2I, D] and one down_proj [E, D, I])."""
    out, experts = {}, {}
    for name, v in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = v
        else:
            out[name] = v
    for base, parts in experts.items():
        gate, up, down = ("w1", "w3", "w2") if "w1" in parts else ("gate_proj", "up_proj", "down_proj")
        n = len(parts[gate])
        out[f"{base}.gate_up_proj"] = np.stack([np.concatenate([parts[gate][j], parts[up][j]]) for j in range(n)])
        out[f"{base}.down_proj"] = np.stack([parts[down][j] for j in range(n)])
    return out


def _loss(model, ids):
    logits = model(ids).rearrange(("batch", "position", "vocab")).array
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.take_along_axis(logp, ids.array[:, 1:, None], axis=-1).mean()


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_gradients_match_transformers(pairs, name):
    hf, _, config, model = pairs(name)
    assert type(config).__name__ == type(hf.config).__name__ and config.num_experts == hf.config.num_experts
    ids = random_ids(config.vocab_size, (2, 13))
    ours = np.asarray(forward(model, named_ids(ids)))
    diff = np.abs(ours - hf_logits(hf, ids)).max()
    print(f"\n{name}: max |logit difference| = {diff:.2e}")
    assert diff < 1e-4
    changed = eqx.tree_at(
        lambda m: m.layers.stacked.mlp, model, replace_fn=lambda moe: dataclasses.replace(moe, **FEATURES[name])
    )
    assert np.abs(np.asarray(forward(changed, named_ids(ids))) - ours).max() > 1e-3, f"{FEATURES[name]} has no effect"

    grad_ids = random_ids(config.vocab_size, (2, 13), seed=1)
    hf.zero_grad()
    loss = hf(torch.tensor(grad_ids, dtype=torch.long), labels=torch.tensor(grad_ids, dtype=torch.long)).loss
    loss.backward()
    our_loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(_loss))(model, named_ids(grad_ids))
    assert abs(float(our_loss) - loss.item()) < 1e-5
    ours_g, theirs = _fused(models.hf_state_dict(grads)), {n: p.grad.numpy() for n, p in hf.named_parameters()}
    assert set(ours_g) == set(theirs)
    errors = {n: float(np.abs(ours_g[n] - t).max() / np.abs(t).max()) for n, t in theirs.items()}
    print(f"{name}: worst relative gradient difference {max(errors.values()):.1e}")
    assert max(errors.values()) < 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_export_loads_back_in_transformers(pairs, name, tmp_path):
    hf, _, config, model = pairs(name)
    models.save_pretrained(model, config, tmp_path)
    files = json.loads((tmp_path / "config.json").read_text())
    again = load_hf(tmp_path)
    assert type(again) is type(hf)
    ids = random_ids(config.vocab_size, (2, 13), seed=2)
    np.testing.assert_allclose(hf_logits(again, ids), hf_logits(hf, ids), atol=1e-6, rtol=0)
    assert models.config_from_hf(tmp_path) == config
    assert models.num_params(config) == sum(p.numel() for p in hf.parameters())
    assert files["num_experts_per_tok"] == config.num_experts_per_tok


def test_greedy_decoding_equals_transformers(pairs):
    hf, _, config, model = pairs("mixtral-window5-mqa5/1")
    prompt = random_ids(config.vocab_size, (2, 5), seed=4)
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(prompt, dtype=torch.long),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            max_new_tokens=20,
            do_sample=False,
        ).numpy()
    ours = np.asarray(models.generate(model, named_ids(prompt), 20, temperature=0).array)
    np.testing.assert_array_equal(ours, ref)
    assert len(np.unique(ours[:, 5:])) > 8


@pytest.mark.parametrize(
    "name, field, value, expect",
    [
        ("qwen3moe-qknorm-normtopk", "mlp_only_layers", [1], "unsupported mlp_only_layers=[1]"),
        ("qwen3moe-qknorm-normtopk", "decoder_sparse_step", 2, "unsupported decoder_sparse_step=2"),
        ("qwen3moe-qknorm-normtopk", "use_sliding_window", True, "unsupported use_sliding_window=True"),
        ("mixtral-window5-mqa5/1", "router_jitter_noise", 0.1, "unsupported router_jitter_noise=0.1"),
        ("mixtral-window5-mqa5/1", "num_local_experts", 0, "field 'num_local_experts' should be a positive int"),
        ("qwen2moe-shared-gated", "qkv_bias", False, "unsupported qkv_bias=False"),
        ("qwen3moe-qknorm-normtopk", "num_experts", 7, "'num_experts' (7) and 'num_local_experts' (8) disagree"),
    ],
)
def test_config_fields_we_do_not_implement_are_named(pairs, tmp_path, name, field, value, expect):
    d = {**json.loads((pairs(name)[1] / "config.json").read_text()), field: value}
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointFormatError) as info:
        models.config_from_hf(tmp_path)
    assert expect in str(info.value) and "config.json" in str(info.value)


# config.json of published checkpoints (as on the hub), read without their weights
PUBLISHED = {
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}


def _hf_parameters(folder) -> dict[str, tuple[int, ...]]:
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in hf.named_parameters()}


def _active_matmul_weights(shapes: dict[str, tuple[int, ...]], k: int) -> int:
    """From transformers' own parameters: every 2-D weight but embeddings and norms, each
    layer's experts counted for the k a token goes through (of E)."""
    n = 0
    for name, shape in shapes.items():
        if name.endswith("embed_tokens.weight") or "norm" in name or name.endswith("bias"):
            continue
        size = int(np.prod(shape))
        n += size * k // shape[0] if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else size
    return n


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_count_parameters_and_active_flops_as_transformers(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[name]))
    config = models.config_from_hf(tmp_path)
    shapes = _hf_parameters(tmp_path)
    assert models.num_params(config) == sum(int(np.prod(s)) for s in shapes.values())
    active = _active_matmul_weights(shapes, config.num_experts_per_tok)
    # 6 N of the active weights, and attention's 12 · heads · head_dim · layers · keys (PaLM's convention)
    attention = 12.0 * config.num_attention_heads * config.HeadSize.size * config.num_hidden_layers * 64
    assert models.flops_per_token(config, 64) == pytest.approx(6.0 * active + attention, rel=1e-12)
    assert models.flops_per_token(config, 64) < 0.4 * 6.0 * models.num_params(config)  # far from counting all


# ---- training from the YAMLs on 8 devices ----------------------------------------------------------

LAYOUTS = {
    "one device": {"mesh.shape": "{data: 8}", "mesh.param_mapping": "{}", "mesh.compute_mapping": "{}"},
    "ep4 + fsdp auto": {
        "mesh.shape": "{data: 2, expert: 4}",
        "mesh.param_mapping": "{embed: data, experts: expert}",
        "mesh.compute_mapping": "{batch: [data, expert], experts: expert}",
    },
    "ep4 + fsdp explicit": {
        "mesh.shape": "{data: 2, expert: 4}",
        "mesh.param_mapping": "{embed: data, experts: expert}",
        "mesh.compute_mapping": "{batch: [data, expert], experts: expert}",
        "model.expert_parallel": "explicit",
    },
    "ep8 explicit": {
        "mesh.shape": "{expert: 8}",
        "mesh.param_mapping": "{experts: expert}",
        "mesh.compute_mapping": "{batch: expert, experts: expert}",
        "model.expert_parallel": "explicit",
    },
}
STEPS = 10
RUNS = {"mixtral": list(LAYOUTS), "qwen3_moe": ["one device", "ep4 + fsdp explicit"]}
SMALL = {"mixtral": {}, "qwen3_moe": {"model.moe_intermediate_size": 24, "model.head_dim": 8}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.txt").write_text("\n".join(f"def f_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    return d


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """``trained(family, layout, **overrides)``: a STEPS-step run from config/<family>_tiny.yaml, once per module."""
    cache = {}

    def get(family: str, layout: str, **extra):
        key = (family, layout, tuple(sorted(extra.items())))
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(re.sub(r"\W", "_", f"{family}-{layout}"))
            over = {
                "trainer.num_train_steps": STEPS,
                "trainer.train_batch_size": 8,
                "trainer.log_interval": 1,
                "trainer.eval_interval": 0,
                "trainer.sample_interval": 0,
                "trainer.progress_bar": "false",
                "trainer.run_dir": str(run_dir),
                "trainer.load_checkpoint": "null",
                "optimizer.warmup_steps": 1,
                "model.hidden_size": 32,
                "model.intermediate_size": 48,
                "model.num_hidden_layers": 2,
                "model.max_position_embeddings": 64,
                **SMALL[family],
                "data.train": f"[{corpus / 'code.txt'}]",
                "data.seq_len": 32,
                "data.val_fraction": 0.05,
                "data.cache_dir": str(corpus / "cache"),
                "checkpoint.interval": 0,
                "checkpoint.save_at_end": "false",
                "tracker.console": "false",
                "tracker.jsonl": "true",
                **LAYOUTS[layout],
                **extra,
            }
            config = load_config(
                ROOT / "config" / f"{family}_tiny.yaml", [x for k, v in over.items() for x in (f"--{k}", str(v))]
            )
            result = train(config)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            cache[key] = (result, rows)
        return cache[key]

    return get


@pytest.mark.parametrize("family", list(RUNS))
def test_expert_parallel_training_equals_one_device(family, trained):
    expected, rows = trained(family, "one device")
    assert len(expected.losses) == STEPS and expected.losses[-1] < expected.losses[0]
    for layout in RUNS[family][1:]:
        run, _ = trained(family, layout)
        np.testing.assert_allclose(run.losses, expected.losses, rtol=0, atol=1e-5, err_msg=layout)
        spec = run.model.layers.stacked.mlp.experts.stacked.gate.weight.array.sharding.spec
        assert "expert" in str(spec), f"{layout}: the experts are not split ({spec})"
    # the router's losses reach the metrics; the load-balancing loss is k at best
    assert {"train/aux/moe_load_balancing", "train/aux/moe_router_z"} <= set(rows[-1])
    k = 2 if family == "mixtral" else 4
    assert all(r["train/aux/moe_load_balancing"] >= 0.999 * k for r in rows)


def test_the_router_losses_are_part_of_the_training_loss(trained):
    # step 1 trains the same model on the same batch: the losses differ by exactly the weighted terms
    # (the run without them needs two steps only: the first loss, and the second made by its gradient)
    off = {"model.router_aux_loss_coef": 0.0, "model.router_z_loss_coef": 0.0, "trainer.num_train_steps": 2}
    (with_aux, rows), (without, _) = trained("mixtral", "one device"), trained("mixtral", "one device", **off)
    assert len(without.losses) == 2
    weighted = 0.01 * rows[0]["train/aux/moe_load_balancing"] + 0.001 * rows[0]["train/aux/moe_router_z"]
    assert with_aux.losses[0] - without.losses[0] == pytest.approx(weighted, rel=1e-3)
    assert with_aux.losses[1] != without.losses[1]  # and its gradient trained another model


def test_named_plan_shows_the_experts_split(capsys):
    for family in ("mixtral", "qwen3_moe"):
        args = ["--config_path", str(ROOT / "config" / f"{family}_tiny.yaml"), "--mesh.shape", "{data: 2, expert: 4}"]
        assert cli.main_plan(args) == 0
        out = capsys.readouterr().out
        assert "mlp.experts.stacked.gate.weight" in out and "experts/expert" in out
