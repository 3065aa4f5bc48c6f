"""A parameter keeps its identity under every layout (issue 48, items 1 and 2).

A nanoGPT-shaped model written as users write it (its own attention, ``configure_optimizers`` choosing the
decayed group by ``p.dim() >= 2`` as nanoGPT does, or by module class and name as minGPT does, a head tied to
the embedding) under FSDP (each strategy), FSDP x Megatron, ZeRO-1, Megatron TP, AxoNN, DDP and a pipeline, at
4 ranks: the optimizer is built from the user's model object after ``parallelize`` or before it (nanoGPT's
``train.py`` order); names, classes, serial shapes and the param groups equal the serial model's; after 3 AdamW
steps with clipping (float64) the parameters equal the serial run's to 1e-10.
"""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.optim import AdamW, ZeroRedundancyOptimizer
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.parallel import FSDP, full_state_dict, parallelize
from axonmpi.parallel.module import PipelinedModule
from axonmpi.parallel.plan import PipelinePlan

TOL = 1e-10
GB, T, V, E, H, L = 8, 8, 32, 16, 2, 2
STEPS = 3
MAX_NORM = 0.5


class SelfAttention(nn.Module):
    """The user's own causal attention (nanoGPT's, not the library's nn.CausalSelfAttention)."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(E, 3 * E, dtype=np.float64)
        self.c_proj = nn.Linear(E, E, dtype=np.float64)

    def forward(self, x):
        B, t, C = x.size()
        q, k, v = self.c_attn(x).split(E, dim=2)
        q, k, v = (z.view(B, t, H, C // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, t, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(E, 4 * E, dtype=np.float64)
        self.c_proj = nn.Linear(4 * E, E, dtype=np.float64)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(E, dtype=np.float64)
        self.attn = SelfAttention()
        self.ln_2 = nn.LayerNorm(E, dtype=np.float64)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embed(nn.Module):
    def __init__(self, wte, wpe):
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx):
        idx = idx.data if isinstance(idx, Tensor) else idx
        return self.wte(idx) + self.wpe(np.arange(idx.shape[1]))


class Head(nn.Module):
    def __init__(self, ln_f, lm_head):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """nanoGPT's model.py shape: 28 parameters, 10 of them with dim() >= 2 (the head tied to wte)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, E, dtype=np.float64)
        self.wpe = nn.Embedding(T, E, dtype=np.float64)
        self.h = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = nn.LayerNorm(E, dtype=np.float64)
        self.lm_head = nn.Linear(E, V, bias=False, dtype=np.float64)
        self.lm_head.weight = self.wte.weight

    def pipeline_layers(self):
        return [Embed(self.wte, self.wpe), *self.h, Head(self.ln_f, self.lm_head)]

    def forward(self, idx):
        x = Embed(self.wte, self.wpe)(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def by_dim(model):
    """nanoGPT's configure_optimizers: every 2-D tensor decayed, biases and norms not."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]


def by_name(model):
    """minGPT's configure_optimizers: Linear weights decayed; biases, LayerNorm and Embedding weights not (a
    weight tied between an Embedding and a Linear head is the Embedding's: not decayed)."""
    decay, no_decay = set(), set()
    for mn, m in model.named_modules():
        for pn, p in m.named_parameters(recurse=False):
            if pn.endswith("bias") or isinstance(m, (nn.LayerNorm, nn.Embedding)):
                no_decay.add(id(p))
            elif pn.endswith("weight") and isinstance(m, nn.Linear):
                decay.add(id(p))
    decay -= no_decay
    params = [p for _, p in model.named_parameters()]
    return [{"params": [p for p in params if id(p) in decay], "weight_decay": 0.1},
            {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0}]


RULES = {"dim": by_dim, "name": by_name}


def _make():
    axonmpi.manual_seed(3)
    return GPT()


def _batch(step):
    rng = np.random.default_rng(40 + step)
    return rng.integers(0, V, (GB, T)), rng.integers(0, V, (GB, T))


def _loss(logits, y):
    y = y.data if isinstance(y, Tensor) else y
    return F.cross_entropy(logits.view(-1, V), np.asarray(y).reshape(-1))


def _serial_optimizer_state(rule):
    model = _make()
    opt = AdamW(RULES[rule](model), lr=1e-2, betas=(0.9, 0.95))
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        _loss(model(x), y).backward()
        clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: st for p, st in opt.state.items()}


def _names(groups, model):
    ids = {id(p): n for n, p in model.named_parameters()}
    return [sorted(ids[id(p)] for p in g["params"]) for g in groups]


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300) if want.size else 0.0
    assert err <= TOL, f"{what}: relative error {err:.3g}"


def _serial(rule):
    model = _make()
    groups = RULES[rule](model)
    opt = AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    norms = []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        _loss(model(x), y).backward()
        norms.append(clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
    assert min(norms) > MAX_NORM         # clipping is active at every step
    return model.state_dict(), _names(groups, model)


_MLP = {"h.*.mlp.c_fc": "column", "h.*.mlp.c_proj": "row"}
LAYOUTS = {   # name: (grid sizes, parallelize options)
    "ddp": ({}, {}),
    "fsdp_full_shard": ({}, {"data_parallel": "fsdp", "sharding_strategy": "FULL_SHARD"}),
    "fsdp_shard_grad_op": ({}, {"data_parallel": "fsdp", "sharding_strategy": "SHARD_GRAD_OP"}),
    "fsdp_hybrid_shard": ({}, {"data_parallel": "fsdp", "sharding_strategy": "HYBRID_SHARD", "hybrid_shard_size": 2}),
    "fsdp2_x_megatron2": ({"G_intra_c": 2}, {"data_parallel": "fsdp", "tensor_parallel": _MLP}),
    "megatron2": ({"G_intra_c": 2}, {"tensor_parallel": _MLP}),
    "megatron2_vocab": ({"G_intra_c": 2}, {"tensor_parallel": {**_MLP, "wte": "vocab", "lm_head": "column_gather"}}),
    "axonn_2row": ({"G_intra_r": 2}, {"tensor_parallel": "axonn"}),
    "axonn_2col_2depth": ({"G_intra_c": 2, "G_intra_d": 2}, {"tensor_parallel": "axonn"}),
    "zero1": ({}, {}),
    "pp2_dp2": ({"G_inter": 2}, {"pipeline": PipelinePlan(num_microbatches=2, schedule="1f1b", loss_fn=_loss)}),
    "pp2_fsdp2": ({"G_inter": 2}, {"data_parallel": "fsdp",
                                   "pipeline": PipelinePlan(num_microbatches=2, schedule="1f1b", loss_fn=_loss)}),
}


def _optimizer(layout, groups):
    if layout == "zero1":
        return ZeroRedundancyOptimizer(groups, AdamW, lr=1e-2, betas=(0.9, 0.95))
    return AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


def _train(pm, model, opt, world):
    for s in range(STEPS):
        x, y = _batch(s)
        xb, yb = pm.local_batch(x, y)
        opt.zero_grad()
        if isinstance(pm, PipelinedModule):
            pm.step(xb, yb)
        else:
            _loss(pm(xb), yb).backward()
        clip_grad_norm_(model.parameters(), MAX_NORM)    # the user's model object, as nanoGPT clips
        opt.step()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_user_param_groups_match_serial(world, layout, rule, when):
    """Names, classes, serial shapes and groups as serially; parameters equal the serial run's after 3 steps,
    whether the optimizer was built from the user's model after ``parallelize`` or before it."""
    if world.world_size != 4:
        pytest.skip("the layouts are for 4 ranks")
    want, want_groups = _serial(rule)
    sizes, opts = LAYOUTS[layout]
    serial = _make()
    serial_names = [(n, tuple(p.shape), p.dim(), p.numel()) for n, p in serial.named_parameters()]
    serial_classes = [(n, type(m)) for n, m in serial.named_modules()]
    grid = axonmpi.ProcessGrid(world, **sizes)
    old, world.grid = world.grid, grid
    try:
        model = _make()
        opt = _optimizer(layout, RULES[rule](model)) if when == "before" else None
        pm = parallelize(model, grid=grid, **opts)
        got_names = [(n, tuple(p.shape), p.dim(), p.numel()) for n, p in model.named_parameters()]
        assert got_names == serial_names, layout
        for (n, cls), (n2, m) in zip(serial_classes, model.named_modules()):
            assert n == n2 and isinstance(m, cls), f"{layout}: {n!r} is a {type(m).__name__}, not a {cls.__name__}"
        assert [n for n, _ in pm.named_modules()] == [n for n, _ in serial_classes]     # the wrapper's: serial too
        assert [m for _, m in pm.named_modules()][1:] == [m for _, m in model.named_modules()][1:]
        groups = RULES[rule](model)
        assert _names(groups, model) == want_groups
        if opt is None:
            opt = _optimizer(layout, groups)
        _train(pm, model, opt, world)
        got = full_state_dict(pm)
        assert list(got) == list(want)
        for k in want:
            _close(got[k], want[k], f"{layout}/{rule}/{when}: {k}")
    finally:
        world.grid = old
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_fsdp_wrapper_keeps_user_parameters(world):
    """FSDP alone: the user's parameters report their serial shapes while their storage is released, and
    ``to_local()`` is this rank's piece of the flat chunk; an optimizer on them equals one on the flat shards."""
    model = _make()
    serial = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    fsdp = FSDP(model)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == serial
    pieces = sum(p.to_local().data.size for p in model.parameters())
    total = sum(f.data.size for f in fsdp.parameters())
    assert pieces == total                       # each chunk element belongs to exactly one parameter
    w = model.h[0].mlp.c_fc.weight
    assert w.shape == (4 * E, E) and w.dim() == 2 and w.numel() == 4 * E * E and w.to_local().data.ndim == 1


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_parameter_reports_serial_shape(world):
    """A Megatron column weight: the serial object, its serial shape; ``to_local()`` and ``.data`` its shard."""
    grid = axonmpi.ProcessGrid(world, G_intra_c=2, G_data=world.world_size // 2) if world.world_size % 2 == 0 \
        else None
    if grid is None:
        pytest.skip("needs an even number of ranks")
    try:
        model = _make()
        w = model.h[0].mlp.c_fc.weight
        parallelize(model, grid=grid, tensor_parallel=_MLP)
        assert model.h[0].mlp.c_fc.weight is w
        assert w.shape == (4 * E, E) and w.size(0) == 4 * E and w.numel() == 4 * E * E
        assert w.to_local().shape == (2 * E, E) and w.data.shape == (2 * E, E)
    finally:
        grid.free()


def test_replaced_parameter_raises_at_step():
    """A parameter a transform dropped: the optimizer that holds it raises at its first step, naming the fix."""
    from axonmpi.parallel.swap import mark_replaced
    lin = nn.Linear(3, 2, dtype=np.float64)
    opt = AdamW(lin.parameters(), lr=0.1)
    holder = nn.Linear(3, 2, dtype=np.float64)
    mark_replaced(list(lin.parameters()), holder, "a test transform")
    with pytest.raises(RuntimeError, match=r"build the optimizer from pm.parameters\(\) after parallelize"):
        opt.step()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["fsdp_full_shard", "fsdp2_x_megatron2", "pp2_fsdp2", "axonn_2row"])
def test_optimizer_on_user_parameters_saves_and_loads(world, layout):
    """The optimizer built from the user's parameters (under FSDP: the originals, stepping their pieces of the
    flat chunks): its state under serial names equals the serial optimizer's, and loads back into a new one."""
    if world.world_size != 4:
        pytest.skip("the layouts are for 4 ranks")
    want = _serial_optimizer_state("dim")
    sizes, opts = LAYOUTS[layout]
    grid = axonmpi.ProcessGrid(world, **sizes)
    old, world.grid = world.grid, grid
    try:
        model = _make()
        pm = parallelize(model, grid=grid, **opts)
        opt = AdamW(by_dim(model), lr=1e-2, betas=(0.9, 0.95))
        _train(pm, model, opt, world)
        st = pm.sharded_state()
        full = st.full_optim_state_dict(opt)["state"]
        assert sorted(full) == sorted(want)
        for n, w in want.items():
            assert full[n]["step"] == w["step"]
            for k in ("exp_avg", "exp_avg_sq"):
                _close(full[n][k], w[k], f"{layout}: {n} {k}")
        opt2 = AdamW(by_dim(model), lr=1e-2, betas=(0.9, 0.95))
        pm.load_optim_state_dict(opt2, pm.optim_state_dict(opt))
        again = pm.sharded_state().full_optim_state_dict(opt2)["state"]
        for n, w in want.items():
            for k in ("exp_avg", "exp_avg_sq"):
                _close(again[n][k], w[k], f"{layout}: {n} {k} after loading")
    finally:
        world.grid = old
        grid.free()
