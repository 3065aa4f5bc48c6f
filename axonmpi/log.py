"""Rank-aware logging: every line says which rank speaks; helpers that print on rank 0 only."""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional

if TYPE_CHECKING:
    import argparse

from . import env as _env

__all__ = ["human", "get_logger", "print0", "print_rank", "RankFilter", "rank0_parser", "exit0", "run_main",
           "stderr_is_terminal", "set_rank", "rank_info"]

_FORMAT = "%(asctime)s [rank %(rank)s/%(world_size)s] %(levelname)s %(name)s: %(message)s"


# (rank, world size) of the current World, told by axonmpi.init (this module sits below
# axonmpi.distributed and never imports it); None before init and after destroy
_RANK: Optional[tuple] = None


def set_rank(rank: Optional[int], world_size: int = 1) -> None:
    """Label log lines with ``rank`` of ``world_size`` (``World`` calls it at init; ``None`` at destroy)."""
    global _RANK
    _RANK = None if rank is None else (int(rank), int(world_size))


def rank_info():
    """``(rank, world_size)``: the World's once ``axonmpi.init`` ran, else the launcher's variables, else (0, 1)."""
    if _RANK is not None:
        return _RANK
    # before init: fall back to launcher variables only for labelling log lines
    for r, s in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 ("SLURM_PROCID", "SLURM_NTASKS")):
        if r in os.environ:
            return int(os.environ[r]), int(os.environ.get(s, "1"))
    return 0, 1


class RankFilter(logging.Filter):
    """Adds ``rank`` and ``world_size`` to every record; with ``rank0_only``, drops other ranks' records."""

    def __init__(self, rank0_only: bool = False):
        super().__init__()
        self.rank0_only = rank0_only

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank, record.world_size = rank_info()
        return not (self.rank0_only and record.rank != 0)


def get_logger(name: str = "axonmpi", level: Optional[int] = None, rank0_only: bool = False) -> logging.Logger:
    """A logger whose lines read ``... [rank 2/4] INFO name: message``.

    The level defaults to ``AXONMPI_LOG_LEVEL`` (``INFO``). With ``rank0_only=True`` only
    world rank 0 emits.

    Example:
        >>> log = axonmpi.get_logger(__name__)
        >>> log.info("loaded %d samples", n)
    """
    logger = logging.getLogger(name)
    if not any(getattr(h, "_axonmpi", False) for h in logger.handlers):
        h = logging.StreamHandler(sys.stderr)
        h._axonmpi = True
        h.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        h.addFilter(RankFilter(rank0_only))
        logger.addHandler(h)
        logger.propagate = False
    lvl = level if level is not None else _env.get_log_level()
    logger.setLevel(lvl)
    return logger


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on world rank 0 only (flushes, so lines are not held back under mpiexec)."""
    if rank_info()[0] == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def print_rank(*args: Any, **kwargs: Any) -> None:
    """``print`` prefixed with ``[rank r/n]`` on every rank."""
    r, n = rank_info()
    kwargs.setdefault("flush", True)
    print(f"[rank {r}/{n}]", *args, **kwargs)


def rank0_parser(parser: "argparse.ArgumentParser") -> "argparse.ArgumentParser":
    """Make ``parser`` print usage, errors and ``--help`` on world rank 0 only; returns it.

    Under ``mpiexec -n 4`` a bad option then prints one usage and one error, not four run
    together; every rank still exits with argparse's code. Works before :func:`axonmpi.init`
    (the rank comes from the launcher's variables).

    Example:
        >>> args = rank0_parser(argparse.ArgumentParser()).parse_args()
    """
    if rank_info()[0] != 0:
        parser._print_message = lambda message, file=None: None
    return parser


# processes between a rank and the terminal: MPICH's and Open MPI's launchers and proxies, Slurm's
_LAUNCHERS = ("mpiexec", "mpirun", "hydra_pmi_proxy", "mpiexec.hydra", "orterun", "orted", "prterun", "prted",
              "srun", "slurmstepd")


def _proc(pid: int, what: str) -> Optional[str]:
    try:
        if what == "fd2":
            return os.readlink(f"/proc/{pid}/fd/2")
        with open(f"/proc/{pid}/{what}", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _is_tty_path(path: Optional[str]) -> bool:
    return bool(path) and (path.startswith("/dev/pts/") or path.startswith("/dev/tty") or path == "/dev/console")


def stderr_is_terminal() -> bool:
    """True when this process's stderr reaches a terminal, also through an MPI launcher.

    Under ``mpiexec`` (or ``srun`` on the same host) a rank's stderr is a pipe to the launcher,
    which forwards it to its own stderr; so where this process's stderr is not a terminal, the
    launcher processes above it are asked (``/proc/<pid>/fd/2`` of each ancestor that is a
    launcher or a proxy: mpiexec, hydra_pmi_proxy, mpirun, orted, prterun, srun, slurmstepd).
    ``AXONMPI_PROGRESS=1`` / ``0`` overrides the answer. False where ``/proc`` is absent.

    Example:
        >>> show_bar = world.rank == 0 and stderr_is_terminal()
    """
    forced = os.environ.get("AXONMPI_PROGRESS", "").strip().lower()
    if forced in ("1", "true", "yes", "on"):
        return True
    if forced in ("0", "false", "no", "off"):
        return False
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    pid = os.getppid()
    for _ in range(4):                      # rank -> proxy -> launcher (-> a wrapper script of the launcher)
        if pid <= 1:
            return False
        comm = (_proc(pid, "comm") or "").strip()
        if not comm.startswith(_LAUNCHERS):
            return False
        if _is_tty_path(_proc(pid, "fd2")):
            return True
        stat = _proc(pid, "stat")
        if not stat:
            return False
        try:
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            return False
    return False


def exit0(message: str, code: int = 2) -> "NoReturn":
    """End this rank with ``code``, printing ``error: message`` on world rank 0 only.

    For conditions every rank evaluates the same way (a bad option value): one clean line
    instead of one per rank and no traceback.

    Example:
        >>> if args.global_batch % world.world_size:
        ...     exit0(f"--global-batch {args.global_batch} must divide by the {world.world_size} ranks")
    """
    if rank_info()[0] == 0:
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
    raise SystemExit(code)


def run_main(func: "Callable[..., Optional[int]]", *args: Any, traceback: bool = False) -> int:
    """Run a command-line entry point: its exit code, one ``error: ...`` line instead of a traceback.

    A closed pipe (``axonmpi ckpt inspect DIR | head``) ends quietly with 0; Ctrl-C with 130.
    ``traceback=True`` re-raises (the CLIs' ``--traceback`` flag).

    Example:
        >>> sys.exit(run_main(args.func, args))
    """
    try:
        return int(func(*args) or 0)
    except BrokenPipeError:
        try:  # stdout's buffer still holds data for the closed pipe: point it at /dev/null before exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a CLI reports every failure in one line
        if traceback:
            raise
        text = str(e) or type(e).__name__
        if isinstance(e, KeyError) and e.args:
            text = str(e.args[0])
        kind = "" if isinstance(e, (OSError, ValueError, KeyError, RuntimeError)) else f"{type(e).__name__}: "
        sys.stderr.write(f"error: {kind}{text}\n")
        return 1


def human(n: int) -> str:
    """``n`` bytes as B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
