"""Generated models and layouts: one seed -> a :class:`Case` (a model, a layout, a second layout to restore in).

Models are ``nn.Sequential`` of the library's layers, as a user would write them: an embedding (tied to the
head or not), a Linear, or a LayerNorm first; residual MLPs of odd or even widths, with or without biases and
an affine or plain LayerNorm; transformer blocks (``nn.CausalSelfAttention``); Llama blocks (``nn.RMSNorm``, ``nn.GroupedQueryAttention`` with
rotary positions, ``nn.SwiGLU``); ``nn.MoE`` blocks (dropless or
with a capacity); a frozen gain with a buffer; a block holding a parameter no forward uses; a later layer
sharing the first layer's weight.  Layouts are drawn from the composition matrix (``parallelize``'s axes:
data / FSDP / ZeRO-1, Megatron or AxoNN tensor, sequence, context, expert, activation checkpointing and
every pipeline schedule) and kept only where the library's documented size rules hold.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

import axonmpi
import axonmpi.nn as nn
from axonmpi import Tensor

try:
    from . import user
except ImportError:            # run as a script (tests/fuzz/run.py)
    import user

__all__ = ["Case", "LayoutSpec", "ModelSpec", "build_model", "draw_case", "draw_layout", "draw_model", "draw_user_model",
           "megatron_plan", "model_plan", "GB", "T"]

F64 = np.float64
GB, T = 16, 8          # global batch rows and tokens per row
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")


# -- the layers a generated model uses (beyond the library's own) ---------------------------------------
class ResidualMLP(nn.Module):
    """``x + proj(act(fc(ln(x))))``; ``spare``: a Linear no forward calls (an unused parameter)."""

    def __init__(self, c: int, hidden: int, bias: bool, norm: Optional[bool], unused: bool):
        super().__init__()
        self.ln = nn.Identity() if norm is None else nn.LayerNorm(c, elementwise_affine=norm, dtype=F64)
        self.fc = nn.Linear(c, hidden, bias=bias, dtype=F64)
        self.act = nn.GELU("tanh")
        self.proj = nn.Linear(hidden, c, bias=bias, dtype=F64)
        if unused:
            self.spare = nn.Linear(c, c, dtype=F64)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(self.ln(x))))


class LlamaBlock(nn.Module):
    """A Llama decoder block: ``x + attn(norm1(x))`` (grouped-query, rotary at ``positions``), then
    ``x + mlp(norm2(x))`` (SwiGLU).  ``forward(x, positions=None)``: under ``parallelize`` a layer taking
    ``positions=`` is given those of the sequence its attention sees (context / sequence parallelism)."""

    def __init__(self, c: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.norm1 = nn.RMSNorm(c, eps=1e-5, dtype=F64)
        self.attn = nn.GroupedQueryAttention(c, heads, kv_heads, dtype=F64)
        self.norm2 = nn.RMSNorm(c, eps=1e-5, dtype=F64)
        self.mlp = nn.SwiGLU(c, hidden, dtype=F64)
        self.rope = nn.RotaryEmbedding(c // heads, theta=20.0)

    def forward(self, x, positions=None):
        x = x + self.attn(self.norm1(x), self.rope(x, positions))
        return x + self.mlp(self.norm2(x))


class MoEBlock(nn.Module):
    """``x + moe(ln(x))``."""

    def __init__(self, c: int, experts: int, top_k: int, hidden: int, capacity: Optional[float]):
        super().__init__()
        self.ln = nn.LayerNorm(c, dtype=F64)
        self.moe = nn.MoE(c, experts, top_k=top_k, hidden=hidden, capacity_factor=capacity, dtype=F64)

    def forward(self, x):
        return x + self.moe(self.ln(x))


class FrozenScale(nn.Module):
    """``x * gain + shift``: ``gain`` a frozen parameter (``requires_grad=False``), ``shift`` a buffer."""

    def __init__(self, c: int):
        super().__init__()
        rng = np.random.default_rng(c)
        self.gain = nn.Parameter(1.0 + 0.1 * rng.standard_normal(c), requires_grad=False, dtype=F64)
        self.register_buffer("shift", 0.05 * rng.standard_normal(c).astype(F64))

    def forward(self, x):
        return x * self.gain + Tensor(self.shift.data if isinstance(self.shift, Tensor) else self.shift)


# -- specs -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """A generated model.  ``blocks``: ``("mlp", hidden, bias, norm)`` (norm: None, False plain, True affine),
    ``("attn", heads, bias)``, ``("llama", heads, kv_heads, hidden)``, ``("moe", experts, top_k, hidden, capacity)``, ``("norm", affine)``,
    ``("frozen",)``, ``("reuse",)`` (a layer sharing the first layer's weight)."""

    first: str                     # "embedding" | "linear" | "layernorm"
    width: int
    feat: int
    vocab: int
    blocks: Tuple[tuple, ...]
    final_norm: Optional[bool]
    head_bias: bool
    tie: bool
    unused: bool
    ignore: bool                   # some targets are -100 (not counted)
    seed: int = 0
    upos: Optional[bool] = None    # user-style: the first layer a user's embedding numbering positions (True:
                                   # taking positions=; False: its own arange only); None: nn.Embedding
    ignore_index: int = -100       # the loss's ignore_index (user-style: -1 too, nanoGPT's), the value of ignored targets
    groups: Optional[str] = None   # user-style param groups: "dim" (nanoGPT's p.dim() >= 2) | "name" (minGPT's rule)
    opt_before: bool = False       # user-style: the optimizer built from the model before parallelize (nanoGPT's order)
    generate: bool = False         # user-style: a greedy generate loop after training (embedding-first models)

    @property
    def has(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for b in self.blocks:
            out[b[0]] = out.get(b[0], 0) + 1
        return out

    def layers(self) -> int:
        """Top-level layers (the pipeline cuts between them)."""
        return ((2 if self.first == "layernorm" else 1) + len(self.blocks) + self.has.get("shared", 0)
                + (self.final_norm is not None) + 1)

    def short(self) -> str:
        parts = [f"{self.first}(V{self.vocab} C{self.width}" + (f" F{self.feat}" if self.first != "embedding" else "")
                 + ("" if self.upos is None else f" user positions={self.upos}") + ")"]
        for b in self.blocks:
            parts.append(b[0] + ("" if len(b) == 1 else str(list(b[1:])).replace(" ", "")))
        if self.final_norm is not None:
            parts.append(f"ln(affine={self.final_norm})")
        parts.append(f"head(bias={self.head_bias}{', tied' if self.tie else ''})")
        flags = [f for f, on in (("unused", self.unused), ("ignore", self.ignore), ("opt_before", self.opt_before),
                                 ("generate", self.generate)) if on]
        flags += [f"ignore_index={self.ignore_index}"] if self.ignore_index != -100 else []
        flags += [f"groups by {self.groups}"] if self.groups else []
        return " -> ".join(parts) + (f" [{', '.join(flags)}]" if flags else "")


@dataclass(frozen=True)
class LayoutSpec:
    """A layout: grid sizes (``G_data`` is the rest of the world) and ``parallelize``'s options."""

    sizes: Tuple[Tuple[str, int], ...] = ()
    tensor: Optional[str] = None            # None | "axonn" | "megatron"
    vocab_split: bool = False               # megatron: the embedding "vocab", the head "column_gather"
    sequence_parallel: bool = False
    context: Optional[str] = None           # "ring" | "ulysses"
    expert_parallel: int = 1
    data: str = "ddp"                       # "ddp" | "fsdp"
    sharding: Optional[str] = None          # FSDP's strategy
    zero1: bool = False
    ac: Optional[str] = None                # None | "all" | "some"
    schedule: Optional[str] = None
    microbatches: int = 2

    def size(self, name: str) -> int:
        return dict(self.sizes).get(name, 1)

    def short(self) -> str:
        s = ",".join(f"{k[2:]}={v}" for k, v in self.sizes) or "data only"
        opts = [self.data + (f"/{self.sharding}" if self.sharding else "") + ("+zero1" if self.zero1 else "")]
        if self.tensor:
            opts.append(self.tensor + ("+vocab" if self.vocab_split else "") + ("+sp" if self.sequence_parallel else ""))
        if self.context:
            opts.append(f"cp={self.context}")
        if self.expert_parallel > 1:
            opts.append(f"ep={self.expert_parallel}")
        if self.ac:
            opts.append(f"ac={self.ac}")
        if self.schedule:
            opts.append(f"pp={self.schedule}/m{self.microbatches}")
        return f"[{s}] " + " ".join(opts)


@dataclass(frozen=True)
class Case:
    seed: int
    model: ModelSpec
    layout: LayoutSpec
    restore: LayoutSpec                      # the layout the checkpoint is restored in

    def describe(self) -> str:
        return (f"seed {self.seed}\n  model:   {self.model.short()}\n  layout:  {self.layout.short()}\n"
                f"  restore: {self.restore.short()}")


# -- building ------------------------------------------------------------------------------------------------
def build_model(spec: ModelSpec) -> nn.Sequential:
    """The model of ``spec`` (the same values on every rank and every call: seeded)."""
    axonmpi.manual_seed(1000 + spec.seed)
    C, V = spec.width, spec.vocab
    layers: List[nn.Module] = []
    if spec.first == "embedding" and spec.upos is not None:
        layers.append((user.UserEmbeddingPositions if spec.upos else user.UserEmbedding)(V, T, C))
    elif spec.first == "embedding":
        layers.append(nn.Embedding(V, C, dtype=F64))
    elif spec.first == "linear":
        layers.append(nn.Linear(spec.feat, C, dtype=F64))
    else:
        layers += [nn.LayerNorm(spec.feat, dtype=F64), nn.Linear(spec.feat, C, dtype=F64)]
    first = layers[0]
    unused_left = spec.unused
    for b in spec.blocks:
        kind = b[0]
        if kind == "mlp":
            layers.append(ResidualMLP(C, b[1], b[2], b[3], unused_left))
            unused_left = False
        elif kind == "attn":
            layers.append(nn.TransformerBlock(C, b[1], bias=b[2], dtype=F64))
        elif kind == "llama":
            layers.append(LlamaBlock(C, b[1], b[2], b[3]))
        elif kind == "moe":
            layers.append(MoEBlock(C, b[1], b[2], b[3], b[4]))
        elif kind == "norm":
            layers.append(nn.LayerNorm(C, elementwise_affine=b[1], dtype=F64))
        elif kind == "frozen":
            layers.append(FrozenScale(C))
        elif kind == "uattn":
            layers.append(user.OwnAttentionBlock(C, b[1], b[3]))
        elif kind == "cls":
            layers.append(user.ClsBlock(C))
        elif kind == "shared":
            layers += list(user.shared_gains(C))
        elif kind == "scalar":
            layers.append(user.Temperature())
        elif kind == "reuse":           # the first layer's weight used again (its shape allows: feat == width)
            if spec.first == "layernorm":
                ln = nn.LayerNorm(C, dtype=F64)
                ln.weight, ln.bias = first.weight, first.bias
                layers.append(ln)
            else:
                lin = nn.Linear(C, C, dtype=F64)
                lin.weight = first.weight
                layers.append(lin)
        else:
            raise ValueError(f"unknown block {b!r}")
    if spec.final_norm is not None:
        layers.append(nn.LayerNorm(C, elementwise_affine=spec.final_norm, dtype=F64))
    head = nn.Linear(C, V, bias=spec.head_bias, dtype=F64)
    if spec.tie:
        head.weight = first.wte.weight if spec.upos is not None else first.weight
    layers.append(head)
    if unused_left:                      # no MLP block to hold it: a top-level module no forward reaches
        model = nn.Sequential(*layers)
        return _with_spare(model, C)
    return nn.Sequential(*layers)


class _Spare(nn.Module):
    """Identity in forward; holds a Linear no forward calls."""

    def __init__(self, c: int):
        super().__init__()
        self.spare = nn.Linear(c, c, dtype=F64)

    def forward(self, x):
        return x


def _with_spare(model: nn.Sequential, c: int) -> nn.Sequential:
    layers = list(model.children())
    return nn.Sequential(*layers[:-1], _Spare(c), layers[-1])


def batch(spec: ModelSpec, step: int):
    """Step ``step``'s global batch ``(x, y)``: token ids or features, and targets (some -100 with ``ignore``)."""
    rng = np.random.default_rng(10_000 * spec.seed + step)
    if spec.first == "embedding":
        x = rng.integers(0, spec.vocab, (GB, T))
    else:
        x = rng.standard_normal((GB, T, spec.feat))
    y = rng.integers(0, spec.vocab, (GB, T))
    if spec.ignore:
        y[rng.random((GB, T)) < 0.2] = spec.ignore_index
    return x, y


def module_names(spec: ModelSpec) -> List[Tuple[str, tuple]]:
    """``(top-level name, block)`` of the model's blocks, in order."""
    at = 2 if spec.first == "layernorm" else 1
    out = []
    for b in spec.blocks:
        out.append((str(at), b))
        at += 2 if b[0] == "shared" else 1
    return out


def model_plan(spec: ModelSpec) -> "axonmpi.parallel.ModelPlan":
    """What the generated model declares: its own blocks compute each token from that token alone
    (``parallelize`` refuses an undeclared module of the user's own in a sequence or context region)."""
    from axonmpi.parallel import ModelPlan
    whole = [f"{n}.attn" for n, b in module_names(spec) if b[0] == "uattn" and b[2]] + \
        [n for n, b in module_names(spec) if b[0] == "cls" and b[1]]
    return ModelPlan(token_local=(ResidualMLP, LlamaBlock, MoEBlock, FrozenScale, _Spare, user.OwnAttentionBlock,
                                  user.Gain, user.Temperature, user.UserEmbedding, user.UserEmbeddingPositions),
                     whole_sequence=tuple(whole))


def megatron_plan(spec: ModelSpec, layout: LayoutSpec) -> Dict[str, str]:
    """The Megatron plan of ``spec`` over a tensor group of ``tp``: every block whose sizes divide."""
    tp = layout.size("G_intra_c")
    plan: Dict[str, str] = {}
    for name, b in module_names(spec):
        if b[0] == "mlp" and b[1] % tp == 0:
            plan[f"{name}.fc"], plan[f"{name}.proj"] = "column", "row"
        elif b[0] == "attn" and b[1] % tp == 0 and (4 * spec.width) % tp == 0:
            plan[f"{name}.attn"] = "attention"
            plan[f"{name}.mlp.fc"], plan[f"{name}.mlp.proj"] = "column", "row"
        elif b[0] == "llama":
            if llama_heads_split(b, tp):      # query heads split; key/value heads split or replicated (column_kv)
                plan.update({f"{name}.attn.q_proj": "column", f"{name}.attn.k_proj": "column_kv",
                             f"{name}.attn.v_proj": "column_kv", f"{name}.attn.o_proj": "row"})
            if b[3] % tp == 0:
                plan.update({f"{name}.mlp.gate_proj": "column", f"{name}.mlp.up_proj": "column",
                             f"{name}.mlp.down_proj": "row"})
    if layout.vocab_split:
        if spec.first == "embedding" and spec.upos is None:
            plan["0"] = "vocab"
        plan[str(top_layers(spec) - 1)] = "column_gather"
    return plan


def llama_heads_split(block: tuple, tp: int) -> bool:
    """Whether a Llama block's heads split over ``tp`` tensor ranks (its key/value heads split or replicated)."""
    heads, kv = block[1], block[2]
    return heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def local_heads(block: tuple, tp: int, split: bool) -> Tuple[int, int]:
    """A Llama block's query and key/value heads on one tensor rank."""
    heads, kv = block[1], block[2]
    if not split:
        return heads, kv
    return heads // tp, max(kv // tp, 1)


def _spare_top(spec: ModelSpec) -> bool:
    return spec.unused and not any(b[0] == "mlp" for b in spec.blocks)


def top_layers(spec: ModelSpec) -> int:
    return spec.layers() + (1 if _spare_top(spec) else 0)


# -- drawing -------------------------------------------------------------------------------------------------
def draw_model(rng: random.Random, seed: int) -> ModelSpec:
    first = rng.choice(["embedding", "embedding", "linear", "layernorm"])
    width = rng.choice([6, 8, 8, 12])
    vocab = rng.choice([7, 8, 10, 37])
    reuse = first != "embedding" and rng.random() < 0.25
    feat = width if reuse else rng.choice([5, 6, 8])
    blocks: List[tuple] = []
    for _ in range(rng.choice([1, 2, 2, 3, 4])):
        kind = rng.choice(["mlp", "mlp", "attn", "attn", "llama", "llama", "moe", "norm", "frozen"])
        if kind == "mlp":
            blocks.append(("mlp", rng.choice([6, 7, 10, 16]), rng.random() < 0.7,
                           rng.choice([None, False, True, True])))
        elif kind == "attn":
            blocks.append(("attn", rng.choice([h for h in (1, 2, 3, 4) if width % h == 0]), rng.random() < 0.8))
        elif kind == "llama":       # heads of an even width (rotary pairs), key/value heads dividing them
            heads = rng.choice([h for h in (1, 2, 3, 4, 6) if width % h == 0 and (width // h) % 2 == 0])
            blocks.append(("llama", heads, rng.choice([k for k in (1, 2, 3, 4, 6) if heads % k == 0]),
                           rng.choice([6, 8, 10, 16])))
        elif kind == "moe":
            blocks.append(("moe", rng.choice([2, 4]), rng.choice([1, 2]), rng.choice([6, 8]),
                           None if rng.random() < 0.8 else rng.choice([0.5, 1.25])))
        elif kind == "norm":
            blocks.append(("norm", rng.random() < 0.5))
        else:
            blocks.append(("frozen",))
    if reuse:
        blocks.insert(rng.randrange(1, len(blocks) + 1), ("reuse",))
    tie = first == "embedding" and rng.random() < 0.5
    return ModelSpec(first=first, width=width, feat=feat, vocab=vocab, blocks=tuple(blocks),
                     final_norm=rng.choice([None, True, False]), head_bias=rng.random() < 0.5 and not tie,
                     tie=tie, unused=rng.random() < 0.15, ignore=rng.random() < 0.3, seed=seed)


def draw_layout(rng: random.Random, spec: ModelSpec, world: int, tries: int = 200) -> LayoutSpec:
    """A valid layout of ``spec`` on ``world`` ranks (the library's documented size rules)."""
    for _ in range(tries):
        lay = _draw_layout_once(rng, spec, world)
        if lay is not None and valid(spec, lay, world):
            return lay
    return LayoutSpec()


def _draw_layout_once(rng: random.Random, spec: ModelSpec, world: int) -> Optional[LayoutSpec]:
    sizes: Dict[str, int] = {}
    left = world
    for axis, p in (("G_inter", 0.45), ("tensor", 0.5), ("G_context", 0.3)):
        if left % 2 == 0 and rng.random() < p:
            if axis == "tensor":
                sizes[rng.choice(["G_intra_c", "G_intra_c", "G_intra_r"])] = 2
            else:
                sizes[axis] = 2
            left //= 2
    data = left
    tensor = None
    if "G_intra_r" in sizes:
        tensor = "axonn"
    elif "G_intra_c" in sizes:
        tensor = rng.choice(["megatron", "megatron", "axonn"])
    vocab_split = tensor == "megatron" and rng.random() < 0.4
    sp = tensor == "megatron" and rng.random() < 0.5
    context = rng.choice(["ring", "ulysses"]) if "G_context" in sizes else None
    ep = 2 if spec.has.get("moe") and data % 2 == 0 and rng.random() < 0.6 else 1
    dp = rng.choice(["ddp", "ddp", "fsdp"])
    sharding = rng.choice([None, "full_shard", "shard_grad_op", "hybrid_shard"]) if dp == "fsdp" else None
    zero1 = dp == "ddp" and rng.random() < 0.25
    schedule = rng.choice(SCHEDULES) if "G_inter" in sizes else None
    ac = rng.choice([None, None, "all", "some"])
    mb = rng.choice([2, 2, 4]) if schedule else 2
    return LayoutSpec(sizes=tuple(sorted(sizes.items())), tensor=tensor, vocab_split=vocab_split,
                      sequence_parallel=sp, context=context, expert_parallel=ep, data=dp, sharding=sharding,
                      zero1=zero1, ac=ac, schedule=schedule, microbatches=mb)


def valid(spec: ModelSpec, lay: LayoutSpec, world: int) -> bool:
    """The documented size rules (not the refusals the composer gives its reasons for)."""
    others = int(np.prod([v for _, v in lay.sizes])) if lay.sizes else 1
    if world % others:
        return False
    data = world // others
    tp = lay.size("G_intra_c") * lay.size("G_intra_r")
    cp = lay.size("G_context")
    shards = data * (tp if lay.tensor == "axonn" else 1) * (lay.microbatches if lay.schedule else 1)
    if GB % shards:
        return False
    if lay.schedule:
        v = 2 if lay.schedule in ("interleaved", "zbv") else 1
        if top_layers(spec) < lay.size("G_inter") * v:
            return False
    if lay.context:
        if not (spec.has.get("attn") or spec.has.get("llama")):
            return False
        if T % (2 * cp):
            return False
        if lay.context == "ulysses":
            plan = megatron_plan(spec, lay) if lay.tensor == "megatron" else {}
            for name, b in module_names(spec):
                if b[0] == "attn":
                    local = b[1] // tp if f"{name}.attn" in plan else b[1]
                    if local % cp:
                        return False
                if b[0] == "llama":
                    q, kv = local_heads(b, tp, f"{name}.attn.q_proj" in plan)
                    if q % cp or (kv % cp and cp % kv):
                        return False
    if lay.sequence_parallel and T % tp:
        return False
    if lay.vocab_split and (spec.vocab % tp or spec.upos is not None):
        return False
    if lay.tensor == "megatron" and not megatron_plan(spec, lay):
        return False
    if lay.expert_parallel > 1 and any(b[1] % lay.expert_parallel for b in spec.blocks if b[0] == "moe"):
        return False
    if lay.sharding == "hybrid_shard" and data * cp < 2:
        return False
    return True


def draw_user_model(rng: random.Random, seed: int, with_0d: bool = False) -> ModelSpec:
    """A model as a PyTorch user writes it (:mod:`user`): the library's model of ``seed`` with one or two blocks of
    the user's own (their attention, a class token, a shared gain; ``with_0d``: a 0-d temperature) inserted, each
    token-mixing one declared ``whole_sequence`` or not, and an embedding-first model's embedding the user's own
    (numbering its positions, taking ``positions=`` or not)."""
    spec = draw_model(rng, seed)
    blocks = list(spec.blocks)
    kinds = ["uattn", "uattn", "cls", "shared"] + (["scalar"] if with_0d else [])
    for _ in range(rng.choice([1, 1, 2])):
        kind = rng.choice(kinds)
        if kind == "uattn":
            b = ("uattn", rng.choice([h for h in (1, 2, 4) if spec.width % h == 0]), rng.random() < 0.6,
                 rng.random() < 0.5)
        elif kind == "cls":
            b = ("cls", rng.random() < 0.6)
        else:
            b = (kind,)
        blocks.insert(rng.randrange(0, len(blocks) + 1), b)
    upos = rng.choice([None, True, True, False]) if spec.first == "embedding" else None
    more = random.Random(7 * seed + 1)      # its own stream: the layouts drawn after stay those of earlier runs
    return replace(spec, blocks=tuple(blocks), upos=upos, ignore_index=more.choice([-100, -1]),
                   groups=more.choice([None, "dim", "name"]), opt_before=more.random() < 0.4,
                   generate=spec.first == "embedding" and more.random() < 0.5)


def draw_case(seed: int, world: int, user_style: bool = False, with_0d: bool = False) -> Case:
    """The case of ``seed`` at ``world`` ranks (the same on every rank: a plain seeded generator); ``user_style``:
    the model is drawn by :func:`draw_user_model`."""
    rng = random.Random(seed)
    spec = draw_user_model(rng, seed, with_0d) if user_style else draw_model(rng, seed)
    return Case(seed, spec, draw_layout(rng, spec, world), draw_layout(rng, spec, world))


def simpler_models(spec: ModelSpec):
    """Smaller variants of ``spec`` (shrinking): a block fewer, a feature off."""
    for i in range(len(spec.blocks)):
        if spec.blocks[i][0] == "reuse" and len(spec.blocks) == 1:
            continue
        yield replace(spec, blocks=spec.blocks[:i] + spec.blocks[i + 1:])
    for f, off in (("unused", False), ("ignore", False), ("head_bias", False), ("final_norm", None), ("upos", None),
                   ("opt_before", False), ("groups", None), ("generate", False), ("ignore_index", -100)):
        if getattr(spec, f) != off:
            yield replace(spec, **{f: off})
    if spec.tie:
        yield replace(spec, tie=False)


def simpler_layouts(lay: LayoutSpec):
    """Smaller variants of ``lay``: an option off, or an axis removed."""
    for f, off in (("ac", None), ("zero1", False), ("sharding", None), ("vocab_split", False),
                   ("sequence_parallel", False), ("expert_parallel", 1)):
        if getattr(lay, f) != off:
            yield replace(lay, **{f: off})
    if lay.data == "fsdp":
        yield replace(lay, data="ddp", sharding=None)
    if lay.microbatches > 2:
        yield replace(lay, microbatches=2)
    for k, _ in lay.sizes:
        rest = tuple((a, b) for a, b in lay.sizes if a != k)
        if k == "G_inter":
            yield replace(lay, sizes=rest, schedule=None)
        elif k == "G_context":
            yield replace(lay, sizes=rest, context=None)
        else:
            yield replace(lay, sizes=rest, tensor=None, vocab_split=False, sequence_parallel=False)
    if lay.schedule not in (None, "1f1b"):
        yield replace(lay, schedule="1f1b")
