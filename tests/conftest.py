"""Every test runs on 8 fake CPU devices, so 1-D (8,) and 2-D (4, 2) meshes are real.

One persistent XLA compilation cache serves the whole session: the pytest workers and every
process a test starts (named-train restarted after a kill, the launcher's workers, the docs'
commands) compile each program once. It lives in a temporary folder that the process which
made it removes at the end. A maximum size turns on jax's file lock, so concurrent processes
never read an entry that another is still writing."""

import gc
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from _procs import PATIENT_COLLECTIVES, fast_compile  # imports no jax itself

# Must happen before jax is imported anywhere (pytest imports conftest first): jax reads these when
# imported, XLA_FLAGS (below) only when its backends start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="named-tests-jax-cache-")
    os.environ["NAMED_TESTS_JAX_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# Compile for tiny models (tests/_procs.py says what and what it saves); an option already set is kept.
for _option in fast_compile().split():
    if _option.split("=")[0] not in _flags:
        _flags += " " + _option
# A device thread starved on 2 cores must not end the worker at XLA:CPU's 60 s collective timeout.
if "xla_cpu_collective_call_terminate_timeout_seconds" not in _flags:
    _flags += " " + PATIENT_COLLECTIVES
os.environ["XLA_FLAGS"] = _flags.strip()
# Programs loaded back from that cache deadlock on several CPU devices unless XLA:CPU scheduled them
# plainly (named._compat.CACHE_SAFE_CPU_FLAG), and collectives on 8 devices need more threads than XLA:CPU's
# pools have on 2 cores (named._compat.collective_safe_env); the processes tests start inherit both.
from named._compat import safe_cpu_env  # noqa: E402 - imports jax, which reads XLA_FLAGS only later

os.environ.update(safe_cpu_env(os.environ))

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_sessionstart(session):
    n = len(jax.devices())
    if n != 8:
        raise pytest.UsageError(f"tests need 8 fake CPU devices, jax sees {n}; was jax imported before conftest?")


def pytest_unconfigure(config):
    if os.environ.get("NAMED_TESTS_JAX_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# ---- tiers: what a test needs beyond this process is a marker (pyproject.toml) ----------------------
# `make test-quick` leaves these out; a test that starts a process without one fails here, so the
# quick tier stays free of processes as tests are added.
_STARTS_PROCESSES = ("procs", "ray", "s3", "notebook", "browser")


@pytest.fixture(autouse=True)
def _processes_are_marked(request, monkeypatch):
    if not any(request.node.get_closest_marker(m) for m in _STARTS_PROCESSES):

        def refuse(self, args=None, *rest, **kw):
            pytest.fail(
                f"{request.node.nodeid} starts a process ({args!r}) but is not marked: add "
                f"@pytest.mark.procs (or one of {', '.join(_STARTS_PROCESSES[1:])})",
                pytrace=False,
            )

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield


# ---- memory: each test file's compiled programs are let go when the file ends ----------------------
# (a worker runs whole files, --dist loadfile; without this, both workers grew to about 6 GB by the end
# of the suite). The persistent compilation cache still serves a program a later file compiles again.
@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()


# ---- the edit loop's tier: tests that run long in process are `slow` too ----------------------------
# `make test-quick` must take <= 3 minutes on 2 cores. tests/runs_long.txt names the tests that took over
# 0.25 s of CPU each in a measured run of that tier (most of its CPU time, in a third of its tests);
# each keeps running in `make test`, and here gets the `slow` marker ("runs long"). A line that no
# longer matches a test of a collected file is an error, so the list cannot go stale.
RUNS_LONG_S = {  # a line: CPU seconds, a tab, the test; "#" starts a comment line
    line.split("\t", 1)[1]: float(line.split("\t", 1)[0])
    for line in Path(__file__).with_name("runs_long.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    found, files = set(), set()
    for item in items:
        files.add(item.path.name)
        for key in (f"{item.path.name}::{item.name}", f"{item.path.name}::{getattr(item, 'originalname', item.name)}"):
            if key in RUNS_LONG_S:
                item.add_marker(pytest.mark.slow)
                found.add(key)
    if any("::" in str(a) for a in config.args):  # single tests asked for: their files are not whole
        return
    stale = sorted(k for k in RUNS_LONG_S if k.split("::")[0] in files and k not in found)
    if stale:
        raise pytest.UsageError(f"tests/runs_long.txt names tests that do not exist: {stale}")


# ---- scheduling: the longest files go to the workers first ----------------------------------------
# xdist's loadfile hands each worker one file at a time in the order collected (the Makefile passes
# --no-loadscope-reorder, whose default orders files by their number of tests and so sent the few long
# end-to-end files last, where one worker ran them while the other sat idle). A file's expected cost:
# the CPU seconds runs_long.txt gives its tests, and a flat guess for the rest by what they start.
_GUESS_S = {"procs": 30.0, "ray": 30.0, "s3": 30.0, "notebook": 30.0, "browser": 30.0, "slow": 10.0}


class _LongestFilesFirst:
    @pytest.hookimpl(trylast=True)  # after -m deselects: a file's cost is that of its tests that run
    def pytest_collection_modifyitems(self, items):
        _longest_files_first(items)


def pytest_configure(config):
    config.pluginmanager.register(_LongestFilesFirst(), "named-longest-files-first")


def _longest_files_first(items):
    def key(item):  # the line of runs_long.txt that names this test, if any
        for name in (item.name, getattr(item, "originalname", item.name)):
            if (k := f"{item.path.name}::{name}") in RUNS_LONG_S:
                return k
        return None

    sharing: dict = {}  # a line naming a test without [parameters] is shared by its parametrizations
    for item in items:
        sharing[key(item)] = sharing.get(key(item), 0) + 1
    cost: dict = {}
    for item in items:
        if (k := key(item)) is not None:
            seconds = RUNS_LONG_S[k] / sharing[k]
        else:
            seconds = max((s for m, s in _GUESS_S.items() if item.get_closest_marker(m)), default=0.2)
        cost[item.path] = cost.get(item.path, 0.0) + seconds
    rank = {path: i for i, path in enumerate(sorted(cost, key=lambda p: (-cost[p], str(p))))}
    items.sort(key=lambda item: rank[item.path])  # stable: a file's own order is kept
