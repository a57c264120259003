"""State dicts: flat dotted keys (torch's convention), Stacked/BlockSeq split per layer, round trips
through dicts and safetensors files, errors that name the key, placement by sharding, and the
Hugging Face export built on the same flattening."""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import named as nm
from named import Axis, models, nn

Vocab, Embed, Mlp, Layers = Axis("vocab", 7), Axis("embed", 4), Axis("mlp", 6), Axis("layers", 3)


class Block(eqx.Module):
    norm: nn.LayerNorm
    up: nn.Linear
    down: nn.Linear

    @staticmethod
    def init(*, key):
        k1, k2 = jax.random.split(key)
        return Block(nn.LayerNorm.init(Embed), nn.Linear.init(Embed, Mlp, key=k1), nn.Linear.init(Mlp, Embed, key=k2))

    def __call__(self, x):
        return x + self.down(nm.relu(self.up(self.norm(x))))


class Net(eqx.Module):
    emb: nn.Embedding
    layers: eqx.Module  # a Stacked or a BlockSeq of Blocks
    head: nn.Linear

    @staticmethod
    def init(stack=nn.Stacked, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        return Net(
            nn.Embedding.init(Vocab, Embed, key=k1),
            stack.init(Layers, Block.init, key=k2),
            nn.Linear.init(Embed, Axis("out", 5), key=k3),
        )

    def __call__(self, ids):
        return self.head(self.layers.fold(self.emb(ids)))


def _perturbed(tree, key):
    """Every array moved off its init (norm gains are not 1, biases not 0), so a swap shows."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def net():
    return _perturbed(Net.init(key=jax.random.key(0)), jax.random.key(1))


IDS = nm.named(jnp.array([[1, 5, 0], [6, 2, 3]]), ("batch", "position"))

BLOCK_KEYS = ["norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight", "down.bias"]
NET_KEYS = {"emb.weight", "head.weight", "head.bias"} | {f"layers.{i}.{k}" for i in range(3) for k in BLOCK_KEYS}


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_keys_are_dotted_paths_and_stacks_split_per_layer(net):
    sd = nm.state_dict(net)
    assert set(sd) == NET_KEYS
    stacked_up = np.asarray(net.layers.stacked.up.weight.array)  # (layers, embed, mlp)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(sd[f"layers.{i}.up.weight"]), stacked_up[i])
    assert sd["layers.1.up.weight"].shape == (4, 6)  # the NamedArray's own order, layers axis removed
    np.testing.assert_array_equal(np.asarray(sd["emb.weight"]), np.asarray(net.emb.weight.array))


def test_round_trip_through_a_dict_into_another_init(net):
    sd = {k: np.asarray(v) for k, v in nm.state_dict(net).items()}
    template = Net.init(key=jax.random.key(42))
    loaded = nm.load_state_dict(template, sd)
    _same(loaded, net)
    np.testing.assert_allclose(np.asarray(loaded(IDS).array), np.asarray(net(IDS).array), rtol=1e-6)


def test_round_trip_through_safetensors(net, tmp_path):
    path = tmp_path / "net.safetensors"
    nm.save_state_dict(net, path)
    assert not list(tmp_path.glob("*.tmp"))
    from safetensors.numpy import load_file  # the file is plain safetensors, readable without us

    assert set(load_file(str(path))) == NET_KEYS
    loaded = nm.load_state_dict_file(Net.init(key=jax.random.key(3)), path)
    _same(loaded, net)


def test_abstract_template_and_bfloat16(net, tmp_path):
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), net)
    path = tmp_path / "half.safetensors"
    nm.save_state_dict(half, path)
    abstract = eqx.filter_eval_shape(Net.init, key=jax.random.key(0))
    loaded = nm.load_state_dict_file(abstract, path)  # values cast to the template's float32
    assert loaded.emb.weight.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(loaded.emb.weight.array), np.asarray(half.emb.weight.array, np.float32))


def test_stacked_and_blockseq_share_keys_and_load_each_other(net):
    blocks = nn.BlockSeq.from_layers(net.layers.unstacked())
    as_seq = eqx.tree_at(lambda n: n.layers, net, blocks)
    sd_seq, sd_stacked = nm.state_dict(as_seq), nm.state_dict(net)
    assert sd_seq.keys() == sd_stacked.keys()
    for k in sd_seq:
        np.testing.assert_array_equal(np.asarray(sd_seq[k]), np.asarray(sd_stacked[k]))
    seq_template = Net.init(nn.BlockSeq, key=jax.random.key(9))
    loaded = nm.load_state_dict(seq_template, sd_stacked)
    assert isinstance(loaded.layers, nn.BlockSeq)
    _same(loaded.layers.unstacked(), net.layers.unstacked())
    # a Python loop and a scan round differently in the last bit
    np.testing.assert_allclose(np.asarray(loaded(IDS).array), np.asarray(net(IDS).array), rtol=1e-5, atol=1e-6)


def test_nested_stacks_and_lists():
    Inner, Outer = Axis("inner", 2), Axis("outer", 3)

    class Pair(eqx.Module):
        blocks: list
        stack: nn.Stacked

    def pair(*, key):
        k1, k2 = jax.random.split(key)
        norms = nn.Stacked.init(Inner, lambda *, key: nn.RMSNorm.init(Embed), key=k2)
        return Pair([nn.Linear.init(Embed, Mlp, key=k1)], norms)

    outer = _perturbed(nn.Stacked.init(Outer, pair, key=jax.random.key(0)), jax.random.key(1))
    sd = nm.state_dict(outer)
    assert set(sd) == (
        {f"{o}.blocks.0.{w}" for o in range(3) for w in ("weight", "bias")}
        | {f"{o}.stack.{i}.weight" for o in range(3) for i in range(2)}
    )
    norms = np.asarray(outer.stacked.stack.stacked.weight.array)  # (outer, inner, embed)
    np.testing.assert_array_equal(np.asarray(sd["2.stack.1.weight"]), norms[2, 1])
    loaded = nm.load_state_dict(nn.Stacked.init(Outer, pair, key=jax.random.key(5)), sd)
    _same(loaded, outer)


def test_layers_axis_need_not_be_first():
    stack = _perturbed(nn.Stacked.init(Layers, nn.Linear.init, Embed, Mlp, key=jax.random.key(0)), jax.random.key(1))
    moved = eqx.tree_at(lambda s: s.stacked.weight, stack, stack.stacked.weight.rearrange(("embed", "layers", "mlp")))
    sd = nm.state_dict(moved)
    np.testing.assert_array_equal(np.asarray(sd["1.weight"]), np.asarray(stack.stacked.weight.array)[1])
    back = nm.load_state_dict(moved, sd)
    assert back.stacked.weight.axes == moved.stacked.weight.axes
    np.testing.assert_array_equal(np.asarray(back.stacked.weight.array), np.asarray(moved.stacked.weight.array))


# ---- errors name the key -------------------------------------------------------------------------


def test_missing_unexpected_and_misshapen_keys(net):
    sd = {k: np.asarray(v) for k, v in nm.state_dict(net).items()}
    template = Net.init(key=jax.random.key(2))
    with pytest.raises(nm.StateDictError, match=r"missing key 'layers\.2\.down\.bias'"):
        nm.load_state_dict(template, {k: v for k, v in sd.items() if k != "layers.2.down.bias"})
    with pytest.raises(nm.StateDictError, match=r"unexpected key 'layers\.3\.up\.weight'"):
        nm.load_state_dict(template, {**sd, "layers.3.up.weight": sd["layers.0.up.weight"]})
    with pytest.raises(
        nm.StateDictError,
        match=r"'layers\.1\.up\.weight' has shape \[6, 4\], expected \[4, 6\] "
        r"\(embed mlp\)",
    ):
        nm.load_state_dict(template, {**sd, "layers.1.up.weight": sd["layers.1.up.weight"].T})
    with pytest.raises(nm.StateDictError, match=r"'emb\.weight' holds integer values"):
        nm.load_state_dict(template, {**sd, "emb.weight": sd["emb.weight"].astype(np.int32)})
    with pytest.raises(nm.StateDictError, match=r"'head\.bias' holds a NamedArray"):
        nm.load_state_dict(template, {**sd, "head.bias": net.head.bias})
    with pytest.raises(nm.StateDictError, match="missing key 'emb.weight'.*abstract"):
        nm.load_state_dict(
            eqx.filter_eval_shape(Net.init, key=jax.random.key(0)),
            {k: v for k, v in sd.items() if k != "emb.weight"},
            strict=False,
        )


def test_non_strict_keeps_the_template_and_ignores_extras(net):
    sd = {k: np.asarray(v) for k, v in nm.state_dict(net).items() if k != "layers.1.up.weight"}
    sd["optimizer.step"] = np.zeros(())
    template = Net.init(key=jax.random.key(2))
    loaded = nm.load_state_dict(template, sd, strict=False)
    up = np.asarray(loaded.layers.stacked.up.weight.array)
    np.testing.assert_array_equal(up[1], np.asarray(template.layers.stacked.up.weight.array)[1])
    np.testing.assert_array_equal(up[0], np.asarray(net.layers.stacked.up.weight.array)[0])


def test_bad_files(net, tmp_path):
    template = Net.init(key=jax.random.key(2))
    with pytest.raises(nm.StateDictError, match="nope.safetensors: not found"):
        nm.load_state_dict_file(template, tmp_path / "nope.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(nm.StateDictError, match="garbage.safetensors: safetensors cannot read it"):
        nm.load_state_dict_file(template, garbage)
    good = tmp_path / "good.safetensors"
    nm.save_state_dict(net, good)
    small = Net.init(key=jax.random.key(2))
    small = eqx.tree_at(lambda n: n.head, small, nn.Linear.init(Embed, Axis("out", 3), key=jax.random.key(0)))
    with pytest.raises(
        nm.StateDictError,
        match=r"good.safetensors: key 'head.weight' has shape \[4, 5\], "
        r"expected \[4, 3\]",
    ):
        nm.load_state_dict_file(small, good)
    with pytest.raises(nm.StateDictError, match="is a directory"):
        nm.save_state_dict(net, tmp_path)


# ---- placement -------------------------------------------------------------------------------------


def test_loading_places_arrays_like_the_template_or_by_mapping(net):
    mesh = nm.make_mesh({"data": 4, "model": 2})
    mapping = {"embed": "data", "mlp": "model"}
    sd = {k: np.asarray(v) for k, v in nm.state_dict(net).items()}
    sharded_template = nm.shard(Net.init(key=jax.random.key(2)), mapping, mesh)
    for loaded in (
        nm.load_state_dict(sharded_template, sd),
        nm.load_state_dict(Net.init(key=jax.random.key(2)), sd, mapping=mapping, mesh=mesh),
    ):
        up = loaded.layers.stacked.up.weight
        assert nm.layout(up) == "layers embed/data mlp/model"  # where it lives
        assert up.array.sharding.is_equivalent_to(nm.sharding_for(up, mapping, mesh), up.ndim)
        assert loaded.head.weight.array.sharding.is_equivalent_to(nm.sharding_for(loaded.head.weight, mapping, mesh), 2)
        _same(loaded, net)


# ---- torch's convention ------------------------------------------------------------------------------


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(4), torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)
        self.layers = torch.nn.ModuleList([TorchBlock() for _ in range(3)])
        self.head = torch.nn.Linear(4, 5)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def test_torch_state_dict_loads_into_the_equivalent_module():
    torch.manual_seed(0)
    ref = TorchNet()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    theirs = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    assert set(theirs) == NET_KEYS  # the same nesting gives the same keys
    # torch's Linear keeps its weight [out, in]; ours has axes In + Out
    linear = re.compile(r"(up|down|head)\.weight$")
    ours = {k: v.T if linear.search(k) else v for k, v in theirs.items()}
    net = nm.load_state_dict(Net.init(key=jax.random.key(0)), ours)
    want = ref(torch.tensor(np.asarray(IDS.array))).detach().numpy()
    np.testing.assert_allclose(np.asarray(net(IDS).array), want, rtol=1e-5, atol=1e-5)


# ---- a real model, and the Hugging Face export on the same flattening ----------------------------------


@pytest.fixture(scope="module")
def llama():
    config = models.LlamaConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=31,
        max_position_embeddings=16,
    )
    return config, _perturbed(models.LlamaLMHeadModel.init(config, key=jax.random.key(0)), jax.random.key(1))


def test_llama_round_trip(llama, tmp_path):
    config, model = llama
    sd = nm.state_dict(model)
    per_layer = {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate.weight",
        "mlp.up.weight",
        "mlp.down.weight",
    }
    assert set(sd) == {"embed_tokens.weight", "norm.weight", "lm_head.weight"} | {
        f"layers.{i}.{k}" for i in range(2) for k in per_layer
    }
    nm.save_state_dict(model, tmp_path / "llama.safetensors")
    loaded = nm.load_state_dict_file(
        models.LlamaLMHeadModel.init(config, key=jax.random.key(7)), tmp_path / "llama.safetensors"
    )
    ids = nm.named(jnp.array([[3, 1, 4, 1, 5]]), ("batch", "position"))
    np.testing.assert_array_equal(np.asarray(loaded(ids).array), np.asarray(model(ids).array))


def test_hf_export_is_our_state_dict_renamed(llama):
    """transformers' Llama names are ours under "model." (with *_proj for the MLP); the tensors are
    ours with each Linear side flattened and torch's [out, in] transpose."""
    config, model = llama
    ours, hf = nm.state_dict(model), models.hf_state_dict(model)

    def hf_name(k):
        if k == "lm_head.weight":
            return k
        return "model." + re.sub(r"mlp\.(gate|up|down)\.", r"mlp.\1_proj.", k)

    assert {hf_name(k) for k in ours} == set(hf)
    for k, v in ours.items():
        v = np.asarray(v)
        if re.search(r"(proj|mlp\.\w+)\.weight$", k):  # a Linear: In axes first, then Out
            n_in = config.hidden_size if not re.search(r"o_proj|down", k) else v.size // config.hidden_size
            v = v.reshape(n_in, -1).T
        np.testing.assert_array_equal(hf[hf_name(k)], v.reshape(hf[hf_name(k)].shape))


def test_flatten_exports_torch_layouts_that_torch_computes_with(tmp_path):
    # a multi-axis Linear (embed -> heads x head_size) inside a stack, exported in torch's layout
    Heads, HeadSize = Axis("heads", 2), Axis("head_size", 3)

    class Proj(eqx.Module):
        qkv: nn.Linear

        @staticmethod
        def init(*, key):
            return Proj(nn.Linear.init(Embed, (Heads, HeadSize), key=key))

    stack = _perturbed(nn.Stacked.init(Layers, Proj.init, key=jax.random.key(2)), jax.random.key(3))
    sd = nm.state_dict(stack, flatten=True)
    assert set(sd) == {f"{i}.qkv.{w}" for i in range(3) for w in ("weight", "bias")}
    assert sd["1.qkv.weight"].shape == (6, 4) and sd["1.qkv.bias"].shape == (6,)  # torch: [out, in], [out]
    torch_layer = torch.nn.Linear(4, 6)
    torch_layer.load_state_dict(
        {k.split(".", 2)[2]: torch.tensor(np.asarray(v)) for k, v in sd.items() if k.startswith("1.")}
    )
    x = nm.random.normal(jax.random.key(4), (Axis("batch", 5), Embed))
    want = torch_layer(torch.tensor(np.asarray(x.array))).detach().numpy().reshape(5, 2, 3)
    got = stack.get_layer(1).qkv(x)
    np.testing.assert_allclose(
        np.asarray(got.rearrange(("batch", "heads", "head_size")).array), want, rtol=1e-5, atol=1e-6
    )
    # and back: the template's axes and order return, from a dict and from a file
    template = nn.Stacked.init(Layers, Proj.init, key=jax.random.key(9))
    for loaded in (
        nm.load_state_dict(template, sd, flatten=True),
        (
            nm.save_state_dict(stack, tmp_path / "flat.safetensors", flatten=True),
            nm.load_state_dict_file(
                eqx.filter_eval_shape(lambda: template), tmp_path / "flat.safetensors", flatten=True
            ),
        )[1],
    ):
        assert loaded.stacked.qkv.weight.axes == stack.stacked.qkv.weight.axes
        _same(loaded, stack)
    with pytest.raises(nm.StateDictError, match=r"key '0.qkv.weight' has shape \[4, 2, 3\], expected \[6, 4\]"):
        nm.load_state_dict(template, nm.state_dict(stack), flatten=True)
