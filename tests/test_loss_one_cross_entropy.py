"""Issue 31 item 3: one cross-entropy.  ``nn.CrossEntropyLoss`` calls ``F.cross_entropy`` (the
fused kernel) for class-index targets, and a batch whose targets are all ``ignore_index``
gives zero input gradients (a NaN ``"mean"`` loss) for every combination of ``weight``,
``label_smoothing``, ``reduction`` and input rank, as torch does.  Before: NaN gradients with
``weight=`` or ``label_smoothing=`` (the module ran a second, composite implementation).
Closed-form checks run everywhere; the torch comparison runs where torch is installed."""
import itertools

import numpy as np
import pytest

from axonmpi import Tensor, nn
from axonmpi.autograd import ops_nn
from axonmpi.nn import functional as F

SHAPES = {2: (4, 5), 3: (4, 5, 3), 4: (2, 5, 3, 2)}      # class axis at dim 1, C = 5
CASES = list(itertools.product(SHAPES, [False, True], [0.0, 0.3], ["mean", "sum", "none"]))
_W = np.array([0.5, 1.0, 2.0, 1.5, 0.25])


def _data(rank, all_ignored, seed=0):
    rng = np.random.default_rng(seed + rank)
    shape = SHAPES[rank]
    x = rng.standard_normal(shape)
    t = rng.integers(0, shape[1], size=(shape[0],) + shape[2:])
    if all_ignored:
        t[:] = -100
    else:
        t.reshape(-1)[::3] = -100
    return x, t


def _ours(x, t, weighted, eps, reduction, module=True):
    xa = Tensor(x.copy(), requires_grad=True)
    w = _W if weighted else None
    if module:
        loss = nn.CrossEntropyLoss(weight=w, reduction=reduction, label_smoothing=eps)(xa, t)
    else:
        loss = nn.NLLLoss(weight=w, reduction=reduction)(F.log_softmax(xa, 1), t)
    loss.sum().backward()
    return np.asarray(loss.data), np.asarray(xa.grad.data)


def _closed_form(x, t, weighted, eps, reduction):
    """torch's definition, written out in NumPy (class axis 1)."""
    c = x.shape[1]
    xl = np.moveaxis(x, 1, -1).reshape(-1, c)
    tl = t.reshape(-1)
    w = _W if weighted else np.ones(c)
    valid = tl != -100
    ts = np.where(valid, tl, 0)
    logp = xl - xl.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    wt = w[ts] * valid
    loss = (1 - eps) * -logp[np.arange(len(ts)), ts] * wt + eps / c * -(logp * w).sum(1) * valid
    if reduction == "none":
        return loss.reshape(t.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / wt.sum() if wt.sum() else np.nan


@pytest.mark.parametrize("rank,weighted,eps,reduction", CASES)
def test_all_ignored_gives_zero_gradients(rank, weighted, eps, reduction):
    x, t = _data(rank, all_ignored=True)
    loss, grad = _ours(x, t, weighted, eps, reduction)
    assert np.all(grad == 0), f"NaN/nonzero gradient for an all-ignored batch: {grad.ravel()[:5]}"
    if reduction == "mean":
        assert np.isnan(loss)                                  # torch: 0/0
    else:
        assert np.all(loss == 0)


@pytest.mark.parametrize("rank,weighted,reduction", list(itertools.product(SHAPES, [False, True],
                                                                             ["mean", "sum", "none"])))
def test_nll_all_ignored_gives_zero_gradients(rank, weighted, reduction):
    x, t = _data(rank, all_ignored=True)
    loss, grad = _ours(x, t, weighted, 0.0, reduction, module=False)
    assert np.all(grad == 0)
    assert np.isnan(loss) if reduction == "mean" else np.all(loss == 0)


@pytest.mark.parametrize("rank,weighted,eps,reduction", CASES)
def test_values_match_closed_form(rank, weighted, eps, reduction):
    x, t = _data(rank, all_ignored=False)
    loss, _ = _ours(x, t, weighted, eps, reduction)
    np.testing.assert_allclose(loss, _closed_form(x, t, weighted, eps, reduction), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("rank,weighted,eps,reduction", CASES)
def test_module_is_the_function(rank, weighted, eps, reduction, monkeypatch):
    """The module's value and gradient are F.cross_entropy's (classes moved last), bit for bit,
    and the module goes through F.cross_entropy's kernel."""
    x, t = _data(rank, all_ignored=False)
    loss_m, grad_m = _ours(x, t, weighted, eps, reduction)
    xf = Tensor(np.moveaxis(x, 1, -1).copy(), requires_grad=True)
    loss_f = F.cross_entropy(xf, np.asarray(t), weight=_W if weighted else None, reduction=reduction,
                             label_smoothing=eps)
    loss_f.sum().backward()
    np.testing.assert_array_equal(loss_m, loss_f.data)
    np.testing.assert_array_equal(grad_m, np.moveaxis(xf.grad.data, -1, 1))
    calls = []
    real = ops_nn.cross_entropy
    monkeypatch.setattr(ops_nn, "cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    _ours(x, t, weighted, eps, reduction)
    assert calls == [1]


@pytest.mark.parametrize("all_ignored", [True, False])
@pytest.mark.parametrize("rank,weighted,eps,reduction", CASES)
def test_matches_torch(rank, weighted, eps, reduction, all_ignored):
    torch = pytest.importorskip("torch")
    x, t = _data(rank, all_ignored)
    xt = torch.tensor(x, requires_grad=True)
    crit = torch.nn.CrossEntropyLoss(weight=torch.tensor(_W) if weighted else None, reduction=reduction,
                                     label_smoothing=eps)
    lt = crit(xt, torch.tensor(t))
    lt.sum().backward()
    loss, grad = _ours(x, t, weighted, eps, reduction)
    np.testing.assert_allclose(loss, lt.detach().numpy(), rtol=1e-12, atol=1e-14, equal_nan=True)
    np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-12, atol=1e-14)
    if not eps:
        xt.grad = None
        nl = torch.nn.NLLLoss(weight=torch.tensor(_W) if weighted else None, reduction=reduction)
        lt = nl(torch.log_softmax(xt, 1), torch.tensor(t))
        lt.sum().backward()
        loss, grad = _ours(x, t, weighted, 0.0, reduction, module=False)
        np.testing.assert_allclose(loss, lt.detach().numpy(), rtol=1e-12, atol=1e-14, equal_nan=True)
        np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("target", [2, -100])
@pytest.mark.parametrize("weighted,eps,reduction", list(itertools.product([False, True], [0.0, 0.3],
                                                                         ["mean", "sum", "none"])))
def test_unbatched_input_is_one_row(weighted, eps, reduction, target):
    """Input rank 1 ((C,) with a scalar target, torch's unbatched form) equals the (1, C) batch."""
    x = np.random.default_rng(5).standard_normal(5)
    one, g1 = _ours(x, np.array(target), weighted, eps, reduction)
    row, g2 = _ours(x[None], np.array([target]), weighted, eps, reduction)
    np.testing.assert_array_equal(one, row.reshape(one.shape))
    np.testing.assert_array_equal(g1, g2[0])
    if target == -100:
        assert np.all(g1 == 0)
