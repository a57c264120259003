"""``named._compat`` is the one place that depends on what JAX may change between the versions
named supports: no other source file branches on a JAX version, probes JAX for a feature, or
reaches into ``jax._src``/``jax.core``; and each shim does its job on the installed JAX
(CI: jax 0.10.2), checked against plain JAX or the environment, not against itself.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import named as nm
from named import _compat

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "src" / "named" / "_compat.py"

# What only the compat module may do (each pattern is also checked to match the compat module
# itself, so a pattern that matches nothing cannot make this test pass).
VERSION_DEPENDENT = {
    "JAX internals": r"\bjax\._src\b",
    "jax.core (outside JAX's API policy)": r"\bjax\.core\.",
    "a version comparison": r"(jax|jaxlib)\.__version__\s*[<>=!]|\bJAX_VERSION\b|version\.parse\(",
    "feature probing of jax": r"\b(hasattr|getattr)\(\s*jax\b",
    "jax.shard_map called directly": r"\bjax\.shard_map\(",
}
REMOVED_OR_RENAMED = {  # may not appear anywhere, the compat module included
    "jax.experimental.shard_map": r"jax\.experimental\.shard_map|\bcheck_rep\b",
    "pjit": r"\bpjit\b",
    "jax.experimental.mesh_utils": r"mesh_utils",
    "jax.lib.xla_bridge": r"jax\.lib\.xla_bridge",
    "legacy jax.tree_* aliases": r"\bjax\.tree_(map|leaves|flatten|unflatten|structure|transpose)\b",
    "device_put_replicated/_sharded": r"device_put_(replicated|sharded)",
    "lax.pvary": r"\bpvary\b",
    "`with mesh:`": r"^\s*with\s+mesh\s*:",
}


def _sources() -> list[Path]:
    """The library and the benchmark scripts (bench/*.py, not the peer's venv below bench/)."""
    return sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))


def _code(path: Path) -> str:
    """The file without comments and docstring-only lines, so prose may name what the code avoids."""
    lines = []
    in_doc = False
    for line in path.read_text().splitlines():
        stripped = line.strip()
        quotes = stripped.count('"""') + stripped.count("'''")
        if in_doc or (quotes and stripped[:3] in ('"""', "'''")):
            in_doc = in_doc != (quotes % 2 == 1)
            continue
        lines.append(line.split(" #")[0] if not stripped.startswith("#") else "")
    return "\n".join(lines)


def test_only_the_compat_module_depends_on_the_jax_version():
    sources = _sources()
    assert COMPAT in sources and len(sources) > 40
    compat = _code(COMPAT)
    offenders = []
    for what, pattern in VERSION_DEPENDENT.items():
        assert re.search(pattern, compat, re.M), f"pattern for {what} matches nothing in _compat.py"
        offenders += [
            f"{p.relative_to(ROOT)}: {what}" for p in sources if p != COMPAT and re.search(pattern, _code(p), re.M)
        ]
    for what, pattern in REMOVED_OR_RENAMED.items():
        offenders += [f"{p.relative_to(ROOT)}: {what}" for p in sources if re.search(pattern, _code(p), re.M)]
    assert offenders == []


def test_the_supported_range_is_pyprojects_and_holds_the_installed_jax():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    lo, hi = _compat.SUPPORTED
    dotted = lambda v: ".".join(map(str, v))  # noqa: E731
    assert f"jax>={dotted(lo)},<{dotted(hi)}" in deps and f"jaxlib>={dotted(lo)},<{dotted(hi)}" in deps
    installed = tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version("jax"))[:3])
    assert _compat.JAX_VERSION == installed
    assert lo <= installed[:2] < hi


def test_is_tracer():
    seen = []
    jax.jit(lambda x: seen.append(_compat.is_tracer(x)) or x)(jnp.ones(2))
    jax.grad(lambda x: seen.append(_compat.is_tracer(x)) or x.sum())(jnp.ones(2))
    assert seen == [True, True]
    assert not _compat.is_tracer(jnp.ones(2)) and not _compat.is_tracer(np.ones(2)) and not _compat.is_tracer(1.0)


def test_threefry_partitionable_is_on_and_random_init_is_mesh_independent():
    assert _compat.threefry_partitionable() is True
    axes = (nm.Axis("a", 8), nm.Axis("b", 4))
    plain = np.asarray(nm.random.normal(jax.random.key(3), axes).array)
    with nm.set_mesh(nm.make_mesh({"data": -1})):
        laid_out = nm.named_jit(lambda k: nm.random.normal(k, axes), mapping={"a": "data"})(jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(laid_out.array), plain)


@pytest.mark.procs
def test_backends_initialized_before_and_after_first_use():
    code = (
        "from named._compat import backends_initialized as b; before = b(); import jax; jax.devices(); "
        "print(before, b())"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]
    assert _compat.backends_initialized() is True  # this test process has used its devices


def test_distributed_client_is_none_without_initialize():
    assert jax.process_count() == 1 and _compat.distributed_client() is None


SLURM = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_NODELIST": "node1",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


def test_cluster_detected_reads_the_environment(monkeypatch):
    for var in SLURM:
        monkeypatch.delenv(var, raising=False)
    if _compat.cluster_detected():
        pytest.skip("this machine itself looks like a cluster to JAX")
    for var, value in SLURM.items():
        monkeypatch.setenv(var, value)
    assert _compat.cluster_detected() is True


def test_shard_map_runs_a_collective_and_checks_varying_outputs():
    mesh = nm.make_mesh({"data": -1})
    x = np.arange(len(jax.devices()) * 3, dtype=np.float32).reshape(len(jax.devices()), 3)
    total = _compat.shard_map(
        lambda b: jax.lax.psum(b, "data"), mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=True
    )(x)
    np.testing.assert_allclose(np.asarray(total), x.sum(0, keepdims=True))
    # check_vma=True refuses a block that varies over "data" returned as if replicated
    with pytest.raises(Exception, match="vary|varying|replicat"):
        _compat.shard_map(lambda b: b, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=True)(x)
    kept = _compat.shard_map(lambda b: b, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)(x)
    np.testing.assert_array_equal(np.asarray(kept), x[:1])


def test_process_cpu_count_where_the_os_has_no_affinity_mask(monkeypatch):
    """Linux: the affinity mask (a container's cores, not the host's); macOS has none: every core;
    Python 3.13's own os.process_cpu_count where it exists."""
    monkeypatch.delattr(os, "process_cpu_count", raising=False)
    assert _compat.process_cpu_count() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert _compat.process_cpu_count() == 1
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert _compat.process_cpu_count() == 6
    monkeypatch.setattr(os, "process_cpu_count", lambda: 3, raising=False)
    assert _compat.process_cpu_count() == 3
