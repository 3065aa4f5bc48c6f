"""What the planner plans: the transformer, the training run and the parallel layout.

``ParallelLayout`` holds every axis of the grid: Megatron's 1-D tensor size ``tp`` (with sequence
parallelism ``sp``) or AxoNN's 3-D ``row x col x depth``, the pipeline ``pp`` with ``vp`` chunks per
rank and its ``schedule``, context ``cp`` (``ring`` or ``ulysses``), experts ``ep`` (taken out of the
data ranks, as Megatron does), data ``dp`` with ``zero`` 0 (DDP), 1 (ZeRO-1) or 3 (FSDP full shard).
The world is ``tp (or row col depth) x cp x pp x dp``.

Example:
    >>> ParallelLayout.parse("tp=8,pp=12,dp=16,vp=2").world
    1536
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, Optional

__all__ = ["TransformerConfig", "TrainConfig", "ParallelLayout", "PRECISION_BYTES", "SCHEDULES", "RECOMPUTE"]

PRECISION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv", "gpipe")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer: ``layers`` blocks of width ``width`` with ``heads`` query heads, sequence
    ``seq``, vocabulary ``vocab``.

    The GPT (default) and the Llama shape in one description, without importing either model class:

    * ``kv_heads``: key/value heads (grouped-query attention when fewer than ``heads``; 0: ``heads``);
    * ``ffn``: the MLP's hidden width (0: ``4 width``); ``gated``: a SwiGLU MLP (gate and up
      projections ``width -> ffn``, a SiLU and a product, down ``ffn -> width``: three matrices);
    * ``rotary``: rotary position embeddings (no learned position table; the rotation of q and k);
    * ``bias``: biases in the Linears and the norms (GPT: yes; Llama: no, and RMSNorm has no bias);
    * ``experts > 0``: every ``moe_every``-th MLP a mixture of ``experts`` experts with ``top_k`` routing;
    * ``tied``: the head shares the word embedding (Megatron's GPT; our GPT and Llama: no).

    Example:
        >>> llama = TransformerConfig(layers=32, width=4096, heads=32, kv_heads=8, seq=4096, vocab=128256,
        ...                           ffn=14336, gated=True, rotary=True, bias=False, tied=False)
        >>> round(llama.params / 1e9, 2)                       # Llama 3 8B
        8.03
    """
    layers: int
    width: int
    heads: int
    seq: int
    vocab: int = 51200
    ffn: int = 0
    experts: int = 0
    top_k: int = 1
    moe_every: int = 1
    tied: bool = True
    kv_heads: int = 0
    gated: bool = False
    rotary: bool = False
    bias: bool = True

    def __post_init__(self):
        for k in ("layers", "width", "heads", "seq", "vocab"):
            if getattr(self, k) < 1:
                raise ValueError(f"TransformerConfig: {k}={getattr(self, k)} must be >= 1")
        if self.width % self.heads:
            raise ValueError(f"TransformerConfig: width={self.width} does not divide by heads={self.heads}")
        if self.kv_heads < 0 or (self.kv_heads and self.heads % self.kv_heads):
            raise ValueError(f"TransformerConfig: kv_heads={self.kv_heads} must divide heads={self.heads} "
                             "(grouped-query attention: each key/value head serves heads / kv_heads query heads)")

    @property
    def hidden(self) -> int:
        """The MLP's hidden width."""
        return self.ffn or 4 * self.width

    @property
    def n_kv(self) -> int:
        """Key/value heads."""
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def qkv_out(self) -> int:
        """Output width of the fused QKV projection: ``h`` queries and ``2 kv_heads head_dim`` keys and values."""
        return self.width + 2 * self.n_kv * self.head_dim

    def linears(self):
        """``(in, out)`` of one block's Linears (the MLP's gate and up are two, as in Llama)."""
        h, f = self.width, self.hidden
        mlp = [(h, f), (h, f), (f, h)] if self.gated else [(h, f), (f, h)]
        return [(h, self.qkv_out), (h, h)] + mlp

    @property
    def norm_params(self) -> int:
        """One LayerNorm (weight and bias) or RMSNorm (weight only, ``bias=False``)."""
        return self.width * (2 if self.bias else 1)

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer % self.moe_every == self.moe_every - 1

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers))

    @property
    def attn_params(self) -> int:
        """QKV and the output projection (with biases when ``bias``)."""
        h = self.width
        return h * self.qkv_out + h * h + ((self.qkv_out + h) if self.bias else 0)

    @property
    def expert_params(self) -> int:
        """One MLP (an expert's): two or three matrices and their biases."""
        h, f = self.width, self.hidden
        if self.gated:
            return 3 * h * f + ((2 * f + h) if self.bias else 0)
        return 2 * h * f + ((f + h) if self.bias else 0)

    @property
    def layer_params(self) -> int:
        """A dense block: attention, the MLP and two norms (GPT: ``12 h^2 + 13 h``)."""
        return self.attn_params + self.expert_params + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Word embeddings, and the learned position table unless ``rotary``."""
        return (self.vocab + (0 if self.rotary else self.seq)) * self.width

    @property
    def params(self) -> int:
        """All parameters (Megatron's ``12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))`` for a dense GPT)."""
        dense = self.layers * self.layer_params
        if self.experts:
            dense += self.moe_layers * ((self.experts - 1) * self.expert_params + self.width * self.experts)
        return dense + self.embedding_params + self.norm_params + (0 if self.tied else self.vocab * self.width)


@dataclass(frozen=True)
class TrainConfig:
    """The batch: ``global_batch`` sequences per step in micro-batches of ``micro_batch``; ``precision``
    of the compute (fp16/bf16: mixed precision with fp32 master weights, Megatron's 18 bytes a parameter);
    ``recompute`` none, selective (Korthikanti's: the attention core) or full; ``dropout``: dropout layers
    run (the published GPT runs: yes; ``examples/train_gpt.py``: ``--dropout 0``, none)."""
    global_batch: int
    micro_batch: int = 1
    precision: str = "fp16"
    recompute: str = "none"
    dropout: bool = True

    def __post_init__(self):
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"precision={self.precision!r}: pick one of {sorted(PRECISION_BYTES)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute={self.recompute!r}: pick one of {RECOMPUTE}")
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ValueError(f"global_batch={self.global_batch} and micro_batch={self.micro_batch} must be >= 1")

    @property
    def bytes(self) -> int:
        return PRECISION_BYTES[self.precision]


_INT_KEYS = ("tp", "pp", "dp", "vp", "cp", "ep", "sp", "zero", "shard", "row", "col", "depth", "overlap",
             "reduce_overlap", "tp_overlap")


@dataclass(frozen=True)
class ParallelLayout:
    """Every axis (see the module's note).  ``overlap=1`` (default) models axonmpi's runtime: DDP buckets
    reduced during the last micro-batch's backward, FSDP's next all-gather prefetched under compute;
    ``overlap=0`` reduces gradients after the backward (Megatron 2021, the published runs).  ``tp_overlap=1``
    hides the backward's tensor-parallel all-reduces under the weight-gradient GEMMs (Megatron's asynchronous
    all-reduce of 2022, on in Korthikanti's runs; axonmpi's runtime does not, so 0 by default).

    Sharded data parallelism (``zero``), as axonmpi runs it: 0 DDP; 1 ZeRO-1 (``ZeroRedundancyOptimizer``:
    DDP's all-reduce, then each rank steps its chunk and the chunks are all-gathered); 2 FSDP
    ``SHARD_GRAD_OP`` (ZeRO-2: gathered in forward, kept for the backward, gradients reduce-scattered);
    3 FSDP ``FULL_SHARD`` (ZeRO-3: gathered in forward and again in backward).  ``shard`` (with ``zero=2``
    or 3): the size of the groups the state is sharded over, the data ranks split into ``dp / shard``
    replicas of it whose gradients are all-reduced (``HYBRID_SHARD``; 0: all ``dp`` ranks).
    ``reduce_overlap=0`` (with ``overlap=1``): gathers are prefetched but gradient reductions block the
    backward (DeepSpeed's ``overlap_comm`` off, its documented default; the published ZeRO-3 runs)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vp: int = 1
    cp: int = 1
    ep: int = 1
    sp: int = 0
    zero: int = 0
    shard: int = 0
    row: int = 1
    col: int = 1
    depth: int = 1
    schedule: str = ""
    cp_kind: str = "ring"
    overlap: int = 1
    tp_overlap: int = 0
    reduce_overlap: int = 1

    def __post_init__(self):
        for k in ("tp", "pp", "dp", "vp", "cp", "ep", "row", "col", "depth"):
            if getattr(self, k) < 1:
                raise ValueError(f"layout: {k}={getattr(self, k)} must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"layout: zero={self.zero}; pick 0 (DDP), 1 (ZeRO-1), 2 (FSDP shard_grad_op) or 3 "
                             "(FSDP full shard)")
        if self.shard and (self.zero < 2 or self.shard < 1 or self.dp % self.shard):
            raise ValueError(f"layout: shard={self.shard} (hybrid shard) needs zero=2 or 3 and must divide "
                             f"dp={self.dp}")
        if any(x not in (0, 1) for x in (self.sp, self.overlap, self.tp_overlap, self.reduce_overlap)):
            raise ValueError(f"layout: sp={self.sp}, overlap={self.overlap}, tp_overlap={self.tp_overlap} and "
                             f"reduce_overlap={self.reduce_overlap} must be 0 or 1")
        if self.tp > 1 and self.axonn > 1:
            raise ValueError(f"layout: tp={self.tp} (Megatron 1-D) and row/col/depth={self.row}/{self.col}/"
                             f"{self.depth} (AxoNN 3-D) are two tensor splits; pick one")
        if self.sp and self.tp == 1:
            raise ValueError("layout: sp=1 (sequence parallelism) needs Megatron tensor parallelism tp > 1")
        if self.schedule and self.schedule not in SCHEDULES:
            raise ValueError(f"layout: schedule={self.schedule!r}; pick one of {SCHEDULES}")
        if self.cp_kind not in ("ring", "ulysses"):
            raise ValueError(f"layout: cp_kind={self.cp_kind!r}; pick ring or ulysses")
        if self.dp % self.ep:
            raise ValueError(f"layout: ep={self.ep} must divide dp={self.dp} (experts are spread over data ranks)")
        if self.vp > 1 and self.pipeline_schedule not in ("interleaved",):
            raise ValueError(f"layout: vp={self.vp} chunks per rank need schedule=interleaved "
                             f"(zbv always runs 2), got {self.pipeline_schedule}")

    @property
    def shard_size(self) -> int:
        """Ranks each piece of sharded state is spread over (the data ranks, or ``shard``)."""
        return (self.shard or self.dp) if self.zero else 1

    @property
    def axonn(self) -> int:
        return self.row * self.col * self.depth

    @property
    def tensor(self) -> int:
        """Ranks of the tensor split (Megatron's ``tp`` or AxoNN's ``row col depth``)."""
        return self.tp * self.axonn

    @property
    def world(self) -> int:
        return self.tensor * self.cp * self.pp * self.dp

    @property
    def pipeline_schedule(self) -> str:
        if self.schedule:
            return self.schedule
        if self.pp == 1:
            return "1f1b"
        return "interleaved" if self.vp > 1 else "1f1b"

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank."""
        return 2 if self.pipeline_schedule == "zbv" else self.vp

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """``"tp=8,pp=12,dp=16,vp=2,schedule=interleaved"`` (keys: tp pp dp vp cp ep sp zero row col depth
        schedule cp_kind overlap)."""
        kw: Dict[str, object] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ValueError(f"--layout: {part!r} is not key=value (e.g. tp=8,pp=12,dp=16)")
            k, v = (s.strip() for s in part.split("=", 1))
            k = k.replace("-", "_")
            if k in ("schedule", "cp_kind"):
                kw[k] = v.lower()
            elif k in _INT_KEYS:
                try:
                    kw[k] = int(v)
                except ValueError:
                    raise ValueError(f"--layout: {k}={v!r} is not a whole number") from None
            else:
                raise ValueError(f"--layout: unknown key {k!r}; use {', '.join(_INT_KEYS + ('schedule', 'cp_kind'))}")
        return cls(**kw)

    def as_dict(self) -> Dict[str, object]:
        d = asdict(self)
        d["schedule"] = self.pipeline_schedule
        return d

    def label(self) -> str:
        """The layout as ``--layout`` takes it: ``ParallelLayout.parse(lay.label())`` is an equal layout
        (``shard`` equal to ``dp`` printed as nothing: the same thing).

        Example:
            >>> ParallelLayout(tp=2, pp=4, dp=2, schedule="zbv").label()
            'tp=2,pp=4,dp=2,schedule=zbv'
        """
        parts = [f"tp={self.tp}"] if self.axonn == 1 else [f"row={self.row},col={self.col},depth={self.depth}"]
        parts += [f"pp={self.pp}", f"dp={self.dp}"]
        for k in ("vp", "cp", "ep"):
            if getattr(self, k) > 1:
                parts.append(f"{k}={getattr(self, k)}")
        if self.cp > 1 and self.cp_kind != "ring":
            parts.append(f"cp_kind={self.cp_kind}")
        if self.sp:
            parts.append("sp=1")
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.shard and self.shard != self.dp:
            parts.append(f"shard={self.shard}")
        if self.pp > 1:
            parts.append(f"schedule={self.pipeline_schedule}")
        if not self.overlap:
            parts.append("overlap=0")
        if not self.reduce_overlap:
            parts.append("reduce_overlap=0")
        if self.tp_overlap:
            parts.append("tp_overlap=1")
        return ",".join(parts)

    def with_(self, **kw) -> "ParallelLayout":
        return replace(self, **kw)
