"""``torch.multiprocessing``'s launching names over an MPI launch: the launcher made the processes.

A PyTorch script starts its workers itself (``mp.spawn(fn, args=(world_size,), nprocs=world_size)``,
or one ``Process(target=...)`` per rank). Under ``mpiexec -n N`` / ``srun`` the N processes exist
already, so here each of them plays one worker:

* :func:`spawn` calls ``fn(rank, *args)`` once, in this process, with this process's rank;
  ``nprocs`` must be N (else ``ValueError`` naming both and the ``mpiexec`` line to use).
* :class:`Process`: the k-th ``Process`` a script starts is rank k's; ``start()`` runs its target
  on rank k and nothing on the others; ``join()`` returns at once (the target ran in ``start``).
* :func:`set_start_method` / :func:`get_start_method` are accepted (there is nothing to fork).

Started with plain ``python script.py`` (a world of one), ``spawn(nprocs=2)`` raises: there is one
process; start the script with ``mpiexec -n 2``.

Example (``mpiexec -n 2 python run.py``)::

    import axonmpi.multiprocessing as mp
    def main(rank, world_size):
        ...
    mp.spawn(main, args=(2,), nprocs=2, join=True)
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .distributed import get_world

__all__ = ["spawn", "Process", "set_start_method", "get_start_method", "get_context", "cpu_count"]

_START_METHOD = ["spawn"]


def _launch() -> Tuple[int, int]:
    w = get_world()
    return w.rank, w.world_size


def _check_count(what: str, n: int, size: int, rank: int) -> None:
    if n != size:
        raise ValueError(f"rank {rank}: {what} asks for {n} process(es) but the launcher started {size}: under MPI "
                         f"the launcher makes the processes (each plays one); run the script as "
                         f"`mpiexec -n {n} python ...` (or `srun -n {n}`)")


def spawn(fn: Callable[..., Any], args: Tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn") -> None:
    """torch's ``mp.spawn``: run ``fn(rank, *args)`` in this process, the launcher's rank ``rank``.

    Args:
        fn: the worker function; its first argument is the rank.
        args: the rest of its arguments.
        nprocs: the number of workers: must equal the number of ranks the launcher started.
        join, daemon, start_method: accepted (the processes are the launcher's).

    Returns:
        None once ``fn`` returned (``join=False`` too: there is no context to hand back).
    """
    rank, size = _launch()
    _check_count(f"spawn(nprocs={nprocs})", int(nprocs), size, rank)
    fn(rank, *tuple(args))


class Process:
    """torch's (``multiprocessing``'s) ``Process`` under MPI: the k-th one started is rank k's worker.

    ``start()`` runs ``target(*args, **kwargs)`` when this process is rank k (k counts the
    ``Process`` objects started so far in this script) and does nothing on the other ranks.
    """

    _started = 0

    def __init__(self, group=None, target: Optional[Callable[..., Any]] = None, name: Optional[str] = None,
                 args: Tuple = (), kwargs: Optional[dict] = None, *, daemon: Optional[bool] = None):
        self._target, self._args, self._kwargs = target, tuple(args), dict(kwargs or {})
        self.name, self.daemon, self.exitcode = name, daemon, None
        self._index: Optional[int] = None

    def start(self) -> None:
        rank, size = _launch()
        self._index = Process._started
        Process._started += 1
        if self._index >= size:
            _check_count(f"starting Process number {self._index + 1}", self._index + 1, size, rank)
        if self._index == rank and self._target is not None:
            self._target(*self._args, **self._kwargs)
        self.exitcode = 0

    def join(self, timeout: Optional[float] = None) -> None:
        """Nothing to wait for: this rank's target ran in ``start()``."""
        if self._index is None:
            raise AssertionError("can only join a started process")

    def is_alive(self) -> bool:
        return False

    @property
    def pid(self) -> Optional[int]:
        import os
        return os.getpid() if self._index is not None else None


def set_start_method(method: str, force: bool = False) -> None:
    """Accepted for torch scripts (``"spawn"``, ``"fork"``, ``"forkserver"``): the launcher starts the processes."""
    if method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"set_start_method({method!r}): expected 'spawn', 'fork' or 'forkserver'")
    _START_METHOD[0] = method


def get_start_method(allow_none: bool = False) -> str:
    return _START_METHOD[0]


class _Context:
    """``mp.get_context(method)``: the same ``Process`` and ``spawn``."""
    Process = Process

    @staticmethod
    def spawn(*a, **k):
        return spawn(*a, **k)


def get_context(method: Optional[str] = None) -> _Context:
    return _Context()


def cpu_count() -> int:
    import os
    return os.cpu_count() or 1
