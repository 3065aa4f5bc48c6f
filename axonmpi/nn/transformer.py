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

    _fuses_residual = True     # forward(x, residual=r) gives r + resid_dropout(out) in one op (TransformerBlock)

    def forward(self, x: Tensor, residual: Tensor = None) -> Tensor:
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
        return _dropped(self.resid_dropout, self.proj(y), residual)

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

    _fuses_residual = True     # forward(x, residual=r) gives r + dropout(out) in one op (TransformerBlock)

    def forward(self, x: Tensor, residual: Tensor = None) -> Tensor:
        return _dropped(self.dropout, self.proj(self.act(self.fc(x))), residual)


def _dropped(drop: Dropout, out: Tensor, residual) -> Tensor:
    """``drop(out)``, or ``residual + drop(out)`` as one op (``F.dropout_add``: one pass each way, the same mask
    and values as the two-op form) when a residual is given."""
    if residual is None:
        return drop(out)
    return ops_nn.dropout_add(out, residual, drop.p, drop.training)


def _residual(sub: Module, h: Tensor, x: Tensor) -> Tensor:
    """``x + sub(h)``; the output dropout of ``sub`` fused with the add where ``sub``'s class offers it (a class
    a transform swapped in, a subclass, or a module with forward hooks, which must see ``sub``'s own output,
    takes the two-op form)."""
    if type(sub).__dict__.get("_fuses_residual") and not sub._forward_hooks:
        return sub(h, residual=x)
    return x + sub(h)


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
        x = _residual(self.attn, self.ln_1(x), x)
        return _residual(self.mlp, self.ln_2(x), x)


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
