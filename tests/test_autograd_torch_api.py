"""PyTorch's names, signatures and semantics for Tensor methods, constructors and the engine
(issue 9 section 4 and the "broken calls" of issue 16): each test fails on the wave-1 code."""
import itertools

import numpy as np
import pytest

import axonmpi
from axonmpi import backend, nn
from axonmpi.autograd import Function, Tensor, gradcheck, is_grad_enabled, ops, set_grad_enabled
from axonmpi.autograd import ops_nn as F
from axonmpi.autograd._util import _on_one_device

RNG = np.random.default_rng(7)


def _t(*shape, positive=False):
    a = RNG.standard_normal(shape)
    if positive:
        a = np.abs(a) + 0.5
    return Tensor(a, requires_grad=True, dtype=np.float64)


def _softmax(a, axis=-1):
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# -- Tensor methods under PyTorch's names ----------------------------------------------------
def test_activation_methods_exist_and_match_functional():
    x = _t(3, 4)
    a = x.numpy()
    np.testing.assert_allclose(x.relu().numpy(), np.maximum(a, 0))
    np.testing.assert_allclose(x.sigmoid().numpy(), 1 / (1 + np.exp(-a)), rtol=1e-14)
    np.testing.assert_allclose(x.softmax(dim=0).numpy(), _softmax(a, 0), rtol=1e-13)
    np.testing.assert_allclose(x.log_softmax(dim=-1).numpy(), np.log(_softmax(a, -1)), rtol=1e-13)
    np.testing.assert_allclose(x.softmax(1).numpy(), _softmax(a, 1), rtol=1e-13)
    mask = a > 0
    np.testing.assert_allclose(x.masked_fill(Tensor(mask), 0.5).numpy(), np.where(mask, 0.5, a))
    np.testing.assert_allclose(x.pow(3).numpy(), a ** 3, rtol=1e-14)
    np.testing.assert_allclose(x.clamp(min=-0.5, max=0.5).numpy(), np.clip(a, -0.5, 0.5))
    np.testing.assert_allclose(x.clamp(max=0.1).numpy(), np.minimum(a, 0.1))


def test_reductions_take_dim_and_keepdim_and_numpy_names():
    x = _t(2, 3, 4)
    a = x.numpy()
    np.testing.assert_allclose(x.sum(dim=1).numpy(), a.sum(1), rtol=1e-14)
    np.testing.assert_allclose(x.sum(dim=(0, 2), keepdim=True).numpy(), a.sum((0, 2), keepdims=True), rtol=1e-14)
    np.testing.assert_allclose(x.sum(axis=-1, keepdims=True).numpy(), a.sum(-1, keepdims=True), rtol=1e-14)
    np.testing.assert_allclose(x.mean(-1, keepdim=True).numpy(), a.mean(-1, keepdims=True), rtol=1e-14)
    np.testing.assert_allclose(x.var(dim=1).numpy(), a.var(1, ddof=1), rtol=1e-13)
    np.testing.assert_allclose(x.var(1, unbiased=False).numpy(), a.var(1), rtol=1e-13)
    np.testing.assert_allclose(x.std(dim=2, keepdim=True).numpy(), a.std(2, ddof=1, keepdims=True), rtol=1e-13)
    np.testing.assert_allclose(x.amax(dim=(1, 2)).numpy(), a.max((1, 2)))
    assert x.sum(dim=1, dtype=np.float32).dtype == np.float32
    np.testing.assert_array_equal(x.argmax(dim=1).numpy(), a.argmax(1))
    assert x.argmax().item() == a.argmax()
    with pytest.raises(TypeError, match="dim or axis"):
        x.sum(dim=0, axis=1)
    with pytest.raises(IndexError, match="out of range"):
        x.sum(dim=3)


def test_size_is_a_method_like_pytorch():
    x = Tensor(np.zeros((2, 5, 3)))
    assert x.size() == (2, 5, 3) and x.size(1) == 5 and x.size(-1) == 3
    assert x.numel() == 30 and x.shape == (2, 5, 3)
    with pytest.raises(IndexError, match="dimension out of range"):
        x.size(3)


def test_max_along_dim_returns_values_and_indices_with_gradient_to_one_index():
    x = Tensor(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 2.0]]), requires_grad=True, dtype=np.float64)
    values, indices = x.max(dim=1)
    np.testing.assert_array_equal(values.numpy(), [3.0, 2.0])
    np.testing.assert_array_equal(indices.numpy(), [1, 0])
    assert indices.dtype == np.int64 and not indices.requires_grad
    values.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), [[0, 1, 0], [1, 0, 0]])  # not split between ties
    out = x.min(1, keepdim=True)
    assert out.values.shape == (2, 1) and out.indices.numpy().tolist() == [[0], [1]]
    x.grad = None
    x.max().backward()  # full reduction: ties share evenly (PyTorch's rule for max())
    np.testing.assert_array_equal(x.grad.numpy(), [[0, 0.5, 0.5], [0, 0, 0]])
    np.testing.assert_array_equal(ops.max(x, Tensor(np.full((2, 3), 2.5))).numpy(), [[2.5, 3, 3], [2.5, 2.5, 2.5]])


def test_shape_methods_take_dim():
    x = _t(2, 6)
    assert [p.shape for p in x.split(2, dim=1)] == [(2, 2)] * 3
    assert [p.shape for p in x.chunk(4, dim=1)] == [(2, 2)] * 3  # PyTorch: ceil(6/4) = 2 per chunk
    assert ops.cat([x, x], dim=1).shape == (2, 12) and ops.stack([x, x], dim=-1).shape == (2, 6, 2)
    assert x.view(3, 4).shape == (3, 4) and x.t().shape == (6, 2) and x.view_as(x.t()).shape == (6, 2)
    assert x.unsqueeze(0).squeeze(0).shape == (2, 6)


def test_full_and_arange_dtypes_follow_pytorch():
    assert axonmpi.full((2,), 3).dtype == np.int64
    assert axonmpi.full((2,), 3.0).dtype == np.float32
    assert axonmpi.full((2,), True).dtype == np.bool_
    assert axonmpi.full(3, 1.5).shape == (3,)
    assert axonmpi.arange(0.0, 3.0).dtype == np.float32
    assert axonmpi.arange(0, 3, 0.5).dtype == np.float32
    assert axonmpi.arange(4).dtype == np.int64 and axonmpi.arange(4).tolist() == [0, 1, 2, 3]


def test_embedding_accepts_a_list():
    emb = nn.Embedding(5, 3, dtype=np.float64)
    out = emb([[1, 4], [0, 1]])
    np.testing.assert_array_equal(out.numpy(), emb.weight.numpy()[[[1, 4], [0, 1]]])
    out.sum().backward()
    np.testing.assert_array_equal(emb.weight.grad.numpy()[:, 0], [1, 2, 0, 0, 1])
    with pytest.raises(IndexError, match="expected 0..4"):
        emb([5])


# -- issue 16: broken calls --------------------------------------------------------------------
def test_to_device_does_not_recurse():
    x = axonmpi.ones(2)
    if backend.cupy_available():
        assert x.to("cuda").device.type == "cuda"
    else:
        with pytest.warns(RuntimeWarning, match="no GPU: running on the CPU"):     # a GPU script on a CPU host
            assert x.to("cuda").device.type == "cpu"
    y = _t(3)
    z = ops.to_device(y, "cpu")  # a recorded move, even to the same device
    assert z.grad_fn is not None and y.cpu() is y
    (z * 2).sum().backward()
    np.testing.assert_array_equal(y.grad.numpy(), 2.0)


MATMUL_SHAPES = [((4,), (4,)), ((4,), (4, 3)), ((3, 4), (4,)), ((2, 3, 4), (4,)), ((4,), (2, 4, 3)),
                 ((2, 1, 3, 4), (5, 4, 2)), ((3, 4), (2, 4, 5)), ((2, 3, 4), (4, 5)), ((3, 4), (4, 2))]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES, ids=[f"{a}@{b}" for a, b in MATMUL_SHAPES])
def test_matmul_every_rank_combination_gradchecks(sa, sb):
    a, b = _t(*sa), _t(*sb)
    assert gradcheck(lambda x, y: x @ y, [a, b], atol=1e-7, rtol=1e-6)
    np.testing.assert_allclose((a @ b).numpy(), a.numpy() @ b.numpy(), rtol=1e-13)


def test_custom_backward_may_return_none_for_an_input_that_requires_grad():
    class Half(Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g, None

    x, y = _t(3), _t(3)
    Half.apply(x, y).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), 1.0)
    assert y.grad is None  # PyTorch leaves it None


_CONST = np.full(3, 10.0)


def test_arrays_returned_by_a_custom_backward_are_never_written():
    class Const(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            return _CONST

    x = _t(3)
    for _ in range(2):
        Const.apply(x).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), 20.0)
    np.testing.assert_array_equal(_CONST, 10.0)
    # the same array flowing into two paths of one backward
    y = _t(3)
    (Const.apply(y) + Const.apply(y)).sum().backward()
    np.testing.assert_array_equal(y.grad.numpy(), 20.0)
    np.testing.assert_array_equal(_CONST, 10.0)


def test_set_grad_enabled_as_a_call_a_block_and_a_decorator():
    x = _t(2)
    try:
        set_grad_enabled(False)
        assert not is_grad_enabled() and not (x * 2).requires_grad
        with set_grad_enabled(True):
            assert (x * 2).requires_grad
        assert not is_grad_enabled()
        set_grad_enabled(True)
        assert is_grad_enabled()

        @set_grad_enabled(False)
        def f(t):
            return t * 2

        assert is_grad_enabled()  # decorating does not switch the caller's mode
        assert not f(x).requires_grad and is_grad_enabled()
    finally:
        set_grad_enabled(True)


# -- operands on two devices (issue 16, GPU paths) ---------------------------------------------
class _FakeDeviceArray:
    """An object that backend.is_cupy_array() takes for a CuPy array (its type's module is cupy)."""

    __module__ = "cupy._core.core"

    def __init__(self, shape):
        self.shape = shape
        self.device = type("D", (), {"id": 0})()


def test_host_operands_are_moved_to_the_gpu_operand_device(monkeypatch):
    dev_arr = _FakeDeviceArray((2, 3))
    moved = []
    monkeypatch.setattr(backend, "to_device", lambda a, d: moved.append((a, str(d))) or dev_arr)
    mask = np.ones((2, 3), bool)
    out = _on_one_device((dev_arr, mask, 1.0), (True, False, False), ("x", "mask", "value"))
    assert out[0] is dev_arr and out[1] is dev_arr and out[2] == 1.0
    assert moved == [(mask, "cuda:0")]


def test_host_operand_that_needs_grad_is_rejected():
    dev_arr = _FakeDeviceArray((2, 3))
    with pytest.raises(ValueError, match="where: input is on cpu but the other operands are on cuda:0"):
        _on_one_device((np.ones((2, 3), bool), np.ones((2, 3)), dev_arr), (False, True, False),
                       ("where: condition", "where: input", "where: other"))
    assert _on_one_device((np.ones(2), np.ones(2)), (True, False), ("a", "b"))[1].shape == (2,)


GPU_CALLS = {
    "cross_entropy_host_targets": lambda x: F.cross_entropy(x, np.array([1, -100, 0])),
    "masked_fill_host_mask": lambda x: F.masked_fill(x, np.array([True, False, True, False]), -1.0),
    "where_host_condition": lambda x: ops.where(np.array([True, False, True, False]), x, 0.0),
    "embedding_host_list": lambda x: F.embedding([0, 2, 2], x),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CALLS))
def test_gpu_ops_accept_host_operands(name):
    if not backend.cupy_available():
        pytest.skip("CuPy with a CUDA device is not available")
    host = Tensor(RNG.standard_normal((3, 4)), dtype=np.float64, requires_grad=True)
    dev = Tensor(host.data, dtype=np.float64, requires_grad=True, device="cuda")
    want = GPU_CALLS[name](host)
    got = GPU_CALLS[name](dev)
    assert got.device.type == "cuda"
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
    assert gradcheck(GPU_CALLS[name], [dev])


def test_backward_takes_pytorch_argument_names():
    x = _t(3)
    y = x * 2.0
    y.backward(gradient=Tensor(np.array([1.0, 2.0, 3.0])), retain_graph=True)
    np.testing.assert_array_equal(x.grad.numpy(), [2.0, 4.0, 6.0])
    with pytest.raises(NotImplementedError, match="create_graph"):
        y.backward(Tensor(np.ones(3)), create_graph=True)
    with pytest.raises(NotImplementedError, match="inputs"):
        y.backward(Tensor(np.ones(3)), inputs=[x])


def test_to_another_tensor_takes_its_dtype():
    x = _t(2)
    assert x.to(Tensor(np.zeros(1, np.float32))).dtype == np.float32
    assert x.to("cpu", np.float32).dtype == np.float32


def test_embedding_padding_idx_and_inplace_flags():
    emb = nn.Embedding(4, 3, padding_idx=-1, dtype=np.float64)
    assert emb.padding_idx == 3
    np.testing.assert_array_equal(emb.weight.numpy()[3], 0.0)
    out = emb([[3, 1], [1, 3]])
    out.sum().backward()
    np.testing.assert_array_equal(emb.weight.grad.numpy()[:, 0], [0, 2, 0, 0])
    assert gradcheck(lambda w: F.embedding([0, 2, 2], w, padding_idx=1), [_t(3, 2)])  # padding row unused
    with pytest.raises(ValueError, match="padding_idx=4"):
        nn.Embedding(4, 3, padding_idx=4)
    x = _t(2, 2)
    for layer in (nn.ReLU(inplace=True), nn.SiLU(inplace=True), nn.Dropout(0.1, inplace=True).eval()):
        assert layer(x).shape == (2, 2)
    np.testing.assert_array_equal(F.relu(x, inplace=True).numpy(), np.maximum(x.numpy(), 0))
    with pytest.raises(TypeError, match="inplace must be a bool"):
        nn.ReLU(inplace="yes")


def test_none_gradient_into_an_intermediate_node_stops_there():
    class Half(Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g, None

    x, y = _t(3), _t(3)
    z = y * 2.0  # an intermediate that requires grad but receives no gradient
    (Half.apply(x, z).sum() + x.sum()).backward()
    np.testing.assert_array_equal(x.grad.numpy(), 2.0)
    assert y.grad is None
    a, b = _t(4), _t(4)  # several outputs: one without a gradient gets zeros, as before
    parts = ops.split(a * b, 2)
    parts[0].sum().backward()
    np.testing.assert_array_equal(a.grad.numpy(), np.r_[b.numpy()[:2], 0, 0])
