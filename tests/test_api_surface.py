"""Every exported name works: each public method of ``Tensor`` and each exported name of
``axonmpi``, ``axonmpi.nn``, ``axonmpi.nn.functional`` and ``axonmpi.optim`` is called on small
inputs, and public functions/classes of autograd, nn and optim carry a docstring.

The names are read from the modules (``__all__``, else ``dir()``); ``EXAMPLES`` holds one small
call per name.  A name without an entry fails ``test_name_works`` -- add one line to ``EXAMPLES``
(the only place to edit).  Entries for names a module does not have are ignored, so branches that
add or remove exports merge without touching this file's logic.
"""
import __future__
import importlib
import inspect
import math
import pkgutil
import types

import os

import numpy as np
import pytest

import axonmpi
from axonmpi import nn, optim
from axonmpi.autograd import Tensor
from axonmpi.nn import functional as F

NAMESPACES = {"axonmpi": axonmpi, "axonmpi.nn": nn, "axonmpi.nn.functional": F, "axonmpi.optim": optim}


def _x(*shape, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape or (2, 3)), requires_grad=True,
                  dtype=np.float64)


def _close(t, want):
    np.testing.assert_allclose(t.numpy() if isinstance(t, Tensor) else np.asarray(t), want, rtol=1e-12, atol=1e-12)
    return True


def _backward_ok(out, *leaves):
    out.sum().backward() if out.numel() > 1 else out.backward()
    assert all(p.grad is not None and np.isfinite(p.grad.numpy()).all() for p in leaves)
    return True


def _model():
    return nn.Sequential(nn.Linear(3, 4, dtype=np.float64), nn.ReLU(), nn.Linear(4, 2, dtype=np.float64))


def _train_step(opt_cls, **kw):
    m = _model()
    opt = opt_cls(m.parameters(), **kw)
    before = m[0].weight.numpy()
    m(_x(5, 3)).pow(2).mean().backward()
    opt.step()
    assert not np.allclose(before, m[0].weight.numpy())
    return True


def _plateau():
    opt = optim.SGD(_model().parameters(), lr=1.0)
    s = optim.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    for loss in (1.0, 1.0, 1.0):
        s.step(loss)
    return s.get_last_lr() == [0.25]


def _scheduler(cls, *args, **kw):
    opt = optim.SGD(_model().parameters(), lr=1.0)
    s = cls(opt, *args, **kw)
    for _ in range(3):
        opt.step()
        s.step()
    assert len(s.get_last_lr()) == 1 and math.isfinite(s.get_last_lr()[0])
    return True


def _grads(*gs):
    ps = []
    for g in gs:
        p = nn.Parameter(np.zeros(len(g)))
        p.grad = Tensor(np.asarray(g, dtype=np.float64))
        ps.append(p)
    return ps


def _p2p_self(fn, *args):
    """Point-to-point with this rank itself is refused loudly (the exchange is tested at 2-4 ranks
    in test_collectives.py); the call must name the rank and the peer."""
    with pytest.raises(ValueError, match=f"rank {axonmpi.rank()}: (src|dst)={axonmpi.rank()} is this rank itself"):
        fn(*args, axonmpi.rank())
    return True


def _ddp():
    m = axonmpi.DDP(_model())
    out = m(_x(4, 3))
    return _backward_ok(out, m.module[0].weight)


def _fsdp():
    m = axonmpi.FSDP(_model(), sharding_strategy=axonmpi.ShardingStrategy.FULL_SHARD)
    before = [p.numpy().copy() for p in m.parameters()]
    opt = optim.Adam(m.parameters(), lr=0.1)
    m(_x(4, 3)).pow(2).mean().backward()
    opt.step()
    return list(m.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"] and not all(
        np.allclose(b, p.numpy()) for b, p in zip(before, m.parameters()))


def _sampler():
    s = axonmpi.DistributedSampler(list(range(7)), num_replicas=1, rank=0, shuffle=False)
    return list(s) == list(range(7))


def _dataloader():
    dl = axonmpi.create_dataloader(axonmpi.data.TensorDataset(np.arange(8.0)), global_batch_size=4, shuffle=False)
    return len(list(dl)) == 2


def _module_api():
    m = _model()
    sd = m.state_dict()
    m.load_state_dict(sd)
    return list(sd) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def _parameter_tagging():
    p = nn.Parameter(np.zeros(2))
    p.shard_group = None
    return p.requires_grad


X, W, IDX = _x(2, 3), _x(4, 3, seed=1), np.array([[0, 3], [1, 1]])
M = np.array([[True, False, True], [False, False, True]])

# "namespace.name" -> a small call; truthy or an exception-free run is success
def _profile():
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        with axonmpi.profile(d) as tr:
            axonmpi.all_reduce(np.ones(2))
        return os.path.exists(os.path.join(d, f"trace_rank{tr.rank}.json"))


EXAMPLES = {
    # ---- axonmpi ---------------------------------------------------------------------------
    "axonmpi.DDP": _ddp,
    "axonmpi.DistributedDataParallel": lambda: axonmpi.DistributedDataParallel is axonmpi.DDP or _ddp(),
    "axonmpi.FSDP": _fsdp,
    "axonmpi.FullyShardedDataParallel": lambda: axonmpi.FullyShardedDataParallel is axonmpi.FSDP or _fsdp(),
    "axonmpi.ShardingStrategy": lambda: axonmpi.ShardingStrategy.coerce("full_shard") is axonmpi.ShardingStrategy.FULL_SHARD,
    "axonmpi.CPUOffload": lambda: axonmpi.CPUOffload.coerce(True) is axonmpi.CPUOffload.FULL,
    "axonmpi.MixedPrecision": lambda: axonmpi.MixedPrecision(param_dtype=np.float16).param_dtype == np.float16,
    "axonmpi.Device": lambda: str(axonmpi.Device("cuda:1")) == "cuda:1",
    "axonmpi.DistributedSampler": _sampler,
    "axonmpi.Function": lambda: axonmpi.Function.apply is not None,
    "axonmpi.GradSyncStrategy": lambda: len(list(axonmpi.GradSyncStrategy)) >= 2,
    "axonmpi.ProcessGroup": lambda: isinstance(axonmpi.get_world().default_group, axonmpi.ProcessGroup),
    "axonmpi.ReduceOp": lambda: axonmpi.ReduceOp.SUM is not None,
    "axonmpi.Tensor": lambda: axonmpi.Tensor([1.0]).dtype == np.float32,
    "axonmpi.Work": lambda: axonmpi.Work(result=3).wait() == 3,
    "axonmpi.World": lambda: isinstance(axonmpi.get_world(), axonmpi.World),
    "axonmpi.all_gather": lambda: _close(axonmpi.all_gather(np.ones(2)), np.ones(2 * axonmpi.world_size())),
    "axonmpi.all_gather_object": lambda: axonmpi.all_gather_object(5) == [5] * axonmpi.world_size(),
    "axonmpi.all_reduce": lambda: _close(axonmpi.all_reduce(np.ones(2)), [axonmpi.world_size()] * 2),
    "axonmpi.all_reduce_max": lambda: _close(axonmpi.all_reduce_max(np.ones(2)), [1, 1]),
    "axonmpi.all_reduce_mean": lambda: _close(axonmpi.all_reduce_mean(np.ones(2)), [1, 1]),
    "axonmpi.all_reduce_min": lambda: _close(axonmpi.all_reduce_min(np.ones(2)), [1, 1]),
    "axonmpi.all_reduce_product": lambda: _close(axonmpi.all_reduce_product(np.ones(2)), [1, 1]),
    "axonmpi.all_reduce_sum": lambda: _close(axonmpi.all_reduce_sum(np.ones(2)), [axonmpi.world_size()] * 2),
    "axonmpi.all_to_all": lambda: axonmpi.all_to_all(np.ones(axonmpi.world_size())).shape == (axonmpi.world_size(),),
    "axonmpi.arange": lambda: axonmpi.arange(3).tolist() == [0, 1, 2],
    "axonmpi.barrier": lambda: axonmpi.barrier() is None,
    "axonmpi.broadcast": lambda: _close(axonmpi.broadcast(np.ones(2)), [1, 1]),
    "axonmpi.broadcast_object": lambda: axonmpi.broadcast_object({"a": 1}) == {"a": 1},
    "axonmpi.create_dataloader": _dataloader,
    "axonmpi.empty": lambda: axonmpi.empty(2, 3).shape == (2, 3),
    "axonmpi.enable_grad": lambda: axonmpi.enable_grad()(lambda: axonmpi.is_grad_enabled())(),
    "axonmpi.full": lambda: axonmpi.full((2,), 3).tolist() == [3, 3],
    "axonmpi.gather": lambda: axonmpi.gather(np.ones(1)) is not None or axonmpi.rank() != 0,
    "axonmpi.gather_object": lambda: axonmpi.gather_object(1) == [1] * axonmpi.world_size() or axonmpi.rank() != 0,
    "axonmpi.get_array_module": lambda: axonmpi.get_array_module(np.ones(1)) is np,
    "axonmpi.get_logger": lambda: axonmpi.get_logger("axonmpi.api_surface").name == "axonmpi.api_surface",
    "axonmpi.get_world": lambda: axonmpi.get_world().world_size == axonmpi.world_size(),
    "axonmpi.get_grid": lambda: axonmpi.get_grid().G_data == axonmpi.world_size(),
    "axonmpi.P2POp": lambda: axonmpi.P2POp(axonmpi.isend, np.zeros(2), 0).peer == 0,
    "axonmpi.batch_isend_irecv": lambda: [w.wait() for w in axonmpi.batch_isend_irecv([
        axonmpi.P2POp(axonmpi.isend, np.arange(2.0), axonmpi.rank()),
        axonmpi.P2POp(axonmpi.irecv, np.zeros(2), axonmpi.rank())])][1].tolist() == [0.0, 1.0],
    "axonmpi.GridCoords": lambda: axonmpi.GridCoords(0, 0, 0, 0, 1).col == 1,
    "axonmpi.ProcessGrid": lambda: isinstance(axonmpi.get_grid(), axonmpi.ProcessGrid)
    and axonmpi.get_grid().rank_of(axonmpi.get_grid().coords) == axonmpi.rank(),
    "axonmpi.gradcheck": lambda: axonmpi.gradcheck(lambda t: t * t, [_x(3)]),
    "axonmpi.init": lambda: axonmpi.init() is axonmpi.get_world(),
    "axonmpi.irecv": lambda: _p2p_self(axonmpi.irecv, np.zeros(2)),
    "axonmpi.is_grad_enabled": lambda: axonmpi.is_grad_enabled() is True,
    "axonmpi.is_initialized": lambda: axonmpi.is_initialized(),
    "axonmpi.is_main_process": lambda: axonmpi.is_main_process() == (axonmpi.rank() == 0),
    "axonmpi.isend": lambda: _p2p_self(axonmpi.isend, np.zeros(2)),
    "axonmpi.manual_seed": lambda: axonmpi.manual_seed(1) is None,
    "axonmpi.no_grad": lambda: not axonmpi.no_grad()(lambda: axonmpi.is_grad_enabled())(),
    "axonmpi.ones": lambda: axonmpi.ones(2).tolist() == [1.0, 1.0],
    "axonmpi.ones_like": lambda: axonmpi.ones_like(X).shape == X.shape,
    "axonmpi.print0": lambda: axonmpi.print0("api surface check") is None,
    "axonmpi.profile": _profile,
    "axonmpi.print_rank": lambda: axonmpi.print_rank("api surface check") is None,
    "axonmpi.rand": lambda: axonmpi.rand(3).shape == (3,),
    "axonmpi.randn": lambda: axonmpi.randn(2, 2).shape == (2, 2),
    "axonmpi.rank": lambda: 0 <= axonmpi.rank() < axonmpi.world_size(),
    "axonmpi.recv": lambda: _p2p_self(axonmpi.recv, np.zeros(2)),
    "axonmpi.reduce": lambda: axonmpi.reduce(np.ones(2)) is not None or axonmpi.rank() != 0,
    "axonmpi.reduce_scatter": lambda: axonmpi.reduce_scatter(np.ones(axonmpi.world_size())).shape == (1,),
    "axonmpi.reduce_scatter_mean": lambda: _close(axonmpi.reduce_scatter_mean(np.ones(axonmpi.world_size())), [1]),
    "axonmpi.reduce_scatter_sum": lambda: axonmpi.reduce_scatter_sum(np.ones(axonmpi.world_size())).shape == (1,),
    "axonmpi.scatter": lambda: axonmpi.scatter([np.ones(1)] * axonmpi.world_size()).shape == (1,),
    "axonmpi.send": lambda: _p2p_self(axonmpi.send, np.zeros(2)),
    "axonmpi.set_grad_enabled": lambda: axonmpi.set_grad_enabled(True) is not None and axonmpi.is_grad_enabled(),
    "axonmpi.tensor": lambda: axonmpi.tensor([1, 2]).dtype == np.int64,
    "axonmpi.world_size": lambda: axonmpi.world_size() >= 1,
    "axonmpi.zeros": lambda: axonmpi.zeros(2).tolist() == [0.0, 0.0],
    "axonmpi.zeros_like": lambda: axonmpi.zeros_like(X).shape == X.shape,
    # ---- axonmpi.nn ------------------------------------------------------------------------
    "axonmpi.nn.CausalSelfAttention": lambda: _backward_ok(nn.CausalSelfAttention(4, 2, dtype=np.float64)(_x(1, 3, 4)), ),
    "axonmpi.nn.Dropout": lambda: nn.Dropout(0.5).eval()(X) is X,
    "axonmpi.nn.Embedding": lambda: nn.Embedding(4, 2)([0, 3]).shape == (2, 2),
    "axonmpi.nn.Flatten": lambda: nn.Flatten()(_x(2, 3, 4)).shape == (2, 12),
    "axonmpi.nn.GELU": lambda: nn.GELU()(X).shape == X.shape,
    "axonmpi.nn.Identity": lambda: nn.Identity()(X) is X,
    "axonmpi.nn.IncompatibleKeys": lambda: nn.IncompatibleKeys([], []).missing_keys == [],
    "axonmpi.nn.LayerNorm": lambda: _close(nn.LayerNorm(3, dtype=np.float64)(X).mean(dim=-1), [0, 0]),
    "axonmpi.nn.Linear": lambda: nn.Linear(3, 5)(X.float()).shape == (2, 5),
    "axonmpi.nn.Checkpointed": lambda: _close(nn.Checkpointed(nn.Tanh())(_x(2, 3)), np.tanh(_x(2, 3).data)),
    "axonmpi.nn.checkpoint": lambda: _close(nn.checkpoint(lambda t: (t * t).sum(), _x(3)).item(),
                                            float((_x(3).data ** 2).sum())),
    "axonmpi.nn.checkpoint_sequential": lambda: _close(
        nn.checkpoint_sequential([nn.Tanh(), nn.Tanh()], 2, _x(2, 3)).data, np.tanh(np.tanh(_x(2, 3).data))),
    "axonmpi.nn.MLP": lambda: nn.MLP(4, dtype=np.float64)(_x(2, 4)).shape == (2, 4),
    "axonmpi.nn.MoE": lambda: _backward_ok(nn.MoE(4, num_experts=3, top_k=2, dtype=np.float64)(_x(2, 4))),
    "axonmpi.nn.moe_losses": lambda: nn.moe_losses(nn.MLP(4)) is None,
    "axonmpi.nn.moe_stats": lambda: nn.moe_stats(nn.MLP(4)) == {},
    "axonmpi.nn.Module": _module_api,
    "axonmpi.nn.ModuleDict": lambda: list(nn.ModuleDict({"a": nn.ReLU()})) == ["a"],
    "axonmpi.nn.ModuleList": lambda: len(nn.ModuleList([nn.ReLU(), nn.Tanh()])) == 2,
    "axonmpi.nn.Parameter": _parameter_tagging,
    "axonmpi.nn.ReLU": lambda: _close(nn.ReLU()(X), np.maximum(X.numpy(), 0)),
    "axonmpi.nn.Sequential": lambda: _model()(_x(2, 3)).shape == (2, 2),
    "axonmpi.nn.SiLU": lambda: nn.SiLU()(X).shape == X.shape,
    "axonmpi.nn.Sigmoid": lambda: _close(nn.Sigmoid()(X), 1 / (1 + np.exp(-X.numpy()))),
    "axonmpi.nn.Softmax": lambda: _close(nn.Softmax(dim=1)(X).sum(dim=1), [1, 1]),
    "axonmpi.nn.Tanh": lambda: _close(nn.Tanh()(X), np.tanh(X.numpy())),
    "axonmpi.nn.GroupedQueryAttention": lambda: _backward_ok(nn.GroupedQueryAttention(4, 2, 1, dtype=np.float64)(
        _x(1, 3, 4), nn.RotaryEmbedding(2)(_x(1, 3, 4)))),
    "axonmpi.nn.RMSNorm": lambda: _close((nn.RMSNorm(3, eps=0.0, dtype=np.float64)(X) ** 2).mean(dim=-1), [1, 1]),
    "axonmpi.nn.RotaryEmbedding": lambda: _close(nn.RotaryEmbedding(2)(X, np.array([0, 1]))[0], np.cos([[0, 0], [1, 1]])),
    "axonmpi.nn.SwiGLU": lambda: nn.SwiGLU(3, 5, dtype=np.float64)(X).shape == X.shape,
    "axonmpi.nn.TransformerBlock": lambda: nn.TransformerBlock(4, 2, dtype=np.float64)(_x(1, 3, 4)).shape == (1, 3, 4),
    # ---- axonmpi.nn.functional -------------------------------------------------------------
    "axonmpi.nn.functional.MinMax": lambda: F.max(X, 1).indices.dtype == np.int64,
    "axonmpi.nn.functional.abs": lambda: _close(F.abs(X), np.abs(X.numpy())),
    "axonmpi.nn.functional.add": lambda: _close(F.add(X, 1.0), X.numpy() + 1),
    "axonmpi.nn.functional.amax": lambda: _close(F.amax(X, dim=1), X.numpy().max(1)),
    "axonmpi.nn.functional.amin": lambda: _close(F.amin(X, 0), X.numpy().min(0)),
    "axonmpi.nn.functional.argmax": lambda: _close(F.argmax(X, dim=1), X.numpy().argmax(1)),
    "axonmpi.nn.functional.argmin": lambda: _close(F.argmin(X, 1), X.numpy().argmin(1)),
    "axonmpi.nn.functional.cat": lambda: F.cat([X, X], dim=1).shape == (2, 6),
    "axonmpi.nn.functional.chunk": lambda: len(F.chunk(X, 3, dim=1)) == 3,
    "axonmpi.nn.functional.clamp": lambda: _close(F.clamp(X, 0.0, 0.5), np.clip(X.numpy(), 0, 0.5)),
    "axonmpi.nn.functional.clip": lambda: _close(F.clip(X, max=0.0), np.minimum(X.numpy(), 0)),
    "axonmpi.nn.functional.concat": lambda: F.concat([X, X]).shape == (4, 3),
    "axonmpi.nn.functional.cos": lambda: _close(F.cos(X), np.cos(X.numpy())),
    "axonmpi.nn.functional.cross_entropy": lambda: _backward_ok(F.cross_entropy(_x(2, 3), [0, 2])),
    "axonmpi.nn.functional.div": lambda: _close(F.div(X, 2.0), X.numpy() / 2),
    "axonmpi.nn.functional.dropout": lambda: F.dropout(X, 0.5, training=False) is X,
    "axonmpi.nn.functional.dropout_add": lambda: _close(F.dropout_add(X, X, 0.5, training=False), 2 * X.numpy()),
    "axonmpi.nn.functional.embedding": lambda: _close(F.embedding(IDX, W), W.numpy()[IDX]),
    "axonmpi.nn.functional.exp": lambda: _close(F.exp(X), np.exp(X.numpy())),
    "axonmpi.nn.functional.expand": lambda: F.expand(_x(1, 3), 4, 3).shape == (4, 3),
    "axonmpi.nn.functional.flatten": lambda: F.flatten(X).shape == (6,),
    "axonmpi.nn.functional.gelu": lambda: F.gelu(X, approximate="tanh").shape == X.shape,
    "axonmpi.nn.functional.apply_rotary_emb": lambda: _close(F.apply_rotary_emb(
        Tensor(np.array([1.0, 0.0])), np.full(2, 0.0), np.full(2, 1.0)), [0.0, 1.0]),   # a quarter turn
    "axonmpi.nn.functional.rms_norm": lambda: _close(F.rms_norm(Tensor(np.array([3.0, 4.0])), 2, eps=0.0),
                                                     np.array([3.0, 4.0]) / np.sqrt(12.5)),
    "axonmpi.nn.functional.swiglu": lambda: _close(F.swiglu(X, X), X.numpy() ** 2 / (1 + np.exp(-X.numpy()))),
    "axonmpi.nn.functional.layer_norm": lambda: F.layer_norm(X, 3).shape == X.shape,
    "axonmpi.nn.functional.linear": lambda: _close(F.linear(X, W), X.numpy() @ W.numpy().T),
    "axonmpi.nn.functional.log": lambda: _close(F.log(F.exp(X)), X.numpy()),
    "axonmpi.nn.functional.log_softmax": lambda: _close(F.log_softmax(X, dim=1).exp().sum(dim=1), [1, 1]),
    "axonmpi.nn.functional.masked_fill": lambda: _close(F.masked_fill(X, M, 0.0), np.where(M, 0, X.numpy())),
    "axonmpi.nn.functional.matmul": lambda: _close(F.matmul(X, W.t()), X.numpy() @ W.numpy().T),
    "axonmpi.nn.functional.max": lambda: _close(F.max(X), X.numpy().max()),
    "axonmpi.nn.functional.maximum": lambda: _close(F.maximum(X, 0.0), np.maximum(X.numpy(), 0)),
    "axonmpi.nn.functional.mean": lambda: _close(F.mean(X, dim=0), X.numpy().mean(0)),
    "axonmpi.nn.functional.min": lambda: _close(F.min(X, dim=0).values, X.numpy().min(0)),
    "axonmpi.nn.functional.minimum": lambda: _close(F.minimum(X, 0.0), np.minimum(X.numpy(), 0)),
    "axonmpi.nn.functional.mse_loss": lambda: _close(F.mse_loss(X, X * 0.0), (X.numpy() ** 2).mean()),
    "axonmpi.nn.functional.l1_loss": lambda: _close(F.l1_loss(X, X * 0.0), np.abs(X.numpy()).mean()),
    "axonmpi.nn.functional.smooth_l1_loss": lambda: _backward_ok(F.smooth_l1_loss(_x(2, 3), np.zeros((2, 3)))),
    "axonmpi.nn.functional.nll_loss": lambda: _close(F.nll_loss(Tensor(np.array([[-0.5, -1.5]])), [1]), 1.5),
    "axonmpi.nn.functional.binary_cross_entropy": lambda: _close(
        F.binary_cross_entropy(Tensor(np.array([0.5])), np.array([1.0])), np.log(2.0)),
    "axonmpi.nn.functional.binary_cross_entropy_with_logits": lambda: _close(
        F.binary_cross_entropy_with_logits(Tensor(np.array([0.0])), np.array([1.0])), np.log(2.0)),
    "axonmpi.nn.CrossEntropyLoss": lambda: _backward_ok(nn.CrossEntropyLoss()(_x(2, 3), [0, 2])),
    "axonmpi.nn.NLLLoss": lambda: _close(nn.NLLLoss(reduction="sum")(Tensor(np.array([[-0.5, -1.5]])), [0]), 0.5),
    "axonmpi.nn.MSELoss": lambda: _close(nn.MSELoss()(X, X * 0.0), (X.numpy() ** 2).mean()),
    "axonmpi.nn.L1Loss": lambda: _close(nn.L1Loss(reduction="sum")(X, X * 0.0), np.abs(X.numpy()).sum()),
    "axonmpi.nn.SmoothL1Loss": lambda: _close(nn.SmoothL1Loss(beta=1.0)(Tensor(np.array([0.5])), np.zeros(1)), 0.125),
    "axonmpi.nn.BCELoss": lambda: _close(nn.BCELoss()(Tensor(np.array([0.5])), np.array([0.0])), np.log(2.0)),
    "axonmpi.nn.BCEWithLogitsLoss": lambda: _close(nn.BCEWithLogitsLoss()(Tensor(np.array([0.0])), np.array([0.0])), np.log(2.0)),
    "axonmpi.nn.functional.mul": lambda: _close(F.mul(X, X), X.numpy() ** 2),
    "axonmpi.nn.functional.neg": lambda: _close(F.neg(X), -X.numpy()),
    "axonmpi.nn.functional.permute": lambda: F.permute(X, 1, 0).shape == (3, 2),
    "axonmpi.nn.functional.pow": lambda: _close(F.pow(X, 2), X.numpy() ** 2),
    "axonmpi.nn.functional.relu": lambda: _close(F.relu(X), np.maximum(X.numpy(), 0)),
    "axonmpi.nn.functional.reshape": lambda: F.reshape(X, (3, 2)).shape == (3, 2),
    "axonmpi.nn.functional.sigmoid": lambda: F.sigmoid(X).shape == X.shape,
    "axonmpi.nn.functional.silu": lambda: F.silu(X).shape == X.shape,
    "axonmpi.nn.functional.sin": lambda: _close(F.sin(X), np.sin(X.numpy())),
    "axonmpi.nn.functional.softmax": lambda: _close(F.softmax(X, dim=1).sum(dim=1), [1, 1]),
    # one query per key (causal), all-equal scores: row i averages values 0..i
    "axonmpi.nn.functional.scaled_dot_product_attention": lambda: _close(F.scaled_dot_product_attention(
        Tensor(np.zeros((1, 3, 2))), Tensor(np.zeros((1, 3, 2))), Tensor(np.array([[[3.0, 0], [1, 0], [2, 0]]])),
        is_causal=True)[0, :, 0], [3.0, 2.0, 2.0]),
    "axonmpi.nn.functional.split": lambda: [p.shape for p in F.split(X, 2, dim=1)] == [(2, 2), (2, 1)],
    "axonmpi.nn.functional.sqrt": lambda: _close(F.sqrt(X * X), np.abs(X.numpy())),
    "axonmpi.nn.functional.squeeze": lambda: F.squeeze(_x(1, 3)).shape == (3,),
    "axonmpi.nn.functional.stack": lambda: F.stack([X, X], dim=0).shape == (2, 2, 3),
    "axonmpi.nn.functional.std": lambda: _close(F.std(X, dim=1), X.numpy().std(1, ddof=1)),
    "axonmpi.nn.functional.sub": lambda: _close(F.sub(X, X), 0),
    "axonmpi.nn.functional.sum": lambda: _close(F.sum(X, dim=1), X.numpy().sum(1)),
    "axonmpi.nn.functional.tanh": lambda: _close(F.tanh(X), np.tanh(X.numpy())),
    "axonmpi.nn.functional.transpose": lambda: F.transpose(X, 0, 1).shape == (3, 2),
    "axonmpi.nn.functional.unsqueeze": lambda: F.unsqueeze(X, -1).shape == (2, 3, 1),
    "axonmpi.nn.functional.var": lambda: _close(F.var(X, dim=1), X.numpy().var(1, ddof=1)),
    "axonmpi.nn.functional.where": lambda: _close(F.where(M, X, 0.0), np.where(M, X.numpy(), 0)),
    # ---- axonmpi.optim ---------------------------------------------------------------------
    "axonmpi.optim.Adam": lambda: _train_step(optim.Adam, lr=0.1),
    "axonmpi.optim.AdamW": lambda: _train_step(optim.AdamW, lr=0.1, weight_decay=0.1),
    "axonmpi.optim.ZeroRedundancyOptimizer": lambda: _train_step(
        lambda ps, **kw: optim.ZeroRedundancyOptimizer(ps, optim.Adam, **kw), lr=0.1),
    "axonmpi.optim.SGD": lambda: _train_step(optim.SGD, lr=0.1, momentum=0.9),
    "axonmpi.optim.Optimizer": lambda: isinstance(optim.SGD(_model().parameters(), lr=0.1), optim.Optimizer),
    "axonmpi.optim.LRScheduler": lambda: _scheduler(optim.StepLR, 1) and issubclass(optim.StepLR, optim.LRScheduler),
    "axonmpi.optim.StepLR": lambda: _scheduler(optim.StepLR, step_size=2, gamma=0.5),
    "axonmpi.optim.CosineAnnealingLR": lambda: _scheduler(optim.CosineAnnealingLR, T_max=4),
    "axonmpi.optim.LinearWarmupCosine": lambda: _scheduler(optim.LinearWarmupCosine, warmup_steps=1, total_steps=4),
    "axonmpi.optim.LambdaLR": lambda: _scheduler(optim.LambdaLR, lambda t: 0.5 ** t),
    "axonmpi.optim.lr_scheduler": lambda: optim.lr_scheduler.StepLR is optim.StepLR,
    "axonmpi.optim.LinearLR": lambda: _scheduler(optim.LinearLR, start_factor=0.5, total_iters=2),
    "axonmpi.optim.ExponentialLR": lambda: _scheduler(optim.ExponentialLR, gamma=0.9),
    "axonmpi.optim.MultiStepLR": lambda: _scheduler(optim.MultiStepLR, milestones=[1, 2]),
    "axonmpi.optim.ConstantLR": lambda: _scheduler(optim.ConstantLR, factor=0.5, total_iters=2),
    "axonmpi.optim.PolynomialLR": lambda: _scheduler(optim.PolynomialLR, total_iters=4),
    "axonmpi.optim.OneCycleLR": lambda: _scheduler(optim.OneCycleLR, max_lr=1.0, total_steps=4,
                                                   cycle_momentum=False),
    "axonmpi.optim.CosineAnnealingWarmRestarts": lambda: _scheduler(optim.CosineAnnealingWarmRestarts, T_0=2),
    "axonmpi.optim.SequentialLR": lambda: _scheduler(
        lambda o: optim.SequentialLR(o, [optim.ConstantLR(o), optim.ExponentialLR(o, 0.9)], milestones=[2])),
    "axonmpi.optim.ChainedScheduler": lambda: _scheduler(
        lambda o: optim.ChainedScheduler([optim.ConstantLR(o), optim.ExponentialLR(o, 0.9)])),
    "axonmpi.optim.ReduceLROnPlateau": lambda: _plateau(),
    "axonmpi.optim.clip_grad_norm_": lambda: optim.clip_grad_norm_(_grads([3.0, 4.0]), 1.0) == pytest.approx(5.0),
    "axonmpi.optim.clip_grad_value_": lambda: optim.clip_grad_value_(_grads([3.0]), 1.0) is None,
    "axonmpi.optim.grad_norm": lambda: optim.grad_norm(_grads([3.0], [4.0])) == pytest.approx(5.0),
    "axonmpi.optim.grad_norm_array": lambda: float(optim.grad_norm_array(_grads([3.0], [4.0]))) == pytest.approx(5.0),
    "axonmpi.optim.clip_grad_norm_array_": lambda: float(optim.clip_grad_norm_array_(_grads([3.0, 4.0]), 1.0))
    == pytest.approx(5.0),
}

# Tensor members: "Tensor.name" -> a small call on X (2, 3 float64, requires grad)
TENSOR_EXAMPLES = {
    "T": lambda: X.T.shape == (3, 2),
    "wrap": lambda: (lambda a: Tensor.wrap(a).data is a and not Tensor.wrap(a).requires_grad)(np.ones(2)),
    "abs": lambda: _close(X.abs(), np.abs(X.numpy())),
    "add": lambda: _close(X.add(1.0), X.numpy() + 1),
    "all": lambda: bool(Tensor(np.ones(2)).all()),
    "amax": lambda: _close(X.amax(dim=1), X.numpy().max(1)),
    "amin": lambda: _close(X.amin(), X.numpy().min()),
    "any": lambda: not bool(Tensor(np.zeros(2)).any()),
    "argmax": lambda: _close(X.argmax(dim=1), X.numpy().argmax(1)),
    "argmin": lambda: _close(X.argmin(dim=0), X.numpy().argmin(0)),
    "astype": lambda: X.astype(np.float32).dtype == np.float32,
    "backward": lambda: _backward_ok(X * 2.0, X),
    "chunk": lambda: len(X.chunk(2, dim=1)) == 2,
    "clamp": lambda: _close(X.clamp(min=0.0), np.maximum(X.numpy(), 0)),
    "clip": lambda: _close(X.clip(-0.1, 0.1), np.clip(X.numpy(), -0.1, 0.1)),
    "clone": lambda: X.clone().data is not X.data,
    "contiguous": lambda: X.contiguous() is X and X.t().contiguous().data.flags.c_contiguous,
    "cos": lambda: _close(X.cos(), np.cos(X.numpy())),
    "cpu": lambda: X.cpu() is X,
    "cuda": lambda: axonmpi.backend.cupy_available() or pytest.raises(RuntimeError, X.cuda),
    "data": lambda: isinstance(X.data, np.ndarray),
    "detach": lambda: not X.detach().requires_grad,
    "detach_": lambda: not (X * 1.0).detach_().requires_grad,
    "device": lambda: X.device.type == "cpu",
    "dim": lambda: X.dim() == 2,
    "div": lambda: _close(X.div(2.0), X.numpy() / 2),
    "double": lambda: X.float().double().dtype == np.float64,
    "dtype": lambda: X.dtype == np.float64,
    "element_size": lambda: X.element_size() == 8,
    "eq": lambda: X.eq(X).all().item(),
    "exp": lambda: _close(X.exp(), np.exp(X.numpy())),
    "expand": lambda: _x(1, 3).expand(4, 3).shape == (4, 3),
    "expand_as": lambda: _x(1, 3).expand_as(X).shape == X.shape,
    "fill_": lambda: _close(Tensor(np.zeros(2)).fill_(3.0), [3, 3]),
    "flatten": lambda: X.flatten().shape == (6,),
    "float": lambda: X.float().dtype == np.float32,
    "ge": lambda: X.ge(X).all().item(),
    "grad": lambda: Tensor([1.0]).grad is None,
    "grad_fn": lambda: (X * 2.0).grad_fn is not None,
    "gt": lambda: not X.gt(X).any().item(),
    "half": lambda: X.half().dtype == np.float16,
    "is_cuda": lambda: X.is_cuda is False,
    "is_leaf": lambda: X.is_leaf,
    "item": lambda: Tensor(2.5).item() == 2.5,
    "le": lambda: X.le(X).all().item(),
    "log": lambda: _close((X * X + 1.0).log(), np.log(X.numpy() ** 2 + 1)),
    "log_softmax": lambda: _close(X.log_softmax(dim=-1).exp().sum(dim=-1), [1, 1]),
    "long": lambda: X.long().dtype == np.int64,
    "lt": lambda: not X.lt(X).any().item(),
    "masked_fill": lambda: _close(X.masked_fill(Tensor(M), 1.0), np.where(M, 1, X.numpy())),
    "matmul": lambda: X.matmul(W.t()).shape == (2, 4),
    "max": lambda: X.max(dim=1).values.shape == (2,) and X.max().shape == (),
    "maximum": lambda: _close(X.maximum(X * 0.0), np.maximum(X.numpy(), 0)),
    "mean": lambda: _close(X.mean(dim=1, keepdim=True), X.numpy().mean(1, keepdims=True)),
    "min": lambda: _close(X.min(0).values, X.numpy().min(0)),
    "minimum": lambda: _close(X.minimum(X * 0.0), np.minimum(X.numpy(), 0)),
    "mul": lambda: _close(X.mul(X), X.numpy() ** 2),
    "ndim": lambda: X.ndim == 2,
    "ne": lambda: not X.ne(X).any().item(),
    "neg": lambda: _close(X.neg(), -X.numpy()),
    "nelement": lambda: X.nelement() == 6,
    "new_full": lambda: X.new_full((2,), 7.0).tolist() == [7.0, 7.0],
    "new_ones": lambda: X.new_ones(2, 2).dtype == np.float64,
    "new_tensor": lambda: X.new_tensor([1, 2]).dtype == np.float64,
    "new_zeros": lambda: X.new_zeros((3,)).shape == (3,),
    "numel": lambda: X.numel() == 6,
    "numpy": lambda: isinstance(X.numpy(), np.ndarray),
    "permute": lambda: X.permute(1, 0).shape == (3, 2),
    "pow": lambda: _close(X.pow(2), X.numpy() ** 2),
    "reciprocal": lambda: _close((X * X + 1.0).reciprocal(), 1 / (X.numpy() ** 2 + 1)),
    "register_hook": lambda: _x(2).register_hook(lambda g: g) is not None,
    "register_post_accumulate_grad_hook": lambda: _x(2).register_post_accumulate_grad_hook(lambda p: None) is not None,
    "relu": lambda: _close(X.relu(), np.maximum(X.numpy(), 0)),
    "requires_grad": lambda: X.requires_grad,
    "requires_grad_": lambda: Tensor([1.0]).requires_grad_().requires_grad,
    "reshape": lambda: X.reshape(3, 2).shape == (3, 2),
    "reshape_as": lambda: X.reshape_as(X.t()).shape == (3, 2),
    "rsqrt": lambda: _close((X * X + 1.0).rsqrt(), (X.numpy() ** 2 + 1) ** -0.5),
    "shape": lambda: X.shape == (2, 3),
    "sigmoid": lambda: _close(X.sigmoid(), 1 / (1 + np.exp(-X.numpy()))),
    "sin": lambda: _close(X.sin(), np.sin(X.numpy())),
    "size": lambda: X.size() == (2, 3) and X.size(1) == 3,
    "softmax": lambda: _close(X.softmax(dim=0).sum(dim=0), [1, 1, 1]),
    "split": lambda: len(X.split(1, dim=0)) == 2,
    "sqrt": lambda: _close((X * X).sqrt(), np.abs(X.numpy())),
    "square": lambda: _close(X.square(), X.numpy() ** 2),
    "squeeze": lambda: _x(1, 3).squeeze(0).shape == (3,),
    "std": lambda: _close(X.std(dim=1), X.numpy().std(1, ddof=1)),
    "sub": lambda: _close(X.sub(X), 0),
    "sum": lambda: _close(X.sum(dim=1), X.numpy().sum(1)),
    "t": lambda: X.t().shape == (3, 2),
    "tanh": lambda: _close(X.tanh(), np.tanh(X.numpy())),
    "to": lambda: X.to("cpu") is X and X.to(np.float32).dtype == np.float32,
    "tolist": lambda: len(X.tolist()) == 2,
    "transpose": lambda: X.transpose(0, 1).shape == (3, 2),
    "type_as": lambda: X.type_as(X.float()).dtype == np.float32,
    "unsqueeze": lambda: X.unsqueeze(0).shape == (1, 2, 3),
    "var": lambda: _close(X.var(dim=1, keepdim=True), X.numpy().var(1, ddof=1, keepdims=True)),
    "view": lambda: X.view(-1).shape == (6,),
    "view_as": lambda: X.view_as(X.t()).shape == (3, 2),
    "where": lambda: _close(X.where(Tensor(M), 0.0), np.where(M, X.numpy(), 0)),
    "xp": lambda: X.xp is np,
    "zero_": lambda: _close(Tensor(np.ones(2)).zero_(), [0, 0]),
}

# PyTorch's top-level names and in-place Tensor methods (tests/test_torch_surface.py checks them further)
def _inplace(name, *args, want):
    t = Tensor(np.array([1.0, -2.0, 3.0]))
    out = getattr(t, name)(*args)
    return out is t and _close(t, want)


def _save_load():
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sd.h5")
        axonmpi.save({"w": np.arange(3.0), "step": 2}, path)
        got = axonmpi.load(path, map_location="cpu", weights_only=True)
    return got["step"] == 2 and np.array_equal(got["w"], np.arange(3.0))


_V = Tensor(np.array([[1.0, 4.0], [3.0, 2.0]]))
TENSOR_EXAMPLES.update({
    "add_": lambda: _inplace("add_", 1.0, want=[2.0, -1.0, 4.0]),
    "sub_": lambda: _inplace("sub_", 1.0, want=[0.0, -3.0, 2.0]),
    "mul_": lambda: _inplace("mul_", 2.0, want=[2.0, -4.0, 6.0]),
    "div_": lambda: _inplace("div_", 2.0, want=[0.5, -1.0, 1.5]),
    "clamp_": lambda: _inplace("clamp_", 0.0, 2.0, want=[1.0, 0.0, 2.0]),
    "copy_": lambda: _inplace("copy_", np.zeros(3), want=[0.0, 0.0, 0.0]),
    "normal_": lambda: Tensor(np.zeros(4)).normal_().numpy().std() > 0,
    "uniform_": lambda: 0 <= Tensor(np.zeros(4)).uniform_(0, 1).numpy().min(),
    "int": lambda: Tensor([1.7]).int().dtype == np.int32,
    "bool": lambda: Tensor([0.0, 2.0]).bool().tolist() == [False, True],
    "type": lambda: Tensor([1.0]).type() == "axonmpi.FloatTensor" and Tensor([1.0]).type(np.float64).dtype == np.float64,
})
EXAMPLES.update({
    "axonmpi.abs": lambda: _close(axonmpi.abs(_V - 2), [[1, 2], [1, 0]]),
    "axonmpi.allclose": lambda: axonmpi.allclose(_V, _V.numpy() + 1e-9),
    "axonmpi.argmax": lambda: axonmpi.argmax(_V, dim=1).tolist() == [1, 0],
    "axonmpi.argmin": lambda: axonmpi.argmin(_V, dim=1).tolist() == [0, 1],
    "axonmpi.as_tensor": lambda: (lambda a: axonmpi.as_tensor(a).data is a)(np.ones(2)),
    "axonmpi.bfloat16": lambda: np.dtype(axonmpi.bfloat16).name == "bfloat16",
    "axonmpi.bool": lambda: axonmpi.bool is np.bool_,
    "axonmpi.cat": lambda: axonmpi.cat([_V, _V]).shape == (4, 2),
    "axonmpi.concat": lambda: axonmpi.concat([_V, _V], dim=1).shape == (2, 4),
    "axonmpi.chunk": lambda: len(axonmpi.chunk(_V, 2)) == 2,
    "axonmpi.clamp": lambda: _close(axonmpi.clamp(_V, 2, 3), [[2, 3], [3, 2]]),
    "axonmpi.destroy_process_group": lambda: callable(axonmpi.destroy_process_group),   # run in test_torch_distributed.py
    "axonmpi.device": lambda: str(axonmpi.device("cuda", 1)) == "cuda:1" and str(axonmpi.device("cpu")) == "cpu",
    "axonmpi.double": lambda: axonmpi.double is np.float64,
    "axonmpi.dtype": lambda: axonmpi.dtype("float32") == np.float32,
    "axonmpi.equal": lambda: axonmpi.equal(_V, _V.numpy()) and not axonmpi.equal(_V, _V * 2),
    "axonmpi.exp": lambda: _close(axonmpi.exp(_V * 0), np.ones((2, 2))),
    "axonmpi.eye": lambda: _close(axonmpi.eye(2), np.eye(2)),
    "axonmpi.flatten": lambda: axonmpi.flatten(_V).shape == (4,),
    "axonmpi.float": lambda: axonmpi.float is np.float32,
    "axonmpi.float16": lambda: axonmpi.float16 is np.float16,
    "axonmpi.float32": lambda: axonmpi.float32 is np.float32,
    "axonmpi.float64": lambda: axonmpi.float64 is np.float64,
    "axonmpi.from_numpy": lambda: (lambda a: axonmpi.from_numpy(a).data is a)(np.ones(2)),
    "axonmpi.get_default_dtype": lambda: axonmpi.get_default_dtype() is np.float32,
    "axonmpi.get_rank": lambda: axonmpi.get_rank() == axonmpi.rank(),
    "axonmpi.get_world_size": lambda: axonmpi.get_world_size() == axonmpi.world_size(),
    "axonmpi.half": lambda: axonmpi.half is np.float16,
    "axonmpi.inference_mode": lambda: (lambda: [None for _ in [0]])() is not None and axonmpi.inference_mode is axonmpi.no_grad,
    "axonmpi.init_process_group": lambda: axonmpi.init_process_group() is None and axonmpi.is_initialized(),
    "axonmpi.int": lambda: axonmpi.int is np.int32,
    "axonmpi.int32": lambda: axonmpi.int32 is np.int32,
    "axonmpi.int64": lambda: axonmpi.int64 is np.int64,
    "axonmpi.int8": lambda: axonmpi.int8 is np.int8,
    "axonmpi.uint8": lambda: axonmpi.uint8 is np.uint8,
    "axonmpi.long": lambda: axonmpi.long is np.int64,
    "axonmpi.is_floating_point": lambda: axonmpi.is_floating_point(_V) and not axonmpi.is_floating_point(Tensor([1])),
    "axonmpi.is_tensor": lambda: axonmpi.is_tensor(_V) and not axonmpi.is_tensor(np.ones(1)),
    "axonmpi.linspace": lambda: _close(axonmpi.linspace(0, 1, 3), [0, 0.5, 1]),
    "axonmpi.load": _save_load,
    "axonmpi.save": _save_load,
    "axonmpi.log_softmax": lambda: _close(axonmpi.log_softmax(_V, dim=1).exp().sum(1), [1, 1]),
    "axonmpi.softmax": lambda: _close(axonmpi.softmax(_V, dim=1).sum(1), [1, 1]),
    "axonmpi.matmul": lambda: _close(axonmpi.matmul(_V, _V), _V.numpy() @ _V.numpy()),
    "axonmpi.max": lambda: axonmpi.max(_V).item() == 4.0,
    "axonmpi.min": lambda: axonmpi.min(_V).item() == 1.0,
    "axonmpi.mean": lambda: axonmpi.mean(_V).item() == 2.5,
    "axonmpi.sum": lambda: axonmpi.sum(_V).item() == 10.0,
    "axonmpi.numel": lambda: axonmpi.numel(_V) == 4,
    "axonmpi.permute": lambda: axonmpi.permute(_V, (1, 0)).tolist() == [[1, 3], [4, 2]],
    "axonmpi.transpose": lambda: axonmpi.transpose(_V, 0, 1).tolist() == [[1, 3], [4, 2]],
    "axonmpi.randint": lambda: axonmpi.randint(0, 3, (5,)).dtype == np.int64,
    "axonmpi.randperm": lambda: sorted(axonmpi.randperm(4).tolist()) == [0, 1, 2, 3],
    "axonmpi.relu": lambda: _close(axonmpi.relu(_V - 2), [[0, 2], [1, 0]]),
    "axonmpi.sigmoid": lambda: _close(axonmpi.sigmoid(_V * 0), np.full((2, 2), 0.5)),
    "axonmpi.tanh": lambda: _close(axonmpi.tanh(_V * 0), np.zeros((2, 2))),
    "axonmpi.pow": lambda: _close(axonmpi.pow(_V, 2.0), [[1.0, 16.0], [9.0, 4.0]]),
    "axonmpi.sin": lambda: _close(axonmpi.sin(_V * 0), np.zeros((2, 2))),
    "axonmpi.cos": lambda: _close(axonmpi.cos(_V * 0), np.ones((2, 2))),
    "axonmpi.maximum": lambda: _close(axonmpi.maximum(_V, Tensor(np.full((2, 2), 2.5))), [[2.5, 4.0], [3.0, 2.5]]),
    "axonmpi.minimum": lambda: _close(axonmpi.minimum(_V, Tensor(np.full((2, 2), 2.5))), [[1.0, 2.5], [2.5, 2.0]]),
    "axonmpi.sqrt": lambda: _close(axonmpi.sqrt(_V * _V), _V.numpy()),
    "axonmpi.reshape": lambda: axonmpi.reshape(_V, (4,)).shape == (4,),
    "axonmpi.split": lambda: len(axonmpi.split(_V, 1)) == 2,
    "axonmpi.squeeze": lambda: axonmpi.squeeze(_V[None]).shape == (2, 2),
    "axonmpi.unsqueeze": lambda: axonmpi.unsqueeze(_V, 0).shape == (1, 2, 2),
    "axonmpi.stack": lambda: axonmpi.stack([_V, _V]).shape == (2, 2, 2),
    "axonmpi.where": lambda: _close(axonmpi.where(_V > 2, _V, 0.0), [[0, 4], [3, 0]]),
    "axonmpi.nn.Conv2d": lambda: _backward_ok(nn.Conv2d(2, 3, 3, padding=1, dtype=np.float64)(_x(1, 2, 4, 4)).sum()),
    "axonmpi.nn.MaxPool2d": lambda: nn.MaxPool2d(2)(_x(1, 1, 4, 4)).shape == (1, 1, 2, 2),
    "axonmpi.nn.functional.conv2d": lambda: F.conv2d(Tensor(np.ones((1, 1, 3, 3))), Tensor(np.ones((1, 1, 2, 2)))).tolist()
    == [[[[4.0, 4.0], [4.0, 4.0]]]],
    "axonmpi.nn.functional.max_pool2d": lambda: F.max_pool2d(Tensor(np.arange(16.0).reshape(1, 1, 4, 4)), 2).tolist()
    == [[[[5.0, 7.0], [13.0, 15.0]]]],
    "axonmpi.optim.Adadelta": lambda: _train_step(optim.Adadelta, lr=1.0),
    "axonmpi.Generator": lambda: (axonmpi.randn(3, generator=axonmpi.Generator().manual_seed(7)).tolist()
                                  == axonmpi.randn(3, generator=axonmpi.Generator().manual_seed(7)).tolist()),
    "axonmpi.nn.functional.one_hot": lambda: F.one_hot(Tensor([0, 2]), 3).tolist() == [[1, 0, 0], [0, 0, 1]],
    "axonmpi.topk": lambda: axonmpi.topk(Tensor([[1.0, 5.0, 3.0]]), 2).indices.tolist() == [[1, 2]],
    "axonmpi.tril": lambda: axonmpi.tril(axonmpi.ones(2, 2)).tolist() == [[1.0, 0.0], [1.0, 1.0]],
    "axonmpi.triu": lambda: axonmpi.triu(axonmpi.ones(2, 2), diagonal=1).tolist() == [[0.0, 1.0], [0.0, 0.0]],
    "axonmpi.multinomial": lambda: axonmpi.multinomial(Tensor([[0.0, 1.0]]), 2, replacement=True).tolist()
    == [[1, 1]],
    "axonmpi.compile": lambda: [axonmpi.compile(lambda a: a + 1)(i) for i in range(3)] == [1, 2, 3],
    "axonmpi.set_float32_matmul_precision": lambda: axonmpi.set_float32_matmul_precision("highest") is None,
    "axonmpi.get_float32_matmul_precision": lambda: axonmpi.get_float32_matmul_precision() in ("highest", "high",
                                                                                              "medium"),
})
TENSOR_EXAMPLES.update({
    "pin_memory": lambda: (lambda t: t.pin_memory() is t)(Tensor([1.0])),
    "topk": lambda: Tensor([3.0, 1.0, 2.0]).topk(1, largest=False).values.tolist() == [1.0],
    "tril": lambda: Tensor(np.ones((2, 2))).tril(-1).tolist() == [[0.0, 0.0], [1.0, 0.0]],
    "triu": lambda: Tensor(np.ones((2, 2))).triu().tolist() == [[1.0, 1.0], [0.0, 1.0]],
    "multinomial": lambda: Tensor([0.0, 0.0, 2.0]).multinomial(1).tolist() == [2],
})
EXAMPLES.update({f"Tensor.{k}": v for k, v in TENSOR_EXAMPLES.items()})


def _exported(mod):
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in dir(mod) if not n.startswith("_")
                 and not isinstance(getattr(mod, n), __future__._Feature)]
    return [n for n in names if not isinstance(getattr(mod, n), types.ModuleType)]


def _names():
    out = [f"{ns}.{n}" for ns, mod in NAMESPACES.items() for n in _exported(mod)]
    out += [f"Tensor.{n}" for n in dir(Tensor) if not n.startswith("_")]
    return sorted(set(out))


@pytest.mark.parametrize("name", _names())
def test_name_works(name, world):
    assert name in EXAMPLES, f"{name} has no example call: add one to EXAMPLES in tests/test_api_surface.py"
    result = EXAMPLES[name]()
    assert result is None or result is not False, f"{name}: its example call returned {result!r}"


# -- docstrings --------------------------------------------------------------------------------
def _documented(obj) -> bool:
    return bool((getattr(obj, "__doc__", None) or "").strip())


def _undocumented():
    """Public functions, classes and their public methods in autograd/nn/optim without a docstring
    (a method may inherit the docstring of the method it overrides)."""
    for pkg in ("axonmpi.autograd", "axonmpi.nn", "axonmpi.optim"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.iter_modules(mod.__path__):
            if info.name.startswith("_"):
                continue
            sub = importlib.import_module(f"{pkg}.{info.name}")
            for n in getattr(sub, "__all__", []):
                obj = getattr(sub, n)
                if not (inspect.isfunction(obj) or inspect.isclass(obj)) or obj.__module__ != sub.__name__:
                    continue
                if not _documented(obj):
                    yield f"{sub.__name__}.{n}"
                if inspect.isclass(obj):
                    for m, f in vars(obj).items():
                        if m.startswith("_") or not inspect.isfunction(f) or _documented(f):
                            continue
                        if not any(_documented(vars(b).get(m)) for b in obj.__mro__[1:]):
                            yield f"{sub.__name__}.{n}.{m}"


def test_public_api_has_docstrings():
    missing = list(_undocumented())
    assert not missing, f"public functions/classes without a docstring: {missing}"
