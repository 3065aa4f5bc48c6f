"""Issue 21's edges, each against PyTorch 2.13's numbers (written in; torch is not a dependency)
or PyTorch's error: pow at 0, cross_entropy weight / label_smoothing / all ignored / bad targets,
embedding -1, chained schedulers, GradScaler on float16, inf-norm clipping with a NaN, ZeRO-1
with ``None`` gradients."""
import math

import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, nn
from axonmpi.amp import GradScaler
from axonmpi.nn import Parameter
from axonmpi.nn import functional as F
from axonmpi.optim import SGD, AdamW, CosineAnnealingLR, StepLR, ZeroRedundancyOptimizer, clip_grad_norm_

# -- autograd ------------------------------------------------------------------------------


def test_pow_gradients_at_zero_match_torch():
    x = Tensor(np.array([0.0, 2.0]), requires_grad=True)
    (x ** 0).sum().backward()
    assert x.grad.data.tolist() == [0.0, 0.0]  # torch: 0, not 0 * 0**-1 = NaN
    x = Tensor(np.array([0.0, 0.0, 2.0]), requires_grad=True)
    e = Tensor(np.array([0.0, 1.5, 1.5]), requires_grad=True)
    (x ** e).sum().backward()
    np.testing.assert_allclose(x.grad.data, [0.0, 0.0, 2.121320343559643], rtol=1e-15)
    np.testing.assert_allclose(e.grad.data, [0.0, 0.0, 1.9605162869370945], rtol=1e-15)
    e = Tensor(np.array([0.0, 1.5, -1.0]), requires_grad=True)
    with np.errstate(divide="ignore"):
        (0.0 ** e).sum().backward()
    assert e.grad.data.tolist() == [0.0, 0.0, -math.inf]  # torch's values, -inf included


_X = np.arange(15, dtype=np.float64).reshape(3, 5) * 0.37 % 1.3 - 0.4
_T = np.array([2, -100, 4])
_W = np.array([0.5, 1.0, 2.0, 1.5, 0.25])
# torch.nn.functional.cross_entropy(x, t, reduction=..., **kw) and x.grad (row 1 is ignored: zeros)
_TORCH_CE = [
    (dict(weight=_W), "mean", 1.4065838147173504,
     [[0.101295040659154, 0.146648336655986, -0.676581015729217, 0.307365456938807, 0.121272181475269],
      [0.027847820118653, 0.010987460753576, 0.015906927260206, 0.023029009207532, -0.077771217339967]]),
    (dict(weight=_W), "sum", 3.1648135831140385,
     [[0.227913841483097, 0.329958757475969, -1.522307285390738, 0.691572278112317, 0.272862408319355],
      [0.06265759526697, 0.024721786695545, 0.035790586335464, 0.051815270716947, -0.174985239014925]]),
    (dict(label_smoothing=0.2), "mean", 1.3918554003970955,
     [[0.036978460370774, 0.062489689368992, -0.300576821347685, 0.152893069528079, 0.048215602079839],
      [0.105315190533939, 0.02944357339109, 0.051581172670927, 0.083630541433894, -0.26997047802985]]),
    (dict(label_smoothing=0.2), "sum", 2.783710800794191,
     [[0.073956920741548, 0.124979378737985, -0.601153642695369, 0.305786139056158, 0.096431204159678],
      [0.210630381067878, 0.05888714678218, 0.103162345341854, 0.167261082867788, -0.5399409560597]]),
    (dict(weight=_W, label_smoothing=0.2), "mean", 1.4345556154035604,
     [[0.082783122907646, 0.11493896689589, -0.554528041457164, 0.251499071862954, 0.105306879790674],
      [0.036781536105702, 0.000241657858086, -0.009468194848818, 0.011100908433686, -0.038655907548656]]),
    (dict(weight=_W, label_smoothing=0.2), "sum", 3.2277501346580113,
     [[0.186262026542203, 0.258612675515752, -1.247688093278618, 0.565872911691647, 0.236940479529017],
      [0.08275845623783, 0.000543730180694, -0.02130343840984, 0.024977043975793, -0.086975791984477]]),
]


@pytest.mark.parametrize("kw,reduction,loss,grad", _TORCH_CE)
def test_cross_entropy_weight_and_label_smoothing_match_torch(kw, reduction, loss, grad):
    x = Tensor(_X, requires_grad=True)
    out = F.cross_entropy(x, _T, reduction=reduction, **kw)
    out.backward()
    assert abs(out.item() - loss) <= 1e-10 * loss
    want = np.array([grad[0], [0.0] * 5, grad[1]])
    np.testing.assert_allclose(x.grad.data, want, rtol=1e-10, atol=1e-14)
    per_row = F.cross_entropy(Tensor(_X), _T, weight=_W, label_smoothing=0.2, reduction="none")
    np.testing.assert_allclose(per_row.data, [2.6048019703297363, 0.0, 0.6229481643282747], rtol=1e-10)


def test_cross_entropy_all_ignored_nan_loss_zero_grad():
    x = Tensor(_X, requires_grad=True)
    loss = F.cross_entropy(x, np.array([-100, -100, -100]))
    loss.backward()
    assert math.isnan(loss.item())             # torch: nan
    assert x.grad.data.tolist() == np.zeros((3, 5)).tolist()  # torch: zeros, not NaN


def test_negative_targets_and_ids_raise_like_torch():
    with pytest.raises(IndexError, match="target -1 is out of bounds for 3 classes"):
        F.cross_entropy(Tensor(np.zeros((2, 3))), np.array([0, -1]))  # torch: "Target -1 is out of bounds."
    with pytest.raises(IndexError, match="target 3 is out of bounds"):
        F.cross_entropy(Tensor(np.zeros((2, 3))), np.array([3, 0]))
    with pytest.raises(IndexError, match=r"span \[-1, -1\].*0\.\.2"):
        F.embedding(np.array([-1]), Tensor(np.zeros((3, 2))))  # torch: "index out of range in self"
    # ignore_index itself may be negative and is skipped
    assert F.cross_entropy(Tensor(np.zeros((2, 3))), np.array([0, -1]), ignore_index=-1).item() == math.log(3)
    with pytest.raises(ValueError, match="label_smoothing"):
        F.cross_entropy(Tensor(np.zeros((2, 3))), np.array([0, 1]), label_smoothing=1.5)


# -- schedulers --------------------------------------------------------------------------------


def test_step_and_cosine_chain_like_torch():
    opt = SGD([Parameter(np.zeros(2))], lr=0.1)
    s1, s2 = StepLR(opt, step_size=2, gamma=0.5), CosineAnnealingLR(opt, T_max=10, eta_min=0.001)
    got = []
    for _ in range(12):
        s1.step()
        s2.step()
        got.append(opt.param_groups[0]["lr"])
    torch_lrs = [0.09757729755661011, 0.04530957127901634, 0.039890781032454074, 0.0166191387437342,
                 0.012931960250212263, 0.004776899375532636, 0.0032531576182449804, 0.0012902999101625646,
                 0.0010743955666424807, 0.001, 0.0034227024433899004, 0.0037757728729249105]
    np.testing.assert_allclose(got, torch_lrs, rtol=1e-12)


def test_manual_lr_change_persists_like_torch():
    opt = SGD([Parameter(np.zeros(2))], lr=0.1)
    sched = CosineAnnealingLR(opt, T_max=6)
    got = []
    for i in range(8):
        if i == 4:
            opt.param_groups[0]["lr"] *= 0.1  # a 10x manual cut
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    np.testing.assert_allclose(got, [0.09330127018922195, 0.07500000000000001, 0.05, 0.025000000000000012,
                                     0.0006698729810778065, 0.0, 0.006698729810778065, 0.025], rtol=1e-12, atol=1e-17)
    opt = SGD([Parameter(np.zeros(2))], lr=0.1)
    sched = StepLR(opt, step_size=3, gamma=0.5)
    got = []
    for i in range(6):
        if i == 2:
            opt.param_groups[0]["lr"] = 0.01
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    np.testing.assert_allclose(got, [0.1, 0.1, 0.005, 0.005, 0.005, 0.0025], rtol=1e-15)


# -- GradScaler / clipping ----------------------------------------------------------------------


@pytest.mark.mpi(min_size=1)
def test_grad_scaler_refuses_float16_gradients():
    world = axonmpi.init()
    p = Parameter(np.zeros(2, np.float16))
    p.grad = Tensor(np.ones(2, np.float16))
    scaler = GradScaler(init_scale=2.0 ** 25)
    with pytest.raises(ValueError, match=f"rank {world.rank}: .*float16 gradient.*float32 master"):
        scaler.unscale_(SGD([p], lr=0.1))  # torch: "Attempting to unscale FP16 gradients."
    assert p.grad.data.tolist() == [1.0, 1.0]  # untouched


@pytest.mark.mpi(min_size=1)
def test_grad_scaler_bfloat16_unscales_in_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    axonmpi.init()
    bf16 = np.dtype(ml_dtypes.bfloat16)
    p = Parameter(np.zeros(3, bf16))
    p.grad = Tensor(np.array([3.0, 768.0, 1.5], bf16))
    scaler = GradScaler(init_scale=3.0)  # 1/3 is not a bfloat16: one rounding, of the product
    scaler.unscale_(SGD([p], lr=0.1))
    want = (np.array([3.0, 768.0, 1.5], np.float32) * np.float32(1 / 3)).astype(bf16)
    assert p.grad.data.astype(np.float64).tolist() == want.astype(np.float64).tolist() == [1.0, 256.0, 0.5]


@pytest.mark.mpi(min_size=2)
def test_inf_norm_nan_on_one_rank_is_nan_on_every_rank():
    world = axonmpi.init()
    p = Parameter(np.zeros(3))
    p.shard_group = world.default_group  # each rank holds a different slice
    p.grad = Tensor(np.array([0.5, -8.4, 0.1]) * (world.rank + 1))
    if world.rank == 1:
        p.grad.data[1] = np.nan
    q = Parameter(np.zeros(2))  # replicated, finite
    q.grad = Tensor(np.array([0.25, -0.75]))
    assert math.isnan(axonmpi.optim.grad_norm([q, p], math.inf))  # torch: nan (the sharded max is NaN)
    with pytest.raises(RuntimeError, match="nan"):
        clip_grad_norm_([q, p], 1.0, norm_type=math.inf, error_if_nonfinite=True)
    p.grad.data[1] = -8.4 * (world.rank + 1)
    want = 8.4 * world.world_size
    assert abs(axonmpi.optim.grad_norm([q, p], math.inf) - want) <= 1e-12 * want


# -- ZeRO-1 with None gradients -----------------------------------------------------------------


def _zero_model():
    axonmpi.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5, dtype=np.float64), nn.Tanh(), nn.Linear(5, 3, dtype=np.float64))


def _zero_run(world, opt_cls, steps, use_second, **kw):
    """ZeRO-1 and the plain optimizer on the same grads; the second Linear gets a grad only at
    the steps where ``use_second(step)``, the other steps it has ``None``."""
    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((steps, 6, 4)), rng.standard_normal((steps, 6, 5))
    ref, model = _zero_model(), _zero_model()
    ropt = opt_cls(ref.parameters(), **kw)
    zopt = ZeroRedundancyOptimizer(model.parameters(), opt_cls, **kw)
    for s in range(steps):
        for m, o in ((ref, ropt), (model, zopt)):
            o.zero_grad(set_to_none=True)
            h = m[1](m[0](Tensor(X[s])))
            out = m[2](h).sum() if use_second(s) else 0.0
            (((h - Tensor(Y[s])) ** 2).mean() + out).backward()
            o.step()
    for k, v in ref.state_dict().items():
        err = np.max(np.abs(model.state_dict()[k] - v))
        assert err <= 1e-10 * np.max(np.abs(v)), (world.rank, k, err)


@pytest.mark.mpi(min_size=1)
def test_zero_skips_none_gradients_like_the_wrapped_optimizer():
    world = axonmpi.init()
    # SGD with momentum and weight decay: None on steps 1 and 3, grads again after (exact)
    _zero_run(world, SGD, 5, lambda s: s not in (1, 3), lr=0.1, momentum=0.9, weight_decay=0.1)
    # AdamW: the second layer stops getting grads at step 2 and never again (exact)
    _zero_run(world, AdamW, 5, lambda s: s < 2, lr=1e-2, weight_decay=0.1)


@pytest.mark.mpi(min_size=1)
def test_zero_adam_parameter_that_returns_after_none_steps():
    world = axonmpi.init()
    # the second layer has no grad at steps 1 and 2, then again: its Adam step count lags by 2
    _zero_run(world, AdamW, 5, lambda s: s not in (1, 2), lr=1e-2, weight_decay=0.1)


@pytest.mark.mpi(min_size=1)
def test_zero_sgd_dampening_late_parameter_raises():
    world = axonmpi.init()
    with pytest.raises(RuntimeError, match=rf"rank {world.rank}: ZeroRedundancyOptimizer: parameter 2 gets its "
                                           r"first gradient.*dampening=0\.5.*own param group"):
        _zero_run(world, SGD, 3, lambda s: s >= 1, lr=0.1, momentum=0.9, dampening=0.5)
