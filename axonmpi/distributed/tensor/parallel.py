"""``torch.distributed.tensor.parallel``'s path: ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` plans, served by :func:`axonmpi.parallel.parallelize`'s Megatron plans.

========================================== ===========================================================
torch style                                 here (``parallelize(tensor_parallel={pattern: kind})``)
========================================== ===========================================================
``ColwiseParallel()``                        ``"column"``: output features split, output stays split
``ColwiseParallel(output_layouts=Replicate())`` ``"column_gather"``: output all-gathered to the full width
``RowwiseParallel()`` on ``nn.Linear``       ``"row"``: input features split, output all-reduced
``RowwiseParallel()`` on ``nn.Embedding``    ``"vocab"``: rows (the vocabulary) split
anything else (``input_layouts=``,          ``NotImplementedError`` at construction or at
``use_local_output=False``, SequenceParallel) ``parallelize_module``, naming the style
========================================== ===========================================================

The module is returned parallelized over the mesh's tensor group (a 1-D mesh, or ``mesh["tp"]``, the last
dimension of a 2-D one); every rank of that group reads the same input, as in torch. This module sits
under ``distributed/`` by torch's name only: it imports the parallel layer, and nothing in the library
imports it.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from . import Replicate, Shard

__all__ = ["parallelize_module", "ColwiseParallel", "RowwiseParallel", "ParallelStyle"]


class ParallelStyle:
    """Base of the styles a plan maps module names to."""

    kind = ""

    def _kind_for(self, module: Any) -> str:
        return self.kind


def _check_layouts(style: str, given: Dict[str, Any], allowed: Dict[str, tuple]) -> None:
    for name, value in given.items():
        if value is None:
            continue
        if not any(value == a for a in allowed.get(name, ())):
            raise NotImplementedError(f"{style}({name}={value!r}) is not served: the tensor-parallel layers here take "
                                      f"{style}() as Megatron's layer{' (or output_layouts=Replicate())' if style == 'ColwiseParallel' else ''}"
                                      "; see docs/porting.md")


class ColwiseParallel(ParallelStyle):
    """torch's ``ColwiseParallel``: a Linear's output features split over the tensor group (Megatron's
    column-parallel layer); ``output_layouts=Replicate()`` all-gathers its output."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True):
        _check_layouts("ColwiseParallel", {"input_layouts": input_layouts, "output_layouts": output_layouts},
                       {"input_layouts": (Replicate(),), "output_layouts": (Shard(-1), Replicate())})
        if not use_local_output:
            raise NotImplementedError("ColwiseParallel(use_local_output=False): outputs are plain Tensors here "
                                      "(no DTensor); leave it out")
        self.kind = "column_gather" if output_layouts == Replicate() else "column"

    def __repr__(self) -> str:
        return f"ColwiseParallel() -> {self.kind!r}"


class RowwiseParallel(ParallelStyle):
    """torch's ``RowwiseParallel``: a Linear's input features split (its input is a column layer's split
    output) and its output all-reduced; on an ``nn.Embedding`` the vocabulary rows split."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True):
        _check_layouts("RowwiseParallel", {"input_layouts": input_layouts, "output_layouts": output_layouts},
                       {"input_layouts": (Shard(-1),), "output_layouts": (Replicate(),)})
        if not use_local_output:
            raise NotImplementedError("RowwiseParallel(use_local_output=False): outputs are plain Tensors here "
                                      "(no DTensor); leave it out")
        self._input_replicated = False
        self.kind = "row"

    def _kind_for(self, module: Any) -> str:
        from ...nn import Embedding
        return "vocab" if isinstance(module, Embedding) else "row"

    def __repr__(self) -> str:
        return "RowwiseParallel()"


def parallelize_module(module: Any, device_mesh: Optional[Any] = None, parallelize_plan: Optional[Dict] = None,
                       *, src_data_rank: Optional[int] = 0) -> Any:
    """torch's ``parallelize_module(module, device_mesh, {"name": ColwiseParallel(), ...})``.

    Args:
        module: the model (built alike on every rank of the tensor group: each keeps its part of
            the serial weights).
        device_mesh: a 1-D :class:`DeviceMesh` (or ``mesh["tp"]``, the last dimension of a 2-D one).
        parallelize_plan: ``{module name or fnmatch pattern: ColwiseParallel() | RowwiseParallel()}``.
        src_data_rank: 0 (every rank already holds the serial weights; nothing is scattered) or None.

    Returns:
        The parallelized module (:func:`axonmpi.parallel.parallelize`'s ``ParallelModule``).
    """
    from ...parallel import parallelize
    from ..device_mesh import DeviceMesh, init_device_mesh
    from ..world import get_world
    rank = get_world().rank
    if device_mesh is None:
        device_mesh = init_device_mesh("cpu", (get_world().world_size,))
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"rank {rank}: parallelize_module needs a DeviceMesh (init_device_mesh), got "
                        f"{type(device_mesh).__name__}")
    if not device_mesh.is_tensor_dim:
        raise NotImplementedError(f"rank {rank}: parallelize_module over {device_mesh}: tensor parallelism runs over "
                                  "a 1-D mesh or the last dimension of a 2-D mesh (mesh['tp'])")
    if not isinstance(parallelize_plan, dict) or not parallelize_plan:
        raise NotImplementedError(f"rank {rank}: parallelize_module(parallelize_plan={parallelize_plan!r}): pass a "
                                  "dict {submodule name: ColwiseParallel() | RowwiseParallel()}")
    named = dict(module.named_modules())
    from fnmatch import fnmatchcase
    plan = {}
    for pattern, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise NotImplementedError(f"rank {rank}: {pattern!r}: {style!r} is not served (ColwiseParallel and "
                                      "RowwiseParallel are; docs/porting.md)")
        hits = [n for n in named if n and fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"rank {rank}: parallelize_plan names {pattern!r}, which matches no submodule of "
                             f"{type(module).__name__} (its submodules: {[n for n in named if n][:12]})")
        for n in hits:
            plan[n] = style._kind_for(named[n])
    return parallelize(module, grid=device_mesh.grid, tensor_parallel=plan, data_parallel=None)
