"""What the library's own upper layers (``named.models``, ``named.trainer``) and the benchmarks
use from its internals, listed in one place, as ``equinox.internal`` does for Equinox's own
packages. Users import ``named``; these names may change with any release.

Nothing outside ``src/named`` imports one of its ``_private`` modules (tests/test_imports.py
checks that): what another layer needs from them is re-exported here.
"""

from ._compat import (
    backends_initialized,
    cache_safe_xla_flags,
    cheap_codegen_flags,
    cluster_detected,
    collective_safe_env,
    cudnn_version,
    distributed_client,
    is_tracer,
    process_cpu_count,
    safe_cpu_env,
    xla_knows_option,
)
from .nn.loss import block_size_error, head_bytes_held

__all__ = [
    "backends_initialized",  # the CLI: can this process still set its device count?
    "block_size_error",  # the config check of trainer.loss_block_size: the loss's own message
    "cache_safe_xla_flags",  # the CLI: XLA flags under which programs loaded from the compilation cache run
    "cheap_codegen_flags",  # named-plan's stand-ins and the tests: XLA:CPU's cheapest machine code
    "cluster_detected",  # distributed: would jax.distributed.initialize() find its coordinator?
    "collective_safe_env",  # the CLI and the tests: thread pools with room for several CPU devices' collectives
    "cudnn_version",  # bench/gpu_mfu.py: recorded beside GPU numbers
    "distributed_client",  # checkpoints and the run plan: JAX's key-value store and barriers
    "head_bytes_held",  # named-plan: what the fused loss holds of an FSDP head, by the loss's own rule
    "is_tracer",  # checkpoints: refuse to save a traced value; generate: check prompt lengths known before tracing
    "process_cpu_count",  # the data build's workers and named-plan's compile threads: the cores this process may use
    "safe_cpu_env",  # the CLI, the tests and the benchmarks: both of the above, before JAX starts
    "xla_knows_option",  # the tests: XLA_FLAGS only with options this jaxlib has
]
