"""Adadelta (the FSDP tutorial's optimizer) against its equations in NumPy and against torch.optim.Adadelta."""
import numpy as np
import pytest

from axonmpi.nn import Parameter
from axonmpi.autograd import Tensor
from axonmpi.optim import Adadelta

RNG = np.random.default_rng(3)
INIT = RNG.standard_normal((3, 4))
GRADS = [RNG.standard_normal((3, 4)) for _ in range(5)]


def _ours(**kw):
    p = Parameter(INIT.copy())
    opt = Adadelta([p], **kw)
    for g in GRADS:
        p.grad = Tensor(g.copy())
        opt.step()
    return p.numpy(), opt


@pytest.mark.serial
@pytest.mark.parametrize("kw", [{}, dict(lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.1), dict(maximize=True)])
def test_adadelta_matches_equations(kw):
    lr, rho, eps, wd = kw.get("lr", 1.0), kw.get("rho", 0.9), kw.get("eps", 1e-6), kw.get("weight_decay", 0.0)
    p, v, u = INIT.copy(), np.zeros_like(INIT), np.zeros_like(INIT)
    for g in GRADS:
        g = (-g if kw.get("maximize") else g) + wd * p
        v = rho * v + (1 - rho) * g * g
        d = np.sqrt(u + eps) / np.sqrt(v + eps) * g
        u = rho * u + (1 - rho) * d * d
        p = p - lr * d
    got, opt = _ours(**kw)
    np.testing.assert_allclose(got, p, rtol=1e-12, atol=1e-14)
    sd = opt.state_dict()
    p2 = Parameter(INIT.copy())
    opt2 = Adadelta([p2], **kw)
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["param_groups"][0]["rho"] == rho
    with pytest.raises(ValueError, match="rho=1.5"):
        Adadelta([p2], rho=1.5)


@pytest.mark.serial
def test_adadelta_matches_torch():
    torch = pytest.importorskip("torch")
    tp = torch.tensor(INIT.copy(), requires_grad=True)
    topt = torch.optim.Adadelta([tp], lr=0.7, weight_decay=0.05)
    for g in GRADS:
        tp.grad = torch.tensor(g)
        topt.step()
    got, _ = _ours(lr=0.7, weight_decay=0.05)
    np.testing.assert_allclose(got, tp.detach().numpy(), rtol=1e-12, atol=1e-14)
