"""The checks that need the devices, the tokenizer or the model's shapes, in one place.

``named-train`` (``train.build_run``) and ``named-plan`` both call ``checked_setup``, so
the two refuse the same configs (both read the config with ``config.load_config`` first, which
runs the checks that need none of these). Everything here runs on abstract shapes (``jax.eval_shape``):
nothing is compiled, allocated or written.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import named as nm
from named import nn
from named.internal import block_size_error  # the blockwise loss's own message, with the nearest divisors
from named.models.hf import CheckpointFormatError, check_folder
from named.partitioning import mesh_axes_of

from ..config import ConfigError, TrainConfig, data_parallel_size, pretrained
from ..config.sections import VOCAB_MULTIPLE
from ..data import Tokenizer, check_transformers_agrees, load_tokenizer
from .loss import token_losses
from .model_init import layer_driver, model_shapes
from .registry import max_positions, model_class, model_type

# Axes of activations that no parameter has; a mapping may name these and the parameters' axes.
_ACTIVATION_AXES = ("batch", "position", "key_position")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the checks built on the way, for the caller to use rather than build again."""

    tokenizer: Tokenizer
    model_cfg: Any
    model_cls: type
    shapes: Any  # the model's parameters as jax.ShapeDtypeStruct leaves
    mesh: jax.sharding.Mesh
    compute_mapping: dict
    param_mapping: dict


def require_harness(what: str) -> None:
    """ConfigError naming ``what`` and the install line when lm-evaluation-harness is not installed
    (``loop.harness`` imports it)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            f"{what} needs lm-evaluation-harness (lm_eval is not installed): pip install 'named-jax[eval]'"
        )


def checked_setup(cfg: TrainConfig, *, check_forward: bool = True) -> Setup:
    """The run's Setup, built by every check of a loaded config (``load_config`` ran the static
    layer) short of its data and run directory, cheapest first: the distributed settings, the
    tokenizer and model config, the mesh against the devices, batch and lengths, both mappings
    against the parameters' shapes, and the compute mapping against every activation of the
    forward pass (``check_activations``; ``check_forward=False`` leaves out that last, dearest
    check, for a caller that ran it on a config that differs only where it cannot tell)."""
    from .distributed import checked_settings

    checked_settings(cfg.distributed)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token)
    check_transformers_agrees(tokenizer)
    model_cfg, model_cls = model_config_for(cfg, tokenizer)
    mesh = nm.make_mesh(check_device_count(cfg, len(jax.devices()), jax.process_count()))
    compute_mapping, param_mapping = cfg.mesh.compute_mapping, cfg.mesh.param_mapping
    check_positions(cfg, model_cfg)
    check_sample_length(cfg, tokenizer, model_cfg)
    check_loss_block(cfg, model_cfg, mesh, compute_mapping, param_mapping)
    if cfg.model.init_from_hf is not None:  # every header against the model before anything is compiled
        try:
            check_folder(pretrained.folder(cfg.model.init_from_hf))
        except CheckpointFormatError as e:
            raise ConfigError(f"model.init_from_hf: {e}") from None
    shapes = model_shapes(cfg, model_cls, model_cfg)
    check_mappings(cfg, shapes, mesh, compute_mapping, param_mapping, model_cfg)
    if check_forward:
        check_activations(cfg, model_cfg, shapes, mesh, compute_mapping, param_mapping)
    return Setup(tokenizer, model_cfg, model_cls, shapes, mesh, compute_mapping, param_mapping)


def model_config_for(cfg: TrainConfig, tokenizer: Tokenizer | None = None):
    """``(model config, model class)``; a null ``model.vocab_size`` takes the tokenizer's
    vocabulary rounded up to a multiple of VOCAB_MULTIPLE, a given one must hold every token id."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.data.tokenizer, cfg.data.eos_token)
    vocab = tokenizer.vocab_size
    model_cfg = cfg.model.model_config(vocab_size=-(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
    if model_cfg.vocab_size < vocab:
        source = f" of {cfg.model.init_from_hf} (model.init_from_hf)" if cfg.model.init_from_hf else ""
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size}{source} is smaller than the tokenizer's {vocab} "
            f"tokens (data.tokenizer={cfg.data.tokenizer!r}): the tokenizer is not this model's"
        )
    return model_cfg, model_class(model_cfg)


def check_device_count(cfg: TrainConfig, n_devices: int, n_processes: int) -> dict[str, int]:
    """The checks that need only the number of devices and processes: ``mesh.shape`` on the devices,
    and the batch over that mesh and the processes. ``named-plan --devices N`` runs them before it
    stands N devices in (asking JAX would start it). Returns the mesh's axis sizes."""
    sizes = nm.mesh_sizes(cfg.mesh.shape, n_devices)
    t = cfg.trainer
    dp = data_parallel_size(cfg, sizes)
    mb = t.train_batch_size // t.microbatches
    if mb % dp:
        raise ConfigError(
            f"the microbatch of {mb} sequences (trainer.train_batch_size={t.train_batch_size} / "
            f"trainer.microbatches={t.microbatches}) does not split over the {dp} devices of the batch mesh axes"
        )
    if (mb // dp) % cfg.mesh.batch_split:
        raise ConfigError(
            f"mesh.batch_split={cfg.mesh.batch_split} does not divide each device's {mb // dp} sequences of a "
            "microbatch "
            f"(trainer.train_batch_size={t.train_batch_size} / trainer.microbatches={t.microbatches} / {dp} devices)"
        )
    if t.train_batch_size % n_processes:
        raise ConfigError(f"trainer.train_batch_size={t.train_batch_size} does not split over {n_processes} processes")
    return sizes


def check_positions(cfg: TrainConfig, model_cfg) -> None:
    seq_len = cfg.data.seq_len
    max_pos = max_positions(model_cfg)
    if seq_len > max_pos:
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than the model's {max_pos} positions (model.n_positions / "
            "max_position_embeddings)"
        )


def check_mappings(cfg: TrainConfig, shapes, mesh, compute_mapping, param_mapping, model_cfg) -> None:
    """Both mappings name only axes the model has, and every axis they split divides evenly:
    the parameters' axes under both mappings, and batch / position under the compute mapping."""
    sizes: dict[str, set[int]] = {}
    for x in jax.tree.leaves(shapes, is_leaf=nm.is_named_array):
        for a in getattr(x, "axes", ()):
            sizes.setdefault(a.name, set()).add(a.size)
    micro = cfg.trainer.train_batch_size // cfg.trainer.microbatches
    for name, n in zip(_ACTIVATION_AXES, (micro, cfg.data.seq_len, cfg.data.seq_len)):
        sizes.setdefault(name, set()).add(n)
    for key, mapping in (("mesh.param_mapping", param_mapping), ("mesh.compute_mapping", compute_mapping)):
        for name in mapping:
            if name not in sizes:
                raise ConfigError(
                    f"{key}.{name}: the {model_type(model_cfg)} model has no axis {name!r}; "
                    f"its axes are {', '.join(sorted(sizes))}"
                )
    try:
        nm.check_sharding(shapes, param_mapping, mesh)  # every parameter's layout, leaf by leaf
    except nm.ShardingError as e:
        raise ConfigError(f"mesh.param_mapping: {e}") from None
    for name in compute_mapping:
        for n in sorted(sizes[name]):
            try:
                nm.pspec_for((nm.Axis(name, n),), compute_mapping, mesh)
            except nm.ShardingError as e:
                raise ConfigError(f"mesh.compute_mapping: {e}") from None


_CLASH = re.compile(r"axes '(\w+)' and '(\w+)' of one array are both mapped to mesh axis '(\w+)'")


def check_activations(cfg: TrainConfig, model_cfg, shapes, mesh, compute_mapping, param_mapping=None) -> None:
    """The compute mapping fits every activation of the forward pass and the loss: no activation
    may have two axes on one mesh axis (``embed: data`` beside ``batch: data``), which the
    per-axis checks above cannot see. The forward is traced under the mapping on abstract inputs
    (``jax.eval_shape``), so every ``nm.shard`` in the model runs and nothing is compiled."""
    micro = cfg.trainer.train_batch_size // cfg.trainer.microbatches
    axes = (nm.Axis("batch", micro), nm.Axis("position", cfg.data.seq_len))
    ids = nm.NamedArray(jax.ShapeDtypeStruct((micro, cfg.data.seq_len), jnp.int32), axes)

    def loss(model, ids):  # the key: dropout's layouts too
        batch = {"input_ids": ids, "segment_ids": ids}
        block = cfg.trainer.loss_block_size
        return token_losses(model, batch, key=jax.random.key(0), block_size=block, param_mapping=param_mapping)[0]

    try:
        with nm.set_mesh(mesh), nm.axis_mapping(compute_mapping):
            jax.eval_shape(loss, shapes, ids)
    except nm.ShardingError as e:
        clash = _CLASH.search(str(e))
        if clash is None:
            raise ConfigError(f"mesh.compute_mapping: {e}") from None
        a, b, m = clash.groups()
        raise ConfigError(
            f"mesh.compute_mapping.{a} and mesh.compute_mapping.{b} both map to mesh axis {m!r}, but "
            f"the {model_type(model_cfg)} model has activations with both axes: {e}"
        ) from None
    driver = layer_driver(cfg, compute_mapping, param_mapping)
    if driver is not None:  # the layer stack traced per device, forward and backward, as the train step runs it

        def explicit_loss(model, ids):  # a function of its own: jax caches traces by function
            with nn.explicit_layers(driver):
                return loss(model, ids).array.astype(jnp.float32).mean()

        try:
            with nm.set_mesh(mesh), nm.axis_mapping(compute_mapping):
                jax.eval_shape(eqx.filter_grad(explicit_loss), shapes, ids)
        except nm.NamedError as e:
            raise ConfigError(f"mesh.mode: explicit: {e}") from None


def check_loss_block(cfg: TrainConfig, model_cfg, mesh, compute_mapping, param_mapping) -> None:
    """``trainer.loss_block_size`` divides the vocab size, and each block of the vocab splits
    evenly over the devices a vocab-parallel head spreads it over: the fused loss takes the head
    as ``mesh.param_mapping`` stores it, and keeps its vocab split over mesh axes the batch is not
    split over (over the others it is gathered whole first)."""
    size = cfg.trainer.loss_block_size
    if size is None:
        return
    if model_cfg.vocab_size % size:
        raise ConfigError(f"trainer.loss_block_size: {block_size_error(nm.Axis('vocab', model_cfg.vocab_size), size)}")
    tokens_over = {m for a in ("batch", "position") for m in mesh_axes_of(compute_mapping.get(a))}
    vocab_over = mesh_axes_of(param_mapping.get("vocab"))
    if set(vocab_over) & tokens_over:
        return
    try:
        nm.pspec_for((nm.Axis("vocab", size),), {"vocab": vocab_over}, mesh)
    except nm.ShardingError as e:
        raise ConfigError(
            f"trainer.loss_block_size={size}: a block of the vocab must split like the head's vocab "
            f"(mesh.param_mapping.vocab): {e}"
        ) from None


def check_sample_length(cfg: TrainConfig, tokenizer: Tokenizer, model_cfg) -> None:
    t = cfg.trainer
    if not t.sample_interval:
        return
    n = len(tokenizer.encode(t.sample_prompt) or [tokenizer.eos_id]) + t.sample_tokens
    if n > max_positions(model_cfg):
        raise ConfigError(
            f"a sample of trainer.sample_tokens={t.sample_tokens} after the prompt trainer.sample_prompt "
            f"({n - t.sample_tokens} tokens) needs {n} positions; the model has {max_positions(model_cfg)}"
        )
