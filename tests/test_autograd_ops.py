"""Every op's backward against central finite differences (float64), forwards against NumPy formulas."""
import math

import numpy as np
import pytest

from axonmpi import backend
from axonmpi.autograd import Tensor, gradcheck, ops
from axonmpi.autograd import ops_nn as F
from axonmpi.autograd.special import erf

RNG = np.random.default_rng(1234)


def _t(*shape, positive=False, rg=True, scale=1.0):
    a = RNG.standard_normal(shape) * scale
    if positive:
        a = np.abs(a) + 0.5
    return Tensor(a, requires_grad=rg, dtype=np.float64)


def _softmax(a, axis=-1):
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _erf_ref(a):
    return np.vectorize(math.erf)(a)


# (id, function of tensors, input factories, NumPy reference of the forward)
CASES = [
    ("add_bcast", lambda a, b: a + b, [lambda: _t(3, 1, 4), lambda: _t(5, 1)], lambda a, b: a + b),
    ("add_scalar_r", lambda a: 2.5 + a, [lambda: _t(3, 4)], lambda a: 2.5 + a),
    ("sub_bcast", lambda a, b: a - b, [lambda: _t(2, 3), lambda: _t(3)], lambda a, b: a - b),
    ("rsub", lambda a: 1.0 - a, [lambda: _t(4)], lambda a: 1.0 - a),
    ("mul_bcast_size1", lambda a, b: a * b, [lambda: _t(2, 1, 3), lambda: _t(1, 4, 1)], lambda a, b: a * b),
    ("div", lambda a, b: a / b, [lambda: _t(3, 4), lambda: _t(4, positive=True)], lambda a, b: a / b),
    ("rdiv", lambda a: 3.0 / a, [lambda: _t(5, positive=True)], lambda a: 3.0 / a),
    ("pow_scalar", lambda a: a ** 3, [lambda: _t(3, 2)], lambda a: a ** 3),
    ("pow_tensor", lambda a, b: a ** b, [lambda: _t(3, 2, positive=True), lambda: _t(2)], lambda a, b: a ** b),
    ("rpow", lambda a: 2.0 ** a, [lambda: _t(4)], lambda a: 2.0 ** a),
    ("neg", lambda a: -a, [lambda: _t(2, 3)], lambda a: -a),
    ("matmul_2d", lambda a, b: a @ b, [lambda: _t(3, 4), lambda: _t(4, 5)], lambda a, b: a @ b),
    ("matmul_batched_bcast", lambda a, b: a @ b, [lambda: _t(2, 1, 3, 4), lambda: _t(3, 4, 2)], lambda a, b: a @ b),
    ("matmul_vec_mat", lambda a, b: a @ b, [lambda: _t(4), lambda: _t(2, 4, 3)], lambda a, b: a @ b),
    ("matmul_mat_vec", lambda a, b: a @ b, [lambda: _t(2, 3, 4), lambda: _t(4)], lambda a, b: a @ b),
    ("sum_all", lambda a: a.sum(), [lambda: _t(3, 4)], lambda a: a.sum()),
    ("sum_axis_keep", lambda a: a.sum(axis=(0, 2), keepdims=True), [lambda: _t(2, 3, 4)],
     lambda a: a.sum(axis=(0, 2), keepdims=True)),
    ("mean_axis", lambda a: a.mean(axis=1), [lambda: _t(2, 3, 4)], lambda a: a.mean(axis=1)),
    ("mean_neg_axis", lambda a: a.mean(axis=-1, keepdims=True), [lambda: _t(3, 5)],
     lambda a: a.mean(axis=-1, keepdims=True)),
    ("max_axis", lambda a: a.max(dim=1).values, [lambda: _t(3, 5)], lambda a: a.max(axis=1)),
    ("min_keep", lambda a: a.amin(axis=0, keepdims=True), [lambda: _t(4, 3)], lambda a: a.min(axis=0, keepdims=True)),
    ("max_all", lambda a: a.max(), [lambda: _t(3, 3)], lambda a: a.max()),
    ("var_axis", lambda a: a.var(axis=1), [lambda: _t(3, 5)], lambda a: a.var(axis=1, ddof=1)),
    ("var_all_biased", lambda a: a.var(correction=0), [lambda: _t(3, 5)], lambda a: a.var()),
    ("reshape", lambda a: a.reshape(4, -1), [lambda: _t(2, 3, 2)], lambda a: a.reshape(4, -1)),
    ("transpose", lambda a: a.transpose(0, 2), [lambda: _t(2, 3, 4)], lambda a: a.swapaxes(0, 2)),
    ("permute", lambda a: a.permute(1, 2, 0), [lambda: _t(2, 3, 4)], lambda a: a.transpose(1, 2, 0)),
    ("T", lambda a: a.T, [lambda: _t(2, 3)], lambda a: a.T),
    ("unsqueeze_squeeze", lambda a: a.unsqueeze(1).squeeze(), [lambda: _t(3, 4)], lambda a: a),
    ("expand", lambda a: a.expand(2, 3, 4), [lambda: _t(3, 1)], lambda a: np.broadcast_to(a, (2, 3, 4))),
    ("slice_basic", lambda a: a[1:, ::2, None], [lambda: _t(3, 5)], lambda a: a[1:, ::2, None]),
    ("index_int_neg", lambda a: a[-1], [lambda: _t(3, 4)], lambda a: a[-1]),
    ("index_repeated", lambda a: a[np.array([0, 2, 0, 0])], [lambda: _t(3, 2)], lambda a: a[[0, 2, 0, 0]]),
    ("index_2d_repeated", lambda a: a[np.array([1, 1, 0]), np.array([2, 2, 0])], [lambda: _t(2, 3)],
     lambda a: a[[1, 1, 0], [2, 2, 0]]),
    ("index_bool", lambda a: a[a.data > 0], [lambda: _t(4, 3)], None),
    ("concat", lambda a, b: ops.concat([a, b, a], axis=1), [lambda: _t(2, 3), lambda: _t(2, 1)],
     lambda a, b: np.concatenate([a, b, a], axis=1)),
    ("stack", lambda a, b: ops.stack([a, b], axis=1), [lambda: _t(2, 3), lambda: _t(2, 3)],
     lambda a, b: np.stack([a, b], axis=1)),
    ("split_multi_output", lambda a: ops.split(a, [1, 3], axis=1), [lambda: _t(2, 4)], None),
    ("split_partial_use", lambda a: ops.split(a, 2, axis=0)[1] * 2, [lambda: _t(5, 2)], lambda a: a[2:4] * 2),
    ("chunk", lambda a: ops.chunk(a, 3, axis=-1), [lambda: _t(2, 7)], None),
    ("exp", lambda a: a.exp(), [lambda: _t(3, 4)], np.exp),
    ("log", lambda a: a.log(), [lambda: _t(3, 4, positive=True)], np.log),
    ("sqrt", lambda a: a.sqrt(), [lambda: _t(3, 4, positive=True)], np.sqrt),
    ("tanh", lambda a: a.tanh(), [lambda: _t(3, 4)], np.tanh),
    ("abs", lambda a: a.abs(), [lambda: _t(3, 4)], np.abs),
    ("relu", F.relu, [lambda: _t(4, 5)], lambda a: np.maximum(a, 0)),
    ("sigmoid", F.sigmoid, [lambda: _t(4, 5)], lambda a: 1 / (1 + np.exp(-a))),
    ("silu", F.silu, [lambda: _t(4, 5)], lambda a: a / (1 + np.exp(-a))),
    ("gelu_erf", F.gelu, [lambda: _t(4, 5, scale=2.0)], lambda a: 0.5 * a * (1 + _erf_ref(a / math.sqrt(2)))),
    ("gelu_tanh", lambda a: F.gelu(a, approximate="tanh"), [lambda: _t(4, 5)],
     lambda a: 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))),
    ("softmax", lambda a: F.softmax(a, axis=-1), [lambda: _t(3, 5)], _softmax),
    ("softmax_axis0", lambda a: F.softmax(a, axis=0), [lambda: _t(3, 5)], lambda a: _softmax(a, 0)),
    ("log_softmax", lambda a: F.log_softmax(a, axis=1), [lambda: _t(2, 4, 3)], lambda a: np.log(_softmax(a, 1))),
    ("layer_norm", lambda a, w, b: F.layer_norm(a, 6, w, b), [lambda: _t(2, 3, 6), lambda: _t(6), lambda: _t(6)],
     lambda a, w, b: (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5) * w + b),
    ("layer_norm_2d_noaffine", lambda a: F.layer_norm(a, (3, 4)), [lambda: _t(2, 3, 4)],
     lambda a: (a - a.mean((1, 2), keepdims=True)) / np.sqrt(a.var((1, 2), keepdims=True) + 1e-5)),
    ("linear", F.linear, [lambda: _t(5, 3), lambda: _t(4, 3), lambda: _t(4)], lambda x, w, b: x @ w.T + b),
    ("linear_3d_nobias", lambda x, w: F.linear(x, w), [lambda: _t(2, 5, 3), lambda: _t(4, 3)], lambda x, w: x @ w.T),
    ("embedding_repeated", lambda w: F.embedding(np.array([[1, 3, 1], [0, 1, 3]]), w), [lambda: _t(4, 3)],
     lambda w: w[[[1, 3, 1], [0, 1, 3]]]),
    ("masked_fill", lambda a: F.masked_fill(a, np.array([True, False, True]), -2.0), [lambda: _t(2, 3)],
     lambda a: np.where([True, False, True], -2.0, a)),
    ("where", lambda a, b: ops.where(np.array([[True], [False]]), a, b), [lambda: _t(2, 3), lambda: _t(3)],
     lambda a, b: np.where([[True], [False]], a, b)),
    ("mse_loss", F.mse_loss, [lambda: _t(3, 4), lambda: _t(3, 4)], lambda a, b: ((a - b) ** 2).mean()),
    ("mse_loss_sum_bcast", lambda a, b: F.mse_loss(a, b, reduction="sum"), [lambda: _t(3, 4), lambda: _t(4)],
     lambda a, b: ((a - b) ** 2).sum()),
    ("mse_loss_none", lambda a, b: F.mse_loss(a, b, reduction="none"), [lambda: _t(3, 4), lambda: _t(3, 4)],
     lambda a, b: (a - b) ** 2),
    ("chain_mixed", lambda a, b: ((a @ b).tanh() * a.sum(axis=1, keepdims=True)).mean(axis=0),
     [lambda: _t(3, 4), lambda: _t(4, 2)], lambda a, b: (np.tanh(a @ b) * a.sum(1, keepdims=True)).mean(0)),
    ("reuse_same_input", lambda a: a * a + a, [lambda: _t(3)], lambda a: a * a + a),
]

_TARGET = np.array([1, 4, 0, 2, 4, 3])
_TARGET_IGN = np.array([1, -100, 0, 2, -100, 3])


def _ce_ref(x, t, ignore=-100, reduction="mean"):
    x2, t2 = x.reshape(-1, x.shape[-1]), t.reshape(-1)
    lp = np.log(_softmax(x2))
    valid = t2 != ignore
    losses = np.where(valid, -lp[np.arange(len(t2)), np.where(valid, t2, 0)], 0.0)
    if reduction == "none":
        return losses.reshape(t.shape)
    return losses.sum() if reduction == "sum" else losses.sum() / valid.sum()


CASES += [
    ("cross_entropy", lambda a: F.cross_entropy(a, _TARGET), [lambda: _t(6, 5)], lambda a: _ce_ref(a, _TARGET)),
    ("cross_entropy_ignore", lambda a: F.cross_entropy(a, _TARGET_IGN), [lambda: _t(6, 5)],
     lambda a: _ce_ref(a, _TARGET_IGN)),
    ("cross_entropy_3d_sum", lambda a: F.cross_entropy(a, _TARGET_IGN.reshape(2, 3), reduction="sum"),
     [lambda: _t(2, 3, 5)], lambda a: _ce_ref(a, _TARGET_IGN.reshape(2, 3), reduction="sum")),
    ("cross_entropy_none", lambda a: F.cross_entropy(a, _TARGET_IGN, reduction="none"), [lambda: _t(6, 5)],
     lambda a: _ce_ref(a, _TARGET_IGN, reduction="none")),
]


@pytest.mark.parametrize("name,fn,makers,ref", CASES, ids=[c[0] for c in CASES])
def test_op_gradcheck(name, fn, makers, ref):
    inputs = [m() for m in makers]
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    if ref is not None:
        out = fn(*inputs)
        np.testing.assert_allclose(out.numpy(), ref(*[t.numpy() for t in inputs]), rtol=1e-10, atol=1e-12)


def test_gradcheck_detects_a_wrong_backward():
    from axonmpi.autograd import Function

    class BadSquare(Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            return g * ctx.saved_tensors[0]  # missing factor 2

    with pytest.raises(AssertionError, match="gradcheck failed"):
        gradcheck(lambda a: BadSquare.apply(a), [_t(3)])


def test_erf_accuracy_against_math_erf():
    x = np.concatenate([np.linspace(-7, 7, 20001), np.geomspace(1e-12, 1, 200)])
    ref = _erf_ref(x)
    err = np.abs(erf(x) - ref)
    assert err.max() < 1e-15
    small = x[(x > 0) & (x < 1e-3)]
    assert (np.abs(erf(small) - _erf_ref(small)) / _erf_ref(small)).max() < 1e-15
    assert np.abs(erf(x.astype(np.float32)) - ref).max() < 2e-7


def test_softmax_and_cross_entropy_stable_for_large_logits():
    x = Tensor(np.array([[1000.0, 0.0, -1000.0]]), requires_grad=True, dtype=np.float64)
    loss = F.cross_entropy(x, np.array([0]))
    loss.backward()
    assert np.isfinite(loss.item()) and abs(loss.item()) < 1e-12
    assert np.isfinite(x.grad.numpy()).all()
    assert np.allclose(F.softmax(x).numpy(), [[1, 0, 0]])


def test_dropout_train_eval_and_scaling():
    from axonmpi import random as R

    R.manual_seed(7)
    x = Tensor(np.ones((200, 100)), requires_grad=True, dtype=np.float64)
    y = F.dropout(x, 0.25, training=True)
    kept = y.numpy() != 0
    assert 0.70 < kept.mean() < 0.80
    np.testing.assert_allclose(y.numpy()[kept], 1 / 0.75)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), y.numpy())
    assert F.dropout(x, 0.25, training=False) is x
    R.manual_seed(7)
    np.testing.assert_array_equal(F.dropout(x, 0.25).numpy(), y.numpy())


def test_float32_ops_keep_dtype():
    x = Tensor(np.random.rand(3, 4).astype(np.float32), requires_grad=True)
    w = Tensor(np.random.rand(2, 4).astype(np.float32), requires_grad=True)
    out = F.gelu(F.layer_norm(F.linear(x, w) * 2.0 + 1.0, 2)).sum()
    assert out.dtype == np.float32
    out.backward()
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32


GPU_CASES = [c for c in CASES if c[0] in (
    "add_bcast", "matmul_batched_bcast", "sum_axis_keep", "index_repeated", "softmax", "layer_norm",
    "linear_3d_nobias", "gelu_erf", "gelu_tanh", "cross_entropy_ignore", "concat", "split_multi_output")]


@pytest.mark.gpu
@pytest.mark.parametrize("name,fn,makers,ref", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_op_gradcheck_cupy(name, fn, makers, ref):
    if not backend.cupy_available():
        pytest.skip("CuPy with a CUDA device is not available")
    inputs = [Tensor(m().data, requires_grad=True, device="cuda") for m in makers]
    assert all(t.device.type == "cuda" for t in inputs)
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
