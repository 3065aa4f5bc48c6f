"""``torch.distributed.tensor``'s path, for the names tensor-parallel scripts import: ``DeviceMesh``,
``init_device_mesh``, and the layouts ``Replicate()`` / ``Shard(dim)`` that ``ColwiseParallel`` /
``RowwiseParallel`` take. DTensor itself (``distribute_tensor``, ``DTensor``) is not served: a
parameter here is its rank's plain array with a :class:`~axonmpi.distributed.Placement` (docs/porting.md).
"""
from __future__ import annotations

from ..device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh", "Replicate", "Shard", "parallel"]


class Replicate:
    """torch's ``Replicate()`` layout: every rank of the mesh dimension holds the whole tensor."""

    def __eq__(self, other) -> bool:
        return isinstance(other, Replicate)

    def __hash__(self) -> int:
        return hash("Replicate")

    def __repr__(self) -> str:
        return "Replicate()"


class Shard:
    """torch's ``Shard(dim)`` layout: the tensor split along ``dim`` over the mesh dimension."""

    def __init__(self, dim: int):
        self.dim = int(dim)

    def __eq__(self, other) -> bool:
        return isinstance(other, Shard) and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("Shard", self.dim))

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


def __getattr__(name):          # ``axonmpi.distributed.tensor.parallel`` loads the parallel layer: only on use
    if name == "parallel":
        import importlib
        return importlib.import_module(".parallel", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
