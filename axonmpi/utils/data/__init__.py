"""``torch.utils.data``'s path for :mod:`axonmpi.data`: the same classes (re-exported, not copied).

``from torch.utils.data import DataLoader, TensorDataset, Dataset, Subset`` and
``torch.utils.data.distributed.DistributedSampler`` port by the import rule; see
docs/porting.md for what each does here.
"""
from ...data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset, default_collate
from . import distributed

__all__ = ["DataLoader", "Dataset", "DistributedSampler", "Subset", "TensorDataset", "default_collate",
           "distributed"]
