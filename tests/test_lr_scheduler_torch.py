"""PyTorch's schedulers (LinearLR ... ReduceLROnPlateau): the lr sequences torch 2.13 gives, resume, errors."""
import numpy as np
import pytest

from axonmpi import optim
from axonmpi.nn import Parameter
from axonmpi.optim import lr_scheduler as L

# lr (or momentum) before each step, computed with torch 2.13.0+cpu by the same scenarios
# written with torch.optim (see _scenarios: only the imports differ).
TORCH = {
    'linear': [[0.025, 0.1], [0.037500000000000006, 0.15000000000000002], [0.05, 0.2], [0.0625, 0.25], [0.075, 0.3], [0.075, 0.3], [0.075, 0.3]],
    'exponential': [[0.1], [0.09000000000000001], [0.08100000000000002], [0.07290000000000002], [0.06561000000000002]],
    'multistep': [[0.1], [0.1], [0.05], [0.05], [0.05], [0.0125], [0.0125], [0.0125]],
    'constant': [[0.05], [0.05], [0.05], [0.1], [0.1], [0.1]],
    'polynomial': [[0.1], [0.05625], [0.024999999999999998], [0.0062499999999999995], [0.0], [0.0]],
    'onecycle': [0.040000000000000036, 0.52, 1.0, 0.9504846320134737, 0.8117456539497631, 0.6112620219362893, 0.38874197806371075, 0.18825834605023697, 0.049519367986526286, 4e-06],
    'onecycle_m': [0.95, 0.8999999999999999, 0.85, 0.854951556604879, 0.8688255099070633, 0.8888739533021842, 0.9111260466978157, 0.9311744900929366, 0.945048443395121, 0.95],
    'onecycle3_lr': [0.02, 0.33999999999999997, 0.34, 0.020000000000000018, 0.016667, 0.013334, 0.010001, 0.006668, 0.0033349999999999977, 1.9999999999985307e-06],
    'onecycle3_b1': [0.95, 0.8833333333333333, 0.8833333333333333, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95],
    'sequential': [[0.010000000000000002], [0.04], [0.07], [0.1], [0.05], [0.025], [0.0125]],
    'sequential_cos': [[0.05], [0.05], [0.1], [0.08535533905932738], [0.05], [0.1], [0.010000000000000002], [0.010000000000000002], [0.010000000000000002]],
    'chained': [[0.010000000000000002], [0.009000000000000003], [0.08100000000000003], [0.07290000000000003], [0.06561000000000003], [0.059049000000000025]],
    'warm_restarts': [[0.1], [0.0775], [0.032500000000000015], [0.1], [0.09397114317029975], [0.0775], [0.05500000000000001], [0.032500000000000015], [0.01602885682970026], [0.1], [0.09846666218300808], [0.09397114317029975]],
    'warm_restarts_frac': [0.08535533905932738, 0.05, 0.09619397662556434, 0.0009607359798384785, 0.1, 0.030865828381745515],
    'plateau': [[0.1, 0.2], [0.1, 0.2], [0.1, 0.2], [0.1, 0.2], [0.05, 0.1], [0.05, 0.1], [0.05, 0.1], [0.05, 0.1], [0.05, 0.1], [0.025, 0.05], [0.025, 0.05], [0.025, 0.05]],
    'plateau_max_abs': [[0.1], [0.1], [0.010000000000000002], [0.010000000000000002], [0.0010000000000000002], [0.0010000000000000002]],
}


def P():
    return Parameter(np.zeros(2))


def sgd(lrs=(0.1,), **kw):
    return optim.SGD([{"params": [P()], "lr": lr} for lr in lrs], lr=lrs[0], **kw)


def run(opt, sched, n, metric=None):
    out = []
    for i in range(n):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step(*([] if metric is None else [metric[i]]))
    return out


def _onecycle(opt, sched, key):
    lrs, moms = [], []
    for i in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0][key] if key == "momentum" else opt.param_groups[0]["betas"][0])
        opt.step()
        if i < 9:
            sched.step()
    return lrs, moms


def _scenarios():
    """The same code, with ``torch.optim`` imported as ``optim``/``L``, produced TORCH."""
    R = {}
    o = sgd((0.1, 0.4))
    R["linear"] = run(o, L.LinearLR(o, start_factor=0.25, end_factor=0.75, total_iters=4), 7)
    o = sgd()
    R["exponential"] = run(o, L.ExponentialLR(o, gamma=0.9), 5)
    o = sgd()
    R["multistep"] = run(o, L.MultiStepLR(o, milestones=[2, 5, 5], gamma=0.5), 8)
    o = sgd()
    R["constant"] = run(o, L.ConstantLR(o, factor=0.5, total_iters=3), 6)
    o = sgd()
    R["polynomial"] = run(o, L.PolynomialLR(o, total_iters=4, power=2.0), 6)
    o = sgd(momentum=0.9)
    R["onecycle"], R["onecycle_m"] = _onecycle(o, L.OneCycleLR(o, max_lr=1.0, total_steps=10), "momentum")
    o = optim.Adam([P()], lr=0.1)
    s = L.OneCycleLR(o, max_lr=[0.5], epochs=2, steps_per_epoch=5, pct_start=0.25, anneal_strategy="linear",
                     three_phase=True)
    R["onecycle3_lr"], R["onecycle3_b1"] = _onecycle(o, s, "betas")
    o = sgd()
    R["sequential"] = run(o, L.SequentialLR(o, [L.LinearLR(o, start_factor=0.1, total_iters=3),
                                                L.ExponentialLR(o, gamma=0.5)], milestones=[3]), 7)
    o = sgd()
    R["sequential_cos"] = run(o, L.SequentialLR(o, [L.ConstantLR(o, factor=0.5, total_iters=5),
                                                    L.CosineAnnealingLR(o, T_max=4), L.MultiStepLR(o, [1], 0.1)],
                                                milestones=[2, 5]), 9)
    o = sgd()
    R["chained"] = run(o, L.ChainedScheduler([L.ConstantLR(o, factor=0.1, total_iters=2),
                                              L.ExponentialLR(o, gamma=0.9)]), 6)
    o = sgd()
    R["warm_restarts"] = run(o, L.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=0.01), 12)
    o = sgd()
    s = L.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2)
    R["warm_restarts_frac"] = []
    for e in [0.5, 1.0, 2.5, 5.75, 6.0, 1.25]:
        s.step(e)
        R["warm_restarts_frac"].append(o.param_groups[0]["lr"])
    o = sgd((0.1, 0.2))
    R["plateau"] = run(o, L.ReduceLROnPlateau(o, factor=0.5, patience=1, cooldown=1, min_lr=[0.0, 0.04]), 12,
                       metric=[1.0, 0.9, 0.95, 0.95, 0.95, 0.95, 0.8, 0.81, 0.8, 0.8, 0.8, 0.8])
    o = sgd()
    R["plateau_max_abs"] = run(o, L.ReduceLROnPlateau(o, mode="max", threshold=0.1, threshold_mode="abs",
                                                      patience=0), 6, metric=[1.0, 1.05, 1.2, 1.25, 1.4, 1.3])
    return R


MINE = _scenarios()


@pytest.mark.parametrize("name", sorted(TORCH))
def test_lr_sequence_equals_torch(name):
    np.testing.assert_allclose(np.array(MINE[name], float), np.array(TORCH[name], float), rtol=1e-14, atol=0)


def test_exported_from_optim_and_lr_scheduler():
    for n in ("LinearLR", "ExponentialLR", "MultiStepLR", "ConstantLR", "OneCycleLR", "SequentialLR",
              "ChainedScheduler", "CosineAnnealingWarmRestarts", "PolynomialLR", "ReduceLROnPlateau"):
        assert getattr(optim, n) is getattr(L, n) and n in optim.__all__ and n in L.__all__


def _resume_equals_uninterrupted(make, n=12, cut=5, metric=None):
    o = make[0]()
    full = run(o, make[1](o), n, metric)
    o = make[0]()
    s = make[1](o)
    first = run(o, s, cut, metric)
    osd, ssd = o.state_dict(), s.state_dict()
    o2 = make[0]()
    s2 = make[1](o2)
    o2.load_state_dict(osd)
    s2.load_state_dict(ssd)
    rest = run(o2, s2, n - cut, None if metric is None else metric[cut:])
    np.testing.assert_allclose(first + rest, full, rtol=1e-15)


@pytest.mark.parametrize("make", [
    (lambda: sgd(momentum=0.9), lambda o: L.OneCycleLR(o, max_lr=0.3, total_steps=13)),
    (sgd, lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.2, total_iters=3), L.PolynomialLR(o, 6)], [3])),
    (sgd, lambda o: L.ChainedScheduler([L.MultiStepLR(o, [2, 7]), L.ExponentialLR(o, 0.95)])),
    (sgd, lambda o: L.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=3)),
], ids=["onecycle", "sequential", "chained", "warm_restarts"])
def test_state_dict_resume_equals_uninterrupted(make):
    _resume_equals_uninterrupted(make)


def test_plateau_resume_equals_uninterrupted():
    metric = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.4, 0.4, 0.4, 0.4, 0.4]
    _resume_equals_uninterrupted((sgd, lambda o: L.ReduceLROnPlateau(o, factor=0.5, patience=1)), metric=metric)


def test_onecycle_past_total_steps_raises():
    o = sgd(momentum=0.9)
    s = L.OneCycleLR(o, max_lr=0.1, total_steps=3)
    for _ in range(3):
        s.step()
    with pytest.raises(ValueError, match="stepped 4 times; total_steps is 3"):
        s.step()


@pytest.mark.parametrize("make, match", [
    (lambda o: L.OneCycleLR(o, max_lr=0.1), "total_steps, or both epochs"),
    (lambda o: L.OneCycleLR(o, max_lr=[0.1, 0.2], total_steps=5), "list of 1"),
    (lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=5, pct_start=1), "pct_start"),
    (lambda o: L.LinearLR(o, start_factor=0.0), "start_factor"),
    (lambda o: L.ConstantLR(o, factor=1.5), "factor"),
    (lambda o: L.CosineAnnealingWarmRestarts(o, T_0=0), "T_0"),
    (lambda o: L.ReduceLROnPlateau(o, factor=1.0), "factor"),
    (lambda o: L.ReduceLROnPlateau(o, mode="up"), "mode"),
    (lambda o: L.SequentialLR(o, [L.ExponentialLR(o, 0.9)], milestones=[2]), "one milestone fewer"),
    (lambda o: L.SequentialLR(o, [L.ReduceLROnPlateau(o)], milestones=[]), "ReduceLROnPlateau"),
    (lambda o: L.ChainedScheduler([L.ExponentialLR(o, 0.9), L.ExponentialLR(sgd(), 0.9)]), "another optimizer"),
])
def test_bad_arguments_name_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make(sgd())


def test_onecycle_needs_momentum_or_betas():
    class Plain(optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1))

    with pytest.raises(ValueError, match="momentum or betas"):
        L.OneCycleLR(Plain([P()]), max_lr=0.1, total_steps=4)
    L.OneCycleLR(Plain([P()]), max_lr=0.1, total_steps=4, cycle_momentum=False)
