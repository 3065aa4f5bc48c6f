"""FSDP parity with the serial model on the global batch (every strategy, 1-4 ranks, float64, AdamW +
clipping), no_sync accumulation, the GPT model, CPU offload modes, state dicts, measured memory and
overlap of prefetch / reduce-scatter with compute."""
import ctypes
import mmap

import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, nn
from axonmpi.models.gpt import GPT, GPTConfig
from axonmpi.parallel import FSDP, CPUOffload, ShardingStrategy
from axonmpi.parallel.fsdp import estimate_memory, find_units

STEPS = 6
LB = 3          # local batch per rank


class Net(nn.Module):
    """Units of 42, 24 and 8 elements (none divisible by 4 or 3... except by luck) plus a root parameter."""

    def __init__(self, dtype=np.float64):
        super().__init__()
        self.l1 = nn.Linear(5, 7, dtype=dtype)
        self.l2 = nn.Linear(7, 3, dtype=dtype)
        self.l3 = nn.Linear(3, 2, dtype=dtype)
        self.scale = nn.Parameter(np.array([1.5, 0.5], dtype))

    def forward(self, x):
        return self.l3(self.l2(self.l1(x).tanh()).tanh()) * self.scale


def _make(cls=Net, **kw):
    axonmpi.manual_seed(0)
    return cls(**kw)


def _data(world, steps=STEPS, d_in=5, d_out=2):
    rng = np.random.default_rng(1)
    n = LB * world.world_size
    return rng.standard_normal((steps, n, d_in)), rng.standard_normal((steps, n, d_out))


def _mse(out, y):
    return ((out - Tensor(y)) ** 2).mean()


def _assert_close(got, want, what):
    """Equal to 1e-10 relative to the array's scale (elements near zero compare by the scale)."""
    err = np.max(np.abs(got - want)) if want.size else 0.0
    assert err <= 1e-10 * max(np.max(np.abs(want)), 1e-300), f"{what}: max error {err}"


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-300)


def _check_parity(world, build, steps=STEPS, micro=1):
    """Train the serial model on the global batch and the FSDP model on this rank's share; compare."""
    X, Y = _data(world, steps * micro)
    ref = _make()
    ropt = axonmpi.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model = build(_make())
    opt = axonmpi.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    r = world.rank
    sl = slice(r * LB, (r + 1) * LB)
    for s in range(steps):
        ropt.zero_grad()
        opt.zero_grad()
        want = 0.0
        for m in range(micro):
            i = s * micro + m
            loss = _mse(ref(Tensor(X[i])), Y[i])
            loss.backward()
            want += float(loss.data)
        got = 0.0
        for m in range(micro):
            i = s * micro + m
            if m < micro - 1:
                with model.no_sync():
                    lf = _mse(model(Tensor(X[i][sl])), Y[i][sl])
                    lf.backward()
            else:
                lf = _mse(model(Tensor(X[i][sl])), Y[i][sl])
                lf.backward()
            got += float(axonmpi.all_reduce(np.array(float(lf.data)), axonmpi.ReduceOp.MEAN))
        assert _rel(got, want) <= 1e-10, f"rank {r} step {s}: loss {got} vs serial {want}"
        n_ref = float(axonmpi.optim.clip_grad_norm_(ref.parameters(), 0.05))
        n_got = float(model.clip_grad_norm_(0.05))
        assert _rel(n_got, n_ref) <= 1e-10, f"rank {r} step {s}: grad norm {n_got} vs serial {n_ref}"
        ropt.step()
        opt.step()
    sd, rsd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd)
    for k in rsd:
        _assert_close(sd[k], rsd[k], f"rank {r}: {k}")
    return model


def _strategies(size):
    out = [(s, None) for s in ShardingStrategy]
    if size == 2:
        out += [(ShardingStrategy.HYBRID_SHARD, 1), (ShardingStrategy.HYBRID_SHARD, 2)]
    if size == 4:
        out += [(ShardingStrategy.HYBRID_SHARD, 2)]
    return out


@pytest.mark.mpi(min_size=1)
def test_parity_every_strategy():
    world = axonmpi.init()
    for strategy, k in _strategies(world.world_size):
        kw = {} if k is None else {"hybrid_shard_size": k}
        model = _check_parity(world, lambda m: FSDP(m, sharding_strategy=strategy, **kw))
        flats = list(model.parameters())
        assert len(flats) == 4                        # root (scale) + l1 + l2 + l3
        if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            assert sum(f.data.size for f in flats) == sum(
                (hi - lo) for f in flats for lo, hi in [f.shard_range])
            total = axonmpi.all_reduce(np.array(sum(f.data.size for f in flats)))
            assert int(total) == 42 + 24 + 8 + 2     # the shards partition the model exactly


@pytest.mark.mpi(min_size=2)
def test_hybrid_explicit_groups():
    world = axonmpi.init()
    n = world.world_size
    if n % 2:
        pytest.skip("needs an even number of ranks")
    shard = world.split(world.rank // 2, name="shard")
    rep = world.split(world.rank % 2, name="rep")
    _check_parity(world, lambda m: FSDP(m, sharding_strategy=ShardingStrategy.HYBRID_SHARD, group=(shard, rep)))


@pytest.mark.mpi(min_size=1)
def test_no_sync_accumulation():
    world = axonmpi.init()
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        _check_parity(world, lambda m: FSDP(m, sharding_strategy=strategy), steps=3, micro=3)


@pytest.mark.mpi(min_size=1)
def test_cpu_offload_modes_same_numbers():
    world = axonmpi.init()
    for mode in CPUOffload:
        _check_parity(world, lambda m: FSDP(m, cpu_offload=mode), steps=5)


@pytest.mark.mpi(min_size=1)
def test_auto_wrap_policies():
    world = axonmpi.init()
    _check_parity(world, lambda m: FSDP(m, auto_wrap_policy=30), steps=5)          # only l1 (42) is a unit
    m = FSDP(_make(), auto_wrap_policy=30)
    assert [u.name for u in m.units] == ["l1"]
    m = FSDP(_make(), auto_wrap_policy={nn.Linear})
    assert [u.name for u in m.units] == ["l1", "l2", "l3"]


@pytest.mark.mpi(min_size=1)
def test_gpt_parity():
    world = axonmpi.init()
    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8)
    rng = np.random.default_rng(3)
    n = 2 * world.world_size
    idx = rng.integers(0, 11, (5, n, 6))
    tgt = rng.integers(0, 11, (5, n, 6))
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        axonmpi.manual_seed(0)
        ref = GPT(cfg, dtype=np.float64)
        axonmpi.manual_seed(0)
        model = FSDP(GPT(cfg, dtype=np.float64), sharding_strategy=strategy)
        assert [u.name for u in model.units] == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head"]
        ropt = axonmpi.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = axonmpi.optim.AdamW(model.parameters(), lr=1e-2)
        sl = slice(2 * world.rank, 2 * world.rank + 2)
        for s in range(5):
            _, want = ref(idx[s], tgt[s])
            ropt.zero_grad()
            want.backward()
            axonmpi.optim.clip_grad_norm_(ref.parameters(), 0.5)
            ropt.step()
            _, got = model(idx[s][sl], tgt[s][sl])
            opt.zero_grad()
            got.backward()
            model.clip_grad_norm_(0.5)
            opt.step()
            g = float(axonmpi.all_reduce(np.array(float(got.data)), axonmpi.ReduceOp.MEAN))
            assert _rel(g, float(want.data)) <= 1e-10, (strategy, s, g, float(want.data))
        sd, rsd = model.state_dict(), ref.state_dict()
        assert list(sd) == list(rsd)
        for k in rsd:
            _assert_close(sd[k], rsd[k], f"{strategy.name} {k}")


@pytest.mark.mpi(min_size=1)
def test_state_dict_roundtrip_and_sharded():
    world = axonmpi.init()
    src = _make()
    for p in src.parameters():
        p.data[...] = np.random.default_rng(7).standard_normal(p.data.shape)
    full = src.state_dict()
    model = FSDP(_make())
    model.load_state_dict(full)
    got = model.state_dict()
    for k in full:
        np.testing.assert_array_equal(got[k], full[k])
    sharded = model.sharded_state_dict()
    assert list(sharded) == list(full)
    for k, v in sharded.items():                  # each block is this rank's part of the flattened parameter
        a = v.offsets[0]
        np.testing.assert_array_equal(v.local, full[k].reshape(-1)[a:a + v.local.shape[0]])
    other = FSDP(_make())
    other.load_state_dict(sharded)
    for k, v in other.state_dict().items():
        np.testing.assert_array_equal(v, full[k])


@pytest.mark.mpi(min_size=1)
def test_errors_are_clear():
    world = axonmpi.init()
    model = FSDP(_make())
    with pytest.raises(RuntimeError, match="outside its FSDP"):
        model.module.l1(Tensor(np.zeros((1, 5))))
    with pytest.raises(ValueError, match="unknown sharding_strategy"):
        FSDP(_make(), sharding_strategy="zero4")
    with pytest.raises(ValueError, match="does not divide"):
        FSDP(_make(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, hybrid_shard_size=world.world_size + 1)

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2, dtype=np.float64)
            self.b = nn.Linear(2, 2, dtype=np.float64)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    f = FSDP(Shared())         # a weight two units hold goes to the root unit, gathered for the whole step
    assert [n for n, _ in f.hoisted.values()] == ["a.weight"]
    with pytest.raises(ValueError, match="already an FSDP model"):
        FSDP(FSDP(_make()))               # nesting itself works: tests/test_fsdp_nested.py


class Tower(nn.Module):
    def __init__(self, width=128, depth=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width + 1, dtype=np.float32) if i % 2 == 0 else
                                    nn.Linear(width + 1, width, dtype=np.float32) for i in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.mpi(min_size=1)
def test_memory_full_shard_adam_fp32_matches_formula():
    world = axonmpi.init()
    n = world.world_size
    model = FSDP(_make(Tower))
    psi = sum(p.total_numel for p in model.parameters())
    opt = axonmpi.optim.Adam(model.parameters(), lr=1e-3)
    model(Tensor(np.ones((2, 128), np.float32))).sum().backward()
    opt.step()
    st = model.memory_stats(opt)
    measured = (st.params_mb + st.grads_mb + st.optimizer_state_mb) * 2 ** 20
    formula = 16 * psi / n
    assert st.gathered_mb == 0.0
    assert abs(measured - formula) <= 0.05 * formula, (measured, formula)
    est = estimate_memory(model, ShardingStrategy.FULL_SHARD, n)
    assert abs(est.total_mb * 2 ** 20 - formula) < 1e-6 and est.formula == "(4+4+8)Psi/N"


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width, dtype=np.float32)

    def forward(self, x):
        return self.lin(x).tanh()


class BlockTower(nn.Module):
    def __init__(self, width=512, depth=6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _resident(buf):
    """Bytes of ``buf``'s pages resident in RAM (``mincore``), 0 for no buffer."""
    if buf is None:
        return 0
    page = mmap.PAGESIZE
    n = -(-buf.nbytes // page)
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(n * page), vec) == 0
    return sum(v & 1 for v in vec) * page


@pytest.mark.mpi(min_size=1)
def test_peak_during_forward_is_units_in_flight_not_the_model():
    """The gather buffers' resident pages (mincore), sampled inside every unit's forward, never exceed
    the units in flight (1, or 2 with prefetch), and drop to zero after backward: freeing is real."""
    world = axonmpi.init()
    if world.world_size == 1:
        pytest.skip("a shard group of one gathers nothing: no buffer (test_group_of_one_aliases_the_shard)")
    for prefetch in (False, True):
        axonmpi.manual_seed(0)
        model = FSDP(BlockTower(), prefetch=prefetch)
        assert {u.mode for u in model.units} == {"remap"}
        unit_bytes = max(u.flat.world_size * u.flat.padded_size * 4 for u in model.units)
        samples = []
        for u in model.units:
            u.module.lin.register_forward_hook(
                lambda m, a, o: samples.append(sum(_resident(v._buf) for v in model.units)))
        x = Tensor(np.ones((2, 512), np.float32))
        for step in range(3):
            model.reset_peak_memory_stats()
            out = model(x)
            st = model.memory_stats()
            out.sum().backward()
            assert sum(_resident(v._buf) for v in model.units) == 0
        in_flight = 2 if prefetch else 1
        page = mmap.PAGESIZE
        assert (st.peak_memory_mb - st.params_mb - st.grads_mb) * 2 ** 20 <= in_flight * unit_bytes
        assert unit_bytes <= max(samples) <= in_flight * (-(-unit_bytes // page) * page), (samples, unit_bytes)


@pytest.mark.mpi(min_size=2)
def test_prefetch_and_reduce_scatter_overlap_compute():
    axonmpi.init()
    model = FSDP(_make(Tower), record_events=True)
    x = Tensor(np.ones((2, 128), np.float32))
    for _ in range(2):
        model.events.clear()
        model(x).sum().backward()
    ev = model.events
    names = [u.name for u in model.units]
    for a, b in zip(names, names[1:]):            # unit k+1's gather is issued while unit k computes
        assert ev.index(("prefetch", b)) < ev.index(("forward_end", a)), (a, b, ev)
    reduces = [i for i, e in enumerate(ev) if e[0] == "reduce"]
    back_gathers = [i for i, e in enumerate(ev) if e == ("gather", names[0])]
    assert len(reduces) == len(names) and len(back_gathers) == 2
    # the last unit's reduce-scatter starts before the first unit's backward has even gathered
    assert reduces[0] < back_gathers[1] < ev.index(("backward_end", ""))
    assert ev[reduces[0]] == ("reduce", names[-1])


@pytest.mark.mpi(min_size=1)
def test_recompute_path_parity(monkeypatch):
    """Where pages cannot be released (CuPy, or no madvise) FULL_SHARD units recompute in backward:
    forced here on NumPy, the same parity holds, with no_sync accumulation too."""
    from axonmpi.parallel.fsdp import runtime
    monkeypatch.delattr(runtime.mmap, "MADV_DONTNEED")
    world = axonmpi.init()
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD):
        model = _check_parity(world, lambda m: FSDP(m, sharding_strategy=strategy), steps=5, micro=2)
        assert {u.mode for u in model.units} == {"recompute"}


@pytest.mark.mpi(min_size=2)
def test_sync_module_states_from_data_rank_0():
    world = axonmpi.init()
    for strategy, k in _strategies(world.world_size):
        kw = {} if k is None else {"hybrid_shard_size": k}
        axonmpi.manual_seed(world.rank)                 # every rank starts different
        model = FSDP(Net(), sharding_strategy=strategy, **kw)
        sd = model.state_dict()
        ref = axonmpi.broadcast_object(sd if world.rank == 0 else None)
        for key in sd:
            np.testing.assert_array_equal(sd[key], ref[key], err_msg=f"{strategy.name} {k} {key}")


@pytest.mark.mpi(min_size=1)
def test_group_of_one_aliases_the_shard():
    """Over a shard group of one (1 rank, or NO_SHARD at any size) a unit's parameters are views of its
    shard while it computes: gathering copies and communicates nothing, no gather buffer exists, nothing
    is gathered beside the state, and an optimizer step on the shard is what the next forward uses."""
    world = axonmpi.init()
    self_group = world.split(world.rank, name="fsdp_test_self")
    for strategy, group in [(ShardingStrategy.FULL_SHARD, self_group), (ShardingStrategy.SHARD_GRAD_OP, self_group),
                            (ShardingStrategy.NO_SHARD, None)]:
        model = FSDP(_make(Tower), sharding_strategy=strategy, group=group)
        assert model.shard_group.size == 1 and all(u.aliases_shard() for u in model.units)
        seen = []
        for u in model.units:         # inside each unit's forward, its parameters view its shard
            def run(*a, _u=u, _orig=u._orig_forward):
                seen.append(_u.flat.aliased and all(np.shares_memory(p.data, _u.flat.data) for p in _u.flat.params))
                return _orig(*a)
            u._orig_forward = run
        opt = axonmpi.optim.Adam(model.parameters(), lr=1e-2)
        x = Tensor(np.ones((2, 128), np.float32))
        for _ in range(2):
            model.reset_peak_memory_stats()
            model(x).sum().backward()
            st = model.memory_stats(opt)
            assert st.gathered_mb == 0.0 and st.peak_memory_mb == st.current_allocation_mb
            assert all(u._buf is None for u in model.units)
            assert all(_views_chunk(u.flat) for u in model.units)   # packed once; .grad views the chunk now
            before = [u.flat.data.copy() for u in model.units]
            opt.step()
            opt.zero_grad()
            assert all(not np.array_equal(b, u.flat.data) for b, u in zip(before, model.units))
        assert len(seen) == 2 * len(model.units) and all(seen), (strategy, seen)
        sd = model.state_dict()
        ref = _make(Tower)
        ref.load_state_dict(sd)
        np.testing.assert_array_equal(model(x).data, ref(x).data)    # the stepped shard is what computes


def _views_chunk(f):
    """Every original's ``.grad`` is its 1-D piece of the flat chunk's gradient (FSDP1's ``use_orig_params``)."""
    return all(p.grad is not None and p.grad.data.ndim == 1 and (p.grad.data.size == 0 or np.shares_memory(
        p.grad.data, f.grad.data)) for p in f.params)


@pytest.mark.mpi(min_size=1)
def test_no_sync_gradients_are_counted_until_reduced():
    """Gradients land in the parameters' own arrays and are packed once when their unit reduces: under
    no_sync they stay unsharded (and memory_stats counts all of them), afterwards only the shards."""
    axonmpi.init()
    model = FSDP(_make(Tower))
    x = Tensor(np.ones((2, 128), np.float32))
    psi = sum(f.total_numel for f in model.parameters())
    with model.no_sync():
        model(x).sum().backward()
    assert model.memory_stats().grads_mb * 2 ** 20 == 4 * psi
    model(x).sum().backward()
    shards = sum(int(f.grad.data.nbytes) for f in model.parameters())
    assert model.memory_stats().grads_mb * 2 ** 20 == shards
    assert all(_views_chunk(u.flat) for u in model.units)
