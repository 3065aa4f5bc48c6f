"""Damage means a failed integrity check, nothing else (issue 31, items 1 and 2; issue 32's `ckpt verify RUN_DIR`).

An intact checkpoint that does not fit the model (another dtype, another shape, other entries) is
never renamed ``.damaged``: the load raises naming the first entry, its saved and expected dtype
and shape, and the fix. ``load_latest`` falls back only past checkpoints that fail verification,
and never returns "fresh" while damaged ones are there. On main each of these set the checkpoints
aside and started from step 0.
"""
import io
import json
import os
import sys

import h5py
import numpy as np
import pytest

import axonmpi
from axonmpi import checkpoint as ckpt
from axonmpi import nn, optim
from axonmpi.checkpoint import CheckpointManager, CheckpointReader, training_state, restore_training_state
from axonmpi.checkpoint import cli


def _shared_dir(world, tmp_path_factory, name):
    return axonmpi.broadcast_object(str(tmp_path_factory.mktemp(name)) if world.rank == 0 else None)


def _flip_a_byte(path, entry):
    with CheckpointReader(path) as r:
        p = r.entry(entry).pieces[0]
    full = os.path.join(path, p.file)
    with h5py.File(full, "r") as f:
        off = f[p.dset].id.get_offset()
    with open(full, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0x10]))


def _linear(dtype):
    axonmpi.manual_seed(3)
    m = nn.Linear(4, 3, dtype=dtype)
    return m, optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.mpi(min_size=1)
def test_a_float64_checkpoint_into_a_float32_model_raises_and_is_never_set_aside(world, tmp_path_factory):
    d = _shared_dir(world, tmp_path_factory, "dtype")
    m64, o64 = _linear("float64")
    mgr = CheckpointManager(d)
    for s in (5, 6, 7):
        mgr.save(s, training_state(m64, o64, step=s))
    m32, o32 = _linear("float32")
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        mgr.load_latest(training_state(m32, o32))        # on main: all three renamed .damaged, None returned
    msg = str(e.value)
    assert "step-00000007 is intact but does not fit" in msg
    assert "'model/weight' is saved as float64 of shape (3, 4), the template has float32 of shape (3, 4)" in msg
    assert "cast=True" in msg and f"rank {world.rank}" in msg
    assert mgr.steps() == [5, 6, 7] and mgr.damaged() == []
    out = mgr.load_latest(training_state(m32, o32), cast=True)        # the fix the message gives
    assert restore_training_state(out, m32, o32)["step"] == 7
    np.testing.assert_array_equal(m32.weight.data, m64.weight.data.astype(np.float32))
    mgr.release()


@pytest.mark.mpi(min_size=1)
def test_a_shape_mismatch_raises_naming_the_first_entry(world, tmp_path_factory):
    d = _shared_dir(world, tmp_path_factory, "shape")
    m, o = _linear("float64")
    mgr = CheckpointManager(d)
    mgr.save(2, training_state(m, o, step=2))
    axonmpi.manual_seed(3)
    other = nn.Linear(5, 3, dtype="float64")
    with pytest.raises(ckpt.CheckpointMismatchError) as e:
        mgr.load_latest(training_state(other, optim.SGD(other.parameters(), lr=0.1)), cast=True)  # cast: no help
    assert "'model/weight' is saved as float64 of shape (3, 4), the template has float64 of shape (3, 5)" in str(e.value)
    assert "options it was saved with" in str(e.value)
    assert mgr.steps() == [2] and mgr.damaged() == []
    mgr.release()


@pytest.mark.mpi(min_size=1)
def test_load_latest_falls_back_only_past_checkpoints_that_fail_verification(world, tmp_path_factory):
    d = _shared_dir(world, tmp_path_factory, "fallback")
    m, o = _linear("float64")
    mgr = CheckpointManager(d, keep_last=None)
    for s in (1, 2, 3):
        mgr.save(s, training_state(m, o, step=s))
    if world.rank == 0:
        _flip_a_byte(mgr.path_for(3), "model/weight")
    axonmpi.barrier()
    m2, o2 = _linear("float64")
    out = mgr.load_latest(training_state(m2, o2))
    assert out["meta"]["step"] == 2 and mgr.steps() == [1, 2]
    assert mgr.damaged() == [mgr.path_for(3) + ".damaged"]
    # a float32 model on the rest: a mismatch, not damage; nothing more is set aside
    m32, o32 = _linear("float32")
    with pytest.raises(ckpt.CheckpointMismatchError):
        mgr.load_latest(training_state(m32, o32))
    assert mgr.steps() == [1, 2]
    # every intact one damaged too: an error naming the folder, never "start fresh"
    if world.rank == 0:
        for s in (1, 2):
            _flip_a_byte(mgr.path_for(s), "model/bias")
    axonmpi.barrier()
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint in") as e:
        mgr.load_latest(training_state(m2, o2))          # on main: returned None ("starting fresh")
    assert "every checkpoint failed verification" in str(e.value) and "checksum mismatch" in str(e.value)
    assert mgr.steps() == [] and len(mgr.damaged()) == 3
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint in"):   # and so on the next attempt
        mgr.load_latest(training_state(m2, o2))
    mgr.release()


@pytest.mark.mpi(min_size=2)
def test_an_axonn_checkpoint_loads_under_fsdp_with_the_documented_template(world, tmp_path_factory):
    from axonmpi.parallel import FSDP, parallelize
    if world.world_size % 2:
        pytest.skip("AxoNN over G_intra_c=2 needs an even world")
    d = _shared_dir(world, tmp_path_factory, "axonn")
    grid = axonmpi.ProcessGrid(world, G_intra_c=2)
    try:
        def net():
            axonmpi.manual_seed(0)
            return nn.Sequential(nn.Linear(4, 8, dtype="float64"), nn.Tanh(), nn.Linear(8, 4, dtype="float64"))

        x = np.random.default_rng(0).standard_normal((2 * world.world_size, 4))
        pm = parallelize(net(), grid=grid, tensor_parallel="axonn")
        opt = optim.AdamW(pm.parameters(), lr=1e-2)
        for _ in range(2):
            opt.zero_grad()
            (pm(axonmpi.tensor(pm.local_batch(x))) ** 2).mean().backward()
            opt.step()
        mgr = CheckpointManager(d)
        mgr.save(2, training_state(pm, opt, step=2))
        full = pm.state_dict()
        mgr.release()
        fs = FSDP(net())
        o2 = optim.AdamW(fs.parameters(), lr=1e-2)
        loaded = CheckpointManager(d).load_latest(training_state(fs, o2))   # on main: renamed .damaged, None
        assert restore_training_state(loaded, fs, o2)["step"] == 2
        got = fs.state_dict()
        for k, v in full.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
        assert CheckpointManager(d).damaged() == []
    finally:
        grid.free()


@pytest.mark.serial
def test_restore_training_state_of_none_says_what_happened():
    m, o = _linear("float64")
    with pytest.raises(ValueError, match=r"nothing was loaded.*load_latest\(\) returns None"):
        restore_training_state(None, m, o)     # on main: TypeError: argument of type 'NoneType' is not iterable


@pytest.mark.serial
def test_inspect_and_verify_agree_on_a_run_folder(tmp_path):
    d = str(tmp_path / "run")
    m, o = _linear("float64")
    mgr = CheckpointManager(d, keep_last=None)
    for s in (1, 2, 3):
        mgr.save(s, training_state(m, o, step=s))
    _flip_a_byte(mgr.path_for(3), "model/weight")
    os.rename(mgr.path_for(2), mgr.path_for(2) + ".damaged")    # set aside by an older axonmpi, but intact
    os.makedirs(os.path.join(d, "step-00000004.tmp-0123456789ab"))
    mgr.release()
    out = io.StringIO()
    assert cli.verify(d, out=out) == 1                          # on main: "not an axonmpi checkpoint"
    text = out.getvalue()
    assert f"ok: {mgr.path_for(1)}" in text and f"DAMAGED: {mgr.path_for(3)}" in text
    assert f"ok: {mgr.path_for(2)}.damaged" in text and "rename it back to step-00000002" in text
    assert "incomplete (ignored by resume)" in text and "2 of 3 checkpoint(s) intact" in text
    out = io.StringIO()
    assert cli.verify(d, as_json=True, out=out) == 1
    rows = {r["step"]: r for r in json.loads(out.getvalue())["checkpoints"]}
    assert rows[1]["ok"] and rows[2]["ok"] and not rows[3]["ok"] and rows[4]["ok"] is None
    out = io.StringIO()
    assert cli.inspect(d, out=out) == 0
    lines = {ln.split()[0]: ln for ln in out.getvalue().splitlines() if ln.strip()[:1].isdigit()}
    assert "incomplete" not in lines["2"] and "set aside by load_latest" in lines["2"]   # on main: "crashed save"
    assert "incomplete: an unfinished or crashed save" in lines["4"]
    assert "2 complete checkpoint(s)" in out.getvalue()             # 1 and 3 (inspect reads no block)
    os.remove(os.path.join(mgr.path_for(1), "shard-00000.h5"))
    out = io.StringIO()
    cli.inspect(d, out=out)
    lines = {ln.split()[0]: ln for ln in out.getvalue().splitlines() if ln.strip()[:1].isdigit()}
    assert "DAMAGED: shard-00000.h5" in lines["1"], out.getvalue()
    out = io.StringIO()
    assert cli.verify(d, out=out) == 1 and f"DAMAGED: {mgr.path_for(1)}" in out.getvalue()


# -- examples/train_gpt.py --resume / --auto-resume ---------------------------------------------------
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-progress", "--sample-chars", "0", "--global-batch", "2", "--warmup", "2"]


def _gpt(*extra):
    import train_gpt
    train_gpt.main(TINY + [str(a) for a in extra])


@pytest.mark.serial
@pytest.mark.parametrize("flag", ["--resume", "--auto-resume"])
def test_resume_with_only_damaged_checkpoints_exits_non_zero_naming_the_folder(tmp_path, capsys, flag):
    d = str(tmp_path / "ck")
    _gpt("--steps", 2, "--checkpoint-dir", d, "--save-every", "1")
    mgr = CheckpointManager(d)
    for s in mgr.steps():
        _flip_a_byte(mgr.path_for(s), "model/lm_head.weight" if "model/lm_head.weight" in
                     CheckpointReader(mgr.path_for(s)).names() else CheckpointReader(mgr.path_for(s)).names()[0])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _gpt("--steps", 4, "--checkpoint-dir", d, flag)      # on main: trained from step 0 and exited 0
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "no intact checkpoint in" in err and d in err, err
    assert len(mgr.damaged()) == 2 and mgr.steps() == []
    with pytest.raises(SystemExit) as e:                     # the requeued job: still refused, not fresh
        _gpt("--steps", 4, "--checkpoint-dir", d, flag)
    assert e.value.code == 1 and "only ones set aside as damaged" in capsys.readouterr().err
    assert mgr.steps() == []


@pytest.mark.serial
def test_auto_resume_starts_fresh_only_in_an_empty_folder(tmp_path, caplog):
    d = str(tmp_path / "ck")
    import logging
    log = logging.getLogger("train_gpt")      # axonmpi.get_logger's loggers do not propagate to the root
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            _gpt("--steps", 1, "--checkpoint-dir", d, "--auto-resume")
    finally:
        log.removeHandler(caplog.handler)
    assert "no checkpoint in" in caplog.text and CheckpointManager(d).steps() == [1]
