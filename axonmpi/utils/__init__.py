"""``torch.utils``'s path: ``axonmpi.utils.data`` is :mod:`axonmpi.data` under torch's name.

The import rule of docs/porting.md (``torch`` becomes ``axonmpi`` in every import line) makes
``from torch.utils.data import DataLoader`` into ``from axonmpi.utils.data import DataLoader``: the
library's own ``DataLoader`` (the names are re-exported, not copied); ``axonmpi.utils.checkpoint`` is
torch's ``torch.utils.checkpoint`` over :mod:`axonmpi.nn.checkpointing`.
"""
from . import data

__all__ = ["checkpoint", "data"]


def __getattr__(name: str):
    if name == "checkpoint":            # loads nn on first use, as ``axonmpi.nn`` itself does
        import importlib
        return importlib.import_module(f"{__name__}.checkpoint")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
