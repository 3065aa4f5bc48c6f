"""Issue 31 item 10: MoE with ``capacity_factor`` under data parallelism is the serial model.

The capacity is counted over the global batch (``ceil(c * global tokens * top_k / E)``) and each
rank drops exactly the assignments the serial model drops on the global batch: its place in every
expert's queue comes from one all-gather of the per-(choice, expert) counts (earlier choices of all
ranks, then the same choice of lower ranks).  Before, each rank applied the capacity to its own
batch: at 4 ranks the loss differed from serial by ~1e-3 relative.  Losses, clipped gradient norms,
weights, ``tokens_per_expert`` and ``dropped_tokens`` equal the serial model's (float64, 1e-10)
for DDP, FSDP, expert parallelism and tensor-parallel experts, top-1 and top-2."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, nn
from axonmpi.nn.moe import _capacity_keep

from test_moe_parallel import _data, _grid, _make, _train

CAP = 0.6        # well below 1: every step drops assignments


def _counts(model):
    return [(m.tokens_per_expert.tolist(), m.dropped_tokens, m.capacity) for m in (model.moe1, model.moe2)]


def _check(grid, k, **kw):
    worst, pm, serial, _ = _train(grid, 4, k, capacity_factor=CAP, **kw)
    # the last step's routing statistics: the serial model's on the global batch
    x, _ = _data(2)
    with axonmpi.no_grad():
        serial(Tensor(x))
        pm(Tensor(pm.local_batch(x, x)[0]))
    got, want = _counts(pm.inner), _counts(serial)
    assert got == want, f"rank {grid.rank}: (tokens per expert, dropped, capacity) {got} vs serial {want}"
    assert all(d > 0 for _, d, _ in want), "the test needs drops"
    stats = nn.moe_stats(pm.inner)
    assert stats["expert_capacity"] == want[0][2] and stats["dropped_tokens"] == sum(d for _, d, _ in want)
    return worst


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "expert_parallel", "tensor_experts"])
def test_capacity_parallel_equals_serial(k, layout):
    w = axonmpi.init()
    n = w.world_size
    if layout == "tensor_experts":
        if n % 2:
            pytest.skip("tensor-parallel experts need an even number of ranks")
        grid = _grid(G_intra_c=2, G_data=n // 2)
        kw = dict(tp="axonn", etp=True)
    else:
        kw = {"ddp": {}, "fsdp": dict(dp="fsdp")}.get(layout)
        if kw is None:
            if n % 2 and n != 3:
                pytest.skip("expert parallelism needs EP | ranks")
            kw = dict(ep=n if 4 % n == 0 else 1)
            if kw["ep"] == 1:
                pytest.skip(f"4 experts do not split over {n} ranks")
        grid = _grid(expert_parallel=kw.get("ep", 1))
    try:
        _check(grid, k, **kw)
    finally:
        grid.free()


def test_global_queue_offsets_give_the_serial_keep_mask():
    """Cut a batch into consecutive slices: the slices' keep masks with the global offsets are the
    serial keep mask (closed form, no MPI)."""
    from axonmpi.nn.moe import _global_queue
    rng = np.random.default_rng(0)
    E, k, N, P = 4, 2, 37, 3
    top = np.stack([rng.permutation(E)[:k] for _ in range(N)])
    cap = 9
    want = _capacity_keep(top, E, cap)
    cuts = [0, 10, 11, 37]

    class Fake:
        def __init__(self, r):
            self.rank, self.size = r, P
    import axonmpi.distributed as dist
    real = dist.all_gather
    parts = [top[a:b] for a, b in zip(cuts, cuts[1:])]
    rows = np.stack([np.concatenate([np.bincount(p[:, j], minlength=E) for j in range(k)] + [[len(p)]])
                     for p in parts])
    try:
        dist.all_gather = lambda x, group=None: rows
        got = np.concatenate([_capacity_keep(p, E, cap, _global_queue(p, E, len(p), Fake(r))[2])
                              for r, p in enumerate(parts)])
    finally:
        dist.all_gather = real
    np.testing.assert_array_equal(got, want)


def test_generate_routes_alone_so_one_data_rank_can_sample():
    """examples/train_gpt.py samples on rank 0 only; a data-parallel MoE GPT's forward all-reduced
    its routing statistics over the data group, so rank 0 waited for ranks that never came (the run
    hung after training, dropless or not). generate() now sets the statistics group aside."""
    from axonmpi.models import GPT, GPTConfig

    class Unreachable:           # a group whose collectives would hang: any use fails the test
        size = 2

        def __getattr__(self, name):
            raise AssertionError(f"generate used the data group ({name})")
    axonmpi.manual_seed(0)
    for cap in (None, 0.5):
        gpt = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, moe_experts=2, moe_top_k=2,
                            moe_capacity_factor=cap), dtype=np.float64)
        fake = Unreachable()
        gpt.blocks[0].mlp.stats_group = fake
        out = gpt.generate(np.zeros((1, 2), np.int64), 3)
        assert out.shape == (1, 5) and gpt.blocks[0].mlp.stats_group is fake
