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

Signals that arrive before the handler exists (during start-up, a long load) are recorded by
:mod:`axonmpi.distributed.signals` (from ``import axonmpi`` under a launcher, and from ``init``); the
first ``PreemptionHandler`` made takes the record over (see the note there).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Dict, Optional, Sequence, NoReturn

import numpy as np

from ..distributed.signals import DEFAULT_SIGNALS as _DEFAULT_SIGNALS
from ..distributed.signals import claim_early, note_handler_made, record_early_signals, signal_number

__all__ = ["PreemptionHandler", "PREEMPTED_EXIT_CODE", "record_early_signals"]

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "temporary failure, the user is invited to retry"


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
        self.signals = tuple(signal_number(s) for s in signals)
        if not self.signals:
            raise ValueError("PreemptionHandler needs at least one signal to catch, got none")
        self.received: Optional[int] = None     # the first signal this rank received
        self.received_at: Optional[float] = None
        self.stopped_at: Optional[float] = None  # when should_stop() first returned True
        self._flag = np.zeros(1, np.int8)
        self._previous: Dict[int, object] = {}
        note_handler_made()
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        early = claim_early(self.signals)   # arrived after init, before this handler existed
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
