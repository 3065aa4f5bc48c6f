"""GPU parity: autograd ops, optimizers, DDP, FSDP, tensor and pipeline parallel on CuPy against NumPy / serial.

Every check reuses the CPU suite's tables and helpers with the arrays on the GPU: each op of
``tests/test_gradcheck_all.py`` forward and backward on CuPy equals NumPy in float64; each
optimizer's updates (with clipping) equal the host's; DDP, FSDP, Megatron TP layers and every
pipeline schedule on CuPy train what the serial model trains on the host on the global batch.
Run with ``make test-gpu`` (1..number-of-GPUs ranks); skipped cleanly without CuPy and a GPU.
"""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not backend.cupy_available(), reason="needs CuPy and a CUDA GPU")]

RTOL = 1e-10


def _host(a):
    a = getattr(a, "data", a)
    return np.asarray(backend.to_host(a))


def _close(got, want, what, rtol=RTOL):
    """Equal to ``rtol`` relative to the reference's scale (elements near zero compare by the scale)."""
    got, want = _host(got), _host(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    if want.size == 0:
        return
    if want.dtype.kind not in "fc":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    err = np.max(np.abs(got - want))
    assert err <= rtol * max(np.max(np.abs(want)), 1e-300), f"{what}: max error {err}"


@pytest.fixture
def dev(world):
    return world.device if world.device.type == "cuda" else backend.Device("cuda", 0)


# -- autograd: every gradcheck case of the CPU suite, on CuPy vs NumPy --------------------------------
import test_gradcheck_all as GC  # noqa: E402

_RANDOM = ("dropout", "Dropout")   # masks come from the device's own generator: not NumPy's numbers


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op,cid,fn,makers,opts", GC.PARAMS, ids=[f"{p[0]}:{p[1]}" for p in GC.PARAMS])
def test_every_op_forward_and_backward_on_cupy_equals_numpy(op, cid, fn, makers, opts, dev):
    if any(k in op or k in cid for k in _RANDOM):
        pytest.skip("random masks differ by device (CuPy's generator)")
    host = [m() for m in makers]
    gpu = [Tensor(t.data.copy(), requires_grad=t.requires_grad, device=dev) for t in host]
    outs = []
    for inputs in (host, gpu):
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        rng = np.random.default_rng(5)
        total = None
        for o in out:   # a fixed random cotangent per output, built on the host and moved like the output
            w = Tensor(rng.standard_normal(o.shape), dtype=o.dtype, device=o.device)
            term = (o * w).sum() if o.dtype.kind == "f" else None
            if term is not None:
                total = term if total is None else total + term.to(total.device)
        if total is not None:
            total.backward()
        outs.append(out)
    for k, (a, b) in enumerate(zip(*outs)):
        _close(b, a, f"{cid}: output {k}")
        if b.dtype.kind == "f" and b.device.type != "cpu":
            assert backend.is_cupy_array(b.data), f"{cid}: output {k} left the GPU"
    for k, (h, g) in enumerate(zip(host, gpu)):
        if h.grad is not None:
            assert g.grad is not None, f"{cid}: no gradient for input {k} on the GPU"
            assert backend.is_cupy_array(g.grad.data), f"{cid}: gradient {k} is not on the GPU"
            _close(g.grad, h.grad, f"{cid}: d input {k}")


# -- optimizers --------------------------------------------------------------------------------------
def _optimizers():
    from axonmpi.optim import SGD, Adam, AdamW
    return [(SGD, dict(lr=0.1)), (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
            (Adam, dict(lr=1e-2)), (Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
            (AdamW, dict(lr=1e-2, weight_decay=0.1))]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("k", range(5))
def test_optimizers_with_clipping_on_cupy_equal_numpy(k, dev):
    from axonmpi.nn import Parameter
    from axonmpi.optim import clip_grad_norm_
    cls, kw = _optimizers()[k]
    rng = np.random.default_rng(k)
    shapes = [(3, 5), (7,), (300, 500)]
    init = [rng.standard_normal(s) for s in shapes]
    grads = [[rng.standard_normal(s) for s in shapes] for _ in range(5)]
    runs = []
    for device in ("cpu", dev):
        params = [Parameter(Tensor(a.copy(), dtype=np.float64, device=device)) for a in init]
        opt = cls(params, **kw)
        norms = []
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = Tensor(g.copy(), dtype=np.float64, device=device)
            norms.append(float(clip_grad_norm_(params, 1.0)))
            opt.step()
        runs.append((params, norms))
    (hp, hn), (gp, gn) = runs
    np.testing.assert_allclose(gn, hn, rtol=RTOL)
    for i, (a, b) in enumerate(zip(gp, hp)):
        assert backend.is_cupy_array(a.data), f"parameter {i} left the GPU"
        _close(a, b, f"{cls.__name__} {kw} parameter {i}")


# -- DDP ---------------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_ddp_adamw_clipping_on_cupy_matches_serial_host(world, dev):
    import test_ddp as T
    import axonmpi.nn.functional as F
    from axonmpi.optim import AdamW, clip_grad_norm_
    from axonmpi.parallel import DDP, GradSyncStrategy
    n, r, B, steps = world.world_size, world.rank, T.B, 5
    X, Y = T._data(n * B * steps)
    ref = T._mlp()
    ropt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for s in range(steps):
        lo, hi = s * n * B, (s + 1) * n * B
        ropt.zero_grad()
        loss = F.cross_entropy(ref(Tensor(X[lo:hi])), Tensor(Y[lo:hi]))
        loss.backward()
        clip_grad_norm_(ref.parameters(), 0.05)
        ropt.step()
        ref_losses.append(float(loss.item()))
    for gs in (GradSyncStrategy.OVERLAP, GradSyncStrategy.AFTER_BACKWARD):
        model = DDP(T._mlp().to(dev), grad_sync=gs, bucket_size_mb=1e-4)
        opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        for s in range(steps):
            a = s * n * B + r * B
            opt.zero_grad()
            loss = F.cross_entropy(model(Tensor(X[a:a + B], device=dev)), Tensor(Y[a:a + B], device=dev))
            loss.backward()
            clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            losses.append(float(axonmpi.all_reduce_mean(np.array(float(loss.item())))))
        np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, err_msg=str(gs))
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert backend.is_cupy_array(p.data), name
            _close(p, q, f"{gs} {name}")


# -- FSDP --------------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_fsdp_every_strategy_on_cupy_matches_serial_host(world, dev):
    import test_fsdp as TF
    from axonmpi.optim import AdamW, clip_grad_norm_
    from axonmpi.parallel import FSDP, ShardingStrategy
    X, Y = TF._data(world)
    r, LB = world.rank, TF.LB
    sl = slice(r * LB, (r + 1) * LB)
    for strategy, k in TF._strategies(world.world_size):
        kw = {} if k is None else {"hybrid_shard_size": k}
        ref = TF._make()
        ropt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        model = FSDP(TF._make().to(dev), sharding_strategy=strategy, **kw)
        opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(TF.STEPS):
            ropt.zero_grad()
            opt.zero_grad()
            want = TF._mse(ref(Tensor(X[s])), Y[s])
            want.backward()
            out = model(Tensor(X[s][sl], device=dev))
            got = ((out - Tensor(Y[s][sl], device=dev)) ** 2).mean()
            got.backward()
            gl = float(axonmpi.all_reduce(np.array(float(got.item())), axonmpi.ReduceOp.MEAN))
            assert TF._rel(gl, float(want.item())) <= RTOL, f"{strategy} step {s}: loss {gl} vs {float(want.item())}"
            n_ref = float(clip_grad_norm_(ref.parameters(), 0.05))
            n_got = float(model.clip_grad_norm_(0.05))
            assert TF._rel(n_got, n_ref) <= RTOL, f"{strategy} step {s}: grad norm {n_got} vs {n_ref}"
            ropt.step()
            opt.step()
        for p in model.parameters():
            assert backend.is_cupy_array(p.data), f"{strategy}: a flat parameter left the GPU"
        sd, rsd = model.state_dict(), ref.state_dict()
        assert list(sd) == list(rsd)
        for key in rsd:
            _close(sd[key], rsd[key], f"{strategy} {key}")


# -- tensor parallel ---------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_tensor_parallel_mlp_and_attention_on_cupy_match_serial_host(world, dev):
    import axonmpi.nn as nn
    from axonmpi.parallel.tensor import TensorParallelAttention, TensorParallelMLP, full_state_dict
    groups = [world.default_group] + ([world.split(world.rank // 2, name="tp-pairs")] if world.world_size == 4 else [])
    for g in groups:
        p = g.size
        axonmpi.random.manual_seed(11)
        ref_mlp = nn.MLP(4 * p, dtype="float64")
        ref_att = nn.CausalSelfAttention(4 * p, 2 * p, dtype="float64")
        mlp = TensorParallelMLP(4 * p, group=g, dtype="float64")
        att = TensorParallelAttention(4 * p, 2 * p, group=g, dtype="float64")
        mlp.load_state_dict(ref_mlp.state_dict(), strict=False)
        att.load_state_dict(ref_att.state_dict(), strict=False)
        mlp.to(dev), att.to(dev)
        X = np.random.default_rng(7).standard_normal((2, 5, 4 * p))
        G = np.random.default_rng(8).standard_normal((2, 5, 4 * p))
        for ref, tp in ((ref_mlp, mlp), (ref_att, att)):
            xs, xt = Tensor(X, requires_grad=True), Tensor(X.copy(), requires_grad=True, device=dev)
            ys, yt = ref(xs), tp(xt)
            assert backend.is_cupy_array(yt.data)
            _close(yt, ys, f"{type(tp).__name__} output", 1e-12)
            ys.backward(Tensor(G))
            yt.backward(Tensor(G.copy(), device=dev))
            _close(xt.grad, xs.grad, f"{type(tp).__name__} input grad", 1e-12)
            full_grads = full_state_dict(tp, grads=True)
            for k, v in ref.named_parameters():
                _close(full_grads[k], v.grad, f"{type(tp).__name__} grad {k}", 1e-12)


# -- pipeline parallel -------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind_name", ["GPIPE", "ONE_F_ONE_B", "INTERLEAVED_ONE_F_ONE_B"])
def test_pipeline_schedules_on_cupy_match_serial_host(world, dev, kind_name):
    import test_pipeline_parity as PP
    from axonmpi.parallel.pipeline import PipelineSchedule
    kind = getattr(PipelineSchedule, kind_name, None)
    if kind is None:
        pytest.skip(f"no schedule {kind_name}")
    cp = backend.get_cupy()
    p = world.world_size
    v = 2 if kind is PipelineSchedule.INTERLEAVED_ONE_F_ONE_B else 1
    m = 2 * p if v > 1 else 4
    ref, ref_losses = PP._serial(PP._mlp, PP._mlp_data, p, v, m, microbatched=False)
    def data(t):
        x, y = PP._mlp_data(t)
        return cp.asarray(x), cp.asarray(y)
    got, losses, names, _ = PP._pipelined(lambda: PP._mlp().to(dev), data, kind, v, m, world.default_group)
    np.testing.assert_allclose([float(x) for x in losses], ref_losses, rtol=RTOL)
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert names, f"rank {world.rank} holds no parameters"
    for n in names:       # trained on the device (state_dict() gives host copies, by design)
        assert backend.is_cupy_array(got.get_parameter(n).data), n
        _close(got_sd[n], ref_sd[n], f"{kind_name} {n}")
