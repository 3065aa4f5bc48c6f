"""The always-on watchdog and flight recorder: every MPI wait has a deadline, every call is recorded.

One topic per module (each starts with the Note that explains it):

- ``monitor.py``: :class:`Watchdog`, the monitor thread that holds each wait's deadline and answers the
  other ranks' questions ([Note: how a hang is explained]).
- ``comm.py`` and ``wrappers.py``: :class:`WatchedComm` / :class:`PolledComm`, the group communicator the
  MPI backend talks through; its calls are generated from one table ([Note: why the wrapper bodies are
  generated]).
- ``check.py``: the always-on collective check ([Note: the always-on collective check]).
- ``diagnosis.py``: the questions a blocked call asks, and the cause read in the answers.
- ``report.py``: this rank's state, the hang paragraph, flight-record files, MPI's fatal exits.
- ``handshake.py``: the exit handshake ([Note: point-to-point accounting]).
- ``record.py``: the flight recorder's entry layout, call sites, call signatures.
- Long phases (a checkpoint save) that move deadlines: :mod:`axonmpi.distributed.phases`.

``AXONMPI_WATCHDOG=0`` turns off the deadlines (no monitor thread, no exit announcements);
``AXONMPI_FLIGHT_RECORDER=0`` turns off the call-site capture and the flight-record files (the
watchdog then keeps a short ring for its deadlines and reports without file:line). Both off:
plain mpi4py calls.
"""
from .comm import PolledComm, WatchedComm
from .monitor import Watchdog
from .record import (_ASK, _EXIT, _PEEK, _PEEKED, _STATE, ANSWER_S, BURST_S, CALL_FIELDS,  # noqa: F401
                     EXIT_GRACE_S, LISTEN_S, MAX_SLEEP_S, PEEK_MAX_S, PEEK_S, QUIET_S, SPIN_S, call_site, sig_text)
from .report import dump_flight_record

__all__ = ["Watchdog", "WatchedComm", "PolledComm", "CALL_FIELDS", "call_site", "dump_flight_record", "sig_text"]
