"""Preemption: a stop signal makes named-train finish the step in flight, commit a checkpoint and
exit with 128 + the signal (143 for SIGTERM); the resumed run ends bitwise equal to an
uninterrupted one. SIGTERM is sent at seeded random moments, during steps and inside the write
window of an asynchronous save (the same tiny GPT-2 on 2 CPU devices as test_kill_resume, whose
compilation cache makes each process cheap); a second signal stops at once; with 2 processes x
2 devices a SIGTERM to one process stops both at the same step. Also: time-based temporary
checkpoints, the per-step decisions (``step_due``, ``StopRequests``) in process, and that the flags
are agreed inside the train step itself (its output decides, over every device's row).
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import jax
import numpy as np
import pytest
from test_kill_resume import (  # noqa: F401 - fixtures
    INTERVAL,
    STEPS,
    WRITE_DELAY_S,
    _committed,
    _files,
    _losses,
    _partial_saves,
    _restore_numpy,
    _start,
    _wait_for,
    reference,  # noqa: F401 - a fixture
    workdir,  # noqa: F401 - a fixture
)
from test_multihost import CONFIG, RUN, corpus, finish, no_core_dumps, start_two, two_processes  # noqa: F401 - fixtures
from test_multihost import STEPS as STEPS_2P
from test_trainer import tiny_args

from named.trainer import checkpoint as ckpt
from named.trainer.config import ConfigError, load_config
from named.trainer.loop import train as train_mod
from named.trainer.loop.cadence import step_due
from named.trainer.loop.stop import StopRequests, exit_code
from named.trainer.loop.train import train

N_TRIALS = 6
SEED = 20251125
SIGTERM_EXIT = exit_code(signal.SIGTERM)


def test_exit_codes_are_128_plus_the_signal():
    assert (exit_code(signal.SIGTERM), exit_code(signal.SIGINT), exit_code(signal.SIGUSR1)) == (143, 130, 138)


def test_bad_stop_signals_are_named():
    for value in ("[SIGKILL]", "[SIGTERM, SIGSTOP]", "SIGTERM"):
        with pytest.raises(ConfigError, match=r"^trainer\.stop_signals"):
            load_config(CONFIG, [f"--trainer.stop_signals={value}"])
    assert load_config(CONFIG, ["--trainer.stop_signals=[]"]).trainer.stop_signals == []  # no handler at all
    assert load_config(CONFIG, ["--trainer.stop_signals=[SIGUSR2, SIGHUP]"]).trainer.stop_signals == [
        "SIGUSR2",
        "SIGHUP",
    ]


def test_due_saves_a_temporary_checkpoint_and_stops_before_the_end():
    cfg = load_config(
        CONFIG, ["--trainer.num_train_steps", "10", "--checkpoint.interval", "4", "--trainer.eval_interval", "2"]
    )
    plain = step_due(3, cfg, True, 1)
    assert not (plain.checkpoint or plain.stop)
    stopping = step_due(3, cfg, True, 1, stop=True)
    assert (stopping.checkpoint, stopping.temporary, stopping.stop, stopping.read, stopping.eval) == (
        True,
        True,
        True,
        True,
        False,
    )
    on_interval = step_due(4, cfg, True, 1, stop=True)
    assert on_interval.checkpoint and not on_interval.temporary  # an interval step stays permanent
    timed = step_due(5, cfg, True, 1, timed=True)
    assert (timed.checkpoint, timed.temporary, timed.stop) == (True, True, False)
    end = step_due(10, cfg, True, 1, stop=True, timed=True)
    assert not (end.checkpoint or end.stop)  # the end: save_at_end, and the run finishes as usual


def _step(stop: StopRequests) -> np.ndarray:
    """What a train step hands back from ``stop.flags()``, computed here with numpy: the max over rows."""
    return np.asarray(stop.flags()).max(axis=0)


def test_stop_requests_catch_a_signal_and_count_time_periods():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequests(["SIGUSR1"], every_minutes=0.005, mesh=mesh) as stop:  # a period of 0.3 s
        quiet = stop.flags()
        assert quiet.shape == (8, 2) and not np.asarray(quiet).any()
        assert {d.id for d in quiet.devices()} == {d.id for d in mesh.devices.flat}  # a row on every device
        assert stop.poll(_step(stop)) == (0, False)  # a launch's first step: nothing agreed before it
        assert stop.flags() is quiet  # unchanged flags: no new array, no transfer
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.35)
        assert (np.asarray(stop.flags()) == [signal.SIGUSR1, 1]).all()  # in every row of this process
        assert stop.poll(_step(stop)) == (0, False)  # decided by the step before: quiet then
        assert stop.poll(_step(stop)) == (signal.SIGUSR1, True)
        stop.saved()
        assert stop.poll(_step(stop))[1] is False  # saved: the next period has not passed yet
        time.sleep(0.3)
        assert stop.poll(_step(stop))[1] is False  # that step's flags were made before the sleep
        assert stop.poll(_step(stop))[1] is True
    assert signal.getsignal(signal.SIGUSR1) is before  # handlers restored


def test_the_train_steps_own_output_decides_over_every_devices_row(corpus, tmp_path, monkeypatch):
    """No signal is sent and no period passes on this host: the real train step gets flags with one
    device's row set (a period at step 2, SIGUSR1 at step 5) and its ``stop_flags`` output alone
    makes the loop save after step 3 and stop after step 6, one step later, as with several
    processes. A loop that read the host's flags, or a step that did not reduce over every row,
    would run to the end."""
    real_make, saves, outputs = train_mod.make_train_step, [], []

    def make_train_step(*args, **kwargs):
        real = real_make(*args, **kwargs)

        def step(model, opt_state, batch, key, flags):
            k = len(outputs) + 1
            rows = np.zeros(flags.shape, np.int32)
            if k in (2, 5):  # one device's row (the last, then the fourth), as if its process alone saw it
                rows[-1 if k == 2 else 3] = (0, 1) if k == 2 else (signal.SIGUSR1, 0)
            model, opt_state, metrics = real(model, opt_state, batch, key, jax.device_put(rows, flags.sharding))
            outputs.append((rows.max(axis=0), metrics["stop_flags"]))
            return model, opt_state, metrics

        return step

    real_save = ckpt.Checkpointer.save

    def record(self, step, tree, metadata=None, *, temporary=False):
        saves.append((step, temporary))
        return real_save(self, step, tree, metadata, temporary=temporary)

    monkeypatch.setattr(train_mod, "make_train_step", make_train_step)
    monkeypatch.setattr(ckpt.Checkpointer, "save", record)
    mesh = {
        "mesh.shape": "{data: 4, model: 2}",
        "mesh.param_mapping": "{embed: data}",
        "mesh.compute_mapping": "{batch: data}",
    }
    result = train(
        load_config(
            CONFIG,
            tiny_args(
                corpus,
                tmp_path / "run",
                **mesh,
                **{
                    "trainer.num_train_steps": 10,
                    "trainer.log_interval": 0,
                    "trainer.train_batch_size": 8,
                    "model.n_layer": 1,
                },
            ),
        )
    )
    assert (result.stopped_by, result.final_step) == (signal.SIGUSR1, 6)
    assert saves == [(3, True), (6, True)]  # the time-based one, then the stop's
    assert _committed(tmp_path / "run") == [6]  # the temporary step_3 went when step_6 committed
    assert len(outputs) == 6
    for want, got in outputs:  # each step's output: the max over every device's row, on every device
        assert got.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(got), want)


def test_time_based_checkpoints_are_temporary(corpus, tmp_path, monkeypatch):
    saves = []
    real = ckpt.Checkpointer.save

    def record(self, step, tree, metadata=None, *, temporary=False):
        saves.append((step, temporary))
        time.sleep(0.07)  # each save outlasts a period
        return real(self, step, tree, metadata, temporary=temporary)

    monkeypatch.setattr(ckpt.Checkpointer, "save", record)
    run_dir = tmp_path / "run"
    train(
        load_config(
            CONFIG,
            tiny_args(
                corpus,
                run_dir,
                **{
                    "trainer.num_train_steps": 10,  # the saves, not the steps, are under test
                    "checkpoint.every_minutes": 0.001,
                    "checkpoint.interval": 5,
                    "checkpoint.keep_last": 5,
                },
            ),
        )
    )
    temporary = [s for s, temp in saves if temp]
    assert len(temporary) >= 2 and (5, False) in saves and (10, False) in saves, saves
    # each temporary one was deleted when a newer one committed; the permanent ones stay
    assert _committed(run_dir) == [5, 10]
    assert all(not ckpt.read_commit(p)["temporary"] for _, p in ckpt.list_checkpoints(run_dir))


def _stopped_at(log_text: str) -> int:
    m = re.search(r"stopped by SIGTERM after step (\d+)", log_text)
    assert m, log_text[-3000:]
    return int(m.group(1))


@pytest.mark.procs
def test_sigterm_at_random_moments_commits_and_resumes_bitwise(workdir, reference):
    ref_losses = dict(_losses(reference))
    ref_files = _files(reference / "checkpoints" / f"step_{STEPS}")
    rng = random.Random(SEED)
    trials: list[dict] = []
    campaigns = 0
    while len(trials) < N_TRIALS:  # one run dir, stopped until it completes
        campaigns += 1
        run_dir = workdir / f"preempted-{campaigns}"
        cycle = 0
        while True:
            cycle += 1
            log = workdir / f"preempted-{campaigns}-{cycle}.log"
            before = _committed(run_dir)
            start = before[-1] if before else 0
            rows = len(_losses(run_dir))
            leftovers = set(_partial_saves(run_dir))
            mode = "finish" if len(trials) >= N_TRIALS else rng.choice(["step", "save"])
            proc = _start(workdir, run_dir, log, write_delay=WRITE_DELAY_S if mode == "save" else None)
            if mode == "step":
                target = min(start + rng.randint(1, 6), STEPS - 1)
                reached = _wait_for(lambda: any(s >= target for s, _ in _losses(run_dir)[rows:]), proc)
                time.sleep(rng.uniform(0.0, 0.02))
            elif mode == "save":  # inside the write window of this process's first save
                reached = _wait_for(lambda: bool(set(_partial_saves(run_dir)) - leftovers), proc)
                time.sleep(rng.uniform(0.0, 3 * WRITE_DELAY_S))
            else:
                reached = False
            if reached and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=300)
            text = log.read_text()
            if rc == 0:  # ran to the end (the signal, if any, came after the last step)
                break
            assert rc == SIGTERM_EXIT, (rc, text[-3000:])
            stopped = _stopped_at(text)
            after = _committed(run_dir)
            assert after[-1] == stopped > start  # the stop's checkpoint is committed and is the newest
            assert ckpt.read_commit(run_dir / "checkpoints" / f"step_{stopped}")["temporary"] == (
                stopped % INTERVAL != 0
            )
            with warnings_as_errors():
                assert ckpt.latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step_{stopped}"
            assert [s for s, _ in _losses(run_dir)][-1] == stopped  # every step up to the stop was logged
            trials.append({"mode": mode, "start": start, "stopped": stopped})
        for s, loss in _losses(run_dir):
            assert loss == ref_losses[s], (s, loss, ref_losses[s])
        assert _files(run_dir / "checkpoints" / f"step_{STEPS}") == ref_files
        got, want = _restore_numpy(run_dir, STEPS, workdir), _restore_numpy(reference, STEPS, workdir)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b, strict=True)
    print(f"\n{len(trials)} SIGTERMs in {campaigns} campaign(s): {trials}")
    modes = [t["mode"] for t in trials]
    assert len(trials) >= N_TRIALS and "step" in modes and "save" in modes


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error", ckpt.CheckpointWarning)

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


@pytest.mark.procs
def test_a_second_signal_stops_at_once_and_leaves_the_last_commit_whole(workdir, reference):
    run_dir = workdir / "twice"
    proc = _start(workdir, run_dir, workdir / "twice.log", write_delay=1.0)  # a long write window
    assert _wait_for(lambda: bool(_committed(run_dir)) and bool(_partial_saves(run_dir)), proc, timeout=300)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == SIGTERM_EXIT
    assert time.monotonic() - t0 < 5  # did not wait for the save in flight
    text = (workdir / "twice.log").read_text()
    assert "second signal (SIGTERM): stopping now" in text
    for s in _committed(run_dir):
        ckpt.verify_checkpoint(run_dir / "checkpoints" / f"step_{s}")
    with warnings_as_errors():
        assert ckpt.latest_checkpoint(run_dir) == run_dir / "checkpoints" / f"step_{_committed(run_dir)[-1]}"


# ---- 2 processes x 2 devices --------------------------------------------------------------

# test_multihost's run (its uninterrupted 2-process run is the reference here, made once a session),
# without the eval and the sample at its end: they must not change what the run trains.
MP_STEPS = STEPS_2P
MP_RUN = {**RUN, "trainer.eval_interval": 0, "trainer.sample_interval": 0}


@pytest.mark.procs
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(corpus, two_processes, tmp_path):
    ref_dir, _ = two_processes
    run_dir, out = tmp_path / "run", tmp_path / "out"
    procs = start_two(tiny_args(corpus, run_dir, **MP_RUN), out)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("train/loss") >= 4):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # one process only
    codes = [p.wait(timeout=300) for p in procs]
    logs = [(run_dir / "logs" / f"process_{i}.log").read_text() for i in range(2)]
    assert codes == [SIGTERM_EXIT, SIGTERM_EXIT], (codes, logs[0][-2000:], logs[1][-2000:])
    stopped = {_stopped_at(text) for text in logs}
    assert len(stopped) == 1  # both processes stopped after the same step
    (step,) = stopped
    assert 4 <= step < MP_STEPS and _committed(run_dir)[-1] == step
    assert ckpt.verify_checkpoint(run_dir / "checkpoints" / f"step_{step}")["process_count"] == 2

    out2 = tmp_path / "out2"
    finish(start_two(tiny_args(corpus, run_dir, **MP_RUN), out2), out2)
    assert (
        f"resumed from {run_dir / 'checkpoints' / f'step_{step}'} at step {step}"
        in (run_dir / "logs" / "process_1.log").read_text()
    )
    assert _files(run_dir / "checkpoints" / f"step_{MP_STEPS}") == _files(ref_dir / "checkpoints" / f"step_{MP_STEPS}")
