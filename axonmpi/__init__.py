"""axonmpi: MPI-native distributed deep learning on NumPy/CuPy and HDF5.

Layers (each imports only those below it): ``backend`` → ``distributed`` → ``autograd`` →
``nn``/``optim``/``data`` → ``parallel`` → ``checkpoint`` → examples, jobs and the CLI.
"""
from __future__ import annotations

__version__ = "0.1.0"

import os as _os

# MPICH: a thread blocked in an MPI call holds the library's lock while it polls; without a real yield the watchdog's
# monitor thread (which answers the other ranks' questions) can starve on a loaded node and a healthy rank is
# reported as not answering. Set before mpi4py initialises MPI; other MPIs ignore it; a value set by the user wins.
_os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")

from . import backend
from .backend import Device, get_array_module
from .log import get_logger, print0, print_rank
from . import distributed
from .distributed import (
    ProcessGroup, ReduceOp, Work, World, all_gather, all_gather_object, all_reduce, all_reduce_max,
    all_reduce_mean, all_reduce_min, all_reduce_product, all_reduce_sum, all_to_all, barrier,
    broadcast, broadcast_object, gather, gather_object, get_world, init, irecv, is_initialized,
    is_main_process, isend, rank, recv, reduce, reduce_scatter, reduce_scatter_mean,
    reduce_scatter_sum, scatter, send, world_size,
)
from .distributed import GridCoords, ProcessGrid, get_grid
from .distributed import P2POp, batch_isend_irecv
from . import random
from . import trace
from .trace import profile
from .random import Generator, manual_seed
from . import autograd
from .autograd import (
    Function, Tensor, arange, empty, enable_grad, full, gradcheck, is_grad_enabled, no_grad, ones, ones_like,
    rand, randn, set_grad_enabled, tensor, zeros, zeros_like,
)
from . import cuda
from .serialization import load, save
from .distributed import (destroy_process_group, get_rank, get_world_size, init_process_group)  # noqa: F401
from ._torch_names import *  # noqa: F401,F403  (torch.device, torch.float32, torch.argmax, ...: _torch_names.__all__)
from .distributed.rank_env import publish_launcher_env as _publish_launcher_env
_publish_launcher_env()    # RANK, WORLD_SIZE, LOCAL_RANK from mpiexec's variables, as torchrun sets them (docs/porting.md)

# The layers above autograd load on first use (``axonmpi.nn``, ``axonmpi.DDP``, ``from axonmpi import
# parallel``): a job that only needs the collectives starts in about half the time (0.45 s of CPU instead of
# 0.9 s per process on the development machine), which every rank of every launch pays. So do torch's module
# paths (docs/porting.md: `torch` becomes `axonmpi` in every import line), which name the library's own
# classes from where torch keeps them (torch.utils.data, torch.nn.parallel, torch.distributed.fsdp,
# torch.distributed.device_mesh, torch.distributed.tensor, torch.multiprocessing).
_SUBMODULES = frozenset({
    "amp", "checkpoint", "cli", "data", "graphs", "interop", "intra_layer", "models", "multiprocessing", "nn", "optim",
    "parallel", "plan", "planner", "plot", "recipes", "testing", "utils",
})
_NAMES = {
    "DDP": "parallel", "DistributedDataParallel": "parallel", "GradSyncStrategy": "parallel",
    "FSDP": "parallel", "CPUOffload": "parallel", "FullyShardedDataParallel": "parallel",
    "MixedPrecision": "parallel", "ShardingStrategy": "parallel",
    "DistributedSampler": "data.distributed", "create_dataloader": "data.distributed",
    "compile": "graphs",
}


def __getattr__(name: str):
    import importlib
    if name == "bfloat16":          # torch.bfloat16; ml_dtypes is imported on first use (it takes seconds)
        from ._torch_names import _bfloat16
        value = globals()[name] = _bfloat16()
        return value
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES | set(_NAMES) | {"bfloat16"})
