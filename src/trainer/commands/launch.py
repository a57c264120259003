"""``named-launch --nproc N [--devices-per-process D] -- named-train ...``

Starts N processes of a command on this machine, wired for ``jax.distributed``: a free
coordinator port on 127.0.0.1, NAMED_COORDINATOR / NAMED_NUM_PROCESSES / NAMED_PROCESS_ID
(0..N-1), and on CPU (the default) JAX_PLATFORMS=cpu, gloo collectives and D fake CPU
devices each; with ``--gpu``, D GPUs each (JAX_LOCAL_DEVICE_IDS). Everything after the first
``--`` is the command, untouched.

- SIGINT, SIGTERM, SIGUSR1, SIGUSR2 and SIGHUP are forwarded to every process; a second one kills
  them (SIGKILL). named-train saves a checkpoint on such a signal (``trainer.stop_signals``) and
  exits with 128 + the signal; the launcher waits up to ``--grace`` seconds (120) for that.
- When one process fails (non-zero exit, or killed by a signal), the launcher says which one
  and how, stops the others (SIGTERM, then SIGKILL after ``--grace`` seconds) and exits with
  that process's code (128 + signal number for a signal).
- ``--nproc`` is at most ``PROCESSES_PER_CORE`` (4) per CPU core of this machine: more only
  thrash it (each process holds a JAX runtime), and a mistyped count would start until the
  machine runs out of processes. A signal that arrives while the processes are being started
  stops the starting too: the ones started get it, no more are started.
- Each process runs in its own process group (so a terminal's Ctrl-C reaches it once, through
  the launcher) and gets SIGTERM if the launcher itself dies.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time

PREFIX = "named-launch:"
# Forwarded to every process: the stop signals named-train may be told to save on.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
GRACE_S = 120.0  # long enough for a stop checkpoint of a small run; --grace for larger ones
PROCESSES_PER_CORE = 4


def max_processes() -> int:
    """The most processes ``--nproc`` may start on this machine."""
    return PROCESSES_PER_CORE * (os.cpu_count() or 1)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nobody listens on, chosen below the kernel's ephemeral range.

    Ports from bind(0) come from the ephemeral range, which is also where every outgoing
    connection (gloo opens dozens) takes its local port, so one can be taken between this
    check and the coordinator binding it. Below that range only listeners take ports.
    """
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    if low > 11000:
        for _ in range(64):
            port = rng.randrange(10000, low - 1000)
            if _port_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict, pid: int, nproc: int, port: int, devices: int | None, cpu: bool) -> dict:
    """The environment of process ``pid``: ``base`` plus what jax.distributed needs."""
    env = dict(base)
    env.update(NAMED_COORDINATOR=f"127.0.0.1:{port}", NAMED_NUM_PROCESSES=str(nproc), NAMED_PROCESS_ID=str(pid))
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
        env["NAMED_CPU_COLLECTIVES"] = "gloo"
        if devices:
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    elif devices:  # GPUs: process i takes devices [i*D, (i+1)*D); jax.distributed.initialize reads this
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(d) for d in range(pid * devices, (pid + 1) * devices))
    return env


def _die_with(parent: int):
    """For the child, between fork and exec: SIGTERM when the launcher dies (Linux), so that
    killing the launcher never leaves orphans training on."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(128 + signal.SIGTERM)

    return preexec


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def launch(
    cmd: list[str],
    nproc: int,
    *,
    devices_per_process: int | None = None,
    cpu: bool = True,
    grace_s: float = GRACE_S,
    env: dict | None = None,
    port: int | None = None,
) -> int:
    """Run ``cmd`` as ``nproc`` processes; return 0, or the first failure's exit code."""
    if nproc < 1:
        # a CLI exits with its message, as argparse does: SystemExit, not a NamedError
        raise SystemExit(f"{PREFIX} --nproc must be >= 1, got {nproc}")  # protocol
    if nproc > max_processes():
        raise SystemExit(  # protocol: as argparse
            f"{PREFIX} --nproc {nproc} is more than this machine's {os.cpu_count()} CPU cores can run "
            f"({PROCESSES_PER_CORE} per core: at most {max_processes()}); named-launch starts processes on this "
            "machine only"
        )
    if not cmd:
        usage = "named-launch --nproc 2 -- named-train ..."
        raise SystemExit(f"{PREFIX} give the command after --, e.g. {usage}")  # protocol: as argparse
    port = port or free_port()
    base = dict(os.environ if env is None else env)
    received: list[int] = []
    procs: list[subprocess.Popen] = []
    told: set[int] = set()  # the pids that have the first signal

    def on_signal(signum, _frame):
        received.append(signum)
        sig = signum if len(received) == 1 else signal.SIGKILL
        for p in procs:
            _signal_group(p, sig)
            told.add(p.pid)

    old = {s: signal.signal(s, on_signal) for s in FORWARDED}
    preexec = _die_with(os.getpid())
    try:
        for i in range(nproc):
            if received:  # stopped while starting: the started ones have the signal, start no more
                break
            try:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=child_env(base, i, nproc, port, devices_per_process, cpu),
                        process_group=0,
                        preexec_fn=preexec,
                    )
                )
                if received and procs[-1].pid not in told:  # the signal came while it was being started
                    _signal_group(procs[-1], received[0])
            except OSError as e:
                print(f"{PREFIX} cannot start {cmd[0]!r}: {e}", file=sys.stderr)
                _stop(procs, grace_s)
                return 127
        while not received:
            codes = [p.poll() for p in procs]
            if received:
                break
            i = root_cause(codes)
            if i is not None:
                code = codes[i]
                print(
                    f"{PREFIX} process {i} of {nproc} (pid {procs[i].pid}) {describe(code)}; stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
                _stop(procs, grace_s)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
        signum = received[0]
        print(
            f"{PREFIX} got {signal.Signals(signum).name}; forwarded it to "
            + (
                f"all {nproc} processes"
                if len(procs) == nproc
                else f"the {len(procs)} of {nproc} started; started no more"
            ),
            file=sys.stderr,
            flush=True,
        )
        _stop(procs, grace_s, already_signalled=True)
        return 128 + signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def root_cause(codes: list[int | None]) -> int | None:
    """Of the processes' exit codes seen in one poll (None: running; -N: killed by signal N), the
    failure to report, or None. A process killed from outside brings its peers down with errors of
    their own, which may end in the same poll: a failed gloo collective throws in C++, whose
    ``terminate`` ends the process with SIGABRT. So a signal other than SIGABRT comes first, then
    SIGABRT, then a non-zero exit; the lowest process index among equals."""
    bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if not bad:
        return None
    return min(bad, key=lambda ic: (ic[1] > 0, ic[1] == -signal.SIGABRT, ic[0]))[0]


def _stop(procs: list[subprocess.Popen], grace_s: float, already_signalled: bool = False) -> None:
    """SIGTERM every live process group, SIGKILL what is left after ``grace_s``, reap all."""
    if not already_signalled:
        for p in procs:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Options before the first ``--``, the command after it (untouched, ``--`` included)."""
    if "--" in argv:
        k = argv.index("--")
        own, cmd = argv[:k], argv[k + 1 :]
    else:
        own, cmd = argv, []
    p = argparse.ArgumentParser(
        prog="named-launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, required=True, help="processes to start")
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="CPU: fake devices per process; with --gpu: GPUs per process (process i gets i*D .. i*D+D-1)",
    )
    p.add_argument("--gpu", action="store_true", help="the machine's accelerators: no CPU platform, no gloo")
    p.add_argument(
        "--grace",
        type=float,
        default=GRACE_S,
        help="seconds between a forwarded signal (or SIGTERM) and SIGKILL: time for a stop checkpoint",
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    a, extra = p.parse_known_args(own)
    if extra:
        p.error(f"unrecognized arguments before --: {' '.join(extra)} (put the command after --)")
    if not cmd:
        p.error("give the command after --, e.g. named-launch --nproc 2 -- named-train --config_path ...")
    return a, cmd


def main(argv: list[str] | None = None) -> int:
    a, cmd = parse_args(sys.argv[1:] if argv is None else argv)
    return launch(cmd, a.nproc, devices_per_process=a.devices_per_process, cpu=not a.gpu, grace_s=a.grace, port=a.port)


if __name__ == "__main__":
    sys.exit(main())
