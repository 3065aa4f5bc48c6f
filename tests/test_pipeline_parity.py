"""Pipeline parity: p stages by every schedule train exactly what one process trains on the global batch."""
import numpy as np
import pytest

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F
from axonmpi import Tensor
from axonmpi.models import GPT, GPTConfig
from axonmpi.optim import AdamW
from axonmpi.optim.clip import clip_grad_norm_
from axonmpi.parallel.pipeline import Pipeline, PipelineSchedule, make_schedule, split_module
from axonmpi.parallel.pipeline.runtime import _microbatch_seed

STEPS = 5
BATCH = 10          # uneven micro-batches on purpose
MAX_NORM = 0.05     # small enough that clipping is active


def _mlp(width=6, depth=8, dropout=0.0):
    axonmpi.random.manual_seed(11)
    layers = []
    for k in range(depth):
        layers.append(nn.Linear(5 if k == 0 else width, width, dtype=np.float64))
        layers.append(nn.Tanh() if k % 2 else nn.Dropout(dropout) if dropout else nn.ReLU())
    layers.append(nn.Linear(width, 3, dtype=np.float64))
    return nn.Sequential(*layers)


def _gpt(n_layer, dropout=0.0):
    axonmpi.random.manual_seed(5)
    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=n_layer, n_head=2, n_embd=8, dropout=dropout)
    return GPT(cfg, dtype=np.float64)


def _chunks_per_rank(kind):
    """Model chunks per rank: 2 for interleaved 1F1B and for ZBV's V, 1 otherwise."""
    return 2 if kind in (PipelineSchedule.INTERLEAVED_ONE_F_ONE_B, PipelineSchedule.ZBV) else 1


def _mlp_data(step, n=BATCH):
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((n, 5)), rng.integers(0, 3, n)


def _gpt_data(step, n=BATCH):
    rng = np.random.default_rng(200 + step)
    return rng.integers(0, 11, (n, 6)), rng.integers(0, 11, (n, 6))


class _Checkpointed(nn.Module):
    """A chunk whose forward is recomputed in backward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return nn.checkpoint(self.inner, x)


def _all_chunks(model, p, v):
    """Every chunk in global stage order (chunk s from pipeline rank s % p's split)."""
    per_rank = [split_module(model, p, v, rank=r) for r in range(p)]
    return [per_rank[s % p][s // p] for s in range(p * v)]


def _serial(make_model, data, p, v, m, microbatched):
    """Reference run in one process. Without dropout on the whole global batch at once; with dropout
    micro-batch by micro-batch with the pipeline's per-(step, stage, micro-batch) seeds."""
    model = make_model()
    opt = AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    chunks = _all_chunks(model, p, v)
    losses = []
    for t in range(STEPS):
        x, y = data(t)
        opt.zero_grad()
        if not microbatched:
            out = x
            for c in chunks:
                out = c(Tensor(out) if isinstance(out, np.ndarray) else out)
            loss = F.cross_entropy(out, Tensor(y))
            loss.backward()
            total = float(loss.item())
        else:
            sizes = [len(a) for a in np.array_split(np.arange(len(x)), m)]
            at, total = 0, 0.0
            for i, b in enumerate(sizes):
                out = Tensor(x[at:at + b])
                for s, c in enumerate(chunks):
                    with axonmpi.random.fork_rng(_microbatch_seed(axonmpi.random.initial_seed(), t, s, i)):
                        out = c(out)
                loss = F.cross_entropy(out, Tensor(y[at:at + b])) * (b / len(x))
                loss.backward()
                total += float(loss.item())
                at += b
        clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(total)
    return model, losses


def _pipelined(make_model, data, schedule, v, m, group, checkpointed=False, data_group=None, slice_data=None):
    model = make_model()
    chunks = split_module(model, group.size, v, group=group,
                          stage_ranks=make_schedule(schedule, group.size, m, v).stage_ranks)
    if checkpointed:
        chunks = [_Checkpointed(c) for c in chunks]
    pipe = Pipeline(chunks, schedule, num_microbatches=m, loss_fn=F.cross_entropy, group=group, virtual_stages=v,
                    data_group=data_group)
    params = pipe.parameters()
    opt = AdamW(params, lr=0.05, weight_decay=0.1)
    losses = []
    for t in range(STEPS):
        x, y = data(t)
        if slice_data is not None:
            x, y = slice_data(x), slice_data(y)
        opt.zero_grad()
        losses.append(pipe.step(x, y))
        clip_grad_norm_(params, MAX_NORM, group=group)
        opt.step()
    mine = {id(q) for q in params}
    return model, losses, {n for n, q in model.named_parameters() if id(q) in mine}, pipe


def _compare(world, ref, ref_losses, got, got_losses, names):
    np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-10, atol=0)
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert names, f"rank {world.rank} holds no parameters"
    for n in names:
        np.testing.assert_allclose(got_sd[n], ref_sd[n], rtol=1e-10, atol=1e-13, err_msg=n)
    # every parameter of the model is trained on exactly one pipeline rank
    counts = axonmpi.all_gather_object(sorted(names))
    return counts


def _gpt_setup(kind):
    """(world, p, v, m, n_layer) for a GPT run: enough layers for p v chunks, m a multiple of p when interleaved."""
    world = axonmpi.init()
    p = world.world_size
    v = _chunks_per_rank(kind)
    return world, p, v, (p if v > 1 else 3), max(1, p * v - 2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", list(PipelineSchedule))
def test_mlp_parity(kind):
    world = axonmpi.init()
    p = world.world_size
    v = _chunks_per_rank(kind)
    m = 2 * p if v > 1 else 4
    ref, ref_losses = _serial(_mlp, _mlp_data, p, v, m, microbatched=False)
    got, losses, names, _ = _pipelined(_mlp, _mlp_data, kind, v, m, world.default_group)
    all_names = _compare(world, ref, ref_losses, got, losses, names)
    flat = [n for part in all_names for n in part]
    assert sorted(flat) == sorted(n for n, _ in ref.named_parameters())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", list(PipelineSchedule))
def test_gpt_parity(kind):
    world, p, v, m, n_layer = _gpt_setup(kind)
    ref, ref_losses = _serial(lambda: _gpt(n_layer), _gpt_data, p, v, m, microbatched=False)
    got, losses, names, _ = _pipelined(lambda: _gpt(n_layer), _gpt_data, kind, v, m, world.default_group)
    _compare(world, ref, ref_losses, got, losses, names)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", list(PipelineSchedule))
def test_dropout_and_checkpointing_parity(kind):
    world, p, v, m, n_layer = _gpt_setup(kind)
    make = lambda: _gpt(n_layer, dropout=0.2)  # noqa: E731
    ref, ref_losses = _serial(make, _gpt_data, p, v, m, microbatched=True)
    got, losses, names, pipe = _pipelined(make, _gpt_data, kind, v, m, world.default_group, checkpointed=True)
    _compare(world, ref, ref_losses, got, losses, names)
    # the same run without checkpointing holds more activation bytes per micro-batch
    _, losses2, _, pipe2 = _pipelined(make, _gpt_data, kind, v, m, world.default_group)
    np.testing.assert_allclose(losses2, losses, rtol=1e-12)
    for s in pipe.memory_stats().stages:
        assert pipe.memory_stats().microbatch_bytes[s] < pipe2.memory_stats().microbatch_bytes[s]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("kind", list(PipelineSchedule))
def test_pipeline_x_data_parallel_2x2(kind):
    """4 ranks as 2 (data) x 2 (pipeline): world rank = 2 * data_index + pipeline_rank."""
    world = axonmpi.init()
    if world.world_size != 4:
        pytest.skip("the 2 x 2 layout needs exactly 4 ranks")
    d, r = divmod(world.rank, 2)
    pp = world.split(d, key=r)          # pp groups [0, 1], [2, 3]: same data index
    dp = world.split(r, key=d)          # dp groups [0, 2], [1, 3]: same stage
    v = _chunks_per_rank(kind)
    m = 2 if v > 1 else 3

    def data(t):                        # the global batch: 2 replicas x BATCH samples
        return _mlp_data(t, 2 * BATCH)

    ref, ref_losses = _serial(_mlp, data, 2, v, m, microbatched=False)
    got, losses, names, _ = _pipelined(_mlp, data, kind, v, m, pp, data_group=dp,
                                       slice_data=lambda a: a[d * BATCH:(d + 1) * BATCH])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    for n in names:
        np.testing.assert_allclose(got_sd[n], ref_sd[n], rtol=1e-10, atol=1e-13, err_msg=n)


def _gpt_data_ignored(step, n=BATCH):
    """GPT data whose micro-batches hold different numbers of ignore_index (-100) targets,
    one sequence wholly ignored."""
    x, y = _gpt_data(step, n)
    y = y.copy()
    y[0, :5] = -100
    y[1, :] = -100
    y[n - 1, 2:] = -100
    y[n // 2, ::2] = -100
    return x, y


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", [PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B])
def test_ignored_targets_parity(kind):
    """Issue 21: each micro-batch's mean was weighted by its sample count, not by its counted
    targets (rel. error 0.17-0.36 with ignore_index targets); now the pipeline equals the serial
    mean over the non-ignored targets."""
    world, p, v, m, n_layer = _gpt_setup(kind)
    ref, ref_losses = _serial(lambda: _gpt(n_layer), _gpt_data_ignored, p, v, 4, microbatched=False)
    got, losses, names, _ = _pipelined(lambda: _gpt(n_layer), _gpt_data_ignored, kind, v, 4, world.default_group)
    _compare(world, ref, ref_losses, got, losses, names)


@pytest.mark.mpi(min_size=4)
def test_ignored_targets_parity_with_data_parallel_2x2():
    """The replicas hold different numbers of counted targets: weighted over the data group too."""
    world = axonmpi.init()
    if world.world_size != 4:
        pytest.skip("the 2 x 2 layout needs exactly 4 ranks")
    d, r = divmod(world.rank, 2)
    pp, dp = world.split(d, key=r), world.split(r, key=d)

    def data(t):
        return _gpt_data_ignored(t, 2 * BATCH)

    ref, ref_losses = _serial(lambda: _gpt(2), data, 2, 1, 3, microbatched=False)
    got, losses, names, _ = _pipelined(lambda: _gpt(2), data, PipelineSchedule.ONE_F_ONE_B, 1, 3, pp,
                                       data_group=dp, slice_data=lambda a: a[d * BATCH:(d + 1) * BATCH])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0)
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    for n in names:
        np.testing.assert_allclose(got_sd[n], ref_sd[n], rtol=1e-10, atol=1e-13, err_msg=n)
