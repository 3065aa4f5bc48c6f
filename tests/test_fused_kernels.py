"""The fast host kernels equal what they replace: fused attention = the unfused chain (and torch), GELU's
sigmoid form = its tanh form, LayerNorm's row form = its axis form, scatter-adds by sorted runs = ``add.at``."""
import math
import warnings

import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.autograd import ops_nn

RNG = np.random.default_rng(41)


def _leaf(*shape, dtype=np.float64, scale=1.0):
    return Tensor((RNG.standard_normal(shape) * scale).astype(dtype), requires_grad=True)


def _unfused(q, k, v, causal=False, mask=None, scale=None, dropout_p=0.0):
    s = F.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        L, S = s.shape[-2], s.shape[-1]
        s = F.masked_fill(s, np.triu(np.ones((L, S), dtype=bool), k=1), -np.inf)
    if mask is not None:
        s = F.masked_fill(s, ~mask, -np.inf) if mask.dtype == np.bool_ else s + Tensor(mask)
    return F.matmul(F.dropout(F.softmax(s, -1), dropout_p), v)


def _grads(fn, leaves, gout):
    for t in leaves:
        t.grad = None
    out = fn(*leaves)
    out.backward(Tensor(gout))
    return out.data, [t.grad.data for t in leaves]


@pytest.mark.parametrize("case", ["causal_blocks", "causal_short", "bool_mask", "float_mask", "rect_causal"])
def test_sdpa_equals_the_unfused_chain(case):
    B, H = 2, 3
    L, S = {"causal_blocks": (150, 150), "rect_causal": (140, 131)}.get(case, (9, 9))
    q, k, v = _leaf(B, H, L, 4), _leaf(B, H, S, 4), _leaf(B, H, S, 5)
    kw = {}
    if case.endswith("causal") or case.startswith("causal"):
        kw["causal"] = True
    if case == "bool_mask":
        kw["mask"] = RNG.random((L, S)) > 0.3
        kw["mask"][:, 0] = True                   # every row sees a key
    if case == "float_mask":
        kw["mask"] = RNG.standard_normal((B, 1, L, S))
    gout = RNG.standard_normal((B, H, L, 5))
    want, gwant = _grads(lambda a, b, c: _unfused(a, b, c, **kw), [q, k, v], gout)
    got, ggot = _grads(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=kw.get("mask"), is_causal=kw.get("causal", False)), [q, k, v], gout)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    for a, b in zip(ggot, gwant):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_sdpa_dropout_draws_as_dropout_on_the_probabilities():
    q, k, v = _leaf(2, 6, 3), _leaf(2, 6, 3), _leaf(2, 6, 2)
    gout = RNG.standard_normal((2, 6, 2))
    axonmpi.manual_seed(7)
    want, gwant = _grads(lambda a, b, c: _unfused(a, b, c, causal=True, dropout_p=0.25), [q, k, v], gout)
    axonmpi.manual_seed(7)
    got, ggot = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, dropout_p=0.25, is_causal=True),
                       [q, k, v], gout)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for a, b in zip(ggot, gwant):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_causal_self_attention_with_dropout_is_the_unfused_block():
    """nn.CausalSelfAttention calls the fused op; with dropout it draws what the old chain drew."""
    attn = nn.CausalSelfAttention(8, 2, dropout=0.3, dtype=np.float64)
    x = Tensor(RNG.standard_normal((2, 5, 8)))
    axonmpi.manual_seed(3)
    got = attn(x).data
    q, k, v = F.split(attn.qkv(x), 8, dim=2)
    q, k, v = (F.permute(F.reshape(a, 2, 5, 2, 4), 0, 2, 1, 3) for a in (q, k, v))
    axonmpi.manual_seed(3)
    y = _unfused(q, k, v, causal=True, dropout_p=0.3)
    want = attn.resid_dropout(attn.proj(F.reshape(F.permute(y, 0, 2, 1, 3), 2, 5, 8))).data
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_sdpa_refusals_name_the_fix():
    q = _leaf(1, 4, 2)
    with pytest.raises(NotImplementedError, match="repeat"):
        F.scaled_dot_product_attention(q, q, q, enable_gqa=True)
    with pytest.raises(ValueError, match="not both"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((4, 4), bool), is_causal=True)
    with pytest.raises(ValueError, match=r"\(..., L, E\)"):
        F.scaled_dot_product_attention(q, _leaf(1, 4, 3), q)


def test_sdpa_matches_torch_float32():
    torch = pytest.importorskip("torch")
    q, k, v = (RNG.standard_normal((2, 4, 200, 16)).astype(np.float32) for _ in range(3))
    g = RNG.standard_normal((2, 4, 200, 16)).astype(np.float32)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    to = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    to.backward(torch.tensor(g))
    aq, ak, av = (Tensor(a, requires_grad=True) for a in (q, k, v))
    ao = F.scaled_dot_product_attention(aq, ak, av, is_causal=True)
    ao.backward(Tensor(g))
    np.testing.assert_allclose(ao.data, to.detach().numpy(), rtol=1e-4, atol=1e-5)
    for a, t in ((aq, tq), (ak, tk), (av, tv)):
        np.testing.assert_allclose(a.grad.data, t.grad.numpy(), rtol=1e-3, atol=1e-4)


def _gelu_tanh_ref(x):
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    t = np.tanh(u)
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x * x)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-13), (np.float32, 2e-6)])
def test_gelu_tanh_sigmoid_form_equals_the_tanh_form(dtype, tol):
    x = np.concatenate([np.linspace(-12, 12, 2001), [-1e4, -50.0, 0.0, 50.0, 1e4]]).astype(dtype)
    t = Tensor(x, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # no overflow warning from exp far left of 0
        y = F.gelu(t, approximate="tanh")
        y.backward(Tensor(np.ones_like(x)))
    want, dwant = _gelu_tanh_ref(x.astype(np.float64))
    assert y.dtype == dtype and t.grad.dtype == dtype
    np.testing.assert_allclose(y.data, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(t.grad.data, dwant, rtol=tol, atol=tol)
    assert y.data[x == -1e4][0] == 0 and t.grad.data[x == -1e4][0] == 0


def test_gelu_tanh_float16_takes_the_plain_expression():
    x = np.linspace(-4, 4, 33).astype(np.float16)
    y = F.gelu(Tensor(x), approximate="tanh")
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.data.astype(np.float64), _gelu_tanh_ref(x.astype(np.float64))[0], atol=5e-3)


@pytest.mark.parametrize("shape,norm,affine", [((4, 6, 8), 8, True), ((3, 5, 4), (5, 4), True), ((7, 16), 16, False)])
def test_layer_norm_row_form_equals_the_axis_form(shape, norm, affine):
    nshape = (norm,) if isinstance(norm, int) else norm
    x = _leaf(*shape, scale=3.0)
    w, b = (_leaf(*nshape), _leaf(*nshape)) if affine else (None, None)
    leaves = [x] + ([w, b] if affine else [])
    g = RNG.standard_normal(shape)
    got, ggot = _grads(lambda *a: F.layer_norm(a[0], norm, *(a[1:] or (None, None))), leaves, g)
    axes = tuple(range(len(shape) - len(nshape), len(shape)))
    mu = x.data.mean(axis=axes, keepdims=True)
    var = ((x.data - mu) ** 2).mean(axis=axes, keepdims=True)
    want = (x.data - mu) / np.sqrt(var + 1e-5)
    if affine:
        want = want * w.data + b.data
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    x16 = Tensor(x.data.astype(np.float16))           # float16 runs the axis form
    out16 = F.layer_norm(x16, norm, *((Tensor(w.data.astype(np.float16)), Tensor(b.data.astype(np.float16)))
                                      if affine else (None, None)))
    assert out16.dtype == np.float16
    np.testing.assert_allclose(out16.data.astype(np.float64), want, atol=2e-2)
    # gradients against the closed form of d/dx sum(g * y)
    xh = (x.data - mu) / np.sqrt(var + 1e-5)
    gh = g * (w.data if affine else 1.0)
    m = int(np.prod(nshape))
    gx = (gh - gh.sum(axis=axes, keepdims=True) / m - xh * (gh * xh).sum(axis=axes, keepdims=True) / m) \
        / np.sqrt(var + 1e-5)
    np.testing.assert_allclose(ggot[0], gx, rtol=1e-10, atol=1e-11)
    if affine:
        lead = tuple(range(len(shape) - len(nshape)))
        np.testing.assert_allclose(ggot[1], (g * xh).sum(axis=lead), rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(ggot[2], g.sum(axis=lead), rtol=1e-11, atol=1e-12)


def test_scatter_adds_by_sorted_runs_equal_add_at():
    idx = RNG.integers(0, 7, 300)
    rows = RNG.standard_normal((300, 5))
    want = np.zeros((7, 5))
    np.add.at(want, idx, rows)
    got = np.zeros((7, 5))
    ops_nn._scatter_add_rows(np, got, idx, rows)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    w = _leaf(7, 5)                                   # embedding and getitem backward use it
    F.embedding(idx.reshape(20, 15), w).backward(Tensor(rows.reshape(20, 15, 5)))
    np.testing.assert_allclose(w.grad.data, want, rtol=1e-13, atol=1e-13)
    a = _leaf(7, 5)
    a[idx].backward(Tensor(rows))
    np.testing.assert_allclose(a.grad.data, want, rtol=1e-13, atol=1e-13)
    a.grad = None
    a[np.array([-1, 6, 0])].backward(Tensor(np.ones((3, 5))))   # negative rows: NumPy's add.at
    assert a.grad.data[6].tolist() == [2.0] * 5 and a.grad.data[0].tolist() == [1.0] * 5
