"""Launching: defaults and checks run by ``init()`` (one BLAS thread per rank, launcher/MPI mismatch), the ``mpiexec`` to use."""
from __future__ import annotations

import os
import shutil
import sys
import warnings
from typing import Optional, Tuple

from .. import env as _env

__all__ = ["THREAD_VARS", "LauncherMismatchError", "LauncherMismatchWarning", "limit_threads", "keep_freed_memory", "launcher_world_size",
           "check_launcher", "apply_launch_defaults", "mpiexec_path"]

#: variables a user sets to choose the BLAS/OpenMP thread count; any of them set means "leave it alone"
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

# (variable, launcher) pairs that carry the number of processes a launcher started, most specific first
_SIZE_VARS = (
    ("SLURM_STEP_NUM_TASKS", "srun"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_SIZE", "a PMI launcher (MPICH/Intel MPI mpiexec, srun --mpi=pmi2)"),
    ("PMIX_SIZE", "a PMIx launcher"),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH's mpirun"),
    ("SLURM_NTASKS", "Slurm"),
)


class LauncherMismatchWarning(RuntimeWarning):
    """An allocation (``SLURM_NTASKS``) holds several tasks but MPI gave this process a world of one: a batch
    script's own Python (not started by ``srun``) is one process by design, so this only warns."""


class LauncherMismatchError(RuntimeError):
    """A launcher (``srun``, ``mpiexec``/``mpirun``) started several processes but MPI gave this one a world of
    one: every process would train alone as rank 0, so ``init()`` stops."""


def limit_threads(local_size: int, rank: int) -> Optional[int]:
    """Limit BLAS/OpenMP pools to one thread when ``local_size`` ranks share this node.

    Nothing changes when the user set any of :data:`THREAD_VARS` (or ``AXONMPI_NO_THREAD_LIMIT=1``)
    or when the rank is alone on its node. The variables are also set for child processes.
    Rank 0 says so once on stderr (as torchrun does).

    Args:
        local_size: ranks on this node.
        rank: this process's world rank (only rank 0 prints).

    Returns:
        The thread count applied (1), or None when nothing was changed.

    Example:
        >>> limit_threads(world.local_size, world.rank)
    """
    if local_size <= 1 or _env.get_bool("AXONMPI_NO_THREAD_LIMIT") or any(v in os.environ for v in THREAD_VARS):
        return None
    from threadpoolctl import threadpool_limits

    for v in THREAD_VARS:
        os.environ[v] = "1"
    threadpool_limits(limits=1)  # applied now, kept for the life of the process
    if rank == 0:
        sys.stderr.write(
            f"axonmpi: {local_size} ranks share this node; using 1 BLAS/OpenMP thread per rank "
            f"(set OMP_NUM_THREADS to choose another count, or AXONMPI_NO_THREAD_LIMIT=1 to keep the default)\n")
        sys.stderr.flush()
    return 1


#: glibc's own variables for the same settings; any of them set means "leave malloc alone"
MALLOC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3          # mallopt's parameter numbers (malloc.h)
#: arrays up to this size come from the heap and are reused (glibc's largest mmap threshold on 64-bit)
MMAP_THRESHOLD = 32 * 2 ** 20
#: free memory kept at the heap's top instead of being given back to the system
TRIM_THRESHOLD = 2 ** 31 - 1
_KEPT: Optional[bool] = None


def keep_freed_memory() -> bool:
    """Let glibc keep freed arrays (up to 32 MiB each) in the process's heap, so that the next step's arrays
    reuse that memory instead of faulting fresh pages in.

    A training step frees and allocates the same arrays (activations, gradients, collective buffers) every
    step. glibc's defaults hand memory back to the system when the top of the heap is free and serve large
    arrays with fresh ``mmap`` s, so every step pays a page fault per 4 KiB touched. On 4 ranks sharing 2
    cores (2026-11-28) that was about 8 us a fault; an out-of-place 4 MiB all-reduce took 16-20 ms instead of 6,
    and a DDP step of ``examples/train_gpt.py`` at 8 x 512 took ~1880 ms instead of ~1600. This sets
    ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` and ``mallopt(M_TRIM_THRESHOLD, 2 GiB)``: the process's heap then
    stays at its high-water mark, as PyTorch's caching allocators keep theirs (and as jemalloc or tcmalloc,
    which PyTorch's CPU tuning guides recommend, do).

    Nothing changes where glibc is not the C library, where ``AXONMPI_KEEP_FREED_MEMORY=0``, or where the
    user set glibc's own ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES``.
    Returns whether it applied (once per process; later calls return the first answer).

    Example:
        >>> keep_freed_memory()          # on Linux with glibc
        True
    """
    global _KEPT
    if _KEPT is not None:
        return _KEPT
    _KEPT = False
    if not _env.get_bool("AXONMPI_KEEP_FREED_MEMORY") or any(v in os.environ for v in MALLOC_VARS):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
            return False                      # musl, macOS: their allocators, their defaults
        _KEPT = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):
        _KEPT = False
    return _KEPT


def launcher_world_size() -> Optional[Tuple[int, str, str]]:
    """``(n, variable, launcher)`` from the first launcher variable present that parses as an int, else None."""
    for var, who in _SIZE_VARS:
        v = os.environ.get(var, "").strip()
        if v.isdigit():
            return int(v), var, who
    return None


def check_launcher(world_size: int) -> Optional[str]:
    """Refuse a launch where a launcher started N > 1 processes but MPI sees one.

    That happens when mpi4py is built against another MPI than the launcher's: every process
    then runs as an independent rank 0, all writing into the same folders.  Under a launcher
    (``srun``'s ``SLURM_STEP_NUM_TASKS``, ``mpiexec``'s ``PMI_SIZE`` ...) it raises
    :class:`LauncherMismatchError`; with only an allocation's ``SLURM_NTASKS`` (a batch script's
    own Python, one process by design) it warns (:class:`LauncherMismatchWarning`).
    ``AXONMPI_ALLOW_LAUNCHER_MISMATCH=1`` turns the error into the warning.

    Args:
        world_size: the size of ``MPI.COMM_WORLD`` this process sees.

    Returns:
        The warning text, or None when the launch looks consistent.

    Raises:
        LauncherMismatchError: a launcher started several processes and MPI gives this one a world of 1.
    """
    found = launcher_world_size()
    if world_size != 1 or found is None or found[0] <= 1:
        return None
    n, var, who = found
    msg = (f"axonmpi: {who} started {n} processes ({var}={n}) but MPI gives this one a world of 1: "
           "mpi4py is built against a different MPI library than the launcher uses, so every process "
           "runs as an independent rank 0. Fix: under srun pass the matching PMI plugin "
           "(`srun --mpi=pmix`, or `--mpi=pmi2`; `srun --mpi=list` shows them), or use the mpiexec of "
           "the MPI that mpi4py was built with (`python -c 'import mpi4py; print(mpi4py.get_config())'`), "
           "or rebuild mpi4py against the system MPI: "
           "`module load <mpi>; pip install --force-reinstall --no-binary=mpi4py mpi4py` (docs/cluster.md)")
    if var != "SLURM_NTASKS" and os.environ.get("AXONMPI_ALLOW_LAUNCHER_MISMATCH", "") != "1":
        raise LauncherMismatchError(msg + "; AXONMPI_ALLOW_LAUNCHER_MISMATCH=1 runs anyway")
    warnings.warn(msg, LauncherMismatchWarning, stacklevel=3)
    return msg


def apply_launch_defaults(world) -> None:
    """What ``init()`` does while it builds the World: :func:`check_launcher`, :func:`limit_threads`, then
    :func:`keep_freed_memory`.

    The launcher check looks at ``MPI.COMM_WORLD`` (a World built on a sub-communicator is no mismatch).
    """
    from mpi4py import MPI

    check_launcher(MPI.COMM_WORLD.Get_size())
    limit_threads(world.local_size, world.rank)
    keep_freed_memory()


def mpiexec_path() -> str:
    """The ``mpiexec`` beside this Python (a venv with the ``mpich`` wheel), else the one on PATH."""
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(cand):
        return cand
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("no mpiexec found: pip install 'axonmpi[mpich]' or load your cluster's MPI module")
    return found
