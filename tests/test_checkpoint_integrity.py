"""Checkpoint data integrity: the block checksum sees reorderings, every read path verifies, the CLI
reports damage (inspect: missing/short files; verify: every block), consolidate never writes bad data."""
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from axonmpi.checkpoint import CheckpointError, CheckpointReader, ShardedArray, cli, load, save
from axonmpi.checkpoint.checksum import BLOCK_BYTES, block_checksums, pagesum64, xxh3_64
from axonmpi.testing import mpiexec_env

pytestmark = pytest.mark.serial

V1 = os.path.join(os.path.dirname(__file__), "data", "checkpoint-v1")  # written by format 1 (pagesum64)


# -- the checksum itself -------------------------------------------------------------------------
def _page_data(seed=0):
    return np.random.default_rng(seed).integers(0, 2**63, 4 * 512, dtype=np.uint64)  # 4 pages of 4 KiB


def _swap_words(w):
    w = w.copy()
    w[[3, 17]] = w[[17, 3]]  # two 8-byte words inside page 0
    return w


def _swap_rows(w):
    u = w.copy().view(np.uint8).reshape(-1, 512)  # 512-byte rows; rows 1 and 5 are both in page 0
    u[[1, 5]] = u[[5, 1]]
    return u.reshape(-1).view(np.uint64)


def _cancelling_flips(w):
    a = w.copy()
    a[2] &= ~np.uint64(1)  # bit 0 of word 2 clear, of word 9 set ...
    a[9] |= np.uint64(1)
    b = a.copy()
    b[2] |= np.uint64(1)   # ... then +1 in one word and -1 in the other: the sum is unchanged
    b[9] &= ~np.uint64(1)
    return a, b


def _equal_sum_pages(seed=1):
    w = _page_data(seed)
    pages = w.reshape(4, 512)
    pages[2] = pages[1][::-1]  # same words, other order: equal page sums
    swapped = pages.copy()
    swapped[[1, 2]] = swapped[[2, 1]]
    return w, swapped.reshape(-1)


def _zero_sum_page(seed=2):
    w = _page_data(seed)
    pages = w.reshape(4, 512)
    with np.errstate(over="ignore"):
        pages[3, -1] = np.uint64(0) - pages[3, :-1].sum(dtype=np.uint64)  # page 3 sums to 0 mod 2**64
    zeroed = pages.copy()
    zeroed[3] = 0
    return w, zeroed.reshape(-1)


def _cases():
    w = _page_data()
    a, b = _cancelling_flips(w)
    return {
        "swap two 8-byte words in a page": (w, _swap_words(w)),
        "swap two 512-byte rows in a page": (w, _swap_rows(w)),
        "two cancelling bit flips": (a, b),
        "swap two equal-sum pages": _equal_sum_pages(),
        "zero a page": _zero_sum_page(),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_xxh3_sees_what_pagesum64_missed(case):
    before, after = _cases()[case]
    assert not np.array_equal(before, after)
    u0, u1 = before.view(np.uint8), after.view(np.uint8)
    assert pagesum64(u0) == pagesum64(u1), "the old checksum was blind to this change (that is the bug)"
    assert xxh3_64(u0) != xxh3_64(u1)
    assert block_checksums(before, 512) != block_checksums(after, 512)


def test_checksum_sees_flips_truncation_and_extension():
    u = _page_data().view(np.uint8)
    ref = xxh3_64(u)
    for i in (0, 7, 4095, 4096, u.size - 1):
        for bit in (0, 7):
            v = u.copy()
            v[i] ^= 1 << bit
            assert xxh3_64(v) != ref
    assert xxh3_64(u[:-1]) != ref and xxh3_64(u[:-8]) != ref
    assert xxh3_64(np.concatenate([u, np.zeros(8, np.uint8)])) != ref
    z = u.copy()
    z[4096:8192] = 0
    assert xxh3_64(z) != ref
    assert xxh3_64(u.copy()) == ref  # deterministic


# -- damaging a saved checkpoint -----------------------------------------------------------------
def _save(path, rows=BLOCK_BYTES // (8 * 64) + 40):
    """A checkpoint whose 'model/w' spans two checksum blocks (float64, 64 columns)."""
    w = np.random.default_rng(0).standard_normal((rows, 64))
    v = np.abs(np.random.default_rng(1).standard_normal((300, 8))) * 1e-6  # like exp_avg_sq
    save(path, {"model": {"w": ShardedArray(w, w.shape, (0, 0)), "b": np.arange(5.0)},
                "optimizer": {"state": {0: {"exp_avg_sq": v}}}, "step": 3}, fsync=False)
    return w, v


def _dataset_offset(path, name):
    with CheckpointReader(path) as r:
        p = r.entry(name).pieces[0]
    full = os.path.join(path, p.file)
    with h5py.File(full, "r") as f:
        return full, p.file, f[p.dset].id.get_offset()


def _patch(full, offset, fn):
    with open(full, "r+b") as fh:
        fh.seek(offset)
        data = bytearray(fh.read(8192))
        fn(data)
        fh.seek(offset)
        fh.write(bytes(data))


def _swap_words_on_disk(data):
    data[0:8], data[64:72] = data[64:72], data[0:8]


def _flip16(data):
    for i in range(100, 116):
        data[i] ^= 0x5A


@pytest.mark.parametrize("damage", [_swap_words_on_disk, _flip16])
def test_load_and_every_reader_path_refuse_damaged_blocks(world, tmp_path, damage):
    path = str(tmp_path / "ck")
    _save(path)
    full, fname, off = _dataset_offset(path, "model/w")
    _patch(full, off, damage)
    with pytest.raises(CheckpointError, match=r"checksum mismatch.*'model/w'|'model/w'.*checksum mismatch"):
        load(path)
    with CheckpointReader(path) as r:
        e = r.entry("model/w")
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            r.read_block(e, (0, 0), e.shape)     # the public block read verifies before returning
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            r.read("model/w", (slice(0, 2),))    # a slice reads (and checks) the whole block
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            r.to_dict()
        np.testing.assert_array_equal(r.read("model/b"), np.arange(5.0))  # other entries still read
        problems = r.verify_all()
    assert [(p.entry, p.file) for p in problems] == [("model/w", fname)]
    with CheckpointReader(path, verify=False) as r:  # asked for: no checksum pass
        assert r.read("model/w").shape == r.entry("model/w").shape


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "axonmpi.checkpoint", *args], capture_output=True, text=True,
                          env=mpiexec_env(), timeout=120)


def test_consolidate_refuses_corrupt_data_and_leaves_nothing_behind(world, tmp_path):
    """Issue 15: 16 flipped bytes in exp_avg_sq were copied into OUT.h5 with exit 0."""
    path = str(tmp_path / "ck")
    _, v = _save(path)
    full, fname, off = _dataset_offset(path, "optimizer/state/0/exp_avg_sq")
    _patch(full, off, _flip16)
    out = str(tmp_path / "one.h5")
    with pytest.raises(CheckpointError, match=r"'optimizer/state/0/exp_avg_sq'.*checksum mismatch"):
        cli.consolidate(path, out)
    r = _run_cli("consolidate", path, out)
    assert r.returncode == 1 and "checksum mismatch" in r.stderr and fname in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no OUT.h5, no OUT.h5.tmp
    # an existing OUT is not touched by a failed --force run either
    with open(out, "w") as fh:
        fh.write("keep")
    with pytest.raises(CheckpointError):
        cli.consolidate(path, out, force=True)
    assert open(out).read() == "keep" and sorted(os.listdir(tmp_path)) == ["ck", "one.h5"]


def test_consolidate_of_an_intact_checkpoint(world, tmp_path):
    path = str(tmp_path / "ck")
    w, v = _save(path)
    out = str(tmp_path / "one.h5")
    assert cli.consolidate(path, out) == 0
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["model/w"][...], w)
        np.testing.assert_array_equal(f["optimizer/state/0/exp_avg_sq"][...], v)
    assert sorted(os.listdir(tmp_path)) == ["ck", "one.h5"]


@pytest.mark.parametrize("how", ["missing", "truncated", "flipped"])
def test_inspect_reports_files_and_verify_names_entry_and_file(world, tmp_path, how):
    path = str(tmp_path / "ck")
    _save(path)
    full, fname, off = _dataset_offset(path, "model/w")
    if how == "missing":
        os.remove(full)
    elif how == "truncated":
        os.truncate(full, off + 4096)
    else:
        _patch(full, off, _flip16)
    r = _run_cli("inspect", path)
    if how == "flipped":  # inspect reads no array data, and says so; verify does
        assert r.returncode == 0 and "DAMAGED" not in r.stdout, r.stdout
        assert "not read here: `axonmpi ckpt verify PATH` checks every block" in r.stdout
    else:
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert "DAMAGED" in r.stdout and fname in r.stdout
        assert ("is missing" if how == "missing" else "truncated") in r.stdout, r.stdout
    r = _run_cli("verify", path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert fname in r.stdout and "DAMAGED" in r.stdout
    if how == "flipped":
        assert "entry 'model/w'" in r.stdout and "checksum mismatch" in r.stdout
    buf = __import__("io").StringIO()
    assert cli.verify(path, as_json=True, out=buf) == 1
    info = json.loads(buf.getvalue())
    assert not info["ok"] and {p["file"] for p in info["problems"]} == {fname}


def test_verify_of_an_intact_checkpoint(world, tmp_path):
    path = str(tmp_path / "ck")
    _save(path)
    r = _run_cli("verify", path)
    assert r.returncode == 0 and r.stdout.startswith("ok: ") and "xxh3_64" in r.stdout, (r.stdout, r.stderr)
    assert "4 entries" in r.stdout
    with CheckpointReader(path) as rd:
        assert rd.attrs["checksum_algorithm"] == "xxh3_64" and rd.attrs["format_version"] == 2
        assert len(rd.entry("model/w").pieces[0].checksums) == 2  # two 4 MiB blocks
        assert rd.verify_all() == [] and rd.file_problems() == []


def test_top_level_cli_has_ckpt_verify(world, tmp_path):
    from axonmpi.cli import main
    path = str(tmp_path / "ck")
    _save(path)
    assert main(["ckpt", "verify", path]) == 0


# -- old checkpoints still load ------------------------------------------------------------------
def test_format_1_checkpoint_with_pagesum64_loads_and_is_verified(world, tmp_path):
    w = np.arange(35, dtype=np.float32).reshape(7, 5) / 4
    with CheckpointReader(V1) as r:
        assert r.attrs["format_version"] == 1 and r.manifest.checksum_algorithm == "axonmpi.pagesum64"
        assert r.verify_all() == []
    out = load(V1)
    np.testing.assert_array_equal(out["model"]["w"], w)
    np.testing.assert_array_equal(out["model"]["b"], np.arange(3))
    assert out["step"] == 42 and out["note"] == "format 1"
    bad = str(tmp_path / "v1")
    shutil.copytree(V1, bad)
    full, _, off = _dataset_offset(bad, "model/w")
    _patch(full, off, lambda d: d.__setitem__(slice(0, 1), bytes([d[0] ^ 1])))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load(bad)
