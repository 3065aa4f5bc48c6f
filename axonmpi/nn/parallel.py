"""``torch.nn.parallel``'s path: :class:`axonmpi.parallel.DistributedDataParallel` (the same class).

Loaded by ``import axonmpi`` after every layer (it names the parallel layer from inside ``nn`` only
because torch's path does); nothing in the library imports it.
"""
from ..parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
