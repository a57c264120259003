"""Every place where named depends on something JAX may change between the versions it
supports (``jax>=0.10,<0.13``): version checks, JAX internals, and APIs outside JAX's
compatibility policy (``jax.core``, ``jax._src``, config flags). The rest of the code imports
these names and never branches on a JAX version or reaches into ``jax._src`` itself
(``tests/test_compat.py`` checks that, and that each shim works on the installed JAX).

Checked against the jax 0.11.0 release notes and the deprecations jax 0.10.2 itself announces
for removal (its ``_deprecations`` tables, scheduled for 0.11 and later), and used directly
elsewhere because it is the same on 0.10, 0.11 and 0.12: ``jax.tree``/``jax.tree_util`` (the legacy
``jax.tree_*`` aliases are not used), ``jax.shard_map`` with ``check_vma`` (not
``jax.experimental.shard_map``/``check_rep``), ``jax.set_mesh`` (no ``with mesh:``),
``jax.sharding`` (``Mesh`` with ``axis_types``, ``NamedSharding``, ``PartitionSpec``, ``AxisType``,
``get_abstract_mesh``, ``reshard`` for Explicit mesh axes), ``jax.checkpoint_policies`` by attribute
(a module from 0.11), ``jax.ad_checkpoint.checkpoint_name``, ``jax.random.key``/``key_data``/``wrap_key_data``,
``jax.make_array_from_process_local_data``. Not used at all: ``pjit``,
``jax.experimental.mesh_utils``, ``jax.lib.xla_bridge``, ``device_put_replicated``/``_sharded``,
``lax.pvary``, ``jax.lax.axis_size``, ``AbstractMesh`` constructors.
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import re
import warnings
from pathlib import Path

import jax

# (major, minor, patch) of the running jax, for the few differences that need it.
JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])
SUPPORTED = ((0, 10), (0, 13))  # [low, high): pyproject's jax>=0.10,<0.13

# pip enforces the range, but a tree put on PYTHONPATH beside another JAX (a borrowed GPU
# image, say) is not checked by anyone else.
if not SUPPORTED[0] <= JAX_VERSION[:2] < SUPPORTED[1]:
    warnings.warn(
        f"named is tested with jax>={SUPPORTED[0][0]}.{SUPPORTED[0][1]},<{SUPPORTED[1][0]}.{SUPPORTED[1][1]}; "
        f"this is jax {jax.__version__}",
        stacklevel=2,
    )

# ``jax.core`` is outside JAX's API policy (0.10 deprecated most of it in favour of
# ``jax.extend.core``); ``Tracer`` is the one name named takes from it.
Tracer = jax.core.Tracer


def is_tracer(x) -> bool:
    """Whether ``x`` is a value being traced (inside jit, grad, vmap...), not a concrete array."""
    return isinstance(x, Tracer)


def process_cpu_count() -> int:
    """The CPU cores this process may run on: ``os.process_cpu_count()`` of Python 3.13, here for
    3.11 and 3.12 (the affinity mask where the OS has one, as on Linux; else every core)."""
    if hasattr(os, "process_cpu_count"):
        return os.process_cpu_count() or 1
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def threefry_partitionable() -> bool:
    """Whether random bits are independent of the sharding (the default since jax 0.5). JAX drops
    a flag once its new behaviour is the only one, so a missing flag means it is on."""
    return bool(getattr(jax.config, "jax_threefry_partitionable", True))


def backends_initialized() -> bool:
    """Whether this process has started its JAX backends (after which device flags no longer
    apply). JAX has no public way to ask."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def xla_knows_option(flag: str) -> bool:
    """Whether this jaxlib's XLA has the option ``flag`` (``--name=value`` or ``name``), by its name
    in jaxlib's libraries: an XLA that does not know an option given in ``XLA_FLAGS`` ends the
    process when its backends start, so an option that releases drop is asked for only where known."""
    return _in_jaxlib(flag.split("=")[0].removeprefix("--"))


@functools.cache
def _in_jaxlib(name: str) -> bool:
    for lib in Path(importlib.util.find_spec("jaxlib").origin).parent.glob("*.so"):
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(name.encode()) >= 0:
                return True
    return False


# XLA:CPU's cheapest machine code, for programs that are only read (named-plan's stand-in devices) or
# are tiny (the tests'): no LLVM optimisation, and the older emitters instead of the MLIR fusion
# emitters, which cost most of the compile time. Without the emitters XLA:CPU also rewrites every
# scatter into a while loop. And one LLVM module per program: XLA:CPU splits a program's code into
# modules that its threads compile in parallel, which for a tiny program costs more than it saves
# (a 2-layer GPT-2 train step on 8 devices, 2 cores: 0.92 against 1.11 s of CPU per compile,
# medians of 16 compiles each, taking turns).
_CHEAP_CODEGEN = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def cheap_codegen_flags() -> tuple[str, ...]:
    """The options of ``_CHEAP_CODEGEN`` that this jaxlib has, for XLA_FLAGS."""
    return tuple(f for f in _CHEAP_CODEGEN if xla_knows_option(f))


# XLA:CPU's concurrency-optimized HLO scheduler (on by default in jaxlib 0.10.2) makes programs that
# deadlock when JAX loads them back from its persistent compilation cache: on several devices the
# devices of one run reach their collectives in different orders (7 of 8 wait in one all-reduce, the
# 8th in another) and XLA aborts the process after 40 s. Freshly compiled, the same programs run;
# compiled with the plain scheduler they also run when loaded from the cache, and a step costs the
# same (docs/benchmarks.md §12). The option belongs to XLA:CPU's compiler; other backends ignore it.
CACHE_SAFE_CPU_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def cache_safe_xla_flags(flags: str) -> str | None:
    """``XLA_FLAGS`` with :data:`CACHE_SAFE_CPU_FLAG` added, for a process whose backends have not
    started and whose persistent compilation cache is on; None when nothing changes (the cache is
    off, the backends already started, or ``flags`` sets the scheduler option either way)."""
    option = CACHE_SAFE_CPU_FLAG.split("=")[0]
    if not jax.config.jax_compilation_cache_dir or backends_initialized():
        return None
    if any(f.split("=")[0] == option for f in flags.split()):
        return None
    return f"{flags} {CACHE_SAFE_CPU_FLAG}".strip()


# XLA:CPU runs each device's part of a multi-device program on a thread of its own, from pools of
# max(cores, devices) threads (PJRT_NPROC, else NPROC, stands in for the core count), and a collective
# holds its thread until every device of its group has joined. The devices need not start their
# collectives in one order, and with no thread to spare a device can wait in one collective while the
# one its peers wait in is ready on it, never to run. With 8 CPU devices on 2 cores, ten-step runs of
# gemma2's FSDP+TP train step (tests/test_families_sharded.py's, two loops of them at once) ended that
# way in 6 of 250 runs with their programs read back from the persistent compilation cache and in 6
# of 263 compiled afresh: devices waited in one all-gather (op 1 or 53) for devices that waited in
# another, until XLA aborted the process. With PJRT_NPROC=32, none of 341 and none of 375 runs did,
# at the same number of runs per minute. Where nothing blocks, the extra threads sleep.
COLLECTIVE_THREADS_PER_DEVICE = 4
_HOST_DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def collective_safe_env(environ) -> dict[str, str]:
    """Environment variables to add before JAX starts its backends in a process with several CPU
    devices (``JAX_NUM_CPU_DEVICES`` in ``environ``, else ``--xla_force_host_platform_device_count``
    in its ``XLA_FLAGS``, as JAX reads them): ``PJRT_NPROC`` for pools of
    ``COLLECTIVE_THREADS_PER_DEVICE`` threads per device, or the machine's cores if more. Empty
    where there is one device, where the pools' size is set already (``PJRT_NPROC`` or ``NPROC``),
    or where the backends started."""
    if "PJRT_NPROC" in environ or "NPROC" in environ or backends_initialized():
        return {}
    try:
        devices = int(environ.get("JAX_NUM_CPU_DEVICES", "-1"))  # JAX's setting; -1: XLA's flag decides
    except ValueError:  # JAX's own check of its setting names the variable when it starts
        return {}
    if devices < 0:
        counts = _HOST_DEVICES.findall(environ.get("XLA_FLAGS", ""))
        devices = int(counts[-1]) if counts else 1  # XLA keeps the last of a repeated flag
    if devices <= 1:
        return {}
    return {"PJRT_NPROC": str(max(process_cpu_count(), COLLECTIVE_THREADS_PER_DEVICE * devices))}


def safe_cpu_env(environ) -> dict[str, str]:
    """What to add to ``environ`` before JAX starts its backends so that its CPU devices run what
    they compile: ``XLA_FLAGS`` with :data:`CACHE_SAFE_CPU_FLAG` (``cache_safe_xla_flags``) and
    ``PJRT_NPROC`` (``collective_safe_env``), each only where it changes something."""
    out = collective_safe_env(environ)
    if (flags := cache_safe_xla_flags(environ.get("XLA_FLAGS", ""))) is not None:
        out["XLA_FLAGS"] = flags
    return out


def distributed_client():
    """The coordination-service client of ``jax.distributed.initialize`` (key-value store and
    barriers, the one JAX's own array serialization uses), or None before it started."""
    from jax._src import distributed

    return distributed.global_state.client


def cluster_detected() -> bool:
    """Whether ``jax.distributed.initialize()`` would find its coordinator from the environment
    (SLURM, Kubernetes, a TPU pod...), by JAX's own test. True when it cannot be told here:
    then ``initialize`` reports JAX's own refusal."""
    try:
        from jax._src.clusters import ClusterEnv

        envs = list(ClusterEnv._cluster_types)
    except (ImportError, AttributeError):
        return True
    return any(not env.opt_in_only_method and env.is_env_present() for env in envs)


def cudnn_version() -> int | None:
    """The cuDNN version JAX loaded (e.g. 91200 for 9.12.0), or None without CUDA: recorded beside
    GPU benchmark numbers. JAX has no public way to ask."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    try:
        return int(cuda_versions.cudnn_get_version()) if cuda_versions is not None else None
    except (AttributeError, RuntimeError):
        return None


def shard_map(f, *, mesh, in_specs, out_specs, check_vma: bool):
    """``jax.shard_map`` (the stable entry point since 0.8; ``check_vma`` is the check that was
    ``check_rep`` in ``jax.experimental.shard_map``)."""
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)


def varying_axes(x) -> frozenset:
    """The mesh axes a value inside ``shard_map`` varies over (jax's "vma" type): ``aval.vma`` in
    the releases that named it so, ``aval.manual_axis_type.varying`` in jax 0.10."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(vma or ())
