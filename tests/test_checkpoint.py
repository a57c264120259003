"""Checkpoints: bitwise roundtrip, resharding on restore, async save, crash safety, integrity, retention."""

import errno
import fcntl
import hashlib
import json
import os
import re
import textwrap
import threading
import tracemalloc
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _procs import run_workers
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import named as nm
from named.trainer import checkpoint as ck
from named.trainer.checkpoint import Checkpointer, CheckpointError, CheckpointWarning
from named.trainer.commands.launch import free_port


class Block(eqx.Module):
    w: nm.NamedArray
    b: nm.NamedArray
    scale: jax.Array
    eps: float
    act: object


class Model(eqx.Module):
    embed: nm.NamedArray
    block: Block
    lm_bias: jax.Array  # bf16, positional


def make_model(seed=0) -> Model:
    k = jax.random.split(jax.random.key(seed), 4)
    return Model(
        embed=nm.named(jax.random.normal(k[0], (16, 8)), "vocab embed"),
        block=Block(
            w=nm.named(jax.random.normal(k[1], (8, 32)), "embed mlp"),
            b=nm.named(jnp.zeros(32), "mlp"),
            scale=jnp.float32(0.5),
            eps=1e-5,
            act=jax.nn.gelu,
        ),
        lm_bias=jax.random.normal(k[2], (16,)).astype(jnp.bfloat16),
    )


def train_state(seed=0):
    model = make_model(seed)
    params = eqx.filter(model, eqx.is_array)
    opt = optax.adamw(1e-2)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda x: x * 0.1 + 1.0, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    model = eqx.apply_updates(model, updates)
    return {"model": model, "opt_state": opt_state, "rng": jax.random.key(7), "table": np.arange(6, dtype=np.int64)}


def arrays_of(tree):
    def raw(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return [raw(x) for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def assert_bitwise_equal(a, b):
    la, lb = arrays_of(a), arrays_of(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def abstract(tree):
    """The target for restore: ShapeDtypeStructs (with shardings) in place of arrays."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x, tree
    )


def step_dirs(run_dir):
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())


# ---- roundtrip -----------------------------------------------------------------------


def test_roundtrip_model_optimizer_and_metadata_bitwise(tmp_path):
    state = train_state()
    key = jax.random.key(3)
    meta = {
        "step": 5,
        "data": {"epoch": 1, "offset": 1234},
        "rng": jax.random.key_data(key).tolist(),
        "config": {"lr": 1e-2},
    }
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(5, state, meta)
        assert ckpt.wait() == tmp_path / "checkpoints" / "step_5"

    restored, meta2 = ck.restore(tmp_path, abstract(train_state(seed=1)))
    assert meta2 == meta
    assert_bitwise_equal(restored, state)
    assert restored["model"].block.w.axes == state["model"].block.w.axes
    assert restored["model"].block.act is jax.nn.gelu and restored["model"].block.eps == 1e-5
    assert restored["model"].lm_bias.dtype == jnp.bfloat16
    assert isinstance(restored["table"], np.ndarray)
    assert jax.random.key_data(restored["rng"]).tolist() == jax.random.key_data(state["rng"]).tolist()
    # concrete arrays work as a target too, and the restored state keeps training identically
    restored2, _ = ck.restore(tmp_path / "checkpoints" / "step_5", train_state(seed=2))
    assert_bitwise_equal(restored2, state)


def crc32c_reference(data: bytes) -> str:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit: RFC 3720's checksum."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return f"{crc ^ 0xFFFFFFFF:08x}"


REFERENCE = {"crc32c": crc32c_reference, "sha256": lambda data: hashlib.sha256(data).hexdigest()}


def test_crc32c_reference_is_rfc_3720s():
    assert crc32c_reference(b"123456789") == "e3069283"  # RFC 3720's check value
    assert crc32c_reference(bytes(32)) == "8a9136aa"  # RFC 3720 B.4: 32 bytes of zeros


@pytest.mark.parametrize("check", ["crc32c", "sha256"])
def test_commit_json_describes_tree_files_and_checksums(tmp_path, check):
    """Every file is listed with its size and the digest of the check asked for, which an
    independent implementation of that check reproduces from the file's bytes."""
    path = ck.save_checkpoint(
        tmp_path, 3, train_state(), {"step": 3}, **({} if check == "crc32c" else {"checksum": check})
    )
    commit = json.loads((path / "commit.json").read_text())
    assert commit["step"] == 3 and commit["metadata"] == {"step": 3}
    by_path = {r["path"]: r for r in commit["leaves"]}
    w = by_path["['model'].block.w"]
    assert (w["shape"], w["dtype"], w["axes"]) == ([8, 32], "float32", ["embed", "mlp"])
    eps = by_path["['model'].block.eps"]
    assert (eps["kind"], eps["type"], eps["value"]) == ("scalar", "float", 1e-5)
    on_disk = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - {"commit.json"}
    assert on_disk == set(commit["files"])
    for rel, info in commit["files"].items():
        data = (path / rel).read_bytes()
        assert info == {check: REFERENCE[check](data), "size": len(data)}, rel
    assert ck.verify_checkpoint(path)["step"] == 3


def _rewrite_commit(path: Path, edit) -> None:
    commit = json.loads((path / "commit.json").read_text())
    body = {k: v for k, v in commit.items() if k != "commit_sha256"}
    edit(body)
    (path / "commit.json").write_text(json.dumps({**body, "commit_sha256": ck.store.self_digest(body)}))


def test_a_checkpoint_listing_sha256_restores_and_an_unknown_check_is_named(tmp_path):
    """Checkpoints saved before crc32c list each file's sha256 (and nothing else changed): they
    verify and restore; a file whose entry carries no known check is refused, named."""
    state = train_state()
    path = ck.save_checkpoint(tmp_path, 1, state)

    def to_sha256(body):
        for rel, info in body["files"].items():
            body["files"][rel] = {"sha256": hashlib.sha256((path / rel).read_bytes()).hexdigest(), "size": info["size"]}

    _rewrite_commit(path, to_sha256)
    assert ck.verify_checkpoint(path)["step"] == 1
    assert_bitwise_equal(ck.restore(path, abstract(state))[0], state)
    victim = _chunk_file(path)
    rel = str(victim.relative_to(path))
    _rewrite_commit(path, lambda body: body["files"][rel].update(md5="0" * 32) or body["files"][rel].pop("sha256"))
    with pytest.raises(CheckpointError, match=re.escape(str(victim)) + ".*no one checksum"):
        ck.restore(path, abstract(state))


# ---- meshes ---------------------------------------------------------------------------


def fsdp_state(mesh):
    """Parameters and optimizer state sharded over 'data' on their first dimension."""
    state = train_state()
    first = NamedSharding(mesh, P("data"))
    repl = NamedSharding(mesh, P())

    def place(x):
        if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.device_put(x, first if x.ndim and x.shape[0] % 8 == 0 else repl)
        return x

    return jax.tree.map(place, state)


def test_save_on_8_devices_restore_on_4x2_and_single_device(tmp_path):
    mesh8 = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    state = fsdp_state(mesh8)
    assert state["model"].embed.array.sharding.spec == P("data")
    path = ck.save_checkpoint(tmp_path, 1, state)
    # one chunk file per shard, each written once: 8 for a sharded leaf, 1 for a replicated one
    commit = ck.verify_checkpoint(path)
    rec = {r["path"]: r for r in commit["leaves"]}
    assert rec["['model'].embed"]["dir"] == "arrays/00000.model.embed"
    assert len([p for p in (path / rec["['model'].embed"]["dir"] / "c").rglob("*") if p.is_file()]) == 8
    scale_dir = path / rec["['model'].block.scale"]["dir"]
    assert sorted(p.name for p in scale_dir.rglob("*") if p.is_file()) == ["c", "zarr.json"]

    mesh42 = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))

    def target_42(x):
        if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            spec = P("model", "data") if x.ndim == 2 else P("data") if x.ndim == 1 and x.shape[0] % 4 == 0 else P()
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh42, spec))
        return x

    target = jax.tree.map(target_42, train_state())
    restored, _ = ck.restore(path, target)
    assert_bitwise_equal(restored, state)
    assert restored["model"].block.w.array.sharding == NamedSharding(mesh42, P("model", "data"))
    assert restored["opt_state"][0].mu.embed.array.sharding == NamedSharding(mesh42, P("model", "data"))

    unsharded = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x  # noqa: E731
    one = jax.tree.map(unsharded, train_state())
    restored1, _ = ck.restore(path, one)
    assert_bitwise_equal(restored1, state)
    assert restored1["model"].embed.array.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_edge_shapes_and_dtypes_and_partial_replication(tmp_path):
    mesh42 = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    half = NamedSharding(mesh42, P("data", None))  # replicated over 'model': 4 owners, not 8
    tree = {
        "half": jax.device_put(jnp.arange(32.0).reshape(8, 4), half),
        "empty": jnp.zeros((0, 3)),
        "flag": jnp.array([True, False, True]),
        "i8": jnp.arange(-4, 4, dtype=jnp.int8),
        "u32": jnp.uint32(2**32 - 1),
        "f16": nm.named(jnp.linspace(0, 1, 5, dtype=jnp.float16), "x"),
    }
    path = ck.save_checkpoint(tmp_path, 0, tree)
    commit = ck.verify_checkpoint(path)
    half_dir = next(r["dir"] for r in commit["leaves"] if r["path"] == "['half']")
    assert sorted(f for f in commit["files"] if f.startswith(half_dir + "/c/")) == [
        f"{half_dir}/c/{i}/0" for i in range(4)
    ]
    out, _ = ck.restore(path, abstract(tree))
    assert_bitwise_equal(out, tree)
    assert out["half"].sharding == half and out["empty"].shape == (0, 3)


# ---- async ----------------------------------------------------------------------------


def test_save_returns_before_write_and_wait_commits(tmp_path, monkeypatch):
    writing, release = threading.Event(), threading.Event()
    real = ck.write.write_leaf

    def slow(*args, **kwargs):
        writing.set()
        release.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(ck.write, "write_leaf", slow)
    state = fsdp_state(jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)))
    expected = arrays_of(state)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state, {"step": 1})
    # save() has returned while the writer is held inside the write
    assert writing.wait(timeout=30) and not (tmp_path / "checkpoints" / "step_1").exists()
    # save() copied everything to host: the device buffers may be donated/deleted at once
    for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array):
            x.delete()
    release.set()
    assert ckpt.wait() == tmp_path / "checkpoints" / "step_1"
    restored, _ = ck.restore(tmp_path, abstract(train_state()))
    assert [a.tobytes() for a in arrays_of(restored)] == [a.tobytes() for a in expected]


def _host_peak(fn, until=lambda: None) -> int:
    """Peak bytes Python and numpy allocate on the host while ``fn`` runs (tensorstore's own
    buffers, which are C++, are not counted). Tracing stops only after ``until`` returns: stopping
    it while another thread allocates (a Checkpointer's writer, tensorstore's threads taking the
    GIL) can crash CPython before 3.12.9 / 3.13.2 (python/cpython#128679); a full make test lost a
    worker to that segmentation fault in the test below."""
    tracemalloc.start()
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
        until()
        return peak
    finally:
        tracemalloc.stop()


def _wide_tree(mesh, seed: int) -> dict:
    """8 MiB of f32 split over 8 devices, much more than the hashing buffers and metadata of a save."""
    keys = jax.random.split(jax.random.key(seed), 4)
    place = NamedSharding(mesh, P(None, "data"))
    return {f"w{i}": jax.device_put(jax.random.normal(k, (256, 2048)), place) for i, k in enumerate(keys)}


def test_save_checkpoint_writes_the_arrays_without_a_host_copy(tmp_path):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tree = _wide_tree(mesh, 0)
    nbytes = sum(x.nbytes for x in tree.values())
    peak = _host_peak(lambda: ck.save_checkpoint(tmp_path, 1, tree))
    assert peak < nbytes / 4, f"save_checkpoint allocated {peak} host bytes for a {nbytes}-byte tree"
    restored, _ = ck.restore(tmp_path, abstract(tree))
    assert_bitwise_equal(restored, tree)


def test_checkpointer_copies_into_the_buffers_of_its_previous_save(tmp_path, monkeypatch):
    """The second save of the same layout copies into the host buffers of the first (no fresh
    allocation, whose page faults cost more than the copy); both checkpoints keep their values."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    first, second = _wide_tree(mesh, 0), _wide_tree(mesh, 1)
    expected = [np.asarray(x) for x in (first["w0"], second["w0"])]
    nbytes = sum(x.nbytes for x in second.values())
    ckpt = Checkpointer(tmp_path, keep_last=None)
    ckpt.save(1, first)
    ckpt.wait()
    fresh, real = [], ck.write.aligned_empty
    monkeypatch.setattr(ck.write, "aligned_empty", lambda n: fresh.append(n) or real(n))

    def save_and_donate():
        ckpt.save(2, second)
        for x in second.values():  # donated right after save() returns, as the train step does
            x.delete()

    peak = _host_peak(save_and_donate, until=ckpt.wait)
    assert peak < nbytes / 4, f"the second save allocated {peak} host bytes for a {nbytes}-byte tree"
    assert not fresh, f"the second save took {sum(fresh)} bytes of fresh host buffers"
    for step, want in zip((1, 2), expected):
        restored, _ = ck.restore(tmp_path / "checkpoints" / f"step_{step}", abstract(first))
        np.testing.assert_array_equal(np.asarray(restored["w0"]), want)


def test_a_checkpointers_host_copies_go_to_the_disk_as_they_lie(tmp_path, monkeypatch):
    """A Checkpointer's host copies are page-aligned, so each chunk is written from them with
    O_DIRECT (where the OS has it), with no staging copy: every byte written comes from them."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tree = _wide_tree(mesh, 0)  # 32 chunks of 256 KiB: whole disk blocks
    copies, writes, real_empty, real_write = [], [], ck.write.aligned_empty, os.write

    def empty(n):
        out = real_empty(n)
        copies.append((out.ctypes.data, out.ctypes.data + n))
        return out

    def write(fd, data):
        writes.append((np.frombuffer(data, np.uint8).ctypes.data, len(data)))
        return real_write(fd, data)

    monkeypatch.setattr(ck.write, "aligned_empty", empty)
    monkeypatch.setattr(ck.chunks.os, "write", write)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, tree)
    monkeypatch.undo()
    assert len(copies) == 32 and sum(n for _, n in writes) == sum(x.nbytes for x in tree.values())
    assert all(any(lo <= a and a + n <= hi for lo, hi in copies) for a, n in writes)
    assert_bitwise_equal(ck.restore(tmp_path, abstract(tree))[0], tree)


@pytest.mark.parametrize("stage", ["write", "read", "read_step"])
def test_file_work_keeps_many_requests_in_flight_whatever_the_core_count(tmp_path, monkeypatch, stage):
    """A save writes, hashes and fsyncs its chunk files, and a restore hashes them, with many in
    flight at once: the disk wants a deep queue, and the number of cores (2 on CI) is not the
    limit. Each call here waits until 8 are running together; a pool of fewer threads never gets
    there."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tree = _wide_tree(mesh, 0)  # 4 arrays x 8 shards: 32 chunk files
    if stage != "write":
        step = ck.save_checkpoint(tmp_path, 1, tree)
    module, name = {
        "write": (ck.write, "write_raw_chunk"),
        "read": (ck.read, "read_whole_chunk"),  # a run's newest checkpoint: each chunk read and hashed once
        "read_step": (ck.read, "read_whole_chunk"),  # a named step: the same
    }[stage]
    real, lock, running, enough, peak = getattr(module, name), threading.Lock(), [0], threading.Event(), [0]

    def work(*args, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            if running[0] >= 8:
                enough.set()
        enough.wait(timeout=1.0)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(module, name, work)
    if stage == "write":
        ck.save_checkpoint(tmp_path, 1, tree)
    else:
        assert_bitwise_equal(ck.restore(tmp_path if stage == "read" else step, abstract(tree))[0], tree)
    assert enough.is_set(), f"at most {peak[0]} files were worked on at once"


def _odd_tree(mesh) -> dict:
    """Shards whose byte sizes are no multiple of a disk block, in several dtypes."""
    keys = jax.random.split(jax.random.key(3), 3)
    place = NamedSharding(mesh, P(None, "data"))
    return {
        "f32": jax.device_put(jax.random.normal(keys[0], (8, 1000)), place),  # 4000-byte shards
        "bf16": jax.device_put(jax.random.normal(keys[1], (67, 3000)).astype(jnp.bfloat16), place),
        "i8": jax.device_put(jax.random.randint(keys[2], (3, 8), -100, 100).astype(jnp.int8), place),
        "scalar": jnp.float32(2.5),
    }


def test_chunks_are_written_directly_hashed_from_memory_and_never_read_back(tmp_path, monkeypatch):
    """Whole-chunk shards go to their files as their bytes (O_DIRECT where the OS has it, in
    several pieces and a cut last block here), hashed as they are written: the save reads back
    only the small metadata files, and the restore (which checks every hash) gets every value."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tree = _odd_tree(mesh)
    monkeypatch.setattr(ck.chunks, "DIRECT_PIECE", 8192)
    hashed, flags = [], {}
    real_hash, real_open = ck.write.hash_file, os.open

    def hash_file(path, *a, **k):
        hashed.append(Path(path).name)
        return real_hash(path, *a, **k)

    def os_open(path, f, *a):
        flags[str(path)] = flags.get(str(path), 0) | f  # every flag asked for, a retry included
        return real_open(path, f, *a)

    monkeypatch.setattr(ck.write, "hash_file", hash_file)
    monkeypatch.setattr(ck.chunks.os, "open", os_open)
    path = ck.save_checkpoint(tmp_path, 1, tree)
    monkeypatch.undo()
    assert set(hashed) == {"zarr.json"}, hashed
    chunk_files = [p for p, f in flags.items() if f & os.O_WRONLY and ("/c/" in p or p.endswith("/c"))]
    assert len(chunk_files) == 3 * 8 + 1
    if hasattr(os, "O_DIRECT"):
        assert all(flags[p] & os.O_DIRECT for p in chunk_files)
    assert_bitwise_equal(ck.restore(path, abstract(tree))[0], tree)


def test_a_restore_reads_each_whole_chunk_once_and_tensorstore_the_rest(tmp_path, monkeypatch):
    """Restoring a named step or a run's newest checkpoint onto the layout it was saved in reads
    each chunk file once, hashed from memory (the verify pass hashes only the zarr.json files: an
    auto-resume reads the checkpoint once, not once to verify and once to use); onto another layout the
    regions that are no whole chunk go through tensorstore. Both are bitwise."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tree = _odd_tree(mesh)
    step = ck.save_checkpoint(tmp_path, 1, tree)
    hashed, whole = [], []
    real_hash, real_whole = ck.read.hash_file, ck.read.read_whole_chunk
    monkeypatch.setattr(
        ck.read, "hash_file", lambda path, *a, **k: hashed.append(Path(path).name) or real_hash(path, *a, **k)
    )
    monkeypatch.setattr(ck.read, "read_whole_chunk", lambda *a: whole.append(a[1]) or real_whole(*a))
    for source in (step, tmp_path):  # a named step, then the run's newest (its corrupt files would be skipped)
        assert_bitwise_equal(ck.restore(source, abstract(tree))[0], tree)
        assert set(hashed) == {"zarr.json"} and len(whole) == 3 * 8 + 1 == len(set(whole))
        hashed.clear(), whole.clear()
    mesh42 = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    target = abstract(tree)
    target["bf16"] = jax.ShapeDtypeStruct((67, 3000), jnp.bfloat16, sharding=NamedSharding(mesh42, P(None, "data")))
    assert_bitwise_equal(ck.restore(step, target)[0], tree)
    assert not any("bf16" in rel for rel in whole)  # its regions span chunks: tensorstore read them


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_file_system_without_o_direct_gets_the_same_checkpoint(tmp_path, monkeypatch, refused_at):
    """Some file systems refuse O_DIRECT when the file is opened (having created it), others at
    the first write or read: either way every chunk is written and read plainly, and the
    checkpoint and the values restored are the same."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform: chunks are always written plainly")
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tree = _odd_tree(mesh)
    refusals, real_open, real_readv = [], os.open, os.readv

    def refuse_write(fd, src, digest):
        refusals.append(fd)
        raise OSError(errno.EINVAL, "Invalid argument")

    def refuse_read(fd, buffers):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refusals.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_readv(fd, buffers)

    def refuse_open(path, flags, *a):
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, *a))  # created, then refused, as tmpfs does
            refusals.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    if refused_at == "write":
        monkeypatch.setattr(ck.chunks, "write_direct", refuse_write)
        monkeypatch.setattr(ck.chunks.os, "readv", refuse_read)
    else:
        monkeypatch.setattr(ck.chunks.os, "open", refuse_open)
    path = ck.save_checkpoint(tmp_path, 1, tree)
    assert len(refusals) == 3 * 8 + 1
    monkeypatch.setattr(ck.chunks, "map_chunk_file", lambda *a: (None, None))  # nor can it map them
    assert_bitwise_equal(ck.restore(path, abstract(tree))[0], tree)
    assert len(refusals) == 2 * (3 * 8 + 1)  # each chunk file read once more, refused first


@pytest.mark.parametrize("way", ["mapped", "read"])
def test_a_restore_makes_the_arrays_from_each_chunk_files_own_pages(tmp_path, monkeypatch, way):
    """Whole chunks are mapped from their files copy-on-write, or where a file system cannot map
    them, read with O_DIRECT (where the OS has it) into page-aligned buffers; either way those
    pages become the restored arrays' device buffers (on CPU devices: the same memory, no second
    copy)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    tree = _odd_tree(mesh)
    step = ck.save_checkpoint(tmp_path, 1, tree)
    flags, buffers, mapped = {}, set(), set()
    real_open, real_whole, real_map = os.open, ck.read.read_whole_chunk, ck.chunks.map_chunk_file

    def os_open(path, f, *a):
        flags[str(path)] = f
        return real_open(path, f, *a)

    def whole(*a):
        out = real_whole(*a)
        buffers.add(out.ctypes.data)
        return out

    def map_file(*a):
        pages, digest = real_map(*a) if way == "mapped" else (None, None)
        if pages is not None:
            mapped.add(pages.ctypes.data)
        return pages, digest

    monkeypatch.setattr(ck.chunks.os, "open", os_open)
    monkeypatch.setattr(ck.read, "read_whole_chunk", whole)
    monkeypatch.setattr(ck.chunks, "map_chunk_file", map_file)
    restored = ck.restore(step, abstract(tree))[0]
    assert_bitwise_equal(restored, tree)
    assert len(flags) == len(buffers) == 3 * 8 + 1
    assert all(address % 4096 == 0 for address in buffers)
    if way == "mapped":  # each file opened plainly and mapped
        assert mapped == buffers and not any(f & getattr(os, "O_DIRECT", 0) for f in flags.values())
    else:
        assert not mapped
        if hasattr(os, "O_DIRECT"):
            assert all(f & os.O_DIRECT for f in flags.values())
    for name in ("f32", "bf16", "i8", "scalar"):
        for shard in restored[name].addressable_shards:
            assert shard.data.unsafe_buffer_pointer() in buffers, name


# ---- crash safety ---------------------------------------------------------------------


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, train_state(), {"step": 1})
    ckpt.wait()

    calls = []
    lock = threading.Lock()
    real = ck.write.write_leaf

    def crashing(*args, **kwargs):
        with lock:
            calls.append(1)
            n = len(calls)
        if n == 3:
            raise OSError("disk on fire")
        return real(*args, **kwargs)

    monkeypatch.setattr(ck.write, "write_leaf", crashing)
    ckpt.save(2, train_state(seed=5), {"step": 2})
    with pytest.raises(CheckpointError, match="step 2.*disk on fire"):
        ckpt.wait()
    assert step_dirs(tmp_path) == ["step_1"]

    # what a SIGKILL would leave: a half-written tmp dir, and a dir that never got its commit.json
    (tmp_path / "checkpoints" / "step_3.tmp-0123abcd").mkdir()
    (tmp_path / "checkpoints" / "step_3.tmp-0123abcd" / "arrays").mkdir()
    (tmp_path / "checkpoints" / "step_4").mkdir()
    assert ck.latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
    restored, meta = ck.restore(tmp_path, abstract(train_state()))
    assert meta == {"step": 1}
    assert_bitwise_equal(restored, train_state())
    with pytest.raises(CheckpointError, match="step_4 has no commit.json"):
        ck.restore(tmp_path / "checkpoints" / "step_4", abstract(train_state()))

    monkeypatch.setattr(ck.write, "write_leaf", real)
    ckpt.save(5, train_state(), {"step": 5})
    ckpt.wait()  # the next good commit clears the crash leftovers
    assert step_dirs(tmp_path) == ["step_1", "step_4", "step_5"]


def _chunk_file(path: Path) -> Path:
    commit = json.loads((path / "commit.json").read_text())
    rec = next(r for r in commit["leaves"] if r["path"] == "['model'].block.w")
    return path / rec["dir"] / "c" / "0" / "0"


@pytest.mark.parametrize("check", ["crc32c", "sha256"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "commit"])
def test_corrupted_newest_falls_back_and_explicit_restore_names_the_file(tmp_path, damage, check):
    ckpt = Checkpointer(tmp_path, checksum=check)
    for step in (1, 2):
        ckpt.save(step, train_state(seed=step), {"step": step})
        ckpt.wait()
    bad = tmp_path / "checkpoints" / "step_2"
    victim = _chunk_file(bad)
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[17] ^= 0xFF
        victim.write_bytes(bytes(data))
        culprit = "checksum mismatch.*" + str(victim) + f".*{check}"
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:100])
        culprit = str(victim) + ".*truncated"
    elif damage == "delete":
        victim.unlink()
        culprit = str(victim) + " is missing"
    else:
        victim = bad / "commit.json"
        victim.write_text(victim.read_text().replace('"step": 2', '"step": 9'))
        culprit = str(victim)

    with pytest.warns(CheckpointWarning, match=f"{culprit}.*using {tmp_path / 'checkpoints' / 'step_1'}"):
        assert ck.latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
    with pytest.warns(CheckpointWarning):
        _, meta = ck.restore(tmp_path, abstract(train_state()))
    assert meta == {"step": 1}
    with pytest.raises(CheckpointError, match=culprit):
        ck.restore(bad, abstract(train_state()))


# ---- retention ------------------------------------------------------------------------


def test_retention_keeps_last_k_and_every_n(tmp_path):
    tree = {"w": jnp.arange(4.0)}
    with Checkpointer(tmp_path, keep_last=2, keep_every=3) as ckpt:
        for step in range(1, 9):
            ckpt.save(step, tree, {"step": step})
            ckpt.wait()
            if step == 4:
                assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 4]
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 6, 7, 8]
    assert step_dirs(tmp_path) == ["step_3", "step_6", "step_7", "step_8"]


def test_failed_save_deletes_nothing(tmp_path, monkeypatch):
    tree = {"w": jnp.arange(4.0)}
    ckpt = Checkpointer(tmp_path, keep_last=1)
    ckpt.save(1, tree)
    ckpt.wait()
    monkeypatch.setattr(ck.write, "write_leaf", lambda *a, **k: (_ for _ in ()).throw(OSError("boom")))
    ckpt.save(2, tree)
    with pytest.raises(CheckpointError, match="boom"):
        ckpt.wait()
    assert step_dirs(tmp_path) == ["step_1"]


def test_resaving_a_step_replaces_it(tmp_path):
    ck.save_checkpoint(tmp_path, 1, {"w": jnp.zeros(3)})
    ck.save_checkpoint(tmp_path, 1, {"w": jnp.ones(3)})
    out, _ = ck.restore(tmp_path, {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})
    assert out["w"].tolist() == [1.0, 1.0, 1.0]
    assert step_dirs(tmp_path) == ["step_1"]


# ---- mismatches and bad input ---------------------------------------------------------


def _mismatches():
    def drop_bias(s):
        return {**s, "model": eqx.tree_at(lambda m: m.lm_bias, s["model"], None)}

    def extra_leaf(s):
        return {**s, "extra": jax.ShapeDtypeStruct((2,), jnp.float32)}

    def wrong_shape(s):
        return {**s, "table": np.zeros(7, np.int64)}

    def wrong_dtype(s):
        return {**s, "model": eqx.tree_at(lambda m: m.block.scale, s["model"], jax.ShapeDtypeStruct((), jnp.bfloat16))}

    def wrong_axes(s):
        return {**s, "model": eqx.tree_at(lambda m: m.block.b, s["model"], nm.named(jnp.zeros(32), "hidden"))}

    def scalar_type(s):
        return {**s, "model": eqx.tree_at(lambda m: m.block.eps, s["model"], 1)}

    return [
        (drop_bias, r"not in the target: \"\['model'\].lm_bias\""),
        (extra_leaf, r"not in the checkpoint: \"\['extra'\]\""),
        (wrong_shape, r"leaf \"\['table'\]\": the checkpoint has int64\[6\], the target int64\[7\]"),
        (wrong_dtype, r"leaf \"\['model'\].block.scale\": the checkpoint has float32\[\], the target bfloat16\[\]"),
        (wrong_axes, r"leaf \"\['model'\].block.b\": axes \['mlp'\] in the checkpoint .* \['hidden'\] in the target"),
        (scalar_type, r"leaf \"\['model'\].block.eps\": the checkpoint has a Python float, the target a int"),
    ]


@pytest.mark.parametrize("edit,message", _mismatches(), ids=lambda v: getattr(v, "__name__", ""))
def test_structure_mismatch_names_the_leaf(tmp_path, edit, message):
    path = ck.save_checkpoint(tmp_path, 1, train_state())
    with pytest.raises(CheckpointError, match=message):
        ck.restore(path, edit(abstract(train_state())))


def test_paths_cannot_escape_the_run_dir(tmp_path):
    with pytest.raises(CheckpointError, match="without '..'"):
        Checkpointer(tmp_path / "run", subdir="../elsewhere")
    with pytest.raises(CheckpointError, match="relative path"):
        Checkpointer(tmp_path / "run", subdir=str(tmp_path / "abs"))
    (tmp_path / "run").mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "run" / "checkpoints")
    with pytest.raises(CheckpointError, match="outside the run directory"):
        Checkpointer(tmp_path / "run")


def test_commit_listing_a_path_outside_is_refused(tmp_path):
    path = ck.save_checkpoint(tmp_path, 1, {"w": jnp.zeros(3)})
    commit = json.loads((path / "commit.json").read_text())
    commit["files"]["../../../etc/passwd"] = {"sha256": "0" * 64, "size": 1}
    del commit["commit_sha256"]
    commit["commit_sha256"] = ck.store.self_digest(commit)
    (path / "commit.json").write_text(json.dumps(commit))
    with pytest.raises(CheckpointError, match="leaves the checkpoint directory"):
        ck.verify_checkpoint(path)


def test_no_checkpoint_yet(tmp_path):
    assert ck.latest_checkpoint(tmp_path) is None and ck.list_checkpoints(tmp_path) == []
    with pytest.raises(CheckpointError, match="no committed checkpoint under"):
        ck.restore(tmp_path, {"w": jax.ShapeDtypeStruct((3,), jnp.float32)})


def test_a_chosen_step_or_the_newest_is_restored(tmp_path):
    with Checkpointer(tmp_path, keep_last=None) as ckpt:
        for step in (10, 20):
            ckpt.save(step, {"w": jnp.full(3, float(step))}, {"step": step})
    target = {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}
    assert ck.restore(tmp_path / "checkpoints" / "step_10", target)[0]["w"].tolist() == [10.0] * 3
    assert ck.restore(tmp_path, target)[1] == {"step": 20}
    assert ck.latest_checkpoint(tmp_path) == ckpt.latest() == tmp_path / "checkpoints" / "step_20"


def test_bad_leaves_and_metadata_fail_before_anything_is_written(tmp_path):
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match=r"leaf \"\['x'\]\" of type object"):
        ckpt.save(1, {"x": object()})
    with pytest.raises(CheckpointError, match="JSON"):
        ckpt.save(1, {"w": jnp.zeros(2)}, {"when": object()})
    assert not (tmp_path / "checkpoints").exists() or step_dirs(tmp_path) == []


def test_no_pickle_in_checkpoint_module():
    for module in Path(ck.__file__).parent.glob("checkpoint*.py"):  # the facade and its parts
        source = module.read_text()
        assert "import pickle" not in source and "pickle.load" not in source and "np.load" not in source


# ---- several processes ----------------------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid = int(sys.argv[1])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=pid)
    import jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from named.trainer.checkpoint import Checkpointer
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    full = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    w = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("data")), lambda idx: full[idx])
    r = jax.make_array_from_callback((5,), NamedSharding(mesh, P()), lambda idx: np.arange(5, dtype=np.int32)[idx])
    with Checkpointer(sys.argv[3]) as ckpt:
        ckpt.save(7, {"w": w, "r": r}, {"step": 7})
    print("done", pid, flush=True)
    """
)


@pytest.mark.procs
def test_two_processes_write_one_checkpoint_restored_by_one(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    src = str(Path(ck.__file__).parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    codes, outs = run_workers([["-c", _WORKER, str(i), str(port), str(tmp_path)] for i in range(2)], env, timeout=120)
    assert codes == [0, 0], outs
    path = tmp_path / "checkpoints" / "step_7"
    commit = ck.verify_checkpoint(path)
    assert commit["process_count"] == 2 and not list(path.glob("manifest*"))
    w_dir = next(r["dir"] for r in commit["leaves"] if r["path"] == "['w']")
    assert sorted(f for f in commit["files"] if f.startswith(w_dir + "/c/")) == [f"{w_dir}/c/{i}/0" for i in range(8)]
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    target = {
        "w": jax.ShapeDtypeStruct((64, 3), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
        "r": jax.ShapeDtypeStruct((5,), jnp.int32),
    }
    out, meta = ck.restore(tmp_path, target)
    assert meta == {"step": 7}
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(64 * 3, dtype=np.float32).reshape(64, 3))
    np.testing.assert_array_equal(np.asarray(out["r"]), np.arange(5))


def test_a_full_disk_is_named_with_the_bytes_before_the_save(tmp_path, monkeypatch):
    """A disk without room for the checkpoint is said before anything is written, naming the disk
    and both byte counts (a write failing in the middle said "cannot close exported pointers exist")."""
    import collections
    import shutil

    tree = {"w": jnp.ones((64, 64), jnp.float32), "b": jnp.zeros((64,), jnp.float32)}
    needed = 64 * 64 * 4 + 64 * 4  # numpy's count of the arrays' bytes
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(
        CheckpointError, match=rf"step 3: the disk of .* \(mounted at .*\) has 1,000 bytes free.*needs {needed:,} bytes"
    ):
        ck.save_checkpoint(tmp_path, 3, tree)
    assert ck.list_checkpoints(tmp_path) == [] and not any((tmp_path / "checkpoints").iterdir())


def test_every_check_the_config_names_has_a_digest(tmp_path):
    # checkpoint.checksum's allowed values (config.CHECKSUMS) and the digests checksum.py computes agree
    from named.trainer.checkpoint import checksum
    from named.trainer.config import CHECKSUMS

    path = tmp_path / "f"
    path.write_bytes(b"123456789")
    digests = {check: checksum.hash_file(path, check)[0] for check in CHECKSUMS}
    assert digests == {"crc32c": "e3069283", "sha256": hashlib.sha256(b"123456789").hexdigest()}
