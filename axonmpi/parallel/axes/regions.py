"""What the composer may assume of the modules in a sequence- or context-parallel region: checked, or refused.

[Note: modules in a region]  Under sequence parallelism (Megatron's, over the tensor group) and context parallelism
(ring or Ulysses, over the context group) each rank runs the region on its part of every sequence.  That equals
the serial model only if no module there mixes tokens on its own: attention must be one the library splits
(``nn.CausalSelfAttention``, ``nn.GroupedQueryAttention`` and their tensor-parallel forms), and every other module
must compute each token's output from that token alone.  The library cannot read a module's code, so the rule is a
list: a module whose ``forward`` is the library's own code of known behaviour (:data:`TOKEN_LOCAL`,
:data:`ATTENTION`, containers with no ``forward``) passes; any other -- a user's own class, or a library class that
may mix tokens (``nn.Conv2d``, ``nn.Softmax``, ``nn.Flatten``) -- must be declared in the
:class:`~axonmpi.parallel.plan.ModelPlan`, by class or by ``named_modules()`` pattern:

* ``token_local``: its own code treats each token on its own (a residual block calling its children, an MLP, a
  norm written by hand); its children are checked in their turn.
* ``whole_sequence``: it mixes tokens (the user's attention): under sequence parallelism it receives the whole
  sequence (gathered over the tensor group, in order) and each rank keeps its shard of its output; its
  parameters' gradients are whole on every tensor rank.  Under context parallelism it receives the whole sequence
  gathered over the context group in order ([Note: a declared whole-sequence module under context parallelism]
  in ``axes/context.py``); not under both at once.

Anything else is refused at construction, naming every such module by its path and class (with its module path).
Context parallelism (and sequence parallelism with no declared region, which cuts the model's input) also relies
on positions: a model whose own code numbers positions must take ``positions=``
(``forward(self, idx, positions=None)``) and use them when given -- refused otherwise ([Note: positions] in
``axes/context.py``).  ``docs/parallelize.md`` ("Modules in a sequence or context region") holds the contract.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, List, Tuple

from ...nn.module import Module, Sequential
from .record import Composition

__all__ = ["ATTENTION", "TOKEN_LOCAL", "check", "declared", "describe", "qualname", "whole_sequence_modules"]

_NN, _P = "axonmpi.nn.", "axonmpi.parallel."
TOKEN_LOCAL = frozenset(
    [_NN + "layers." + n for n in ("Linear", "Embedding", "LayerNorm", "Dropout", "ReLU", "GELU", "SiLU", "Tanh",
                                   "Sigmoid", "Identity")]
    + [_NN + n for n in ("normalization.RMSNorm", "transformer.MLP", "transformer.TransformerBlock",
                         "transformer.SwiGLU", "moe.MoE", "moe.Experts", "moe.ExpertLinear", "rotary.RotaryEmbedding",
                         "module.Sequential", "checkpointing.Checkpointed")]
    + [_P + n for n in ("tensor.layers.ColumnParallelLinear", "tensor.layers.RowParallelLinear",
                        "tensor.layers.VocabParallelEmbedding", "tensor.layers.SequenceParallelLayerNorm",
                        "tensor.layers.TensorParallelMLP", "tensor.kv.ColumnParallelKVLinear",
                        "tensor.transformer.SequenceParallelDropout", "intra_layer.linear.Linear",
                        "intra_layer.embedding.Embedding")]
    + ["axonmpi.models.gpt." + n for n in ("GPT", "GPTEmbedding", "GPTHead")]
    + ["axonmpi.models.llama." + n for n in ("Llama", "LlamaModel", "LlamaDecoderLayer", "LlamaEmbedding",
                                             "LlamaBlock", "LlamaHead")])
"""The library's modules whose ``forward`` computes each token from that token alone (containers included)."""

ATTENTION = frozenset([_NN + "transformer.CausalSelfAttention", _NN + "attention.GroupedQueryAttention",
                       _P + "tensor.layers.TensorParallelAttention", _P + "context.attention.ContextParallelAttention",
                       _P + "context.gqa.ContextParallelGroupedQueryAttention"])
"""The attention layers the library splits along the sequence itself."""

_FIX_POSITIONS = ("    def forward(self, idx, positions=None):\n"
                  "        pos = positions if positions is not None else arange(0, idx.shape[1])")


def qualname(cls: type) -> str:
    """``"module.Class"``: a class named so that two classes of one name are told apart."""
    return f"{cls.__module__}.{cls.__qualname__}"


def describe(path: str, m: Module) -> str:
    """``"'blocks.0.attn' (my_model.CausalSelfAttention)"``; the model itself is ``'' (...)``."""
    return f"{path!r} ({qualname(type(m))})"


def _forward_class(m: Module):
    """The class whose ``forward`` the module runs (``None``: it has none of its own -- a ModuleList)."""
    for cls in type(m).__mro__:
        if "forward" in cls.__dict__:
            return None if cls is Module else cls
    return None


def declared(path: str, m: Module, entries: Iterable) -> bool:
    """Whether ``m`` (at ``path``) is one of ``entries``: classes (exactly its class) or ``named_modules()``
    patterns."""
    return any(type(m) is e if isinstance(e, type) else fnmatch.fnmatchcase(path, str(e)) for e in entries)


def whole_sequence_modules(module: Module, c: Composition) -> List[Tuple[str, Module]]:
    """The modules the plan declares ``whole_sequence`` (outermost only: one inside another is inside its gather)."""
    entries = c.model_plan.whole_sequence
    if not entries:
        return []
    out: List[Tuple[str, Module]] = []
    for q, m in module.named_modules():
        if declared(q, m, entries) and not any(_under(q, p) for p, _ in out):
            out.append((q, m))
    return out


def _under(q: str, p: str) -> bool:
    return p == "" or q == p or q.startswith(p + ".")


def _region(module: Module, c: Composition) -> List[Tuple[str, Module]]:
    """The modules that run on part of each sequence: all of them under context parallelism and under sequence
    parallelism with no declared region; with a :class:`~axonmpi.parallel.plan.SequenceRegion`, all but its
    ``outside`` modules and its ``enter`` (unless a dropout: swapped for the scatter).  A declared
    ``whole_sequence`` module's subtree sees whole sequences; a pipeline never runs the model's own ``forward``."""
    skip = [q for q, _ in whole_sequence_modules(module, c)]
    if "" in skip:
        return []
    region = c.model_plan.sequence_region if c.sp and not c.cp else None
    if region is not None:
        mods = dict(module.named_modules())
        skip += [q for q in mods if q and any(fnmatch.fnmatchcase(q, p) for p in region.outside)]
        enter = mods.get(region.enter)
        if region.enter and enter is not None and qualname(type(enter)) != _NN + "layers.Dropout":
            skip.append(region.enter)
    return [(q, m) for q, m in list(module.named_modules()) + _pipeline_wrappers(module, c)
            if not any(_under(q, s) for s in skip) and not (q == "" and c.pipeline is not None)]


def _pipeline_wrappers(module: Module, c: Composition) -> List[Tuple[str, Module]]:
    """The layers a model's ``pipeline_layers()`` makes that are not among its modules (wrappers such as a ViT's
    ``PatchEmbed`` or a GPT's embedding-plus-positions step): the pipeline runs their ``forward`` on each stage, so
    they are in the region too, named ``pipeline_layers()[i]``."""
    if c.pipeline is None or not callable(getattr(module, "pipeline_layers", None)):
        return []
    own = {id(m) for m in module.modules()}
    return [(f"pipeline_layers()[{i}]", m) for i, m in enumerate(module.pipeline_layers()) if id(m) not in own]


def _axes(c: Composition) -> str:
    parts = []
    if c.sp:
        parts.append(f"sequence parallelism (sequence_parallel=True: each of the {c.grid.intra_group.size} ranks of "
                     "the tensor group runs its shard of each sequence)")
    if c.cp:
        parts.append(f"context parallelism (context_parallel={c.context!r}: each of the "
                     f"{c.grid.context_group.size} ranks of the context group runs its tokens of each sequence)")
    return " and ".join(parts)


def check(module: Module, c: Composition) -> None:
    """Refuse, at construction, a module in a sequence- or context-parallel region that the library does not know
    and the plan does not declare ([Note: modules in a region]); then refuse a context-parallel model whose code
    numbers positions but cannot be given them."""
    if not (c.sp or c.cp):
        return
    plan = c.model_plan
    if c.cp and c.sp and plan.whole_sequence:
        raise NotImplementedError(
            f"rank {c.rank}: ModelPlan(whole_sequence={plan.whole_sequence!r}) is built for sequence parallelism or "
            f"context parallelism, not both at once (context_parallel={c.context!r} with sequence_parallel=True): "
            "drop one, or use nn.CausalSelfAttention / nn.GroupedQueryAttention, which both split")
    unknown = [(q, m) for q, m in _region(module, c)
               if _forward_class(m) is not None and qualname(_forward_class(m)) not in TOKEN_LOCAL | ATTENTION
               and not declared(q, m, plan.token_local)]
    if unknown:
        _refuse(unknown, c)
    if c.cp or (c.sp and not c.region_declared):     # the model's input itself cut along the sequence
        _check_positions(module, c)


def _refuse(unknown, c: Composition) -> None:
    names = ", ".join(describe(q, m) for q, m in unknown[:8]) + (f" and {len(unknown) - 8} more"
                                                                 if len(unknown) > 8 else "")
    classes, mixing = [], []
    for q, m in unknown:
        n = type(m).__name__
        if n not in classes + mixing:      # a guess for the example only: attention-like names mix tokens
            (mixing if any(w in (n + q).lower() for w in ("att", "conv", "pool", "mix")) else classes).append(n)
    tup = lambda xs: "(" + ", ".join(xs) + ("," if len(xs) == 1 else "") + ")"
    if c.cp:
        eg = "ModelPlan(" + ", ".join(([f"token_local={tup(classes)}"] if classes else []) +
                                      ([f"whole_sequence={tup(mixing)}"] if mixing else [])) + ")"
        how = ("token_local for those whose own code treats each token on its own, whole_sequence for those that "
               "mix tokens (their own attention: each rank then gathers the whole sequence for it); or use "
               "nn.CausalSelfAttention / nn.GroupedQueryAttention, which ring / Ulysses split")
    else:
        eg = "ModelPlan(" + ", ".join(([f"token_local={tup(classes)}"] if classes else []) +
                                      ([f"whole_sequence={tup(mixing)}"] if mixing else [])) + ")"
        how = ("token_local for those whose own code treats each token on its own, whole_sequence for those that "
               "mix tokens (their own attention, a convolution or a mean over the sequence: they then receive "
               "whole sequences); or use nn.CausalSelfAttention ('attention' in the tensor-parallel plan)")
    raise ValueError(
        f"rank {c.rank}: {_axes(c)} runs {names} on part of each sequence, and the library does not know whether "
        f"their forward mixes tokens (they are not its attention or token-local layers). Declare each in the "
        f"model plan, by class or by named_modules() pattern: {how}; e.g. {eg} "
        "(docs/parallelize.md, 'Modules in a sequence or context region')")


def _check_positions(module: Module, c: Composition) -> None:
    """[Note: positions]: positions are numbered where the model's input enters -- the model's ``forward``, or
    the first layer of an ``nn.Sequential`` or of a pipeline's ``pipeline_layers()`` -- and the library gives them
    to a ``forward`` that takes ``positions=``.  Code of the user's own there that takes none is refused (a
    ``token_local`` module elsewhere numbers no positions by its contract, or takes ``positions=`` too)."""
    from .context import takes_positions
    path, first = "", module
    if isinstance(module, Sequential) and len(module):
        path, first = "0", module[0]
    elif c.pipeline is not None and callable(getattr(module, "pipeline_layers", None)):
        layers = list(module.pipeline_layers())
        path, first = ("pipeline_layers()[0]", layers[0]) if layers else ("", module)
    cls = _forward_class(first)
    if takes_positions(first) or cls is None or qualname(cls) in TOKEN_LOCAL | ATTENTION:
        return
    split = "ring: chunks r and 2P-1-r of 2P" if str(c.context).lower().endswith("ring") else "the r-th of P chunks"
    how = (f"context_parallel={c.context!r} gives each rank its tokens of each sequence ({split})" if c.cp else
           "sequence_parallel=True with no declared SequenceRegion gives each tensor rank its shard of each sequence "
           "from the model's input on")
    raise ValueError(
        f"rank {c.rank}: {how}, but {describe(path, first)} takes the model's input and its forward takes no "
        f"positions=, so code that numbers positions itself (arange(0, t)) would number this rank's tokens 0..t-1. "
        f"Take the global positions and use them when given (the library passes them):\n{_FIX_POSITIONS}\n"
        "(a model that numbers no positions: accept positions=None and ignore it; docs/context_parallel.md, "
        "'Positions')")
