"""A GPT language model (nanoGPT-shaped) built from :mod:`axonmpi.nn`."""
from __future__ import annotations

import math
import os
from collections import OrderedDict
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
from ..nn.moe import ExpertLinear, MoE, moe_loss
from ..nn.transformer import TransformerBlock
from ..random import default_generator

__all__ = ["GPT", "GPTConfig", "GPTEmbedding", "GPTHead", "init_gpt_weights", "mask_padded_vocab", "padded_vocab_size"]

# ours <-> Hugging Face GPT-2 names inside a block (Conv1D layers store their weight transposed)
_HF_BLOCK = {"ln_1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "ln_2": "ln_2",
             "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _is_conv1d(hf_name: str) -> bool:
    return any(f".{c}." in hf_name for c in _CONV1D)


def _hf_arrays(state_dict) -> "OrderedDict[str, np.ndarray]":
    """HF names without ``transformer.`` -> host NumPy arrays (torch tensors through ``.numpy()``)."""
    out = OrderedDict()
    for k, v in state_dict.items():
        if hasattr(v, "detach"):
            v = v.detach().cpu().numpy()
        out[k[len("transformer."):] if k.startswith("transformer.") else k] = np.asarray(to_host(v))
    return out


def _from_hf_name(k: str) -> Optional[str]:
    """Our name for HF name ``k`` (no ``transformer.``); None for the attention mask buffers."""
    if k in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"):
        return k
    parts = k.split(".")
    if parts[0] == "h" and len(parts) >= 4:
        inner, leaf = ".".join(parts[2:-1]), parts[-1]
        for ours, hf in _HF_BLOCK.items():
            if hf == inner:
                return f"blocks.{parts[1]}.{ours}.{leaf}"
        if inner == "attn" and leaf in ("bias", "masked_bias"):  # causal-mask buffers of old versions
            return None
    raise ValueError(f"from_hf_gpt2: unknown GPT-2 key {k!r} (expected wte, wpe, h.{{i}}.{{ln_1,attn.c_attn,"
                     "attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}}.*, ln_f.*, lm_head.weight)")


def _to_hf_name(k: str) -> str:
    if k == "lm_head.weight":
        return k
    parts = k.split(".")
    if parts[0] == "blocks":
        return f"transformer.h.{parts[1]}.{_HF_BLOCK['.'.join(parts[2:-1])]}.{parts[-1]}"
    return "transformer." + k


@dataclass(frozen=True)
class GPTConfig:
    """GPT hyper-parameters.

    Args:
        vocab_size: number of tokens.
        block_size: maximum context length.
        n_layer, n_head, n_embd: depth, heads and width.
        dropout: dropout probability (embeddings, attention, residuals).
        bias: biases in Linear and LayerNorm layers.
        tie_word_embeddings: ``lm_head.weight`` is ``wte.weight`` (one Parameter, as GPT-2 and
            PyTorch's ``weight tying``; both names stay in ``state_dict``). Default: untied.
        moe_experts: 0 (dense MLPs) or E: the MLP of every ``moe_every``-th block (blocks
            ``moe_every - 1, 2 moe_every - 1, ...``) is an :class:`~axonmpi.nn.MoE` of E experts of
            the MLP's shape (``blocks.{i}.mlp.router.weight``, ``blocks.{i}.mlp.experts.{fc,proj}.*``).
        moe_top_k, moe_gating, moe_capacity_factor: the MoE's ``top_k``, ``gating`` and
            ``capacity_factor`` (``None``: dropless).
        moe_every: 1 (every block) or 2 (every other block, as GShard and Switch).
        moe_aux_loss_coeff, moe_z_loss_coeff: weights of the load-balancing and router z losses in
            :meth:`GPT.moe_auxiliary_loss` (Megatron's ``moe_aux_loss_coeff`` / ``moe_z_loss_coeff``).
        padded_vocab_size: rows of ``wte`` and ``lm_head`` when more than ``vocab_size`` (Megatron's padded
            vocabulary, so that it divides over the tensor group: :func:`padded_vocab_size`). The padding
            rows are never a token: their logits are masked out (``-0.5 * finfo.max``, so softmax gives them
            exactly 0: the loss and its gradients equal the unpadded model's, and :meth:`GPT.generate` never
            samples them), and exports write the first ``vocab_size`` rows. ``None``: no padding.
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    tie_word_embeddings: bool = False
    moe_experts: int = 0
    moe_top_k: int = 1
    moe_every: int = 1
    moe_gating: str = "softmax"
    moe_capacity_factor: Optional[float] = None
    moe_aux_loss_coeff: float = 1e-2
    moe_z_loss_coeff: float = 1e-3
    padded_vocab_size: Optional[int] = None

    @property
    def vocab_rows(self) -> int:
        """Rows of ``wte`` / ``lm_head``: ``padded_vocab_size`` when set, else ``vocab_size``."""
        return self.padded_vocab_size or self.vocab_size

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.moe_experts, int) or self.moe_experts < 0:
            raise ValueError(f"GPTConfig.moe_experts must be 0 (dense) or a positive int, got {self.moe_experts!r}")
        if self.moe_experts and (self.moe_top_k not in (1, 2) or self.moe_top_k > self.moe_experts):
            raise ValueError(f"GPTConfig.moe_top_k must be 1 or 2 and at most moe_experts={self.moe_experts}, "
                             f"got {self.moe_top_k!r}")
        if self.moe_every not in (1, 2):
            raise ValueError(f"GPTConfig.moe_every must be 1 (every block) or 2 (every other), got {self.moe_every!r}")
        p = self.padded_vocab_size
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < self.vocab_size):
            raise ValueError(f"GPTConfig.padded_vocab_size must be None or an int >= vocab_size={self.vocab_size}, "
                             f"got {p!r}")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int = 1) -> int:
    """Megatron's ``--make-vocab-size-divisible-by N``: the vocabulary rounded up to a multiple of
    ``N * tensor_parallel`` (so each tensor rank holds whole multiples of N rows).

    Example:
        >>> padded_vocab_size(95, 1, tensor_parallel=2), padded_vocab_size(50257, 128)
        (96, 50304)
    """
    if isinstance(divisible_by, bool) or not isinstance(divisible_by, int) or divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by must be a positive int, got {divisible_by!r}")
    m = divisible_by * max(1, int(tensor_parallel))
    return -(-int(vocab_size) // m) * m


def mask_padded_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """``logits`` with the columns past ``vocab_size`` (Megatron's padding rows) pushed to ``-0.5 * finfo.max``:
    softmax gives them exactly 0, so the loss and every gradient equal the unpadded model's."""
    n = logits.shape[-1]
    if n == vocab_size:
        return logits
    xp = get_array_module(logits.data)
    mask = xp.zeros(n, dtype=logits.data.dtype)
    mask[vocab_size:] = -0.5 * np.finfo(mask.dtype).max
    return logits + Tensor._wrap(mask)


def _padded(c: "GPTConfig") -> Optional[int]:
    return c.vocab_size if c.padded_vocab_size is not None else None


class GPTEmbedding(Module):
    """The GPT's input end as a pipeline layer: token + position embeddings, then dropout."""

    def __init__(self, wte: Module, wpe: Module, drop: Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, idx, positions=None):
        """``positions``: each column's position (default ``0 .. T-1``), as :meth:`GPT.forward`'s."""
        idx = idx.data if isinstance(idx, Tensor) else idx
        xp = get_array_module(self.wte.weight.data)
        idx = xp.asarray(idx)
        pos = xp.arange(idx.shape[1]) if positions is None else xp.asarray(positions)
        return self.drop(self.wte(idx) + self.wpe(pos))


class GPTHead(Module):
    """The GPT's output end as a pipeline layer: final LayerNorm, then the vocabulary projection."""

    def __init__(self, ln_f: Module, lm_head: Module, vocab_size: Optional[int] = None):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head
        self.vocab_size = vocab_size        # set when the head's rows are padded (GPTConfig.padded_vocab_size)

    def forward(self, x):
        logits = self.lm_head(self.ln_f(x))
        return logits if self.vocab_size is None else mask_padded_vocab(logits, self.vocab_size)


def init_gpt_weights(module: Module, n_layer: int) -> None:
    """GPT-2's init of ``module``'s Linear / Embedding weights (and tensor-parallel layers' shards of the
    full draw): N(0, 0.02), residual projections (names ending ``attn.proj`` / ``mlp.proj`` /
    ``experts.proj``)
    N(0, 0.02 / sqrt(2 * n_layer)), biases 0; in ``named_modules`` order (one layer alone draws as
    it would inside the whole GPT)."""
    std_resid = 0.02 / math.sqrt(2 * n_layer)
    for name, m in module.named_modules():
        std = std_resid if name.endswith(("attn.proj", "mlp.proj", "experts.proj")) else 0.02
        if isinstance(m, (Linear, Embedding, ExpertLinear)):
            init.normal_(m.weight, 0.0, std)
        elif hasattr(m, "init_full_") and "weight" in dict(m.named_parameters(recurse=False)):
            # a tensor-parallel layer (auto_parallelize): this rank's shard of the full N(0, std) draw
            m.init_full_("weight", lambda w, s=std: init.normal_(w, 0.0, s))
        else:
            continue
        if not isinstance(m, Embedding) and getattr(m, "bias", None) is not None:
            init.zeros_(m.bias)


class GPT(Module):
    """Decoder-only transformer: ``wte`` + ``wpe`` -> ``blocks`` -> ``ln_f`` -> ``lm_head``.

    Parameter names: ``wte.weight``, ``wpe.weight``, ``blocks.{i}.{ln_1,attn.qkv,attn.proj,ln_2,
    mlp.fc,mlp.proj}.*``, ``ln_f.*``, ``lm_head.weight`` (no bias; tied to ``wte`` only with
    ``GPTConfig(tie_word_embeddings=True)``). Hugging Face GPT-2 weights come in and go out by
    :meth:`from_hf_gpt2` / :meth:`to_hf_gpt2` (same math: tanh GELU, LayerNorm eps 1e-5,
    biases everywhere, attention scaled by 1/sqrt(head_dim)).
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
        self.wte = Embedding(c.vocab_rows, c.n_embd, dtype=dtype)
        self.wpe = Embedding(c.block_size, c.n_embd, dtype=dtype)
        self.drop = Dropout(c.dropout)
        self.blocks = ModuleList(
            TransformerBlock(c.n_embd, c.n_head, c.dropout, c.bias, dtype=dtype) for _ in range(c.n_layer))
        if c.moe_experts:
            for i, block in enumerate(self.blocks):
                if (i + 1) % c.moe_every == 0:
                    block.mlp = MoE(c.n_embd, c.moe_experts, top_k=c.moe_top_k, gating=c.moe_gating,
                                    capacity_factor=c.moe_capacity_factor, bias=c.bias, dtype=dtype)
        self.ln_f = LayerNorm(c.n_embd, bias=c.bias, dtype=dtype)
        self.lm_head = Linear(c.n_embd, c.vocab_rows, bias=False, dtype=dtype)
        self.init_weights()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight
        if device is not None:
            self.to(device)

    def init_weights(self) -> None:
        """GPT-2's init over all modules (see the class docstring); ``GPT.__init__`` calls it."""
        init_gpt_weights(self, self.config.n_layer)

    @staticmethod
    def build_pipeline_layer(config: GPTConfig, i: int, dtype=None) -> Module:
        """Pipeline layer ``i`` (``0``: embedding, ``1..n_layer``: blocks, ``n_layer + 1``: head) as
        ``GPT.__init__`` constructs it (same modules, same random draws in the same order), not yet
        passed through :meth:`init_weights` (:func:`init_gpt_weights` on the layer does that)."""
        c = config
        if i == 0:
            return GPTEmbedding(Embedding(c.vocab_rows, c.n_embd, dtype=dtype),
                                Embedding(c.block_size, c.n_embd, dtype=dtype), Dropout(c.dropout))
        if i <= c.n_layer:
            return TransformerBlock(c.n_embd, c.n_head, c.dropout, c.bias, dtype=dtype)
        return GPTHead(LayerNorm(c.n_embd, bias=c.bias, dtype=dtype),
                       Linear(c.n_embd, c.vocab_rows, bias=False, dtype=dtype), _padded(c))

    @classmethod
    def from_pipeline_layers(cls, config: GPTConfig, layers: list) -> "GPT":
        """The GPT made of ``[embedding, block 0, ..., head]`` (as :meth:`pipeline_layers` gives them),
        sharing their parameters; no init, no tying."""
        model = cls.__new__(cls)
        Module.__init__(model)
        model.config = config
        emb, head = layers[0], layers[-1]
        model.wte, model.wpe, model.drop = emb.wte, emb.wpe, emb.drop
        model.blocks = ModuleList(layers[1:-1])
        model.ln_f, model.lm_head = head.ln_f, head.lm_head
        return model

    def moe_auxiliary_loss(self) -> Optional[Tensor]:
        """``moe_aux_loss_coeff * aux + moe_z_loss_coeff * z`` of the last forward's MoE layers (summed
        over layers; global-batch values), to add to the language-model loss before backward;
        ``None`` for a dense GPT.

        Example:
            >>> logits, loss = gpt(idx, targets)
            >>> (loss + gpt.moe_auxiliary_loss()).backward()
        """
        return moe_loss(self, self.config.moe_aux_loss_coeff, self.config.moe_z_loss_coeff)

    def pipeline_layers(self) -> list:
        """The model as pipeline layers sharing its parameters: ``[embedding, block 0, ..., head]``
        (what :func:`~axonmpi.parallel.pipeline.split_module` cuts)."""
        return [GPTEmbedding(self.wte, self.wpe, self.drop), *self.blocks,
                GPTHead(self.ln_f, self.lm_head, _padded(self.config))]

    def forward(self, idx, targets=None, positions=None) -> Tuple[Tensor, Optional[Tensor]]:
        """Logits (B, T, vocab) for token ids ``idx`` (B, T), and the mean cross-entropy if ``targets``.

        ``positions``: the position of each column of ``idx`` (default ``0 .. T-1``; Hugging Face's
        ``position_ids``), for a caller that feeds a subset of a sequence's tokens.
        """
        idx = idx.data if isinstance(idx, Tensor) else idx
        if idx.ndim != 2:
            raise ValueError(f"GPT.forward expects idx of shape (batch, time), got {tuple(idx.shape)}")
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        xp = get_array_module(self.wte.weight.data)
        idx = xp.asarray(idx)
        pos = xp.arange(T) if positions is None else xp.asarray(positions)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if self.config.padded_vocab_size is not None:
            logits = mask_padded_vocab(logits, self.config.vocab_size)
        loss = None
        if targets is not None:
            targets = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
            loss = ops_nn.cross_entropy(logits, targets)
        return logits, loss

    @no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None):
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T); returns (B, T + max_new_tokens) ids.

        Sampling uses :mod:`axonmpi.random`'s generator on the host.  MoE layers whose experts are
        all on this rank route these sequences alone (their data-parallel statistics group, whose
        collectives the other ranks would not join, is set aside meanwhile), so one rank of a
        data-parallel MoE run can sample; expert-parallel layers need every rank to call this.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        local = [m for m in self.modules() if isinstance(m, MoE) and m.dispatcher is None]
        saved = [m.stats_group for m in local]
        for m in local:
            m.stats_group = None
        try:
            return self._generate(idx, max_new_tokens, temperature, top_k)
        finally:
            for m, g in zip(local, saved):
                m.stats_group = g

    def _generate(self, idx, max_new_tokens: int, temperature: float, top_k: Optional[int]):
        was_tensor = isinstance(idx, Tensor)
        idx = to_host(idx.data if was_tensor else idx).astype(np.int64)
        device = self.wte.weight.device
        gen = default_generator()
        for _ in range(max_new_tokens):
            cond = idx[:, -self.config.block_size:]
            logits, _ = self(to_device(cond, device))
            z = to_host(logits.data[:, -1, :self.config.vocab_size]).astype(np.float64) / temperature
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

    # -- Hugging Face GPT-2 ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source, n_head: Optional[int] = None, *, dtype=None, device=None, dropout: float = 0.0) -> "GPT":
        """:meth:`from_hf_gpt2` under the name :meth:`Llama.from_hf <axonmpi.models.Llama.from_hf>` has: a
        transformers GPT-2 directory (``config.json`` + ``model.safetensors``) or a ``GPT2LMHeadModel`` state dict.

        Example:
            >>> gpt = GPT.from_hf("gpt2-dir")          # what GPT2LMHeadModel.save_pretrained wrote
        """
        return cls.from_hf_gpt2(source, n_head, dtype=dtype, device=device, dropout=dropout)

    def save_hf(self, directory, max_shard_size="5GB", dtype=None) -> list:
        """:meth:`save_hf_gpt2` under :meth:`Llama.save_hf <axonmpi.models.Llama.save_hf>`'s name."""
        return self.save_hf_gpt2(directory, max_shard_size=max_shard_size, dtype=dtype)

    @classmethod
    def from_hf_gpt2(cls, state_dict, n_head: Optional[int] = None, *, dtype=None, device=None,
                     dropout: float = 0.0) -> "GPT":
        """A GPT holding Hugging Face GPT-2 weights (``GPT2LMHeadModel`` or ``GPT2Model`` state dict,
        or a directory of ``config.json`` and ``model.safetensors``).

        A directory (a ``str`` or path: what :meth:`save_hf_gpt2` or transformers'
        ``save_pretrained`` writes) gives the sizes, ``n_head`` and the tie
        (``tie_word_embeddings``, transformers' default True) from its ``config.json``, as
        ``GPT2LMHeadModel.from_pretrained`` reads them; a config our GPT cannot compute (another
        activation, LayerNorm epsilon or MLP width) raises naming the field.

        Sizes come from the shapes: vocabulary and width from ``wte``, context from ``wpe``,
        depth from the ``h.{i}`` blocks. The number of heads is not in any shape: pass
        ``n_head`` (``config.n_head``) or it is ``n_embd // 64``, GPT-2's head width in every
        released size (small 12, medium 16, large 20, xl 25). Conv1D weights (``attn.c_attn``,
        ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``; stored (in, out)) are transposed to
        Linear's (out, in); ``lm_head`` is tied to ``wte`` when it is absent or equal to it.

        Args:
            state_dict: name -> array (NumPy, or torch tensors: read through ``.numpy()``),
                with or without the ``transformer.`` prefix.
            n_head: number of attention heads.
            dtype: parameter dtype (default: that of ``wte``).
            device: where the model lives.
            dropout: the GPT's dropout (0 in evaluation, as HF's ``eval()``).

        Returns:
            The GPT (``from_hf_gpt2(sd).to_hf_gpt2()`` gives ``sd``'s arrays back).

        Example:
            >>> hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2))
            >>> gpt = GPT.from_hf_gpt2(hf.state_dict(), n_head=2)
        """
        tie = None
        if isinstance(state_dict, (str, os.PathLike)):
            from . import hf_gpt2
            state_dict, kw = hf_gpt2.read_directory(state_dict)
            n_head, tie = (kw["n_head"] if n_head is None else n_head), kw["tie_word_embeddings"]
        sd = _hf_arrays(state_dict)
        if "wte.weight" not in sd or "wpe.weight" not in sd:
            raise ValueError(f"from_hf_gpt2: no wte.weight/wpe.weight among the keys {sorted(sd)[:8]}...; "
                             "pass a GPT2LMHeadModel or GPT2Model state_dict")
        vocab, c = sd["wte.weight"].shape
        block = sd["wpe.weight"].shape[0]
        layers = sorted({int(k.split(".")[1]) for k in sd if k.startswith("h.")})
        if layers != list(range(len(layers))) or not layers:
            raise ValueError(f"from_hf_gpt2: blocks h.{{i}} must be numbered 0..n_layer-1, found {layers}")
        if n_head is None:
            if c % 64:
                raise ValueError(f"from_hf_gpt2: n_embd={c} is not a multiple of 64 (GPT-2's head width); "
                                 "pass n_head= (config.n_head)")
            n_head = c // 64
        head = sd.get("lm_head.weight")
        if tie is False and head is None:
            raise ValueError("from_hf_gpt2: the config says tie_word_embeddings=false but the weights have no "
                             "lm_head.weight (transformers would initialise it at random)")
        tied = tie if tie is not None else (
            head is None or (head.shape == sd["wte.weight"].shape and np.array_equal(head, sd["wte.weight"])))
        cfg = GPTConfig(vocab_size=int(vocab), block_size=int(block), n_layer=len(layers), n_head=int(n_head),
                        n_embd=int(c), dropout=dropout, bias=True, tie_word_embeddings=bool(tied))
        model = cls(cfg, dtype=dtype if dtype is not None else sd["wte.weight"].dtype)
        ours = {}
        for k, v in sd.items():
            mapped = _from_hf_name(k)
            if mapped is None:
                continue
            ours[mapped] = v.T if k.endswith(".weight") and _is_conv1d(k) else v
        if tied:
            ours["lm_head.weight"] = sd["wte.weight"]
        model.load_state_dict(ours)
        if device is not None:
            model.to(device)
        return model

    def to_hf_gpt2(self) -> "OrderedDict[str, np.ndarray]":
        """This GPT's weights under Hugging Face ``GPT2LMHeadModel`` names (host NumPy arrays).

        Returns a state dict, not a model: ``transformer.wte.weight``, ``transformer.wpe.weight``,
        ``transformer.h.{i}.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj}.*`` (Conv1D
        weights as (in, out)), ``transformer.ln_f.*`` and ``lm_head.weight`` (always present; equal
        to ``wte`` when tied).  The GPT must have biases (GPT-2 has them everywhere).

        To load it, the transformers model must be built from *this* GPT's config, above all
        ``tie_word_embeddings``: our GPT is untied by default while ``GPT2Config()`` ties, and a
        tied ``GPT2LMHeadModel`` replaces the loaded ``lm_head`` by ``wte`` (wrong logits, with
        "all keys matched").  :meth:`hf_gpt2_config` gives that config; simpler still,
        :meth:`save_hf_gpt2` writes a directory that ``from_pretrained`` loads.

        Example:
            >>> hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt.hf_gpt2_config())).eval()
            >>> hf.load_state_dict({k: torch.from_numpy(v) for k, v in gpt.to_hf_gpt2().items()})
            >>> gpt.save_hf_gpt2("gpt2-out")      # or: config.json + model.safetensors
            >>> hf = transformers.GPT2LMHeadModel.from_pretrained("gpt2-out")
        """
        self._check_hf_gpt2("to_hf_gpt2")
        out = OrderedDict()
        for k, v in self.state_dict().items():
            if k in ("wte.weight", "lm_head.weight"):
                v = v[:self.config.vocab_size]          # the padding rows are no token: the unpadded vocabulary
            name = _to_hf_name(k)
            out[name] = np.ascontiguousarray(v.T) if k.endswith(".weight") and _is_conv1d(name) else v
        return out

    def hf_gpt2_config(self) -> dict:
        """transformers' ``GPT2Config`` fields for this GPT (``GPT2Config(**gpt.hf_gpt2_config())``):
        sizes, ``n_positions = block_size``, tanh GELU (``gelu_new``), LayerNorm epsilon 1e-5, the
        dropouts, ``dtype`` and ``tie_word_embeddings`` (True only for ``GPTConfig(tie_word_embeddings=True)``)."""
        self._check_hf_gpt2("hf_gpt2_config")
        from . import hf_gpt2
        return hf_gpt2.hf_config(self.config, self.wte.weight.data.dtype)

    def save_hf_gpt2(self, directory, max_shard_size="5GB", dtype=None) -> list:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` so that
        ``transformers.GPT2LMHeadModel.from_pretrained(directory)`` is this GPT (same logits), tied
        or untied as this GPT is (``tie_word_embeddings`` in the config; a tied head is stored once,
        as ``save_pretrained`` does).  Above ``max_shard_size`` the weights are split into HF shards
        with ``model.safetensors.index.json``; ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp64"``)
        casts the stored weights (default: the model's).  :meth:`from_hf_gpt2` reads the directory back.

        Returns:
            The paths written.

        Example:
            >>> gpt.save_hf_gpt2("gpt2-out")
            >>> hf = transformers.GPT2LMHeadModel.from_pretrained("gpt2-out")
        """
        self._check_hf_gpt2("save_hf_gpt2")
        from . import hf_gpt2
        return hf_gpt2.save(self, directory, max_shard_size=max_shard_size, dtype=dtype)

    def _check_hf_gpt2(self, who: str) -> None:
        if self.config.moe_experts:
            raise ValueError(f"{who}: GPT-2 has no mixture-of-experts layers (this GPT has moe_experts="
                             f"{self.config.moe_experts}); save its state_dict() instead")
        if not self.config.bias:
            raise ValueError(f"{who}: this GPT has bias=False; GPT-2 has biases in every Linear and "
                             "LayerNorm (build it with GPTConfig(bias=True))")

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameter count (optionally excluding the position embedding, like nanoGPT)."""
        n = super().num_parameters()
        return n - self.wpe.weight.numel() if non_embedding else n

    def extra_repr(self) -> str:
        return f"{self.config}"
