"""init()'s launch defaults: one BLAS thread per rank when ranks share a node; launcher/MPI mismatch warned."""
import re
import subprocess
import sys
import warnings

import pytest

from axonmpi.distributed import launch
from axonmpi.testing import mpiexec_env, mpiexec_path

_PROBE = ("import axonmpi; w = axonmpi.init(); from threadpoolctl import threadpool_info; "
          "n = max([i['num_threads'] for i in threadpool_info()] or [1]); r = axonmpi.gather_object((w.rank, n)); "
          "w.rank == 0 and print(' '.join(f'threads {a} {b}' for a, b in r), flush=True)")


def _run(n, extra=None, drop=launch.THREAD_VARS):
    env = {k: v for k, v in mpiexec_env().items() if k not in drop}
    env.update(extra or {})
    return subprocess.run([mpiexec_path(), "-n", str(n), sys.executable, "-c", _PROBE], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.serial
def test_two_ranks_get_one_thread_and_one_notice():
    r = _run(2)
    assert r.returncode == 0, r.stderr
    found = sorted(re.findall(r"threads (\d) (\d+)", r.stdout))
    assert found == [("0", "1"), ("1", "1")], (r.stdout, r.stderr)
    assert r.stderr.count("ranks share this node; using 1 BLAS/OpenMP thread per rank") == 1, r.stderr


@pytest.mark.serial
def test_user_choice_is_kept():
    r = _run(2, {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr
    assert "using 1 BLAS/OpenMP thread" not in r.stderr


def test_limit_threads_unit(monkeypatch):
    for v in launch.THREAD_VARS:
        monkeypatch.delenv(v, raising=False)
    assert launch.limit_threads(1, 0) is None  # alone on the node: untouched
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.limit_threads(4, 0) is None  # the user's choice wins


@pytest.mark.parametrize("var", ["SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"])
def test_launcher_mismatch_is_an_error_under_a_launcher(monkeypatch, var):
    """srun / mpiexec started 4 processes, MPI sees 1: an error naming the fix; an allocation's SLURM_NTASKS alone
    (a batch script's own Python) or AXONMPI_ALLOW_LAUNCHER_MISMATCH=1: a warning."""
    for v, _ in launch._SIZE_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.delenv("AXONMPI_ALLOW_LAUNCHER_MISMATCH", raising=False)
    monkeypatch.setenv(var, "4")
    want = rf"started 4 processes \({var}=4\).*--mpi=pmix.*mpi4py"
    if var == "SLURM_NTASKS":
        with pytest.warns(launch.LauncherMismatchWarning, match=want):
            launch.check_launcher(1)
    else:
        with pytest.raises(launch.LauncherMismatchError, match=want):
            launch.check_launcher(1)
        monkeypatch.setenv("AXONMPI_ALLOW_LAUNCHER_MISMATCH", "1")
        with pytest.warns(launch.LauncherMismatchWarning, match=want):
            launch.check_launcher(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch.check_launcher(4) is None  # consistent
    monkeypatch.setenv(var, "1")
    assert launch.check_launcher(1) is None


@pytest.mark.serial
def test_init_refuses_a_fake_srun_and_warns_in_an_allocation():
    env = mpiexec_env({"SLURM_NTASKS": "4"})
    r = subprocess.run([sys.executable, "-c", "import axonmpi; axonmpi.init()"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "LauncherMismatchWarning" in r.stderr and "SLURM_NTASKS=4" in r.stderr
    r = subprocess.run([sys.executable, "-c", "import axonmpi; axonmpi.init()"], capture_output=True, text=True,
                       env={**env, "SLURM_STEP_NUM_TASKS": "4"}, timeout=60)
    assert r.returncode != 0 and "LauncherMismatchError" in r.stderr and "SLURM_STEP_NUM_TASKS=4" in r.stderr


_FAULTS = ("import resource, sys, numpy as np{init}\n"
           "def flt(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
           "for i in range(6):\n"
           "    if i == 3: f0 = flt()\n"
           "    a = np.ones(6 << 20, np.float32); b = np.ones(6 << 20, np.float32); c = np.ones(3 << 20, np.float32)\n"
           "    del a, b, c\n"
           "print('faults', (flt() - f0) // 3)\n")


def _faults(init: bool, extra=None) -> int:
    env = {k: v for k, v in mpiexec_env().items() if k not in launch.MALLOC_VARS}
    env.update(extra or {})
    code = _FAULTS.format(init="\nimport axonmpi; axonmpi.init()" if init else "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return int(re.search(r"faults (\d+)", r.stdout).group(1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_init_keeps_freed_arrays_so_a_step_faults_no_pages_in():
    # a step's pattern: 24 + 24 + 12 MiB allocated, touched and freed again and again. glibc's defaults give
    # the top of the heap back to the system each time (1531 faults a round here); after init() none
    assert _faults(init=False) > 1000
    assert _faults(init=True) < 50
    assert _faults(init=True, extra={"AXONMPI_KEEP_FREED_MEMORY": "0"}) > 1000      # the opt-out
    assert _faults(init=True, extra={"MALLOC_TRIM_THRESHOLD_": "131072"}) > 1000    # the user's own setting wins
