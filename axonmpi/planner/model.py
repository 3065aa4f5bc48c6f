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
    """A GPT: ``layers`` blocks of width ``width`` with ``heads`` heads, sequence ``seq``, vocabulary
    ``vocab``; MLP hidden ``ffn`` (default ``4 width``); ``experts > 0`` makes every ``moe_every``-th MLP
    a mixture of ``experts`` experts with ``top_k`` routing; ``tied`` embeddings (Megatron's)."""
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

    def __post_init__(self):
        for k in ("layers", "width", "heads", "seq", "vocab"):
            if getattr(self, k) < 1:
                raise ValueError(f"TransformerConfig: {k}={getattr(self, k)} must be >= 1")
        if self.width % self.heads:
            raise ValueError(f"TransformerConfig: width={self.width} does not divide by heads={self.heads}")

    @property
    def hidden(self) -> int:
        return self.ffn or 4 * self.width

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer % self.moe_every == self.moe_every - 1

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers))

    @property
    def layer_params(self) -> int:
        """A dense block: QKV, projection, two MLP Linears (with biases) and two LayerNorms."""
        h, f = self.width, self.hidden
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    @property
    def expert_params(self) -> int:
        """One expert's MLP."""
        return 2 * self.width * self.hidden + self.hidden + self.width

    @property
    def params(self) -> int:
        """All parameters (Megatron's ``12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))`` for a dense GPT)."""
        dense = self.layers * self.layer_params
        if self.experts:
            dense += self.moe_layers * ((self.experts - 1) * self.expert_params + self.width * self.experts)
        emb = (self.vocab + self.seq) * self.width + 2 * self.width
        return dense + emb + (0 if self.tied else self.vocab * self.width)


@dataclass(frozen=True)
class TrainConfig:
    """The batch: ``global_batch`` sequences per step in micro-batches of ``micro_batch``; ``precision``
    of the compute (fp16/bf16: mixed precision with fp32 master weights, Megatron's 18 bytes a parameter);
    ``recompute`` none, selective (Korthikanti's: the attention core) or full."""
    global_batch: int
    micro_batch: int = 1
    precision: str = "fp16"
    recompute: str = "none"

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


_INT_KEYS = ("tp", "pp", "dp", "vp", "cp", "ep", "sp", "zero", "row", "col", "depth", "overlap", "tp_overlap")


@dataclass(frozen=True)
class ParallelLayout:
    """Every axis (see the module's note).  ``overlap=1`` (default) models axonmpi's runtime: DDP buckets
    reduced during the last micro-batch's backward, FSDP's next all-gather prefetched under compute;
    ``overlap=0`` reduces gradients after the backward (Megatron 2021, the published runs).  ``tp_overlap=1``
    hides the backward's tensor-parallel all-reduces under the weight-gradient GEMMs (Megatron's asynchronous
    all-reduce of 2022, on in Korthikanti's runs; axonmpi's runtime does not, so 0 by default)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vp: int = 1
    cp: int = 1
    ep: int = 1
    sp: int = 0
    zero: int = 0
    row: int = 1
    col: int = 1
    depth: int = 1
    schedule: str = ""
    cp_kind: str = "ring"
    overlap: int = 1
    tp_overlap: int = 0

    def __post_init__(self):
        for k in ("tp", "pp", "dp", "vp", "cp", "ep", "row", "col", "depth"):
            if getattr(self, k) < 1:
                raise ValueError(f"layout: {k}={getattr(self, k)} must be >= 1")
        if self.zero not in (0, 1, 3):
            raise ValueError(f"layout: zero={self.zero}; pick 0 (DDP), 1 (ZeRO-1) or 3 (FSDP full shard)")
        if self.sp not in (0, 1) or self.overlap not in (0, 1) or self.tp_overlap not in (0, 1):
            raise ValueError(f"layout: sp={self.sp}, overlap={self.overlap} and tp_overlap={self.tp_overlap} "
                             "must be 0 or 1")
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
        if self.pp > 1 and self.pipeline_schedule not in ("1f1b", "interleaved"):
            parts.append(f"schedule={self.pipeline_schedule}")
        return ",".join(parts)

    def with_(self, **kw) -> "ParallelLayout":
        return replace(self, **kw)
