"""The rank variables torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``): from the MPI launcher's own variables when ``axonmpi`` is imported (a script that reads
``RANK`` before ``init_process_group``, as nanoGPT's ``train.py`` does, sees it), and checked against MPI and
completed by ``init_process_group``."""
from __future__ import annotations

import os
import socket
from typing import Dict

__all__ = ["RANK_VARS", "launcher_variables", "publish_launcher_env", "rank_variables", "publish_rank_env"]

#: the variables :func:`publish_rank_env` writes (a nested launch drops them: ``axonmpi.testing.mpiexec_env``)
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


# (rank, size, local rank, local size) variables of the launchers that set all four, most specific first
_LAUNCHERS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),          # MPICH / Intel MPI's hydra
)


def launcher_variables(environ=None) -> Dict[str, str]:
    """torchrun's rank variables read from an MPI launcher's (``mpiexec`` of MPICH, Intel MPI or Open MPI), without
    starting MPI; empty when no such launcher started this process (or it set only part of them)."""
    env = os.environ if environ is None else environ
    for rank, size, local, local_size in _LAUNCHERS:
        if all(v in env for v in (rank, size, local, local_size)):
            return {"RANK": env[rank], "WORLD_SIZE": env[size], "LOCAL_RANK": env[local],
                    "LOCAL_WORLD_SIZE": env[local_size]}
    return {}


def publish_launcher_env() -> Dict[str, str]:
    """Set the rank variables the launcher's own give, where absent (run when ``axonmpi`` is imported): what
    torchrun gives a script, ``mpiexec`` gives it here. ``init_process_group`` checks them against MPI."""
    found = launcher_variables()
    if "RANK" in os.environ and os.environ.get("WORLD_SIZE") != found.get("WORLD_SIZE"):
        return {}               # set by someone else (a torchrun-style launch, a user): init_process_group checks
    for name, value in found.items():
        os.environ.setdefault(name, value)
    return found


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
