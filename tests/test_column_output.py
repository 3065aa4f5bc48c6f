"""Issue 30 item 6: the output keeps the serial shape.

A Megatron plan that maps the output layer to ``"column"`` gave each tensor rank its half of the logits
(shape (4, 3) where the serial model gives (4, 6)) and a loss on them ran without complaint.  Now such a
plan raises at the first forward, naming the layer and the fix, and ``"column_gather"`` all-gathers the
layer's output (PyTorch's ``ColwiseParallel(output_layouts=Replicate())``): ``pm(x)`` has the serial
shape and training equals the serial model (float64, 1e-10), with sequence parallelism too.
"""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.optim import SGD
from axonmpi.parallel import ModelPlan, full_state_dict, parallelize

D, H, C = 6, 12, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D, dtype=np.float64)
        self.fc1 = nn.Linear(D, H, dtype=np.float64)
        self.fc2 = nn.Linear(H, D, dtype=np.float64)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, act=False):
        super().__init__()
        self.embed = nn.Linear(D, D, dtype=np.float64)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, C, dtype=np.float64)
        self.act = act

    def forward(self, x, positions=None):      # numbers no positions (sequence parallelism asks)
        y = self.head(self.blocks(self.embed(x)))
        return F.gelu(y) if self.act else y


def _make(act=False):
    axonmpi.manual_seed(11)
    return Net(act)


def _grid(world):
    n = world.world_size
    return axonmpi.ProcessGrid(world, G_intra_c=2 if n % 2 == 0 else n)


PLAN = {"blocks.*.fc1": "column", "blocks.*.fc2": "row"}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("act", [False, True], ids=["logits", "gelu_of_logits"])
def test_column_output_layer_raises_naming_it(world, act):
    grid = _grid(world)
    try:
        pm = parallelize(_make(act), grid=grid, tensor_parallel={**PLAN, "head": "column"})
        x = np.random.default_rng(1).standard_normal((4, D))
        with pytest.raises(ValueError) as e:
            pm(Tensor(x))
        msg = str(e.value)
        assert f"rank {world.rank}:" in msg and "'head'" in msg and "'column_gather'" in msg, msg
        assert f"{C // grid.intra_group.size} of its {C} output features" in msg, msg
        if not act:                                   # without a graph too (the output is the column's array)
            with axonmpi.no_grad(), pytest.raises(ValueError, match="'head'"):
                pm(Tensor(x))
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_paired_columns_and_a_replicated_head_do_not_raise(world):
    grid = _grid(world)
    try:
        pm = parallelize(_make(), grid=grid, tensor_parallel=PLAN)
        x = np.random.default_rng(1).standard_normal((4, D))
        assert pm(Tensor(x)).shape == (4, C)
        assert pm(Tensor(x)).shape == (4, C)          # the hooks are gone after one checked forward
        assert not pm.inner.blocks[0].fc1._forward_hooks and not pm.inner._forward_hooks
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_column_gather_keeps_the_serial_shape_and_trains_as_serial(world, sp):
    grid = _grid(world)
    try:
        rng = np.random.default_rng(2)
        shape = (2 * grid.G_data, 2 * grid.intra_group.size, D) if sp else (4 * grid.G_data, D)
        x = rng.standard_normal(shape)
        y = rng.integers(0, C, shape[:-1])
        ref = _make()
        want = F.cross_entropy(ref(Tensor(x)), y)
        want.backward()
        pm = parallelize(_make(), grid=grid, tensor_parallel={**PLAN, "head": "column_gather"},
                         sequence_parallel=sp, sequence_dim=1 if sp else 0,
                         model_plan=ModelPlan(token_local=(Net, Block)))
        xb, yb = pm.local_batch(x, y)
        before = {k: np.array(v, copy=True) for k, v in full_state_dict(pm).items()}
        opt = SGD(pm.parameters(), lr=1.0)
        opt.zero_grad()
        out = pm(Tensor(xb))
        assert out.shape == ref(Tensor(xb)).shape               # the serial shape
        loss = F.cross_entropy(out, yb)
        loss.backward()
        opt.step()
        value = float(axonmpi.all_reduce(np.array([loss.item()]), op="mean", group=grid.data_group)[0])
        assert abs(value - want.item()) <= 1e-10 * want.item()
        after = full_state_dict(pm)
        for k, p in ref.named_parameters():
            g = before[k] - after[k]
            err = np.abs(g - p.grad.data).max() / np.abs(p.grad.data).max()
            assert err <= 1e-10, (k, err)
    finally:
        grid.free()


@pytest.mark.mpi(min_size=2)
def test_a_loss_over_split_logits_is_paired(world):
    """A column head whose split logits feed ``vocab_parallel_cross_entropy`` (Megatron's loss over the
    vocabulary shards) leaves the region whole: the loss is the serial one and nothing raises."""
    from axonmpi.parallel.tensor import vocab_parallel_cross_entropy
    grid = _grid(world)
    old, world.grid = world.grid, grid
    try:
        class WithLoss(Net):
            def forward(self, x, y):
                logits = self.head(self.blocks(self.embed(x)))
                if logits.shape[-1] == C:                     # the serial model
                    return F.cross_entropy(logits, y)
                return vocab_parallel_cross_entropy(logits, y, grid.intra_group)

        rng = np.random.default_rng(3)
        x, y = rng.standard_normal((4, D)), rng.integers(0, C, 4)
        axonmpi.manual_seed(11)
        want = WithLoss()(Tensor(x), y).item()
        axonmpi.manual_seed(11)
        pm = parallelize(WithLoss(), grid=grid, tensor_parallel={**PLAN, "head": "column"}, data_parallel=None)
        loss = pm(Tensor(x), y)
        loss.backward()
        assert abs(loss.item() - want) <= 1e-12 * want
    finally:
        world.grid = old
        grid.free()
