"""The one finalize step: every hooked reduction is bucketed (one collective per bucket, not one per parameter)
and equals the serial model; it runs once per backward pass, at the end of the outermost one."""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.autograd import backward_depth, queue_callback
from axonmpi.distributed.backends.counting import count_traffic
from axonmpi.distributed.placement import placement_of
from axonmpi.parallel import ModelPlan, parallelize

F64 = np.float64


class _Net(nn.Module):
    """LayerNorm / MLP / LayerNorm / MLP / head: 4 LayerNorm parameters, 2 row biases, the replicated input and head, all
    used on sequence shards under sequence parallelism."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8, dtype=F64)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            blk = nn.Module()
            blk.ln, blk.fc, blk.proj = nn.LayerNorm(8, dtype=F64), nn.Linear(8, 16, dtype=F64), nn.Linear(16, 8, dtype=F64)
            self.blocks.append(blk)
        self.head = nn.Linear(8, 4, dtype=F64)

    def forward(self, x, positions=None):      # numbers no positions (sequence parallelism asks)
        h = self.inp(x)
        for b in self.blocks:
            h = h + b.proj(F.gelu(b.fc(b.ln(h))))
        return self.head(h)


@pytest.mark.mpi(min_size=2)
def test_sequence_parallel_sums_are_one_collective_per_bucket(world):
    """Megatron TP 2 + SP: the 10 parameters used on sequence shards (LayerNorms, row biases, the replicated input
    and head layers) are summed over the tensor group in one all-reduce per step (one bucket: one dtype), and the
    gradients equal the serial model's."""
    if world.world_size % 2:
        pytest.skip("G_intra_c=2 needs an even number of ranks")
    grid = axonmpi.ProcessGrid(world, G_intra_c=2)
    try:
        axonmpi.manual_seed(3)
        serial = _Net()
        axonmpi.manual_seed(3)
        pm = parallelize(_Net(), grid=grid, tensor_parallel={"blocks.*.fc": "column", "blocks.*.proj": "row"},
                         sequence_parallel=True, data_parallel=None if grid.G_data == 1 else "ddp",
                         model_plan=ModelPlan(token_local=(_Net,)))
        partial = [p for p in pm.inner.parameters() if placement_of(p).partial_groups]
        assert len(partial) == 10
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((2 * grid.G_data, 4, 6)), rng.integers(0, 4, (2 * grid.G_data, 4))
        F.cross_entropy(serial(Tensor(x)), y).backward()
        xb, yb = pm.local_batch(x, y)
        out = pm(Tensor(xb))
        loss = F.cross_entropy(out, yb)
        with count_traffic() as c:
            loss.backward()
        # blocking, or launched during backward as the bucket fills (GradReducer.arm(as_ready=True))
        reductions = sum(c.calls(group=grid.intra_group.name, method=m) for m in ("allreduce", "iallreduce"))
        assert reductions == 1, f"{reductions} all-reduces over the tensor group: one per bucket expected"
        got = axonmpi.parallel.ShardedState(pm.inner)
        for n, p in serial.named_parameters():
            g = axonmpi.parallel.placed.gather(pm.inner.get_parameter(n).grad.data, got.placement(n))
            np.testing.assert_allclose(np.asarray(g), p.grad.data, rtol=1e-10, atol=1e-13, err_msg=n)
    finally:
        grid.free()


def test_queue_callback_runs_once_at_the_end_of_the_outermost_pass():
    """A callback queued from a hook inside a checkpoint's recomputation pass runs once, after the outer pass."""
    order = []
    lin = nn.Linear(3, 3, dtype=F64)
    head = nn.Linear(3, 1, dtype=F64)

    def hook(p):
        order.append(("hook", backward_depth()))
        if len(order) == 1:
            queue_callback(lambda: order.append(("end", backward_depth(), head.weight.grad is not None)))
    lin.weight.register_post_accumulate_grad_hook(hook)
    y = head(nn.checkpoint(lin, Tensor(np.ones((2, 3)), requires_grad=True)))
    y.sum().backward()
    assert order[0] == ("hook", 2)               # inside the recomputation's pass
    assert order[-1] == ("end", 1, True)         # after it, in the outer pass, with every gradient in place
    assert sum(1 for o in order if o[0] == "end") == 1
    with pytest.raises(RuntimeError, match="no backward pass is running"):
        queue_callback(lambda: None)
