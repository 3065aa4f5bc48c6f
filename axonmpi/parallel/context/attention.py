"""``ContextParallelAttention``: causal self-attention over a sequence split across the context-parallel group (ring or Ulysses)."""
from __future__ import annotations

import math
from typing import Optional

from ...autograd import ops, ops_nn
from ...autograd.tensor import Tensor
from ...distributed import ProcessGroup, role_group
from ...nn.layers import Dropout, Linear
from ...nn.module import Module
from .layout import CPAlgo, ContextLayout, local_layout
from .ring import ring_attention
from .ulysses import check_heads, head_to_seq, seq_to_head

__all__ = ["ContextParallelAttention"]


def _causal(q, k, v, hd):
    """Serial causal attention on whole sequences: q, k, v ``(B, h, T, hd)`` -> ``(B, h, T, hd)``."""
    return ops_nn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(hd))


class ContextParallelAttention(Module):
    """Multi-head causal self-attention on this rank's tokens of a sequence split over ``group``.

    Names and shapes match :class:`axonmpi.nn.CausalSelfAttention` (``qkv`` (3C, C), ``proj``
    (C, C)); the weights are replicated over the group (their gradients are partial sums: reduce
    them over data x context, ``grid.data_context_group``).

    Args:
        n_embd: model width C.
        n_head: heads (``ulysses``: must divide by the group size).
        group: the context-parallel group (default: the grid's ``"context"`` group).
        algo: ``"ring"`` (K/V blocks around the group, causal load balancing: this rank's tokens
            are chunks ``r`` and ``2P-1-r`` of ``2P``) or ``"ulysses"`` (all-to-all to head shards;
            this rank's tokens are the ``r``-th of ``P`` contiguous chunks).  See :class:`ContextLayout`.
        dropout: dropout on the output (``resid_dropout``; masks drawn per rank).  Dropout on the
            attention weights is not built for context parallelism (``attn_dropout`` must be 0).
        attn_dropout: must be 0 (raises ``NotImplementedError`` otherwise).
        bias: biases on the projections.
        seq_len: the whole sequence length (default: each forward's ``seq_len`` argument, else
            ``T_local * P``, an even split).

    Example:
        >>> attn = ContextParallelAttention(64, 4, group=grid.context_group, algo="ring", dtype="float64")
        >>> layout = attn.layout(T)
        >>> y_local = attn(layout.split(x, cp.rank), seq_len=T)   # this rank's rows of serial attention
    """

    def __init__(self, n_embd: int, n_head: int, group: Optional[ProcessGroup] = None, algo="ring",
                 dropout: float = 0.0, bias: bool = True, dtype=None, device=None, *, attn_dropout: float = 0.0,
                 seq_len: Optional[int] = None):
        super().__init__()
        self.group = role_group("context", group)
        if n_embd % n_head:
            raise ValueError(f"rank {self.group.world.rank}: n_embd={n_embd} must be divisible by n_head={n_head}")
        if attn_dropout:
            raise NotImplementedError(f"rank {self.group.world.rank}: dropout on the attention weights "
                                      f"(attn_dropout={attn_dropout}) is not built for context parallelism")
        self.algo = CPAlgo.coerce(algo)
        self.n_embd, self.n_head = int(n_embd), int(n_head)
        if self.algo is CPAlgo.ULYSSES:
            check_heads(self.n_head, self.group)
        self.seq_len = seq_len
        self.context_enabled = True          # False: whole sequences on this rank alone (generation)
        self.qkv = Linear(n_embd, 3 * n_embd, bias=bias, dtype=dtype, device=device)
        self.proj = Linear(n_embd, n_embd, bias=bias, dtype=dtype, device=device)
        self.resid_dropout = Dropout(dropout)

    def layout(self, seq_len: int) -> ContextLayout:
        """The :class:`ContextLayout` of a ``seq_len``-token sequence over this module's group and algorithm."""
        return ContextLayout(int(seq_len), self.group.size, self.algo)

    def forward(self, x: Tensor, seq_len: Optional[int] = None) -> Tensor:
        # the widths come from qkv's output: under tensor parallelism (parallelize swaps in a head-split
        # qkv and a row-parallel proj) this rank holds C/t of the width and n_head/t of the heads, and
        # under sequence parallelism qkv all-gathers the tokens, so T is read after it too
        qkv = self.qkv(x)
        B, T, C = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        hd = self.n_embd // self.n_head
        nh = C // hd
        if not self.context_enabled:
            q, k, v = (ops.permute(ops.reshape(t, B, T, nh, hd), 0, 2, 1, 3) for t in ops.split(qkv, C, axis=2))
            y = ops.reshape(ops.permute(_causal(q, k, v, hd), 0, 2, 1, 3), B, T, C)
            return self.resid_dropout(self.proj(y))
        P = self.group.size
        layout = local_layout(self.group, self.algo, T, seq_len if seq_len is not None else self.seq_len)
        n = layout.seq_len
        if self.algo is CPAlgo.RING:
            q, k, v = (ops.permute(ops.reshape(t, B, T, nh, hd), 0, 2, 1, 3) for t in ops.split(qkv, C, axis=2))
            y = ring_attention(q, k, v, self.group, n)
            y = ops.reshape(ops.permute(y, 0, 2, 1, 3), B, T, C)
        else:
            lens = [layout.local_len(j) for j in range(P)]
            heads = seq_to_head(ops.reshape(qkv, B, T, 3, nh, hd), self.group, lens)   # (B, n, 3, nh/P, hd)
            q, k, v = (ops.permute(ops.reshape(t, B, n, nh // P, hd), 0, 2, 1, 3)
                       for t in ops.split(heads, 1, axis=2))
            y = ops.permute(_causal(q, k, v, hd), 0, 2, 1, 3)                        # (B, n, nh/P, hd)
            y = head_to_seq(ops.reshape(y, B, n, 1, nh // P, hd), self.group, lens)
            y = ops.reshape(y, B, T, C)
        return self.resid_dropout(self.proj(y))

    def extra_repr(self) -> str:
        return (f"n_embd={self.n_embd}, n_head={self.n_head}, algo={self.algo.value}, "
                f"context group size={self.group.size}")
