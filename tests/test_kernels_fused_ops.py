"""The kernel layer's fused ops (issue 49): masked softmax, ring attention's online-softmax block, dropout and
residual add + dropout. NumPy and numba (where it imports) agree with a float64 reference and each other; backwards
against finite differences; torch parity where torch is installed."""
import math

import numpy as np
import pytest

import axonmpi
import axonmpi.nn.functional as F
from axonmpi import Tensor, kernels as K
from axonmpi.autograd import ops_nn
from axonmpi.autograd.gradcheck import gradcheck

PATHS = ["numpy"] + (["numba"] if K.numba_available() else [])
TOL = {np.float64: 1e-12, np.float32: 3e-6}


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setenv("AXONMPI_KERNELS", request.param)
    return request.param


def _ref_softmax(s, scale, ncols):
    s = s.astype(np.float64) * scale
    L, S = s.shape[-2:]
    s = np.where(np.arange(S)[None, :] < np.asarray(ncols)[:, None], s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_masked_softmax_against_reference(path, dtype):
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((2, 3, 7, 9)) * 3).astype(dtype)
    ncols = np.array([1, 2, 3, 9, 5, 6, 7])
    want = _ref_softmax(s, 0.3, ncols)
    p = K.masked_softmax_forward(s.copy(), 0.3, ncols)
    assert p.dtype == dtype
    np.testing.assert_allclose(p, want, rtol=TOL[dtype], atol=TOL[dtype])
    assert (p[..., 0, 1:] == 0).all()
    g = rng.standard_normal(s.shape).astype(dtype)
    gx = K.masked_softmax_backward(p, g.copy(), 0.3)
    w64 = want
    gw = 0.3 * w64 * (g - (g * w64).sum(-1, keepdims=True))
    np.testing.assert_allclose(gx, gw, rtol=10 * TOL[dtype], atol=10 * TOL[dtype])
    full = K.masked_softmax_forward(s.copy(), 1.0)           # no mask: the plain softmax
    np.testing.assert_allclose(full, K.softmax_forward(s), rtol=TOL[dtype], atol=TOL[dtype])


def test_masked_softmax_row_without_keys_is_nan(path):
    s = np.zeros((1, 2, 3))
    with np.errstate(invalid="ignore"):
        p = K.masked_softmax_forward(s, 1.0, np.array([0, 3]))
    assert np.isnan(p[0, 0]).all() and np.allclose(p[0, 1], 1 / 3)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_online_softmax_block_merges_to_the_whole_softmax(path, dtype):
    """Two key blocks merged by the online softmax = the softmax over all keys (ring attention's forward), and the
    probabilities again from the log-sum-exp with their gradient (its backward)."""
    rng = np.random.default_rng(1)
    R, T, S1, S2, D = 3, 6, 5, 4, 2
    s1, s2 = (rng.standard_normal((R, T, n)).astype(dtype) for n in (S1, S2))
    v1, v2 = (rng.standard_normal((R, n, D)).astype(dtype) for n in (S1, S2))
    n1, n2 = np.full(T, S1), np.array([0, 0, 1, 2, 3, 4])   # the second block: a causal prefix, rows 0-1 see none
    m = np.full((R, T), -np.inf, dtype)
    lsum = np.zeros((R, T), dtype)
    o = np.zeros((R, T, D), dtype)
    for s, v, n, q0 in ((s1, v1, n1, 0), (s2, v2, n2, 2)):
        e = s[:, q0:].copy()
        alpha = K.online_softmax_block(e, 0.5, n[q0:], m, lsum, q0)
        o[:, q0:] = o[:, q0:] * alpha[..., None] + e @ v
    out = o / lsum[..., None]
    both = np.concatenate([s1, s2], -1)
    ncols = np.concatenate([np.full((T, S1), True), np.arange(S2)[None, :] < n2[:, None]], -1)
    sc = np.where(ncols, both.astype(np.float64) * 0.5, -np.inf)
    pw = np.exp(sc - sc.max(-1, keepdims=True))
    pw /= pw.sum(-1, keepdims=True)
    tol = 10 * TOL[dtype]
    np.testing.assert_allclose(out, pw @ np.concatenate([v1, v2], 1), rtol=tol, atol=tol)
    lse = m + np.log(lsum)
    p2 = K.exp_minus_lse(s2[:, 2:].copy(), 0.5, n2[2:], lse, 2)
    np.testing.assert_allclose(p2, pw[:, 2:, S1:], rtol=tol, atol=tol)
    dp = rng.standard_normal(p2.shape).astype(dtype)
    delta = rng.standard_normal((R, T)).astype(dtype)
    got = K.lse_softmax_backward(p2, dp.copy(), delta, 2, 0.5)
    np.testing.assert_allclose(got, 0.5 * p2 * (dp - delta[:, 2:, None]), rtol=tol, atol=tol)


def test_numpy_and_numba_masked_softmax_agree_float32(monkeypatch):
    if not K.numba_available():
        pytest.skip("numba not installed")
    s = (np.random.default_rng(2).standard_normal((4, 33, 65)) * 4).astype(np.float32)
    n = np.minimum(np.arange(1, 34), 65)
    out = {}
    for p in PATHS:
        monkeypatch.setenv("AXONMPI_KERNELS", p)
        out[p] = K.masked_softmax_forward(s.copy(), 0.125, n)
    np.testing.assert_allclose(out["numba"], out["numpy"], rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("groups", [1, 3])
def test_grouped_causal_attention_equals_repeated_heads(path, groups):
    rng = np.random.default_rng(3)
    B, Hk, T, D = 2, 2, 5, 4
    q = Tensor(rng.standard_normal((B, Hk, groups * T, D)), requires_grad=True)
    k, v = (Tensor(rng.standard_normal((B, Hk, T, D)), requires_grad=True) for _ in range(2))
    y = ops_nn.grouped_causal_attention(q, k, v, groups)
    qh = q.data.reshape(B, Hk, groups, T, D)
    s = np.einsum("bhgtd,bhsd->bhgts", qh, k.data) / math.sqrt(D)
    s = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    want = np.einsum("bhgts,bhsd->bhgtd", pr, v.data).reshape(y.shape)
    np.testing.assert_allclose(y.data, want, rtol=1e-12, atol=1e-13)
    assert gradcheck(lambda a, b, c: ops_nn.grouped_causal_attention(a, b, c, groups), (q, k, v))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_dropout_kernel_equals_the_mask_product(path, dtype):
    rng = np.random.default_rng(4)
    x, res = (rng.standard_normal((37, 19)).astype(dtype) for _ in range(2))
    r = rng.random(x.shape, dtype=np.float32 if dtype == np.float32 else np.float64)
    mask = (r >= 0.3).astype(dtype)
    mask *= 1.0 / 0.7
    y, keep = K.dropout_forward(x, r, 0.3)
    assert y.dtype == dtype and keep.dtype == np.bool_
    np.testing.assert_array_equal(y, x * mask)                    # bitwise: the old Dropout's values
    ya, keep2 = K.dropout_forward(x, r, 0.3, residual=res)
    np.testing.assert_array_equal(ya, res + x * mask)
    np.testing.assert_array_equal(keep, keep2)
    g = rng.standard_normal(x.shape).astype(dtype)
    np.testing.assert_array_equal(K.dropout_backward(g, keep, 0.3), g * mask)


def test_dropout_add_is_residual_plus_dropout_and_gradchecks(path):
    rng = np.random.default_rng(5)
    x = Tensor(rng.standard_normal((4, 6)), requires_grad=True)
    res = Tensor(rng.standard_normal((4, 6)), requires_grad=True)
    axonmpi.manual_seed(11)
    y = F.dropout_add(x, res, 0.4)
    axonmpi.manual_seed(11)
    want = res.data + F.dropout(Tensor(x.data), 0.4).data
    np.testing.assert_array_equal(y.data, want)
    g = rng.standard_normal((4, 6))
    y.backward(Tensor(g))
    np.testing.assert_array_equal(res.grad.data, g)
    np.testing.assert_array_equal(x.grad.data, g * (want - res.data != 0) / 0.6)
    def f(a, b):
        axonmpi.manual_seed(12)
        return F.dropout_add(a, b, 0.4)
    assert gradcheck(f, (x, res))
    np.testing.assert_array_equal(F.dropout_add(x, res, 0.4, training=False).data, x.data + res.data)


def test_dropout_add_matches_torch_statistics():
    torch = pytest.importorskip("torch")
    x = np.ones((200, 500), np.float32)
    y = F.dropout_add(Tensor(x), Tensor(np.zeros_like(x)), 0.25).data
    ty = torch.nn.functional.dropout(torch.from_numpy(x), 0.25).numpy()
    # same rule as torch: kept elements scaled by 1 / (1 - p) (rounded in float32), the kept fraction near 1 - p
    assert set(np.unique(y)) <= {0.0, np.float32(1 / 0.75)} and set(np.unique(ty)) <= {0.0, np.float32(1 / 0.75)}
    assert abs((y != 0).mean() - 0.75) < 0.01 and abs((ty != 0).mean() - 0.75) < 0.01


# -- Adam / AdamW in one pass --------------------------------------------------------------------------------------
def _adam_reference(p, g, m, v, vm, lr, b1, b2, eps, wd, t, decoupled, maximize):
    """The optimizer's update before the kernel layer (in-place ufuncs), for bitwise parity."""
    xp = np
    s = np.empty_like(m)
    if decoupled and wd:
        p *= 1.0 - lr * wd
    gg = g
    if maximize or (wd and not decoupled):
        gg = -g if maximize else g.copy()
        if wd and not decoupled:
            gg += p * wd
    xp.multiply(gg, 1.0 - b1, out=s)
    m *= b1
    m += s
    xp.multiply(gg, gg, out=s)
    s *= 1.0 - b2
    v *= b2
    v += s
    if vm is not None:
        xp.maximum(vm, v, out=vm)
    xp.sqrt(v if vm is None else vm, out=s)
    s /= math.sqrt(1.0 - b2 ** t)
    s += eps
    xp.divide(m, s, out=s)
    s *= lr / (1.0 - b1 ** t)
    p -= s


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("opts", [dict(decoupled=True, maximize=False, ams=False),
                                  dict(decoupled=False, maximize=True, ams=True),
                                  dict(decoupled=True, maximize=False, ams=True)])
def test_adam_update_is_bitwise_the_ufunc_form(path, dtype, opts):
    rng = np.random.default_rng(7)
    n = 70000 + 13                                  # more than one NumPy piece
    p0 = rng.standard_normal(n).astype(dtype)
    p, pr = p0.copy(), p0.copy()
    m, v, mr, vr = (np.zeros(n, dtype) for _ in range(4))
    vm, vmr = (np.zeros(n, dtype), np.zeros(n, dtype)) if opts["ams"] else (None, None)
    for t in (1, 2, 3):
        g = rng.standard_normal(n).astype(dtype)
        c = K.adam_coefficients(1e-2, (0.9, 0.95), 1e-8, 0.1, t, opts["decoupled"])
        K.adam_update(p, g, m, v, c, maximize=opts["maximize"], vmax=vm)
        _adam_reference(pr, g, mr, vr, vmr, 1e-2, 0.9, 0.95, 1e-8, 0.1, t, opts["decoupled"], opts["maximize"])
    np.testing.assert_array_equal(p, pr)
    np.testing.assert_array_equal(m, mr)
    np.testing.assert_array_equal(v, vr)


@pytest.mark.parametrize("opts", [dict(decoupled=True, maximize=False, ams=False, low=False),
                                  dict(decoupled=False, maximize=True, ams=True, low=False),
                                  dict(decoupled=True, maximize=False, ams=True, low=True)])
def test_adam_update_multi_is_bitwise_one_update_per_parameter(path, opts):
    """One multi-tensor pass over a group equals one adam_update per parameter, bit for bit (arrays the fused loop
    does not take, a strided one and an empty one, go through adam_update in the same call)."""
    rng = np.random.default_rng(11)
    shapes = [(5, 7), (13,), (1,), (3, 4, 2), (0,), (6, 4)]
    ps = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ps[-1] = np.asfortranarray(ps[-1])                          # strided: the per-parameter form
    ref = [p.copy(order="K") for p in ps]
    st = [[np.zeros(p.shape, np.float32) for _ in range(3)] for p in ps]
    sr = [[np.zeros(p.shape, np.float32) for _ in range(3)] for p in ps]
    lows = [np.zeros(p.shape, np.float16) for p in ps] if opts["low"] else None
    lr_ = [np.zeros(p.shape, np.float16) for p in ps] if opts["low"] else [None] * len(ps)
    for t in (1, 2, 3):
        gs = [rng.standard_normal(p.shape).astype(np.float32) for p in ps]
        c = K.adam_coefficients(1e-2, (0.9, 0.95), 1e-8, 0.1, t, opts["decoupled"])
        K.adam_update_multi(ps, gs, [s[0] for s in st], [s[1] for s in st], c, maximize=opts["maximize"],
                            vmaxs=[s[2] for s in st] if opts["ams"] else None, lows=lows)
        for i, p in enumerate(ref):
            K.adam_update(p, gs[i], sr[i][0], sr[i][1], c, maximize=opts["maximize"],
                          vmax=sr[i][2] if opts["ams"] else None, low=lr_[i])
    for i in range(len(ps)):
        np.testing.assert_array_equal(ps[i], ref[i])
        np.testing.assert_array_equal(st[i][0], sr[i][0])
        np.testing.assert_array_equal(st[i][1], sr[i][1])
        if opts["low"]:
            np.testing.assert_array_equal(lows[i], lr_[i])
            np.testing.assert_array_equal(lows[i], ps[i].astype(np.float16))


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_adamw_writes_the_low_precision_copy_in_the_same_pass(path, low):
    from axonmpi.nn import Parameter
    from axonmpi.optim import AdamW
    if low == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        low = ml_dtypes.bfloat16
    rng = np.random.default_rng(8)
    w = Parameter(rng.standard_normal((5, 7)).astype(np.float32))
    w.low_precision_copy = np.zeros((5, 7), low)
    opt = AdamW([w], lr=0.1)
    w.grad = Tensor(rng.standard_normal((5, 7)).astype(np.float32))
    opt.step()
    np.testing.assert_array_equal(w.low_precision_copy.view(np.uint16), w.data.astype(low).view(np.uint16))
    # rounding of every float32 class: normals, ties, half subnormals, overflow, inf, NaN
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 4000),
                        np.array([65504, 65520, 1e6, -np.inf, np.inf, 6e-8, 3e-8, 1e-45, 0.0, -0.0])]).astype(np.float32)
    if K.host_path() == "numba":
        from axonmpi.kernels import _optim_nb
        conv = _optim_nb.f32_to_f16_bits if np.dtype(low) == np.float16 else _optim_nb.f32_to_bf16_bits
        got = np.array([conv(a) for a in x], np.uint16)
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(got, x.astype(low).view(np.uint16))
    w.low_precision_copy = np.zeros((3,), np.float16)
    with pytest.raises(ValueError, match="low_precision_copy"):
        opt.step()


def test_adamw_matches_torch():
    torch = pytest.importorskip("torch")
    from axonmpi.nn import Parameter
    from axonmpi.optim import AdamW
    rng = np.random.default_rng(9)
    w0 = rng.standard_normal((40, 30))
    w = Parameter(w0.copy())
    tw = torch.tensor(w0.copy(), requires_grad=True)
    opt = AdamW([w], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    topt = torch.optim.AdamW([tw], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(4):
        g = rng.standard_normal(w0.shape)
        w.grad = Tensor(g.copy())
        tw.grad = torch.tensor(g)
        opt.step()
        topt.step()
    np.testing.assert_allclose(w.data, tw.detach().numpy(), rtol=1e-12, atol=1e-14)


# -- gradient norm and clip without a host sync ----------------------------------------------------------------------
def _model(r, g, pair, dtype):
    from axonmpi.nn import Parameter
    def p(grad, group="unset"):
        q = Parameter(np.zeros(len(grad) if grad is not None else 1, dtype))
        if grad is not None:
            q.grad = Tensor(np.asarray(grad, dtype))
        if group != "unset":
            q.shard_group = group
        return q
    return [p([1.0, -2.5], None), p(np.full(r + 1, 2.0 * (r + 1) + 0.1), g), p([0.3 * (r + 1)]),
            p(None if r == 0 else [1.7], g), p(np.linspace(-1, 1, 7) * (r + 2), pair)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_clip_grad_norm_array_equals_clip_grad_norm(world, norm_type, dtype):
    """Sharded, replicated and gradient-less parameters over 1..4 ranks: the array form's norm and clipped
    gradients are the float form's, bit for bit (max_norm 0.5 clips; 1e9 does not)."""
    from axonmpi.optim import clip_grad_norm_, clip_grad_norm_array_, grad_norm, grad_norm_array
    g = world.default_group
    r = g.rank
    pair = world.split(r // 2, key=r)
    for max_norm in (0.5, 1e9):
        a, b = _model(r, g, pair, dtype), _model(r, g, pair, dtype)
        want = clip_grad_norm_(a, max_norm, norm_type, group=g)
        got = clip_grad_norm_array_(b, max_norm, norm_type, group=g)
        assert isinstance(got, np.ndarray) and got.shape == () and got.dtype == np.float64
        assert float(got) == pytest.approx(want, rel=1e-15)
        for pa, pb in zip(a, b):
            if pa.grad is None:
                assert pb.grad is None
            else:
                np.testing.assert_array_equal(pb.grad.data, pa.grad.data)
        assert float(grad_norm_array(b, norm_type, group=g)) == pytest.approx(grad_norm(a, norm_type, group=g),
                                                                               rel=1e-15)


def test_clip_grad_norm_array_nan_propagates():
    from axonmpi.nn import Parameter
    from axonmpi.optim import clip_grad_norm_array_
    w = Parameter(np.zeros(3))
    w.grad = Tensor(np.array([1.0, np.nan, 2.0]))
    for p in (2.0, math.inf):
        assert np.isnan(clip_grad_norm_array_([w], 1.0, p))
    assert np.isnan(w.grad.data).all()


@pytest.mark.gpu
def test_fused_ops_cupy_equal_the_numpy_reference(monkeypatch):
    from axonmpi.backend import get_cupy
    cp = get_cupy()
    if cp is None:
        pytest.skip("needs CuPy and a CUDA device")
    monkeypatch.setenv("AXONMPI_KERNELS", "numpy")
    rng = np.random.default_rng(10)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 3e-6)):
        s = rng.standard_normal((3, 9, 11)).astype(dtype)
        n = np.minimum(np.arange(1, 10), 11)
        p = K.masked_softmax_forward(s.copy(), 0.7, n)
        pd = K.masked_softmax_forward(cp.asarray(s), 0.7, cp.asarray(n))
        np.testing.assert_allclose(cp.asnumpy(pd), p, rtol=tol, atol=tol)
        g = rng.standard_normal(s.shape).astype(dtype)
        np.testing.assert_allclose(cp.asnumpy(K.masked_softmax_backward(pd, cp.asarray(g), 0.7)),
                                   K.masked_softmax_backward(p, g.copy(), 0.7), rtol=tol, atol=tol)
        x, res = (rng.standard_normal((33, 17)).astype(dtype) for _ in range(2))
        r = rng.random(x.shape, dtype=np.float32 if dtype == np.float32 else np.float64)
        y, keep = K.dropout_forward(x, r, 0.2, residual=res)
        yd, keepd = K.dropout_forward(cp.asarray(x), cp.asarray(r), 0.2, residual=cp.asarray(res))
        np.testing.assert_allclose(cp.asnumpy(yd), y, rtol=tol, atol=tol)
        np.testing.assert_array_equal(cp.asnumpy(keepd), keep)
        np.testing.assert_allclose(cp.asnumpy(K.dropout_backward(cp.asarray(x), keepd, 0.2)),
                                   K.dropout_backward(x, keep, 0.2), rtol=tol, atol=tol)
        p0, g0 = rng.standard_normal(1000).astype(dtype), rng.standard_normal(1000).astype(dtype)
        host = [p0.copy(), g0, np.zeros_like(p0), np.zeros_like(p0)]
        dev = [cp.asarray(a) for a in host]
        for t in (1, 2):
            K.adam_update(*host, K.adam_coefficients(1e-2, (0.9, 0.99), 1e-8, 0.1, t, True))
            K.adam_update(*dev, K.adam_coefficients(1e-2, (0.9, 0.99), 1e-8, 0.1, t, True, cp))
        np.testing.assert_allclose(cp.asnumpy(dev[0]), host[0], rtol=10 * tol, atol=10 * tol)
        total = K.grad_norm_partial([dev[1]], 2.0) ** 0.5
        K.clip_by_total_norm_([dev[1]], total, 0.5)
        np.testing.assert_allclose(float(cp.linalg.norm(dev[1])), 0.5, rtol=1e-5)


def test_transformer_block_fuses_residual_dropout_with_the_same_values(path):
    """TransformerBlock adds attn's and MLP's output dropout to the residual in one op (F.dropout_add): outputs and
    gradients equal the two-op form's bit for bit under the same seed (a forward hook on the sublayers forces that
    form), and the graph has one op fewer per residual."""
    from axonmpi.nn import TransformerBlock
    rng = np.random.default_rng(3)
    blk = TransformerBlock(16, 2, dropout=0.25, dtype=np.float64)
    x0 = rng.standard_normal((2, 5, 16))

    def run(hooked):
        hs = [m.register_forward_hook(lambda mod, a, out: None) for m in (blk.attn, blk.mlp)] if hooked else []
        axonmpi.manual_seed(5)
        x = Tensor(x0.copy(), requires_grad=True)
        y = blk(x)
        (y * Tensor(np.linspace(-1, 1, y.data.size).reshape(y.shape))).sum().backward()
        grads = [x.grad.data.copy()] + [p.grad.data.copy() for p in blk.parameters()]
        blk.zero_grad()
        for h in hs:
            h.remove()
        return y, grads
    (y1, g1), (y2, g2) = run(False), run(True)
    assert type(y1.grad_fn).__name__ == "DropoutAdd" and type(y2.grad_fn).__name__ != "DropoutAdd"
    np.testing.assert_array_equal(y1.data, y2.data)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a, b)
