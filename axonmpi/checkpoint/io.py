"""The checkpoint entry points in one place: save, load, CheckpointReader, is_checkpoint.

The code lives by topic: :mod:`~axonmpi.checkpoint.plan` (who writes what),
:mod:`~axonmpi.checkpoint.write` (save), :mod:`~axonmpi.checkpoint.read` (reading and
verifying), :mod:`~axonmpi.checkpoint.loading` (load into a layout), :mod:`~axonmpi.checkpoint.index`
(index.h5) and :mod:`~axonmpi.checkpoint.checksum` (block checksums).
"""
from .format import CheckpointError
from .loading import load
from .read import CheckpointReader, is_checkpoint
from .write import save

__all__ = ["save", "load", "CheckpointReader", "CheckpointError", "is_checkpoint"]
