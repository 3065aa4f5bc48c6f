"""Mixture of experts: a top-k router over ``num_experts`` GELU MLPs, dropless by default.

``MoE`` replaces a transformer block's ``MLP``: same input and output, ``(..., n_embd)``.

[Note: MoE forward]
1. Router: ``logits = x @ router.weight.T`` in at least float32 (float16 / bfloat16 inputs are
   cast up; float64 stays float64). Scores are ``softmax(logits)`` or ``sigmoid(logits)``.
2. Top-k: each token picks its ``top_k`` highest scores (ties: the lower expert id). The gate
   weights are those scores, renormalised to sum to one per token when ``normalize`` (default:
   when ``top_k > 1``; with ``top_k = 1`` and softmax the raw score is kept, as Switch does, so
   the router still gets a gradient from the language-model loss).
3. Dispatch: the (token, choice) assignments are sorted by expert (stable: token order inside
   an expert); expert ``e`` runs its MLP on its rows (dropless: every assignment is computed).
   With ``capacity_factor=c`` each expert takes at most ``ceil(c * tokens * top_k / E)`` rows of
   the *global* batch (``tokens`` summed over ``stats_group``), first choices before second
   choices, each in global token order (Switch / GShard); the rest are dropped (they contribute
   zero; the residual carries the token) and counted.  Each rank learns its place in the global
   queues from one all-gather of its per-(choice, expert) counts (an exclusive prefix sum over
   the lower ranks plus the totals of the earlier choices), so a data-parallel run drops exactly
   the assignments the serial model drops on the global batch: the ranks of ``stats_group``
   must hold consecutive slices of the global batch in rank order (``local_batch`` does).
4. Combine: every row is multiplied by its gate weight and summed back into its token.

A dispatcher object (``self.dispatcher``) runs step 3's expert computation; ``None`` runs the
local experts in this process. ``axonmpi.parallel.moe`` installs an all-to-all dispatcher
(expert parallelism) or a gather dispatcher (tensor-parallel experts), whose ``before`` /
``after`` methods also gather the tokens ahead of step 1 and scatter the outputs after step 4.

[Note: MoE losses from the global batch]
The load-balancing loss is Switch's / GShard's ``E * sum_i f_i * P_i``: ``f_i`` the fraction of
the batch's assignments routed to expert ``i`` (before any capacity drop), ``P_i`` the mean
router probability of expert ``i`` over the batch's tokens (sigmoid scores are normalised per
token first). The z-loss is ``mean_t logsumexp(logits_t)^2`` (ST-MoE). Both are computed over
the *global* batch: with ``stats_group`` set (the ranks that split the batch), the counts and the
probability sums are all-reduced over it, so every rank holds the serial value, and the backward
of the all-reduce scales by the group size (every rank adds the same loss, and the data-parallel
average then gives the serial gradient).  Under sequence parallelism each tensor rank routes its shard
of the sequences: with ``sequence_group`` set they are summed over it too (Megatron's aux loss with
``sequence_parallel``), the gradient passed back as is (the router is replicated over that group and its
gradient is summed there afterwards). They are returned, not added: weight them yourself
(Megatron's ``moe_aux_loss_coeff`` ~ 1e-2, ``moe_z_loss_coeff`` ~ 1e-3).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from ..autograd import ops, ops_math, ops_nn, ops_reduce
from ..autograd.tensor import Tensor
from ..backend import get_array_module, to_host
from . import init
from .layers import _param, _to_device
from .module import Module

__all__ = ["MoE", "MoELosses", "Experts", "ExpertLinear", "moe_loss", "moe_losses", "moe_stats"]


class MoELosses(NamedTuple):
    """The auxiliary losses of one MoE forward (scalar Tensors, global-batch values)."""

    aux_loss: Tensor
    z_loss: Tensor


def _groups(group) -> tuple:
    """``stats_group`` as a tuple: none, one group, or several (AxoNN's data group and tensor block)."""
    return () if group is None else tuple(group) if isinstance(group, (tuple, list)) else (group,)


def _global_sum(x: Tensor, group, sequence_group=None) -> Tensor:
    """``x`` summed over the ranks splitting the batch (each group of ``group``: the gradient times its
    size) and over those splitting the sequences (``sequence_group``: the gradient as is, Megatron's
    reduce-from region; the replicated router's gradient is summed over that group afterwards)."""
    from ..parallel.tensor.mappings import global_sum, reduce_from_tensor_parallel_region
    for g in _groups(group) or (None,):   # nn is imported by parallel: resolved at call time
        x = global_sum(x, g)
    if sequence_group is None or sequence_group.size == 1:
        return x
    return reduce_from_tensor_parallel_region(x, sequence_group)


def _sum_counts(counts: np.ndarray, *groups) -> np.ndarray:
    from ..distributed import all_reduce
    for group in (g for gs in groups for g in _groups(gs)):
        if group.size > 1:
            counts = all_reduce(counts, group=group)
    return counts


class ExpertLinear(Module):
    """``num_experts`` Linear layers as one stacked weight ``(E, out, in)`` and bias ``(E, out)``.

    Init per expert as :class:`~axonmpi.nn.Linear`: ``U(-1/sqrt(in), 1/sqrt(in))`` for both.
    ``weight[e]`` is expert ``e``'s ``nn.Linear.weight`` (PyTorch layout).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = True,
                 dtype=None, device=None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = _param((num_experts, out_features, in_features), dtype, device)
        self.bias = _param((num_experts, out_features), dtype, device) if bias else None
        bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
        init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            init.uniform_(self.bias, -bound, bound)
        _to_device(self, device)

    def pieces(self):
        """Per local expert ``(weight (out, in), bias (out,) or None)`` Tensors (one split node each)."""
        n = self.weight.data.shape[0]
        ws = ops.split(self.weight, 1, dim=0)
        bs = ops.split(self.bias, 1, dim=0) if self.bias is not None else (None,) * n
        return [(ops.reshape(w, w.shape[1:]), None if b is None else ops.reshape(b, b.shape[1:]))
                for w, b in zip(ws, bs)]

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class Experts(Module):
    """The expert MLPs: ``fc`` (C -> hidden) -> GELU -> ``proj`` (hidden -> C) per expert.

    ``forward(x, counts)``: ``x`` holds ``counts[e]`` rows for local expert ``e`` back to back.
    Names: ``fc.weight`` ``(E, hidden, C)``, ``fc.bias`` ``(E, hidden)``, ``proj.weight``
    ``(E, C, hidden)``, ``proj.bias`` ``(E, C)``: expert ``e`` is ``nn.MLP`` with ``fc.weight[e]``...
    """

    def __init__(self, num_experts: int, n_embd: int, hidden: int, bias: bool = True,
                 approximate: str = "tanh", dtype=None, device=None):
        super().__init__()
        self.approximate = approximate
        self.fc = ExpertLinear(num_experts, n_embd, hidden, bias, dtype=dtype, device=device)
        self.proj = ExpertLinear(num_experts, hidden, n_embd, bias, dtype=dtype, device=device)

    def forward(self, x: Tensor, counts) -> Tensor:
        counts = [int(c) for c in counts]
        if len(counts) != self.fc.weight.data.shape[0]:
            raise ValueError(f"Experts: {len(counts)} counts for {self.fc.weight.data.shape[0]} local experts")
        xs = ops.split(x, counts, dim=0) if len(counts) > 1 else (x,)
        ys = []
        for xi, (w1, b1), (w2, b2) in zip(xs, self.fc.pieces(), self.proj.pieces()):
            h = ops_nn.gelu(ops_nn.linear(xi, w1, b1), approximate=self.approximate)
            ys.append(ops_nn.linear(h, w2, b2))
        return ys[0] if len(ys) == 1 else ops.concat(ys, dim=0)


def _capacity_keep(experts: np.ndarray, num_experts: int, capacity: int,
                   offsets: Optional[np.ndarray] = None) -> np.ndarray:
    """Keep mask of ``(N, k)`` assignments: per expert the first ``capacity`` in (choice, token) order.

    ``offsets[j, e]``: the place in expert ``e``'s queue of this batch's first choice-``j``
    assignment to ``e`` (default: the choice-``j' < j`` assignments of this batch, i.e. a batch of
    its own); with the global counts it is the serial queue of the whole batch (:func:`_global_queue`).
    """
    n, k = experts.shape
    if offsets is None:
        counts = np.stack([np.bincount(experts[:, j], minlength=num_experts) for j in range(k)]).astype(np.int64)
        offsets = np.cumsum(counts, axis=0) - counts
    rank_in = np.empty((n, k), np.int64)               # place of each assignment in its expert's queue
    for j in range(k):
        col = experts[:, j]
        for e in range(num_experts):
            idx = np.nonzero(col == e)[0]
            rank_in[idx, j] = offsets[j, e] + np.arange(idx.size)
    return rank_in < capacity


def _global_queue(experts: np.ndarray, num_experts: int, n: int, group):
    """(global tokens, routed per expert (global), offsets (k, E)) from ONE all-gather of this rank's
    per-(choice, expert) counts over ``group`` (whose ranks hold consecutive slices of the global
    batch in rank order): the serial queue is all first choices of the global batch in token order,
    then all second choices, so this rank's choice-``j`` assignments to ``e`` start after every
    choice-``j' < j`` assignment to ``e`` of all ranks and the choice-``j`` ones of lower ranks."""
    k = experts.shape[1]
    mine = np.concatenate([np.bincount(experts[:, j], minlength=num_experts) for j in range(k)] + [[n]])
    mine = mine.astype(np.int64)
    if group is None or group.size == 1:
        rows = mine[None]
        me = 0
    else:
        from ..distributed import all_gather
        rows = all_gather(mine[None], group=group)       # (ranks, k E + 1), group-rank order
        me = group.rank
    per = rows[:, :-1].reshape(rows.shape[0], k, num_experts)
    total = per.sum(axis=0)                               # (k, E) over the global batch
    offsets = (np.cumsum(total, axis=0) - total) + per[:me].sum(axis=0)
    return int(rows[:, -1].sum()), total.sum(axis=0), offsets


class MoE(Module):
    """A mixture-of-experts MLP with a top-k router (dropless by default).

    Args:
        n_embd: model width C (input and output).
        num_experts: number of expert MLPs E.
        top_k: experts per token (1 or 2).
        hidden: expert hidden width (default ``4 * n_embd``, as :class:`~axonmpi.nn.MLP`).
        gating: ``"softmax"`` or ``"sigmoid"`` scores.
        normalize: renormalise the top-k gate weights to sum to one (default: ``top_k > 1``).
        capacity_factor: ``None`` (dropless) or ``c > 0``: each expert takes at most
            ``ceil(c * tokens * top_k / E)`` rows of the global batch (counted over
            ``stats_group``: parallel runs drop what the serial model drops); the rest are dropped.
        bias: biases in the experts (the router has none).
        approximate: the GELU form (``"tanh"``, as the GPT's MLP, or ``"none"``).

    After each forward: ``self.losses`` (:class:`MoELosses`: ``aux_loss``, ``z_loss``, global
    batch), ``self.tokens_per_expert`` (global rows computed per expert, host int64 array),
    ``self.dropped_tokens`` (global count of dropped assignments) and, with a capacity,
    ``self.capacity`` (rows per expert of the global batch).

    Example:
        >>> moe = MoE(64, num_experts=8, top_k=2, dtype="float64")
        >>> y, (aux, z) = moe(x, return_losses=True)
        >>> loss = F.cross_entropy(head(y), t) + 1e-2 * aux + 1e-3 * z
    """

    def __init__(self, n_embd: int, num_experts: int, top_k: int = 1, hidden: Optional[int] = None,
                 gating: str = "softmax", normalize: Optional[bool] = None,
                 capacity_factor: Optional[float] = None, bias: bool = True, approximate: str = "tanh",
                 dtype=None, device=None):
        super().__init__()
        if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
            raise ValueError(f"MoE: num_experts={num_experts!r} must be a positive int")
        if top_k not in (1, 2) or top_k > num_experts:
            raise ValueError(f"MoE: top_k={top_k!r} must be 1 or 2 and at most num_experts={num_experts}")
        if gating not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE: gating={gating!r}; expected 'softmax' or 'sigmoid'")
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float))
                                                and capacity_factor > 0):
            raise ValueError(f"MoE: capacity_factor={capacity_factor!r} must be None (dropless) or > 0")
        hidden = 4 * n_embd if hidden is None else int(hidden)
        self.n_embd, self.num_experts, self.top_k, self.hidden = n_embd, int(num_experts), int(top_k), hidden
        self.gating = gating
        self.normalize = (top_k > 1) if normalize is None else bool(normalize)
        self.capacity_factor = capacity_factor
        self.router = Module()
        self.router.weight = _param((num_experts, n_embd), dtype, device)
        init.normal_(self.router.weight, 0.0, 0.02)
        _to_device(self.router, device)
        self.experts = Experts(num_experts, n_embd, hidden, bias, approximate, dtype=dtype, device=device)
        self.dispatcher = None        # None: the local experts; set by axonmpi.parallel.moe
        self.stats_group = None       # the ranks splitting the batch (statistics summed over it; or a tuple of groups)
        self.sequence_group = None    # the ranks splitting the sequences (sequence parallelism): summed too
        self.losses: Optional[MoELosses] = None
        self.tokens_per_expert: Optional[np.ndarray] = None
        self.dropped_tokens = 0
        self.capacity: Optional[int] = None

    # -- router ----------------------------------------------------------------------------
    def _route(self, x2: Tensor):
        rdt = np.promote_types(np.dtype(x2.dtype), np.float32)
        xr = x2 if np.dtype(x2.dtype) == rdt else ops.cast(x2, rdt)
        w = self.router.weight
        wr = w if np.dtype(w.dtype) == rdt else ops.cast(w, rdt)
        logits = ops_nn.linear(xr, wr)
        scores = ops_nn.softmax(logits, -1) if self.gating == "softmax" else ops_nn.sigmoid(logits)
        return logits, scores

    def forward(self, x: Tensor, return_losses: bool = False):
        shape = tuple(x.shape)
        C = shape[-1]
        if C != self.n_embd:
            raise ValueError(f"MoE: input width {C} != n_embd {self.n_embd}")
        x2 = ops.reshape(x, -1, C)
        gather = getattr(self.dispatcher, "before", None)
        if gather is not None:                 # tensor-parallel experts: route the group's tokens
            x2 = gather(x2)
        N = x2.shape[0]
        E, k = self.num_experts, self.top_k
        xp = get_array_module(x2.data)
        logits, scores = self._route(x2)
        s_host = np.asarray(to_host(scores.data))
        top = np.argsort(-s_host, axis=1, kind="stable")[:, :k]                  # (N, k) expert ids
        gates = ops.getitem(scores, (xp.asarray(np.arange(N)[:, None]), xp.asarray(top)))
        if self.normalize:
            gates = gates / ops_reduce.sum(gates, dim=-1, keepdim=True)
        if np.dtype(gates.dtype) != np.dtype(x2.dtype):
            gates = ops.cast(gates, x2.dtype)
        # capacity (Switch) over the global batch: first choices first, each in global token order
        if self.capacity_factor is None:
            keep = np.ones((N, k), bool)
        else:
            n_glob, routed_glob, offsets = _global_queue(top, E, N, self.stats_group)
            cap = int(math.ceil(self.capacity_factor * n_glob * k / E))
            keep = _capacity_keep(top, E, cap, offsets)
            self.capacity = cap
        flat_e = top.reshape(-1)                                                 # assignment a = t*k + j
        kept = np.nonzero(keep.reshape(-1))[0]
        order = kept[np.argsort(flat_e[kept], kind="stable")]                    # sorted by expert
        counts = np.bincount(flat_e[order], minlength=E).astype(np.int64)
        rows = ops.getitem(x2, xp.asarray(order // k))
        y = self._experts(rows, counts)
        g = ops.getitem(ops.reshape(gates, N * k), xp.asarray(order))
        y = y * ops.reshape(g, -1, 1)
        M = order.size
        inv = np.full(N * k, M, np.int64)
        inv[order] = np.arange(M)
        if M < N * k:
            y = ops.concat([y, Tensor(xp.zeros((1, C), y.dtype))], dim=0)
        out = ops_reduce.sum(ops.reshape(ops.getitem(y, xp.asarray(inv)), N, k, C), dim=1)
        # global-batch statistics and losses
        if self.capacity_factor is None:
            routed = np.bincount(flat_e, minlength=E).astype(np.int64)
            tot = _sum_counts(np.concatenate([routed, counts, [N]]).astype(np.int64), self.stats_group,
                              self.sequence_group)
            routed_g, kept_g, n_g = tot[:E], tot[E:2 * E], int(tot[-1])
        else:       # the global queue's counts: expert e keeps its first `cap` assignments
            routed_g, n_g = routed_glob.astype(np.int64), n_glob
            kept_g = np.minimum(routed_g, cap)
        self.tokens_per_expert = kept_g
        self.dropped_tokens = int(routed_g.sum() - kept_g.sum())
        probs = scores if self.gating == "softmax" else scores / ops_reduce.sum(scores, dim=-1, keepdim=True)
        P = _global_sum(ops_reduce.sum(probs, dim=0), self.stats_group, self.sequence_group) * (1.0 / n_g)
        f = xp.asarray(routed_g.astype(np.dtype(P.dtype)) / (n_g * k))
        aux = ops_reduce.sum(P * Tensor(f)) * float(E)
        m = Tensor(xp.max(logits.data, axis=-1, keepdims=True))
        lse = ops.reshape(ops_math.log(ops_reduce.sum(ops_math.exp(logits - m), dim=-1, keepdim=True)) + m, N)
        z = _global_sum(ops_reduce.sum(lse * lse), self.stats_group, self.sequence_group) * (1.0 / n_g)
        self.losses = MoELosses(aux, z)
        if gather is not None:
            out = self.dispatcher.after(out)
        out = ops.reshape(out, *shape)
        return (out, self.losses) if return_losses else out

    def _experts(self, rows: Tensor, counts: np.ndarray) -> Tensor:
        if self.dispatcher is None:
            return self.experts(rows, counts)
        return self.dispatcher(rows, counts, self.experts)

    def extra_repr(self) -> str:
        cap = "dropless" if self.capacity_factor is None else f"capacity_factor={self.capacity_factor}"
        return (f"n_embd={self.n_embd}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"hidden={self.hidden}, gating={self.gating!r}, normalize={self.normalize}, {cap}")


def moe_losses(model: Module):
    """``(aux_loss, z_loss)`` summed over the MoE layers of ``model``'s last forward (``None`` if none).

    Example:
        >>> logits, lm = gpt(idx, targets)
        >>> aux, z = moe_losses(gpt)
        >>> (lm + 1e-2 * aux + 1e-3 * z).backward()
    """
    aux = z = None
    for m in model.modules():
        if isinstance(m, MoE) and m.losses is not None:
            aux = m.losses.aux_loss if aux is None else aux + m.losses.aux_loss
            z = m.losses.z_loss if z is None else z + m.losses.z_loss
    return None if aux is None else (aux, z)


def moe_loss(model: Module, aux_coeff: float, z_coeff: float) -> Optional[Tensor]:
    """``aux_coeff * aux + z_coeff * z`` of ``model``'s MoE layers' last forward (:func:`moe_losses`;
    ``None`` if it has none): what a training step adds to its language-model loss.

    Example:
        >>> (lm + moe_loss(model, 1e-2, 1e-3)).backward()
    """
    got = moe_losses(model)
    if got is None:
        return None
    aux, z = got
    return aux * aux_coeff + z * z_coeff


def moe_stats(model: Module) -> dict:
    """Metrics of the MoE layers' last forward: ``aux_loss``, ``z_loss`` (summed over layers, floats),
    tokens per expert ``min/mean/max`` (over every layer's experts) and ``dropped_tokens`` (summed),
    all over the global batch; with a ``capacity_factor``, ``expert_capacity`` (rows per expert of
    the global batch, the largest over layers); ``{}`` when the model has no MoE layer."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.losses is not None]
    if not layers:
        return {}
    per = np.concatenate([m.tokens_per_expert for m in layers])
    caps = [m.capacity for m in layers if m.capacity_factor is not None and m.capacity is not None]
    out = {
        "aux_loss": float(sum(float(to_host(m.losses.aux_loss.data)) for m in layers)),
        "z_loss": float(sum(float(to_host(m.losses.z_loss.data)) for m in layers)),
        "tokens_per_expert_min": int(per.min()), "tokens_per_expert_mean": float(per.mean()),
        "tokens_per_expert_max": int(per.max()),
        "dropped_tokens": int(sum(m.dropped_tokens for m in layers)),
    }
    if caps:
        out["expert_capacity"] = int(max(caps))
    return out
