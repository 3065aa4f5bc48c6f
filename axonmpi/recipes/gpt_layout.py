"""The GPT recipe's layout rules: which layouts the GPT can run on (:func:`check_layout`), into how
many row slices the batch is cut (:func:`batch_shards`).
Used by :class:`~axonmpi.recipes.gpt.HybridGPT` and ``examples/train_gpt.py``; see ``docs/hybrid.md``.
"""
from __future__ import annotations

import enum
from typing import List, Optional

from ..distributed.grid import Layout
from ..enums import coerce_enum
from ..models.gpt import GPTConfig
from ..parallel.pipeline import PipelineSchedule

__all__ = ["Layout", "TPStyle", "batch_shards", "check_layout"]


class TPStyle(enum.Enum):
    """How the tensor dimensions of the grid split the GPT."""
    MEGATRON = "megatron"   # 1-D: heads / MLP columns / vocabulary over intra_group (G_intra_c only)
    AXONN = "axonn"         # 3-D: every Linear over row x column x depth (auto_parallelize)


def _style(tp_style) -> TPStyle:
    return coerce_enum(TPStyle, tp_style, "tp_style")


def _schedule(schedule):
    return coerce_enum(PipelineSchedule, schedule, "schedule")


def batch_shards(layout: Layout, tp_style="axonn") -> int:
    """Into how many equal row slices the global batch is cut.

    Example:
        >>> batch_shards(Layout(G_data=2, G_intra_c=2), "megatron"), batch_shards(Layout(G_data=2, G_intra_c=2))
        (2, 4)
    """
    if layout.tensor_size > 1 and _style(tp_style) is TPStyle.AXONN:
        return layout.G_data * layout.tensor_size
    return layout.G_data


def virtual_stage_count(schedule, virtual_stages: Optional[int] = None) -> int:
    """Chunks per pipeline rank: ``virtual_stages`` (default 2) for the interleaved schedule, 2 for ZBV, else 1."""
    name = _schedule(schedule).name
    if name == "INTERLEAVED_ONE_F_ONE_B":
        return 2 if virtual_stages is None else int(virtual_stages)
    if virtual_stages not in (None, 1) and not (name == "ZBV" and virtual_stages == 2):
        raise ValueError(f"virtual_stages={virtual_stages} needs the interleaved schedule (ZBV runs 2, the others 1), "
                         f"got schedule={name.lower()}")
    return 2 if name == "ZBV" else 1


def check_layout(config: GPTConfig, layout: Layout, *, global_batch: int, num_microbatches: int = 1,
                 schedule="1f1b", tp_style="axonn", world_size: Optional[int] = None,
                 sequence_parallel: bool = False, virtual_stages: Optional[int] = None) -> None:
    """Refuse a layout the GPT (or a Llama: a ``LlamaConfig``) cannot run on, before any work: a ``ValueError``
    naming every size that does not fit (e.g. ``n_head=4 does not divide by G_intra_c=3``).

    Example:
        >>> check_layout(GPTConfig(vocab_size=16, n_layer=1), Layout(G_inter=4), global_batch=8)
        Traceback (most recent call last):
        ValueError: ...the GPT has 3 pipeline layers (embedding, 1 blocks, head) but G_inter=4 ...

    ``virtual_stages``: the interleaved schedule's chunks per rank (default 2; ZBV always runs 2).
    """
    style, sched = _style(tp_style), _schedule(schedule)
    errs: List[str] = []
    if world_size is not None and layout.world_size != world_size:
        errs.append(f"G_data*G_context*G_inter*G_intra_r*G_intra_c*G_intra_d = {layout.world_size} but there are "
                    f"{world_size} ranks")
    errs += [f"{k}={v} must be >= 1" for k, v in layout.as_dict().items() if v < 1]
    if errs:
        raise ValueError(f"impossible layout {layout}: " + "; ".join(errs))
    if layout.tensor_size > 1 and style is TPStyle.MEGATRON:
        if layout.G_intra_r > 1 or layout.G_intra_d > 1:
            errs.append(f"--tp-style megatron splits over one dimension (G_intra_c); got G_intra_r={layout.G_intra_r}, "
                        f"G_intra_d={layout.G_intra_d} (use --tp-style axonn)")
        c = layout.G_intra_c
        if not isinstance(config, GPTConfig):       # a Llama: its own size rules (recipes/llama.py)
            from .llama import llama_layout_errors
            errs += llama_layout_errors(config, c, sequence_parallel)
        else:
            errs += [f"{what}={n} does not divide by G_intra_c={c}" for what, n in
                     (("n_head", config.n_head), ("4*n_embd (MLP width)", 4 * config.n_embd)) if n % c]
        if isinstance(config, GPTConfig) and config.vocab_rows % c:   # Megatron pads the vocabulary: its flag
            errs.append(f"vocab_size={config.vocab_rows} does not divide by G_intra_c={c}: pad it with "
                        f"--make-vocab-size-divisible-by N (Megatron's flag; N=1 gives "
                        f"{-(-config.vocab_rows // c) * c} rows, the padding masked out of the loss; "
                        "GPTConfig(padded_vocab_size=...))")
    n_layers = config.n_layer + 2
    v = virtual_stage_count(sched, virtual_stages)
    if layout.G_inter * v > n_layers:
        name = "GPT" if isinstance(config, GPTConfig) else type(config).__name__.replace("Config", "")
        errs.append(f"the {name} has {n_layers} pipeline layers (embedding, {config.n_layer} blocks, head) but "
                    f"G_inter={layout.G_inter}" + (f" x {v} virtual stages" if v > 1 else "")
                    + " needs at least one each")
    if num_microbatches < 1:
        errs.append(f"num_microbatches={num_microbatches} must be >= 1")
    elif v > 1 and num_microbatches % layout.G_inter:
        errs.append(f"the interleaved schedule needs num_microbatches={num_microbatches} to be a multiple of "
                    f"G_inter={layout.G_inter}")
    shards = batch_shards(layout, style)
    if global_batch % shards:
        errs.append(f"global batch {global_batch} does not divide into {shards} equal row slices "
                    f"({'G_data*G_intra_r*G_intra_c*G_intra_d' if shards != layout.G_data else 'G_data'} = {shards})")
    elif global_batch // shards < num_microbatches:
        errs.append(f"{global_batch // shards} rows per rank cannot make num_microbatches={num_microbatches}")
    if errs:
        raise ValueError(f"impossible layout {layout} (tp_style={style.value}, schedule={schedule}): "
                         + "; ".join(errs))
