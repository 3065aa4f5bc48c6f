"""PyTorch names that port by import: loss modules/functions with reduction=, nn.utils, elementwise
comparisons returning bool Tensors, DataLoader workers. Values and gradients against torch where it is
installed (``make test-interop``), and against torch numbers written here otherwise."""
import numpy as np
import pytest

import axonmpi
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


# -- the names PyTorch's DDP and FSDP tutorials use (issue 32) -----------------------------------------
@pytest.mark.serial
def test_tutorial_names_device_randn_argmax_one_hot():
    import axonmpi as torch
    assert str(torch.device("cpu")) == "cpu" and str(torch.device("cuda", 1)) == "cuda:1" and str(torch.device(0)) == "cuda:0"
    x = torch.randn(20, 10)
    assert x.shape == (20, 10) and x.dtype == torch.float32
    assert torch.argmax(Tensor([[1.0, 5.0], [7.0, 2.0]]), dim=1).tolist() == [1, 0]
    oh = F.one_hot(Tensor(np.array([0, 3, 1])), num_classes=4)
    assert oh.dtype == np.int64 and oh.tolist() == [[1, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0]]
    assert F.one_hot(Tensor(np.array([2, 0]))).shape == (2, 3)
    with pytest.raises(ValueError, match=r"class values must be in \[0, 2\), got min 0 and max 2"):
        F.one_hot(Tensor(np.array([0, 2])), 2)
    with pytest.raises(TypeError, match="integer"):
        F.one_hot(Tensor([0.0]), 2)
    assert not torch.cuda.is_available() or torch.cuda.device_count() > 0
    torch.cuda.set_device(0)                      # nothing on a host without a GPU
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    ev1.record()
    assert ev0.elapsed_time(ev1) >= 0.0


@pytest.mark.serial
def test_one_hot_matches_torch():
    torch = pytest.importorskip("torch")
    idx = np.array([[0, 2], [1, 1]])
    assert F.one_hot(Tensor(idx), 3).tolist() == torch.nn.functional.one_hot(torch.tensor(idx), 3).tolist()


@pytest.mark.serial
def test_to_rank_and_ddp_device_ids(world):
    import axonmpi as torch
    from axonmpi.backend import index_device
    want = index_device(world.rank)
    assert want.type == ("cuda" if torch.cuda.is_available() else "cpu")
    t = Tensor(np.ones(2)).to(world.rank)
    assert t.device == want
    model = nn.Linear(3, 2).to(world.rank)
    assert model.weight.device == want
    ddp = axonmpi.DDP(model, device_ids=[world.rank])
    assert ddp.module is model
    assert axonmpi.DDP(nn.Linear(3, 2), [0]).module.weight.device == index_device(0)   # torch's positional order
    with pytest.raises(ValueError, match="one device per process"):
        axonmpi.DDP(nn.Linear(3, 2), device_ids=[0, 1])
    axonmpi.DDP(nn.Linear(3, 2), process_group=world.default_group, bucket_cap_mb=1)


@pytest.mark.serial
def test_save_load_state_dicts(tmp_path):
    import io
    import axonmpi as torch
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = axonmpi.optim.Adam(model.parameters(), lr=0.1)
    model(Tensor(np.ones((2, 3), np.float32))).sum().backward()
    opt.step()
    states = {"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 3, "loss": float("nan"),
              "t": Tensor([1.0, 2.0], requires_grad=True), "pair": (1, "a"), "bf": np.zeros(2, np.dtype(torch.bfloat16))}
    path = tmp_path / "mnist_cnn.pt"
    torch.save(states, str(path))
    assert not (tmp_path / "mnist_cnn.pt.tmp").exists()
    for where in (None, "cpu", {"cuda:0": "cuda:1"}, torch.device("cpu"), lambda a, loc: a):
        got = torch.load(path, map_location=where, weights_only=True)
        assert got["epoch"] == 3 and np.isnan(got["loss"]) and got["pair"] == (1, "a")
        assert got["t"].requires_grad and got["t"].tolist() == [1.0, 2.0]
        assert got["bf"].dtype.name == "bfloat16"
        for k, v in model.state_dict().items():
            assert np.array_equal(got["model"][k], v) and got["model"][k].dtype == v.dtype
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    fresh.load_state_dict(got["model"])
    opt2 = axonmpi.optim.Adam(fresh.parameters(), lr=0.1)
    opt2.load_state_dict(got["opt"])                              # int parameter ids kept as ints
    assert list(got["opt"]["state"]) == list(opt.state_dict()["state"])
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    assert set(torch.load(buf)) == set(model.state_dict())
    with pytest.raises(TypeError, match=r"\['m'\] is a Sequential; .*save the object's state_dict"):
        torch.save({"m": model}, str(tmp_path / "bad.pt"))
    with pytest.raises(FileNotFoundError, match="no file"):
        torch.load(str(tmp_path / "missing.pt"))
    (tmp_path / "pickle.pt").write_bytes(b"\x80\x04not hdf5")
    with pytest.raises(ValueError, match="not an HDF5 file written by axonmpi.save"):
        torch.load(str(tmp_path / "pickle.pt"))


@pytest.mark.serial
def test_in_place_tensor_methods_as_torch():
    import axonmpi as torch
    ddp_loss = torch.zeros(2)
    ddp_loss[0] += 1.5                                    # the FSDP tutorial's bookkeeping
    ddp_loss[1] += 4
    assert ddp_loss.tolist() == [1.5, 4.0]
    a = Tensor(np.arange(3.0))
    b = a
    a += 1                                                 # in place, as torch: b sees it
    assert b.tolist() == [1.0, 2.0, 3.0] and a is b
    a.mul_(2).sub_(1, alpha=2).div_(2)
    assert a.tolist() == [0.0, 1.0, 2.0]
    w = Tensor(np.ones(2), requires_grad=True)
    with pytest.raises(RuntimeError, match=r"add_ on a leaf Tensor that requires grad \(shape \(2,\).*axonmpi.no_grad"):
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="item assignment"):
        w[0] = 3.0
    with axonmpi.no_grad():
        w.copy_(np.array([3.0, 4.0]))
        w[1] = 5.0
    assert w.tolist() == [3.0, 5.0]
    v = w * 2                                             # tracked: += builds a new tensor, as before
    v += 1
    assert v.tolist() == [7.0, 11.0] and v.grad_fn is not None
    n = Tensor(np.array([1, 2]))
    with pytest.raises(TypeError, match="can't be cast"):
        n.add_(0.5)
    assert Tensor([[1.0, 2.0]]).view_as(Tensor(np.zeros((2, 1)))).shape == (2, 1)
