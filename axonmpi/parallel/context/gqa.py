"""``ContextParallelGroupedQueryAttention``: grouped-query causal attention with rotary positions over a sequence
split across the context-parallel group (ring or Ulysses).

[Note: rotary positions under context parallelism]  Each rank holds its tokens of each sequence (ring: chunks
``r`` and ``2P-1-r`` of ``2P``, the zig-zag; Ulysses: the ``r``-th of ``P``).  The rotation is applied to this
rank's queries and keys before any exchange, with the tables of their global positions (the model's
``RotaryEmbedding`` of the positions ``parallelize`` gives a module taking ``positions=``:
``axes/context.number_positions``), so a key block that travels round the ring, or a head shard that an
all-to-all assembles, carries keys already rotated at their own positions -- exactly the serial model's keys.
The causal mask is by global position too (the ring's ``kernels.prefix_lengths``; Ulysses' whole sequence in order).
"""
from __future__ import annotations

from typing import Optional, Tuple

from ...autograd import ops, ops_llama, ops_nn
from ...autograd.tensor import Tensor
from ...distributed import ProcessGroup, role_group
from ...nn.layers import Linear
from ...nn.module import Module
from .layout import CPAlgo, ContextLayout, local_layout
from .ring import ring_attention
from .ulysses import check_heads, head_to_seq, seq_to_head

__all__ = ["ContextParallelGroupedQueryAttention", "grouped_causal_attention"]


def grouped_causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Serial causal attention on whole sequences with grouped key/value heads: ``q`` ``(B, H, T, D)``, ``k`` /
    ``v`` ``(B, Hk, T, D)`` (query head ``h`` reads ``h // (H / Hk)``) -> ``(B, H, T, D)``.  The queries of a
    group are stacked along time (one product per key/value head; keys and values are not repeated)."""
    B, H, T, D = q.shape
    Hk = k.shape[1]
    y = ops_nn.grouped_causal_attention(ops.reshape(q, B, Hk, (H // Hk) * T, D), k, v, H // Hk)
    return ops.reshape(y, B, H, T, D)


class ContextParallelGroupedQueryAttention(Module):
    """:class:`~axonmpi.nn.GroupedQueryAttention` on this rank's tokens of a sequence split over ``group``.

    Names and shapes match the serial layer (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``); ``parallelize``
    swaps it in for every ``nn.GroupedQueryAttention`` under ``context_parallel=`` keeping the projections (a
    tensor-parallel plan's split ones included: the heads are read from the projected widths).  The weights are
    replicated over the group (their gradients are partial sums: reduced over data x context).

    Args:
        n_embd, n_head, n_kv_head, head_dim: as :class:`~axonmpi.nn.GroupedQueryAttention`'s.
        group: the context-parallel group (default: the grid's ``"context"`` group).
        algo: ``"ring"`` (key/value blocks of the ``n_kv_head`` heads around the group, zig-zag layout) or
            ``"ulysses"`` (all-to-all to head shards: the query heads on this rank must divide by the group size,
            and its key/value heads divide by it or divide it -- then each is repeated to one per rank).
        bias: biases on the projections.
        attn_dropout: must be 0 (dropout on the attention weights is not built for context parallelism).
        seq_len: the whole sequence length (default: each forward's ``seq_len``, else ``T_local * P``).

    ``forward(x, position_embeddings=None, seq_len=None)``: ``x`` this rank's tokens ``(B, T_local, C)``;
    ``position_embeddings`` the ``(cos, sin)`` tables of those tokens' global positions ([Note: rotary positions
    under context parallelism]).

    Example:
        >>> attn = ContextParallelGroupedQueryAttention(64, 8, 2, group=grid.context_group, algo="ring")
        >>> pos = attn.layout(T).positions(grid.context_group.rank)
        >>> y_local = attn(attn.layout(T).split(x, cp.rank), rope(x, pos), seq_len=T)
    """

    def __init__(self, n_embd: int, n_head: int, n_kv_head: Optional[int] = None, head_dim: Optional[int] = None,
                 group: Optional[ProcessGroup] = None, algo="ring", bias: bool = False, dtype=None, device=None, *,
                 attn_dropout: float = 0.0, seq_len: Optional[int] = None):
        super().__init__()
        self.group = role_group("context", group)
        r = self.group.world.rank
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_head % n_kv_head:
            raise ValueError(f"rank {r}: n_kv_head={n_kv_head} must divide n_head={n_head}")
        if head_dim is None:
            if n_embd % n_head:
                raise ValueError(f"rank {r}: n_embd={n_embd} is not divisible by n_head={n_head}; pass head_dim=")
            head_dim = n_embd // n_head
        if attn_dropout:
            raise NotImplementedError(f"rank {r}: dropout on the attention weights (attn_dropout={attn_dropout}) is "
                                      "not built for context parallelism")
        self.algo = CPAlgo.coerce(algo)
        self.n_embd, self.n_head = int(n_embd), int(n_head)
        self.n_kv_head, self.head_dim = int(n_kv_head), int(head_dim)
        self.seq_len = seq_len
        self.context_enabled = True          # False: whole sequences on this rank alone (generation)
        self.q_proj = Linear(n_embd, n_head * head_dim, bias=bias, dtype=dtype, device=device)
        self.k_proj = Linear(n_embd, n_kv_head * head_dim, bias=bias, dtype=dtype, device=device)
        self.v_proj = Linear(n_embd, n_kv_head * head_dim, bias=bias, dtype=dtype, device=device)
        self.o_proj = Linear(n_head * head_dim, n_embd, bias=bias, dtype=dtype, device=device)

    def layout(self, seq_len: int) -> ContextLayout:
        """The :class:`ContextLayout` of a ``seq_len``-token sequence over this module's group and algorithm."""
        return ContextLayout(int(seq_len), self.group.size, self.algo)

    def _heads(self, y: Tensor, B: int, what: str) -> Tensor:
        T, width = y.shape[1], y.shape[-1]
        if width % self.head_dim:
            raise ValueError(f"rank {self.group.world.rank}: {what} gives {width} features on this rank, not a "
                             f"multiple of head_dim={self.head_dim}: a tensor-parallel split must give whole heads")
        return ops.reshape(y, B, T, width // self.head_dim, self.head_dim)

    def _rotated(self, x: Tensor, position_embeddings) -> Tuple[Tensor, Tensor, Tensor]:
        """This rank's ``q``, ``k``, ``v`` ``(B, T, heads, D)``, ``q`` and ``k`` rotated at their positions."""
        B = x.shape[0]
        q = self._heads(self.q_proj(x), B, "q_proj")
        k = self._heads(self.k_proj(x), B, "k_proj")
        v = self._heads(self.v_proj(x), B, "v_proj")
        T, nh, nkv = q.shape[1], q.shape[2], k.shape[2]
        if nh % nkv:
            raise ValueError(f"rank {self.group.world.rank}: {nh} query heads and {nkv} key/value heads on this rank; "
                             "the key/value heads must divide the query heads")
        if position_embeddings is not None:
            cos, sin = (t.data if isinstance(t, Tensor) else t for t in position_embeddings)
            if cos.ndim < 2 or cos.shape[-2] != T:
                raise ValueError(f"rank {self.group.world.rank}: position_embeddings of shape {tuple(cos.shape)} do "
                                 f"not cover this rank's {T} tokens (the tables of their global positions)")
            cos, sin = cos[..., None, :], sin[..., None, :]
            q = ops_llama.apply_rotary_emb(q, cos, sin)
            k = ops_llama.apply_rotary_emb(k, cos, sin)
        return q, k, v

    def forward(self, x: Tensor, position_embeddings=None, seq_len: Optional[int] = None) -> Tensor:
        q, k, v = self._rotated(x, position_embeddings)
        B, T, nh, hd = q.shape
        nkv = k.shape[2]
        heads = [ops.permute(t, 0, 2, 1, 3) for t in (q, k, v)]                 # (B, h, T, hd)
        if not self.context_enabled:
            y = grouped_causal_attention(*heads)
            return self.o_proj(ops.reshape(ops.permute(y, 0, 2, 1, 3), B, T, nh * hd))
        P = self.group.size
        layout = local_layout(self.group, self.algo, T, seq_len if seq_len is not None else self.seq_len)
        n = layout.seq_len
        if self.algo is CPAlgo.RING:
            y = ops.permute(ring_attention(*heads, self.group, n), 0, 2, 1, 3)    # (B, T, nh, hd)
        else:
            y = self._ulysses(q, k, v, [layout.local_len(j) for j in range(P)], n)
        return self.o_proj(ops.reshape(y, B, T, nh * hd))

    def _ulysses(self, q: Tensor, k: Tensor, v: Tensor, lens, n: int) -> Tensor:
        """All-to-all to head shards (the query heads and the key/value heads each split over the group; key/value
        heads fewer than the group repeated to one per rank), whole-sequence attention, and back."""
        B, T, nh, hd = q.shape
        nkv, P = k.shape[2], self.group.size
        check_heads(nh, self.group)
        kv = ops.stack([k, v], axis=2)                                          # (B, T, 2, nkv, hd)
        if nkv % P:
            if P % nkv:
                raise ValueError(
                    f"rank {self.group.world.rank}: Ulysses splits this rank's {nkv} key/value heads over the {P} "
                    f"context ranks; {nkv} neither divides by {P} nor divides it (use ring, or key/value heads that "
                    "divide by tensor x context)")
            rep = P // nkv                      # each key/value head repeated: one per context rank
            kv = ops.reshape(ops.expand(ops.reshape(kv, B, T, 2, nkv, 1, hd), B, T, 2, nkv, rep, hd),
                             B, T, 2, P, hd)
        qh = seq_to_head(ops.reshape(q, B, T, 1, nh, hd), self.group, lens)     # (B, n, 1, nh/P, hd)
        kvh = seq_to_head(kv, self.group, lens)                                 # (B, n, 2, nkv'/P, hd)
        kvp = kvh.shape[3]
        qn = ops.permute(ops.reshape(qh, B, n, nh // P, hd), 0, 2, 1, 3)
        kn, vn = (ops.permute(ops.reshape(t, B, n, kvp, hd), 0, 2, 1, 3) for t in ops.split(kvh, 1, axis=2))
        y = ops.permute(grouped_causal_attention(qn, kn, vn), 0, 2, 1, 3)       # (B, n, nh/P, hd)
        y = head_to_seq(ops.reshape(y, B, n, 1, nh // P, hd), self.group, lens)
        return ops.reshape(y, B, T, nh, hd)

    def extra_repr(self) -> str:
        return (f"n_embd={self.n_embd}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, head_dim={self.head_dim}, "
                f"algo={self.algo.value}, context group size={self.group.size}")
