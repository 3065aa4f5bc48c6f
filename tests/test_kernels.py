"""The kernel layer (axonmpi.kernels): NumPy, numba (where it imports) and a float64 reference agree, in float64
and float32; gradients match finite differences; odd shapes, non-contiguous inputs, dtypes kept; CuPy sources."""
import math
import os
import re

import numpy as np
import pytest

from axonmpi import kernels as K
from axonmpi.kernels import _cupy

PATHS = ["numpy"] + (["numba"] if K.numba_available() else [])


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv("AXONMPI_KERNELS", request.param)
    assert K.host_path() == request.param
    return request.param


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sig(x):
    return 0.5 * (1 + np.tanh(0.5 * x))


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


# name -> (forward(x), reference forward in float64, backward(x, y, g), reference derivative in float64)
UNARY = {
    "gelu": (lambda x: K.gelu_forward(x), lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
             lambda x, y, g: K.gelu_backward(x, g),
             lambda x: 0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)),
    "gelu_from_output": (lambda x: K.gelu_forward(x), lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
                         lambda x, y, g: K.gelu_backward(x, g, y=y),
                         lambda x: 0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)),
    "gelu_tanh": (lambda x: K.gelu_forward(x, "tanh"), _gelu_tanh, lambda x, y, g: K.gelu_backward(x, g, "tanh"),
                  None),
    "silu": (K.silu_forward, lambda x: x * _sig(x), lambda x, y, g: K.silu_backward(x, g),
             lambda x: _sig(x) * (1 + x * (1 - _sig(x)))),
    "relu": (K.relu_forward, lambda x: np.maximum(x, 0), lambda x, y, g: K.relu_backward(y, g),
             lambda x: (x > 0).astype(x.dtype)),
    "sigmoid": (K.sigmoid_forward, _sig, lambda x, y, g: K.sigmoid_backward(y, g), lambda x: _sig(x) * (1 - _sig(x))),
    "tanh": (K.tanh_forward, np.tanh, lambda x, y, g: K.tanh_backward(y, g), lambda x: 1 - np.tanh(x) ** 2),
    "exp": (K.exp_forward, np.exp, lambda x, y, g: K.exp_backward(y, g), np.exp),
}

TOL = {np.float64: 1e-12, np.float32: 3e-6}


def _data(shape, dtype, scale=3.0, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_forward_backward_against_float64_reference(path, name, dtype):
    fwd, ref, bwd, dref = UNARY[name]
    x = _data((37, 53), dtype)
    g = _data((37, 53), dtype, 1.0, seed=1)
    y = fwd(x)
    assert y.dtype == dtype and y.shape == x.shape
    x64 = x.astype(np.float64)
    tol = TOL[dtype]
    np.testing.assert_allclose(y, ref(x64), rtol=tol, atol=tol)
    gx = bwd(x, y, g)
    assert gx.dtype == dtype
    if dref is None:   # the derivative by central differences of the float64 reference
        h = 1e-6
        d = (ref(x64 + h) - ref(x64 - h)) / (2 * h)
        np.testing.assert_allclose(gx, g * d, rtol=max(tol, 1e-8), atol=max(tol, 1e-8))
    else:
        np.testing.assert_allclose(gx, g.astype(np.float64) * dref(x64), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_non_contiguous_and_odd_shapes(path, name):
    fwd, ref, bwd, _ = UNARY[name]
    base = _data((9, 14), np.float64)
    for x in (base[:, ::2], base.T, base[3], np.float64(0.7) * np.ones((1, 1, 3)), np.zeros((0, 5))):
        x = np.asarray(x)
        y = fwd(x)
        assert y.shape == x.shape
        np.testing.assert_allclose(y, ref(x), rtol=1e-12, atol=1e-12)
        g = np.ones_like(x)
        np.testing.assert_allclose(bwd(x, y, g), bwd(np.ascontiguousarray(x), y.copy(), g), rtol=1e-13, atol=0)


def test_numpy_and_numba_agree_in_float32(monkeypatch):
    if "numba" not in PATHS:
        pytest.skip("numba is not installed (pip install 'axonmpi[fast]')")
    x = _data((64, 129), np.float32)
    g = _data((64, 129), np.float32, 1.0, seed=3)
    outs = {}
    for p in PATHS:
        monkeypatch.setenv("AXONMPI_KERNELS", p)
        outs[p] = [(fwd(x), bwd(x, fwd(x), g)) for fwd, _, bwd, _ in UNARY.values()]
    for (a, ga), (b, gb) in zip(outs["numpy"], outs["numba"]):
        np.testing.assert_allclose(a, b, rtol=3e-6, atol=3e-6)
        np.testing.assert_allclose(ga, gb, rtol=3e-6, atol=3e-6)


def test_far_tails_and_nan(path):
    with np.errstate(over="ignore"):
        _far_tails_and_nan()


def _far_tails_and_nan():
    x = np.array([-1e4, -100.0, -50.0, 0.0, 50.0, 100.0, 1e4, np.nan], np.float32)
    assert K.gelu_forward(x, "tanh")[0] == 0 and K.silu_forward(x)[0] == 0
    assert K.sigmoid_forward(x)[0] == 0 and K.sigmoid_forward(x)[6] == 1
    assert K.exp_forward(x)[6] == np.inf and K.exp_forward(x)[0] == 0
    for f in (K.gelu_forward, K.silu_forward, K.sigmoid_forward, K.tanh_forward, K.exp_forward, K.relu_forward):
        assert np.isnan(f(x)[-1]), f
    g = np.full(x.shape, np.inf, np.float32)
    with np.errstate(invalid="ignore"):
        assert np.isinf(K.exp_backward(K.exp_forward(x[:7]), g[:7])[3])      # inf gradients propagate (GradScaler)


def test_swiglu(path):
    for dtype in (np.float64, np.float32):
        a, b, g = (_data((5, 33), dtype, seed=s) for s in range(3))
        y = K.swiglu_forward(a, b)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        tol = TOL[dtype]
        np.testing.assert_allclose(y, a64 * _sig(a64) * b64, rtol=tol, atol=tol)
        ga, gb = K.swiglu_backward(a, b, g)
        assert ga.dtype == gb.dtype == dtype
        np.testing.assert_allclose(gb, g * a64 * _sig(a64), rtol=tol, atol=tol)
        np.testing.assert_allclose(ga, g * b64 * _sig(a64) * (1 + a64 * (1 - _sig(a64))), rtol=tol, atol=tol)


def _softmax64(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softmax_log_softmax_cross_entropy(path, dtype):
    x = _data((7, 3, 29), dtype)[:, 1]          # non-contiguous rows
    g = _data((7, 29), dtype, 1.0, seed=2)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    tol = 10 * TOL[dtype]
    p = K.softmax_forward(x)
    np.testing.assert_allclose(p, _softmax64(x64), rtol=tol, atol=tol)
    np.testing.assert_allclose(K.softmax_backward(p, g), p * (g64 - (g64 * p).sum(-1, keepdims=True)), rtol=tol,
                               atol=tol)
    lp = K.log_softmax_forward(x)
    np.testing.assert_allclose(lp, np.log(_softmax64(x64)), rtol=tol, atol=tol)
    np.testing.assert_allclose(K.log_softmax_backward(lp, g), g64 - _softmax64(x64) * g64.sum(-1, keepdims=True),
                               rtol=tol, atol=tol)
    t = np.array([0, 28, 5, -100, 3, 3, 17])
    loss, wt, state = K.cross_entropy_forward(x, t, -100)
    keep = t != -100
    want = -np.log(_softmax64(x64))[np.arange(7), np.where(keep, t, 0)] * keep
    np.testing.assert_allclose(loss, want, rtol=tol, atol=tol)
    gx = K.cross_entropy_backward(state, np.asarray(0.5, dtype))
    onehot = np.zeros((7, 29))
    onehot[np.arange(7)[keep], t[keep]] = 1
    np.testing.assert_allclose(gx, 0.5 * (_softmax64(x64) - onehot) * keep[:, None], rtol=tol, atol=tol)
    assert p.dtype == lp.dtype == loss.dtype == gx.dtype == dtype


def _fd(f, x, h=1e-6):
    d = np.empty(x.size)
    for i in range(x.size):
        e = np.zeros(x.size)
        e[i] = h
        d[i] = (f(x + e.reshape(x.shape)) - f(x - e.reshape(x.shape))) / (2 * h)
    return d.reshape(x.shape)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norms_against_finite_differences(path, norm):
    rng = np.random.default_rng(4)
    x, w, b, g = rng.standard_normal((3, 7)), rng.standard_normal(7), rng.standard_normal(7), rng.standard_normal((3, 7))
    if norm == "layer":
        def f(x, w, b):
            return K.layer_norm_forward(x, w, b, 1e-5)
        y, st = f(x, w, b)
        gx, gw, gb = K.layer_norm_backward(g, st, True, True, True)
        np.testing.assert_allclose(gb, _fd(lambda b_: (f(x, w, b_)[0] * g).sum(), b), rtol=1e-7, atol=1e-8)
        xh = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + 1e-5)
        np.testing.assert_allclose(y, xh * w + b, rtol=1e-12, atol=1e-12)
    else:
        def f(x, w, b):
            return K.rms_norm_forward(x, w, 1e-6)
        y, st = f(x, w, b)
        gx, gw = K.rms_norm_backward(g, st, True, True)
        np.testing.assert_allclose(y, x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6) * w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gx, _fd(lambda x_: (f(x_, w, b)[0] * g).sum(), x), rtol=1e-7, atol=1e-8)
    np.testing.assert_allclose(gw, _fd(lambda w_: (f(x, w_, b)[0] * g).sum(), w), rtol=1e-7, atol=1e-8)
    x32 = x.astype(np.float32)
    y32 = (K.layer_norm_forward(x32, w.astype(np.float32), b.astype(np.float32), 1e-5) if norm == "layer"
           else K.rms_norm_forward(x32, w.astype(np.float32), 1e-6))[0]
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, y, rtol=1e-5, atol=1e-5)


def test_embedding_backward_repeated_indices(path):
    idx = np.array([[3, 1, 3], [0, 3, 9]])
    for dtype in (np.float64, np.float32):
        g = _data((2, 3, 4), dtype)
        want = np.zeros((10, 4))
        np.add.at(want, idx.reshape(-1), g.reshape(-1, 4).astype(np.float64))
        want[1] = 0
        got = K.embedding_backward(idx, g, 10, padding_idx=1)
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])


def test_erf_float32_accuracy():
    x = np.linspace(-7, 7, 200001).astype(np.float32)
    assert np.abs(K.erf_float32(x) - _erf(x.astype(np.float64))).max() < 1.2e-7


def test_host_path_env(monkeypatch):
    monkeypatch.setenv("AXONMPI_KERNELS", "numpy")
    assert K.host_path() == "numpy" and "NumPy" in K.describe()
    monkeypatch.setenv("AXONMPI_KERNELS", "cuda")
    with pytest.raises(ValueError, match="AXONMPI_KERNELS"):
        K.host_path()


def test_cupy_kernel_sources_are_well_formed():
    """Every CuPy kernel's parameters parse, its body names each of them, braces and parentheses balance."""
    assert len(_cupy.KERNELS) >= 12
    for name, k in _cupy.KERNELS.items():
        assert k.kind in ("elementwise", "reduction", "raw")
        params = k.params()
        assert params, name
        for typ, pname in params:
            assert re.fullmatch(r"(raw )?[A-Za-z_][A-Za-z0-9_]*", typ), (name, typ)
            assert re.search(rf"\b{pname}\b", k.body), (name, pname)
        for a, b in ("()", "{}"):
            assert k.body.count(a) == k.body.count(b), name
        assert k.body.strip().endswith(";"), name


@pytest.mark.gpu
def test_cupy_kernels_equal_the_numpy_reference(monkeypatch):
    from axonmpi.backend import get_cupy
    cp = get_cupy()
    if cp is None:
        pytest.skip("needs CuPy and a CUDA device")
    monkeypatch.setenv("AXONMPI_KERNELS", "numpy")
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 3e-6)):
        x = _data((33, 65), dtype)
        g = _data((33, 65), dtype, 1.0, seed=1)
        for name, (fwd, _, bwd, _) in UNARY.items():
            y = fwd(x)
            yd = fwd(cp.asarray(x))
            np.testing.assert_allclose(cp.asnumpy(yd), y, rtol=tol, atol=tol, err_msg=name)
            np.testing.assert_allclose(cp.asnumpy(bwd(cp.asarray(x), yd, cp.asarray(g))), bwd(x, y, g), rtol=tol,
                                       atol=tol, err_msg=name)
        p = K.softmax_forward(x)
        np.testing.assert_allclose(cp.asnumpy(K.softmax_backward(cp.asarray(p), cp.asarray(g))),
                                   K.softmax_backward(p, g), rtol=tol, atol=tol)
        lp = K.log_softmax_forward(x)
        np.testing.assert_allclose(cp.asnumpy(K.log_softmax_backward(cp.asarray(lp), cp.asarray(g))),
                                   K.log_softmax_backward(lp, g), rtol=tol, atol=tol)
        ga, gb = K.swiglu_backward(x, g, g)
        gad, gbd = K.swiglu_backward(cp.asarray(x), cp.asarray(g), cp.asarray(g))
        np.testing.assert_allclose(cp.asnumpy(gad), ga, rtol=tol, atol=tol)
        np.testing.assert_allclose(cp.asnumpy(gbd), gb, rtol=tol, atol=tol)


@pytest.mark.parametrize("tables", [(1, 6, 1, 8), (6, 1, 8), (8,), (2, 6, 3, 8)])
def test_rotary_against_the_plain_form(path, tables):
    rng = np.random.default_rng(5)
    for dtype in (np.float64, np.float32):
        x = rng.standard_normal((2, 6, 3, 8)).astype(dtype)
        c, s = (rng.standard_normal(tables).astype(dtype) for _ in range(2))
        h = 4
        rot = np.concatenate([-x[..., h:], x[..., :h]], -1)
        want = x * c + rot * s
        y = K.rotary_forward(x, c, s)
        assert y.dtype == dtype
        np.testing.assert_allclose(y, want, rtol=TOL[dtype], atol=TOL[dtype])
        g = rng.standard_normal(x.shape).astype(dtype)
        gx = K.rotary_backward(g, c, s)
        # <rotary(x), g> = <x, rotary^T(g)> for every x
        np.testing.assert_allclose((y * g).sum(), (x * gx).sum(), rtol=1e-5 if dtype == np.float32 else 1e-12)
        np.testing.assert_allclose(K.rotary_backward(g[:, :, :, :], c, s), gx, rtol=0, atol=0)
