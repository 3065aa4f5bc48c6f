"""``context_parallel_gpt``: a GPT (or any model of ``nn.CausalSelfAttention`` blocks) whose sequences are split over the context group."""
from __future__ import annotations

import contextlib
import inspect

import numpy as np
from typing import Dict, List, Optional

from ...autograd import ops_nn
from ...autograd.tensor import Tensor
from ...backend import get_array_module
from ...distributed import ProcessGroup, role_group
from ...distributed.placement import add_placement
from ...nn import CausalSelfAttention, Module
from ..swap import swap_modules
from .attention import ContextParallelAttention
from .layout import CPAlgo, ContextLayout

__all__ = ["ContextParallelEmbedding", "ContextParallelism", "ContextParallelModel", "context_parallel_embedding",
           "context_parallel_gpt"]


class ContextParallelism:
    """What a model under :func:`context_parallel_gpt` reads: the group, the algorithm, the attention layers."""

    def __init__(self, group: ProcessGroup, algo: CPAlgo, attention: List[ContextParallelAttention]):
        self.group, self.algo, self.attention = group, algo, attention
        self.active = True

    @property
    def size(self) -> int:
        return self.group.size

    def layout(self, seq_len: int) -> ContextLayout:
        """The :class:`ContextLayout` of a ``seq_len``-token sequence."""
        return ContextLayout(int(seq_len), self.group.size, self.algo)

    def positions(self, seq_len: int):
        """This rank's token positions of a ``seq_len``-token sequence."""
        return self.layout(seq_len).positions(self.group.rank)

    def begin(self, seq_len: int) -> None:
        """Tell every attention layer the whole sequence length of this forward."""
        for a in self.attention:
            a.seq_len = int(seq_len)

    @contextlib.contextmanager
    def disabled(self):
        """Run the model on whole sequences on this rank alone (generation on one rank)."""
        self.active = False
        for a in self.attention:
            a.context_enabled = False
        try:
            yield
        finally:
            self.active = True
            for a in self.attention:
                a.context_enabled = True


class ContextParallelModel:
    """The class a model takes under :func:`context_parallel_gpt` (``ContextParallel<its class>``, as
    PyTorch's ``fully_shard`` swaps a module's class): the model itself knows nothing of context parallelism.

    ``forward(idx, targets)`` keeps this rank's tokens (:meth:`ContextParallelism.positions`) of the full
    ``(B, T)`` ids it is given and runs the model's own forward on them at their positions; the loss is
    this rank's token sum scaled by ``P / (tokens in the batch)``: the mean over the context group is
    the serial mean loss (and, averaged over data x context, its gradient). ``generate`` runs whole
    sequences on this rank alone.
    """

    context_parallel: ContextParallelism

    def forward(self, idx, targets=None):
        cp = self.context_parallel
        ids = idx.data if isinstance(idx, Tensor) else idx
        config = getattr(self, "config", None)
        if (not cp.active or getattr(ids, "ndim", 0) != 2
                or (config is not None and ids.shape[1] > config.block_size)):
            return super().forward(idx, targets)       # whole sequences; or the model's own error, on every rank
        T = ids.shape[1]
        pos = cp.positions(T)
        cp.begin(T)
        logits, _ = super().forward(ids[:, get_array_module(ids).asarray(pos)], positions=pos)
        if targets is None:
            return logits, None
        xp = get_array_module(logits.data)
        targets = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
        count = max(int((targets != -100).sum()), 1)
        loss = ops_nn.cross_entropy(logits, targets[:, xp.asarray(pos)], reduction="sum") * (cp.size / count)
        return logits, loss

    def generate(self, *args, **kwargs):
        with self.context_parallel.disabled():
            return super().generate(*args, **kwargs)


class ContextParallelEmbedding:
    """The class a GPT's embedding layer (``GPTEmbedding``) takes in a pipeline under context parallelism
    (:func:`context_parallel_embedding`): it is given this rank's tokens of each sequence (``pm.local_batch``:
    ring's zig-zag chunks ``r`` and ``2P-1-r``, Ulysses' ``r``-th) and numbers them with their positions in the
    whole sequence, as :class:`ContextParallelModel` does for the whole GPT."""

    context_parallel: ContextParallelism

    def forward(self, idx, positions=None):
        if positions is None:
            cp = self.context_parallel
            positions = cp.positions(int(np.shape(idx.data if isinstance(idx, Tensor) else idx)[1]) * cp.size)
        return super().forward(idx, positions=positions)


_CLASSES: Dict[tuple, type] = {}


def _context_parallel_class(cls: type, mixin: type = ContextParallelModel) -> type:
    if issubclass(cls, mixin):
        return cls
    if (cls, mixin) not in _CLASSES:
        _CLASSES[(cls, mixin)] = type(f"ContextParallel{cls.__name__}", (mixin, cls), {})
    return _CLASSES[(cls, mixin)]


def context_parallel_embedding(layer: Module, model: Module) -> Module:
    """Make ``layer`` (a GPT's pipeline embedding, whose ``forward`` takes ``positions=``) number this rank's
    tokens at their global positions, over the context group and algorithm of ``model``'s
    :class:`ContextParallelAttention` layers (in place; returns ``layer``).

    Example:
        >>> emb = context_parallel_embedding(chunks[0][0], model)   # after the attention swap
    """
    attention = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
    if not attention:
        raise ValueError(f"context_parallel_embedding: {type(model).__name__} holds no ContextParallelAttention "
                         "(swap the attention layers first)")
    layer.context_parallel = ContextParallelism(attention[0].group, attention[0].algo, attention)
    layer.__class__ = _context_parallel_class(type(layer), ContextParallelEmbedding)
    return layer


def context_parallel_gpt(model: Module, group: Optional[ProcessGroup] = None, algo="ring") -> Module:
    """Swap, in place, every :class:`~axonmpi.nn.CausalSelfAttention` for a :class:`ContextParallelAttention`
    holding the same ``qkv`` / ``proj`` layers (names and values unchanged), record every parameter as
    replicated over the context group, and set ``model.context_parallel``. A model whose ``forward``
    takes ``positions=`` (the GPT) becomes a :class:`ContextParallelModel`:

    it takes the whole ``(B, T)`` token ids on every rank of the group and computes only
    this rank's tokens (ring: chunks ``r`` and ``2P-1-r`` of ``2P``; Ulysses: the ``r``-th of ``P``).
    Reduce the gradients over data x context (``grid.data_context_group``; ``parallelize`` and
    ``HybridGPT`` do) and average the loss there.

    Args:
        model: the serial model, built identically on every rank (attention dropout must be 0).
        group: the context-parallel group (default: the grid's ``"context"`` group).
        algo: ``"ring"`` or ``"ulysses"`` (:class:`CPAlgo`).

    Returns:
        ``model`` itself.

    Example:
        >>> axonmpi.init(G_context=2)
        >>> model = context_parallel_gpt(GPT(cfg, dtype="float64"), algo="ring")
        >>> logits, loss = model(idx, targets)        # logits: this rank's tokens only
    """
    g = role_group("context", group)
    algo = CPAlgo.coerce(algo)

    def swap(parent, name, child, _):
        if type(child) is not CausalSelfAttention:
            return None
        if child.attn_dropout.p:
            raise NotImplementedError(f"rank {g.world.rank}: attention dropout ({child.attn_dropout.p}) is not "
                                      "built for context parallelism; use dropout=0")
        new = ContextParallelAttention(child.n_embd, child.n_head, group=g, algo=algo,
                                       dropout=child.resid_dropout.p, bias=child.qkv.bias is not None)
        new.qkv, new.proj = child.qkv, child.proj          # the same layers: names and values kept
        return new

    layers = [new for _, new in swap_modules(model, swap)]
    if not layers:
        raise ValueError(f"rank {g.world.rank}: context_parallel_gpt found no CausalSelfAttention in the model")
    for p in model.parameters():
        add_placement(p, replica=g)
    model.context_parallel = ContextParallelism(g, algo, layers)
    if "positions" in inspect.signature(type(model).forward).parameters:
        model.__class__ = _context_parallel_class(type(model))
    return model
