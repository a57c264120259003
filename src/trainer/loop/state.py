"""The state a run trains, built in one place for the loop (``train``), the benchmarks
(``bench/_common.TrainerStep``) and the planner (``plan.abstract_train_step``): the parameters and
the optimizer state laid out by the parameter mapping on the mesh, the optimizer the train step
(``train.make_train_step``) updates them with, and the step's other inputs. From a key, real
arrays; without one, ``jax.ShapeDtypeStruct`` leaves with the shardings the real ones get, so the
planner compiles the step the run compiles and allocates nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

import named as nm
from named.nn.precision import get_policy

from ..config import TrainConfig
from .checks import Setup
from .model_init import init_model
from .optim import build_optimizer, init_opt_state
from .stop import flags_layout


@dataclasses.dataclass
class RunState:
    """The parameters, the optimizer state and the optimizer it belongs to (the one to give
    ``train.make_train_step``)."""

    model: Any
    opt_state: Any
    optimizer: optax.GradientTransformation

    def abstract_inputs(self, cfg: TrainConfig, setup: Setup) -> tuple:
        """The step's five arguments as shapes laid out as the run lays them out: this state, a
        batch of ``trainer.train_batch_size`` rows by the compute mapping (``batch_layout``), a
        key and the stop flags (``stop.flags_layout``)."""
        return self.model, self.opt_state, batch_layout(cfg, setup), jax.random.key(0), flags_layout(setup.mesh)


def run_state(cfg: TrainConfig, setup: Setup, key: jax.Array | None = None, *, pretrained: bool = True) -> RunState:
    """The run's state for ``setup`` (``checks.checked_setup(cfg)``). With ``key``: the model made
    by ``model_init.init_model`` (the pretrained weights of ``model.init_from_hf`` unless not
    ``pretrained``: a resume restores every weight) and its optimizer state, real arrays on the
    mesh. Without: ``setup.shapes`` and the optimizer state's shapes, each leaf with the sharding
    the real one has (a NamedArray's by the parameter mapping, any other leaf replicated)."""
    mesh, mapping = setup.mesh, setup.param_mapping
    optimizer = build_optimizer(cfg.optimizer, cfg.trainer.num_train_steps)
    if key is None:
        model = laid_out(setup.shapes, mapping, mesh)
        opt_state = laid_out(jax.eval_shape(lambda m: init_opt_state(cfg, m, optimizer), model), mapping, mesh)
    else:
        with nm.set_mesh(mesh):
            model = init_model(
                cfg,
                setup.model_cls,
                setup.model_cfg,
                param_mapping=mapping,
                mesh=mesh,
                key=key,
                pretrained=pretrained,
                dtype=get_policy(cfg.trainer.precision).param_dtype,
            )
            opt_state = nm.named_jit(lambda m: init_opt_state(cfg, m, optimizer), mapping=mapping)(model)
    return RunState(model, opt_state, optimizer)


def laid_out(tree, mapping, mesh):
    """``tree``'s array leaves as ``jax.ShapeDtypeStruct`` with the sharding ``nm.named_jit`` gives
    them under ``mapping``: a NamedArray's by its axes, any other array replicated."""

    def leaf(x):
        if isinstance(x, nm.NamedArray):
            return nm.NamedArray(
                jax.ShapeDtypeStruct(x.array.shape, x.array.dtype, sharding=nm.sharding_for(x, mapping, mesh)), x.axes
            )
        if isinstance(x, (jax.ShapeDtypeStruct, jax.Array)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
        return x

    return jax.tree.map(leaf, tree, is_leaf=nm.is_named_array)


def batch_layout(cfg: TrainConfig, setup: Setup) -> dict[str, nm.NamedArray]:
    """A batch of the step as shapes: ``trainer.train_batch_size`` rows of ``data.seq_len`` token
    ids, segment ids and loss flags, laid out by the compute mapping (as ``train.device_batch``
    lays out the loader's rows)."""
    axes = (nm.Axis("batch", cfg.trainer.train_batch_size), nm.Axis("position", cfg.data.seq_len))
    sharding = nm.sharding_for(axes, setup.compute_mapping, setup.mesh)
    shape = tuple(a.size for a in axes)
    return {
        name: nm.NamedArray(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), axes)
        for name, dtype in (("input_ids", jnp.int32), ("segment_ids", jnp.int32), ("loss_mask", jnp.bool_))
    }
