"""Grouped-query causal self-attention (``n_kv_head`` key/value heads shared by groups of query heads)
with rotary positions, in transformers' ``LlamaAttention`` shape: separate ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``.

[Note: local heads come from the widths]
The numbers of query and key/value heads are read from the projected widths (``reshape(B, T, -1,
head_dim)``, torchtitan's way), not from the constructor: under a Megatron plan that makes
``q_proj``/``k_proj``/``v_proj`` column-parallel and ``o_proj`` row-parallel, each rank holds
``n_head / p`` query heads and ``n_kv_head / p`` key/value heads, and the same forward computes its
heads with no tensor-parallel layer of its own (``p`` must divide ``n_kv_head``).  Query head ``h``
reads key/value head ``h // (n_head / n_kv_head)`` (transformers' ``repeat_kv``); on a rank the
groups are contiguous, so the rule holds per rank.  The keys and values are not repeated in memory:
the queries of a group are stacked along the time axis, one matmul per key/value head.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from ..autograd import ops, ops_llama, ops_nn
from ..autograd.tensor import Tensor
from .layers import Dropout, Linear
from .module import Module

__all__ = ["GroupedQueryAttention"]


class GroupedQueryAttention(Module):
    """Causal self-attention with ``n_head`` query heads and ``n_kv_head`` key/value heads.

    Args:
        n_embd: model width C.
        n_head: query heads.
        n_kv_head: key/value heads (default ``n_head``: multi-head attention; 1: multi-query); must
            divide ``n_head``.
        head_dim: width of a head (default ``n_embd // n_head``).
        bias: biases in the four projections (transformers' ``attention_bias``; Llama: False).
        dropout: dropout on the attention weights in training mode (``attention_dropout``).
        dtype, device: of the parameters.

    ``forward(x, position_embeddings=None)``: ``x`` (B, T, C); ``position_embeddings`` the ``(cos, sin)``
    tables of :class:`~axonmpi.nn.RotaryEmbedding` for the T positions ((T, head_dim) or (B, T, head_dim)),
    applied to queries and keys; ``None``: no rotation.

    Example:
        >>> attn = GroupedQueryAttention(64, n_head=8, n_kv_head=2)
        >>> y = attn(x, RotaryEmbedding(8)(x))                    # x: (B, T, 64)
    """

    def __init__(self, n_embd: int, n_head: int, n_kv_head: Optional[int] = None, head_dim: Optional[int] = None,
                 bias: bool = False, dropout: float = 0.0, dtype=None, device=None):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        for name, v in (("n_embd", n_embd), ("n_head", n_head), ("n_kv_head", n_kv_head)):
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"GroupedQueryAttention: {name} must be a positive int, got {v!r}")
        if n_head % n_kv_head:
            raise ValueError(f"GroupedQueryAttention: n_kv_head={n_kv_head} must divide n_head={n_head}")
        if head_dim is None:
            if n_embd % n_head:
                raise ValueError(f"GroupedQueryAttention: n_embd={n_embd} is not divisible by n_head={n_head}; "
                                 "pass head_dim=")
            head_dim = n_embd // n_head
        self.n_embd, self.n_head, self.n_kv_head, self.head_dim = int(n_embd), int(n_head), int(n_kv_head), int(head_dim)
        self.q_proj = Linear(n_embd, n_head * head_dim, bias=bias, dtype=dtype, device=device)
        self.k_proj = Linear(n_embd, n_kv_head * head_dim, bias=bias, dtype=dtype, device=device)
        self.v_proj = Linear(n_embd, n_kv_head * head_dim, bias=bias, dtype=dtype, device=device)
        self.o_proj = Linear(n_head * head_dim, n_embd, bias=bias, dtype=dtype, device=device)
        self.attn_dropout = Dropout(dropout)

    def _heads(self, y: Tensor, B: int, what: str) -> Tensor:
        T, width = y.shape[1], y.shape[-1]
        if width % self.head_dim:
            raise ValueError(
                f"GroupedQueryAttention: {what} gives {width} features on this rank, not a multiple of head_dim="
                f"{self.head_dim}: a tensor-parallel split must give each rank whole heads (the tensor size must "
                f"divide n_head={self.n_head} and n_kv_head={self.n_kv_head})")
        return ops.reshape(y, B, T, width // self.head_dim, self.head_dim)

    def forward(self, x: Tensor, position_embeddings: Optional[Tuple] = None) -> Tensor:
        B, hd = x.shape[0], self.head_dim
        # (B, T, nh, hd): this rank's heads; T from the projections (a sequence-parallel column layer gathers it)
        q = self._heads(self.q_proj(x), B, "q_proj")
        k = self._heads(self.k_proj(x), B, "k_proj")
        v = self._heads(self.v_proj(x), B, "v_proj")
        T, nh, nkv = q.shape[1], q.shape[2], k.shape[2]
        if nh % nkv:
            raise ValueError(f"GroupedQueryAttention: {nh} query heads and {nkv} key/value heads on this rank; the "
                             f"key/value heads must divide the query heads (n_head={self.n_head}, n_kv_head="
                             f"{self.n_kv_head}: the tensor size must divide n_kv_head)")
        if position_embeddings is not None:
            cos, sin = (t.data if isinstance(t, Tensor) else t for t in position_embeddings)
            if cos.ndim < 2 or cos.shape[-2] != T:
                raise ValueError(f"GroupedQueryAttention: position_embeddings of shape {tuple(cos.shape)} do not cover "
                                 f"the {T} tokens of the projections (expected ({T}, {hd}) or (batch, {T}, {hd}): the "
                                 "tables of every token the attention sees, at its position in the sequence)")
            cos, sin = cos[..., None, :], sin[..., None, :]        # broadcast over heads
            q = ops_llama.apply_rotary_emb(q, cos, sin)
            k = ops_llama.apply_rotary_emb(k, cos, sin)
        rep = nh // nkv
        # the rep query heads of each key/value head stacked along time: (B, nkv, rep * T, hd)
        q = ops.reshape(ops.permute(ops.reshape(q, B, T, nkv, rep, hd), 0, 2, 3, 1, 4), B, nkv, rep * T, hd)
        k = ops.permute(k, 0, 2, 1, 3)                                  # (B, nkv, T, hd)
        v = ops.permute(v, 0, 2, 1, 3)                                  # (B, nkv, T, hd)
        p = self.attn_dropout.p if self.attn_dropout.training else 0.0
        y = ops_nn.grouped_causal_attention(q, k, v, rep, dropout_p=p, scale=1.0 / math.sqrt(hd))
        y = ops.reshape(ops.permute(ops.reshape(y, B, nkv, rep, T, hd), 0, 3, 1, 2, 4), B, T, nh * hd)
        return self.o_proj(y)

    def extra_repr(self) -> str:
        return f"n_embd={self.n_embd}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, head_dim={self.head_dim}"
