"""Test harness shared by every test file.

* Serial tests (no ``mpi`` marker, or ``@pytest.mark.serial``) run only in the 1-rank pass of
  ``make test``; under ``mpiexec -n N`` with N > 1 they are skipped, so each runs once.
* Under ``mpiexec``, only rank 0 prints pytest's report; the other ranks write theirs to
  ``.test-logs/np<N>-rank<r>.log`` (``make test`` prints those of failed runs).
* ``--shard K/N`` keeps the K-th (0-based) of N shards of equal time (by ``tests/durations-np1.tsv``; every
  N-th test without it): ``make test`` runs the 1-rank pass as two such shards at once, since its tests
  mostly wait on jobs they launch.
* A watchdog (``faulthandler.dump_traceback_later``) ends a test that hangs for
  ``AXONMPI_TEST_TIMEOUT`` seconds (default 180), printing every thread's stack; the MPI
  launcher then tears down the other ranks instead of leaving the job blocked.
"""
from __future__ import annotations

import faulthandler
import os
import re

import pytest

try:
    from mpi4py import MPI

    _RANK, _SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
except Exception:  # pragma: no cover - mpi4py missing
    _RANK, _SIZE = 0, 1

_TIMEOUT = float(os.environ.get("AXONMPI_TEST_TIMEOUT", "180"))


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only every N-th collected test, from the K-th (0-based): K/N, e.g. 0/2 and 1/2")


def _shard(config):
    text = config.getoption("--shard")
    if not text:
        return None
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise pytest.UsageError(f"--shard {text!r}: expected K/N with 0 <= K < N, e.g. --shard 1/2")
    return int(m.group(1)), int(m.group(2))


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Ranks other than 0 write pytest's report to .test-logs/np<N>-rank<r>.log."""
    if _SIZE == 1 or _RANK == 0:
        return
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    from _pytest.config import create_terminal_writer

    logdir = os.path.join(str(config.rootpath), ".test-logs")
    os.makedirs(logdir, exist_ok=True)
    f = open(os.path.join(logdir, f"np{_SIZE}-rank{_RANK}.log"), "w", encoding="utf-8")
    config.add_cleanup(f.close)
    tr._tw = create_terminal_writer(config, f)


_DEFAULT_S = 0.05       # the weight of a test tests/durations-np1.tsv does not list


def _balance(config, items, n):
    """The shard of each collected test: the slowest first, each to the shard with the least time so far, by the
    1-rank pass's times in ``tests/durations-np1.tsv`` (``python tests/slowest.py .test-logs --write-np1
    tests/durations-np1.tsv`` after a ``make test`` writes it again); every N-th test without that file.  Every
    shard computes the same split from the same collection."""
    weights = {}
    try:
        with open(os.path.join(str(config.rootpath), "tests", "durations-np1.tsv"), encoding="utf-8") as f:
            for line in f:
                t, _, name = line.rstrip("\n").split("\t", 2)
                weights[name] = float(t)
    except (OSError, ValueError):
        return [i % n for i in range(len(items))]
    load, owner = [0.0] * n, [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-weights.get(items[i].nodeid, _DEFAULT_S), i)):
        j = min(range(n), key=lambda s: (load[s], s))
        owner[i] = j
        load[j] += weights.get(items[i].nodeid, _DEFAULT_S)
    return owner


def pytest_collection_modifyitems(config, items):
    shard = _shard(config)
    if shard is not None:
        k, n = shard
        owner = _balance(config, items, n)
        config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if owner[i] != k])
        items[:] = [it for i, it in enumerate(items) if owner[i] == k]
    if not re.search(r"\bnd\b", config.option.markexpr or ""):
        # the N-D layouts (8 and 16 ranks) run in make test's own pass: pytest -m nd
        skip_nd = pytest.mark.skip(reason="N-D layout: runs in its own pass (mpiexec -n 8|16 pytest -m nd)")
        for item in items:
            if item.get_closest_marker("nd") is not None:
                item.add_marker(skip_nd)
    if _SIZE == 1:
        return
    skip = pytest.mark.skip(reason="serial test: runs in the 1-rank pass")
    for item in items:
        if item.get_closest_marker("serial") is not None or item.get_closest_marker("mpi") is None:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    faulthandler.dump_traceback_later(_TIMEOUT, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


_TIMES: dict = {}
_SKIPPED: set = set()


def pytest_runtest_logreport(report):
    """Each test's setup + call + teardown time (rank 0): ``make test`` prints the ten slowest of all passes."""
    if _RANK == 0:
        _TIMES[report.nodeid] = _TIMES.get(report.nodeid, 0.0) + report.duration
        if report.skipped:
            _SKIPPED.add(report.nodeid)


def pytest_sessionfinish(session):
    logdir = os.path.join(str(session.config.rootpath), ".test-logs")
    if _RANK == 0 and _TIMES and os.path.isdir(logdir):
        with open(os.path.join(logdir, f"durations-np{_SIZE}-{os.getpid()}.tsv"), "w", encoding="utf-8") as f:
            f.writelines(f"{t:.2f}\t{_SIZE}\t{n}\n" for n, t in _TIMES.items() if n not in _SKIPPED)


@pytest.fixture
def world():
    """The axonmpi World of this test run (all ranks of mpiexec): the current one, so a test that destroys the World
    and makes it again (the trainer in process makes its own grid) leaves the next test a live World."""
    import axonmpi

    return axonmpi.init()


@pytest.fixture
def slurm_env(tmp_path):
    """For job-template tests: ``slurm_env(**variables)`` gives an environment whose ``srun`` echoes its
    arguments (nothing is started), with the Slurm and site variables a template reads, plus ``variables``."""
    from axonmpi.testing import mpiexec_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\necho srun \"$@\"\n")
    os.chmod(fake / "srun", 0o755)

    def make(**variables):
        return mpiexec_env({"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NAME": "t", "SLURM_JOB_NODELIST": "n[1-2]",
                            "AXONMPI_SCRATCH": str(tmp_path), "AXONMPI_SITE": os.path.join(root, "jobs", "site.sh"),
                            **variables})
    return make
