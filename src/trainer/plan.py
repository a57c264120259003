"""``named-plan``: what a config would do on this machine, without training.

It runs every check ``named-train`` runs short of the data and the run directory
(``checks.check_against_devices``), so it refuses the configs train refuses. By default nothing
is compiled or allocated: the mesh, every parameter's layout and bytes per device, and the
microbatch plan. ``compile=True`` (``python -m named.trainer.plan --compile``) also
compiles the train step on abstract inputs and reports its collectives, memory per device and
FLOPs (a few seconds for the small configs).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import named as nm

from .checks import Setup, check_against_devices
from .config import TrainConfig, data_parallel_size
from .registry import flops_per_token


def plan_report(cfg: TrainConfig, *, compile: bool = False) -> str:
    s = check_against_devices(cfg)
    model_cfg, mesh, compute, param = s.model_cfg, s.mesh, s.compute, s.param
    params = nm.param_report(s.shapes, param, mesh)
    t = cfg.trainer
    dp = data_parallel_size(cfg, dict(mesh.shape))
    micro = t.train_batch_size // t.microbatches
    lines = [
        f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind} in {jax.process_count()} process(es)",
        f"mesh: {dict(mesh.shape)}",
        f"compute mapping: {compute}",
        f"parameter mapping: {param}",
        "",
        "parameters:",
        str(params),
        "",
        f"adam state (2 moments, float32) per device: {2 * params.bytes_per_device / 2**20:.2f} MiB; "
        f"params + grads + moments: {4 * params.bytes_per_device / 2**20:.2f} MiB per device",
        "",
        f"batch: {t.train_batch_size} sequences x {cfg.data.seq_len} tokens = {t.train_batch_size * cfg.data.seq_len} tokens/step",
        f"microbatches: {t.microbatches} of {micro} sequences; {micro // max(dp, 1)} per data-parallel group of {dp} device(s)",
        f"model: {type(model_cfg).__name__} with {params.n_params:,} parameters; "
        f"{flops_per_token(model_cfg, cfg.data.seq_len) / 1e9:.3f} GFLOP per token (6N + 12·L·d·T)",
    ]
    if compile:
        lines += ["", "train step (compiled on abstract inputs):", str(train_step_report(cfg, s))]
    return "\n".join(lines)


def train_step_report(cfg: TrainConfig, s: Setup | None = None) -> nm.inspect.CompiledReport:
    """Compile the train step ``named-train`` would run, on abstract inputs laid out as the run
    lays them out (parameters and optimizer state by the parameter mapping, the batch by the
    compute mapping), and report its collectives, memory per device and FLOPs. ``s``: the result
    of ``check_against_devices(cfg)``, when the caller has it."""
    from named.nn.precision import get_policy

    from .optim import build_optimizer
    from .train import make_train_step

    s = s if s is not None else check_against_devices(cfg)
    mesh, compute, param = s.mesh, s.compute, s.param
    t = cfg.trainer
    optimizer = build_optimizer(cfg.optimizer, t.num_train_steps)

    def abstract(tree, mapping):
        def leaf(x):
            if isinstance(x, nm.NamedArray):
                return nm.NamedArray(jax.ShapeDtypeStruct(x.array.shape, x.array.dtype,
                                                         sharding=nm.sharding_for(x, mapping, mesh)), x.axes)
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, jax.P()))
            return x

        return jax.tree.map(leaf, tree, is_leaf=nm.is_named_array)

    model = s.shapes
    opt_state = jax.eval_shape(optimizer.init, model)
    rows = (nm.Axis("batch", t.train_batch_size), nm.Axis("position", cfg.data.seq_len))
    batch = {name: nm.NamedArray(jax.ShapeDtypeStruct((rows[0].size, rows[1].size), dtype), rows)
             for name, dtype in (("input_ids", jnp.int32), ("segment_ids", jnp.int32), ("loss_mask", jnp.bool_))}
    step = make_train_step(s.model_cls, optimizer, get_policy(t.precision), cfg, compute, param)
    with nm.set_mesh(mesh):
        lowered = step.lower(abstract(model, param), abstract(opt_state, param), abstract(batch, compute),
                             jax.random.key(0))
    return nm.compiled_report(lowered, mesh=mesh)


def main(argv: list[str] | None = None) -> int:
    """``python -m named.trainer.plan --config_path config/gpt2_nano.yaml [--compile] [--section.key value ...]``"""
    from .cli import _fail, _split_config_path
    from .config import ConfigError, load_config
    from .data import DataError

    argv = list(sys.argv[1:] if argv is None else argv)
    compile_step = "--compile" in argv
    argv = [a for a in argv if a != "--compile"]
    try:
        print(plan_report(load_config(*_split_config_path(argv)), compile=compile_step))
    except (ConfigError, DataError, nm.NamedError) as e:
        return _fail(e)
    except OSError as e:  # the machine, not the input: no traceback, exit 1
        return _fail(e, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
