"""Every test runs on 8 fake CPU devices, so 1-D (8,) and 2-D (4, 2) meshes are real."""

import os

# Must happen before jax is imported anywhere (pytest imports conftest first).
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_sessionstart(session):
    n = len(jax.devices())
    if n != 8:
        raise pytest.UsageError(f"tests need 8 fake CPU devices, jax sees {n}; was jax imported before conftest?")
