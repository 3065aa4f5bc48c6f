"""``torch.utils``'s path: ``axonmpi.utils.data`` is :mod:`axonmpi.data` under torch's name.

The import rule of docs/porting.md (``torch`` becomes ``axonmpi`` in every import line) makes
``from torch.utils.data import DataLoader`` into ``from axonmpi.utils.data import DataLoader``: the
library's own ``DataLoader`` (the names are re-exported, not copied).
"""
from . import data

__all__ = ["data"]
