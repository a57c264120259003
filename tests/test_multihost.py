"""Multi-host training on jax.distributed, proven on one machine: 2 processes x 2 fake CPU
devices (gloo collectives) against 1 process x 4 devices, FSDP over the 4 global devices. Two
devices per process, not one, so that each process has several devices to feed (as a GPU host
has); not four, because on CPU every device is a gloo rank and 8 ranks on a 2-core machine cost
about twice the time of 4 (measured: 16.4 s against 10.0 s for the same 20 steps).

What is proven here (docs/multihost.md lists it too): equal losses; each process reads only
its rows of every batch; only process 0 writes metrics and the console; checkpoints move both
ways between 2 processes and 1; a killed or frozen process makes the others exit, with and
without the launcher, and leaves the last committed checkpoint valid; the launcher's signal
forwarding, exit codes and ``--`` parsing.
"""

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest
from _procs import once, shared_dir, xla_flags
from test_trainer import CORPUS, tiny_args

from named.trainer import checkpoint as ck
from named.trainer.commands.launch import child_env, free_port, launch, parse_args
from named.trainer.config import DataError, load_config
from named.trainer.data import TrainBatches, build_data
from named.trainer.loop.distributed import settings
from named.trainer.loop.train import train

pytestmark = [pytest.mark.procs]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "config" / "gpt2_nano.yaml")
TRAIN = [
    sys.executable,
    "-c",
    "import sys; from named.trainer.commands.cli import main_train; sys.exit(main_train())",
    "--config_path",
    CONFIG,
]
LAUNCH = [sys.executable, "-m", "named.trainer.commands.launch"]
# named-train whose process 1 reaches its first train step SKEW_S seconds after process 0:
# longer than the 30 s gloo waits when it connects a group of devices (see connect_collectives).
SKEW_S = 35
TRAIN_SKEWED = [
    sys.executable,
    "-c",
    f"""
import os, sys, time
import named.trainer.loop.train as tt
make = tt.make_train_step
def late(*a, **k):
    if os.environ["NAMED_PROCESS_ID"] == "1":
        time.sleep({SKEW_S})
    return make(*a, **k)
tt.make_train_step = late
from named.trainer.commands.cli import main_train
sys.exit(main_train())
""",
    "--config_path",
    CONFIG,
]
STEPS, CKPT_EVERY = 20, 10
PER_PROCESS = 2  # CPU devices per process
# FSDP over every device of the run, whatever their number: 4 in the runs of 2 processes x 2 and
# their 1-process reference, 8 where this (8-device) pytest process resumes one.
FSDP = {"mesh.shape": "{data: -1}", "mesh.param_mapping": "{embed: data}", "mesh.compute_mapping": "{batch: data}"}
# The same run in every comparison: log every step, checkpoint at 10 (and at the end), and at
# the end an eval and a greedy sample (both run on the global mesh, so on every process).
RUN = {
    **FSDP,
    "trainer.log_interval": 1,
    "checkpoint.interval": CKPT_EVERY,
    "checkpoint.keep_last": 5,
    "trainer.eval_interval": STEPS,
    "trainer.sample_interval": STEPS,
    "trainer.sample_tokens": 8,
}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """The corpus (and its token cache) of the session, shared with test_preemption.py."""
    d = shared_dir(tmp_path_factory, "corpus")
    with once(d / ".written") as first:
        if first:
            (d / "code.txt").write_text(CORPUS)
    return d


@pytest.fixture(scope="session", autouse=True)
def no_core_dumps():
    """A process that JAX aborts (heartbeat failure) must not leave a core file behind;
    children inherit the limit (a preexec_fn would fork a multithreaded JAX process)."""
    old = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, old[1]))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, old)


# The processes this module (and test_preemption.py) starts compile without a persistent compilation
# cache: two processes of a gloo run whose programs came from one abort in their first collective
# ("Received data size doesn't match expected size": their collectives out of step). Measured with
# jax 0.10.2, both processes with XLA_FLAGS identical, the scheduler flag of named._compat included:
# process 0 loading the programs it wrote in the previous launch while process 1 compiled them
# failed 1 of 1; both loading them failed 2 of 2; neither reading a cache passed (process 0 writing
# one changes nothing). Only process 0 writes the cache, so a cache per process cannot serve process 1.
NO_COMPILATION_CACHE = {"JAX_COMPILATION_CACHE_DIR": ""}


def _base_env(**extra) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS") and not k.startswith("NAMED_")
    }
    env["XLA_FLAGS"] = xla_flags()  # the launcher adds each process's device count
    env["NAMED_LOG_LEVEL"] = "DEBUG"  # the per-process log files record the data rows read at each step
    env.update(NO_COMPILATION_CACHE)
    env.update(extra)
    return env


def start_two(args: list[str], out: Path, **extra_env) -> list[subprocess.Popen]:
    """Two named-train processes x PER_PROCESS CPU devices, wired by hand (no launcher); stdout and
    stderr of each go to ``out/stdout_<i>.txt`` and ``out/stderr_<i>.txt``."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for i in range(2):
        env = child_env(_base_env(**extra_env), i, 2, port, PER_PROCESS, cpu=True)
        with open(out / f"stdout_{i}.txt", "w") as so, open(out / f"stderr_{i}.txt", "w") as se:
            procs.append(subprocess.Popen(TRAIN + args, env=env, stdout=so, stderr=se, cwd=ROOT))
    return procs


def read(out: Path, name: str) -> str:
    return (out / name).read_text()


def finish(procs: list[subprocess.Popen], out: Path, timeout: float = 400) -> None:
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), (codes, *(read(out, f"stderr_{i}.txt")[-3000:] for i in range(len(procs))))


def metrics(run_dir: Path, key: str = "train/loss") -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    values = [(r["step"], r[key]) for r in rows if key in r]
    assert len(values) == len(dict(values)), f"{key} logged twice for a step: more than one process wrote metrics"
    return dict(values)


def copy_checkpoint(src_run: Path, step: int, dst_run: Path) -> None:
    shutil.copytree(src_run / "checkpoints" / f"step_{step}", dst_run / "checkpoints" / f"step_{step}")


@dataclass(frozen=True)
class OneProcess:
    run_dir: Path
    losses: list[float]


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory) -> OneProcess:
    """The reference: the same run as 1 named-train process x 4 devices."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    done = subprocess.run(
        TRAIN + tiny_args(corpus, run_dir, **RUN),
        env=_base_env(XLA_FLAGS=xla_flags(2 * PER_PROCESS)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = metrics(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return OneProcess(run_dir, [losses[s] for s in range(1, STEPS + 1)])


@dataclass(frozen=True)
class Skewed:
    proc: subprocess.Popen
    run_dir: Path
    out: Path


@pytest.fixture(scope="module")
def skewed_launch(one_process, corpus, tmp_path_factory):
    """One-process checkpoint resumed by the launcher on 2 processes, process 1 SKEW_S seconds late
    (TRAIN_SKEWED), started here and waited for in its test: its processes mostly sleep and wait,
    so the rest of the file runs beside them (its first test asks for this fixture, its last waits)."""
    base = tmp_path_factory.mktemp("skewed")
    run_dir, out = base / "run", base / "out"
    out.mkdir()
    copy_checkpoint(one_process.run_dir, CKPT_EVERY, run_dir)
    args = tiny_args(corpus, run_dir, **RUN, **{"trainer.load_checkpoint": "auto"})
    with open(out / "stdout_0.txt", "w") as so, open(out / "stderr_0.txt", "w") as se:  # as ``finish`` reads them
        proc = subprocess.Popen(
            [*LAUNCH, "--nproc", "2", "--devices-per-process", str(PER_PROCESS), "--", *TRAIN_SKEWED, *args],
            cwd=ROOT,
            env=_base_env(),
            stdout=so,
            stderr=se,
        )
    yield Skewed(proc, run_dir, out)
    if proc.poll() is None:  # its test did not run: the launcher ends its processes on SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def two_processes(corpus, no_core_dumps, tmp_path_factory):
    """The same run on 2 processes x 2 devices, process 0's console on; made once a session: it is
    also the uninterrupted run test_preemption.py's stopped one must end equal to."""
    base = shared_dir(tmp_path_factory, "two")
    run_dir, out = base / "run", base / "out"
    with once(base / ".done") as first:
        if first:
            shutil.rmtree(base / "run", ignore_errors=True)  # what a failed try left
            t0 = time.monotonic()
            procs = start_two(tiny_args(corpus, run_dir, **RUN, **{"tracker.console": "true"}), out)
            finish(procs, out)
            print(f"2x{PER_PROCESS} run of {STEPS} steps: {time.monotonic() - t0:.1f} s")
    return run_dir, out


def test_two_processes_match_one_process(one_process, skewed_launch, two_processes):
    # skewed_launch: started here, before the two-process run, so that its wait overlaps this file's work
    run_dir, _ = two_processes
    two = metrics(run_dir)
    assert sorted(two) == list(range(1, STEPS + 1))
    diff = np.abs(np.array([two[s] for s in range(1, STEPS + 1)]) - np.array(one_process.losses))
    print(f"max |loss(2 processes) - loss(1 process)| over {STEPS} steps: {diff.max():.3g}")
    assert diff.max() <= 1e-6, diff
    one_dir = one_process.run_dir
    assert abs(metrics(run_dir, "eval/loss")[STEPS] - metrics(one_dir, "eval/loss")[STEPS]) <= 1e-6
    assert metrics(run_dir, "sample") == metrics(one_dir, "sample")  # the same weights (to 1e-6): the same text
    assert np.mean(one_process.losses[-5:]) < np.mean(one_process.losses[:5]) - 0.5  # it did learn


_ROWS = re.compile(r"step (\d+): process (\d) reads data rows \[([\d, ]*)\]")


def test_each_process_reads_only_its_rows(corpus, two_processes):
    run_dir, _ = two_processes
    cfg = load_config(CONFIG, tiny_args(corpus, run_dir, **RUN))
    sequences = build_data(cfg.data).train
    batches = [TrainBatches(sequences, batch_size=16, seed=0, process_index=i, process_count=2) for i in range(2)]
    read_rows = [{}, {}]
    for i in range(2):
        for m in _ROWS.finditer((run_dir / "logs" / f"process_{i}.log").read_text()):
            assert int(m.group(2)) == i
            read_rows[i][int(m.group(1))] = [int(x) for x in m.group(3).split(",")]
    for step in range(STEPS):
        mine, theirs = read_rows[0][step], read_rows[1][step]
        assert len(mine) == len(theirs) == 8  # half of the global batch each
        assert mine == batches[0].indices(step).tolist() and theirs == batches[1].indices(step).tolist()
        assert not set(mine) & set(theirs)
        assert mine + theirs == batches[0].global_indices(step).tolist()


def test_only_process_zero_writes_console_and_trackers(two_processes):
    run_dir, out = two_processes
    stdout_0, stdout_1 = read(out, "stdout_0.txt"), read(out, "stdout_1.txt")
    assert (
        "[train 20]" in stdout_0
        and "[eval 20]" in stdout_0
        and "[sample 20]" in stdout_0
        and "done: 20 steps" in stdout_0
    )
    assert "[train" not in stdout_1 and "[eval" not in stdout_1 and "[sample" not in stdout_1, stdout_1[-2000:]
    assert "done:" not in stdout_1 and "loss" not in stdout_1, stdout_1[-2000:]
    assert "[train" not in read(out, "stderr_1.txt")
    log_1 = (run_dir / "logs" / "process_1.log").read_text()
    assert "[train 20]" in log_1  # process 1 logs into its own file ...
    assert len(metrics(run_dir)) == STEPS  # ... and metrics.jsonl has one row per step: process 0's


def test_two_process_checkpoint_resumes_in_one_process(corpus, one_process, two_processes, tmp_path):
    """Onto another mesh as well: this pytest process has 8 devices, so FSDP is over 8, not 4."""
    run_dir, _ = two_processes
    commit = ck.verify_checkpoint(run_dir / "checkpoints" / f"step_{CKPT_EVERY}")
    assert commit["process_count"] == 2
    # FSDP over 4 devices: both processes wrote chunks of every embed-sharded weight.
    assert sum(1 for f in commit["files"] if "/c/" in f) > len(commit["leaves"])
    copy_checkpoint(run_dir, CKPT_EVERY, tmp_path / "run")
    resumed = train(
        load_config(CONFIG, tiny_args(corpus, tmp_path / "run", **RUN, **{"trainer.load_checkpoint": "auto"}))
    )
    assert len(jax.devices()) == 8 and len(resumed.losses) == STEPS - CKPT_EVERY
    np.testing.assert_allclose(resumed.losses, one_process.losses[CKPT_EVERY:], rtol=0, atol=1e-5)
    # the reference's weights and Adam state at the end, read onto this process's 8-device layout
    want, _ = ck.restore(one_process.run_dir / "checkpoints" / f"step_{STEPS}", (resumed.model, resumed.opt_state))
    for a, b in zip(jax.tree.leaves((resumed.model, resumed.opt_state)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)


# ---- a process dies ---------------------------------------------------------------------

# Long enough never to finish in these tests; a checkpoint every 2 steps.
ENDLESS = {
    **FSDP,
    "trainer.num_train_steps": 100000,
    "trainer.log_interval": 1,
    "checkpoint.interval": 2,
    "checkpoint.keep_last": 2,
    "trainer.progress_bar": "false",
}


def wait_for_commit(run_dir: Path, procs, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = ck.list_checkpoints(run_dir)
        if found:
            return found[-1][0]
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint committed in {timeout} s")


def children_by_process_id(launcher_pid: int) -> dict[int, int]:
    """{NAMED_PROCESS_ID: os pid} of the launcher's children, from /proc."""
    out = {}
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            ids = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"NAMED_PROCESS_ID=")]
            if ids:
                out[int(ids[0])] = int(child)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_killed_process_stops_the_launch_and_the_last_checkpoint_stays_valid(corpus, tmp_path):
    run_dir = tmp_path / "run"
    # Usually the survivor's next collective fails at once on the closed socket. But gloo's
    # all-reduce, waiting for a peer that died, does not notice (its device threads stay in
    # gloo::allreduce; seen in about one run in three, before and after the stop flags moved into
    # the train step): then the heartbeat ends the survivor, here after 10 s instead of 100.
    with open(tmp_path / "out.txt", "w") as so, open(tmp_path / "err.txt", "w") as se:
        launcher = subprocess.Popen(
            [
                *LAUNCH,
                "--nproc",
                "2",
                "--devices-per-process",
                str(PER_PROCESS),
                "--",
                *TRAIN,
                *tiny_args(corpus, run_dir, **ENDLESS),
            ],
            cwd=ROOT,
            env=_base_env(NAMED_HEARTBEAT_TIMEOUT="10"),
            stdout=so,
            stderr=se,
        )
    try:
        committed = wait_for_commit(run_dir, [launcher])
        kids = children_by_process_id(launcher.pid)
        assert sorted(kids) == [0, 1]
        t0 = time.monotonic()
        os.kill(kids[1], signal.SIGKILL)
        code = launcher.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    print(f"launcher exited {took:.1f} s after process 1 was killed")
    err = (tmp_path / "err.txt").read_text()
    assert code == 128 + signal.SIGKILL, err[-3000:]
    assert f"process 1 of 2 (pid {kids[1]}) was killed by SIGKILL; stopping the others" in err
    assert "Traceback" not in err, err[-3000:]  # the survivor's broken collective is one line
    assert not alive(kids[0])
    latest = ck.latest_checkpoint(run_dir)
    assert latest is not None and int(latest.name.split("_")[1]) >= committed
    assert ck.verify_checkpoint(latest)["process_count"] == 2


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_survivor_exits_without_a_launcher(corpus, tmp_path, how):
    """No launcher to stop it: a dead peer (SIGKILL) breaks the next collective; a frozen one
    (SIGSTOP) stops sending heartbeats and JAX aborts the survivor after the heartbeat timeout."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    procs = start_two(tiny_args(corpus, run_dir, **ENDLESS), out, NAMED_HEARTBEAT_TIMEOUT="10")
    try:
        wait_for_commit(run_dir, procs)
        t0 = time.monotonic()
        procs[1].send_signal(getattr(signal, how))
        code = procs[0].wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    err = read(out, "stderr_0.txt")
    print(f"{how} of process 1: process 0 exited with {code} after {took:.1f} s")
    broken_collective = code == 1 and "error: process 0 of 2: a collective across processes failed" in err
    heartbeat_abort = code == -signal.SIGABRT and "stopped sending heartbeats" in err
    # killed in the middle of sending, the peer leaves a short message that gloo's transport
    # refuses by aborting the survivor at once (seen once under heavy load, 0.1 s after the kill)
    gloo_abort = code == -signal.SIGABRT and "Received data size doesn't match expected size" in err and took < 10
    if how == "SIGKILL":  # usually the collective; the heartbeat if process 0 was not in one (checkpoint barrier)
        assert broken_collective or heartbeat_abort or gloo_abort, (code, err[-3000:])
        assert "Traceback" not in err, err[-3000:]  # the peer's death is one line, not a trace through jax
    else:
        assert heartbeat_abort, (code, err[-3000:])
    assert ck.verify_checkpoint(ck.latest_checkpoint(run_dir))["process_count"] == 2


# ---- the launcher -----------------------------------------------------------------------

CHILD = """
import os, signal, sys, time
i = int(os.environ["NAMED_PROCESS_ID"])
out = sys.argv[1]
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(f"{out}/{i}.pid", "w").write(f"{os.getpid()} {os.environ['NAMED_COORDINATOR']} {os.environ['XLA_FLAGS']}")
if sys.argv[2] == "fail" and i == 1:
    time.sleep(0.5)
    sys.exit(3)
time.sleep(120)
"""


def launch_children(tmp_path: Path, mode: str, *launcher_args: str) -> tuple[subprocess.Popen, dict[int, int]]:
    p = subprocess.Popen(
        [
            *LAUNCH,
            "--nproc",
            "2",
            "--devices-per-process",
            "3",
            *launcher_args,
            "--",
            sys.executable,
            "-c",
            CHILD,
            str(tmp_path),
            mode,
        ],
        env=_base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"{i}.pid").exists() and (tmp_path / f"{i}.pid").read_text() for i in range(2)):
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    return p, {i: int((tmp_path / f"{i}.pid").read_text().split()[0]) for i in range(2)}


def wait_gone(pids, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_launcher_sets_each_process_up(tmp_path):
    p, pids = launch_children(tmp_path, "sleep")
    try:
        info = [(tmp_path / f"{i}.pid").read_text().split() for i in range(2)]
        assert info[0][1] == info[1][1] and info[0][1].startswith("127.0.0.1:")  # one coordinator
        assert info[0][2:] == info[1][2:] and "--xla_force_host_platform_device_count=3" in info[0][2:]
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)


def test_launcher_environment_for_gpus():
    env = child_env({"XLA_FLAGS": "--xla_cpu_foo"}, 1, 4, 1234, 2, cpu=False)
    assert env["JAX_LOCAL_DEVICE_IDS"] == "2,3" and env["XLA_FLAGS"] == "--xla_cpu_foo"
    assert "JAX_PLATFORMS" not in env and "NAMED_CPU_COLLECTIVES" not in env
    assert (env["NAMED_COORDINATOR"], env["NAMED_NUM_PROCESSES"], env["NAMED_PROCESS_ID"]) == (
        "127.0.0.1:1234",
        "4",
        "1",
    )


def test_launcher_forwards_sigterm_and_exits_143(tmp_path):
    p, pids = launch_children(tmp_path, "sleep")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM
    assert "got SIGTERM; forwarded it to all 2 processes" in err
    assert wait_gone(pids.values())


def test_launcher_kills_a_process_that_ignores_sigterm_after_the_grace(tmp_path):
    p, pids = launch_children(tmp_path, "ignore-term", "--grace", "1")
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGINT and time.monotonic() - t0 < 10
    assert wait_gone(pids.values())


def test_launcher_propagates_a_failure_and_stops_the_others(tmp_path):
    p, pids = launch_children(tmp_path, "fail")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 3
    assert f"process 1 of 2 (pid {pids[1]}) exited with code 3; stopping the others" in err
    assert wait_gone([pids[0]])


def test_launcher_death_takes_its_children_along(tmp_path):
    p, pids = launch_children(tmp_path, "sleep")
    p.kill()
    p.communicate(timeout=30)
    assert wait_gone(pids.values())


def test_launcher_exit_code_and_argument_parsing(tmp_path):
    ok = subprocess.run(
        [
            *LAUNCH,
            "--nproc",
            "3",
            "--",
            sys.executable,
            "-c",
            "import os, sys; sys.stdout.write(f\"{os.environ['NAMED_PROCESS_ID']} {sys.argv[1:]}\\n\")",
            "--",
            "--nproc",
            "9",
        ],
        env=_base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    # Everything after the first -- belongs to the command, later -- and --nproc included.
    assert sorted(ok.stdout.splitlines()) == [f"{i} ['--', '--nproc', '9']" for i in range(3)]
    bad = subprocess.run(
        [*LAUNCH, "--nproc", "2", sys.executable, "-c", "pass"],
        env=_base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "put the command after --" in bad.stderr
    none = subprocess.run([*LAUNCH, "--nproc", "2", "--"], env=_base_env(), capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "give the command after --" in none.stderr
    a, cmd = parse_args(["--nproc", "4", "--grace", "2", "--", "named-train", "--trainer.num_train_steps", "3"])
    assert (a.nproc, a.grace, a.devices_per_process, a.gpu) == (4, 2.0, None, False)
    assert cmd == ["named-train", "--trainer.num_train_steps", "3"]
    missing = subprocess.run(
        [*LAUNCH, "--nproc", "2", "--", str(tmp_path / "no-such-program")],
        env=_base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 127 and "cannot start" in missing.stderr


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    import socket

    port = free_port()
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert port < low
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ---- settings -----------------------------------------------------------------------------


def test_distributed_settings(monkeypatch):
    from named.trainer.config import ConfigError, DistributedConfig

    for k in ("NAMED_COORDINATOR", "NAMED_NUM_PROCESSES", "NAMED_PROCESS_ID", "NAMED_HEARTBEAT_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    assert settings(DistributedConfig()) is None  # one process
    auto = settings(DistributedConfig(initialize=True))  # JAX's cluster auto-detection fills the rest
    assert auto == {"initialization_timeout": 300, "heartbeat_timeout_seconds": 100}
    monkeypatch.setenv("NAMED_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("NAMED_NUM_PROCESSES", "2")
    monkeypatch.setenv("NAMED_PROCESS_ID", "1")
    monkeypatch.setenv("NAMED_HEARTBEAT_TIMEOUT", "7")
    kw = settings(DistributedConfig(local_device_ids=[0, 1]))
    assert kw == {
        "coordinator_address": "127.0.0.1:1234",
        "num_processes": 2,
        "process_id": 1,
        "local_device_ids": [0, 1],
        "initialization_timeout": 300,
        "heartbeat_timeout_seconds": 7,
    }
    assert settings(DistributedConfig(process_id=0))["process_id"] == 0  # the config wins over the environment
    monkeypatch.setenv("NAMED_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="NAMED_HEARTBEAT_TIMEOUT"):
        settings(DistributedConfig())
    monkeypatch.delenv("NAMED_HEARTBEAT_TIMEOUT")
    monkeypatch.delenv("NAMED_PROCESS_ID")
    with pytest.raises(ConfigError, match="distributed.process_id missing"):
        settings(DistributedConfig())


def test_named_train_initializes_distributed_before_any_backend():
    """named-train reads its config, then calls jax.distributed.initialize: by then no JAX
    backend may have started (initialize must come before any other JAX work)."""
    code = f"""
import sys, jax
from jax._src import xla_bridge
def initialize(**kw):
    assert not xla_bridge._backends, (
        f"backends started before jax.distributed.initialize: {{list(xla_bridge._backends)}}"
    )
    print("initialize", sorted(kw))
    sys.exit(0)
jax.distributed.initialize = initialize
from named.trainer.commands.cli import main_train
main_train(["--config_path", {CONFIG!r}, "--trainer.num_train_steps", "50"])
raise SystemExit("jax.distributed.initialize was not called")
"""
    env = child_env(_base_env(), 1, 2, 1234, 4, cpu=True)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "initialize ['coordinator_address', 'heartbeat_timeout_seconds', 'initialization_timeout', "
        "'num_processes', 'process_id']" in r.stdout
    )


@pytest.mark.parametrize(
    "raised, traceback_kept",
    [
        (
            jax.errors.JaxRuntimeError(
                "INTERNAL: Gloo all-reduce failed: [127.0.0.1]:40000: Connection closed by peer"
            ),
            False,
        ),
        (ZeroDivisionError("a bug of this process"), True),
    ],
)
def test_a_survivor_of_a_dead_peer_prints_one_line_and_a_bug_its_traceback(monkeypatch, capsys, raised, traceback_kept):
    """In-process: named-train of a 2-process run whose train() raises what a killed peer leaves
    its survivor (gloo's broken connection), or a bug. The first is one ``error:`` line naming the
    likely cause (its traceback lies inside jax and says nothing more); the second keeps it."""
    import named.trainer.loop.distributed as distributed
    import named.trainer.loop.train as train_module
    from named.trainer.commands.cli import main_train

    def fail(cfg):
        raise raised

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(distributed, "maybe_initialize", lambda cfg: True)
    monkeypatch.setattr(distributed, "exit_now", leave)
    monkeypatch.setattr(train_module, "train", fail)
    with pytest.raises(SystemExit) as left:
        main_train(["--config_path", CONFIG])
    err = capsys.readouterr().err
    assert left.value.code == 1
    assert ("Traceback (most recent call last)" in err) == traceback_kept, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: process 0 of 1: ") and type(raised).__name__ in last, err
    assert ("another process has most likely died" in last) != traceback_kept


@pytest.mark.parametrize(
    "codes, culprit",
    [
        ([None, None], None),
        ([0, None], None),
        ([-signal.SIGABRT, -signal.SIGKILL], 1),  # the killed one, not the survivor gloo aborted (CI, once)
        ([-signal.SIGABRT, -signal.SIGTERM, 1], 1),
        ([1, -signal.SIGABRT], 1),
        ([None, 2, 1], 1),
        ([-signal.SIGKILL, -signal.SIGKILL], 0),
    ],
)
def test_the_launcher_reports_the_root_cause_of_failures_seen_together(codes, culprit):
    from named.trainer.commands.launch import root_cause

    assert root_cause(codes) == culprit


def test_launcher_and_config_process_counts_must_agree(monkeypatch):
    from named.trainer.config import ConfigError, DistributedConfig

    monkeypatch.setenv("NAMED_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("NAMED_NUM_PROCESSES", "2")
    monkeypatch.setenv("NAMED_PROCESS_ID", "1")
    assert settings(DistributedConfig(num_processes=2))["num_processes"] == 2
    with pytest.raises(
        ConfigError, match=r"distributed.num_processes=4 .* started 2 processes \(NAMED_NUM_PROCESSES=2\)"
    ):
        settings(DistributedConfig(num_processes=4))


class _KeyValueStore:
    """jax.distributed's key-value store, for processes taking turns in this one: a get reads the
    oldest value set under the same name (a key less its decision number, which the turns share)."""

    def __init__(self):
        self.values: list[tuple[str, str]] = []

    def key_value_set(self, key, value):
        self.values.append((key.rpartition("/")[0], value))

    def blocking_key_value_get(self, key, timeout_ms):
        i = next(i for i, (name, _) in enumerate(self.values) if name == key.rpartition("/")[0])
        return self.values.pop(i)[1]


def test_the_data_check_is_process_0s_even_when_the_other_reads_the_run_directory_half_written(
    corpus, tmp_path, monkeypatch
):
    """A checkpoint copied into a new run directory resumes with its data as it is now. Process 0
    decides so before it writes config.yaml, then data_files.json; process 1 must not look for
    itself: between those two writes it would find a run without a record of its data and refuse."""
    import named.internal
    from named.trainer.checkpoint import rundir
    from named.trainer.loop.train import data_record_is_new

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / f"step_{CKPT_EVERY}").mkdir(parents=True)
    cfg = load_config(CONFIG, tiny_args(corpus, run_dir, **RUN))
    plan = rundir.RunPlan(run_dir, ck.location(run_dir), ck.location(run_dir / "checkpoints" / "x"), CKPT_EVERY)
    store = _KeyValueStore()
    monkeypatch.setattr(named.internal, "distributed_client", lambda: store)

    def as_process(i, count=2):
        monkeypatch.setattr(jax, "process_count", lambda: count)
        monkeypatch.setattr(jax, "process_index", lambda: i)

    as_process(0)
    assert data_record_is_new(cfg, plan) is True  # a new run directory: its data begins here
    (run_dir / "config.yaml").write_text("written by process 0's claim\n")  # data_files.json: not yet
    as_process(0, count=1)
    with pytest.raises(DataError, match="has no record of its data files"):
        data_record_is_new(cfg, plan)  # what process 1 would see, looking for itself
    as_process(1)
    assert data_record_is_new(cfg, plan) is True

    def refuse():
        raise DataError("the data changed")

    as_process(0)
    with pytest.raises(DataError, match="the data changed"):
        rundir.decided_by_process_0(refuse)
    as_process(1)
    with pytest.raises(DataError, match="process 0 refused the run: the data changed"):
        rundir.decided_by_process_0(lambda: pytest.fail("process 1 decided for itself"))
    assert store.values == []  # every decision process 0 shared was taken


def test_launcher_bounds_the_process_count(monkeypatch):
    from named.trainer.commands import launch as launch_module

    def refuse(*args, **kwargs):  # a launcher without the bound would start processes: none is
        raise OSError("started a process")

    monkeypatch.setattr(launch_module.subprocess, "Popen", refuse)
    with pytest.raises(SystemExit, match=r"--nproc 100000 is more than this machine's \d+ CPU cores can run"):
        launch(["true"], 100000)


@pytest.mark.slow
def test_a_signal_while_starting_stops_the_starting(monkeypatch, tmp_path):
    """SIGTERM arrives after the second of six processes started: those two get it and end,
    no third is started, and the launcher exits 143 at once."""
    from named.trainer.commands import launch as launch_module

    started = []

    class Popen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self.pid)
            if len(started) == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(launch_module.subprocess, "Popen", Popen)
    t0 = time.monotonic()
    code = launch(["sleep", "60"], 6, grace_s=30, env={"PATH": os.environ["PATH"]})
    assert code == 128 + signal.SIGTERM and len(started) == 2
    assert time.monotonic() - t0 < 20
    assert wait_gone(started)


# ---- the launch the first test started ------------------------------------------------------


def test_one_process_checkpoint_resumes_in_two_processes_under_the_launcher(one_process, skewed_launch):
    """Also: process 1 starts its first step SKEW_S seconds late, and nothing times out. Last in the
    file: the launch started with its first test, and the tests between ran while it waited."""
    run_dir = skewed_launch.run_dir
    finish([skewed_launch.proc], skewed_launch.out)
    two = metrics(run_dir)
    assert sorted(two) == list(range(CKPT_EVERY + 1, STEPS + 1))
    np.testing.assert_allclose([two[s] for s in sorted(two)], one_process.losses[CKPT_EVERY:], rtol=0, atol=1e-5)
    assert abs(metrics(run_dir, "eval/loss")[STEPS] - metrics(one_process.run_dir, "eval/loss")[STEPS]) <= 1e-5
    for i in range(2):
        assert (
            f"resumed from {run_dir / 'checkpoints' / f'step_{CKPT_EVERY}'} at step {CKPT_EVERY}"
            in (run_dir / "logs" / f"process_{i}.log").read_text()
        )
    assert ck.verify_checkpoint(run_dir / "checkpoints" / f"step_{STEPS}")["process_count"] == 2
