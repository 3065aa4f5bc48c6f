"""Conventions the composer relies on, checked or refused (issue 48, item 3).

A model written the way PyTorch users write it (nanoGPT's shape: its own ``LayerNorm``, ``CausalSelfAttention``
with one ``c_attn`` Linear, ``split`` / ``view`` / ``transpose`` and ``F.scaled_dot_product_attention``, an
``MLP``, a ``Block``, a ``GPT`` that numbers its own positions):

* inside a sequence-parallel region (TP 2 + SP; PP 2 x TP 2 + SP) its attention is refused at construction,
  naming ``path (module.Class)``, the axis and the fix; declared ``whole_sequence`` it equals serial (1e-10);
* under context parallelism (ring, Ulysses; x TP) a ``forward`` that numbers its own positions is refused
  naming the fix; with the documented two-line change (``positions=None``) it equals serial.
"""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.optim import AdamW
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.parallel import ModelPlan, PipelinePlan, SequenceRegion, full_state_dict, parallelize

TOL = 1e-10
V, C, H, T = 16, 8, 2, 8
D = np.float64


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias."""

    def __init__(self, ndim, bias=True):
        super().__init__()
        self.weight = nn.Parameter(np.ones(ndim, dtype=D))
        self.bias = nn.Parameter(np.zeros(ndim, dtype=D)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention (a name the library also uses: refusals qualify it by its module)."""

    def __init__(self, manual=False):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C, dtype=D)
        self.c_proj = nn.Linear(C, C, dtype=D)
        self.n_head, self.n_embd, self.manual = H, C, manual

    def forward(self, x):
        B, T_, C_ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T_, self.n_head, C_ // self.n_head).transpose(1, 2)
        q = q.view(B, T_, self.n_head, C_ // self.n_head).transpose(1, 2)
        v = v.view(B, T_, self.n_head, C_ // self.n_head).transpose(1, 2)
        if self.manual:
            att = (q @ k.transpose(-2, -1)) * (1.0 / np.sqrt(k.size(-1)))
            att = att.masked_fill(np.tril(np.ones((T_, T_))) == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T_, C_)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C, dtype=D)
        self.c_proj = nn.Linear(4 * C, C, dtype=D)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = LayerNorm(C), attn, LayerNorm(C), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model: numbers its own positions (``torch.arange(0, t)``)."""

    def __init__(self, attn=CausalSelfAttention, n_layer=2):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, C, dtype=D), wpe=nn.Embedding(T, C, dtype=D), drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(attn()) for _ in range(n_layer)]), ln_f=LayerNorm(C)))
        self.lm_head = nn.Linear(C, V, bias=False, dtype=D)

    def forward(self, idx):
        b, t = idx.size()
        pos = axonmpi.arange(0, t, dtype=axonmpi.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class PositionsGPT(GPT):
    """The documented change: ``positions=None`` taken and used when given."""

    def forward(self, idx, positions=None):
        b, t = idx.size()
        pos = positions if positions is not None else axonmpi.arange(0, t, dtype=axonmpi.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class Embed(nn.Module):
    """A pipeline's first layer written by a user: token and position embeddings."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C, dtype=D), nn.Embedding(T, C, dtype=D)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(axonmpi.arange(0, idx.shape[1], dtype=axonmpi.long))


class EmbedPositions(Embed):
    """The documented change: ``positions=None`` taken and used when given."""

    def forward(self, idx, positions=None):
        pos = positions if positions is not None else axonmpi.arange(0, idx.shape[1], dtype=axonmpi.long)
        return self.wte(idx) + self.wpe(pos)


def _sequential(attn=CausalSelfAttention, embed=Embed):
    return nn.Sequential(embed(), nn.Dropout(0.0), Block(attn()), Block(attn()), LayerNorm(C),
                         nn.Linear(C, V, bias=False, dtype=D))


SP_PLAN = {"transformer.h.*.mlp.c_fc": "column", "transformer.h.*.mlp.c_proj": "row", "lm_head": "column_gather"}
SP_REGION = SequenceRegion(enter="transformer.drop", leave="lm_head", outside=("transformer.wte", "transformer.wpe"))
PP_PLAN = {"*.mlp.c_fc": "column", "*.mlp.c_proj": "row", "5": "column_gather"}
PP_REGION = SequenceRegion(enter="1", leave="5", outside=("0",))
LOCAL = (GPT, PositionsGPT, Block, MLP, LayerNorm, Embed, EmbedPositions)


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1) if isinstance(y, Tensor) else Tensor(np.reshape(y, -1)))


def _data(n, rows):
    rng = np.random.default_rng(7)
    return [(rng.integers(0, V, (rows, T)), rng.integers(0, V, (rows, T))) for _ in range(n)]


def _parity(make, grid, steps=3, **kw):
    """``steps`` AdamW steps with clipping, serial vs ``parallelize(make(), **kw)``: the worst relative difference
    of the losses and of the parameters after."""
    axonmpi.manual_seed(3)
    serial = make()
    axonmpi.manual_seed(3)
    pm = parallelize(make(), grid=grid, **kw)
    opts = [AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (serial, pm)]
    worst = 0.0
    for x, y in _data(steps, 2 * grid.G_data):
        losses = []
        for m, opt in zip((serial, pm), opts):
            opt.zero_grad()
            if m is serial:
                loss = _loss(m(Tensor(x)), y)
                loss.backward()
                loss = float(loss.item())
            elif "pipeline" in kw:
                loss = float(pm.step(*pm.local_batch(x, y)))
            else:
                xb, yb = pm.local_batch(x, y)
                loss = _loss(pm(Tensor(xb)), yb)     # this rank's rows' (and tokens') mean: not the global one
                loss.backward()
                loss = None if kw.get("context_parallel") or grid.G_data > 1 else float(loss.item())
            clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            losses.append(loss)
        if losses[1] is not None:
            worst = max(worst, abs(losses[1] - losses[0]) / abs(losses[0]))
    sd = full_state_dict(pm)
    for k, v in serial.state_dict().items():
        worst = max(worst, float(np.max(np.abs(sd[k] - v)) / max(np.max(np.abs(v)), 1e-300)))
    return worst


def _grid(world, **sizes):
    n = int(np.prod(list(sizes.values())))
    if world.world_size % n:
        pytest.skip(f"needs a multiple of {n} ranks")
    return axonmpi.ProcessGrid(world, **sizes)


# -- the user's own attention in a sequence-parallel region ----------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("declared", [(), LOCAL])
def test_own_attention_refused_under_sequence_parallelism(world, declared):
    grid = _grid(world, G_intra_c=2)
    try:
        with pytest.raises(ValueError) as e:
            parallelize(GPT(), grid=grid, tensor_parallel=SP_PLAN, sequence_parallel=True,
                        model_plan=ModelPlan(sequence_region=SP_REGION, token_local=declared))
        msg = str(e.value)
        assert "'transformer.h.0.attn' (test_conventions.CausalSelfAttention)" in msg, msg
        assert "sequence parallelism" in msg and "whole_sequence=(CausalSelfAttention,)" in msg, msg
        if declared:        # the rest declared: only the attention is named
            assert "Block" not in msg.split("runs ")[1].split(" on part")[0], msg
        else:
            assert "'transformer.h.0' (test_conventions.Block)" in msg and "(test_conventions.GPT)" in msg, msg
    finally:
        grid.free()


@pytest.mark.mpi(min_size=4)
def test_own_attention_refused_under_pipeline_tp_sp(world):
    grid = _grid(world, G_inter=2, G_intra_c=2)
    try:
        with pytest.raises(ValueError, match=r"'2.attn' \(test_conventions.CausalSelfAttention\)"):
            parallelize(_sequential(), grid=grid, tensor_parallel=PP_PLAN, sequence_parallel=True,
                        pipeline=PipelinePlan(2, "1f1b", loss_fn=_loss),
                        model_plan=ModelPlan(sequence_region=PP_REGION, token_local=LOCAL))
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("manual", [False, True])
def test_declared_whole_sequence_attention_equals_serial(world, manual):
    grid = _grid(world, G_intra_c=2)
    try:
        plan = ModelPlan(sequence_region=SP_REGION, token_local=LOCAL, whole_sequence=(CausalSelfAttention,))
        worst = _parity(lambda: GPT(lambda: CausalSelfAttention(manual)), grid, tensor_parallel=SP_PLAN,
                        sequence_parallel=True, model_plan=plan)
        assert worst <= TOL, worst
    finally:
        grid.free()


@pytest.mark.mpi(min_size=4)
def test_declared_whole_sequence_attention_in_pipeline_equals_serial(world):
    grid = _grid(world, G_inter=2, G_intra_c=2)
    try:
        plan = ModelPlan(sequence_region=PP_REGION, token_local=LOCAL, whole_sequence=("*.attn",))
        worst = _parity(_sequential, grid, tensor_parallel=PP_PLAN, sequence_parallel=True, model_plan=plan,
                        pipeline=PipelinePlan(2, "1f1b", loss_fn=_loss))
        assert worst <= TOL, worst
    finally:
        grid.free()


def test_attention_style_on_own_class_names_both_classes():
    """The plan's 'attention' on the user's own class: both classes named with their modules."""
    from axonmpi.parallel.axes import tensor
    from axonmpi.parallel.axes.record import Composition

    class _G:
        rank = 0
    c = Composition(grid=_G(), tensor={"transformer.h.*.attn": "attention"})
    with pytest.raises(TypeError) as e:
        tensor._check_plan(GPT(), c)
    msg = str(e.value)
    assert "'transformer.h.0.attn' (test_conventions.CausalSelfAttention)" in msg, msg
    assert "axonmpi.nn.transformer.CausalSelfAttention" in msg, msg


def test_model_plan_declarations_checked():
    assert ModelPlan(token_local=Block).token_local == (Block,)
    assert ModelPlan(whole_sequence=["*.attn"]).whole_sequence == ("*.attn",)
    with pytest.raises(TypeError, match="token_local"):
        ModelPlan(token_local=(3,))


# -- positions under context parallelism -------------------------------------------------------------------------
def _cp_gpt(cls):
    return lambda: cls(attn=lambda: nn.CausalSelfAttention(C, 4, bias=True, dtype=D))   # Ulysses x TP 2: 4 heads


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_own_positions_refused_under_context_parallelism(world, algo):
    grid = _grid(world, G_context=2)
    try:
        with pytest.raises(ValueError) as e:
            parallelize(_cp_gpt(GPT)(), grid=grid, context_parallel=algo, model_plan=ModelPlan(token_local=LOCAL))
        msg = str(e.value)
        assert "(test_conventions.GPT)" in msg and "positions=None" in msg and "positions if positions" in msg, msg
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_unknown_modules_refused_under_context_parallelism(world, algo):
    grid = _grid(world, G_context=2)
    try:
        with pytest.raises(ValueError, match=r"context parallelism .*'transformer.h.0' \(test_conventions.Block\)"):
            parallelize(_cp_gpt(PositionsGPT)(), grid=grid, context_parallel=algo)
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_positions_taken_equals_serial_under_context_parallelism(world, algo):
    grid = _grid(world, G_context=2)
    try:
        worst = _parity(_cp_gpt(PositionsGPT), grid, context_parallel=algo, model_plan=ModelPlan(token_local=LOCAL))
        assert worst <= TOL, worst
    finally:
        grid.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_positions_under_context_and_tensor_parallelism(world, algo):
    grid = _grid(world, G_context=2, G_intra_c=2)
    plan = {"transformer.h.*.attn": "attention", "transformer.h.*.mlp.c_fc": "column",
            "transformer.h.*.mlp.c_proj": "row"}
    try:
        with pytest.raises(ValueError, match="positions=None"):
            parallelize(_cp_gpt(GPT)(), grid=grid, context_parallel=algo, tensor_parallel=plan,
                        model_plan=ModelPlan(token_local=LOCAL))
        worst = _parity(_cp_gpt(PositionsGPT), grid, context_parallel=algo, tensor_parallel=plan,
                        model_plan=ModelPlan(token_local=LOCAL))
        assert worst <= TOL, worst
    finally:
        grid.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_positions_under_context_parallelism_with_pipeline_and_fsdp(world, algo):
    """CP 2 x PP 2 (an nn.Sequential whose first layer is the user's embedding) and CP 2 x FSDP 2."""
    lib_attn = lambda: nn.CausalSelfAttention(C, 4, bias=True, dtype=D)     # noqa: E731
    plan = ModelPlan(token_local=LOCAL)
    grid = _grid(world, G_context=2, G_inter=2)
    try:
        pipe = dict(context_parallel=algo, model_plan=plan, pipeline=PipelinePlan(2, "1f1b", loss_fn=_loss))
        with pytest.raises(ValueError, match=r"'0' \(test_conventions.Embed\).*takes no positions="):
            parallelize(_sequential(lib_attn), grid=grid, **pipe)
        worst = _parity(lambda: _sequential(lib_attn, EmbedPositions), grid, **pipe)
        assert worst <= TOL, worst
    finally:
        grid.free()
    grid = _grid(world, G_context=2)
    try:
        worst = _parity(_cp_gpt(PositionsGPT), grid, context_parallel=algo, data_parallel="fsdp", model_plan=plan)
        assert worst <= TOL, worst
    finally:
        grid.free()


# -- a declared whole-sequence module under context parallelism (issue 48: was NotImplementedError) -----------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("manual", [False, True])
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_declared_whole_sequence_attention_under_context_parallelism(world, algo, manual):
    """The user's own attention declared ``whole_sequence``: each rank gathers the whole sequence for it (ring: its
    chunks put back in order) and keeps its tokens of the output; with positions taken, CP 2 equals serial."""
    grid = _grid(world, G_context=2)
    plan = ModelPlan(token_local=LOCAL, whole_sequence=(CausalSelfAttention,))
    try:
        with pytest.raises(ValueError, match=r"context parallelism .*'transformer.h.0.attn' "
                                             r"\(test_conventions.CausalSelfAttention\).*whole_sequence="):
            parallelize(PositionsGPT(lambda: CausalSelfAttention(manual)), grid=grid, context_parallel=algo,
                        model_plan=ModelPlan(token_local=LOCAL))
        worst = _parity(lambda: PositionsGPT(lambda: CausalSelfAttention(manual)), grid, context_parallel=algo,
                        model_plan=plan)
        assert worst <= TOL, worst
    finally:
        grid.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("algo", ["ring", "ulysses"])
def test_declared_whole_sequence_under_context_parallelism_with_pipeline_and_fsdp(world, algo):
    """CP 2 x PP 2 (the user's own attention in an nn.Sequential, its first layer taking positions) and CP 2 x FSDP 2;
    sequence and context parallelism at once with a whole_sequence module is refused, naming both."""
    plan = ModelPlan(token_local=LOCAL, whole_sequence=(CausalSelfAttention,))
    grid = _grid(world, G_context=2, G_inter=2)
    try:
        pipe = dict(context_parallel=algo, model_plan=plan, pipeline=PipelinePlan(2, "1f1b", loss_fn=_loss))
        worst = _parity(lambda: _sequential(CausalSelfAttention, EmbedPositions), grid, **pipe)
        assert worst <= TOL, worst
    finally:
        grid.free()
    grid = _grid(world, G_context=2)
    try:
        worst = _parity(lambda: PositionsGPT(CausalSelfAttention), grid, context_parallel=algo,
                        data_parallel="fsdp", model_plan=plan)
        assert worst <= TOL, worst
    finally:
        grid.free()
    grid = _grid(world, G_context=2, G_intra_c=2)
    try:
        with pytest.raises(NotImplementedError, match="not both at once"):
            parallelize(PositionsGPT(CausalSelfAttention), grid=grid, context_parallel=algo, sequence_parallel=True,
                        tensor_parallel=SP_PLAN, model_plan=ModelPlan(sequence_region=SP_REGION, token_local=LOCAL,
                                                                      whole_sequence=(CausalSelfAttention,)))
    finally:
        grid.free()
