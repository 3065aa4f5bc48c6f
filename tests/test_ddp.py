"""DDP parity: N ranks with local batch B train exactly what one process trains on the global batch N*B."""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.data import TensorDataset
from axonmpi.data.distributed import DistributedSampler, create_dataloader
from axonmpi.optim import SGD, Adam
from axonmpi.parallel import DDP, DistributedDataParallel, GradSyncStrategy

B = 3          # local batch per rank (odd on purpose)
STEPS = 5


def _mlp(dtype=np.float64, extra=False):
    axonmpi.random.manual_seed(1234)
    m = nn.Sequential(nn.Linear(5, 7, dtype=dtype), nn.Tanh(), nn.Linear(7, 6, dtype=dtype), nn.ReLU(),
                      nn.Linear(6, 3, dtype=dtype))
    if extra:
        m.append(nn.Linear(3, 3, dtype=dtype))   # never used in forward below
    return m


def _data(n, dtype=np.float64, seed=7):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 5)).astype(dtype), rng.integers(0, 3, n)


def _forward_loss(model, x, y):
    return F.cross_entropy(model(Tensor(x)), Tensor(y))


def _serial_run(world, dtype, steps, opt_cls=Adam, **opt_kw):
    model = _mlp(dtype)
    opt = opt_cls(model.parameters(), **opt_kw)
    n = world.world_size
    X, Y = _data(n * B * steps, dtype)
    losses = []
    for s in range(steps):
        lo, hi = s * n * B, (s + 1) * n * B
        opt.zero_grad()
        loss = _forward_loss(model, X[lo:hi], Y[lo:hi])
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
    return model, losses


def _ddp_run(world, dtype, steps, opt_cls=Adam, accumulate=1, **ddp_kw):
    model = DDP(_mlp(dtype), **ddp_kw)
    opt = opt_cls(model.parameters(), lr=1e-2) if opt_cls is Adam else opt_cls(model.parameters(), lr=0.1, momentum=0.9)
    n, r = world.world_size, world.rank
    X, Y = _data(n * B * steps, dtype)
    losses = []
    for s in range(steps):
        lo = s * n * B + r * B
        x, y = X[lo:lo + B], Y[lo:lo + B]
        opt.zero_grad()
        total = 0.0
        parts = np.array_split(np.arange(B), accumulate)
        for k, idx in enumerate(parts):
            scale = len(idx) / B
            if k < accumulate - 1:
                with model.no_sync():
                    loss = F.cross_entropy(model(Tensor(x[idx])), Tensor(y[idx])) * scale
                    loss.backward()
            else:
                loss = F.cross_entropy(model(Tensor(x[idx])), Tensor(y[idx])) * scale
                loss.backward()
            total += float(loss.item())
        opt.step()
        losses.append(float(axonmpi.all_reduce_mean(np.array(total))))
    return model, losses


def _assert_params_equal(model, ref, rtol):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=rtol, atol=rtol * 1e-2, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("grad_sync", [GradSyncStrategy.OVERLAP, GradSyncStrategy.AFTER_BACKWARD])
@pytest.mark.parametrize("bucket_size_mb", [1e-4, 25.0])
def test_ddp_matches_serial_adam_float64(world, grad_sync, bucket_size_mb):
    ref, ref_losses = _serial_run(world, np.float64, STEPS, Adam, lr=1e-2)
    model, losses = _ddp_run(world, np.float64, STEPS, grad_sync=grad_sync, bucket_size_mb=bucket_size_mb)
    if bucket_size_mb < 1e-3:
        assert len(model.buckets) > 1
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    _assert_params_equal(model, ref, 1e-10)


@pytest.mark.mpi(min_size=2)
def test_ddp_matches_serial_float32_sgd_momentum(world):
    ref, ref_losses = _serial_run(world, np.float32, STEPS, SGD, lr=0.1, momentum=0.9)
    model, losses = _ddp_run(world, np.float32, STEPS, SGD)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_params_equal(model, ref, 1e-5)


@pytest.mark.mpi(min_size=2)
def test_ddp_no_sync_gradient_accumulation(world):
    ref, ref_losses = _serial_run(world, np.float64, 3, Adam, lr=1e-2)
    model, losses = _ddp_run(world, np.float64, 3, accumulate=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    _assert_params_equal(model, ref, 1e-10)


@pytest.mark.mpi(min_size=1)
def test_single_rank_group_ddp_is_the_serial_model(world):
    """Over a group of one rank DDP must be the identity: same gradients, no collective, any world size."""
    alone = world.split(world.rank, name="alone")
    x, y = _data(B, seed=50 + world.rank)
    ref = _mlp()
    F.cross_entropy(ref(Tensor(x)), Tensor(y)).backward()
    model = DDP(_mlp(), group=alone, record_events=True, find_unused_parameters=True)
    F.cross_entropy(model(Tensor(x)), Tensor(y)).backward()
    assert model.synchronizer.events == []
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        np.testing.assert_array_equal(p.grad.data, q.grad.data, err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_ddp_construction_syncs_parameters_from_rank0(world):
    axonmpi.random.manual_seed(100 + world.rank)          # different init on every rank
    m = nn.Linear(4, 3, dtype=np.float64)
    w0 = axonmpi.broadcast(m.weight.data.copy(), src=0)
    DDP(m)
    np.testing.assert_array_equal(m.weight.data, w0)


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2, dtype=np.float64)
        self.register_buffer("scale", Tensor(np.ones(2)))

    def forward(self, x):
        return self.lin(x) * Tensor(self.scale.data)


@pytest.mark.mpi(min_size=2)
def test_ddp_broadcasts_buffers_each_forward(world):
    m = DDP(_WithBuffer())
    m.module.scale.data[...] = world.rank + 5.0          # ranks drift apart
    m(Tensor(np.ones((1, 2))))
    np.testing.assert_array_equal(m.module.scale.data, 5.0)  # rank 0's value everywhere
    m2 = DDP(_WithBuffer(), broadcast_buffers=False)
    m2.module.scale.data[...] = world.rank + 5.0
    m2(Tensor(np.ones((1, 2))))
    np.testing.assert_array_equal(m2.module.scale.data, world.rank + 5.0)


@pytest.mark.mpi(min_size=2)
def test_ddp_parity_with_buffers(world):
    """A model whose forward reads a buffer: DDP (buffers broadcast each step) equals the serial run."""
    n, r = world.world_size, world.rank
    rng = np.random.default_rng(11)
    X, Y = rng.standard_normal((n * B * 3, 2)), rng.standard_normal((n * B * 3, 2))

    def build():
        axonmpi.random.manual_seed(21)
        m = _WithBuffer()
        m.scale.data[...] = [0.5, 2.0]
        return m

    ref = build()
    opt = Adam(ref.parameters(), lr=1e-2)
    for s in range(3):
        opt.zero_grad()
        F.mse_loss(ref(Tensor(X[s * n * B:(s + 1) * n * B])), Tensor(Y[s * n * B:(s + 1) * n * B])).backward()
        opt.step()
    model = DDP(build())
    if r:
        model.module.scale.data[...] = 99.0          # stale buffers on other ranks are overwritten
    opt = Adam(model.parameters(), lr=1e-2)
    for s in range(3):
        lo = s * n * B + r * B
        opt.zero_grad()
        F.mse_loss(model(Tensor(X[lo:lo + B])), Tensor(Y[lo:lo + B])).backward()
        opt.step()
    _assert_params_equal(model, ref, 1e-10)
    np.testing.assert_array_equal(model.module.scale.data, [0.5, 2.0])


@pytest.mark.mpi(min_size=2)
def test_overlap_launches_first_bucket_before_backward_ends(world):
    model = DDP(_mlp(), bucket_size_mb=1e-4, record_events=True)
    x, y = _data(B)
    F.cross_entropy(model(Tensor(x)), Tensor(y)).backward()
    ev = model.synchronizer.events
    first_launch = ev.index(("launch", 0))
    last_ready = max(i for i, e in enumerate(ev) if e[0] == "ready")
    assert first_launch < last_ready, ev
    # the first bucket holds the last layer, whose gradient backward produces first
    assert model.buckets[0].names[-1].startswith("4.")
    launches = [e[1] for e in ev if e[0] == "launch"]
    assert launches == list(range(len(model.buckets)))
    # AFTER_BACKWARD launches only once every gradient is in
    m2 = DDP(_mlp(), bucket_size_mb=1e-4, record_events=True, grad_sync=GradSyncStrategy.AFTER_BACKWARD)
    F.cross_entropy(m2(Tensor(x)), Tensor(y)).backward()
    ev2 = m2.synchronizer.events
    assert ev2.index(("launch", 0)) > max(i for i, e in enumerate(ev2) if e[0] == "ready")


class _Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _mlp()
        self.unused = nn.Linear(3, 3, dtype=np.float64)

    def forward(self, x):
        h = x
        for i in range(5):
            h = self.body[i](h)
        return h


@pytest.mark.mpi(min_size=2)
def test_unused_parameter_is_a_clear_error(world):
    model = DDP(_Skip())
    x, y = _data(B)
    F.cross_entropy(model(Tensor(x)), Tensor(y)).backward()
    with pytest.raises(RuntimeError, match=r"did not: \['unused.weight', 'unused.bias'\].*find_unused_parameters=True"):
        model.sync_gradients()
    with pytest.raises(RuntimeError, match="previous backward"):
        model(Tensor(x))


@pytest.mark.mpi(min_size=2)
def test_find_unused_parameters_keeps_parity(world):
    ref, ref_losses = _serial_run(world, np.float64, 3, Adam, lr=1e-2)
    model = DDP(_Skip(), find_unused_parameters=True)
    opt = Adam(model.parameters(), lr=1e-2)
    n, r = world.world_size, world.rank
    X, Y = _data(n * B * 3)
    for s in range(3):
        lo = s * n * B + r * B
        opt.zero_grad()
        F.cross_entropy(model(Tensor(X[lo:lo + B])), Tensor(Y[lo:lo + B])).backward()
        assert model.module.unused.weight.grad is None
        opt.step()
    for (name, p), (_, q) in zip(model.module.body.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-10, err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_fp16_compression_hook_close_to_exact(world):
    x, y = _data(world.world_size * B, np.float32)
    lo = world.rank * B
    exact = DDP(_mlp(np.float32))
    comp = DDP(_mlp(np.float32), comm_hook="fp16")
    for m in (exact, comp):
        F.cross_entropy(m(Tensor(x[lo:lo + B])), Tensor(y[lo:lo + B])).backward()
    for (name, p), (_, q) in zip(exact.named_parameters(), comp.named_parameters()):
        assert q.grad.data.dtype == np.float32
        np.testing.assert_allclose(q.grad.data, p.grad.data, rtol=2e-3, atol=1e-4, err_msg=name)


@pytest.mark.mpi(min_size=1)
def test_ddp_bad_options(world):
    with pytest.raises(ValueError, match="unknown comm_hook"):
        DDP(_mlp(), comm_hook="int8")
    with pytest.raises(ValueError, match="unknown grad_sync"):
        DDP(_mlp(), grad_sync="sometimes")
    with pytest.raises(TypeError, match="wraps an axonmpi.nn.Module"):
        DistributedDataParallel(lambda x: x)
    with pytest.raises(ValueError, match="bucket_size_mb"):
        DDP(_mlp(), bucket_size_mb=0)


@pytest.mark.mpi(min_size=2)
def test_ddp_gpt_matches_serial(world):
    from axonmpi.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=13, block_size=6, n_layer=2, n_head=2, n_embd=8, dropout=0.0)
    n, r = world.world_size, world.rank
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 13, (n * 2 * 3, 6))
    tgt = rng.integers(0, 13, (n * 2 * 3, 6))

    def run(model, rows_of_step):
        opt = Adam(model.parameters(), lr=3e-3)
        losses = []
        for s in range(3):
            rows = rows_of_step(s)
            opt.zero_grad()
            _, loss = model(idx[rows], tgt[rows])
            loss.backward()
            opt.step()
            losses.append(float(axonmpi.all_reduce_mean(np.array(loss.item()))))
        return losses

    axonmpi.random.manual_seed(5)
    ref = GPT(cfg).double()
    ref_losses = [None] * 3
    opt = Adam(ref.parameters(), lr=3e-3)
    for s in range(3):
        opt.zero_grad()
        _, loss = ref(idx[s * n * 2:(s + 1) * n * 2], tgt[s * n * 2:(s + 1) * n * 2])
        loss.backward()
        opt.step()
        ref_losses[s] = float(loss.item())
    axonmpi.random.manual_seed(5)
    model = DDP(GPT(cfg).double())
    losses = run(model, lambda s: slice(s * n * 2 + r * 2, s * n * 2 + r * 2 + 2))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
    _assert_params_equal(model, ref, 1e-9)


# -- distributed loading ------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n_items,drop_last", [(23, True), (23, False), (24, True)])
def test_distributed_sampler_partitions_the_epoch(world, n_items, drop_last):
    n, r = world.world_size, world.rank
    ds = list(range(n_items))
    s = DistributedSampler(ds, shuffle=True, seed=3, drop_last=drop_last)
    s.set_epoch(2)
    mine = list(s)
    everyone = axonmpi.all_gather_object(mine)
    assert all(len(e) == len(mine) for e in everyone)
    flat = [i for e in everyone for i in e]
    perm = np.random.default_rng((3, 2)).permutation(n_items).tolist()
    if drop_last:
        assert sorted(flat) == sorted(perm[: len(flat)]) and len(set(flat)) == len(flat)
        assert len(flat) == n_items // n * n
    else:
        assert set(flat) == set(range(n_items))
    # local position j of every rank together = global positions [j*n, (j+1)*n) of the epoch order
    for j in range(len(mine)):
        assert sorted(e[j] for e in everyone) == sorted((perm + perm)[j * n:(j + 1) * n])
    s.set_epoch(3)
    assert list(s) != mine or n_items // n <= 1


@pytest.mark.mpi(min_size=1)
def test_create_dataloader_global_batch(world):
    n, r = world.world_size, world.rank
    X = np.arange(40 * n, dtype=np.float64).reshape(20 * n, 2)
    loader = create_dataloader(TensorDataset(X, np.arange(20 * n)), global_batch_size=4 * n, seed=1)
    loader.set_epoch(0)
    seen = []
    for xb, yb in loader:
        assert xb.shape == (4, 2)
        np.testing.assert_array_equal(xb, X[yb])
        glob = axonmpi.all_gather(yb)
        seen.extend(glob.tolist())
    assert sorted(seen) == list(range(20 * n))
    if n > 1:
        with pytest.raises(ValueError, match=f"global_batch_size={4 * n + 1} does not divide"):
            create_dataloader(TensorDataset(X), global_batch_size=4 * n + 1)


@pytest.mark.mpi(min_size=1)
def test_sampler_resume_state_on_other_replica_count(world):
    ds = list(range(30))
    s = DistributedSampler(ds, num_replicas=2, rank=0, seed=9)
    s.set_epoch(1)
    s.advance(4)
    st = s.state_dict()
    assert st == {"epoch": 1, "seed": 9, "consumed_global": 8}
    t = DistributedSampler(ds, num_replicas=4, rank=1, seed=0)
    t.load_state_dict(st)
    assert t.epoch == 1 and t.seed == 9 and len(t) == t.num_samples - 2
    assert list(t) == t.indices()[2:].tolist()


# -- issue 16: one collective order on every rank, second backward, no dropped requests ---------------
class _Branches(nn.Module):
    """A trunk and two one-output heads; ``use`` says which heads this forward runs.

    Registered last, the heads land in the first buckets (reverse registration order), so a
    rank that skips a head would be the first to want its bucket reduced.
    """

    def __init__(self):
        super().__init__()
        axonmpi.random.manual_seed(77)
        self.trunk = nn.Linear(5, 4, dtype=np.float64)
        self.never = nn.Linear(4, 1, dtype=np.float64)     # unused on every rank
        self.a = nn.Linear(4, 1, dtype=np.float64)
        self.b = nn.Linear(4, 1, dtype=np.float64)
        self.use = ("a", "b")

    def forward(self, x):
        h = self.trunk(x).tanh()
        out = h.sum() * 0.1
        for name in self.use:
            out = out + getattr(self, name)(h).sum()
        return out


def _heads_of(rank):
    """Rank 0 skips b, rank 1 skips a, rank 2 skips b, rank 3 runs both."""
    return {0: ("a",), 1: ("b",), 2: ("a",), 3: ("a", "b")}[rank % 4]


def _closed_form_grads(x, use, n):
    """The averaged gradient from a plain model on every rank: sum of local grads / n."""
    ref = _Branches()
    ref.use = use
    loss = ref(Tensor(x))
    loss.backward()
    grads = {}
    for name, p in ref.named_parameters():
        g = p.grad.data if p.grad is not None else np.zeros_like(p.data)
        grads[name] = axonmpi.all_reduce(g) / n
    return grads, float(loss.item())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("between", ["async", "blocking"])
@pytest.mark.parametrize("grad_sync", [GradSyncStrategy.OVERLAP, GradSyncStrategy.AFTER_BACKWARD])
def test_find_unused_same_collective_order_on_every_rank(world, between, grad_sync):
    n, r = world.world_size, world.rank
    rng = np.random.default_rng(100 + r)
    model = DDP(_Branches(), find_unused_parameters=True, bucket_size_mb=1e-6, grad_sync=grad_sync)
    assert [bk.names for bk in model.buckets[:4]] == [["b.bias"], ["b.weight"], ["a.bias"], ["a.weight"]]
    for step in range(2):
        x = rng.standard_normal((3, 5))
        use = _heads_of(r) if step == 0 else _heads_of(r + 1)
        model.module.use = use
        model.zero_grad()
        loss = model(Tensor(x))
        lv = np.array([loss.item()])
        if between == "async":                       # the user's collective between forward and backward
            w = axonmpi.all_reduce(lv, async_op=True)
            loss.backward()
            total = w.wait()
        else:
            total = axonmpi.all_reduce(lv)
            loss.backward()
        expected, local = _closed_form_grads(x, use, n)
        np.testing.assert_allclose(total, axonmpi.all_reduce(np.array([local])), rtol=1e-12)
        for name, p in model.named_parameters():
            if name.startswith("never."):
                assert p.grad is None, name
                continue
            np.testing.assert_allclose(p.grad.data, expected[name], rtol=1e-12, atol=1e-15, err_msg=name)
            everyone = axonmpi.all_gather(p.grad.data[None])
            np.testing.assert_array_equal(everyone, np.broadcast_to(p.grad.data, everyone.shape), err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_find_unused_launches_nothing_in_forward(world):
    model = DDP(_Branches(), find_unused_parameters=True, bucket_size_mb=1e-6, record_events=True)
    model.module.use = _heads_of(world.rank)
    loss = model(Tensor(np.ones((2, 5))))
    assert not any(e[0] == "launch" for e in model.synchronizer.events)
    assert all(bk.work is None for bk in model.buckets)
    loss.backward()
    launches = [e[1] for e in model.synchronizer.events if e[0] == "launch"]
    assert launches == list(range(len(model.buckets)))


@pytest.mark.mpi(min_size=2)
def test_find_unused_keeps_no_sync_accumulated_gradient(world):
    """A head used only in the no_sync micro-batch on this rank still contributes its gradient."""
    n, r = world.world_size, world.rank
    x1, x2 = np.full((2, 5), 0.3 + r), np.full((2, 5), -0.2 * r)
    model = DDP(_Branches(), find_unused_parameters=True, bucket_size_mb=1e-6)
    with model.no_sync():
        model.module.use = ("a", "b")
        model(Tensor(x1)).backward()
    model.module.use = ("a",) if r == 0 else ("a", "b")
    model(Tensor(x2)).backward()
    ref = _Branches()
    ref.use = ("a", "b")
    ref(Tensor(x1)).backward()
    ref.use = model.module.use
    ref(Tensor(x2)).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if name.startswith("never."):
            assert p.grad is None
            continue
        np.testing.assert_allclose(p.grad.data, axonmpi.all_reduce(q.grad.data) / n, rtol=1e-12, err_msg=name)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("find_unused", [False, True])
def test_second_backward_in_one_step_is_synchronised(world, find_unused):
    n, r = world.world_size, world.rank
    lin = nn.Linear(1, 1, bias=False, dtype=np.float64)
    lin.weight.data[...] = 1.0
    model = DDP(lin, find_unused_parameters=find_unused)
    x = np.array([[1.5 + 3.0 * r]])          # local grad of sum(w x) is x
    loss = model(Tensor(x)).sum()
    loss.backward(retain_graph=True)
    mean_x = np.mean([1.5 + 3.0 * k for k in range(n)])
    np.testing.assert_allclose(lin.weight.grad.data, [[mean_x]], rtol=1e-14)
    (loss * 2.0).backward()                     # another backward, no forward in between
    np.testing.assert_allclose(lin.weight.grad.data, [[3.0 * mean_x]], rtol=1e-14)
    # the next step is a normal step again
    lin.weight.grad = None
    model(Tensor(x)).sum().backward()
    np.testing.assert_allclose(lin.weight.grad.data, [[mean_x]], rtol=1e-14)


class _RaiseOnce(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _mlp()
        self.fail = False

    def forward(self, x):
        h = x
        for i in range(5):
            h = self.body[i](h)
            if i == 2 and self.fail:
                def boom(g):
                    raise FloatingPointError("injected in backward")
                h.register_hook(boom)
        return h


@pytest.mark.mpi(min_size=2)
def test_exception_mid_backward_completes_requests_and_next_step_is_right(world):
    n, r = world.world_size, world.rank
    model = DDP(_RaiseOnce(), bucket_size_mb=1e-6)
    x, y = _data(n * B)
    xl, yl = x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]
    model.module.fail = True
    with pytest.raises(FloatingPointError):
        F.cross_entropy(model(Tensor(xl)), Tensor(yl)).backward()
    started = [bk.work for bk in model.buckets if bk.work is not None]
    assert started                                # buckets of the last layers were already launched
    model.module.fail = False
    with pytest.raises(RuntimeError, match=r"previous backward.*completed on every rank and discarded"):
        model(Tensor(xl))
    assert all(w.is_completed() for w in started)
    assert all(p.grad is None for p in model.parameters())   # partly reduced gradients were dropped
    # the following step: an extra collective between forward and backward, and exact gradients
    loss = F.cross_entropy(model(Tensor(xl)), Tensor(yl))
    s = axonmpi.all_reduce(np.array([float(r)]), async_op=True)
    loss.backward()
    assert s.wait()[0] == n * (n - 1) / 2
    ref = _mlp()
    F.cross_entropy(ref(Tensor(x)), Tensor(y)).backward()
    for (name, p), (_, q) in zip(model.module.body.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.grad.data, q.grad.data, rtol=1e-10, err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_remove_hooks_waits_for_reductions_in_flight(world):
    model = DDP(_RaiseOnce(), bucket_size_mb=1e-6)
    x, y = _data(B)
    model.module.fail = True
    with pytest.raises(FloatingPointError):
        F.cross_entropy(model(Tensor(x)), Tensor(y)).backward()
    model.synchronizer.remove_hooks()
    assert all(bk.work is not None and bk.work.is_completed() for bk in model.buckets)
