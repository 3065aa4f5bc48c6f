"""Helpers for testing MPI programs: run a script under a fresh ``mpiexec``; ``fake_nccl``, a CPU stand-in for NCCL."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, Optional, Sequence

from ..distributed.launch import mpiexec_path  # the production helper, re-exported

__all__ = ["mpiexec_path", "mpiexec_env", "run_mpiexec"]

# what a launcher (Hydra, Slurm's PMI, Open MPI's prterun, Intel MPI) sets for its own children: a child
# started by a test inherits them, and an MPI_Init that finds PMI_FD of a launch that is not its own
# fails ("PMI_Init returned -1"). Every process a test spawns goes through mpiexec_env().
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "PRTE_", "I_MPI_", "MPICH_INTERFACE",
                      "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
# torchrun's rank variables, which init_process_group publishes (distributed/rank_env.py): a child is a new launch
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def mpiexec_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The current environment minus the launcher's own variables (so a nested launch is clean)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES) and k not in _RANK_VARS}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if extra:
        env.update(extra)
    return env


def run_mpiexec(args: Sequence[str], n: int, *, timeout: float = 120.0,
                env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n python <args>`` and return the completed process (text output captured).

    Example:
        >>> r = run_mpiexec(["-c", "import axonmpi; print(axonmpi.init().rank)"], n=2)
        >>> r.returncode
        0
    """
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpiexec_env(env), cwd=cwd)
