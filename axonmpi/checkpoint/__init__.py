"""Sharded HDF5 checkpoints: save/load any distributed state, reshard on load, crash-safe replace."""
from ..distributed.sharding import ShardedArray
from .format import CheckpointError, CheckpointMismatchError
from .loading import LegacyChecksumWarning, load
from .manager import CheckpointManager
from .preemption import PREEMPTED_EXIT_CODE, PreemptionHandler
from .runlock import FolderInUseError
from .read import CheckpointReader, is_checkpoint
from .safetensors_io import export_safetensors, load_safetensors, save_safetensors
from .state import restore_training_state, training_state
from .write import save

__all__ = [
    "ShardedArray", "save", "load", "CheckpointReader", "CheckpointError", "CheckpointMismatchError",
    "CheckpointManager",
    "is_checkpoint", "training_state", "restore_training_state", "PreemptionHandler", "PREEMPTED_EXIT_CODE",
    "FolderInUseError", "LegacyChecksumWarning",
    "export_safetensors", "load_safetensors", "save_safetensors",
]
