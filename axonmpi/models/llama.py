"""A Llama-family language model (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP) built
from :mod:`axonmpi.nn`, with transformers' ``LlamaForCausalLM`` module names."""
from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..autograd import ops_nn
from ..autograd.tensor import Tensor
from ..backend import get_array_module
from ..nn import init
from ..nn.attention import GroupedQueryAttention
from ..nn.layers import Embedding, Linear
from ..nn.module import Module, ModuleList
from ..nn.normalization import RMSNorm
from ..nn.rotary import RotaryEmbedding, check_rope_scaling
from ..nn.transformer import SwiGLU
from .gpt import mask_padded_vocab

__all__ = ["Llama", "LlamaBlock", "LlamaConfig", "LlamaDecoderLayer", "LlamaEmbedding", "LlamaHead", "LlamaModel",
           "init_llama_weights", "llama_hidden_size"]


def llama_hidden_size(n_embd: int, multiple_of: int = 256, ffn_dim_multiplier: Optional[float] = None) -> int:
    """Meta's SwiGLU width rule: ``2/3`` of ``4 * n_embd`` (times ``ffn_dim_multiplier``), rounded up to a
    multiple of ``multiple_of`` (Llama 2 7B: 4096 -> 11008).

    Example:
        >>> llama_hidden_size(4096)
        11008
    """
    hidden = int(2 * 4 * n_embd / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LlamaConfig:
    """Llama hyper-parameters (transformers' ``LlamaConfig`` under the names of :class:`GPTConfig`).

    Args:
        vocab_size: number of tokens (``vocab_size``).
        n_embd: model width (``hidden_size``).
        n_layer: decoder layers (``num_hidden_layers``).
        n_head: query heads (``num_attention_heads``).
        n_kv_head: key/value heads (``num_key_value_heads``; default ``n_head``); must divide ``n_head``.
        intermediate_size: SwiGLU width (default :func:`llama_hidden_size` of ``n_embd``).
        head_dim: width of a head (default ``n_embd // n_head``).
        block_size: longest sequence (``max_position_embeddings``).
        rope_theta: rotary base (Llama 2: 10000, Llama 3: 500000).
        rope_scaling: ``None`` or transformers' ``rope_scaling`` dict: ``{"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``
            (Llama 3.1) or ``{"rope_type": "linear", "factor": f}``; other types raise ``NotImplementedError``.
        rms_norm_eps: RMSNorm epsilon (Llama 2: 1e-5, Llama 3: 1e-5, transformers' default 1e-6).
        tie_word_embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight`` (one Parameter; both
            names stay in ``state_dict``). Default untied (transformers' Llama default).
        attention_bias, mlp_bias: biases in the attention / MLP projections (Llama: none).
        attention_dropout: dropout on the attention weights in training mode.
        initializer_range: standard deviation of the normal init of Linear and Embedding weights.
        padded_vocab_size: rows of ``embed_tokens`` and ``lm_head`` when more than ``vocab_size`` (Megatron's padded
            vocabulary, so that it divides over the tensor group; :func:`~axonmpi.models.gpt.padded_vocab_size`).
            The padding rows are never a token: their logits are masked out (softmax gives them exactly 0, so the
            loss and its gradients equal the unpadded model's), and :meth:`Llama.to_hf` / exports write the first
            ``vocab_size`` rows. ``None``: no padding.
    """

    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_kv_head: Optional[int] = None
    intermediate_size: Optional[int] = None
    head_dim: Optional[int] = None
    block_size: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    padded_vocab_size: Optional[int] = None

    @property
    def vocab_rows(self) -> int:
        """Rows of ``embed_tokens`` / ``lm_head``: ``padded_vocab_size`` when set, else ``vocab_size``."""
        return self.padded_vocab_size or self.vocab_size

    def __post_init__(self):
        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {v!r}")
        kv = self.n_head if self.n_kv_head is None else self.n_kv_head
        if not isinstance(kv, (int, np.integer)) or kv <= 0 or self.n_head % kv:
            raise ValueError(f"LlamaConfig.n_kv_head={self.n_kv_head!r} must be a positive int dividing "
                             f"n_head={self.n_head}")
        hd = self.head_dim
        if hd is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"LlamaConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                                 "pass head_dim=")
            hd = self.n_embd // self.n_head
        if not isinstance(hd, (int, np.integer)) or hd <= 0 or hd % 2:
            raise ValueError(f"LlamaConfig.head_dim must be a positive even int (rotary pairs), got {hd!r}")
        hidden = llama_hidden_size(self.n_embd) if self.intermediate_size is None else self.intermediate_size
        if not isinstance(hidden, (int, np.integer)) or hidden <= 0:
            raise ValueError(f"LlamaConfig.intermediate_size must be a positive int, got {hidden!r}")
        if not float(self.rope_theta) > 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not float(self.rms_norm_eps) >= 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be >= 0, got {self.rms_norm_eps!r}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"LlamaConfig.attention_dropout must be in [0, 1), got {self.attention_dropout!r}")
        p = self.padded_vocab_size
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < self.vocab_size):
            raise ValueError(f"LlamaConfig.padded_vocab_size must be None or an int >= vocab_size={self.vocab_size}, "
                             f"got {p!r}")
        scaling = check_rope_scaling(self.rope_scaling, "LlamaConfig.rope_scaling")
        for name, v in (("n_kv_head", int(kv)), ("head_dim", int(hd)), ("intermediate_size", int(hidden)),
                        ("rope_theta", float(self.rope_theta)), ("rope_scaling", scaling),
                        ("rms_norm_eps", float(self.rms_norm_eps))):
            object.__setattr__(self, name, v)

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a plain dict (``LlamaConfig(**config.to_dict()) == config``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "LlamaConfig":
        """A config from :meth:`to_dict`'s dict (unknown keys raise ``ValueError`` naming them)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"LlamaConfig.from_dict: unknown fields {unknown} (the fields are {sorted(names)})")
        return cls(**d)

    def __hash__(self):
        return hash(tuple((k, repr(v)) for k, v in asdict(self).items()))


def init_llama_weights(module: Module, std: float = 0.02) -> None:
    """transformers' Llama init of ``module``: Linear and Embedding weights N(0, std), biases 0, RMSNorm
    weights 1, in ``named_modules`` order (one layer alone draws as it would inside the whole model)."""
    for _, m in module.named_modules():
        if isinstance(m, (Linear, Embedding)):
            init.normal_(m.weight, 0.0, std)
            if isinstance(m, Linear) and m.bias is not None:
                init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            m.reset_parameters()


class LlamaDecoderLayer(Module):
    """Pre-norm block: ``x + self_attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``.

    ``forward(x, position_embeddings)``: ``(cos, sin)`` of the sequence's positions
    (:class:`~axonmpi.nn.RotaryEmbedding`; :class:`LlamaModel` computes them once for all layers).
    """

    def __init__(self, config: LlamaConfig, dtype=None, device=None):
        super().__init__()
        c = config
        # registered in transformers' order, so state_dict() lists the names as LlamaForCausalLM's does
        self.self_attn = GroupedQueryAttention(c.n_embd, c.n_head, c.n_kv_head, c.head_dim, bias=c.attention_bias,
                                               dropout=c.attention_dropout, dtype=dtype, device=device)
        self.mlp = SwiGLU(c.n_embd, c.intermediate_size, bias=c.mlp_bias, dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(c.n_embd, eps=c.rms_norm_eps, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(c.n_embd, eps=c.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, x: Tensor, position_embeddings: Tuple) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), position_embeddings)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(Module):
    """The decoder without its head (transformers' ``LlamaModel``): ``embed_tokens`` -> ``layers`` -> ``norm``;
    ``rotary_emb`` holds no state. ``forward(idx, positions=None)`` gives the final hidden states (B, T, C)."""

    def __init__(self, config: LlamaConfig, dtype=None, device=None):
        super().__init__()
        c = config
        self.embed_tokens = Embedding(c.vocab_rows, c.n_embd, dtype=dtype, device=device)
        self.layers = ModuleList(LlamaDecoderLayer(c, dtype=dtype, device=device) for _ in range(c.n_layer))
        self.norm = RMSNorm(c.n_embd, eps=c.rms_norm_eps, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)

    def forward(self, idx, positions=None) -> Tensor:
        x = self.embed_tokens(idx)
        if positions is None:
            # the tokens of ``idx`` (not of ``x``: a sequence-parallel region entered at the embedding scatters its
            # output, while the attention's column layers gather the sequence back before the rotation)
            positions = get_array_module(x.data).arange(np.shape(getattr(idx, "data", idx))[1])
        rope = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


class LlamaEmbedding(Module):
    """The Llama's input end as a pipeline layer: ``embed_tokens`` (token ids -> hidden states)."""

    def __init__(self, embed_tokens: Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, idx):
        idx = idx.data if isinstance(idx, Tensor) else idx
        return self.embed_tokens(get_array_module(self.embed_tokens.weight.data).asarray(idx))


class LlamaBlock(Module):
    """A decoder layer as a pipeline layer, with the rotary tables of its own (every stage computes them).

    ``forward(x, positions=None)``: ``positions`` are those of the sequence the attention sees (default
    ``0 .. T-1``).  Under ``parallelize`` a pipeline stage's layer taking ``positions=`` is given them: each
    token's global position under context parallelism, the whole sequence's inside a sequence-parallel region
    (the attention's column layers gather it), so the tables match the attention's tokens.
    """

    def __init__(self, layer: LlamaDecoderLayer, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.layer, self.rotary_emb = layer, rotary_emb

    def forward(self, x, positions=None):
        if positions is None:
            positions = get_array_module(x.data).arange(x.shape[1])
        return self.layer(x, self.rotary_emb(x, positions))


class LlamaHead(Module):
    """The Llama's output end as a pipeline layer: the final ``norm``, then ``lm_head`` (a padded vocabulary's
    padding columns masked out)."""

    def __init__(self, norm: Module, lm_head: Module, vocab_size: Optional[int] = None):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.vocab_size = vocab_size        # set when the head's rows are padded (LlamaConfig.padded_vocab_size)

    def forward(self, x):
        logits = self.lm_head(self.norm(x))
        return logits if self.vocab_size is None else mask_padded_vocab(logits, self.vocab_size)


def _padded(c: LlamaConfig) -> Optional[int]:
    return c.vocab_size if c.padded_vocab_size is not None else None


class Llama(Module):
    """Llama-family causal language model: ``model`` (:class:`LlamaModel`) then ``lm_head``.

    Parameter names are transformers' ``LlamaForCausalLM``'s: ``model.embed_tokens.weight``,
    ``model.layers.{i}.input_layernorm.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
    ``model.layers.{i}.post_attention_layernorm.weight``, ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
    ``model.norm.weight``, ``lm_head.weight`` — so weights move by name (:meth:`from_hf`, :meth:`save_hf`).
    Init: transformers' (Linear and Embedding weights N(0, ``initializer_range``), norms 1).

    Under a Megatron plan (``axonmpi.recipes.llama.llama_plan``: q/k/v and gate/up column-parallel, o/down
    row-parallel, key/value heads split or, when fewer than the tensor size, replicated by ``"column_kv"``) each
    rank computes its heads with the same code; :meth:`pipeline_layers` cut it for a pipeline, each block with its
    rotary tables; see ``docs/llama.md``.

    Example:
        >>> cfg = LlamaConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_kv_head=2, intermediate_size=64)
        >>> model = Llama(cfg)
        >>> logits, loss = model(idx, targets)
    """

    def __init__(self, config: LlamaConfig, dtype=None, device=None):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama expects a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.model = LlamaModel(config, dtype=dtype)
        self.lm_head = Linear(config.n_embd, config.vocab_rows, bias=False, dtype=dtype)
        self.init_weights()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if device is not None:
            self.to(device)

    def init_weights(self) -> None:
        """transformers' init over all modules (see the class docstring); ``Llama.__init__`` calls it."""
        init_llama_weights(self, self.config.initializer_range)

    # -- the model as pipeline layers -------------------------------------------------------------
    @staticmethod
    def build_pipeline_layer(config: LlamaConfig, i: int, dtype=None) -> Module:
        """Pipeline layer ``i`` (``0``: :class:`LlamaEmbedding`, ``1..n_layer``: :class:`LlamaBlock`,
        ``n_layer + 1``: :class:`LlamaHead`) as ``Llama.__init__`` constructs it (same modules, same random draws
        in the same order), not yet through :func:`init_llama_weights`."""
        c = config
        if i == 0:
            return LlamaEmbedding(Embedding(c.vocab_rows, c.n_embd, dtype=dtype))
        if i <= c.n_layer:
            return LlamaBlock(LlamaDecoderLayer(c, dtype=dtype),
                              RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling))
        return LlamaHead(RMSNorm(c.n_embd, eps=c.rms_norm_eps, dtype=dtype),
                         Linear(c.n_embd, c.vocab_rows, bias=False, dtype=dtype), _padded(c))

    @classmethod
    def from_pipeline_layers(cls, config: LlamaConfig, layers: list) -> "Llama":
        """The Llama made of ``[embedding, block 0, ..., head]`` (as :meth:`pipeline_layers` gives them), sharing
        their parameters (the serial names); no init, no tying."""
        model = cls.__new__(cls)
        Module.__init__(model)
        model.config = config
        body = LlamaModel.__new__(LlamaModel)
        Module.__init__(body)
        body.embed_tokens = layers[0].embed_tokens
        body.layers = ModuleList(b.layer for b in layers[1:-1])
        body.norm = layers[-1].norm
        body.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        model.model, model.lm_head = body, layers[-1].lm_head
        return model

    def pipeline_layers(self) -> list:
        """The model as pipeline layers sharing its parameters: ``[embedding, block 0, ..., head]`` (what
        :func:`~axonmpi.parallel.pipeline.split_module` cuts); each block computes its rotary tables."""
        m = self.model
        return [LlamaEmbedding(m.embed_tokens), *(LlamaBlock(layer, m.rotary_emb) for layer in m.layers),
                LlamaHead(m.norm, self.lm_head, _padded(self.config))]

    def forward(self, idx, targets=None, positions=None) -> Tuple[Tensor, Optional[Tensor]]:
        """Logits (B, T, vocab) for token ids ``idx`` (B, T), and the mean cross-entropy if ``targets``
        (``-100``: not counted).

        ``positions``: each token's position, ``(T,)`` or ``(B, T)`` (transformers' ``position_ids``;
        default ``0 .. T-1``): a caller that feeds a part of a sequence passes its global positions.
        """
        idx = idx.data if isinstance(idx, Tensor) else idx
        if idx.ndim != 2:
            raise ValueError(f"Llama.forward expects idx of shape (batch, time), got {tuple(idx.shape)}")
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        xp = get_array_module(self.model.embed_tokens.weight.data)
        idx = xp.asarray(idx)
        if positions is not None:
            positions = positions.data if isinstance(positions, Tensor) else xp.asarray(positions)
            if positions.shape[-1] != T or positions.ndim not in (1, 2):
                raise ValueError(f"Llama.forward: positions of shape {tuple(positions.shape)} do not match idx of "
                                 f"shape {tuple(idx.shape)} (expected ({T},) or (batch, {T}))")
        logits = self.lm_head(self.model(idx, positions))
        if self.config.padded_vocab_size is not None:
            logits = mask_padded_vocab(logits, self.config.vocab_size)
        loss = None
        if targets is not None:
            targets = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
            loss = ops_nn.cross_entropy(logits, targets)
        return logits, loss

    # -- Hugging Face transformers' LlamaForCausalLM --------------------------------------------
    @classmethod
    def from_hf(cls, source, config=None, *, dtype=None, device=None) -> "Llama":
        """A Llama holding transformers ``LlamaForCausalLM`` weights.

        Args:
            source: a directory of ``config.json`` and ``model.safetensors`` (or HF shards with
                ``model.safetensors.index.json``), as ``save_pretrained`` or :meth:`save_hf` writes it;
                or a state dict (names as ``LlamaForCausalLM.state_dict()``, values NumPy arrays or
                torch tensors; a ``LlamaModel``'s names without ``model.`` are accepted).
            config: with a state dict: a :class:`LlamaConfig` (or its ``to_dict()``), a ``config.json`` dict, or a
                transformers ``LlamaConfig`` (head counts, rotary base and scaling and the norm epsilon are in no shape).
                With a directory: ``None`` (``config.json`` is read).
            dtype: parameter dtype (default: that of ``model.embed_tokens.weight``).
            device: where the model lives.

        A config our Llama cannot compute (another activation, rotary type, ``partial_rotary_factor``)
        raises naming the field. With no ``lm_head.weight`` the head is tied (as transformers does when
        ``tie_word_embeddings`` is true); ``tie_word_embeddings=false`` with no head raises.

        Example:
            >>> hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=64, ...))
            >>> ours = Llama.from_hf(hf.state_dict(), hf.config)
            >>> ours = Llama.from_hf("llama-dir")       # config.json + model.safetensors
        """
        from . import hf_llama
        return hf_llama.from_hf(cls, source, config, dtype=dtype, device=device)

    def to_hf(self) -> "OrderedDict[str, np.ndarray]":
        """The weights under transformers ``LlamaForCausalLM`` names (host NumPy arrays; the names are
        this model's own, ``lm_head.weight`` included when tied; a padded vocabulary's first ``vocab_size`` rows)."""
        sd = OrderedDict(self.state_dict())
        if self.config.padded_vocab_size is not None:
            for k in ("model.embed_tokens.weight", "lm_head.weight"):
                sd[k] = sd[k][:self.config.vocab_size]
        return sd

    def hf_config(self) -> Dict[str, Any]:
        """transformers' ``config.json`` for this model (``transformers.LlamaConfig(**model.hf_config())``)."""
        from . import hf_llama
        return hf_llama.hf_config(self.config, self.model.embed_tokens.weight.data.dtype)

    def save_hf(self, directory, max_shard_size="5GB", dtype=None) -> list:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` so that
        ``transformers.LlamaForCausalLM.from_pretrained(directory)`` is this model (same logits); a tied head
        is stored once, as ``save_pretrained`` does.  Above ``max_shard_size`` the weights are split into HF
        shards with ``model.safetensors.index.json``; ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``,
        ``"fp64"``) casts the stored weights.  :meth:`from_hf` reads the directory back.

        Returns:
            The paths written.

        Example:
            >>> model.save_hf("llama-out")
            >>> hf = transformers.LlamaForCausalLM.from_pretrained("llama-out")
        """
        from . import hf_llama
        return hf_llama.save(self, directory, max_shard_size=max_shard_size, dtype=dtype)

    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None):
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T) (the last ``block_size`` as context, the
        :mod:`axonmpi.random` generator on the host); returns (B, T + max_new_tokens) ids, as ``GPT.generate``."""
        from ..autograd.grad_mode import no_grad
        from ..backend import to_device, to_host
        from ..random import default_generator
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        was_tensor = isinstance(idx, Tensor)
        ids = to_host(idx.data if was_tensor else idx).astype(np.int64)
        device, gen = self.lm_head.weight.device, default_generator()
        with no_grad():
            for _ in range(int(max_new_tokens)):
                logits, _ = self(to_device(ids[:, -self.config.block_size:], device))
                z = to_host(logits.data[:, -1, :]).astype(np.float64) / temperature
                if top_k is not None:
                    z = np.where(z < np.sort(z, axis=-1)[:, -min(int(top_k), z.shape[-1])][:, None], -np.inf, z)
                p = np.exp(z - z.max(axis=-1, keepdims=True))
                p /= p.sum(axis=-1, keepdims=True)
                u = gen.random((p.shape[0], 1))
                nxt = np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), p.shape[-1] - 1)
                ids = np.concatenate([ids, nxt[:, None]], axis=1)
        out = to_device(ids, device)
        return Tensor(out) if was_tensor else out

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameter count (optionally without the token embedding; a tied head counted once)."""
        n = super().num_parameters()
        return n - self.model.embed_tokens.weight.numel() if non_embedding else n

    def extra_repr(self) -> str:
        return f"{self.config}"
