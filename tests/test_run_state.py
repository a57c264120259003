"""One builder of a run's state (``loop.state.run_state``) serves the training loop, the
benchmarks (``bench/_common.TrainerStep``) and the planner (``plan.abstract_train_step``): each
calls it, and the three states agree leaf by leaf in shape, dtype and where every shard lives,
which is also where the mappings say by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from test_trainer import corpus, tiny_args  # noqa: F401 (fixture)

import named as nm
from named.trainer.commands import plan
from named.trainer.config import load_config
from named.trainer.loop import state as state_mod
from named.trainer.loop import train as train_mod

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

MESH = {"data": 4, "model": 2}
COMPUTE = {"batch": "data", "mlp": "model", "heads": "model"}
PARAM = {"embed": "data", "mlp": "model", "heads": "model"}


def _flow(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"


def _cfg(corpus: Path, run_dir: Path):
    """A tiny GPT-2 on FSDP + tensor parallelism, one step."""
    over = {
        "trainer.num_train_steps": 1,
        "optimizer.warmup_steps": 0,
        "trainer.train_batch_size": 8,
        "model.n_layer": 1,
        "data.seq_len": 16,
        "checkpoint.save_at_end": "false",
        "mesh.shape": _flow(MESH),
        "mesh.compute_mapping": _flow(COMPUTE),
        "mesh.param_mapping": _flow(PARAM),
    }
    return load_config(ROOT / "config/gpt2_nano.yaml", tiny_args(corpus, run_dir, **over))


def _where(tree) -> list:
    """Every array leaf (real or a ShapeDtypeStruct) as its shape, dtype and the block of it each
    device holds."""

    def leaf(x):
        blocks = {
            d.id: tuple((s.start, s.stop) for s in idx) for d, idx in x.sharding.devices_indices_map(x.shape).items()
        }
        return x.shape, np.dtype(x.dtype), blocks

    return [leaf(x) for x in jax.tree.leaves(tree)]


@pytest.fixture
def built(monkeypatch):
    """Each call of ``run_state`` as (real, the state's layout), whoever makes it."""
    calls = []
    real = state_mod.run_state

    def spy(cfg, setup, key=None, **kw):
        out = real(cfg, setup, key, **kw)
        calls.append(
            (key is not None, jax.tree.structure((out.model, out.opt_state)), _where((out.model, out.opt_state)))
        )
        return out

    monkeypatch.setattr(state_mod, "run_state", spy)
    monkeypatch.setattr(train_mod, "run_state", spy)  # the loop's own name for it
    return calls


def test_the_planner_and_the_benchmarks_build_the_state_with_the_one_builder(corpus, tmp_path, built):
    import _common as C

    cfg = _cfg(corpus, tmp_path / "run")
    _, args = plan.abstract_train_step(cfg)
    C.TrainerStep(cfg, np.zeros((8, 16), np.int32))
    assert [real for real, *_ in built] == [False, True]  # the planner's shapes, the benchmark's arrays
    (_, abstract_tree, abstract), (_, real_tree, real) = built
    assert abstract_tree == real_tree and abstract == real
    # the parameters where the mappings put them, worked out by hand: each axis split over the mesh
    # axis its mapping names, so a device holds size / that axis's size of it
    named = [x for x in jax.tree.leaves(args[0], is_leaf=nm.is_named_array) if isinstance(x, nm.NamedArray)]
    names = {a.name for x in named for a in x.axes}
    assert {"embed", "heads", "mlp"} <= names
    for x in named:
        block = tuple(a.size // MESH.get(PARAM.get(a.name), 1) for a in x.axes)
        assert x.array.sharding.shard_shape(x.array.shape) == block, x.axes


@pytest.mark.slow
def test_the_training_loop_builds_its_state_with_the_one_builder(corpus, tmp_path, built):
    cfg = _cfg(corpus, tmp_path / "run")
    plan.abstract_train_step(cfg)
    result = train_mod.train(cfg)
    assert len(result.losses) == 1 and np.isfinite(result.losses[0])
    assert [real for real, *_ in built] == [False, True]  # the planner's, then the loop's
    (_, abstract_tree, abstract), (_, real_tree, real) = built
    assert abstract_tree == real_tree and abstract == real
    # and what the step gives back stays laid out so: the donated state keeps its layout
    assert _where((result.model, result.opt_state)) == real


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_runs_differing_in_the_optimizers_numbers_compile_one_train_step(corpus, tmp_path, mode):
    """The learning rate, the schedule's span and warmup, weight decay and clipping are inputs of the
    compiled train step, not constants in it: runs that differ only in them lower to one program
    (so the persistent compilation cache serves the second); Adam's betas are still constants."""

    def program(**over):
        cfg = load_config(
            ROOT / "config/gpt2_nano.yaml",
            tiny_args(corpus, tmp_path / "run", **{"model.n_layer": 1, "data.seq_len": 16, "mesh.mode": mode, **over}),
        )
        step, args = plan.abstract_train_step(cfg)
        with nm.set_mesh(args[2]["input_ids"].array.sharding.mesh):
            return step.lower(*args).as_text()

    base = program(**{"trainer.num_train_steps": 3, "optimizer.warmup_steps": 0.1})  # 0 steps of warmup
    assert base == program(**{"trainer.num_train_steps": 40, "optimizer.warmup_steps": 0.1})  # 4 steps of warmup
    assert base == program(
        **{
            "optimizer.learning_rate": 0.01,
            "optimizer.weight_decay": 0.05,
            "optimizer.max_grad_norm": 0.5,
            "optimizer.min_lr_ratio": 0.0,
            "optimizer.schedule_steps": 100,
        }
    )
    assert base != program(**{"optimizer.beta1": 0.8})  # the comparison tells programs apart
