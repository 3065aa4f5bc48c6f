"""``torch.distributed._tensor`` (torch's older path, still in its examples): :mod:`axonmpi.distributed.tensor`'s names."""
from ..tensor import DeviceMesh, Replicate, Shard, init_device_mesh
from . import device_mesh

__all__ = ["DeviceMesh", "Replicate", "Shard", "init_device_mesh", "device_mesh"]
