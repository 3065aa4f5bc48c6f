"""Backward engine: hooks, post-accumulate order, in-place accumulation, graph freeing, Function API."""
import numpy as np
import pytest

from axonmpi.autograd import Function, Tensor, enable_grad, is_grad_enabled, no_grad
from axonmpi.autograd import ops_nn as F


def _leaf(*shape, dtype=np.float64):
    return Tensor(np.random.default_rng(0).standard_normal(shape), requires_grad=True, dtype=dtype)


def test_register_hook_replaces_gradient_on_leaf_and_intermediate():
    x = _leaf(3)
    seen = []
    x.register_hook(lambda g: seen.append(g.numpy()) or Tensor(g.data * 10))
    y = x * 2
    y.register_hook(lambda g: Tensor(g.data + 1))
    y.sum().backward()
    np.testing.assert_allclose(seen[0], [4.0, 4.0, 4.0])  # (1 + 1) * 2
    np.testing.assert_allclose(x.grad.numpy(), [40.0, 40.0, 40.0])


def test_hook_sees_summed_gradient_once_and_handle_removes():
    x = _leaf(2)
    calls = []
    h = x.register_hook(lambda g: calls.append(g.numpy().copy()))
    (x * 3 + x * 4).sum().backward()
    assert len(calls) == 1
    np.testing.assert_allclose(calls[0], [7.0, 7.0])
    h.remove()
    (x * 1).sum().backward()
    assert len(calls) == 1
    np.testing.assert_allclose(x.grad.numpy(), [8.0, 8.0])


def test_post_accumulate_hooks_fire_once_in_reverse_use_order():
    w1, w2, w3 = _leaf(4, 4), _leaf(4, 4), _leaf(4, 4)
    x = Tensor(np.ones((2, 4)))
    order = []
    grads_at_fire = {}
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        def hook(t, name=name):
            order.append(name)
            grads_at_fire[name] = t.grad.numpy().copy()
        w.register_post_accumulate_grad_hook(hook)
    h = F.relu(x @ w1)
    h = h @ w2 + h @ w1  # w1 used early and again in the middle
    loss = (h @ w3).sum()
    loss.backward()
    assert order == ["w3", "w2", "w1"]
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        np.testing.assert_array_equal(grads_at_fire[name], w.grad.numpy())  # final when fired


def test_post_accumulate_hook_fires_before_backward_ends():
    """A leaf used only late finishes before the early part of the graph runs."""
    w_late, w_early = _leaf(3, 3), _leaf(3, 3)
    events = []

    class Probe(Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            events.append("early-node")
            return g

    w_late.register_post_accumulate_grad_hook(lambda t: events.append("w_late"))
    x = Probe.apply(Tensor(np.ones((2, 3)), requires_grad=True) @ w_early)
    (x @ w_late).sum().backward()
    assert events.index("w_late") < events.index("early-node")


def test_accumulation_in_place_keeps_external_view():
    w = _leaf(2, 3)
    flat = np.zeros(10)
    w.grad = Tensor(flat[2:8].reshape(2, 3))
    (w * 2).sum().backward()
    (w * 3).sum().backward()
    np.testing.assert_allclose(flat[2:8], 5.0)
    assert np.shares_memory(w.grad.data, flat)
    assert flat[0] == 0 and flat[9] == 0


def test_fresh_grads_do_not_alias_each_other_or_the_seed():
    a, b = _leaf(3), _leaf(3)
    y = a + b  # Add.backward hands the same array to both inputs
    seed = np.ones(3)
    y.backward(seed)
    assert not np.shares_memory(a.grad.data, b.grad.data)
    assert not np.shares_memory(a.grad.data, seed)
    a.grad.data += 1
    np.testing.assert_allclose(b.grad.numpy(), 1.0)
    np.testing.assert_allclose(seed, 1.0)


def test_leaf_used_twice_accumulates():
    x = _leaf(3)
    (x * x * x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 3 * x.numpy() ** 2)


def test_graph_freed_unless_retain_graph():
    x = _leaf(3)
    y = (x.exp() * 2).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 4 * np.exp(x.numpy()))
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()


def test_no_grad_and_enable_grad():
    x = _leaf(2)
    with no_grad():
        assert not is_grad_enabled()
        y = x * 2
        with enable_grad():
            z = x * 2
    assert is_grad_enabled()
    assert not y.requires_grad and y.grad_fn is None
    assert z.requires_grad

    @no_grad()
    def f(t):
        return t * 2

    @no_grad
    def g(t):
        return t * 2

    assert not f(x).requires_grad and not g(x).requires_grad


def test_custom_function_multi_output_identity_and_needs_input_grad():
    class SplitHalves(Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.scale = scale
            ctx.flags = ctx.needs_input_grad
            return x, x * scale  # first output is the input array unchanged

        @staticmethod
        def backward(ctx, g_id, g_scaled):
            return g_id + g_scaled * ctx.scale, None

    x = _leaf(3)
    a, b = SplitHalves.apply(x, 5.0)
    assert a.data is x.data
    assert a.grad_fn is b.grad_fn
    (a.sum() + b.sum() * 2).backward()
    np.testing.assert_allclose(x.grad.numpy(), 11.0)
    # only one output used: the other's gradient arrives as zeros
    x.grad = None
    a, b = SplitHalves.apply(x, 5.0)
    b.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 5.0)


def test_function_backward_wrong_arity_is_reported():
    class Bad(Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(RuntimeError, match="expected 2"):
        Bad.apply(_leaf(2), _leaf(2)).sum().backward()


def test_tensor_api_basics():
    t = Tensor([[1.0, 2.0]])
    assert t.dtype == np.float32 and t.shape == (1, 2) and t.ndim == 2 and t.size() == (1, 2) and t.numel() == 2
    assert Tensor(np.arange(3)).dtype == np.int64
    assert t.device.type == "cpu" and t.is_leaf and not t.requires_grad
    x = _leaf(2)
    y = x * 2
    assert not y.is_leaf and y.detach().grad_fn is None
    assert y.detach().data is y.data
    n = x.numpy()
    n[0] = 123
    assert x.data[0] != 123
    assert Tensor(3.5).item() == 3.5
    with pytest.raises(RuntimeError):
        y.requires_grad = False
    with pytest.raises(TypeError):
        Tensor(np.arange(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar"):
        y.backward()
    np_first = np.ones(2) + x  # ndarray on the left defers to Tensor
    assert isinstance(np_first, Tensor) and np_first.requires_grad
    z = x.to(dtype="float32")
    z.sum().backward()
    assert x.grad.dtype == np.float64
    assert "requires_grad=True" in repr(x) and "grad_fn=<Mul>" in repr(y)
