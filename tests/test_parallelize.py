"""``parallelize`` on two models that are not the GPT, at 4 ranks, against the serial model on the global batch.

A residual MLP with LayerNorm (the Mixer shape) and a small attention encoder, under DDP, AxoNN
(2 data x 2 row), AxoNN (2 column x 2 depth), a Megatron plan (2 data x 2 tensor), FSDP over 4 and
FSDP (2 data) x AxoNN (2 row):
the loss at every step, the clip norm (clipping active) and the parameters after 3 AdamW steps
agree to 1e-10 (float64).  Pipelines over parallelized stages (PP 2 x TP 2, PP 2 x DP 2) likewise.
"""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.distributed.backends.counting import count_traffic
from axonmpi.optim import AdamW
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.parallel import Pipeline, PipelineSchedule, full_state_dict, parallelize

TOL = 1e-10
GB = 8
MAX_NORM = 0.05
STEPS = 3


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln = nn.LayerNorm(d, dtype=np.float64)
        self.fc1 = nn.Linear(d, h, dtype=np.float64)
        self.fc2 = nn.Linear(h, d, dtype=np.float64)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ResMLP(nn.Module):
    """The Mixer shape: embed -> residual blocks with LayerNorm -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8, dtype=np.float64)
        self.blocks = nn.Sequential(Block(8, 16), Block(8, 16))
        self.head = nn.Linear(8, 4, dtype=np.float64)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


class Encoder(nn.Module):
    """One pre-norm transformer encoder layer (2 heads, no mask) over (B, T, 5) inputs, mean-pooled."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.head_dim = d // heads
        self.embed = nn.Linear(5, d, dtype=np.float64)
        self.ln1 = nn.LayerNorm(d, dtype=np.float64)
        self.q = nn.Linear(d, d, dtype=np.float64)
        self.k = nn.Linear(d, d, dtype=np.float64)
        self.v = nn.Linear(d, d, dtype=np.float64)
        self.o = nn.Linear(d, d, dtype=np.float64)
        self.mlp = Block(d, 2 * d)
        self.head = nn.Linear(d, 3, dtype=np.float64)

    def forward(self, x):
        h = self.embed(x)
        a = self.ln1(h)
        b, t = a.shape[0], a.shape[1]

        def split(z):      # (B, T, H*D) -> (B, H, T, D); H is this rank's heads under a Megatron plan
            return z.reshape(b, t, z.shape[-1] // self.head_dim, self.head_dim).transpose(1, 2)
        q, k, v = split(self.q(a)), split(self.k(a)), split(self.v(a))
        att = F.softmax((q @ k.transpose(-2, -1)) * (1.0 / np.sqrt(self.head_dim)), -1)
        y = (att @ v).transpose(1, 2)
        y = y.reshape(b, t, y.shape[-2] * y.shape[-1])
        h = self.mlp(h + self.o(y))
        return self.head(h.mean(1))


MODELS = {
    "resmlp": (ResMLP, lambda s: np.random.default_rng(10 + s).standard_normal((GB, 6)), 4,
               {"blocks.*.fc1": "column", "blocks.*.fc2": "row"}),
    "encoder": (Encoder, lambda s: np.random.default_rng(20 + s).standard_normal((GB, 3, 5)), 3,
                {"q": "column", "k": "column", "v": "column", "o": "row", "mlp.fc1": "column", "mlp.fc2": "row"}),
}

LAYOUTS = {       # name: (grid sizes, tensor_parallel (MEGATRON: the model's plan), data_parallel)
    "ddp": ({}, None, "ddp"),
    "axonn_2data_2row": ({"G_intra_r": 2}, "axonn", "ddp"),
    "axonn_2col_2depth": ({"G_intra_c": 2, "G_intra_d": 2}, "axonn", "ddp"),
    "megatron_2data_2tensor": ({"G_intra_c": 2}, "MEGATRON", "ddp"),
    "fsdp4": ({}, None, "fsdp"),
    "fsdp2_x_axonn_2row": ({"G_intra_r": 2}, "axonn", "fsdp"),
    "fsdp2_x_megatron_2tensor": ({"G_intra_c": 2}, "MEGATRON", "fsdp"),
}


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300)
    assert err <= TOL, f"{what}: relative error {err:.3g}"
    return err


def _make(cls):
    axonmpi.manual_seed(4)
    return cls()


def _targets(step, classes):
    return np.random.default_rng(30 + step).integers(0, classes, GB)


def _serial_run(cls, data, classes):
    ref = _make(cls)
    opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for s in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(ref(Tensor(data(s))), _targets(s, classes))
        loss.backward()
        norms.append(clip_grad_norm_(ref.parameters(), MAX_NORM))
        opt.step()
        losses.append(float(loss.data))
    assert min(norms) > MAX_NORM      # clipping is active at every step
    return losses, norms, ref.state_dict()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_parallelize_matches_serial(world, model, layout):
    if world.world_size != 4:
        pytest.skip("the layouts are for 4 ranks")
    cls, data, classes, plan = MODELS[model]
    sizes, tp, dp = LAYOUTS[layout]
    tp = plan if tp == "MEGATRON" else tp
    want_losses, want_norms, want = _serial_run(cls, data, classes)
    grid = axonmpi.ProcessGrid(world, **sizes)
    try:
        pm = parallelize(_make(cls), grid=grid, tensor_parallel=tp, data_parallel=dp)
        opt = AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
        worst = 0.0
        for s in range(STEPS):
            xb, yb = pm.local_batch(data(s), _targets(s, classes))
            opt.zero_grad()
            loss = F.cross_entropy(pm(Tensor(xb)), yb)
            loss.backward()
            norm = clip_grad_norm_(pm.parameters(), MAX_NORM)
            opt.step()
            mean = float(axonmpi.all_reduce(np.array([float(loss.data)]))[0]) / world.world_size
            worst = max(worst, _close(mean, want_losses[s], f"{model}/{layout} step {s} loss"),
                        _close(norm, want_norms[s], f"{model}/{layout} step {s} clip norm"))
        got = full_state_dict(pm)
        assert list(got) == list(want)
        for k in want:
            worst = max(worst, _close(got[k], want[k], f"{model}/{layout} {k}"))
        if world.rank == 0:
            print(f"\nparity {model}/{layout}: worst relative error {worst:.2e}")
    finally:
        grid.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("sizes,plan", [({"G_inter": 2, "G_intra_c": 2}, "megatron"), ({"G_inter": 2}, None),
                                        ({"G_inter": 2, "G_intra_r": 2}, "axonn")],
                         ids=["pp2_tp2", "pp2_dp2", "pp2_axonn2"])
def test_pipeline_over_parallelized_stages_matches_serial(world, sizes, plan):
    """Stage 0 = embed + block 0, stage 1 = block 1 + head of the residual MLP, each parallelized
    (Megatron plan on the blocks, AxoNN easy mode, or nothing), in a Pipeline whose data group is the
    grid's; AxoNN stages are reduced by the Pipeline through the gradient-sync table."""
    if world.world_size != 4:
        pytest.skip("the layouts are for 4 ranks")
    want_losses, want_norms, want = _serial_run(ResMLP, MODELS["resmlp"][1], 4)
    data = MODELS["resmlp"][1]
    grid = axonmpi.ProcessGrid(world, **sizes)
    old, world.grid = world.grid, grid       # Pipeline and clip read the current grid
    try:
        full = _make(ResMLP)
        stage_id = grid.coords.inter
        stage = nn.Sequential(full.embed, full.blocks[0]) if stage_id == 0 else nn.Sequential(full.blocks[1], full.head)
        tp = {"*.fc1": "column", "*.fc2": "row"} if plan == "megatron" else plan
        pm = parallelize(stage, grid=grid, tensor_parallel=tp, data_parallel=None)
        # a Megatron tensor group holds the same boundary activations: each rank sends half of them
        scatter = grid.intra_group if plan == "megatron" else None
        pipe = Pipeline(pm, PipelineSchedule.ONE_F_ONE_B, num_microbatches=2, loss_fn=F.cross_entropy,
                        scatter_group=scatter)
        assert pipe.data_group is grid.data_group
        opt = AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
        for s in range(STEPS):
            xb, yb = pm.local_batch(data(s), _targets(s, 4))
            opt.zero_grad()
            with count_traffic() as c:
                loss = pipe.step(xb, yb)
            # per micro-batch an (rows/2, 8) activation one way and its gradient back, float64
            whole = 2 * 2 * (len(xb) // 2) * 8 * 8
            p2p = c.total("send", group="inter_group") + c.total("recv", group="inter_group")
            assert p2p == (whole // 2 if scatter is not None else whole) + (15 * 8 if s == 0 else 0)   # + the header once
            norm = clip_grad_norm_(pm.parameters(), MAX_NORM)
            opt.step()
            _close(loss, want_losses[s], f"step {s} loss")
            _close(norm, want_norms[s], f"step {s} clip norm")
        got = full_state_dict(pm)
        names = {0: ("embed.", "blocks.0."), 1: ("blocks.1.", "head.")}[stage_id]
        for k, v in got.items():           # "0.weight" -> the serial name of that part
            head, rest = k.split(".", 1)
            _close(v, want[names[int(head)] + rest], f"stage {stage_id}: {k}")
    finally:
        world.grid = old
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_options_not_built_raise(world):
    if world.world_size % 2:
        pytest.skip("needs an even world")
    grid = axonmpi.ProcessGrid(world, G_intra_c=2)
    try:
        with pytest.raises(ValueError, match="needs a grid with G_context > 1"):
            parallelize(_make(ResMLP), grid=grid, tensor_parallel={"*.fc1": "column"}, context_parallel="ring")
        with pytest.raises(ValueError, match="tensor_parallel is None"):
            parallelize(_make(ResMLP), grid=grid, data_parallel="ddp")
        with pytest.raises(ValueError, match="no module of the model matches"):
            parallelize(_make(ResMLP), grid=grid, tensor_parallel={"nothing*": "column"})
    finally:
        grid.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("saved", sorted(LAYOUTS))
def test_a_checkpoint_of_each_layout_loads_under_every_other_and_into_the_plain_module(world, saved, tmp_path_factory):
    """``pm.sharded_state_dict()`` saved under one layout; ``checkpoint.load`` (full arrays) into every
    layout's ``pm.load_state_dict`` and into the serial module gives the same serial state."""
    if world.world_size != 4:
        pytest.skip("the layouts are for 4 ranks")
    cls, data, classes, plan = MODELS["resmlp"]
    path = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("pz")) if world.rank == 0 else None) + "/ckpt"

    def build(layout, seed):
        sizes, tp, dp = LAYOUTS[layout]
        grid = axonmpi.ProcessGrid(world, **sizes)
        axonmpi.manual_seed(seed)
        return grid, parallelize(cls(), grid=grid, tensor_parallel=plan if tp == "MEGATRON" else tp,
                                 data_parallel=dp)

    grid, pm = build(saved, 4)
    try:
        opt = AdamW(pm.parameters(), lr=1e-2)
        xb, yb = pm.local_batch(data(0), _targets(0, classes))
        F.cross_entropy(pm(Tensor(xb)), yb).backward()
        opt.step()
        want = full_state_dict(pm)
        axonmpi.checkpoint.save(path, {"model": pm.sharded_state_dict()})
    finally:
        grid.free()
    loaded = axonmpi.checkpoint.load(path, None)["model"]
    for layout in sorted(LAYOUTS):
        grid, pm2 = build(layout, 99)
        try:
            pm2.load_state_dict(loaded)
            got = full_state_dict(pm2)
            for k in want:
                _close(got[k], want[k], f"saved {saved}, loaded {layout}: {k}")
        finally:
            grid.free()
    plain = _make(cls)
    plain.load_state_dict({k: np.asarray(v).reshape(np.shape(want[k])) for k, v in loaded.items()})
    for k, v in plain.state_dict().items():
        _close(v, want[k], f"saved {saved}, loaded serial: {k}")


RESUME = [(k, k) for k in sorted(LAYOUTS) if k not in ("fsdp2_x_axonn_2row", "fsdp2_x_megatron_2tensor")] + [
    ("megatron_2data_2tensor", "fsdp4"), ("fsdp4", "axonn_2col_2depth"), ("axonn_2data_2row", "ddp"),
    ("ddp", "megatron_2data_2tensor")]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("saved,resumed", RESUME, ids=[f"{a}->{b}" for a, b in RESUME])
def test_training_state_resumes_under_any_layout(world, saved, resumed, tmp_path_factory):
    """``training_state(pm, opt)`` after 2 AdamW steps (clipping on) under one layout, restored under
    another, 2 more steps: the parameters equal the serial model's after 4 steps.  Tensor-parallel
    optimizer moments are saved as blocks under serial names (a rank's shard never overwrites another's)."""
    if world.world_size != 4:
        pytest.skip("the layouts are for 4 ranks")
    cls, data, classes, plan = MODELS["resmlp"]
    path = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("rs")) if world.rank == 0 else None)
    ref = _make(cls)
    ropt = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for s in range(4):
        ropt.zero_grad()
        F.cross_entropy(ref(Tensor(data(s))), _targets(s, classes)).backward()
        clip_grad_norm_(ref.parameters(), MAX_NORM)
        ropt.step()

    def run(layout, seed, steps, load=False):
        # FSDP stores flattened blocks, the others blocks of the serial shapes: between the two, load
        # the full arrays (no template); otherwise this layout's training_state is the template
        same_form = (LAYOUTS[saved][2] == "fsdp") == (LAYOUTS[layout][2] == "fsdp")
        sizes, tp, dp = LAYOUTS[layout]
        grid = axonmpi.ProcessGrid(world, **sizes)
        try:
            axonmpi.manual_seed(seed)
            pm = parallelize(cls(), grid=grid, tensor_parallel=plan if tp == "MEGATRON" else tp, data_parallel=dp)
            opt = AdamW(pm.parameters(), lr=1.0)
            mgr = axonmpi.checkpoint.CheckpointManager(path)
            if load:
                template = axonmpi.checkpoint.training_state(pm, opt, step=0) if same_form else None
                loaded = mgr.load_latest(template)
                assert axonmpi.checkpoint.restore_training_state(loaded, pm, opt)["step"] == 2
            else:
                opt.param_groups[0].update(lr=1e-2, weight_decay=0.1)
            for s in steps:
                xb, yb = pm.local_batch(data(s), _targets(s, classes))
                opt.zero_grad()
                F.cross_entropy(pm(Tensor(xb)), yb).backward()
                clip_grad_norm_(pm.parameters(), MAX_NORM)
                opt.step()
            if not load:
                state = axonmpi.checkpoint.training_state(pm, opt, step=2)
                if tp is not None:
                    blocks = [v for st in state["optimizer"]["state"].values() for v in st.values()
                              if isinstance(v, axonmpi.checkpoint.ShardedArray)]
                    assert blocks, "tensor-parallel moments must be saved as blocks"
                mgr.save(2, state)
            return full_state_dict(pm)
        finally:
            grid.free()

    run(saved, 4, range(2))
    got = run(resumed, 99, range(2, 4), load=True)
    want = ref.state_dict()
    for k in want:
        _close(got[k], want[k], f"{saved} -> {resumed}: {k}")
