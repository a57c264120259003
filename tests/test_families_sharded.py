"""Every decoder family trains from its config/ YAML under the same mappings: FSDP+TP on the 8
fake devices (weights split over data as FSDP splits them, and over model) gives the losses of
the unsharded run (every array replicated) to 1e-5, because all families use the same axis
names; Llama 3 also under FSDP alone. ``named-plan`` prints each family's layouts."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import named as nm
from named.trainer.commands import cli
from named.trainer.config import load_config
from named.trainer.loop.train import train

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10  # the layouts' losses part at the first step that differs; ten show the run learning too
FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3"]
TP = "mlp: model, heads: model, kv_heads: model"
LAYOUTS = {
    "unsharded": {"mesh.shape": "{data: 8}", "mesh.param_mapping": "{}", "mesh.compute_mapping": "{}"},
    "fsdp": {"mesh.shape": "{data: 8}", "mesh.param_mapping": "{embed: data}", "mesh.compute_mapping": "{batch: data}"},
    "fsdp+tp": {
        "mesh.shape": "{data: 4, model: 2}",
        "mesh.param_mapping": f"{{embed: data, {TP}}}",
        "mesh.compute_mapping": f"{{batch: data, {TP}}}",
    },
}
# windows of 8 in sequences of 32, and for Gemma 3 a local:global pattern that two layers show
WINDOWS = {
    "mistral": {"model.sliding_window": 8},
    "gemma2": {"model.sliding_window": 8},
    "gemma3": {"model.sliding_window": 8, "model.sliding_window_pattern": 2},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    (d / "code.txt").write_text("\n".join(f"def f_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    return d


def _run(family: str, layout: str, corpus: Path, run_dir: Path):
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
        **WINDOWS.get(family, {}),
        "data.train": f"[{corpus / 'code.txt'}]",
        "data.seq_len": 32,
        "data.val_fraction": 0.05,
        "data.cache_dir": str(corpus / "cache"),
        "checkpoint.interval": 0,
        "checkpoint.save_at_end": "false",
        "tracker.console": "false",
        "tracker.jsonl": "false",
        **LAYOUTS[layout],
    }
    return train(
        load_config(ROOT / "config" / f"{family}_tiny.yaml", [x for k, v in over.items() for x in (f"--{k}", str(v))])
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_and_tp_train_like_one_device(family, corpus, tmp_path):
    # FSDP alone for one family: the others share its code, and FSDP+TP splits their weights over data too
    layouts = list(LAYOUTS) if family == "llama3" else ["unsharded", "fsdp+tp"]
    runs = {layout: _run(family, layout, corpus, tmp_path / layout) for layout in layouts}
    expected = runs["unsharded"].losses
    assert len(expected) == STEPS and expected[-1] < expected[0]
    for layout in layouts[1:]:
        np.testing.assert_allclose(runs[layout].losses, expected, rtol=0, atol=1e-5, err_msg=layout)
    specs = [
        str(x.array.sharding.spec)
        for x in jax.tree.leaves(runs["fsdp+tp"].model, is_leaf=nm.is_named_array)
        if isinstance(x, nm.NamedArray)
    ]
    assert any("model" in s for s in specs) and any("data" in s for s in specs)


@pytest.mark.parametrize("family", FAMILIES)
def test_named_plan_prints_the_layouts(family, capsys):
    assert cli.main_plan(["--config_path", str(ROOT / "config" / f"{family}_tiny.yaml")]) == 0
    out = capsys.readouterr().out
    assert "self_attn.q_proj.weight" in out and "layers embed/data heads head_size" in out
