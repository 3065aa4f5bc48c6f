"""Nested FSDP (``FSDP(Net(FSDP(block), FSDP(block), head))``) and frozen parameters: parity with the serial
model on the global batch (float64, AdamW + clipping, 1-4 ranks, FULL_SHARD / SHARD_GRAD_OP / NO_SHARD /
HYBRID_SHARD), unwrapped state-dict keys, checkpoints into a serial model, and the clear errors."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, checkpoint, nn
from axonmpi.amp import GradScaler
from axonmpi.parallel import FSDP, MixedPrecision, ShardingStrategy
from axonmpi.parallel._flat import FlatParameter
from test_fsdp import _strategies  # noqa: E402  (the strategies and hybrid sizes each world size allows)

STEPS = 5
LB = 3          # local batch per rank


class Block(nn.Module):
    """A unit with a child unit: FSDP(Block) has the root unit ``scale`` and the unit ``lin``."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, dtype=np.float64)
        self.scale = nn.Parameter(np.linspace(0.5, 1.5, d_out))

    def forward(self, x):
        return self.lin(x).tanh() * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.b1 = Block(5, 7)
        self.b2 = Block(7, 3)
        self.head = nn.Linear(3, 2, dtype=np.float64)
        self.bias = nn.Parameter(np.array([0.25, -0.5]))

    def forward(self, x):
        return self.head(self.b2(self.b1(x))) + self.bias


def _make(freeze=()):
    axonmpi.manual_seed(0)
    net = Net()
    for name in freeze:
        net.get_parameter(name).requires_grad = False
    return net


def _two_inner(net, **kw):
    net.b1 = FSDP(net.b1, **kw)
    net.b2 = FSDP(net.b2, **kw)
    return FSDP(net, **kw)


def _deep(net, **kw):
    """Three levels: b2.lin in its own FSDP, inside FSDP(b2), inside the root."""
    net.b2.lin = FSDP(net.b2.lin, **kw)
    net.b2 = FSDP(net.b2, **kw)
    return FSDP(net, **kw)


def _with_policy(net, **kw):
    """b1 nested as given; the root's policy makes units of the other Linears (b2.lin, head)."""
    net.b1 = FSDP(net.b1, **kw)
    return FSDP(net, auto_wrap_policy={nn.Linear}, **kw)


def _policy_around(net, **kw):
    """The root's policy makes a unit of each Block; b2's unit holds the FSDP instance b2.lin."""
    net.b2.lin = FSDP(net.b2.lin, **kw)
    return FSDP(net, auto_wrap_policy={Block}, **kw)


BUILDS = {"two_inner": _two_inner, "deep": _deep, "policy": _with_policy, "policy_around": _policy_around}
UNITS = {"two_inner": ["b1", "b1.lin", "b2", "b2.lin", "head"],
         "deep": ["b1", "b2", "b2.lin", "head"],
         "policy": ["b1", "b1.lin", "b2.lin", "head"],
         "policy_around": ["b1", "b2", "b2.lin"]}


def _data(world, steps):
    rng = np.random.default_rng(1)
    n = LB * world.world_size
    return rng.standard_normal((steps, n, 5)), rng.standard_normal((steps, n, 2))


def _mse(out, y):
    return ((out - Tensor(y)) ** 2).mean()


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-300)


def _assert_close(got, want, what):
    err = np.max(np.abs(got - want)) if want.size else 0.0
    assert err <= 1e-10 * max(np.max(np.abs(want)), 1e-300), f"{what}: max error {err}"


def _train(world, model, opt, X, Y, steps, micro=1):
    """Train ``model`` (FSDP, this rank's share) over ``steps``; return the global losses."""
    r = world.rank
    sl = slice(r * LB, (r + 1) * LB)
    losses = []
    for s in steps:
        opt.zero_grad()
        got = 0.0
        for m in range(micro):
            x, y = X[s * micro + m][sl], Y[s * micro + m][sl]
            if m < micro - 1:
                with model.no_sync():
                    _mse(model(Tensor(x)), y).backward()
                    lf = None
            else:
                lf = _mse(model(Tensor(x)), y)
                lf.backward()
            if lf is not None:
                got = float(axonmpi.all_reduce(np.array(float(lf.data)), axonmpi.ReduceOp.MEAN))
        losses.append((got, float(model.clip_grad_norm_(0.05))))
        opt.step()
    return losses


def _serial(X, Y, steps, micro=1, freeze=()):
    ref = _make(freeze)
    opt = axonmpi.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for s in steps:
        opt.zero_grad()
        for m in range(micro):
            loss = _mse(ref(Tensor(X[s * micro + m])), Y[s * micro + m])
            loss.backward()
        losses.append((float(loss.data), float(axonmpi.optim.clip_grad_norm_(ref.parameters(), 0.05))))
        opt.step()
    return ref, opt, losses


def _check_parity(world, build, micro=1, freeze=()):
    X, Y = _data(world, STEPS * micro)
    ref, _, want = _serial(X, Y, range(STEPS), micro, freeze)
    model = build(_make(freeze))
    opt = axonmpi.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    got = _train(world, model, opt, X, Y, range(STEPS), micro)
    for s, ((lg, ng), (lw, nw)) in enumerate(zip(got, want)):
        assert _rel(lg, lw) <= 1e-10 and _rel(ng, nw) <= 1e-10, (world.rank, s, lg, lw, ng, nw)
    sd, rsd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd)                      # the unwrapped model's keys, in its order
    for k in rsd:
        _assert_close(sd[k], rsd[k], f"rank {world.rank}: {k}")
    return model, opt


@pytest.mark.mpi(min_size=1)
def test_nested_parity_every_strategy():
    world = axonmpi.init()
    for strategy, k in _strategies(world.world_size):
        kw = {"sharding_strategy": strategy, **({} if k is None else {"hybrid_shard_size": k})}
        for name, build in BUILDS.items():
            model, _ = _check_parity(world, lambda m: build(m, **kw))
            assert [u.name for u in model.units] == UNITS[name], (name, [u.name for u in model.units])
            flats = list(model.parameters())          # every unit's flat shard, once: the optimizer sees all
            assert len({id(f) for f in flats}) == len(flats) == len(model.units) + 1     # + root unit (bias)
            assert sum(f.total_numel for f in flats) == 42 + 7 + 24 + 3 + 8 + 2


def _mixed(root, b1, b2, lin):
    """Each instance its own options (PyTorch's rule): b2.lin in FSDP(**lin), inside FSDP(b2, **b2)."""
    def build(net):
        net.b1 = FSDP(net.b1, **b1)
        net.b2.lin = FSDP(net.b2.lin, **lin)
        net.b2 = FSDP(net.b2, **b2)
        return FSDP(net, **root)
    return build


@pytest.mark.mpi(min_size=1)
def test_nested_instances_keep_their_own_strategy_groups_and_offload():
    world = axonmpi.init()
    S = ShardingStrategy
    k = 2 if world.world_size in (2, 4) else 1
    hyb = {"sharding_strategy": S.HYBRID_SHARD, "hybrid_shard_size": k}
    cases = [
        ({"sharding_strategy": S.FULL_SHARD}, {"sharding_strategy": S.SHARD_GRAD_OP},
         {"sharding_strategy": S.NO_SHARD}, hyb),
        ({"sharding_strategy": S.SHARD_GRAD_OP}, {}, hyb, {"sharding_strategy": S.NO_SHARD}),
        (hyb, {"cpu_offload": "full"}, {"sharding_strategy": S.SHARD_GRAD_OP}, {}),
        ({"sharding_strategy": S.NO_SHARD, "cpu_offload": "optimizer_states"}, hyb, {},
         {"sharding_strategy": S.FULL_SHARD}),
    ]
    for root, b1, b2, lin in cases:
        model, _ = _check_parity(world, _mixed(root, b1, b2, lin), micro=2)
        strategies = {u.name: model._unit_strategy[id(u)] for u in model._all_units}
        want = {"": root, "head": root, "b1": b1, "b1.lin": b1, "b2": b2, "b2.lin": lin}
        for name, kw in want.items():
            assert strategies[name] is kw.get("sharding_strategy", S.FULL_SHARD), (name, strategies)
        units = {u.name: u for u in model._all_units}
        for name, kw in want.items():        # each unit reduces over its own instance's groups
            u = units[name]
            if u.flat is not None:
                assert u.flat.world_size == (world.world_size if kw.get("sharding_strategy") in
                                             (None, S.FULL_SHARD, S.SHARD_GRAD_OP) else
                                             1 if kw["sharding_strategy"] is S.NO_SHARD else k), name


@pytest.mark.mpi(min_size=1)
def test_nested_no_sync_and_recompute(monkeypatch):
    world = axonmpi.init()
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        _check_parity(world, lambda m: _deep(m, sharding_strategy=strategy), micro=2)
    from axonmpi.parallel.fsdp import runtime
    monkeypatch.delattr(runtime.mmap, "MADV_DONTNEED")     # CuPy's path: units recompute in backward
    model, _ = _check_parity(world, _deep, micro=2)
    modes = {u.name: u.mode for u in model.units}
    assert modes == {"b1": "recompute", "b2": "keep", "b2.lin": "recompute", "head": "recompute"}, modes
    # b2 (FSDP(b2)'s root unit) holds the unit b2.lin: it stays gathered from forward to its backward


@pytest.mark.mpi(min_size=1)
def test_nested_state_dict_sharded_and_memory():
    world = axonmpi.init()
    model = _two_inner(_make())
    serial = _make()
    rng = np.random.default_rng(7)
    full = {k: rng.standard_normal(v.shape) for k, v in serial.state_dict().items()}
    model.load_state_dict(full)
    got = model.state_dict()
    assert list(got) == list(serial.state_dict())
    for k in full:
        np.testing.assert_array_equal(got[k], full[k])
    sharded = model.sharded_state_dict()
    assert list(sharded) == list(full)
    other = _two_inner(_make())
    other.load_state_dict(sharded)
    for k, v in other.state_dict().items():
        np.testing.assert_array_equal(v, full[k])
    opt = axonmpi.optim.Adam(model.parameters(), lr=1e-3)
    model(Tensor(np.ones((2, 5)))).sum().backward()
    opt.step()
    st = model.memory_stats(opt)
    flats = list(model.parameters())
    assert st.params_mb * 2 ** 20 == sum(f._shard.nbytes for f in flats)
    assert st.optimizer_state_mb * 2 ** 20 == 2 * sum(f.data.nbytes for f in flats)


@pytest.mark.mpi(min_size=1)
def test_frozen_parameters_parity_no_grad_no_optimizer_state():
    """A frozen unit in the middle (b2: all frozen; b1 learns through it), a mixed unit (b1.lin: weight
    frozen) and a frozen root parameter; nested and flat. Frozen parameters keep their values, get no
    gradient and no optimizer state, and the all-frozen unit launches no reduce-scatter."""
    world = axonmpi.init()
    freeze = ("b2.lin.weight", "b2.lin.bias", "b2.scale", "b1.lin.weight", "bias")
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        for build in (lambda m: FSDP(m, sharding_strategy=strategy, record_events=True),
                      lambda m: _two_inner(m, sharding_strategy=strategy, record_events=True)):
            model, opt = _check_parity(world, build, freeze=freeze)
            names = dict(model._frozen)
            assert sorted(names) == sorted(freeze)
            flat_params = {id(p) for f in model.parameters() for p in f.params}
            for k, p in names.items():
                assert p.grad is None and not p.requires_grad and id(p) not in flat_params, k
                assert p.data.shape == _make().get_parameter(k).data.shape    # whole, on every rank
            assert all(isinstance(p, FlatParameter) for g in opt.param_groups for p in g["params"])
            assert set(opt.state) <= set(model.parameters())
            osd = model.optim_state_dict(opt)
            assert not set(osd["state"]) & set(freeze) and set(osd["state"]) == \
                {k for k in _make().state_dict() if k not in freeze}
            reduced = {u for kind, u in model.events if kind == "reduce"}
            assert reduced == {u.name for u in model.units if u.flat is not None}, reduced
            assert not reduced & {"", "b2", "b2.lin"} and "b1" in reduced, reduced   # b1 (or b1.lin) mixed


@pytest.mark.mpi(min_size=1)
def test_nested_checkpoint_round_trip_into_serial_and_flat(tmp_path_factory):
    """A nested FSDP model (with a frozen parameter) saves shards; a serial model and a flat (non-nested)
    FSDP model on fewer ranks load them and continue training exactly as the nested model does."""
    world = axonmpi.init()
    path = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("ckpt")) if world.rank == 0 else None) + "/n"
    freeze = ("b1.scale",)
    X, Y = _data(world, 6)
    model = _deep(_make(freeze))
    opt = axonmpi.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(world, model, opt, X, Y, range(3))
    checkpoint.save(path, {"model": model.sharded_state_dict(), "optim": model.optim_state_dict(opt)})
    want_loss = _train(world, model, opt, X, Y, range(3, 5))
    want = model.state_dict()
    half = world.new_group(list(range(max(1, world.world_size // 2))))
    if half.is_member:                 # flat FSDP over half the ranks: same global batch, bigger local share
        flat = FSDP(_make(freeze), group=half)
        fopt = axonmpi.optim.AdamW(flat.parameters(), lr=1.0)
        state = {"model": flat.sharded_state_dict(), "optim": flat.optim_state_dict(fopt)}
        state["optim"]["state"] = {}
        state = checkpoint.load(path, state, group=half)
        flat.load_state_dict(state["model"])
        flat.load_optim_state_dict(fopt, state["optim"])
        assert fopt.param_groups[0]["lr"] == 1e-2
        b = LB * world.world_size // half.size
        for s in range(3, 5):
            fopt.zero_grad()
            sl = slice(half.rank * b, (half.rank + 1) * b)
            lf = _mse(flat(Tensor(X[s][sl])), Y[s][sl])
            lf.backward()
            flat.clip_grad_norm_(0.05)
            fopt.step()
            g = float(axonmpi.all_reduce(np.array(float(lf.data)), axonmpi.ReduceOp.MEAN, group=half))
            assert _rel(g, want_loss[s - 3][0]) <= 1e-10
        for k, v in flat.state_dict().items():
            _assert_close(v, want[k], f"flat FSDP: {k}")
    single = world.new_group([0])
    if single.is_member:               # a serial model and a serial AdamW from the same files
        ref = _make(freeze)
        full = checkpoint.load(path, None, group=single)
        sd = ref.state_dict()
        assert set(full["model"]) == set(sd)
        ref.load_state_dict({k: np.asarray(full["model"][k]).reshape(sd[k].shape) for k in sd})
        assert not ref.get_parameter("b1.scale").requires_grad
        trainable = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
        ropt = axonmpi.optim.AdamW([p for _, p in trainable], lr=1.0)
        osd = full["optim"]
        ropt.load_state_dict({
            "state": {i: {k: (np.asarray(v).reshape(sd[n].shape) if np.ndim(v) else v)
                          for k, v in osd["state"][n].items()} for i, (n, _) in enumerate(trainable)},
            "param_groups": [{**{k: v for k, v in osd["param_groups"][0].items() if k != "params"},
                              "params": list(range(len(trainable)))}]})
        for s in range(3, 5):
            ropt.zero_grad()
            loss = _mse(ref(Tensor(X[s])), Y[s])
            loss.backward()
            axonmpi.optim.clip_grad_norm_(ref.parameters(), 0.05)
            ropt.step()
            assert _rel(float(loss.data), want_loss[s - 3][0]) <= 1e-10
        for k, v in ref.state_dict().items():
            _assert_close(v, want[k], f"serial: {k}")


@pytest.mark.mpi(min_size=1)
def test_nested_errors_are_clear():
    world = axonmpi.init()
    net = _make()
    net.b1 = FSDP(net.b1, mixed_precision=MixedPrecision(param_dtype=np.float32))
    with pytest.raises(NotImplementedError, match="nested at 'b1' has mixed_precision=MixedPrecision"):
        FSDP(net)
    if world.world_size > 1:          # the inner shards over half the data ranks: not the same data ranks
        net = _make()
        net.b1 = FSDP(net.b1, group=world.split(world.rank % 2))
        with pytest.raises(ValueError, match=f"'b1' spans the data-parallel ranks \\[{world.rank % 2}[,\\]]"):
            FSDP(net)
    model = _two_inner(_make())
    inner = model.module.b1
    assert all(m is not model for m in inner.modules()) and "(b1): FullyShardedDataParallel" in repr(model)
    with pytest.raises(RuntimeError, match="outside its FSDP"):
        inner(Tensor(np.zeros((1, 5))))
    for call in (inner.state_dict, inner.sharded_state_dict, inner.memory_stats,
                 lambda: inner.clip_grad_norm_(1.0)):
        with pytest.raises(RuntimeError, match="nested in another FSDP model"):
            call()
    with pytest.raises(ValueError, match="already nested in another FSDP"):
        FSDP(nn.Sequential(inner))
    with pytest.raises(ValueError, match="already an FSDP model"):
        FSDP(model)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = FSDP(nn.Linear(2, 2, dtype=np.float64))
            self.b = nn.Linear(2, 2, dtype=np.float64)
            self.b.weight = self.a.module.weight

        def forward(self, x):
            return self.b(self.a(x))

    axonmpi.manual_seed(0)
    with pytest.raises(ValueError, match="shared with the FSDP instance nested at 'a'"):
        FSDP(Tied())


@pytest.mark.mpi(min_size=1)
def test_nested_full_shard_frees_each_unit_and_keeps_only_the_enclosing_ones():
    """Inside b2.lin's forward (three levels deep) the units gathered are the root, its enclosing b2 and
    itself, never the finished b1 / b1.lin; after backward nothing is gathered."""
    axonmpi.init()
    model = _deep(_make())
    seen = []
    lin = model.module.b2.module.lin.module
    lin.register_forward_hook(lambda m, a, o: seen.append(
        {u.name for u in model._all_units if u.flat is not None and u.flat.full is not None}))
    for _ in range(2):
        model(Tensor(np.ones((2, 5)))).sum().backward()
        assert model.memory_stats().gathered_mb == 0.0
    for s in seen:
        assert {"", "b2", "b2.lin"} <= s and not s & {"b1", "b1.lin"}, seen


@pytest.mark.mpi(min_size=1)
def test_frozen_parameters_with_fp16_compute_keep_their_full_precision_values():
    """Under MixedPrecision(float16) a frozen parameter computes in float16 beside the gathered units and
    keeps its full-precision master: the state dict gives it back bit for bit; training tracks the
    full-precision run within the fp16 tolerance of tests/test_amp.py (seen: 7.7e-5 relative)."""
    world = axonmpi.init()
    freeze = ("b1.lin.weight", "b2.scale")
    mp = MixedPrecision(param_dtype=np.float16, reduce_dtype=np.float32)
    X, Y = _data(world, 4)
    sl = slice(world.rank * LB, (world.rank + 1) * LB)
    init = _make(freeze).state_dict()
    out = []
    for kw in ({}, {"mixed_precision": mp}):
        model = _two_inner(_make(freeze), **kw)
        opt = axonmpi.optim.Adam(model.parameters(), lr=1e-2)
        scaler = GradScaler(init_scale=1024.0, enabled=bool(kw))
        for s in range(4):
            opt.zero_grad()
            loss = ((model(Tensor(X[s][sl])).astype(np.float64) - Tensor(Y[s][sl])) ** 2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            model.clip_grad_norm_(10.0)
            scaler.step(opt)
            scaler.update()
        out.append(model.state_dict())
    ref, got = out
    lin_w = model.module.b1.module.lin.weight
    assert lin_w.data.dtype == np.float16                  # the compute copy
    for k in freeze:
        assert got[k].dtype == np.float64 and np.array_equal(got[k], init[k]), k
    for k in ref:
        assert got[k].dtype == np.float64
        err = np.max(np.abs(got[k] - ref[k]))
        assert err <= 2e-3 * np.max(np.abs(ref[k])), (k, err)
    model.load_state_dict(init)                            # loads the master exactly, refreshes the copy
    assert np.array_equal(model.state_dict()["b1.lin.weight"], init["b1.lin.weight"])
    np.testing.assert_array_equal(lin_w.data, init["b1.lin.weight"].astype(np.float16))
