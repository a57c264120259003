"""Checkpoints on an object store, against a real S3 server: moto's standalone server, started
on a free 127.0.0.1 port for this module and stopped after it, spoken to by tensorstore's own
``s3`` kvstore driver exactly as AWS would be (endpoint and credentials from the usual AWS_*
variables). What is proven here: bitwise round trips and resharding on restore, the same bytes
as a local save, multi-process saves, retention that deletes the record first, temporary
checkpoints, partial and corrupted checkpoints (warned about, never trusted), a server that goes
away mid-save (the previous checkpoint stays the latest, the save reports the failure), a
missing bucket and refused credentials (named, before training), and ``named-train`` killed
with SIGKILL and resumed from the bucket bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest
from _procs import run_workers
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_checkpoint import abstract, assert_bitwise_equal, fsdp_state, train_state
from test_kill_resume import reference, workdir  # noqa: F401 - fixtures

from named.trainer import checkpoint as ck
from named.trainer.checkpoint import store as checkpoint_store
from named.trainer.checkpoint import write as checkpoint_write
from named.trainer.commands.launch import free_port

pytestmark = [pytest.mark.s3, pytest.mark.procs]

BUCKET = "named-ckpt"
ROOT = Path(__file__).resolve().parents[1]


class MotoServer:
    """moto's standalone S3 server in a subprocess (``python -m moto.server``)."""

    def __init__(self, **env):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **env},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=2)
                break
            except OSError as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on {self.url}") from e
                time.sleep(0.1)

    def create_bucket(self, name: str) -> None:
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT"), timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def s3_env(endpoint: str) -> dict:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }


@pytest.fixture(scope="module")
def s3():
    server = MotoServer()
    server.create_bucket(BUCKET)
    old_env = {k: os.environ.get(k) for k in s3_env(server.url)}
    old_retries = dict(checkpoint_store.RETRIES)
    os.environ.update(s3_env(server.url))
    # a server that is gone fails a save in a fraction of a second, not a minute
    checkpoint_store.RETRIES.update(max_retries=2, initial_delay="0.05s", max_delay="0.1s")
    try:
        yield server
    finally:
        checkpoint_store.RETRIES.clear()
        checkpoint_store.RETRIES.update(old_retries)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


_PREFIXES = iter(range(10**6))


@pytest.fixture
def url(s3) -> str:
    return f"s3://{BUCKET}/t{next(_PREFIXES)}"


def objects(loc) -> list[str]:
    return checkpoint_store.list_objects(ck.location(str(loc)))


# ---- round trips ----------------------------------------------------------------------------


def test_roundtrip_and_reshard_bitwise_with_the_bytes_of_a_local_save(url, tmp_path):
    mesh8 = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    state = fsdp_state(mesh8)
    path = ck.save_checkpoint(url, 1, state, {"step": 1})
    assert str(path) == f"{url}/checkpoints/step_1"
    commit = ck.verify_checkpoint(path)
    keys = objects(path)
    assert set(keys) == set(commit["files"]) | {"commit.json"}  # nothing else was left behind
    assert all(re.fullmatch(r"data-[0-9a-f]{12}/arrays/.+", k) for k in commit["files"])
    # the objects hold exactly the bytes a local save writes, file for file
    local = ck.save_checkpoint(tmp_path, 1, state, {"step": 1})
    local_sha = ck.verify_checkpoint(local)["files"]  # each file's checksum and size
    remote_sha = {rel.split("/", 1)[1]: info for rel, info in commit["files"].items()}
    assert remote_sha == local_sha and len(local_sha) > 10
    # the newest checkpoint of the run, onto 8 devices, a 4x2 mesh and one device
    restored, meta = ck.restore(url, abstract(state))
    assert meta == {"step": 1}
    assert_bitwise_equal(restored, state)
    mesh42 = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh42, P(None, "model")))
            if isinstance(x, jax.ShapeDtypeStruct) and len(x.shape) == 2
            else x
        ),
        abstract(state),
    )
    out, _ = ck.restore(path, target)
    assert_bitwise_equal(out, state)
    assert out["model"].block.w.array.sharding.spec == P(None, "model")
    single, _ = ck.restore(path, abstract(train_state(seed=4)))
    assert_bitwise_equal(single, state)


def test_retention_deletes_the_record_first_and_temporary_checkpoints_go(url, monkeypatch):
    ckpt = ck.Checkpointer(url, keep_last=2)
    for step in (1, 2, 3):
        ckpt.save(step, train_state(seed=step), {"step": step})
    ckpt.wait()
    assert [s for s, _ in ck.list_checkpoints(url)] == [2, 3]
    assert not [k for k in objects(f"{url}/checkpoints") if k.startswith("step_1/")]
    # the record goes before the data: stop a deletion right after it
    deleted = []
    real = checkpoint_store.delete_prefix

    def stop_after_records(loc):
        deleted.append(str(loc))
        raise ck.CheckpointError("stopped on purpose")

    monkeypatch.setattr(checkpoint_store, "delete_prefix", stop_after_records)
    import named.trainer.checkpoint.retention as retention

    monkeypatch.setattr(retention, "delete_prefix", stop_after_records)
    ckpt.save(4, train_state(seed=4), {"step": 4})
    with pytest.raises(ck.CheckpointError, match="stopped on purpose"):
        ckpt.wait()
    assert deleted == [f"{url}/checkpoints/step_2"]
    assert [s for s, _ in ck.list_checkpoints(url)] == [3, 4]  # step_2 is not trusted any more
    assert ck.uncommitted_steps(ck.location(f"{url}/checkpoints")) == ["step_2"]
    monkeypatch.setattr(retention, "delete_prefix", real)
    # a temporary checkpoint is not counted by keep_last and goes once a newer one commits
    ckpt.save(5, train_state(seed=5), {"step": 5}, temporary=True)
    ckpt.wait()
    assert [s for s, _ in ck.list_checkpoints(url)] == [3, 4, 5]
    ckpt.save(6, train_state(seed=6), {"step": 6})
    ckpt.wait()
    assert [s for s, _ in ck.list_checkpoints(url)] == [4, 6]
    assert {k.split("/")[0] for k in objects(f"{url}/checkpoints")} == {"step_4", "step_6"}  # leftovers removed too


def test_resaving_a_step_keeps_the_old_one_whole_until_the_new_record(url):
    first = ck.save_checkpoint(url, 3, train_state(seed=1), {"v": 1})
    old = set(ck.verify_checkpoint(first)["files"])
    again = ck.save_checkpoint(url, 3, train_state(seed=2), {"v": 2})
    commit = ck.verify_checkpoint(again)
    assert commit["metadata"] == {"v": 2} and not old & set(commit["files"])
    assert set(objects(again)) == set(commit["files"]) | {"commit.json"}  # the old data is gone after the commit
    out, _ = ck.restore(again, abstract(train_state()))
    assert_bitwise_equal(out, train_state(seed=2))


def test_whole_chunk_reads_in_flight_stay_within_their_bytes(url, monkeypatch):
    from named.trainer.checkpoint import read as checkpoint_read

    mesh8 = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    state = fsdp_state(mesh8)
    path = ck.save_checkpoint(url, 1, state)
    seen = []

    class Recorded(checkpoint_read.ReadsInFlight):
        def __init__(self):
            super().__init__()
            seen.append(self)

    monkeypatch.setattr(checkpoint_read, "ReadsInFlight", Recorded)
    chunk = max(info["size"] for rel, info in ck.read_commit(path)["files"].items() if "/c/" in rel)
    # the largest chunk's bytes twice; then no bytes but a floor of 1 and of 3 reads at once
    for budget, floor, bound in ((2 * chunk, 1, None), (1, 1, 1), (1, 3, 3)):
        monkeypatch.setattr(checkpoint_read, "READ_BYTES_IN_FLIGHT", budget)
        monkeypatch.setattr(checkpoint_read, "MIN_READS_IN_FLIGHT", floor)
        out, _ = ck.restore(path, abstract(state))
        assert_bitwise_equal(out, state)
        (in_flight,) = seen  # one for the restore, shared by its leaves
        seen.clear()
        assert in_flight.reads == in_flight.bytes == 0  # every read let go of its room
        if bound is None:
            assert chunk <= in_flight.peak_bytes <= budget
        else:
            assert 1 <= in_flight.peak_reads <= bound


def test_an_array_is_opened_with_the_zarr_json_already_fetched(url):
    """A restore fetches and checks each leaf's zarr.json itself; opening the array with it
    reads nothing more (with the stored zarr.json deleted, the chunks still read)."""
    path = ck.save_checkpoint(url, 1, train_state(seed=1))
    loc = ck.location(str(path))
    rel = next(rel for rel in ck.read_commit(path)["files"] if rel.endswith("/zarr.json"))
    meta = checkpoint_store.read_object(loc, rel)
    checkpoint_store.delete_objects(loc, [rel])
    arr = checkpoint_store.open_array(loc / rel.removesuffix("/zarr.json"), __import__("json").loads(meta))
    assert arr.read().result().shape == tuple(arr.shape)


# ---- what is never trusted ----------------------------------------------------------------


@pytest.mark.parametrize("check", ["crc32c", "sha256"])
def test_partial_and_corrupted_checkpoints_are_skipped_with_a_warning(url, check):
    ck.save_checkpoint(url, 1, train_state(seed=1), {"step": 1}, checksum=check)
    good = ck.save_checkpoint(url, 2, train_state(seed=2), {"step": 2}, checksum=check)
    assert all(set(info) == {check, "size"} for info in ck.read_commit(good)["files"].values())
    # a save of step 3 that never wrote its record
    commit = ck.read_commit(good)
    partial = ck.location(f"{url}/checkpoints/step_3")
    checkpoint_store.write_objects(partial, {f"data-0123456789ab/{k.split('/', 1)[1]}": b"x" for k in commit["files"]})
    with pytest.warns(ck.CheckpointWarning, match=re.escape(f"{partial} holds objects but no commit.json")):
        assert ck.latest_checkpoint(url) == good
    with pytest.warns(ck.CheckpointWarning, match="step_3 holds objects"):
        out, meta = ck.restore(url, abstract(train_state()))
    assert meta == {"step": 2}
    # a committed checkpoint whose object changed: named by URL, and the one before is used
    victim = sorted(k for k in commit["files"] if "/c/" in k)[0]
    data = bytearray(checkpoint_store.read_object(good, victim))
    data[len(data) // 2] ^= 0xFF
    checkpoint_store.write_objects(good, {victim: bytes(data)})
    with pytest.raises(ck.CheckpointError, match=re.escape(f"{good}/{victim}") + rf" \(corrupted; {check}\)"):
        ck.verify_checkpoint(good)
    with pytest.raises(ck.CheckpointError, match=re.escape(f"{good}/{victim}")):
        ck.restore(good, abstract(train_state()))
    with pytest.warns(ck.CheckpointWarning, match=re.escape(f"{good}/{victim}")):
        assert ck.latest_checkpoint(url) == ck.location(f"{url}/checkpoints/step_1")
    checkpoint_store.write_objects(good, {victim: bytes(data[:-3])})
    with pytest.raises(ck.CheckpointError, match="truncated"):
        ck.verify_checkpoint(good)
    # a restore reads whole chunks through tensorstore's zarr driver: a cut or missing object is
    # named too, never read as zeros (the fill value)
    for damage in ("cut", "missing"):
        if damage == "missing":
            checkpoint_store.delete_objects(good, [victim])
        with pytest.raises(ck.CheckpointError, match=re.escape(f"{good}/{victim}") + ".*missing or truncated"):
            ck.restore(good, abstract(train_state()))


class Proxy:
    """A TCP relay to the S3 server that can be cut (the server seems gone) and restored."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self):
        self.up = False
        with self.lock:
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.conns.clear()

    def close(self):
        self.cut()
        self.listener.close()


def test_a_server_that_goes_away_mid_save_fails_the_save_and_keeps_the_previous(url, s3, monkeypatch):
    proxy = Proxy(s3.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    try:
        ckpt = ck.Checkpointer(url)
        ckpt.save(1, train_state(seed=1), {"step": 1})
        ckpt.wait()
        real_write_objects = checkpoint_write.write_objects

        def write_objects(folder, blobs):  # every chunk uploaded: the server goes before the record
            if ck.store.COMMIT_FILE in blobs:
                proxy.cut()
            return real_write_objects(folder, blobs)

        monkeypatch.setattr(checkpoint_write, "write_objects", write_objects)
        ckpt.save(2, train_state(seed=2), {"step": 2})
        with pytest.raises(
            ck.CheckpointError, match=rf"step 2 to {re.escape(url)}/checkpoints failed: .*{re.escape(url)}"
        ):
            ckpt.wait()
    finally:
        proxy.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)  # the server is reachable again
    with pytest.warns(ck.CheckpointWarning, match="step_2 holds objects but no commit.json"):
        latest = ck.latest_checkpoint(url)
    assert latest == ck.location(f"{url}/checkpoints/step_1")
    with pytest.warns(ck.CheckpointWarning, match="step_2 holds objects"):
        out, meta = ck.restore(url, abstract(train_state()))
    assert meta == {"step": 1}
    assert_bitwise_equal(out, train_state(seed=1))


def test_missing_bucket_and_refused_credentials_are_named(s3):
    with pytest.raises(ck.CheckpointError, match=r"s3://no-such-bucket/x: cannot list objects: .*NoSuchBucket"):
        ck.check_access(ck.location("s3://no-such-bucket/x"), write=False)
    with pytest.raises(ck.CheckpointError, match="unsupported storage scheme http://"):
        ck.location("http://example.com/x")
    strict = MotoServer(INITIAL_NO_AUTH_ACTION_COUNT="0")  # this one checks credentials
    try:
        os.environ["AWS_ENDPOINT_URL"] = strict.url
        with pytest.raises(ck.CheckpointError, match=rf"s3://{BUCKET}/y: cannot list objects: PERMISSION_DENIED"):
            ck.check_access(ck.location(f"s3://{BUCKET}/y"), write=True)
    finally:
        os.environ["AWS_ENDPOINT_URL"] = s3.url
        strict.stop()


_WORKER = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1]))
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from named.trainer.checkpoint import Checkpointer
mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
full = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("data")), lambda idx: full[idx])
with Checkpointer(sys.argv[3]) as ckpt:
    ckpt.save(7, {"w": w}, {"step": 7})
"""


def test_two_processes_write_one_checkpoint_to_the_bucket(url):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    codes, outs = run_workers([["-c", _WORKER, str(i), str(port), url] for i in range(2)], env, timeout=180)
    assert codes == [0, 0], outs
    path = ck.latest_checkpoint(url)
    commit = ck.verify_checkpoint(path)
    assert commit["process_count"] == 2 and not [k for k in objects(path) if "manifest" in k]
    assert len([f for f in commit["files"] if "/c/" in f]) == 8  # one object per shard, from both processes
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    out, _ = ck.restore(path, {"w": jax.ShapeDtypeStruct((64, 3), np.float32, sharding=NamedSharding(mesh, P("data")))})
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(64 * 3, dtype=np.float32).reshape(64, 3))


# ---- named-train against the bucket --------------------------------------------------------


def _train(workdir: Path, run_dir: Path, base: str, log: Path, *, write_delay=None, **over) -> subprocess.Popen:
    """named-train as test_kill_resume starts it (its snapshot of the code, token cache and compilation
    cache), with checkpoints under ``base``."""
    from test_kill_resume import _args, _env, _main

    env = {**_env(workdir), **{k: os.environ[k] for k in s3_env("")}}
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _main(write_delay), *_args(workdir, run_dir, **{"checkpoint.base": base, **over})],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _final_sha(base: str, step: int) -> dict:
    commit = ck.verify_checkpoint(ck.location(f"{base}/checkpoints/step_{step}"))
    # each file's checksum and size, named below the step's folder as a local checkpoint's commit names them
    return {rel.split("/", 1)[1]: info for rel, info in commit["files"].items()}


def _restore_numpy(base: str, step: int, workdir: Path):
    """A checkpoint of the run under ``base`` as host numpy arrays: no mesh at all (resharded on restore)."""
    from test_kill_resume import _args

    from named.trainer.config import load_config
    from named.trainer.loop.optim import build_optimizer
    from named.trainer.loop.registry import model_class

    cfg = load_config(workdir / "gpt2_nano.yaml", _args(workdir, workdir / "unused")[2:])
    model_cfg = cfg.model.model_config(vocab_size=384)
    shapes = jax.eval_shape(lambda: model_class(model_cfg).init(model_cfg, key=jax.random.key(0)))
    opt = jax.eval_shape(build_optimizer(cfg.optimizer, cfg.trainer.num_train_steps).init, shapes)
    target = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), (shapes, opt))
    tree, meta = ck.restore(f"{base}/checkpoints/step_{step}", target)
    assert meta["step"] == step
    return tree


S3_INTERVAL = 9  # fewer saves than test_kill_resume's run makes: every one goes through the S3 server


def test_named_train_killed_and_resumed_from_the_bucket_bitwise(workdir, reference, s3):
    """The reference is test_kill_resume's uninterrupted run (the same training, its checkpoints on
    the local disk, made once a session): the run killed and resumed on the bucket must end equal."""
    from test_kill_resume import STEPS, _files, _losses
    from test_kill_resume import _restore_numpy as _restore_local

    over = {"checkpoint.interval": S3_INTERVAL}
    # killed inside the write window of a save (its objects on the bucket, no record yet)
    base = f"s3://{BUCKET}/train-killed"
    run_dir = workdir / "s3-killed"
    proc = _train(workdir, run_dir, base, workdir / "s3-killed-1.log", write_delay=0.3, **over)
    ckdir = ck.location(f"{base}/checkpoints")
    deadline = time.monotonic() + 300
    while not (ck.list_checkpoints(base) and ck.uncommitted_steps(ckdir)):
        assert proc.poll() is None and time.monotonic() < deadline, (workdir / "s3-killed-1.log").read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    committed = [s for s, _ in ck.list_checkpoints(base)]
    partial = ck.uncommitted_steps(ckdir)
    assert partial and int(partial[-1][5:]) > committed[-1]
    # resumed from the newest committed checkpoint, warned about the partial one, finished bitwise equal
    proc = _train(workdir, run_dir, base, workdir / "s3-killed-2.log", **over)
    assert proc.wait(timeout=600) == 0, (workdir / "s3-killed-2.log").read_text()[-3000:]
    text = (workdir / "s3-killed-2.log").read_text()
    assert f"resumed from {base}/checkpoints/step_{committed[-1]} at step {committed[-1]}" in text
    assert "CheckpointWarning" in text and f"{partial[-1]} holds objects but no commit.json" in text
    assert [s for s, _ in ck.list_checkpoints(base)] == [STEPS - S3_INTERVAL, STEPS]
    assert not (run_dir / "checkpoints").exists()  # lock, config, logs and metrics stay local
    assert {"config.yaml", "metrics.jsonl", ".lock"} <= {p.name for p in run_dir.iterdir()}
    ref_losses = dict(_losses(reference))
    resumed = _losses(run_dir)
    assert [s for s, _ in resumed][-1] == STEPS and all(ref_losses[s] == loss for s, loss in resumed)
    assert _final_sha(base, STEPS) == _files(reference / "checkpoints" / f"step_{STEPS}")  # each file's bytes
    assert ck.uncommitted_steps(ckdir) == []  # removed by the next successful save
    # reshard on restore: the bucket's checkpoint onto host numpy arrays, equal to the reference's
    got, want = _restore_numpy(base, STEPS, workdir), _restore_local(reference, STEPS, workdir)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b, strict=True)
    assert len(jax.tree.leaves(got)) > 10


def test_named_train_refuses_a_missing_bucket_before_writing(workdir, s3, tmp_path):
    proc = _train(workdir, tmp_path / "run", "s3://no-such-bucket/run", tmp_path / "missing.log")
    assert proc.wait(timeout=300) == 2
    text = (tmp_path / "missing.log").read_text()
    assert "s3://no-such-bucket/run/checkpoints: cannot list objects" in text and "Traceback" not in text
    assert not (tmp_path / "run").exists()
