"""Exact resume of a real training run: DDP + AdamW + LR schedule + dropout RNG + mid-epoch data position."""
import numpy as np
import pytest

import axonmpi
from axonmpi import checkpoint as ckpt
from axonmpi.data import CharDataset
from axonmpi.models import GPT, GPTConfig
from axonmpi.optim import AdamW
from axonmpi.optim.lr_scheduler import LinearWarmupCosine

CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8, dropout=0.1)


def _setup(world, dtype):
    tokens = np.random.default_rng(0).integers(0, 11, 400)
    loader = axonmpi.create_dataloader(CharDataset(tokens, 8), global_batch_size=2 * world.world_size, seed=4)
    axonmpi.manual_seed(1)
    model = axonmpi.DDP(GPT(CFG).to(dtype=dtype))
    opt = AdamW(model.parameters(), lr=1e-2)
    sched = LinearWarmupCosine(opt, warmup_steps=2, total_steps=10)
    axonmpi.manual_seed(100 + world.rank)   # per-rank dropout stream
    return model, opt, sched, loader


def _train(model, opt, sched, loader, steps, it=None):
    batches = []
    for _ in range(steps):
        if it is None:
            it = iter(loader)
        x, y = next(it)
        loader.sampler.advance(len(x))
        batches.append(x.copy())
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        sched.step()
    return batches, it


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_resume_is_bitwise_exact(world, tmp_path_factory, dtype):
    path = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("resume") / "ck") if world.rank == 0 else None)
    # uninterrupted: 3 + 3 steps
    model, opt, sched, loader = _setup(world, dtype)
    b1, it = _train(model, opt, sched, loader, 3)
    ckpt.save(path, ckpt.training_state(model, opt, sched, loader.sampler, step=3))
    b2, _ = _train(model, opt, sched, loader, 3, it)
    want_params = {k: v.copy() for k, v in model.state_dict().items()}
    want_opt = opt.state_dict()

    # fresh objects with different seeds, restored from the checkpoint, then the same 3 steps
    axonmpi.manual_seed(999)
    model2, opt2, sched2, loader2 = _setup(world, dtype)
    axonmpi.manual_seed(12345)
    meta = ckpt.restore_training_state(ckpt.load(path), model2, opt2, sched2, loader2.sampler)
    assert meta["step"] == 3
    b2r, _ = _train(model2, opt2, sched2, loader2, 3)
    for a, b in zip(b2, b2r):                       # same data order after the resume
        np.testing.assert_array_equal(a, b)
    for k, v in model2.state_dict().items():        # bitwise-identical parameters
        np.testing.assert_array_equal(v, want_params[k], err_msg=k)
    got_opt = opt2.state_dict()
    for i, st in want_opt["state"].items():
        for name, val in st.items():
            np.testing.assert_array_equal(got_opt["state"][i][name], val, err_msg=f"state[{i}][{name}]")
    assert sched2.get_last_lr() == sched.get_last_lr()


# -- the example's resume path (examples/train_gpt.py) and the manager's pruning ------------------------
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-progress", "--sample-chars", "0", "--global-batch", "2", "--warmup", "2"]


def _gpt(*extra):
    import train_gpt
    train_gpt.main(TINY + [str(a) for a in extra])


@pytest.mark.serial
def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path, keep_last=2)
    for s in (300, 320):
        mgr.save(s, {"w": np.full(3, float(s))})
    mgr.save(10, {"w": np.full(3, 10.0)})   # on main: step-10 was pruned at once, 300 and 320 kept
    assert 10 in mgr.steps() and len(mgr.steps()) == 2
    np.testing.assert_array_equal(ckpt.load(mgr.path_for(10))["w"], np.full(3, 10.0))


@pytest.mark.serial
def test_fresh_run_into_old_folder_is_refused(tmp_path, capsys):
    d = str(tmp_path / "ck")
    _gpt("--steps", 3, "--checkpoint-dir", d)
    with pytest.raises(SystemExit) as e:
        _gpt("--steps", 2, "--checkpoint-dir", d)
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert "already holds checkpoints of steps [3]" in err and "--resume" in err and "--overwrite" in err
    assert ckpt.CheckpointManager(d).steps() == [3]          # nothing lost
    _gpt("--steps", 2, "--checkpoint-dir", d, "--overwrite")
    assert ckpt.CheckpointManager(d).steps() == [2]


@pytest.mark.serial
def test_resume_names_the_config_difference(tmp_path, capsys):
    d = str(tmp_path / "ck")
    _gpt("--steps", 2, "--checkpoint-dir", d)
    capsys.readouterr()
    args = [a if a != "16" else "32" for a in TINY[:4]] + TINY[4:]   # --n-embd 32
    import train_gpt
    with pytest.raises(SystemExit):
        train_gpt.main(args + ["--steps", "4", "--checkpoint-dir", d, "--resume"])
    err = capsys.readouterr().err
    assert "--n-embd 32 vs saved 16" in err and len(err) < 400, err


@pytest.mark.serial
def test_resume_with_more_steps_extends_the_schedule(tmp_path):
    d, m = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    _gpt("--steps", 6, "--checkpoint-dir", d)
    _gpt("--steps", 9, "--checkpoint-dir", d, "--resume", "--metrics-json", m)
    rows = [json.loads(x) for x in open(m)]
    assert [r["step"] for r in rows] == [7, 8, 9]
    assert set(rows[0]) == {"step", "loss", "grad_norm", "lr", "step_s", "tokens_per_s", "tokens_per_s_avg",
                            "host_peak_rss_gib", "epoch", "sample", "tokens", "time"}
    opt = AdamW([axonmpi.Tensor(np.zeros(1), requires_grad=True)], lr=3e-3)
    want = LinearWarmupCosine(opt, warmup_steps=2, total_steps=9, min_lr=3e-4)
    expect = [want.lr_at(3e-3, t) for t in (6, 7, 8)]      # lr used by steps 7, 8, 9 of a 9-step schedule
    np.testing.assert_allclose([r["lr"] for r in rows], expect, rtol=1e-12)
    assert rows[0]["lr"] > 3e-4 * 1.5                        # on main: min_lr for every extra step


@pytest.mark.serial
def test_resume_with_no_save_finds_the_checkpoint(tmp_path):
    d = str(tmp_path / "ck")
    _gpt("--steps", 2, "--checkpoint-dir", d, "--save-every", "1")
    _gpt("--steps", 3, "--checkpoint-dir", d, "--resume", "--no-save")   # on main: "no checkpoint found"
    assert ckpt.CheckpointManager(d).steps() == [1, 2]


@pytest.mark.mpi(min_size=2)
def test_resume_one_rank_rng_on_more_ranks_warns(world):
    from axonmpi import random as _random
    one = json.dumps([_random.get_rng_state()])
    records = []
    h = logging.Handler()
    h.emit = records.append
    lg = logging.getLogger("axonmpi.checkpoint.state")
    lg.addHandler(h)
    try:
        ckpt.restore_training_state({"rng": one, "meta": {"world_size": 1}})
    finally:
        lg.removeHandler(h)
    assert any("saved by 1 ranks and are restored on" in r.getMessage() for r in records), records


@pytest.mark.serial
def test_resume_applies_changed_options_and_refuses_the_seed(tmp_path, caplog):
    """On main the new checkpoint recorded lr 0.01 while 0.003 was in effect, and --seed was ignored."""
    import logging
    d, m = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    _gpt("--steps", 4, "--checkpoint-dir", d, "--metrics-json", m)
    with open(m, "a") as f:                      # rows a killed job wrote after its last checkpoint
        f.write('{"step": 5, "loss": 1.0}\n{"step": 6, "lo')
    log = logging.getLogger("train_gpt")      # axonmpi.get_logger's loggers do not propagate to the root
    log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            _gpt("--steps", 6, "--checkpoint-dir", d, "--resume", "--lr", "0.001", "--global-batch", "4",
                 "--metrics-json", m)
    finally:
        log.removeHandler(caplog.handler)
    text = caplog.text
    assert "--lr 0.003 -> 0.001" in text and "--global-batch 2 -> 4" in text
    rows = [json.loads(x) for x in open(m)]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    opt = AdamW([axonmpi.Tensor(np.zeros(1), requires_grad=True)], lr=1e-3)
    want = LinearWarmupCosine(opt, warmup_steps=2, total_steps=6, min_lr=1e-4)
    np.testing.assert_allclose([r["lr"] for r in rows[4:]], [want.lr_at(1e-3, t) for t in (4, 5)], rtol=1e-12)
    saved = ckpt.load(ckpt.CheckpointManager(d).latest())
    assert saved["extra"]["config"]["lr"] == 0.001 and saved["scheduler"]["base_lrs"] == [0.001]


@pytest.mark.serial
def test_seed_change_on_resume_is_refused_by_name(tmp_path, capsys):
    d = str(tmp_path / "ck")
    _gpt("--steps", 2, "--checkpoint-dir", d)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _gpt("--steps", 4, "--checkpoint-dir", d, "--resume", "--seed", "5")
    assert e.value.code == 2 and "--seed 5 vs saved 0" in capsys.readouterr().err
    assert ckpt.CheckpointManager(d).steps() == [2]


@pytest.mark.serial
def test_metrics_json_starts_anew_on_overwrite(tmp_path):
    d, m = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    _gpt("--steps", 3, "--checkpoint-dir", d, "--metrics-json", m)
    _gpt("--steps", 3, "--checkpoint-dir", d, "--metrics-json", m, "--overwrite")
    assert [json.loads(x)["step"] for x in open(m)] == [1, 2, 3]      # on main: 1..3 twice
