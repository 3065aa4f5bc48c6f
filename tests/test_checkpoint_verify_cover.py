"""`ckpt verify` checks that an entry's pieces tile its shape, `consolidate` names the entry, and an unfinished
save is "incomplete (ignored by resume)" with exit 0 unless --strict (issue 53 fault 4, issue 52 item 5)."""
import io
import os
import shutil

import numpy as np
import pytest

from axonmpi.checkpoint import CheckpointError, CheckpointReader, cli, save
from axonmpi.checkpoint.format import INDEX_NAME
from axonmpi.checkpoint.index import read_index, write_index


def _rewrite_index(path, edit):
    """Edit the manifest of ``path`` and write the index again (with a valid checksum)."""
    idx = os.path.join(path, INDEX_NAME)
    m = read_index(idx)
    edit(m.entries)
    os.remove(idx)
    write_index(idx, m.entries, m.attrs, m.file_bytes)


def _saved(tmp_path, name="ck"):
    path = str(tmp_path / name)
    save(path, {"w": np.arange(64.0).reshape(16, 4), "b": np.ones(3), "step": 7})
    return path


def _verify(path, strict=False):
    out = io.StringIO()
    code = cli.verify(path, out=out, strict=strict)
    return code, out.getvalue()


@pytest.mark.parametrize("how", ["huge", "gap", "overlap", "outside"])
def test_verify_finds_pieces_that_do_not_tile_the_entry(tmp_path, how, monkeypatch):
    path = _saved(tmp_path)
    if how == "outside":     # HDF5 refuses such a virtual dataset: write the manifest without the views
        from axonmpi.checkpoint import index
        monkeypatch.setattr(index, "write_entry_view", lambda f, e, h5py: None)

    def edit(entries):
        e = next(x for x in entries if x.name == "w")
        p = e.pieces[0]
        if how == "huge":        # a valid CRC claiming (10^12, 4) over pieces covering 16 rows: "29.1 TiB verified"
            e.shape = (10 ** 12, 4)
        elif how == "gap":
            e.shape = (20, 4)
        elif how == "overlap":   # two pieces over the same rows, claimed over 32 rows
            e.shape = (32, 4)
            e.pieces.append(type(p)(p.entry, p.file, p.dset, (8, 0), p.shape, p.block_rows, p.checksums, p.byte_offset))
        else:
            p.offsets = (4, 0)
    _rewrite_index(path, edit)
    code, text = _verify(path)
    assert code == 1 and "DAMAGED" in text and "entry 'w'" in text, text
    want = {"huge": "cover 64 of the 4000000000000 elements", "gap": "cover 64 of the 80 elements",
            "overlap": "overlap", "outside": "outside the entry's shape (16, 4)"}[how]
    assert want in text, text


def test_consolidate_names_the_entry_instead_of_a_bare_memory_error(tmp_path):
    path = _saved(tmp_path)
    _rewrite_index(path, lambda entries: setattr(next(x for x in entries if x.name == "w"), "shape", (10 ** 12, 4)))
    out = str(tmp_path / "all.h5")
    with pytest.raises(CheckpointError, match=r"entry 'w': the pieces cover 64 of the 4000000000000 elements"):
        cli.consolidate(path, out)
    assert not os.path.exists(out) and not [n for n in os.listdir(tmp_path) if ".tmp" in n]


def test_an_intact_checkpoint_still_verifies(tmp_path):
    code, text = _verify(_saved(tmp_path))
    assert code == 0 and text.startswith("ok:"), text
    with CheckpointReader(str(tmp_path / "ck")) as r:
        assert r.coverage_problems() == []


def test_an_unfinished_save_is_incomplete_not_damaged_unless_strict(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    good = _saved(run, "step-00000010")
    # a kill after the index was written but before the rename, with a shard cut short: what resume ignores
    tmp = str(run / "step-00000020.tmp-0123456789ab")
    shutil.copytree(good, tmp)
    shard = next(f for f in os.listdir(tmp) if f.startswith("shard"))
    with open(os.path.join(tmp, shard), "r+b") as fh:
        fh.truncate(100)
    os.makedirs(run / "step-00000030.tmp-ba9876543210")          # killed before any file was written
    code, text = _verify(str(run))
    assert code == 0, text
    assert "DAMAGED" not in text and text.count("incomplete (ignored by resume)") == 2, text
    assert "1 of 1 checkpoint(s) intact" in text
    code, text = _verify(str(run), strict=True)
    assert code == 1, text
    code, text = _verify(tmp)                                    # the unfinished save named directly
    assert code == 0 and text.startswith("incomplete (ignored by resume)"), text
    assert _verify(tmp, strict=True)[0] == 1
    from axonmpi.cli import main
    assert main(["ckpt", "verify", str(run)]) == 0 and main(["ckpt", "verify", "--strict", str(run)]) == 1
