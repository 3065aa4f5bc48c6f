"""A NaN is traced to its rank before the optimizer step (issue 53 item 6, fault 5).

On main a NaN made by rank 1's forward ended the job with "rank 0: loss became nan at step 5; lower --lr", after
``opt.step()`` had applied NaN gradients; under fp16 with a GradScaler the trainer exited instead of letting
the scaler skip the step.
"""
import numpy as np
import pytest

import axonmpi
from axonmpi import nn, optim
from axonmpi.amp import GradScaler
from axonmpi.autograd import Tensor
from axonmpi.finite import NonFiniteError, check_finite, nonfinite_ranks
import axonmpi.nn.functional as F


def _ddp_step(world, bad_rank, scaler=None):
    """One DDP forward/backward whose input is NaN on ``bad_rank``; returns (model, opt, local loss, weights before)."""
    axonmpi.manual_seed(0)
    model = axonmpi.DDP(nn.Linear(4, 3, dtype="float64"))
    opt = optim.SGD(model.parameters(), lr=0.1)
    x = np.random.default_rng(world.rank).standard_normal((5, 4))
    if world.rank == bad_rank:
        x[2, 1] = np.nan
    local = F.mse_loss(model(Tensor(x)), Tensor(np.zeros((5, 3))), reduction="sum")
    loss = local * (1.0 / world.world_size)
    (loss if scaler is None else scaler.scale(loss)).backward()
    before = [p.data.copy() for p in model.parameters()]
    return model, opt, local, before


@pytest.mark.mpi(min_size=2)
def test_the_rank_whose_forward_made_the_nan_is_named_before_the_step(world):
    bad = world.world_size - 1
    model, opt, local, before = _ddp_step(world, bad)
    loss_ranks, grad_ranks = nonfinite_ranks(loss=local, optimizer=opt)
    assert loss_ranks == [bad]
    assert grad_ranks == list(range(world.world_size))          # DDP's reduction spread it everywhere
    with pytest.raises(NonFiniteError) as e:
        check_finite(5, loss=local, optimizer=opt, hint="lower --lr")
    msg = str(e.value)
    assert f"the local loss of rank(s) [{bad}] became inf/nan first" in msg and "at step 5" in msg, msg
    assert "lower --lr" in msg and e.value.loss_ranks == [bad]
    for p, b in zip(model.parameters(), before):                # nothing applied
        np.testing.assert_array_equal(p.data, b)


@pytest.mark.mpi(min_size=2)
def test_a_nan_in_one_ranks_gradient_alone_is_named(world):
    axonmpi.manual_seed(0)
    p = nn.Linear(3, 2, dtype="float64")
    for q in p.parameters():
        q.grad = Tensor(np.ones(q.shape))
    if world.rank == 1:
        p.weight.grad.data[0, 1] = np.inf
    assert nonfinite_ranks(parameters=p.parameters()) == ([], [1])
    assert nonfinite_ranks(loss=1.0, parameters=p.parameters(), group=None)[0] == []


@pytest.mark.mpi(min_size=1)
def test_all_finite_is_silent(world):
    model, opt, local, _ = _ddp_step(world, bad_rank=-1)
    check_finite(1, loss=local, optimizer=opt, reduced=(1.5, 2.0))
    with pytest.raises(NonFiniteError, match=r"the reduced values \[inf\] are inf/nan although every rank's own"):
        check_finite(1, loss=local, optimizer=opt, reduced=(1.5, float("inf")))
    assert nonfinite_ranks(loss=local, optimizer=opt) == ([], [])


@pytest.mark.mpi(min_size=2)
def test_under_a_grad_scaler_the_step_is_skipped_not_raised(world):
    scaler = GradScaler(init_scale=1024.0)
    model, opt, local, before = _ddp_step(world, world.world_size - 1, scaler)
    scaler.unscale_(opt)
    scaler.step(opt)
    assert scaler.skipped
    scaler.update()
    assert scaler.get_scale() == 512.0
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.data, b)
    model, opt, local, before = _ddp_step(world, -1, scaler)
    scaler.step(opt)
    assert not scaler.skipped


TRAIN = """
import sys, numpy as np
sys.path.insert(0, {examples!r})
import axonmpi, train_gpt
from axonmpi.recipes import gpt
real = gpt.HybridGPT._token_mean
calls = [0]
def poisoned(self, x, y):
    calls[0] += 1
    out = real(self, x, y)
    if axonmpi.get_world().rank == 1 and calls[0] == 3:    # rank 1's forward makes a NaN at step 3
        self.local_loss = self.local_loss * np.nan
        return out * float("nan")
    return out
gpt.HybridGPT._token_mean = poisoned
train_gpt.main(["--steps", "4", "--checkpoint-dir", {ck!r}, "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                "--block-size", "16", "--corpus-bytes", "60000", "--global-batch", "4", "--no-progress"{more}])
print("finished", flush=True)
"""


@pytest.mark.serial
@pytest.mark.parametrize("fp16", [False, True])
def test_the_trainer_names_the_rank_or_lets_the_scaler_skip(tmp_path, fp16):
    import os
    from axonmpi.testing import run_mpiexec
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    more = ', "--mixed-precision", "fp16", "--fsdp", "full_shard"' if fp16 else ""
    r = run_mpiexec(["-c", TRAIN.format(examples=examples, ck=str(tmp_path / "ck"), more=more)], n=2, timeout=300)
    if fp16:
        assert r.returncode == 0 and "finished" in r.stdout, r.stderr[-3000:]
    else:
        assert r.returncode != 0
        assert "NonFiniteError" in r.stderr and "the local loss of rank(s) [1] became inf/nan first" in r.stderr, \
            r.stderr[-3000:]
        assert "at step 3 before the optimizer step" in r.stderr
