"""Transformer building blocks: causal self-attention, MLP and a pre-norm block (nanoGPT-shaped), and
Llama's gated MLP (``SwiGLU``: ``gate_proj``, ``up_proj``, ``down_proj``).

Parameter names: ``attn.qkv`` (fused q/k/v projection, (3*n_embd, n_embd)), ``attn.proj``,
``mlp.fc``, ``mlp.proj``, ``ln_1``, ``ln_2`` — e.g. ``"blocks.3.attn.qkv.bias"`` in a GPT.
"""
from __future__ import annotations

from ..autograd import ops, ops_llama, ops_nn
from ..autograd.tensor import Tensor
from .layers import GELU, Dropout, LayerNorm, Linear
from .module import Module

__all__ = ["CausalSelfAttention", "MLP", "SwiGLU", "TransformerBlock"]


class CausalSelfAttention(Module):
    """Multi-head causal self-attention with a fused ``qkv`` projection and an output ``proj``.

    Args:
        n_embd: model width C (must be divisible by ``n_head``).
        n_head: number of heads.
        dropout: dropout on attention weights and on the output.
        bias: whether the projections have biases.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True,
                 dtype=None, device=None):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_embd, self.n_head = n_embd, n_head
        self.qkv = Linear(n_embd, 3 * n_embd, bias=bias, dtype=dtype, device=device)
        self.proj = Linear(n_embd, n_embd, bias=bias, dtype=dtype, device=device)
        self.attn_dropout = Dropout(dropout)
        self.resid_dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        nh, hd = self.n_head, C // self.n_head
        q, k, v = ops.split(self.qkv(x), C, axis=2)
        q = ops.permute(ops.reshape(q, B, T, nh, hd), 0, 2, 1, 3)
        k = ops.permute(ops.reshape(k, B, T, nh, hd), 0, 2, 1, 3)
        v = ops.permute(ops.reshape(v, B, T, nh, hd), 0, 2, 1, 3)
        # one fused op (scores, causal mask, softmax, dropout drawn as self.attn_dropout would, @ v)
        p = self.attn_dropout.p if self.attn_dropout.training else 0.0
        y = ops_nn.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hd)
        y = ops.reshape(ops.permute(y, 0, 2, 1, 3), B, T, C)
        return self.resid_dropout(self.proj(y))

    def extra_repr(self) -> str:
        return f"n_embd={self.n_embd}, n_head={self.n_head}"


class MLP(Module):
    """``fc`` (C -> hidden) -> GELU -> ``proj`` (hidden -> C) -> dropout."""

    def __init__(self, n_embd: int, hidden: int = None, dropout: float = 0.0, bias: bool = True,
                 approximate: str = "tanh", dtype=None, device=None):
        super().__init__()
        hidden = 4 * n_embd if hidden is None else hidden
        self.fc = Linear(n_embd, hidden, bias=bias, dtype=dtype, device=device)
        self.act = GELU(approximate)
        self.proj = Linear(hidden, n_embd, bias=bias, dtype=dtype, device=device)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class TransformerBlock(Module):
    """Pre-norm block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True,
                 dtype=None, device=None):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias=bias, dtype=dtype, device=device)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, dtype=dtype, device=device)
        self.ln_2 = LayerNorm(n_embd, bias=bias, dtype=dtype, device=device)
        self.mlp = MLP(n_embd, dropout=dropout, bias=bias, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class SwiGLU(Module):
    """The gated MLP of Llama (transformers' ``LlamaMLP``): ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    ``gate_proj`` and ``up_proj`` (C -> hidden) are column-parallel and ``down_proj`` (hidden -> C)
    row-parallel under a Megatron plan; the gate is fused (:func:`~axonmpi.nn.functional.swiglu`).

    Example:
        >>> mlp = SwiGLU(64, 172)
        >>> mlp(x).shape == x.shape
        True
    """

    def __init__(self, n_embd: int, hidden: int, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.gate_proj = Linear(n_embd, hidden, bias=bias, dtype=dtype, device=device)
        self.up_proj = Linear(n_embd, hidden, bias=bias, dtype=dtype, device=device)
        self.down_proj = Linear(hidden, n_embd, bias=bias, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops_llama.swiglu(self.gate_proj(x), self.up_proj(x)))
