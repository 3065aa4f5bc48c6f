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
