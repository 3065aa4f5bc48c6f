"""ZeroRedundancyOptimizer (ZeRO-1) with DDP equals the serial model; state is 1/N per rank; state dicts."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, nn
from axonmpi.optim import AdamW, SGD, ZeroRedundancyOptimizer


def _make():
    axonmpi.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, dtype=np.float64), nn.Tanh(), nn.Linear(7, 3, dtype=np.float64))


def _train(world, steps=6, opt_cls=AdamW, **kw):
    rng = np.random.default_rng(1)
    B, n = 3, world.world_size
    X, Y = rng.standard_normal((steps, B * n, 5)), rng.standard_normal((steps, B * n, 3))
    ref = _make()
    ropt = opt_cls(ref.parameters(), **kw)
    model = axonmpi.DDP(_make())
    opt = ZeroRedundancyOptimizer(model.parameters(), opt_cls, **kw)
    sl = slice(world.rank * B, (world.rank + 1) * B)
    for s in range(steps):
        want = ((ref(Tensor(X[s])) - Tensor(Y[s])) ** 2).mean()
        ropt.zero_grad()
        want.backward()
        axonmpi.optim.clip_grad_norm_(ref.parameters(), 0.5)
        ropt.step()
        got = ((model(Tensor(X[s][sl])) - Tensor(Y[s][sl])) ** 2).mean()
        opt.zero_grad()
        got.backward()
        axonmpi.optim.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        g = float(axonmpi.all_reduce(np.array(float(got.data)), axonmpi.ReduceOp.MEAN))
        assert abs(g - float(want.data)) <= 1e-10 * abs(float(want.data))
    for k, v in ref.state_dict().items():
        err = np.max(np.abs(model.state_dict()[k] - v))
        assert err <= 1e-10 * np.max(np.abs(v)), (world.rank, k, err)
    return ref, ropt, model, opt


@pytest.mark.mpi(min_size=1)
def test_zero_ddp_parity_and_sharded_state():
    world = axonmpi.init()
    ref, ropt, model, opt = _train(world, lr=1e-2, weight_decay=0.1)
    n_params = 5 * 7 + 7 + 7 * 3 + 3
    local = sum(v.size for st in opt.optim.state.values() for v in st.values() if hasattr(v, "size") and v.ndim)
    total = int(axonmpi.all_reduce(np.array(local)))
    assert total == 2 * n_params                       # exp_avg + exp_avg_sq, each element on one rank
    assert local <= 2 * -(-n_params // world.world_size)
    opt.consolidate_state_dict(to=0)
    if world.rank == 0:
        sd, rsd = opt.state_dict(), ropt.state_dict()
        assert sorted(sd["state"]) == sorted(rsd["state"])
        for i in rsd["state"]:
            assert sd["state"][i]["step"] == rsd["state"][i]["step"]
            for k in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_allclose(sd["state"][i][k], rsd["state"][i][k], rtol=1e-9, atol=1e-15)
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            opt.state_dict()


@pytest.mark.mpi(min_size=1)
def test_zero_sgd_momentum_parity():
    _train(axonmpi.init(), opt_cls=SGD, lr=0.1, momentum=0.9)


@pytest.mark.mpi(min_size=1)
def test_zero_load_full_and_sharded_state():
    world = axonmpi.init()
    ref, ropt, model, opt = _train(world, steps=3, lr=1e-2)
    full = ropt.state_dict()                           # the serial optimizer's state loads into ZeRO
    fresh = ZeroRedundancyOptimizer(_make().parameters(), AdamW, lr=1e-2)
    fresh.load_state_dict(full)
    fresh.consolidate_state_dict(to=0)
    sharded = opt.sharded_state_dict()
    again = ZeroRedundancyOptimizer(_make().parameters(), AdamW, lr=1e-2)
    again.load_state_dict(sharded)
    again.consolidate_state_dict(to=0)
    if world.rank == 0:
        for o in (fresh, again):
            for i, st in full["state"].items():
                for k in ("exp_avg", "exp_avg_sq"):
                    np.testing.assert_allclose(o.state_dict()["state"][i][k], st[k], rtol=1e-9, atol=1e-15)
