"""Every process a test spawns gets the launcher-free environment of ``axonmpi.testing.mpiexec_env``.

Under ``mpiexec`` (``make test`` runs pytest at several rank counts) the launcher's variables (PMI_FD,
PMI_RANK, HYDRA_*, MPI_LOCALRANKID ...) are in ``os.environ``; a child python that inherits them and
initialises MPI talks to a PMI socket that is not its own and dies with ``PMI_Init returned -1``
(issue 31 item 8: tests/test_porting.py once torch is installed).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from axonmpi.testing import mpiexec_env

HERE = os.path.dirname(os.path.abspath(__file__))
_SPAWN = {"run", "Popen", "check_output", "check_call", "call"}
_NOT_MPI = {"h5dump"}   # tools that never start MPI


def _spawns(path):
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SPAWN
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"):
            yield node


@pytest.mark.serial
def test_every_spawning_test_cleans_the_launcher_environment():
    bad = []
    for name in sorted(os.listdir(HERE)):
        if not name.endswith(".py"):
            continue
        path = os.path.join(HERE, name)
        for call in _spawns(path):
            first = call.args[0] if call.args else None
            if isinstance(first, ast.List) and first.elts and isinstance(first.elts[0], ast.Constant) \
                    and first.elts[0].value in _NOT_MPI:
                continue
            env = [k.value for k in call.keywords if k.arg == "env"]
            if not env:
                bad.append(f"{name}:{call.lineno}: no env= (inherits the launcher's PMI_FD)")
            elif "os.environ" in ast.unparse(env[0]):
                bad.append(f"{name}:{call.lineno}: env= built from os.environ (use axonmpi.testing.mpiexec_env)")
    assert not bad, "\n".join(bad)


@pytest.mark.serial
def test_a_child_started_from_inside_a_launch_initialises_mpi(monkeypatch):
    """What a test run under ``mpiexec -n 1`` sees: the launcher's variables, pointing at a PMI that is gone."""
    for k, v in {"PMI_FD": "9", "PMI_RANK": "0", "PMI_SIZE": "1", "PMI_HOSTNAME": "x", "MPI_LOCALRANKID": "0",
                 "MPI_LOCALNRANKS": "1", "HYDRA_CONTROL_FD": "11"}.items():
        monkeypatch.setenv(k, v)
    env = mpiexec_env()
    assert not [k for k in env if k.startswith(("PMI_", "HYDRA_", "MPI_LOCAL"))]
    r = subprocess.run([sys.executable, "-c", "import axonmpi; print(axonmpi.init().world_size)"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.split()[-1] == "1", r.stderr[-2000:]
