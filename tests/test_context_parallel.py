"""Context parallelism: ring and Ulysses attention against serial causal attention (float64, forward and
backward), the sequence layouts, the G_context grid dimension, and the bytes each algorithm moves."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor
import axonmpi.nn.functional as F
from axonmpi.nn import CausalSelfAttention
from axonmpi.parallel.context import CPAlgo, ContextLayout, ContextParallelAttention

TOL = 1e-10


def _rel(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


# -- layouts (no MPI) -------------------------------------------------------------------------------
@pytest.mark.parametrize("T,P", [(8, 2), (10, 2), (13, 3), (17, 4), (8, 4)])
def test_ring_layout_balances_and_round_trips(T, P):
    lay = ContextLayout(T, P, "ring")
    pos = [lay.positions(r) for r in range(P)]
    assert sorted(np.concatenate(pos).tolist()) == list(range(T))
    for r, p in enumerate(pos):
        assert np.all(np.diff(p) > 0)                        # ascending on every rank
    # causal work (query-key pairs with key <= query) differs by at most a few tokens' worth between ranks
    work = [int(sum(q + 1 for q in p)) for p in pos]
    assert max(work) - min(work) <= 2 * T, work
    x = np.arange(2 * T).reshape(2, T)
    assert np.array_equal(lay.merge([lay.split(x, r) for r in range(P)]), x)


def test_layout_errors_name_the_value_and_the_fix():
    assert ContextLayout(10, 2, "ring").positions(0).tolist() == [0, 1, 2, 8, 9]
    with pytest.raises(ValueError, match="3 tokens.*4 chunks.*at least 4 tokens"):
        ContextLayout(3, 2, "ring")
    with pytest.raises(ValueError, match="unknown context-parallel algorithm"):
        ContextLayout(8, 2, "zigzag")
    assert ContextLayout(7, 3, CPAlgo.ULYSSES).ranges(2) == [(5, 7)]


# -- attention parity -------------------------------------------------------------------------------
def _parity(world, algo, T, heads=4, C=16, B=2):
    g = world.default_group
    P, r = g.size, g.rank
    axonmpi.manual_seed(3)
    serial = CausalSelfAttention(C, heads, dtype=np.float64)
    cp = ContextParallelAttention(C, heads, group=g, algo=algo, dtype=np.float64)
    cp.load_state_dict(serial.state_dict())
    x = np.random.default_rng(5).standard_normal((B, T, C))
    gy = np.random.default_rng(6).standard_normal((B, T, C))
    xs = Tensor(x.copy(), requires_grad=True)
    ys = serial(xs)
    (ys * Tensor(gy)).sum().backward()
    lay = cp.layout(T)
    xl = Tensor(lay.split(x, r), requires_grad=True)
    yl = cp(xl, seq_len=T)
    (yl * Tensor(lay.split(gy, r))).sum().backward()
    errs = {"out": _rel(yl.data, lay.split(ys.data, r)), "dx": _rel(xl.grad.data, lay.split(xs.grad.data, r))}
    for name, p in cp.named_parameters():       # replicated weights: partial gradients, summed over the group
        total = axonmpi.all_reduce(p.grad.data.copy(), group=g)
        errs[name] = _rel(total, dict(serial.named_parameters())[name].grad.data)
    worst = max(axonmpi.all_gather_object(max(errs.values()), group=g))
    assert worst <= TOL, (algo, T, errs)
    return worst


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_attention_parity_even(world, algo):
    P = world.world_size
    _parity(world, algo, T=4 * P * 2, heads=4 if P != 3 else 6, C=24)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_attention_parity_uneven_sequence(world, algo):
    P = world.world_size
    T = 4 * P + 3                                  # divides neither by P nor by 2P
    _parity(world, algo, T=T, heads=P * 2, C=P * 8)


@pytest.mark.mpi(min_size=3)
def test_ulysses_refuses_heads_that_do_not_divide(world):
    three = world.split(0 if world.rank < 3 else None)
    if world.rank < 3:
        with pytest.raises(ValueError, match=rf"rank {world.rank}: Ulysses attention splits the 4 heads over the 3 "
                                             r".*multiple of 3.*cp_algo='ring'"):
            ContextParallelAttention(16, 4, group=three, algo="ulysses")


@pytest.mark.mpi(min_size=2)
def test_wrong_local_length_is_refused(world):
    g = world.default_group
    cp = ContextParallelAttention(8, 2, group=g, algo="ring", dtype=np.float64)
    with pytest.raises(ValueError, match="tokens on context rank"):
        cp(Tensor(np.zeros((1, 3, 8))), seq_len=4 * g.size + 1 + 3 * (g.rank == 0))


# -- bytes through the backend = the formulas ------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_bytes_equal_the_formulas(world, algo):
    from axonmpi.distributed.backends.counting import count_bytes
    g = world.default_group
    P = g.size
    B, H, C, T = 2, 2 * P, 8 * P, 4 * P
    cp = ContextParallelAttention(C, H, group=g, algo=algo, dtype=np.float64)
    lay = cp.layout(T)
    x = Tensor(lay.split(np.random.default_rng(1).standard_normal((B, T, C)), g.rank), requires_grad=True)
    with count_bytes() as fwd:
        y = cp(x, seq_len=T)
    with count_bytes() as bwd:
        y.sum().backward()
    item = 8
    kv_local = 2 * B * (T // P) * C * item                 # this rank's K and V
    if algo == "ring":
        assert fwd.total("send") == (P - 1) * kv_local == (P - 1) * (2 * B * T * C * item) // P
        assert fwd.total("recv") == fwd.total("send") and fwd.total("alltoall") == 0
        assert bwd.total("send") == (2 * P - 1) * kv_local
    else:
        assert fwd.total("alltoall") == 4 * B * T * C * item // P        # 4 N h / P (times batch and item size)
        assert bwd.total("alltoall") == 4 * B * T * C * item // P
        assert fwd.total("send") == 0


# -- the grid's context dimension ------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_grid_context_dimension(world):
    from axonmpi.distributed import ProcessGrid
    n = world.world_size
    for GC in [c for c in range(2, n + 1) if n % c == 0]:
        grid = ProcessGrid(world, G_context=GC)
        try:
            GD = n // GC
            c = grid.coords
            assert (c.data, c.context) == divmod(world.rank, GC) and grid.G_data == GD
            assert grid.context_group.ranks == tuple(c.data * GC + k for k in range(GC))
            assert grid.data_group.ranks == tuple(d * GC + c.context for d in range(GD))
            assert grid.group_for("context") is grid.context_group
            assert sorted(grid.group_for("data_context").ranks) == list(range(n))
            assert grid.group_for("data").ranks == grid.data_group.ranks and not grid.is_trivial
            assert all(grid.rank_of(grid.coords_of(w)) == w for w in range(n))
            assert grid.sizes["G_context"] == GC
        finally:
            grid.free()
    with pytest.raises(ValueError, match="G_context"):
        ProcessGrid(world, G_context=n + 1)


# -- examples/train_gpt.py --context-parallel N --cp-algo ring|ulysses equals one process -----------
ROOT = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))
SCRIPT = __import__("os").path.join(ROOT, "examples", "train_gpt.py")
TINY = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--corpus-bytes", "60000",
        "--eval-batches", "1", "--no-progress", "--sample-chars", "0", "--global-batch", "12", "--steps", "5",
        "--dtype", "float64", "--lr", "1e-2", "--grad-clip", "0.05", "--warmup", "2"]


def _train(tmp, name, n, extra=()):
    import json
    import subprocess
    import sys
    from axonmpi.testing import mpiexec_env, run_mpiexec
    metrics, params = str(tmp / f"{name}.jsonl"), str(tmp / f"{name}.npz")
    args = [SCRIPT, *TINY, "--metrics-json", metrics, "--dump-params", params, *extra]
    if "--checkpoint-dir" not in extra:
        args.append("--no-save")
    if n == 1:
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=mpiexec_env(),
                           cwd=tmp)
    else:
        r = run_mpiexec(args, n=n, timeout=240, cwd=str(tmp))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    return [json.loads(ln) for ln in open(metrics)], dict(np.load(params)), r


@pytest.fixture(scope="module")
def serial_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("serial"), "serial", 1)


def _same(rows, params, ref_rows, ref_params, steps=(1, 2, 3, 4, 5)):
    ref = {x["step"]: x for x in ref_rows}
    assert [x["step"] for x in rows] == list(steps)
    worst = 0.0
    for x in rows:
        for key in ("loss", "grad_norm"):
            err = abs(x[key] - ref[x["step"]][key]) / abs(ref[x["step"]][key])
            assert err <= 1e-9, (x, ref[x["step"]])
            worst = max(worst, err)
    assert params.keys() == ref_params.keys()
    for k, v in ref_params.items():
        err = np.abs(params[k] - v).max() / max(np.abs(v).max(), 1e-300)
        assert params[k].shape == v.shape and err <= 1e-9, k
        worst = max(worst, err)
    return worst


@pytest.mark.serial
@pytest.mark.parametrize("n,flags", [
    (2, ["--context-parallel", "2", "--cp-algo", "ring"]),
    # the others only in make test-all: parallelize's context-parallel parity tests in this file and
    # tests/test_nd_layouts.py cover each layout in process; these check the trainer's flags reach it
    pytest.param(2, ["--context-parallel", "2", "--cp-algo", "ulysses"], marks=pytest.mark.slow),
    pytest.param(3, ["--context-parallel", "3", "--cp-algo", "ring"], marks=pytest.mark.slow),
    pytest.param(4, ["--context-parallel", "2", "--cp-algo", "ring", "--G-data", "2"], marks=pytest.mark.slow),
    (4, ["--context-parallel", "2", "--cp-algo", "ulysses", "--G-data", "2"]),
    pytest.param(4, ["--G-intra-c", "2", "--G-data", "2", "--tp-style", "megatron", "--sequence-parallel"],
                 marks=pytest.mark.slow),   # item 4, via HybridGPT
    (4, ["--context-parallel", "2", "--cp-algo", "ring", "--G-inter", "2", "--microbatches", "2"]),  # CP x pipeline
], ids=lambda v: v if isinstance(v, int) else "-".join(a.strip("-") for a in v))
def test_train_gpt_context_parallel_equals_one_process(n, flags, serial_run, tmp_path):
    rows, params, r = _train(tmp_path, "cp", n, flags)
    _same(rows, params, *serial_run[:2])
    assert ("G_context=" in r.stdout) == ("--context-parallel" in flags)


@pytest.mark.slow  # resharding across layouts: tests/test_nd_layouts.py in process; the trainer's resume: test_resume.py
@pytest.mark.serial
def test_train_gpt_context_parallel_checkpoint_loads_under_other_layouts(serial_run, tmp_path):
    """Saved at step 3 under ring CP 2; resumed under one process and under 2 data x Ulysses CP 2: steps 4, 5
    and the final parameters equal the uninterrupted serial run's."""
    import shutil
    from axonmpi.checkpoint import CheckpointManager
    ck = str(tmp_path / "ck")
    _train(tmp_path, "a", 2, ["--context-parallel", "2", "--checkpoint-dir", ck, "--save-every", "3"])
    mgr = CheckpointManager(ck)
    assert 3 in mgr.steps()
    for s in mgr.steps():
        if s > 3:
            shutil.rmtree(mgr.path_for(s))
    for name, n, flags in (("serial", 1, []), ("dp2cp2", 4, ["--context-parallel", "2", "--cp-algo", "ulysses",
                                                             "--G-data", "2"])):
        rows, params, _ = _train(tmp_path, name, n, ["--checkpoint-dir", ck, "--resume", "--no-save", *flags])
        _same(rows, params, *serial_run[:2], steps=(4, 5))


@pytest.mark.serial
@pytest.mark.parametrize("n,flags,needle", [
    (2, ["--context-parallel", "2", "--block-size", "3"], "--block-size 3 cannot be cut into the 4 chunks"),
    (3, ["--context-parallel", "3", "--cp-algo", "ulysses"], "2 heads on this rank (of 2) over the 3 context ranks"),
])
def test_train_gpt_refuses_context_layouts_not_built(n, flags, needle, tmp_path):
    from axonmpi.testing import run_mpiexec
    r = run_mpiexec([SCRIPT, *TINY, "--no-save", *flags], n=n, timeout=240, cwd=str(tmp_path))
    assert r.returncode != 0 and needle in r.stdout + r.stderr, (r.stdout[-2000:], r.stderr[-2000:])


# -- parallelize(..., context_parallel=) -----------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_parallelize_context_parallel_trains_as_serial(world, algo):
    from axonmpi.distributed import placement_of
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.optim import AdamW, clip_grad_norm_
    from axonmpi.parallel import full_state_dict, parallelize
    from axonmpi.parallel.grad_sync import data_reduction_group
    n = world.world_size
    GC = 2 if n % 2 == 0 else n
    grid = axonmpi.ProcessGrid(world, G_context=GC)
    try:
        cfg = GPTConfig(vocab_size=20, block_size=4 * GC + 1, n_layer=2, n_head=2 * GC, n_embd=8 * GC)
        rng = np.random.default_rng(2)
        B = 2 * grid.G_data
        batches = [(rng.integers(0, 20, (B, cfg.block_size)), rng.integers(0, 20, (B, cfg.block_size)))
                   for _ in range(3)]
        axonmpi.manual_seed(9)
        serial = GPT(cfg, dtype="float64")
        axonmpi.manual_seed(9)
        pm = parallelize(GPT(cfg, dtype="float64"), grid=grid, context_parallel=algo)
        assert pm.module.group is data_reduction_group(grid) and data_reduction_group(grid).size == n
        assert all(grid.context_group in placement_of(p).replicas for p in pm.parameters())
        opts = [AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (serial, pm)]
        worst = 0.0
        for x, y in batches:
            got = []
            for m, opt in zip((serial, pm), opts):
                xb, yb = (x, y) if m is serial else pm.local_batch(x, y)      # this rank's rows and tokens
                opt.zero_grad()
                if m is serial:
                    _, loss = m(xb, yb)
                else:         # the one loss rule: the global token mean (an uneven split: 9 tokens over 2P chunks)
                    logits, _ = m(xb)
                    loss = pm.token_mean(F.cross_entropy(logits, yb, reduction="sum"), int(yb.size))
                loss.backward()
                norm = float(clip_grad_norm_(m.parameters(), 0.05))
                opt.step()
                got.append((float(loss.data), norm))
            assert got[0][1] > 0.05
            worst = max(worst, _rel(got[1][0], got[0][0]), _rel(got[1][1], got[0][1]))
        sd = full_state_dict(pm)
        for k, v in serial.state_dict().items():
            worst = max(worst, _rel(sd[k], v))
        assert worst <= TOL, worst
    finally:
        grid.free()
