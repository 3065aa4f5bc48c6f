"""Checkpoints: round trip of every entry type, resharding at every group size, loud errors, safety."""
import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np

from axonmpi.checkpoint.runlock import LOCK_NAME
import pytest

import axonmpi
from axonmpi.checkpoint import (
    CheckpointError, CheckpointManager, CheckpointReader, ShardedArray, load, restore_training_state,
    save, training_state,
)
from axonmpi.distributed import barrier, broadcast_object, chunk_bounds

BIG = 2**127 + 12345  # a PCG64-sized int


@pytest.fixture
def ckdir(world):
    """A directory every rank sees (made by rank 0), removed afterwards."""
    d = tempfile.mkdtemp(prefix="axonmpi-ckpt-") if world.rank == 0 else None
    d = broadcast_object(d)
    yield d
    barrier()
    if world.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def _glob(shape, dtype=np.float64, seed=0):
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float64) * 0.5 + seed).reshape(shape).astype(dtype)


def _state(world):
    a = _glob((10, 6))
    return {
        "model": {
            "w16": np.linspace(-1, 1, 7).astype(np.float16),
            "w32": _glob((3, 5), np.float32),
            "w64": _glob((4,), np.float64, 1),
            "i8": np.arange(-3, 3, dtype=np.int8), "u64": np.array([2**64 - 1], np.uint64),
            "i64": np.arange(5, dtype=np.int64), "mask": np.array([[True, False], [False, True]]),
            "c": np.array([1 + 2j], np.complex128),
            "zero_d": np.array(3.25), "empty": np.zeros((0, 4), np.float32), "npscalar": np.float32(1.5),
            "blocks.0.attn.qkv.weight": ShardedArray.from_global(a, axis=0),
        },
        "optimizer": {"state": {0: {"step": 3, "exp_avg": np.ones(2)}, 1: {"step": 3.0}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "rng": {"seed": 7, "bit_generator": {"state": {"state": BIG, "inc": BIG + 2}, "has_uint32": 0}},
        "step": 12, "epoch": 2, "loss": 0.125, "done": False, "name": "gpt-ü", "nothing": None,
        "sizes": [1, 2.5, "x", None, [3, 4]], "shape": (2, 3), "empty_dict": {},
    }


def _check_equal(a, b, path="state"):
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _check_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b, (path, a, b)


@pytest.mark.mpi(min_size=1)
def test_round_trip_every_entry_type(world, ckdir):
    path = os.path.join(ckdir, "ck")
    state = _state(world)
    assert save(path, state) == path
    full = load(path)
    want = _state(world)
    want["model"]["blocks.0.attn.qkv.weight"] = _glob((10, 6))
    _check_equal(want, full)
    # with a template: arrays filled in place, values replaced
    tmpl = _state(world)
    zeros = {}
    for k, v in tmpl["model"].items():
        if isinstance(v, np.ndarray):
            tmpl["model"][k] = zeros[k] = np.zeros_like(v)
    tmpl["model"]["blocks.0.attn.qkv.weight"] = sa = ShardedArray.zeros((10, 6), np.float64, axis=0)
    tmpl["step"], tmpl["rng"]["bit_generator"]["state"]["state"] = 0, 1
    out = load(path, tmpl)
    assert out["model"]["w32"] is zeros["w32"]
    np.testing.assert_array_equal(zeros["w32"], _glob((3, 5), np.float32))
    np.testing.assert_array_equal(sa.local, _glob((10, 6))[sa.slices])
    assert out["step"] == 12 and out["rng"]["bit_generator"]["state"]["state"] == BIG
    assert out["shape"] == (2, 3) and out["sizes"] == [1, 2.5, "x", None, [3, 4]]
    assert out["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert set(out["optimizer"]["state"]) == {0, 1}


LAYOUTS = [((10, 6), 0), ((10, 6), 1), ((7, 9), 1), ((13,), 0), ((5, 3, 4), 2), ((2, 2), 0)]


@pytest.mark.mpi(min_size=1)
def test_reshard_onto_every_group_size_and_axis(world, ckdir):
    """Saved at N ranks split along one axis; loaded at 1..N ranks along each axis and in full."""
    path = os.path.join(ckdir, "ck")
    state = {f"e{i}": ShardedArray.from_global(_glob(s, np.float32, i), axis=ax) for i, (s, ax) in enumerate(LAYOUTS)}
    state["blocked"] = _block_2d(world, _glob((9, 7), seed=3))
    save(path, state)
    for k in range(1, world.world_size + 1):
        sub = world.new_group(range(k))
        if not sub.is_member:
            continue
        for axis in (0, -1):
            tmpl = {f"e{i}": ShardedArray.zeros(s, np.float32, axis=axis, group=sub) for i, (s, _) in enumerate(LAYOUTS)}
            tmpl["blocked"] = ShardedArray.zeros((9, 7), np.float64, axis=axis, group=sub)
            load(path, tmpl, group=sub)
            for i, (s, _) in enumerate(LAYOUTS):
                np.testing.assert_array_equal(tmpl[f"e{i}"].local, _glob(s, np.float32, i)[tmpl[f"e{i}"].slices])
            np.testing.assert_array_equal(tmpl["blocked"].local, _glob((9, 7), seed=3)[tmpl["blocked"].slices])
        full = {f"e{i}": np.empty(s, np.float32) for i, (s, _) in enumerate(LAYOUTS)}
        full["blocked"] = np.empty((9, 7))
        load(path, full, group=sub)
        for i, (s, _) in enumerate(LAYOUTS):
            np.testing.assert_array_equal(full[f"e{i}"], _glob(s, np.float32, i))


def _block_2d(world, full):
    """A 2-D block decomposition over an r x c grid of the world (c = 2 when it divides)."""
    c = 2 if world.world_size % 2 == 0 else 1
    r = world.world_size // c
    i, j = divmod(world.rank, c)
    r0, r1 = chunk_bounds(full.shape[0], r, i)
    c0, c1 = chunk_bounds(full.shape[1], c, j)
    return ShardedArray(full[r0:r1, c0:c1].copy(), full.shape, (r0, c0))


@pytest.mark.mpi(min_size=2)
def test_replicated_blocks_written_once_by_lowest_rank(world, ckdir):
    """Hybrid sharding: 2 shards, replicated over the other ranks → pieces from ranks 0 and 1 only."""
    path = os.path.join(ckdir, "ck")
    full = _glob((11, 3))
    sa = ShardedArray.from_global(full, axis=0, rank=world.rank % 2, parts=2)
    save(path, {"w": sa})
    with CheckpointReader(path) as r:
        files = sorted(p.file for p in r.entry("w").pieces)
        assert files == ["shard-00000.h5", "shard-00001.h5"]
        np.testing.assert_array_equal(r.read("w"), full)


@pytest.mark.mpi(min_size=2)
def test_plain_arrays_spread_over_ranks_and_written_once(world, ckdir):
    path = os.path.join(ckdir, "ck")
    state = {f"p{i}": _glob((64, 32), seed=i) for i in range(2 * world.world_size)}
    save(path, state)
    with CheckpointReader(path) as r:
        writers = {p.file for n in r.names() for p in r.entry(n).pieces}
        assert all(len(r.entry(n).pieces) == 1 for n in r.names())
        assert len(writers) == world.world_size
    out = load(path)
    for i in range(2 * world.world_size):
        np.testing.assert_array_equal(out[f"p{i}"], _glob((64, 32), seed=i))


@pytest.mark.mpi(min_size=1)
def test_missing_and_unexpected_entries_are_all_listed(world, ckdir):
    path = os.path.join(ckdir, "ck")
    save(path, {"a": np.ones(2), "b": {"c": 1, "d": np.zeros(3)}})
    with pytest.raises(CheckpointError) as ei:
        load(path, {"a": np.zeros(2), "x": np.zeros(1), "y": 0})
    msg = str(ei.value)
    assert "'x'" in msg and "'y'" in msg and "'b/c'" in msg and "'b/d'" in msg and "strict=False" in msg
    t = {"a": np.zeros(2), "x": np.zeros(1)}
    out = load(path, t, strict=False)
    np.testing.assert_array_equal(t["a"], 1) and np.testing.assert_array_equal(out["x"], 0)
    # an empty-dict / None leaf takes what is saved under it
    out = load(path, {"a": None, "b": {}})
    assert out["b"]["c"] == 1 and out["b"]["d"].shape == (3,)


@pytest.mark.mpi(min_size=1)
def test_shape_and_dtype_mismatch(world, ckdir):
    path = os.path.join(ckdir, "ck")
    save(path, {"w": _glob((4, 3), np.float32), "s": ShardedArray.from_global(_glob((6, 2)), axis=0)})
    with pytest.raises(CheckpointError, match=r"'w' is saved as float32 of shape \(4, 3\), the template has float32 of shape \(3, 4\)"):
        load(path, {"w": np.zeros((3, 4), np.float32), "s": None})
    with pytest.raises(CheckpointError, match=r"'w' is saved as float32 .*the template has float64.*cast=True"):
        load(path, {"w": np.zeros((4, 3)), "s": None})
    with pytest.raises(CheckpointError, match=r"'s' is saved as \w+ of shape \(6, 2\), the template has \w+ of shape \(7, 2\)"):
        load(path, {"w": None, "s": ShardedArray.zeros((7, 2), axis=0)})
    t = {"w": np.zeros((4, 3)), "s": ShardedArray.zeros((6, 2), np.float32, axis=1)}
    load(path, t, cast=True)
    np.testing.assert_array_equal(t["w"], _glob((4, 3), np.float32).astype(np.float64))
    np.testing.assert_array_equal(t["s"].local, _glob((6, 2), np.float32)[t["s"].slices])


@pytest.mark.mpi(min_size=1)
def test_bad_types_and_keys_fail_loudly(world, ckdir):
    path = os.path.join(ckdir, "ck")
    with pytest.raises(TypeError, match=rf"rank {world.rank}: state\['model'\]\['act'\] has unsupported type object"):
        save(path, {"model": {"w": np.ones(2), "act": object()}})
    with pytest.raises(ValueError, match=r"'a/b'.*no '/'"):
        save(path, {"model": {"a/b": np.ones(2)}})
    with pytest.raises(TypeError, match=r"dtype <U1"):
        save(path, {"s": np.array(["a"])})
    with pytest.raises(TypeError, match="keys must be str or int"):
        save(path, {(1, 2): 3})
    with pytest.raises(ValueError, match="reserved"):
        save(path, {"_axonmpi": 1})
    with pytest.raises(CheckpointError, match="tile"):
        save(path, {"w": ShardedArray(np.ones(2), (5,), (0,))})
    assert not os.path.exists(path) and os.listdir(ckdir) == []


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_or_fail_make_every_rank_raise(world, ckdir, monkeypatch):
    path = os.path.join(ckdir, "ck")
    state = {"w": np.ones(3)}
    if world.rank == 1:
        state["extra"] = 1
    with pytest.raises(CheckpointError, match=r"rank 1 has entries \['extra'\]"):
        save(path, state)
    save(path, {"w": np.ones(3)})
    monkeypatch.setenv("AXONMPI_CKPT_FAULT", "after_shard:1:raise")
    with pytest.raises((CheckpointError, RuntimeError), match="injected fault after_shard on rank 1"):
        save(path, {"w": np.full(3, 2.0)})
    barrier()
    np.testing.assert_array_equal(load(path)["w"], np.ones(3))
    assert sorted(os.listdir(ckdir)) == ["ck"]


def _damage(world, path, how):
    if world.rank == 0:
        with CheckpointReader(path) as r:
            p = r.entry("model/w").pieces[0]
        f = os.path.join(path, p.file)
        if how == "missing":
            os.remove(f)
        elif how == "truncated":
            os.truncate(f, os.path.getsize(f) // 2)
        elif how == "corrupt":
            with h5py.File(f, "r") as h:
                off = h[p.dset].id.get_offset()
            with open(f, "r+b") as fh:
                fh.seek(off + 8)
                b = fh.read(1)
                fh.seek(off + 8)
                fh.write(bytes([b[0] ^ 0xFF]))
        elif how == "reshaped":
            with h5py.File(f, "r+") as h:
                del h[p.dset]
                h[p.dset] = np.zeros((3,))
    barrier()
    return p.file if world.rank == 0 else None


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("how,what", [("missing", "is missing"), ("truncated", "truncated"),
                                      ("corrupt", "checksum mismatch"), ("reshaped", "changed shape")])
def test_damaged_shard_names_entry_and_file(world, ckdir, how, what):
    path = os.path.join(ckdir, "ck")
    save(path, {"model": {"w": _glob((64, 8)), "b": np.ones(3)}})
    fname = broadcast_object(_damage(world, path, how))
    with pytest.raises(CheckpointError) as ei:
        load(path)
    msg = str(ei.value)
    assert what in msg and "'model/w'" in msg and fname in msg, msg
    if how == "corrupt":  # verify=False trades the checksum pass for speed: the flip goes unnoticed
        out = load(path, verify=False)
        assert out["model"]["w"].shape == (64, 8)
        assert not np.array_equal(out["model"]["w"], _glob((64, 8)))
    # the virtual dataset alone would have hidden a missing file behind fill values
    if how == "missing" and world.rank == 0:
        with h5py.File(os.path.join(path, "index.h5")) as f:
            f["model/w"][...]  # no error from HDF5 here: this is why load never reads through it


@pytest.mark.mpi(min_size=1)
def test_index_is_plain_hdf5_with_virtual_datasets(world, ckdir):
    path = os.path.join(ckdir, "ck")
    w = _glob((10, 6))
    save(path, {"model": {"blocks.0.attn.qkv.weight": ShardedArray.from_global(w, axis=1), "b": np.arange(3)},
                "step": 5, "rng": BIG, "name": "x", "cfg": {"lr": 0.5, "layers": [1, 2]}})
    if world.rank == 0:
        moved = os.path.join(ckdir, "moved")
        shutil.move(path, moved)  # relative source paths: the directory can move
        cwd = os.getcwd()
        os.chdir("/")
        try:
            with h5py.File(os.path.join(moved, "index.h5"), "r") as f:
                np.testing.assert_array_equal(f["model/blocks.0.attn.qkv.weight"][...], w)
                np.testing.assert_array_equal(f["model/b"][...], np.arange(3))
                assert f["step"][()] == 5 and int(f["rng"][()]) == BIG and f["name"][()].decode() == "x"
                assert f["cfg/lr"][()] == 0.5 and f.attrs["format"] == "axonmpi-checkpoint"
                assert f.attrs["world_size"] == world.world_size
        finally:
            os.chdir(cwd)
        shutil.move(moved, path)
    barrier()


@pytest.mark.serial
def test_h5dump_reads_the_index(world, ckdir):
    if shutil.which("h5dump") is None:
        pytest.skip("h5dump (Debian hdf5-tools) is not installed")
    path = os.path.join(ckdir, "ck")
    save(path, {"model": {"w": ShardedArray.from_global(_glob((3, 4)), axis=0)}, "step": 9})
    r = subprocess.run(["h5dump", "-d", "/model/w", os.path.join(path, "index.h5")],
                       capture_output=True, text=True, cwd="/", timeout=30)
    assert r.returncode == 0, r.stderr
    assert "(2,0): 4, 4.5, 5, 5.5" in r.stdout, r.stdout
    r = subprocess.run(["h5dump", "-d", "/step", os.path.join(path, "index.h5")], capture_output=True, text=True)
    assert "(0): 9" in r.stdout or ": 9" in r.stdout


@pytest.mark.mpi(min_size=1)
def test_overwrite_replaces_atomically_and_refuses_foreign_paths(world, ckdir):
    path = os.path.join(ckdir, "ck")
    save(path, {"w": np.ones(4), "v": 1})
    save(path, {"w": np.full(4, 2.0), "v": 2})
    out = load(path)
    assert out["v"] == 2 and out["w"][0] == 2.0
    assert sorted(os.listdir(ckdir)) == ["ck"]
    barrier()  # rank 0 must not create "notes" below while another rank still lists the directory
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save(path, {"v": 3}, overwrite=False)
    foreign = os.path.join(ckdir, "notes")
    if world.rank == 0:
        os.makedirs(foreign)
        open(os.path.join(foreign, "keep.txt"), "w").close()
    barrier()
    with pytest.raises(FileExistsError, match="not an axonmpi checkpoint"):
        save(foreign, {"v": 3})
    assert os.path.exists(os.path.join(foreign, "keep.txt"))


@pytest.mark.mpi(min_size=1)
def test_collective_option_needs_parallel_h5py(world, ckdir):
    if h5py.get_config().mpi:
        path = os.path.join(ckdir, "ck")
        save(path, {"w": ShardedArray.from_global(_glob((7, 3)), axis=0), "b": np.ones(2)}, collective=True)
        np.testing.assert_array_equal(load(path)["w"], _glob((7, 3)))
    else:
        with pytest.raises(NotImplementedError, match="parallel HDF5"):
            save(os.path.join(ckdir, "ck"), {"w": np.ones(2)}, collective=True)


@pytest.mark.mpi(min_size=1)
def test_manager_prunes_and_finds_latest(world, ckdir):
    mgr = CheckpointManager(os.path.join(ckdir, "run"), keep_last=2, every_steps=10)
    assert mgr.latest() is None and mgr.load_latest() is None
    assert [s for s in range(0, 35) if mgr.should_save(s)] == [10, 20, 30]
    for step in (10, 20, 30):
        mgr.save(step, {"w": np.full(3, float(step)), "step": step})
    barrier()
    assert mgr.steps() == [20, 30] and mgr.latest().endswith("step-00000030")
    out = mgr.load_latest({"w": np.zeros(3), "step": 0})
    assert out["step"] == 30 and out["w"][0] == 30.0
    # a crashed save's leftovers next to a complete checkpoint are cleaned on the next save
    if world.rank == 0:
        os.makedirs(mgr.path_for(30) + ".tmp-deadbeef")
    barrier()
    mgr.save(40, {"w": np.zeros(3), "step": 40})
    barrier()
    assert sorted(n for n in os.listdir(mgr.directory) if n != LOCK_NAME) == ["step-00000030", "step-00000040"]
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(ckdir, keep_last=0)


class _Counter:
    """A duck-typed stateful object (like a sampler or scheduler)."""

    def __init__(self, pos=0):
        self.pos = pos

    def state_dict(self):
        return {"pos": self.pos, "order": (3, 1, 2)}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


@pytest.mark.mpi(min_size=1)
def test_training_state_resume_is_exact(world, ckdir):
    """Train N steps, save, train M; a fresh model+optimizer loads at N, trains M: bitwise equal."""
    nn = pytest.importorskip("axonmpi.nn")
    optim = pytest.importorskip("axonmpi.optim")
    import axonmpi.random as R
    from axonmpi.autograd.tensor import Tensor

    def make(seed):
        R.manual_seed(seed)
        m = nn.Linear(4, 3, dtype=np.float64)
        return m, optim.Adam(m.parameters(), lr=0.01)

    def step(m, opt):
        x = R.default_generator().standard_normal((5, 4))
        opt.zero_grad()
        loss = (m(Tensor(x)) ** 2).sum()
        loss.backward()
        opt.step()

    m, opt = make(1)
    sampler = _Counter()
    for _ in range(3):
        step(m, opt)
        sampler.pos += 1
    path = os.path.join(ckdir, "ck")
    save(path, training_state(m, opt, sampler=sampler, step=3, extra={"note": "x"}))
    for _ in range(2):
        step(m, opt)
    want = {k: v.copy() for k, v in m.state_dict().items()}

    m2, opt2 = make(99)
    s2 = _Counter()
    meta = restore_training_state(load(path), m2, opt2, sampler=s2)
    assert meta["step"] == 3 and meta["extra"] == {"note": "x"} and s2.pos == 3
    for _ in range(2):
        step(m2, opt2)
    for k, v in m2.state_dict().items():
        np.testing.assert_array_equal(v, want[k])


@pytest.mark.serial
def test_cli_inspect_and_consolidate(world, ckdir):
    import argparse
    import io
    import json

    from axonmpi.checkpoint import cli
    from axonmpi.testing import mpiexec_env

    path = os.path.join(ckdir, "ck")
    w = _glob((6, 4), np.float32)
    save(path, {"model": {"w": ShardedArray.from_global(w, axis=0), "b": np.ones(3)},
                "meta": {"step": 17}, "rng": BIG})
    r = subprocess.run([sys.executable, "-m", "axonmpi.checkpoint", "inspect", path],
                       capture_output=True, text=True, env=mpiexec_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "step        17" in r.stdout and "model/w" in r.stdout and "float32" in r.stdout
    assert "(6, 4)" in r.stdout and "96 B" in r.stdout and str(BIG) in r.stdout
    # the lead's top-level CLI: axonmpi ckpt ...
    top = argparse.ArgumentParser(prog="axonmpi")
    cli.add_subparser(top.add_subparsers(dest="command"))
    out = os.path.join(ckdir, "one.h5")
    args = top.parse_args(["ckpt", "consolidate", path, out])
    assert args.func(args) == 0
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["model/w"][...], w)
        assert not f["model/w"].is_virtual and f["meta/step"][()] == 17 and int(f["rng"][()]) == BIG
    buf = io.StringIO()
    assert cli.inspect(path, as_json=True, out=buf) == 0
    info = json.loads(buf.getvalue())
    assert info["step"] == 17 and info["world_size"] == 1 and info["array_bytes"] == 96 + 24
    r = subprocess.run([sys.executable, "-m", "axonmpi.checkpoint", "consolidate", path, out],
                       capture_output=True, text=True, env=mpiexec_env(), timeout=60)
    assert r.returncode == 1 and "--force" in r.stderr


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("debug", [True, False])
def test_save_names_plain_arrays_that_are_not_replicated(world, ckdir, monkeypatch, debug):
    """Always on (issue 20: per-rank optimizer moments saved as plain arrays overwrote each other)."""
    monkeypatch.setattr(world, "debug", debug)
    with pytest.raises(CheckpointError, match=r"entry 'w': plain array differs between rank 0 and rank 1"):
        save(os.path.join(ckdir, "ck"), {"w": np.full(3, float(world.rank)), "same": np.ones(2)})
