"""``torch.distributed._tensor.device_mesh``'s path: :mod:`axonmpi.distributed.device_mesh`'s names."""
from ..device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
