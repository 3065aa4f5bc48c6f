"""nn.MoE in one process: a dense loop over experts as the reference, finite differences, losses, capacity."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor
from axonmpi.autograd import ops, ops_nn, ops_reduce
from axonmpi.autograd.gradcheck import gradcheck
from axonmpi.nn.moe import MoE, moe_losses, moe_stats


def _moe(**kw):
    axonmpi.manual_seed(kw.pop("seed", 0))
    opts = dict(num_experts=4, top_k=2, hidden=6, dtype=np.float64)
    opts.update(kw)
    return MoE(5, **opts)


def _x(shape=(3, 4, 5), seed=1):
    return Tensor(np.random.default_rng(seed).standard_normal(shape), requires_grad=True)


def _dense(m: MoE, x: Tensor, keep=None) -> Tensor:
    """Every expert on every token; a token's output is the gate-weighted sum over its top-k experts."""
    C = x.shape[-1]
    x2 = ops.reshape(x, -1, C)
    logits = ops_nn.linear(x2, m.router.weight)
    s = ops_nn.softmax(logits, -1) if m.gating == "softmax" else ops_nn.sigmoid(logits)
    top = np.argsort(-s.data, axis=1, kind="stable")[:, :m.top_k]
    mask = np.zeros(s.shape)
    for j in range(m.top_k):
        mask[np.arange(len(top)), top[:, j]] = 1.0 if keep is None else keep[:, j]
    sel = np.zeros(s.shape)
    sel[np.arange(len(top))[:, None], top] = 1.0
    g = s * Tensor(sel)
    if m.normalize:
        g = g / ops_reduce.sum(g, dim=-1, keepdim=True)
    g = g * Tensor(mask)
    out = None
    for e in range(m.num_experts):
        h = ops_nn.gelu(ops_nn.linear(x2, ops.getitem(m.experts.fc.weight, e), ops.getitem(m.experts.fc.bias, e)),
                        approximate="tanh")
        y = ops_nn.linear(h, ops.getitem(m.experts.proj.weight, e), ops.getitem(m.experts.proj.bias, e))
        y = y * ops.reshape(ops.getitem(g, (slice(None), e)), -1, 1)
        out = y if out is None else out + y
    return ops.reshape(out, *x.shape)


def _grads(m, x):
    return [x.grad.data.copy()] + [p.grad.data.copy() for p in m.parameters()]


@pytest.mark.parametrize("top_k,gating", [(1, "softmax"), (2, "softmax"), (2, "sigmoid"), (1, "sigmoid")])
def test_moe_matches_dense_loop_forward_and_backward(top_k, gating):
    m = _moe(top_k=top_k, gating=gating)
    x = _x()
    w = np.random.default_rng(7).standard_normal(x.shape)
    (m(x) * Tensor(w)).sum().backward()
    got_y, got_g = m(x).data, _grads(m, x)
    m.zero_grad()
    x.grad = None
    ref = _dense(m, x)
    (ref * Tensor(w)).sum().backward()
    np.testing.assert_allclose(got_y, ref.data, rtol=1e-12, atol=1e-14)
    for a, b in zip(got_g, _grads(m, x)):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("top_k,gating,cap", [(1, "softmax", None), (2, "softmax", None), (2, "sigmoid", None),
                                              (2, "softmax", 0.75)])
def test_moe_finite_differences(top_k, gating, cap):
    m = _moe(top_k=top_k, gating=gating, capacity_factor=cap)
    x = _x((2, 3, 5))
    params = list(m.parameters())

    def f(x, *ps):
        y, (aux, z) = m(x, return_losses=True)
        return y, aux, z
    assert gradcheck(f, [x, *params], eps=1e-6, atol=1e-7, rtol=1e-5)


def test_capacity_drops_the_switch_way_and_counts():
    m = _moe(top_k=2, capacity_factor=0.5)
    x = _x((4, 6, 5))
    y = m(x)
    N, E, k = 24, 4, 2
    cap = int(np.ceil(0.5 * N * k / E))
    s = ops_nn.softmax(ops_nn.linear(ops.reshape(x, -1, 5), m.router.weight), -1).data
    top = np.argsort(-s, axis=1, kind="stable")[:, :k]
    keep = np.zeros((N, k))
    used = np.zeros(E, int)
    for j in range(k):                 # first choices first, each in token order
        for t in range(N):
            e = top[t, j]
            if used[e] < cap:
                keep[t, j] = 1
                used[e] += 1
    assert m.dropped_tokens == N * k - int(keep.sum()) > 0
    np.testing.assert_array_equal(m.tokens_per_expert, used)
    assert m.tokens_per_expert.max() <= cap
    np.testing.assert_allclose(y.data, _dense(m, x, keep).data, rtol=1e-12, atol=1e-14)


def test_dropless_conserves_tokens_and_aux_loss_formula():
    m = _moe(top_k=2, num_experts=5)
    x = _x((3, 7, 5))
    y, (aux, z) = m(x, return_losses=True)
    N, E, k = 21, 5, 2
    assert m.dropped_tokens == 0 and int(m.tokens_per_expert.sum()) == N * k
    logits = np.asarray(x.data).reshape(N, 5) @ m.router.weight.data.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.argsort(-p, axis=1, kind="stable")[:, :k]
    f = np.bincount(top.reshape(-1), minlength=E) / (N * k)
    np.testing.assert_allclose(float(aux.data), E * np.sum(f * p.mean(0)), rtol=1e-13)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    np.testing.assert_allclose(float(z.data), np.mean(lse ** 2), rtol=1e-13)
    st = moe_stats(m)
    assert st["tokens_per_expert_mean"] == N * k / E and st["dropped_tokens"] == 0
    assert moe_losses(m)[0] is m.losses.aux_loss


def test_router_logits_at_least_float32():
    m = _moe(dtype=np.float16)
    x = Tensor(np.random.default_rng(0).standard_normal((6, 5)).astype(np.float16))
    logits, scores = m._route(x)
    assert logits.dtype == np.float32 and scores.dtype == np.float32
    assert m(x).dtype == np.float16
    m64 = _moe()
    assert m64._route(Tensor(np.zeros((2, 5))))[0].dtype == np.float64


def test_bad_options_raise():
    with pytest.raises(ValueError, match="top_k"):
        MoE(4, num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="gating"):
        MoE(4, num_experts=2, gating="relu")
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(4, num_experts=2, capacity_factor=0)
    with pytest.raises(ValueError, match="num_experts"):
        MoE(4, num_experts=0)


def test_planner_moe_options_and_cli(capsys):
    from axonmpi.cli import main
    from axonmpi.plan import moe_estimate, moe_options
    ep = moe_estimate(100, 16, 64, 8, 2, expert_parallel=4, itemsize=4)
    assert ep.bytes_forward == 2 * 0.75 * 200 * 16 * 4 and ep.count_bytes == 64
    assert ep.expert_params == 2 * (2 * 16 * 64 + 64 + 16)
    tp = moe_estimate(100, 16, 64, 8, 2, tensor_parallel=4, itemsize=4)
    assert tp.bytes_forward == 2 * 4 * 100 * 16 * 4
    assert moe_options(100, 16, 64, 8, 2, 4)[0].option == "expert_parallel"
    assert [o.option for o in moe_options(100, 16, 64, 6, 2, 4)] == ["tensor_parallel_experts"]   # 6 % 4
    with pytest.raises(ValueError, match="divide"):
        moe_estimate(100, 16, 64, 6, 2, expert_parallel=4)
    # in process: a child python under mpiexec's PMI environment would try the parent's PMI socket
    assert main(["plan", "--world", "4", "--layers", "2", "--width", "64", "--seq", "16", "--global-batch", "8",
                 "--top", "1", "--moe-experts", "4"]) in (0, None)
    out = capsys.readouterr().out
    assert "expert_parallel" in out and "tensor_parallel_experts" in out
