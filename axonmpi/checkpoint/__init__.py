"""Sharded HDF5 checkpoints: save/load any distributed state, reshard on load, crash-safe replace."""
from .format import CheckpointError
from .io import CheckpointReader, is_checkpoint, load, save
from .manager import CheckpointManager
from .sharded import ShardedArray
from .state import restore_training_state, training_state

__all__ = [
    "ShardedArray", "save", "load", "CheckpointReader", "CheckpointError", "CheckpointManager",
    "is_checkpoint", "training_state", "restore_training_state",
]
