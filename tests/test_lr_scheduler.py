"""Learning-rate schedulers: closed-form values at chosen steps, resume, errors."""
import math

import numpy as np
import pytest

from axonmpi.nn import Parameter
from axonmpi.optim import SGD, CosineAnnealingLR, LambdaLR, LinearWarmupCosine, StepLR


def _opt(lrs=(0.1,)):
    return SGD([{"params": [Parameter(np.zeros(2))], "lr": lr} for lr in lrs], lr=lrs[0])


def _lrs(sched, steps):
    """lr in effect for steps 0..steps-1 (the constructor sets step 0's)."""
    out = []
    for _ in range(steps):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.step()
    return out


def test_step_lr():
    lrs = _lrs(StepLR(_opt(), step_size=3, gamma=0.5), 8)
    np.testing.assert_allclose(lrs, [0.1] * 3 + [0.05] * 3 + [0.025] * 2, rtol=1e-15)


def test_cosine_annealing_closed_form():
    sched = CosineAnnealingLR(_opt((0.2, 0.4)), T_max=10, eta_min=0.01)
    assert sched.get_last_lr() == [0.2, 0.4]
    for _ in range(5):
        sched.step()
    np.testing.assert_allclose(sched.get_last_lr(), [0.105, 0.205], rtol=1e-14)  # halfway: the mean
    for _ in range(5):
        sched.step()
    np.testing.assert_allclose(sched.get_last_lr(), [0.01, 0.01], rtol=1e-14)
    sched.step()  # t = 11
    np.testing.assert_allclose(sched.get_last_lr()[0], 0.01 + 0.19 * (1 + math.cos(math.pi * 1.1)) / 2)


def test_linear_warmup_cosine():
    lrs = _lrs(LinearWarmupCosine(_opt((1.0,)), warmup_steps=4, total_steps=12, min_lr=0.1), 15)
    np.testing.assert_allclose(lrs[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-15)
    assert lrs[4] == 1.0
    np.testing.assert_allclose(lrs[8], 0.1 + 0.9 * 0.5, rtol=1e-14)  # midway through the decay
    np.testing.assert_allclose(lrs[10], 0.1 + 0.9 * (1 + math.cos(math.pi * 6 / 8)) / 2, rtol=1e-14)
    np.testing.assert_allclose(lrs[12:], [0.1] * 3, rtol=1e-15)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    no_warmup = _lrs(LinearWarmupCosine(_opt((1.0,)), warmup_steps=0, total_steps=2), 3)
    np.testing.assert_allclose(no_warmup, [1.0, 0.5, 0.0], atol=1e-15)


def test_lambda_lr_per_group():
    sched = LambdaLR(_opt((0.1, 1.0)), [lambda t: 0.5 ** t, lambda t: 1.0 / (t + 1)])
    for _ in range(3):
        sched.step()
    np.testing.assert_allclose(sched.get_last_lr(), [0.1 * 0.125, 0.25], rtol=1e-15)
    np.testing.assert_allclose([g["lr"] for g in sched.optimizer.param_groups], [0.0125, 0.25])
    with pytest.raises(ValueError, match="2 callables"):
        LambdaLR(_opt((0.1, 1.0)), [lambda t: 1.0])


def test_state_dict_resume_matches_uninterrupted():
    full = LinearWarmupCosine(_opt(), warmup_steps=3, total_steps=20, min_lr=1e-3)
    ref = _lrs(full, 10)
    first = LinearWarmupCosine(_opt(), warmup_steps=3, total_steps=20, min_lr=1e-3)
    head = _lrs(first, 4)
    opt2 = _opt()
    opt2.load_state_dict(first.optimizer.state_dict())  # carries lr and initial_lr
    second = LinearWarmupCosine(opt2, warmup_steps=3, total_steps=20, min_lr=1e-3)
    second.load_state_dict(first.state_dict())
    assert head + _lrs(second, 6) == ref
    assert "optimizer" not in first.state_dict()


def test_resume_with_last_epoch():
    opt = _opt()
    s = StepLR(opt, step_size=2, gamma=0.1)
    for _ in range(3):
        s.step()
    resumed = StepLR(opt, step_size=2, gamma=0.1, last_epoch=2)  # its constructor takes step 3
    np.testing.assert_allclose(resumed.get_last_lr(), s.get_last_lr())
    with pytest.raises(KeyError, match="initial_lr"):
        StepLR(_opt(), step_size=2, last_epoch=3)


@pytest.mark.parametrize("make,match", [
    (lambda o: StepLR(o, step_size=0), "step_size"),
    (lambda o: CosineAnnealingLR(o, T_max=0), "T_max"),
    (lambda o: LinearWarmupCosine(o, warmup_steps=10, total_steps=10), "total_steps"),
    (lambda o: LinearWarmupCosine(o, warmup_steps=-1, total_steps=10), "-1"),
])
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make(_opt())
