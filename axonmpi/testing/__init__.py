"""Helpers for testing MPI programs: run a script under a fresh ``mpiexec``; ``fake_nccl``, a CPU stand-in for NCCL."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Dict, Optional, Sequence

__all__ = ["mpiexec_path", "mpiexec_env", "run_mpiexec"]

_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "I_MPI_", "MPICH_INTERFACE")


def mpiexec_path() -> str:
    """The ``mpiexec`` beside this Python (a venv with the ``mpich`` wheel), else the one on PATH."""
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(cand):
        return cand
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("no mpiexec found: pip install 'axonmpi[mpich]' or load your cluster's MPI module")
    return found


def mpiexec_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The current environment minus the launcher's own variables (so a nested launch is clean)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
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
