"""Early signals: SIGTERM/SIGUSR1 that arrive before a PreemptionHandler exists are kept, not lost.

[Note: signals before the handler]
Slurm's warning (``--signal=USR1@120``) or a SIGTERM may arrive during start-up (imports, building
the model, a long checkpoint load), before the script makes its
:class:`~axonmpi.checkpoint.PreemptionHandler`. MPICH installs a C-level SIGUSR1 handler at
``MPI_Init`` (which mpi4py calls when it is imported), so without a Python handler the signal was
swallowed and the run went on to its time limit; before ``MPI_Init`` the default action ends the
process.

So :func:`record_early_signals` installs a Python handler that only records the first
SIGTERM/SIGUSR1 (where no Python handler is installed yet). ``import axonmpi`` calls it right after
MPI is up when the process was started by a launcher (``mpiexec``, ``srun``: their rank variables
are set), and :func:`axonmpi.init` calls it in every process; a signal recorded before ``init``
is announced by ``init`` (one line) and kept. The first ``PreemptionHandler`` made takes the record
over (:func:`claim_early`), and its first ``should_stop()`` returns True on every rank. A recorded
SIGTERM that no handler claims within ``AXONMPI_EARLY_SIGNAL_GRACE`` seconds (default 30, Slurm's
default ``KillWait``) ends the rank as SIGTERM would have (exit 143, one line saying why): a script
that never makes a handler still stops on SIGTERM.

A signal that arrives before ``import axonmpi`` gets the default action (the rank ends; under
MPICH's launcher the job ends). The job templates hold SIGUSR1 until every rank has imported
axonmpi (``AXONMPI_READY_DIR``, see ``jobs/requeue.sh``), so under them no signal meets that window.

This module sits below :mod:`axonmpi.checkpoint.preemption` (which claims the record) and imports
nothing from axonmpi but :mod:`axonmpi.env`.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Dict, Optional, Sequence

__all__ = ["record_early_signals", "claim_early", "note_handler_made", "signal_number", "announce_early",
           "launched", "mark_ready", "DEFAULT_SIGNALS"]

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "MPI_LOCALRANKID")

# the first signal recorded before any PreemptionHandler existed: (signum, monotonic time) or None
_early: Optional[tuple] = None
_installed: Dict[int, object] = {}   # signum -> the handler record_early_signals replaced
_handlers_made = 0
_announced = False


def signal_number(s: "int | str") -> int:
    """The number of signal ``s`` (a name such as ``"SIGTERM"`` or ``"USR1"``, or a number)."""
    if isinstance(s, str):
        name = s.upper() if s.upper().startswith("SIG") else "SIG" + s.upper()
        if not hasattr(signal, name):
            raise ValueError(f"unknown signal {s!r}; expected a name such as 'SIGTERM' or 'USR1', or a number")
        return int(getattr(signal, name))
    return int(s)


def on_early_signal(signum, frame) -> None:
    """The recording handler: keep the first signal (and arm the SIGTERM grace)."""
    global _early
    if _early is None:
        _early = (signum, time.monotonic())
        if signum == signal.SIGTERM:
            _arm_sigterm_grace()


def _arm_sigterm_grace() -> None:
    """A SIGTERM that no PreemptionHandler claims in time ends the rank as SIGTERM would have."""
    from ..env import get_float
    grace = get_float("AXONMPI_EARLY_SIGNAL_GRACE")
    seen = _handlers_made

    def expire():
        if _handlers_made == seen and _early is not None and _early[0] == signal.SIGTERM:
            os.write(2, f"[axonmpi] pid {os.getpid()}: SIGTERM arrived and no PreemptionHandler was made within "
                        f"{grace:g} s (AXONMPI_EARLY_SIGNAL_GRACE): ending this rank as SIGTERM would "
                        "(exit 143)\n".encode())
            os._exit(128 + signal.SIGTERM)

    t = threading.Timer(grace, expire)
    t.daemon = True
    t.start()


def launched() -> bool:
    """True when a launcher (mpiexec, srun, ...) started this process (its rank variables are set)."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def record_early_signals(signals: Sequence["int | str"] = DEFAULT_SIGNALS) -> None:
    """Record SIGTERM/SIGUSR1 that arrive before a PreemptionHandler exists (``import axonmpi`` and ``init``).

    Only where no Python handler is installed (the default action, or MPICH's C-level handler);
    a handler the script installed itself is left alone. Main thread only (else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in signals:
        n = signal_number(s)
        if n in _installed:
            continue
        prev = signal.getsignal(n)
        if prev is None or prev is signal.SIG_DFL:
            _installed[n] = signal.signal(n, on_early_signal)


def mark_ready() -> None:
    """Tell the job template this rank catches signals now: a file in ``AXONMPI_READY_DIR`` (when set).

    ``jobs/requeue.sh`` holds a SIGUSR1 that arrives before every rank has written its file, and
    forwards it then (see the module note)."""
    d = os.environ.get("AXONMPI_READY_DIR")
    if not d:
        return
    rank = next((os.environ[v] for v in ("SLURM_PROCID", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
                 if v in os.environ), "0")
    path = os.path.join(d, f"rank-{rank}.{os.uname().nodename}.{os.getpid()}")
    try:
        with open(path, "w") as f:
            f.write("ready\n")
    except OSError as err:
        os.write(2, f"[axonmpi] rank {rank}: could not write {path} ({err.strerror}): the job template will "
                    "hold a SIGUSR1 until AXONMPI_SIGNAL_HOLD_S (default 90 s) instead of forwarding it at once; "
                    "AXONMPI_READY_DIR must be a folder every rank can write (jobs/requeue.sh makes it on the "
                    "scratch folder)\n".encode())


def announce_early(rank: int) -> None:
    """``init``: say (once, one line) that a signal recorded before ``init`` is kept for the first handler."""
    global _announced
    if _early is None or _announced:
        return
    _announced = True
    name = signal.Signals(_early[0]).name
    os.write(2, f"[axonmpi] rank {rank}: {name} arrived before axonmpi.init(); kept: the first "
                "PreemptionHandler's should_stop() returns True on every rank\n".encode())


def note_handler_made() -> None:
    """A PreemptionHandler was made (the SIGTERM grace of an earlier record no longer ends the rank)."""
    global _handlers_made
    _handlers_made += 1


def claim_early(signals) -> Optional[tuple]:
    """The recorded early signal ``(signum, monotonic time)``, once, for the first handler that catches it."""
    global _early
    e = _early
    if e is not None and e[0] in signals:
        _early = None
        return e
    return None
