"""Issue 30 item 7: one loss rule.

``pm.token_mean(lsum, num_tokens)`` gives the serial mean over the global batch's counted targets (the
torch-style ``F.cross_entropy(..., ignore_index=-100)`` mean computed in one process on the global batch):
its value on every rank, and after ``backward()`` every gradient.  The targets are ignored unevenly over
the ranks (the first rows mostly ignored), so the plain per-rank mean (PyTorch DDP's mean of per-rank
means) is measurably off; checked here too, so the data can tell the two rules apart.
Layouts at 2, 3, 4 ranks: DDP, FSDP, AxoNN easy mode (batch split over the tensor block), FSDP x AxoNN,
Megatron, context parallel (ring, Ulysses), and the pipeline (PP, PP x DP, PP x AxoNN stages).
"""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.optim import SGD
from axonmpi.parallel import Pipeline, full_state_dict, parallelize
from axonmpi.parallel.token_mean import global_count, token_mean

TOL = 1e-10
D, H, C, T = 6, 12, 6, 4         # sizes divide by 2 and 3 (AxoNN / Megatron over 2 or 3 ranks)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D, dtype=np.float64)
        self.fc1 = nn.Linear(D, H, dtype=np.float64)
        self.fc2 = nn.Linear(H, D, dtype=np.float64)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TokenMLP(nn.Module):
    """Per-token classifier over (B, T, D) inputs: logits (B, T, C)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D, dtype=np.float64)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, C, dtype=np.float64)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


PLAN = {"blocks.*.fc1": "column", "blocks.*.fc2": "row"}


def _make():
    axonmpi.manual_seed(7)
    return TokenMLP()


def _batch(gb, step=0):
    """Inputs (gb, T, D) and targets (gb, T) whose first third of rows is mostly ignored (-100)."""
    rng = np.random.default_rng(40 + step)
    x = rng.standard_normal((gb, T, D))
    y = rng.integers(0, C, (gb, T))
    p = np.where(np.arange(gb)[:, None] < gb // 3 + 1, 0.8, 0.1)
    y[rng.random((gb, T)) < p] = -100
    y[0, :] = -100                  # a wholly ignored row
    assert (y != -100).sum() > 0
    return x, y


def _serial(x, y, model=None):
    ref = _make() if model is None else model
    loss = F.cross_entropy(ref(Tensor(x)), y, ignore_index=-100)     # torch's global token mean
    loss.backward()
    return float(loss.item()), ref


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _grads_by_sgd(pm, params, step_fn):
    """The full serial-named gradients of a parallelized model: one SGD step of lr 1 on ``params``
    (``before - after`` of ``full_state_dict``), so any layout's sharding is undone by the state dict."""
    before = {k: np.array(v, copy=True) for k, v in full_state_dict(pm).items()}
    opt = SGD(params, lr=1.0)
    opt.zero_grad()
    value = step_fn()
    opt.step()
    after = full_state_dict(pm)
    return value, {k: before[k] - after[k] for k in before}


def _contract(pm, xb, yb):
    """The one loss rule, exactly as the issue states it; the loss value."""
    lsum = F.cross_entropy(pm(Tensor(xb)), yb, ignore_index=-100, reduction="sum")
    loss = pm.token_mean(lsum, num_tokens=int((yb != -100).sum()))
    loss.backward()
    return loss.item()


LAYOUTS = {       # name: (grid sizes per world size, tensor_parallel, data_parallel)
    "ddp": (lambda n: {}, None, "ddp"),
    "fsdp": (lambda n: {}, None, "fsdp"),
    "axonn_row": (lambda n: {"G_intra_r": 2 if n % 2 == 0 else n}, "axonn", "ddp"),
    "fsdp_x_axonn_row": (lambda n: {"G_intra_r": 2} if n % 2 == 0 else None, "axonn", "fsdp"),
    "megatron": (lambda n: {"G_intra_c": 2 if n % 2 == 0 else n}, PLAN, "ddp"),
    "fsdp_x_megatron": (lambda n: {"G_intra_c": 2} if n % 2 == 0 else None, PLAN, "fsdp"),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_token_mean_equals_serial(world, layout):
    n = world.world_size
    sizes, tp, dp = LAYOUTS[layout]
    sizes = sizes(n)
    if sizes is None:
        pytest.skip(f"{layout} is built for an even number of ranks")
    grid = axonmpi.ProcessGrid(world, **sizes)
    try:
        pm = parallelize(_make(), grid=grid, tensor_parallel=tp, data_parallel=dp)
        shards = pm.batch_shards[0]
        x, y = _batch(4 * shards)
        want, ref = _serial(x, y)
        want_grads = {k: p.grad.data for k, p in ref.named_parameters()}
        xb, yb = pm.local_batch(x, y)
        value, grads = _grads_by_sgd(pm, pm.parameters(), lambda: _contract(pm, xb, yb))
        assert _rel(value, want) <= TOL, (value, want)          # the same on every rank
        for k, g in want_grads.items():
            assert _rel(grads[k], g) <= TOL, (k, _rel(grads[k], g))

        # the plain mean keeps PyTorch DDP's semantics (mean of the shards' means): not the token mean here
        local = F.cross_entropy(pm(Tensor(xb)), yb, ignore_index=-100).item()
        groups = pm.token_groups()
        ddp_mean = local
        for g in groups:
            ddp_mean = float(axonmpi.all_reduce(np.array([ddp_mean]), op="mean", group=g)[0])
        if shards > 1:           # NaN where a rank counts no target (its mean is 0/0, as torch's)
            assert not np.isfinite(ddp_mean) or _rel(ddp_mean, want) > 1e-4, (ddp_mean, want)
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_token_mean_context_parallel(world, algo):
    """A GPT under ``parallelize(context_parallel=)``: ``pm.local_batch`` gives each rank its tokens of each
    sequence (the GPT numbers them at their global positions); each rank's logits are those tokens';
    summed over data x context with the counts, the loss and gradients are the serial token mean's."""
    from axonmpi.models import GPT, GPTConfig
    n = world.world_size
    GC = 2 if n % 2 == 0 else n
    grid = axonmpi.ProcessGrid(world, G_context=GC)
    try:
        cfg = GPTConfig(vocab_size=20, block_size=4 * GC + 1, n_layer=1, n_head=2 * GC, n_embd=8 * GC)
        rng = np.random.default_rng(3)
        B, L = 2 * grid.G_data, cfg.block_size
        x = rng.integers(0, 20, (B, L))
        y = rng.integers(0, 20, (B, L))
        y[:, : L // 2][rng.random((B, L // 2)) < 0.8] = -100      # the first tokens mostly ignored
        y[0, :] = -100
        axonmpi.manual_seed(9)
        serial = GPT(cfg, dtype="float64")
        logits, _ = serial(x)
        want = F.cross_entropy(logits, y, ignore_index=-100)
        want.backward()
        axonmpi.manual_seed(9)
        pm = parallelize(GPT(cfg, dtype="float64"), grid=grid, context_parallel=algo)
        xb, yl = pm.local_batch(x, y)                                  # this rank's rows and tokens

        def step():
            logits, _ = pm(xb)
            lsum = F.cross_entropy(logits, yl, ignore_index=-100, reduction="sum")
            loss = pm.token_mean(lsum, num_tokens=int((yl != -100).sum()))
            loss.backward()
            return loss.item()

        value, grads = _grads_by_sgd(pm, pm.parameters(), step)
        assert _rel(value, want.item()) <= TOL, (value, want.item())
        for k, p in serial.named_parameters():
            assert _rel(grads[k], p.grad.data) <= TOL, k
    finally:
        grid.free()


PIPE_LAYOUTS = {   # name: (grid sizes, tensor_parallel of the stages)
    "pp2": ({"G_inter": 2}, None),
    "pp2_dp": ({"G_inter": 2}, None),
    "pp2_axonn2": ({"G_inter": 2, "G_intra_r": 2}, "axonn"),
    "pp2_megatron2": ({"G_inter": 2, "G_intra_c": 2}, {"*.fc1": "column", "*.fc2": "row"}),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", sorted(PIPE_LAYOUTS))
def test_pipeline_counts_over_microbatches_and_batch_groups(world, layout):
    """Two stages of parallelized chunks, 3 micro-batches of unevenly ignored targets: the loss of
    ``step`` and the gradients are the serial token mean's (the AxoNN stages' tensor block reads its own
    rows: counted over it too, where before each block rank's mean was averaged)."""
    n = world.world_size
    sizes, tp = PIPE_LAYOUTS[layout]
    need = 2 * (2 if layout in ("pp2_dp", "pp2_axonn2", "pp2_megatron2") else 1)
    if n != need:
        pytest.skip(f"{layout} needs {need} ranks")
    grid = axonmpi.ProcessGrid(world, **sizes)
    old, world.grid = world.grid, grid
    try:
        full = _make()
        s = grid.coords.inter
        stage = nn.Sequential(full.embed, full.blocks[0]) if s == 0 else nn.Sequential(full.blocks[1], full.head)
        pm = parallelize(stage, grid=grid, tensor_parallel=tp, data_parallel=None)
        pipe = Pipeline(pm, "1f1b", num_microbatches=3, loss_fn=F.cross_entropy)
        shards = pm.batch_shards[0]
        x, y = _batch(6 * shards)
        want, ref = _serial(x, y)
        xb, yb = pm.local_batch(x, y)
        value, grads = _grads_by_sgd(pm, pm.parameters(), lambda: pipe.step(xb, yb))
        assert _rel(value, want) <= TOL, (value, want)
        names = {0: ("embed.", "blocks.0."), 1: ("blocks.1.", "head.")}[s]
        for k, g in grads.items():
            head, rest = k.split(".", 1)
            name = names[int(head)] + rest
            assert _rel(g, ref.get_parameter(name).grad.data) <= TOL, name
    finally:
        world.grid = old
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_token_mean_function_and_errors(world):
    """The function under ``pm.token_mean``: value and gradient scale in closed form from the ranks;
    a rank with no counted target contributes nothing; bad counts raise naming the value and the rank."""
    g, r, n = world.default_group, world.rank, world.world_size
    lsum = Tensor(np.array(float(r + 1)), requires_grad=True)
    count = r                                   # rank 0 counts nothing
    loss = token_mean(lsum * 2.0, count, [g])
    total, N = sum(2.0 * (q + 1) for q in range(n)), sum(range(n))
    assert abs(loss.item() - total / N) <= 1e-15 * total / N
    loss.backward()
    assert abs(float(lsum.grad.data) - 2.0 * n / N) <= 1e-15
    assert global_count(count, [g]) == N
    with pytest.raises(ValueError, match=f"rank {r}: num_tokens must be a non-negative int"):
        token_mean(Tensor(np.array(1.0)), -1, [g])
    with pytest.raises(ValueError, match=f"rank {r}: token_mean needs a scalar loss sum"):
        token_mean(Tensor(np.ones(3)), 1, [g])
    nan = token_mean(Tensor(np.array(0.0), requires_grad=True), 0, [g])
    assert np.isnan(nan.item())


RECIPE = {   # world size: [(grid sizes, tp_style, schedule, fsdp)]
    2: [({"G_data": 2}, "axonn", "1f1b", None), ({"G_inter": 2}, "axonn", "1f1b", None),
        ({"G_intra_r": 2}, "axonn", "1f1b", None), ({"G_intra_c": 2}, "megatron", "1f1b", None),
        ({"G_data": 2}, "axonn", "1f1b", "full_shard"), ({"G_context": 2}, "axonn", "1f1b", None)],
    3: [({"G_data": 3}, "axonn", "1f1b", None), ({"G_inter": 3}, "axonn", "gpipe", None)],
    4: [({"G_data": 2, "G_inter": 2}, "axonn", "1f1b", None), ({"G_data": 2, "G_intra_r": 2}, "axonn", "1f1b", None),
        ({"G_inter": 2, "G_intra_r": 2}, "axonn", "1f1b", None),
        ({"G_data": 2, "G_intra_c": 2}, "megatron", "1f1b", "shard_grad_op"),
        ({"G_data": 2, "G_intra_r": 2}, "axonn", "1f1b", "full_shard"),
        ({"G_data": 2, "G_context": 2}, "axonn", "1f1b", None)],
}


@pytest.mark.mpi(min_size=2)
def test_gpt_recipe_logs_the_serial_token_mean(world):
    """``HybridGPT.forward_backward`` (what ``examples/train_gpt.py`` logs) with unevenly ignored targets:
    the serial global token mean at every step and the serial parameters after 3 AdamW steps with clipping,
    under DDP, FSDP, FSDP x Megatron / AxoNN, AxoNN, Megatron, pipelines and context parallelism."""
    from axonmpi.models import GPT, GPTConfig
    from axonmpi.optim import AdamW, clip_grad_norm_
    from axonmpi.recipes import HybridGPT
    cfg = GPTConfig(vocab_size=12, block_size=8, n_layer=2, n_head=2, n_embd=8)
    rng = np.random.default_rng(4)
    batches = []
    for _ in range(3):
        x, y = rng.integers(0, 12, (12, 8)), rng.integers(0, 12, (12, 8))
        y[:4][rng.random((4, 8)) < 0.8] = -100        # the first rows mostly ignored
        y[:, :3][rng.random((12, 3)) < 0.5] = -100    # and the first tokens (context parallel)
        y[0] = -100
        batches.append((x, y))
    axonmpi.manual_seed(7)
    ref = GPT(cfg, dtype="float64")
    opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        logits, _ = ref(x)
        loss = F.cross_entropy(logits, y, ignore_index=-100)
        loss.backward()
        clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        ref_losses.append(float(loss.item()))
    want = ref.state_dict()
    for sizes, style, sched, fsdp in RECIPE.get(world.world_size, []):
        grid = axonmpi.ProcessGrid(world, **sizes)
        try:
            axonmpi.manual_seed(7)
            hyb = HybridGPT(cfg, grid, tp_style=style, schedule=sched, num_microbatches=2, dtype="float64",
                            global_batch=12, fsdp=fsdp)
            opt = AdamW(hyb.parameters(), lr=1e-2, weight_decay=0.1)
            losses = []
            for x, y in batches:
                opt.zero_grad()
                losses.append(hyb.forward_backward(hyb.local_batch(x), hyb.local_batch(y)))
                hyb.clip_grad_norm_(0.05)
                opt.step()
            assert _rel(losses, ref_losses) <= TOL, (sizes, style, fsdp, losses, ref_losses)
            x, y = batches[0]
            ev = hyb.eval_loss(hyb.local_batch(x), hyb.local_batch(y))
            got = hyb.full_state_dict()
            for k, v in want.items():
                assert _rel(got[k], v) <= TOL, (sizes, style, fsdp, k)
            with axonmpi.no_grad():
                logits, _ = ref(x)
                assert _rel(ev, F.cross_entropy(logits, y).item()) <= TOL, (sizes, style, fsdp, "eval")
        finally:
            grid.free()


@pytest.mark.mpi(min_size=2)
def test_token_mean_expert_parallel(world):
    """MoE experts split over an expert group (``expert_parallel``): the experts' gradients (tokens of every
    rank, reduced over the expert-data group) follow the same rule."""
    n = world.world_size
    ep = 2 if n % 2 == 0 else n
    grid = axonmpi.ProcessGrid(world, expert_parallel=ep)

    def make():
        axonmpi.manual_seed(5)
        return nn.Sequential(nn.Linear(D, 8, dtype=np.float64), nn.MoE(8, 2 * ep, top_k=2, hidden=12,
                                                                        dtype=np.float64),
                             nn.Linear(8, C, dtype=np.float64))

    try:
        x, y = _batch(4 * n)
        x, y = x[:, 0], y[:, 0]
        y[: n] = -100
        want, ref = _serial(x, y, make())
        pm = parallelize(make(), grid=grid, expert_parallel=ep)
        xb, yb = pm.local_batch(x, y)
        value, grads = _grads_by_sgd(pm, pm.parameters(), lambda: _contract(pm, xb, yb))
        assert _rel(value, want) <= TOL, (value, want)
        for k, p in ref.named_parameters():
            assert _rel(grads[k], p.grad.data) <= TOL, (k, _rel(grads[k], p.grad.data))
    finally:
        grid.free()


COMPOSED = {   # world size: [(grid sizes, tensor_parallel, data_parallel, schedule)]
    2: [({"G_inter": 2}, None, "ddp", "zbv")],
    4: [({"G_inter": 2}, None, "ddp", "1f1b"), ({"G_inter": 2}, None, "fsdp", "zb-h1"),
        ({"G_inter": 2, "G_intra_c": 2}, {"*.fc1": "column", "*.fc2": "row"}, "ddp", "interleaved"),
        ({"G_inter": 2, "G_intra_r": 2}, "axonn", "ddp", "gpipe")],
}


@pytest.mark.mpi(min_size=2)
def test_composed_pipeline_counts_tokens(world):
    """``parallelize(..., pipeline=PipelinePlan(...))``: ``pm.step`` gives the serial token mean and its
    gradients with unevenly ignored targets (data, the AxoNN tensor block and the micro-batches counted)."""
    from axonmpi.parallel import PipelinePlan

    def make():
        axonmpi.manual_seed(7)
        return nn.Sequential(nn.Linear(D, D, dtype=np.float64), Block(), Block(), nn.Linear(D, C, dtype=np.float64))

    for sizes, tp, dp, sched in COMPOSED.get(world.world_size, []):
        grid = axonmpi.ProcessGrid(world, **sizes)
        old, world.grid = world.grid, grid
        try:
            pm = parallelize(make(), grid=grid, tensor_parallel=tp, data_parallel=dp,
                             pipeline=PipelinePlan(num_microbatches=2 * grid.G_inter, schedule=sched))
            x, y = _batch(8 * pm.batch_shards[0])
            want, ref = _serial(x, y, make())
            xb, yb = pm.local_batch(x, y)
            value, grads = _grads_by_sgd(pm, pm.parameters(), lambda: pm.step(xb, yb))
            assert _rel(value, want) <= TOL, (sizes, tp, dp, sched, value, want)
            for k, p in ref.named_parameters():
                assert _rel(grads[k], p.grad.data) <= TOL, (sizes, tp, dp, sched, k)
        finally:
            world.grid = old
            grid.free()
