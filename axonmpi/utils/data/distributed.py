"""``torch.utils.data.distributed``'s path: :class:`axonmpi.data.DistributedSampler` (the same class)."""
from ...data.distributed import DistributedSampler

__all__ = ["DistributedSampler"]
