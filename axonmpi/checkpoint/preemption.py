"""PreemptionHandler: catch SIGTERM/SIGUSR1, agree at a step boundary, save, exit with a requeue code.

[Note: preemption protocol]
A signal handler only sets a flag: MPI calls, file writes and logging are not safe inside a
Python signal handler, and the ranks may receive the signal at different times (Slurm signals
the batch shell, the shell forwards it to ``srun``, ``srun`` to every task) or only some of them
(``kill -TERM`` of one rank by hand). At every step boundary :meth:`PreemptionHandler.should_stop`
all-reduces one int8 (MAX) over the group: the ranks stop at the same step, at most one step after
the first rank was signalled. The training loop then saves and calls :meth:`PreemptionHandler.exit`,
which raises ``SystemExit(PREEMPTED_EXIT_CODE)`` on every rank; the job templates requeue the job on
that code (``jobs/requeue.sh``, docs/cluster.md "Preemption and requeue").

[Note: signals before the handler]
Slurm's warning (``--signal=USR1@120``) or a SIGTERM may arrive during start-up or a long checkpoint
load, before the script makes its ``PreemptionHandler``. MPICH installs a C-level SIGUSR1 handler at
``MPI_Init``, so without a Python handler the signal was swallowed and the run went on to its time
limit. :func:`axonmpi.init` therefore calls :func:`record_early_signals` right after MPI is up: a
Python handler that only records the first SIGTERM/SIGUSR1 (where no Python handler is installed
yet). The first ``PreemptionHandler`` made takes the record over, and its first ``should_stop()``
returns True on every rank. A recorded SIGTERM that no handler claims within
``AXONMPI_EARLY_SIGNAL_GRACE`` seconds (default 30, Slurm's default ``KillWait``) ends the rank as
SIGTERM would have (exit 143, one line saying why): a script that never makes a handler still
stops on SIGTERM.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Dict, Optional, Sequence, NoReturn

import numpy as np

__all__ = ["PreemptionHandler", "PREEMPTED_EXIT_CODE", "record_early_signals"]

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "temporary failure, the user is invited to retry"

_DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


def _signal_number(s: "int | str") -> int:
    if isinstance(s, str):
        name = s.upper() if s.upper().startswith("SIG") else "SIG" + s.upper()
        if not hasattr(signal, name):
            raise ValueError(f"unknown signal {s!r}; expected a name such as 'SIGTERM' or 'USR1', or a number")
        return int(getattr(signal, name))
    return int(s)


# the first signal recorded before any PreemptionHandler existed: (signum, monotonic time) or None
_early: Optional[tuple] = None
_early_installed: Dict[int, object] = {}   # signum -> the handler record_early_signals replaced
_handlers_made = 0


def _on_early_signal(signum, frame) -> None:
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


def record_early_signals(signals: Sequence["int | str"] = _DEFAULT_SIGNALS) -> None:
    """Record SIGTERM/SIGUSR1 that arrive before a :class:`PreemptionHandler` exists (called by ``init``).

    Only where no Python handler is installed (the default action, or MPICH's C-level handler);
    a handler the script installed itself is left alone. Main thread only (else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in signals:
        n = _signal_number(s)
        if n in _early_installed:
            continue
        prev = signal.getsignal(n)
        if prev is None or prev is signal.SIG_DFL:
            _early_installed[n] = signal.signal(n, _on_early_signal)


def _claim_early(signals) -> Optional[tuple]:
    """The recorded early signal, once, for the first handler that catches it."""
    global _early
    e = _early
    if e is not None and e[0] in signals:
        _early = None
        return e
    return None


class PreemptionHandler:
    """Turn SIGTERM/SIGUSR1 into a save at the next step boundary agreed by every rank of ``group``.

    Install it (in the main thread) before the training loop; call :meth:`should_stop` once per step
    on every rank (collective: one all-reduce of one byte); when it returns True, save and call
    :meth:`exit`. Previous handlers are restored by :meth:`close` (or leaving the ``with`` block).
    A second signal while a save is pending is logged and otherwise ignored: the save goes on
    (Slurm sends SIGKILL ``KillWait`` seconds after SIGTERM anyway).

    Args:
        signals: the signals to catch (names or numbers; default SIGTERM and SIGUSR1).
        group: the process group that agrees (default: all ranks).

    Example:
        >>> with PreemptionHandler() as pre:
        ...     for step in range(start, steps):
        ...         train_step()
        ...         if pre.should_stop():
        ...             mgr.save(step + 1, training_state(model, opt, step=step + 1))
        ...             pre.exit(f"saved step {step + 1}")
    """

    def __init__(self, signals: Sequence["int | str"] = _DEFAULT_SIGNALS, *, group=None):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler must be made in the main thread (Python runs signal handlers there)")
        self.group = group
        self.signals = tuple(_signal_number(s) for s in signals)
        if not self.signals:
            raise ValueError("PreemptionHandler needs at least one signal to catch, got none")
        self.received: Optional[int] = None     # the first signal this rank received
        self.received_at: Optional[float] = None
        self.stopped_at: Optional[float] = None  # when should_stop() first returned True
        self._flag = np.zeros(1, np.int8)
        self._previous: Dict[int, object] = {}
        global _handlers_made
        _handlers_made += 1
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        early = _claim_early(self.signals)   # arrived after init, before this handler existed
        if early is not None:
            self.received, self.received_at = early

    def _on_signal(self, signum, frame) -> None:
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
        else:   # a handler must stay tiny; a write to stderr is safe enough and says why nothing died
            os.write(2, f"axonmpi: {signal.Signals(signum).name} again: the preemption save is already "
                        "pending\n".encode())

    @property
    def signal_name(self) -> Optional[str]:
        """The name of the first signal received on this rank (None: none)."""
        return None if self.received is None else signal.Signals(self.received).name

    def should_stop(self) -> bool:
        """True on every rank of the group when any rank has received a signal (collective, every step)."""
        from ..distributed import all_reduce, resolve_group
        g = resolve_group(self.group)
        self._flag[0] = 1 if self.received is not None else 0
        if g.size > 1:
            stop = bool(all_reduce(self._flag, op="max", group=g)[0])
        else:
            stop = bool(self._flag[0])
        if stop and self.stopped_at is None:
            self.stopped_at = time.monotonic()
        return stop

    def exit(self, message: str = "") -> "NoReturn":  # noqa: F821
        """Log ``message`` on group rank 0 and end this rank with :data:`PREEMPTED_EXIT_CODE` (every rank calls it)."""
        from ..distributed import barrier, resolve_group
        from ..log import get_logger
        g = resolve_group(self.group)
        if g.size > 1:
            barrier(group=g)   # nobody leaves before every rank has finished its part of the save
        what = self.signal_name or "a signal on another rank"
        get_logger(__name__, rank0_only=True).warning(
            "preempted (%s): %sexiting with code %d so that the job is requeued", what,
            f"{message}; " if message else "", PREEMPTED_EXIT_CODE)
        self.close()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def close(self) -> None:
        """Restore the signal handlers that were installed before (idempotent)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def __enter__(self) -> "PreemptionHandler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        names = ", ".join(signal.Signals(s).name for s in self.signals)
        return f"PreemptionHandler(signals=[{names}], received={self.signal_name})"
