"""SGD, Adam and AdamW against their update equations written out in NumPy; state dicts; errors."""
import numpy as np
import pytest

from axonmpi.autograd import Tensor
from axonmpi.nn import Parameter
from axonmpi.optim import SGD, Adam, AdamW

STEPS = 4
SHAPES = [(3, 5), (7,), (300, 500)]  # the last spans several host update pieces


def _problem(seed=0, dtype=np.float64, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(STEPS)]
    return init, grads


def _run(opt_cls, init, grads, steps=None, **opts):
    params = [Parameter(a.copy()) for a in init]
    opt = opt_cls(params, **opts)
    for gs in grads[:steps]:
        for p, g in zip(params, gs):
            p.grad = Tensor(g.copy())
        opt.step()
    return params, opt


# ---------------------------------------------------------------- hand-written references

def ref_sgd(p, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
    buf = None
    for g in grads:
        g = -g if maximize else g
        g = g + weight_decay * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def ref_adam(p, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
             decoupled=False):
    b1, b2 = betas
    m = v = vmax = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = -g if maximize else g
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vmax = np.maximum(vmax, v)
        denom = np.sqrt(vmax if amsgrad else v) / np.sqrt(1 - b2 ** t) + eps
        p = p - lr / (1 - b1 ** t) * m / denom
    return p


def _check(params, init, grads, ref, **opts):
    for k, (p, a) in enumerate(zip(params, init)):
        want = ref(a, [gs[k] for gs in grads], **opts)
        assert p.data.dtype == a.dtype
        np.testing.assert_allclose(p.data, want, rtol=1e-12, atol=1e-14)
        assert not np.allclose(p.data, a)  # something happened


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.8, dampening=0.3),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.1, momentum=0.5, weight_decay=0.01, nesterov=True),
    dict(lr=0.1, weight_decay=0.1, maximize=True),
    dict(lr=0.02, momentum=0.7, dampening=0.1, weight_decay=0.05, maximize=True),
]


@pytest.mark.parametrize("opts", SGD_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_sgd_matches_equations(opts):
    init, grads = _problem(1)
    params, _ = _run(SGD, init, grads, **opts)
    _check(params, init, grads, ref_sgd, **opts)


ADAM_CASES = [
    dict(lr=1e-2),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=1e-2, amsgrad=True),
    dict(lr=1e-2, weight_decay=0.05, amsgrad=True, maximize=True),
]


@pytest.mark.parametrize("opts", ADAM_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_adam_matches_equations(opts):
    init, grads = _problem(2)
    params, opt = _run(Adam, init, grads, **opts)
    _check(params, init, grads, ref_adam, **opts)
    assert opt.state[params[0]]["step"] == STEPS


@pytest.mark.parametrize("opts", [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.3, amsgrad=True),
                                  dict(lr=1e-2, weight_decay=0.1, maximize=True, betas=(0.5, 0.9))],
                         ids=["default-wd", "wd-amsgrad", "maximize"])
def test_adamw_matches_equations(opts):
    init, grads = _problem(3)
    params, _ = _run(AdamW, init, grads, **opts)
    _check(params, init, grads, ref_adam, decoupled=True, **{"weight_decay": 1e-2, **opts})


def test_adamw_differs_from_adam_only_by_decay():
    init, grads = _problem(4)
    a, _ = _run(Adam, init, grads, lr=1e-2, weight_decay=0.0)
    w, _ = _run(AdamW, init, grads, lr=1e-2, weight_decay=0.0)
    for x, y in zip(a, w):
        np.testing.assert_array_equal(x.data, y.data)


def test_update_is_in_place_on_strided_and_viewed_parameters():
    rng = np.random.default_rng(5)
    base = rng.standard_normal((6, 4))
    start = base.T.copy()
    grad_buf = rng.standard_normal(24)
    p = Parameter(base.T)  # non-contiguous view: must be updated in place, not rebound
    p.grad = Tensor(grad_buf.reshape(6, 4).T)  # a view into a flat gradient buffer
    opt = Adam([p], lr=0.1, weight_decay=0.1)
    opt.step()
    opt.step()
    assert np.shares_memory(p.data, base)
    want = ref_adam(start, [grad_buf.reshape(6, 4).T] * 2, lr=0.1, weight_decay=0.1)
    np.testing.assert_allclose(base.T, want, rtol=1e-12)


def test_float16_parameters_keep_float32_state():
    init, grads = _problem(6, dtype=np.float16, shapes=[(40, 30)])
    params, opt = _run(Adam, init, grads, lr=1e-2)
    st = opt.state[params[0]]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == np.float32
    assert params[0].data.dtype == np.float16
    want = ref_adam(init[0].astype(np.float64), [g[0].astype(np.float64) for g in grads], lr=1e-2)
    np.testing.assert_allclose(params[0].data, want, rtol=2e-3, atol=1e-3)  # 4 float16 roundings
    sgd_params, sgd = _run(SGD, init, grads, lr=1e-2, momentum=0.9)
    assert sgd.state[sgd_params[0]]["momentum_buffer"].dtype == np.float32


def test_param_groups_with_different_lr():
    init, grads = _problem(7, shapes=[(4, 3), (5,)])
    a, b = Parameter(init[0].copy()), Parameter(init[1].copy())
    opt = SGD([{"params": [a]}, {"params": [b], "lr": 0.5, "momentum": 0.9}], lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    for gs in grads:
        a.grad, b.grad = Tensor(gs[0].copy()), Tensor(gs[1].copy())
        opt.step()
    np.testing.assert_allclose(a.data, ref_sgd(init[0], [g[0] for g in grads], lr=0.1), rtol=1e-12)
    want_b = ref_sgd(init[1], [g[1] for g in grads], lr=0.5, momentum=0.9)
    np.testing.assert_allclose(b.data, want_b, rtol=1e-12)


def test_add_param_group_and_missing_grads():
    init, grads = _problem(8, shapes=[(3,), (4,)])
    a, b = Parameter(init[0].copy()), Parameter(init[1].copy())
    opt = Adam([a], lr=1e-2)
    opt.add_param_group({"params": [b], "lr": 0.1})
    a.grad = Tensor(grads[0][0].copy())  # b has no grad: untouched, no state
    opt.step()
    np.testing.assert_array_equal(b.data, init[1])
    assert b not in opt.state and opt.state[a]["step"] == 1
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [a]})


@pytest.mark.parametrize("opt_cls,opts", [
    (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    (AdamW, dict(lr=1e-2, betas=(0.8, 0.95))),
])
def test_state_dict_round_trip_continues_identically(opt_cls, opts):
    init, grads = _problem(9)
    full, _ = _run(opt_cls, init, grads, **opts)
    half, opt = _run(opt_cls, init, grads, steps=2, **opts)
    sd = opt.state_dict()
    # PyTorch's layout, host arrays that are copies
    assert sorted(sd["state"]) == [0, 1, 2]
    assert sd["param_groups"][0]["params"] == [0, 1, 2] and sd["param_groups"][0]["lr"] == opts["lr"]
    for st in sd["state"].values():
        for k, v in st.items():
            if k != "step":
                assert isinstance(v, np.ndarray)
                live = [s for s in opt.state[half[0]].values() if hasattr(s, "shape")]
                assert not any(np.shares_memory(v, s) for s in live)
    params2 = [Parameter(p.data.copy()) for p in half]
    opt2 = opt_cls(params2, lr=123.0)  # options come back from the state dict
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == opts["lr"]
    for gs in grads[2:]:
        for p, g in zip(params2, gs):
            p.grad = Tensor(g.copy())
        opt2.step()
    for x, y in zip(full, params2):
        np.testing.assert_array_equal(x.data, y.data)


def test_load_state_dict_mismatch_raises():
    init, grads = _problem(10, shapes=[(3,), (4,)])
    _, opt = _run(Adam, init, grads, steps=1)
    other = Adam([Parameter(init[0].copy())])
    with pytest.raises(ValueError, match="2 parameters"):
        other.load_state_dict(opt.state_dict())
    swapped = Adam([Parameter(init[1].copy()), Parameter(init[0].copy())])
    with pytest.raises(ValueError, match="shape"):
        swapped.load_state_dict(opt.state_dict())


def test_zero_grad_modes():
    p = Parameter(np.ones(4))
    buf = np.arange(8.0)
    p.grad = Tensor(buf[2:6])  # a view into an external gradient buffer
    opt = SGD([p], lr=0.1)
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None and p.grad.data.base is buf
    np.testing.assert_array_equal(buf, [0, 1, 0, 0, 0, 0, 6, 7])
    opt.zero_grad()
    assert p.grad is None


def test_step_with_closure_returns_loss():
    p = Parameter(np.array([2.0]))
    opt = SGD([p], lr=0.25)

    def closure():
        p.grad = Tensor(2 * p.data)  # d/dp p^2
        return float(p.data[0] ** 2)

    assert opt.step(closure) == 4.0
    np.testing.assert_allclose(p.data, [1.0])


@pytest.mark.parametrize("make,exc,match", [
    (lambda ps: SGD(ps, lr=-0.1), ValueError, "-0.1"),
    (lambda ps: SGD(ps, lr=0.1, momentum=-1), ValueError, "momentum=-1"),
    (lambda ps: SGD(ps, lr=0.1, nesterov=True), ValueError, "nesterov"),
    (lambda ps: SGD(ps, lr=0.1, momentun=0.9), TypeError, "momentun"),
    (lambda ps: Adam(ps, betas=(1.0, 0.999)), ValueError, r"\(1.0, 0.999\)"),
    (lambda ps: Adam(ps, betas=(0.9, -0.1)), ValueError, "-0.1"),
    (lambda ps: Adam(ps, eps=-1e-8), ValueError, "eps=-1e-08"),
    (lambda ps: AdamW(ps, weight_decay=-0.1), ValueError, "weight_decay=-0.1"),
    (lambda ps: Adam([{"params": ps, "beta": 0.9}]), TypeError, "beta"),
    (lambda ps: Adam([{"params": ps, "lr": -3.0}]), ValueError, "-3.0"),
    (lambda ps: Adam([]), ValueError, "empty"),
    (lambda ps: Adam(ps[0]), TypeError, "list"),
    (lambda ps: Adam([np.zeros(3)]), TypeError, "ndarray"),
    (lambda ps: Adam([{"params": ps}, {"params": ps}]), ValueError, "more than one"),
])
def test_bad_options_raise_naming_the_value(make, exc, match):
    with pytest.raises(exc, match=match):
        make([Parameter(np.zeros(3))])
