"""Mixed precision: FSDP float16 compute with fp32 master shards and GradScaler tracks the fp32 run and skips
exactly the step with an overflow (forced on one rank, agreed by all); GradScaler's PyTorch schedule."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, nn
from axonmpi.amp import GradScaler
from axonmpi.parallel import FSDP, MixedPrecision, ShardingStrategy

# fp16 compute (11-bit mantissa) vs fp32 after 6 Adam steps, relative to each tensor's scale (seen: 1.2e-4)
TOL = 2e-3


def _make():
    axonmpi.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, dtype=np.float32), nn.Tanh(), nn.Linear(7, 3, dtype=np.float32))


def _run(world, mp, overflow_step=None, steps=6):
    rng = np.random.default_rng(1)
    B = 4
    X = rng.standard_normal((steps, B * world.world_size, 5)).astype(np.float32)
    Y = rng.standard_normal((steps, B * world.world_size, 3)).astype(np.float32)
    model = FSDP(_make(), sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=mp)
    opt = axonmpi.optim.Adam(model.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=1024.0, growth_interval=3, enabled=mp is not None)
    sl = slice(world.rank * B, (world.rank + 1) * B)
    scales, skipped = [], []
    for s in range(steps):
        opt.zero_grad()
        out = model(Tensor(X[s][sl]))
        loss = ((out.astype(np.float32) - Tensor(Y[s][sl])) ** 2).mean()
        scaler.scale(loss).backward()
        if s == overflow_step and world.rank == 0:
            next(iter(model.parameters())).grad.data[0] = np.inf
        before = [p.data.copy() for p in model.parameters()]
        scaler.unscale_(opt)
        model.clip_grad_norm_(10.0)
        scaler.step(opt)
        scaler.update()
        skipped.append(all(np.array_equal(b, p.data) for b, p in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
    return model.state_dict(), scales, skipped


@pytest.mark.mpi(min_size=1)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # clipping the forced inf
def test_fp16_tracks_fp32_and_skips_exactly_the_overflow_step():
    world = axonmpi.init()
    mp = MixedPrecision(param_dtype=np.float16, reduce_dtype=np.float32)
    ref, _, ref_skipped = _run(world, None)
    got, scales, skipped = _run(world, mp)
    assert not any(skipped) and not any(ref_skipped)
    for k in ref:
        assert got[k].dtype == np.float32                     # master weights stay fp32
        err = np.max(np.abs(got[k] - ref[k]))
        assert err <= TOL * np.max(np.abs(ref[k])), (k, err)
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 4096.0]   # growth every 3 clean steps
    _, scales, skipped = _run(world, mp, overflow_step=2)
    assert skipped == [False, False, True, False, False, False]          # on every rank
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0]


def test_grad_scaler_semantics_and_errors():
    axonmpi.init()
    s = GradScaler(init_scale=8.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=1)
    p = nn.Parameter(np.ones(3, np.float32))
    opt = axonmpi.optim.SGD([p], lr=1.0)
    s.scale((p * 2.0).sum()).backward()
    np.testing.assert_array_equal(p.grad.data, [16.0, 16.0, 16.0])
    s.step(opt)
    np.testing.assert_array_equal(p.data, [-1.0, -1.0, -1.0])       # unscaled gradient 2 applied
    s.update()
    assert s.get_scale() == 16.0
    p.grad.data[1] = np.nan
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called"):
        s.unscale_(opt)
    assert s.step(opt) is None
    s.update()
    assert s.get_scale() == 4.0 and s.state_dict()["_growth_tracker"] == 0
    with pytest.raises(ValueError, match="backoff_factor"):
        GradScaler(backoff_factor=1.5)


def test_bfloat16_needs_ml_dtypes():
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        with pytest.raises(TypeError, match="ml_dtypes"):
            MixedPrecision(param_dtype="bfloat16")
    else:
        assert MixedPrecision(param_dtype="bfloat16").param_dtype.name == "bfloat16"


def _drive(s, steps, bad=()):
    """Run ``steps`` (iteration numbers) of scale/unscale/step/update on a one-parameter model; ``bad``:
    the iterations whose gradient overflows.  Returns the scale after each."""
    p = nn.Parameter(np.ones(2, np.float32))
    opt = axonmpi.optim.SGD([p], lr=0.0)
    scales = []
    for i in steps:
        opt.zero_grad()
        s.scale((p * 1.0).sum()).backward()
        if i in bad:
            p.grad.data[0] = np.inf
        s.unscale_(opt)
        s.step(opt)
        s.update()
        scales.append(s.get_scale())
    return scales


def test_grad_scaler_state_dict_resumes_the_same_schedule():
    """A scaler restored from ``state_dict()`` mid-way (scale and growth tracker) continues exactly as the
    uninterrupted one: the same scales after every later step (PyTorch's keys and semantics)."""
    axonmpi.init()
    kw = dict(init_scale=64.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    bad = {1, 8}
    whole = _drive(GradScaler(**kw), range(10), bad)
    a = GradScaler(**kw)
    first = _drive(a, range(6), bad)
    state = a.state_dict()
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert state["scale"] == 64.0 and state["_growth_tracker"] == 1      # 64 -> 16 at step 1 -> 64 at step 4
    b = GradScaler()                                                     # defaults, overwritten by the load
    b.load_state_dict({k: np.float64(v) if isinstance(v, float) else np.int64(v) for k, v in state.items()})
    assert b.state_dict() == state
    assert first + _drive(b, range(6, 10), bad) == whole
    fresh = _drive(GradScaler(**kw), range(6, 10), bad)                   # what a resume without the state does
    assert fresh != whole[6:]
    assert GradScaler(enabled=False).state_dict() == {}
    with pytest.raises(RuntimeError, match="empty.*disabled GradScaler"):
        GradScaler().load_state_dict({})
    with pytest.raises(KeyError, match="_growth_tracker"):
        GradScaler().load_state_dict({k: v for k, v in state.items() if k != "_growth_tracker"})
