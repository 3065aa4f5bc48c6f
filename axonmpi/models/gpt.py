"""A GPT language model (nanoGPT-shaped) built from :mod:`axonmpi.nn`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ..autograd import ops_nn
from ..autograd.grad_mode import no_grad
from ..autograd.tensor import Tensor
from ..backend import get_array_module, to_device, to_host
from ..nn import init
from ..nn.layers import Dropout, Embedding, LayerNorm, Linear
from ..nn.module import Module, ModuleList
from ..nn.transformer import TransformerBlock
from ..random import default_generator

__all__ = ["GPT", "GPTConfig", "GPTEmbedding", "GPTHead"]


@dataclass(frozen=True)
class GPTConfig:
    """GPT hyper-parameters.

    Args:
        vocab_size: number of tokens.
        block_size: maximum context length.
        n_layer, n_head, n_embd: depth, heads and width.
        dropout: dropout probability (embeddings, attention, residuals).
        bias: biases in Linear and LayerNorm layers.
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


class GPTEmbedding(Module):
    """The GPT's input end as a pipeline layer: token + position embeddings, then dropout."""

    def __init__(self, wte: Module, wpe: Module, drop: Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, idx):
        idx = idx.data if isinstance(idx, Tensor) else idx
        xp = get_array_module(self.wte.weight.data)
        idx = xp.asarray(idx)
        return self.drop(self.wte(idx) + self.wpe(xp.arange(idx.shape[1])))


class GPTHead(Module):
    """The GPT's output end as a pipeline layer: final LayerNorm, then the vocabulary projection."""

    def __init__(self, ln_f: Module, lm_head: Module):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class GPT(Module):
    """Decoder-only transformer: ``wte`` + ``wpe`` -> ``blocks`` -> ``ln_f`` -> ``lm_head``.

    Parameter names: ``wte.weight``, ``wpe.weight``, ``blocks.{i}.{ln_1,attn.qkv,attn.proj,ln_2,
    mlp.fc,mlp.proj}.*``, ``ln_f.*``, ``lm_head.weight`` (no bias; not tied to ``wte``).
    GPT-2 init: Linear/Embedding weights N(0, 0.02), biases 0, residual projections
    (``attn.proj``, ``mlp.proj``) N(0, 0.02 / sqrt(2 * n_layer)).  The MLP uses the tanh GELU.

    Example:
        >>> cfg = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32)
        >>> model = GPT(cfg)
        >>> logits, loss = model(idx, targets)
    """

    def __init__(self, config: GPTConfig, dtype=None, device=None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT expects a GPTConfig, got {type(config).__name__}")
        self.config = config
        c = config
        self.wte = Embedding(c.vocab_size, c.n_embd, dtype=dtype)
        self.wpe = Embedding(c.block_size, c.n_embd, dtype=dtype)
        self.drop = Dropout(c.dropout)
        self.blocks = ModuleList(
            TransformerBlock(c.n_embd, c.n_head, c.dropout, c.bias, dtype=dtype) for _ in range(c.n_layer))
        self.ln_f = LayerNorm(c.n_embd, bias=c.bias, dtype=dtype)
        self.lm_head = Linear(c.n_embd, c.vocab_size, bias=False, dtype=dtype)
        self._init_weights()
        if device is not None:
            self.to(device)

    def _init_weights(self) -> None:
        std_resid = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, m in self.named_modules():
            std = std_resid if name.endswith("attn.proj") or name.endswith("mlp.proj") else 0.02
            if isinstance(m, (Linear, Embedding)):
                init.normal_(m.weight, 0.0, std)
            elif hasattr(m, "init_full_") and m._parameters.get("weight") is not None:
                # a tensor-parallel layer (auto_parallelize): this rank's shard of the full N(0, std) draw
                m.init_full_("weight", lambda w, s=std: init.normal_(w, 0.0, s))
            else:
                continue
            if not isinstance(m, Embedding) and getattr(m, "bias", None) is not None:
                init.zeros_(m.bias)

    def pipeline_layers(self) -> list:
        """The model as pipeline layers sharing its parameters: ``[embedding, block 0, ..., head]``
        (what :func:`~axonmpi.parallel.pipeline.split_module` cuts)."""
        return [GPTEmbedding(self.wte, self.wpe, self.drop), *self.blocks, GPTHead(self.ln_f, self.lm_head)]

    def forward(self, idx, targets=None) -> Tuple[Tensor, Optional[Tensor]]:
        """Logits (B, T, vocab) for token ids ``idx`` (B, T), and the mean cross-entropy if ``targets``."""
        idx = idx.data if isinstance(idx, Tensor) else idx
        if idx.ndim != 2:
            raise ValueError(f"GPT.forward expects idx of shape (batch, time), got {tuple(idx.shape)}")
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        xp = get_array_module(self.wte.weight.data)
        idx = xp.asarray(idx)
        pos = xp.arange(T)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            targets = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
            loss = ops_nn.cross_entropy(logits, targets)
        return logits, loss

    @no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None):
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T); returns (B, T + max_new_tokens) ids.

        Sampling uses :mod:`axonmpi.random`'s generator on the host.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        was_tensor = isinstance(idx, Tensor)
        idx = to_host(idx.data if was_tensor else idx).astype(np.int64)
        device = self.wte.weight.device
        gen = default_generator()
        for _ in range(max_new_tokens):
            cond = idx[:, -self.config.block_size:]
            logits, _ = self(to_device(cond, device))
            z = to_host(logits.data[:, -1, :]).astype(np.float64) / temperature
            if top_k is not None:
                k = min(int(top_k), z.shape[-1])
                kth = np.sort(z, axis=-1)[:, -k][:, None]
                z = np.where(z < kth, -np.inf, z)
            p = np.exp(z - z.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            u = gen.random((p.shape[0], 1))
            nxt = np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), p.shape[-1] - 1)
            idx = np.concatenate([idx, nxt[:, None]], axis=1)
        out = to_device(idx, device)
        return Tensor(out) if was_tensor else out

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameter count (optionally excluding the position embedding, like nanoGPT)."""
        n = super().num_parameters()
        return n - self.wpe.weight.numel() if non_embedding else n

    def extra_repr(self) -> str:
        return f"{self.config}"
