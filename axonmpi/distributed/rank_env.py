"""The rank variables torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``), published by ``init_process_group`` for code that reads them afterwards."""
from __future__ import annotations

import os
import socket
from typing import Dict

__all__ = ["RANK_VARS", "rank_variables", "publish_rank_env"]

#: the variables :func:`publish_rank_env` writes (a nested launch drops them: ``axonmpi.testing.mpiexec_env``)
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def rank_variables(world) -> Dict[str, str]:
    """torchrun's rank variables for ``world`` (``MASTER_ADDR`` is rank 0's host name: one broadcast)."""
    return {"RANK": str(world.rank), "LOCAL_RANK": str(world.local_rank), "WORLD_SIZE": str(world.world_size),
            "LOCAL_WORLD_SIZE": str(world.local_size), "MASTER_ADDR": world._comm.bcast(socket.gethostname(), root=0)}


def publish_rank_env(world) -> Dict[str, str]:
    """Set the rank variables in ``os.environ`` (collective: every rank calls it).

    A variable the launcher already set is kept when it agrees; a rank number that disagrees raises ValueError
    on that rank, naming the variable, both values and the fix. ``MASTER_ADDR`` is only set when absent (a
    launcher may name the host by address). Returns what was published.
    """
    want = rank_variables(world)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        have = os.environ.get(name)
        if have is not None and have.strip() != want[name]:
            raise ValueError(
                f"rank {world.rank}: the environment has {name}={have!r} but the launch made this process "
                f"{name}={want[name]} (MPI's numbering); unset {name} before mpiexec/srun, or launch so they agree")
    for name, value in want.items():
        os.environ.setdefault(name, value)
    return want
