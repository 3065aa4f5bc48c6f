"""PyTorch names that port by import: loss modules/functions with reduction=, nn.utils, elementwise
comparisons returning bool Tensors, DataLoader workers. Values and gradients against torch where it is
installed (``make test-interop``), and against torch numbers written here otherwise."""
import numpy as np
import pytest

from axonmpi import Tensor, nn
from axonmpi.data import DataLoader
import axonmpi.nn.functional as F

RNG = np.random.default_rng(0)
X = RNG.standard_normal((5, 4))
XI = RNG.standard_normal((2, 4, 3))            # (N, C, d1): classes at dim 1
T = np.array([0, 3, 1, 2, 3])
TI = np.array([[0, 3, -100], [1, 2, 2]])
Y = RNG.standard_normal((5, 4))
P = 1 / (1 + np.exp(-RNG.standard_normal((5, 4))))
B = (RNG.random((5, 4)) > 0.5).astype(np.float64)
W = np.array([0.5, 1.0, 2.0, 1.5])

CASES = [  # (name, axonmpi call, torch call) on float64 inputs x (logits, log-probs, predictions)
    ("ce", lambda m, x: m.CrossEntropyLoss()(x, T), lambda t, x: t.nn.CrossEntropyLoss()(x, t.tensor(T))),
    ("ce_sum_w_ls", lambda m, x: m.CrossEntropyLoss(weight=W, reduction="sum", label_smoothing=0.1)(x, T),
     lambda t, x: t.nn.CrossEntropyLoss(weight=t.tensor(W), reduction="sum", label_smoothing=0.1)(x, t.tensor(T))),
    ("ce_mean_w_ls", lambda m, x: m.CrossEntropyLoss(weight=W, label_smoothing=0.2)(x, T),
     lambda t, x: t.nn.CrossEntropyLoss(weight=t.tensor(W), label_smoothing=0.2)(x, t.tensor(T))),
    ("ce_probs", lambda m, x: m.CrossEntropyLoss()(x, P), lambda t, x: t.nn.CrossEntropyLoss()(x, t.tensor(P))),
    ("ce_none_dim1", lambda m, x: m.CrossEntropyLoss(reduction="none")(x, T),
     lambda t, x: t.nn.CrossEntropyLoss(reduction="none")(x, t.tensor(T))),
    ("nll_w", lambda m, x: m.NLLLoss(weight=W)(F.log_softmax(x, -1), T),
     lambda t, x: t.nn.NLLLoss(weight=t.tensor(W))(t.log_softmax(x, -1), t.tensor(T))),
    ("mse", lambda m, x: m.MSELoss()(x, Y), lambda t, x: t.nn.MSELoss()(x, t.tensor(Y))),
    ("l1_sum", lambda m, x: m.L1Loss(reduction="sum")(x, Y), lambda t, x: t.nn.L1Loss(reduction="sum")(x, t.tensor(Y))),
    ("smoothl1", lambda m, x: m.SmoothL1Loss(beta=0.7)(x, Y), lambda t, x: t.nn.SmoothL1Loss(beta=0.7)(x, t.tensor(Y))),
    ("bcelogits_pw", lambda m, x: m.BCEWithLogitsLoss(pos_weight=W)(x * 10, B),
     lambda t, x: t.nn.BCEWithLogitsLoss(pos_weight=t.tensor(W))(x * 10, t.tensor(B))),
    ("bce_w_none", lambda m, x: m.BCELoss(weight=W, reduction="none")(F.sigmoid(x), B),
     lambda t, x: t.nn.BCELoss(weight=t.tensor(W), reduction="none")(t.sigmoid(x), t.tensor(B))),
]


def _ours(fn, x=X):
    xt = Tensor(x.copy(), requires_grad=True)
    out = fn(nn, xt)
    out.sum().backward()
    return out.numpy(), xt.grad.numpy()


@pytest.mark.serial
@pytest.mark.parametrize("name,mine,theirs", CASES, ids=[c[0] for c in CASES])
def test_losses_match_torch(name, mine, theirs):
    torch = pytest.importorskip("torch")
    val, grad = _ours(mine)
    xt = torch.tensor(X, requires_grad=True)
    ref = theirs(torch, xt)
    ref.sum().backward()
    assert np.allclose(val, ref.detach().numpy(), rtol=1e-12, atol=1e-12), name
    assert np.allclose(grad, xt.grad.numpy(), rtol=1e-10, atol=1e-12), name


@pytest.mark.serial
def test_cross_entropy_classes_at_dim1_and_ignore_index():
    torch = pytest.importorskip("torch")
    for red in ("mean", "sum", "none"):
        xt = Tensor(XI.copy(), requires_grad=True)
        out = nn.CrossEntropyLoss(reduction=red)(xt, TI)
        out.sum().backward()
        tx = torch.tensor(XI, requires_grad=True)
        ref = torch.nn.CrossEntropyLoss(reduction=red)(tx, torch.tensor(TI))
        ref.sum().backward()
        assert np.allclose(out.numpy(), ref.detach().numpy(), rtol=1e-12) and out.shape == tuple(ref.shape)
        assert np.allclose(xt.grad.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.serial
def test_losses_against_written_torch_numbers():
    # torch.nn.CrossEntropyLoss()(logits, t) and MSELoss(), values printed by torch 2.13.0
    logits = np.array([[1.0, 2.0, 0.5], [0.1, -1.0, 3.0]])
    assert abs(nn.CrossEntropyLoss()(Tensor(logits), np.array([1, 0])).item() - 1.7175715015342181) < 1e-12
    assert abs(nn.CrossEntropyLoss(label_smoothing=0.1)(Tensor(logits), np.array([1, 0])).item() - 1.7292381682008848) < 1e-12
    assert abs(nn.BCEWithLogitsLoss()(Tensor(logits), (logits > 0.8) * 1.0).item() - 0.42008539698447295) < 1e-12
    assert abs(nn.SmoothL1Loss()(Tensor(logits), np.zeros((2, 3))).item() - 0.855) < 1e-12
    with pytest.raises(ValueError, match="reduction must be one of"):
        nn.L1Loss(reduction="avg")


@pytest.mark.serial
def test_nn_utils():
    lin = nn.Linear(3, 2, dtype=np.float64)
    vec = nn.utils.parameters_to_vector(lin.parameters())
    assert vec.shape == (8,) and np.array_equal(vec.numpy()[:6], lin.weight.numpy().reshape(-1))
    nn.utils.vector_to_parameters(Tensor(np.arange(8.0)), lin.parameters())
    assert np.array_equal(lin.bias.numpy(), [6.0, 7.0])
    with pytest.raises(ValueError, match="vector has 7 elements, the parameters 8"):
        nn.utils.vector_to_parameters(Tensor(np.arange(7.0)), lin.parameters())
    lin(Tensor(np.ones((4, 3)))).sum().backward()
    norm = nn.utils.clip_grad_norm_(lin.parameters(), 0.5)
    assert float(norm) == pytest.approx(np.sqrt(3 * 16 * 2 + 16 * 2))
    g = np.concatenate([p.grad.numpy().reshape(-1) for p in lin.parameters()])
    assert np.linalg.norm(g) == pytest.approx(0.5, rel=1e-5)
    nn.utils.clip_grad_value_(lin.parameters(), 0.01)
    assert max(abs(p.grad.numpy()).max() for p in lin.parameters()) <= 0.01


@pytest.mark.serial
def test_comparisons_are_elementwise_and_hash_by_identity():
    pred, y = Tensor([1, 2, 3, 4]), Tensor([1, 0, 3, 0])
    eq = pred == y
    assert isinstance(eq, Tensor) and eq.dtype == np.bool_ and eq.tolist() == [True, False, True, False]
    assert (pred == y).sum().item() == 2 and (pred == y).float().mean().item() == 0.5
    assert (pred != y).tolist() == [False, True, False, True] and (pred == 3).tolist() == [False, False, True, False]
    assert [(pred < 3).tolist(), (pred >= 3).tolist()] == [[True, True, False, False], [False, False, True, True]]
    assert (pred == None) is False and (pred != None) is True  # noqa: E711
    d = {pred: "a", y: "b"}
    assert d[pred] == "a" and len({pred, y, pred}) == 2 and pred in [pred, y]
    with pytest.raises(RuntimeError, match="ambiguous"):   # as torch: a list search compares elementwise
        pred in [y, pred]
    lin = nn.Linear(2, 2)
    assert lin.weight in list(lin.parameters()) and lin.weight in set(lin.parameters())


class _Squares:
    def __len__(self):
        return 23

    def __getitem__(self, i):
        return np.full(3, float(i * i)), i % 4


@pytest.mark.serial
@pytest.mark.parametrize("workers,persistent", [(2, False), (3, True)])
def test_dataloader_workers_give_the_same_batches(workers, persistent):
    import threading
    ref = [(x.copy(), y.copy()) for x, y in DataLoader(_Squares(), batch_size=4, shuffle=True, seed=5)]
    dl = DataLoader(_Squares(), batch_size=4, shuffle=True, seed=5, num_workers=workers, pin_memory=True,
                    prefetch_factor=2, persistent_workers=persistent)
    for epoch in range(2):
        got = list(dl)
        assert len(got) == len(ref) == 6
        for (a, b), (c, e) in zip(got, ref if epoch == 0 else got):
            assert np.array_equal(a, c) and np.array_equal(b, e)
    names = [t.name for t in threading.enumerate()]
    assert any(n.startswith("axonmpi-loader") for n in names) == persistent
    with pytest.raises(ValueError, match="prefetch_factor"):
        DataLoader(_Squares(), num_workers=0, prefetch_factor=2)
    with pytest.raises(ValueError, match="num_workers"):
        DataLoader(_Squares(), num_workers=-1)
