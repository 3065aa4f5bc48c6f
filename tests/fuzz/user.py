"""Blocks written the way PyTorch users write them, for the fuzzer's user-style cases (issue 48, item 7).

* ``("uattn", heads, declared, manual)``: a pre-norm residual block around the user's own ``CausalSelfAttention``
  (nanoGPT's: one ``c_attn`` Linear, ``split`` / ``view`` / ``transpose``, ``F.scaled_dot_product_attention`` or
  a masked softmax) -- a token-mixing module the library does not know; ``declared``: the model plan names it
  ``whole_sequence``.
* ``("cls", declared)``: a class-token ``Parameter`` concatenated before the tokens, one attention over them, the
  class token's row dropped again (ViT's shape, kept causal-free): token-mixing, declared or not.
* ``("shared",)``: two gain blocks holding one ``Parameter`` (a gain shared by two blocks).
* ``("scalar",)`` (``--with-0d``): a 0-d learnable temperature.
* param groups chosen as users choose them (:func:`param_groups`): nanoGPT's ``p.dim() >= 2`` decayed, or minGPT's
  "Linear weights decay; biases, norms, embeddings, class tokens, gains and temperatures do not", each group with
  its own weight decay and learning rate; the optimizer built from the user's model before ``parallelize`` or after.
* a greedy ``generate`` loop (nanoGPT's, ``top_k=1``) after training, through ``pm`` in ``eval()`` under ``no_grad``.
* the first layer ``UserEmbedding``: token and position embeddings, the positions numbered by its own
  ``arange`` (``takes`` False) or taken as ``positions=`` when given (``takes`` True, the documented change).

A case equals the serial model, or ``parallelize`` refuses it at construction with its reason; a case that runs
and differs is a failure.
"""
from __future__ import annotations

import numpy as np

import axonmpi
import axonmpi.nn as nn
import axonmpi.nn.functional as F

__all__ = ["param_groups", "generate", "CausalSelfAttention", "ClsBlock", "Gain", "OwnAttentionBlock", "Temperature", "UserEmbedding",
           "UserEmbeddingPositions", "USER_KINDS"]

F64 = np.float64
USER_KINDS = ("uattn", "cls", "shared", "scalar")


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, as its users write it."""

    def __init__(self, c: int, heads: int, manual: bool):
        super().__init__()
        self.c_attn = nn.Linear(c, 3 * c, dtype=F64)
        self.c_proj = nn.Linear(c, c, dtype=F64)
        self.n_head, self.n_embd, self.manual = heads, c, manual

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.manual:
            att = (q @ k.transpose(-2, -1)) * (1.0 / np.sqrt(k.size(-1)))
            att = att.masked_fill(np.tril(np.ones((T, T))) == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class OwnAttentionBlock(nn.Module):
    def __init__(self, c: int, heads: int, manual: bool):
        super().__init__()
        self.ln = nn.LayerNorm(c, dtype=F64)
        self.attn = CausalSelfAttention(c, heads, manual)

    def forward(self, x):
        return x + self.attn(self.ln(x))


class ClsBlock(nn.Module):
    """A class token before the tokens, attention over all (not causal), the class token's row dropped."""

    def __init__(self, c: int):
        super().__init__()
        self.cls_token = nn.Parameter(axonmpi.randn(1, 1, c, dtype=F64) * 0.1)
        self.qkv = nn.Linear(c, 3 * c, dtype=F64)

    def forward(self, x):
        B, T, C = x.size()
        h = axonmpi.cat([self.cls_token.expand(B, 1, C), x], dim=1)
        q, k, v = self.qkv(h).split(C, dim=2)
        att = F.softmax((q @ k.transpose(-2, -1)) * (1.0 / np.sqrt(C)), dim=-1)
        return x + (att @ v)[:, 1:, :]


class Gain(nn.Module):
    """``x * gain``; two of them hold one Parameter (:func:`shared_gains`)."""

    def __init__(self, gain):
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


def shared_gains(c: int):
    g = nn.Parameter(1.0 + 0.1 * axonmpi.randn(c, dtype=F64))
    return Gain(g), Gain(g)


class Temperature(nn.Module):
    """A 0-d learnable temperature."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(axonmpi.tensor(1.5, dtype=F64))

    def forward(self, x):
        return x * self.t


class UserEmbedding(nn.Module):
    """Token and position embeddings; numbers its own positions (``arange(0, t)``)."""

    def __init__(self, vocab: int, block: int, c: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c, dtype=F64), nn.Embedding(block, c, dtype=F64)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(axonmpi.arange(0, idx.shape[1], dtype=axonmpi.long))


class UserEmbeddingPositions(UserEmbedding):
    """The documented change: ``positions=None`` taken, and used when given."""

    def forward(self, idx, positions=None):
        pos = positions if positions is not None else axonmpi.arange(0, idx.shape[1], dtype=axonmpi.long)
        return self.wte(idx) + self.wpe(pos)


def param_groups(model, rule: str, lr: float, wd: float):
    """The user's optimizer groups of ``model`` (its own object, serial names and shapes under any layout):
    ``"dim"``: nanoGPT's ``configure_optimizers`` (every trainable tensor with ``dim() >= 2`` decayed);
    ``"name"``: minGPT's (weights of ``nn.Linear`` decayed; biases and the parameters of norms, embeddings and the
    user's own modules not).  The undecayed group takes twice the learning rate (each group's options apply)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if rule == "dim":
        decay = {id(p) for _, p in params if p.dim() >= 2}
    elif rule == "name":
        decay = set()
        for _, m in model.named_modules():
            for pn, p in m.named_parameters(recurse=False):
                if pn.endswith("weight") and isinstance(m, nn.Linear) and not isinstance(m, nn.Embedding):
                    decay.add(id(p))
        for _, m in model.named_modules():       # a weight an Embedding shares with a Linear head: the Embedding's
            if isinstance(m, (nn.Embedding, nn.LayerNorm)):
                decay -= {id(p) for p in m.parameters(recurse=False)}
    else:
        raise ValueError(f"param_groups: rule {rule!r}, expected 'dim' or 'name'")
    return [{"params": [p for _, p in params if id(p) in decay], "weight_decay": wd},
            {"params": [p for _, p in params if id(p) not in decay], "weight_decay": 0.0, "lr": 2 * lr}]


def generate(model, idx, steps: int):
    """nanoGPT's ``generate`` with ``top_k=1`` (greedy): ``steps`` tokens appended to ``idx``; returns the tokens and
    the last step's logits (host arrays)."""
    model.eval()
    logits = None
    with axonmpi.no_grad():
        for _ in range(steps):
            out = model(idx)
            logits = out[:, -1, :]
            v, _ = axonmpi.topk(logits, 1)
            probs = F.softmax(logits.masked_fill(logits < v[:, [-1]], -float("inf")), dim=-1)
            nxt = axonmpi.argmax(probs, dim=-1, keepdim=True)
            idx = axonmpi.cat([idx, nxt], dim=1)
    model.train()
    return np.asarray(idx.numpy()), np.asarray(logits.numpy())
