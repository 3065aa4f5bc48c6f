"""nn.Conv2d / nn.MaxPool2d / F.conv2d / F.max_pool2d (the FSDP tutorial's MNIST net): gradients against finite
differences (float64), values and gradients against torch where installed, PyTorch's init bounds, errors."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, nn
from axonmpi.autograd import gradcheck
import axonmpi.nn.functional as F

RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 3, 7, 6))
W = RNG.standard_normal((4, 3, 3, 2))
B = RNG.standard_normal(4)
GEOMS = [(1, 0), (2, 1), ((2, 1), (1, 0))]


def _leaf(a):
    return Tensor(a.copy(), requires_grad=True, dtype=np.float64)


@pytest.mark.serial
@pytest.mark.parametrize("stride,padding", GEOMS)
def test_gradcheck(stride, padding):
    assert gradcheck(lambda x, w, b: F.conv2d(x, w, b, stride, padding), [_leaf(X[:1, :, :5, :4]), _leaf(W), _leaf(B)])
    xs = X[:1, :2, :5, :5] + np.arange(25).reshape(5, 5) * 0.1      # no ties: finite differences stay in one window
    assert gradcheck(lambda x: F.max_pool2d(x, (2, 3), stride, (1, 1) if padding else 0), [_leaf(xs)])


@pytest.mark.serial
@pytest.mark.parametrize("stride,padding", GEOMS)
def test_matches_torch(stride, padding):
    torch = pytest.importorskip("torch")
    x, w, b = _leaf(X), _leaf(W), _leaf(B)
    y = F.conv2d(x, w, b, stride, padding)
    (y * y).sum().backward()
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (X, W, B))
    ty = torch.nn.functional.conv2d(tx, tw, tb, stride, padding)
    (ty * ty).sum().backward()
    for ours, theirs in ((y, ty), (x.grad, tx.grad), (w.grad, tw.grad), (b.grad, tb.grad)):
        np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-12, atol=1e-12)
    x = _leaf(X)
    m = F.max_pool2d(x, (2, 3), stride, (1, 1) if padding else 0)
    (m * m).sum().backward()
    tx = torch.tensor(X, requires_grad=True)
    tm = torch.nn.functional.max_pool2d(tx, (2, 3), stride, (1, 1) if padding else 0)
    (tm * tm).sum().backward()
    np.testing.assert_array_equal(m.numpy(), tm.detach().numpy())
    np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())


@pytest.mark.serial
def test_fsdp_tutorial_net_trains_and_init_bounds():
    """PyTorch's FSDP tutorial's Net (conv, conv, max_pool2d, dropout, flatten, fc, fc, log_softmax, nll_loss)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 4, 3, 1)
            self.conv2 = nn.Conv2d(4, 8, 3, 1)
            self.dropout1 = nn.Dropout(0.25)
            self.fc1 = nn.Linear(8 * 4 * 4, 16)
            self.fc2 = nn.Linear(16, 10)

        def forward(self, x):
            x = F.relu(self.conv1(x))
            x = F.relu(self.conv2(x))
            x = F.max_pool2d(x, 2)
            x = self.dropout1(x)
            x = axonmpi.flatten(x, 1)
            return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)

    axonmpi.manual_seed(0)
    net = Net()
    bound = 1 / np.sqrt(1 * 3 * 3)
    assert np.abs(net.conv1.weight.numpy()).max() <= bound and np.abs(net.conv1.bias.numpy()).max() <= bound
    opt = axonmpi.optim.Adadelta(net.parameters(), lr=1.0)
    x = Tensor(RNG.standard_normal((16, 1, 12, 12)).astype(np.float32))
    y = Tensor(RNG.integers(0, 10, 16))
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = F.nll_loss(net(x), y, reduction="sum")
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    pred = net(x).argmax(dim=1, keepdim=True)
    assert pred.eq(y.view_as(pred)).sum().item() >= 0


@pytest.mark.serial
def test_errors_name_the_problem():
    conv = nn.Conv2d(3, 2, 3)
    with pytest.raises(TypeError, match=r"Conv2d\(3, 2, kernel_size=\(3, 3\).* has float32 weights but got input of dtype float64"):
        conv(Tensor(np.ones((1, 3, 5, 5))))
    with pytest.raises(ValueError, match=r"\(N, C, H, W\) input, got shape \(3, 5, 5\)"):
        conv(Tensor(np.ones((3, 5, 5), np.float32)))
    with pytest.raises(ValueError, match="input has 2 channels, the weight expects 3"):
        conv(Tensor(np.ones((1, 2, 5, 5), np.float32)))
    with pytest.raises(NotImplementedError, match="groups=1"):
        nn.Conv2d(4, 4, 3, groups=2)
