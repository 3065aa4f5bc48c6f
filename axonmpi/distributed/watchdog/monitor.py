"""The watchdog's monitor: one thread per process holds every MPI wait's deadline and answers the other ranks.

[Note: how a hang is explained]
Each group's MPI backend talks through a :class:`WatchedComm`. On the fast path (MPI initialised
with ``THREAD_MULTIPLE``, the default of mpi4py) the main thread makes the ordinary blocking MPI
calls (and plain ``Wait`` on requests), as with the watchdog off; it only stamps each call into
the flight recorder first: a preallocated ring of ``AXONMPI_FLIGHT_RECORDER_SIZE`` (2000) slots
rewritten in place (per-group sequence number, op, group, element count, dtype, peer, start and
end time, and the user's call site, kept as code object and instruction offset and turned into
file:line only when a record is read), and marks it as the call in flight. One monitor thread
per process sleeps until the deadline of that call (``AXONMPI_TIMEOUT``, default 600 s, or
``init(timeout=)``), waking at most every ``LISTEN_S`` (0.1 s) to answer questions on the
watchdog's own communicator (a duplicate of the World's, used for nothing else, so a wedged
group cannot block it). PyTorch's NCCL watchdog has the same shape. Waits that must poll (DDP's
overlapped buckets test their requests during backward) call ``Test``: it never sleeps.

When a call overruns its deadline, the monitor asks every other rank for its state; each
monitor answers (its calls in flight and its last completed call per group) and writes its
flight record; the asking rank names the ranks that are behind, at which call of which group,
their last completed call and its file:line, in one paragraph, writes its own record and ends
the job (``MPI_Abort``, exit 1). When several ranks time out together, the lowest one reports
and the others wait for its abort.

Below ``THREAD_MULTIPLE`` (``MPI.Query_thread()``) a thread may not call MPI while the main
thread is inside a blocking call, so the watchdog falls back to polling (said once, at init):
blocking calls run as their non-blocking twin tested in a loop, spinning ``SPIN_S`` and then
sleeping between bursts of tests; ``AXONMPI_WATCHDOG_POLLING=1`` forces that mode.

A rank whose Python process ends (end of script, ``sys.exit``) announces it on the watchdog
communicator and waits for the others in a barrier that answers questions. A rank waiting on
a call that an exited rank never made reports within ``EXIT_GRACE_S`` instead of after the
"""
from __future__ import annotations

import atexit
import pickle
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from .. import phases as _phases
from .comm import PolledComm, WatchedComm
from .diagnosis import _Diagnosis
from .handshake import _Handshake
from .record import (_ASK, _BLK, _EXIT, _FINAL, _GROUP, _IDX, _OP, _PEEK, _PEEKED, _PEER, _RANKS, _SEQ, _STATE,
                     _T0, _T1, BURST_S, EXIT_GRACE_S, LISTEN_S, MAX_SLEEP_S, PEEK_S, SPIN_S, _clock, _public)
from .report import _Report, _name_fatal_mpi_errors

__all__ = ["Watchdog"]

_said_polling = False


class Watchdog(_Diagnosis, _Report, _Handshake):
    """Deadlines and root-cause report for one World's MPI waits; the flight recorder.

    Made by :class:`~axonmpi.distributed.World` (one per World) when ``AXONMPI_WATCHDOG`` or
    ``AXONMPI_FLIGHT_RECORDER`` is on; with deadlines, its communicator is a duplicate of the
    World's, used for nothing else.

    Attributes:
        timeout: seconds a wait may last before the job is ended with a report.
        capacity: entries kept in the ring buffer (``AXONMPI_FLIGHT_RECORDER_SIZE``).
        dump_dir: where flight records are written on expiry (``AXONMPI_FLIGHT_DIR``).
        watch: True when waits have deadlines (a monitor thread runs).
        record: True when the flight recorder is on (call sites, flight-record files).
        polling: True in the fallback mode below ``THREAD_MULTIPLE``.
    """

    def __init__(self, comm, *, timeout: float, capacity: int, dump_dir: str, watch: bool = True,
                 record: bool = True, polling: Optional[bool] = None, check: bool = True):
        global _said_polling
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.watch, self.record = bool(watch), bool(record)
        self.check = bool(check)       # the always-on collective check (groups made from now on)
        from ...env import get_float
        self.check_every = max(1, int(get_float("AXONMPI_CHECK_EVERY")))   # calls between two exchanges
        self._comms: List["WatchedComm"] = []   # every group's watched communicator (p2p counts)
        self._bad_exit: List[str] = []          # what makes this rank exit 1 at the end
        self.comm = comm.Dup() if self.watch else None
        self.timeout = float(timeout)
        self.capacity = int(capacity) if self.record else min(int(capacity), 64)
        self.dump_dir = dump_dir
        self.ring: List[list] = [[None] * 12 + [-1, False, -1, None, None] for _ in range(self.capacity)]
        self.pos = 0
        self.cur_wait = None   # (slot, call index, wait start) of a request being waited on, or None
        self.phases: list = []                 # this rank's known long phases (distributed/phases.py)
        self.deadlines: Dict[int, float] = {}  # call index -> its deadline, moved while a peer's phase progresses
        if polling is None:
            polling = MPI.Query_thread() < MPI.THREAD_MULTIPLE
        self.polling = bool(polling) and self.watch
        if self.polling and not _said_polling and self.rank == 0:
            _said_polling = True
            levels = {0: "SINGLE", 1: "FUNNELED", 2: "SERIALIZED", 3: "MULTIPLE"}
            sys.stderr.write(
                f"[axonmpi] watchdog: MPI thread level is {levels.get(MPI.Query_thread(), '?')} (below "
                "THREAD_MULTIPLE, or AXONMPI_WATCHDOG_POLLING=1): waits poll non-blocking calls instead of "
                "blocking in MPI, which costs time on large messages\n")
        self.exited: Dict[int, Dict[Any, int]] = {}   # world rank -> {group key: its last seq}
        self.reporter: Optional[int] = None            # the lowest rank reporting a hang, if any
        self._answers: Dict[int, Any] = {}
        self._peeked: Dict[int, Any] = {}      # world rank -> (round, state): answers to this rank's peeks
        self._peek_round = 0
        self._peek_at: Dict[int, list] = {}    # call index -> [next peek time, interval, round asked, asked at]
        self._cause: Optional[str] = None      # what a peek found (named in the hang report)
        self._sends: List[Any] = []
        self._count_lock = threading.Lock()
        self._nsent = np.zeros(self.size, np.int64)   # messages this rank's watchdog sent to each rank
        self._nrecv = np.zeros(self.size, np.int64)   # and received from each
        self._stop = threading.Event()
        self._exit_notices = 0
        self._closed = False
        self._expiring = False
        self._thread = None
        _name_fatal_mpi_errors(self)
        if self.watch and self.size > 1:
            self._thread = threading.Thread(target=self._monitor, name="axonmpi-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self._at_exit)

    def watched(self, group):
        """The communicator ``group``'s MPI backend uses: blocking calls with stamps, or polling."""
        return (PolledComm if self.polling else WatchedComm)(group, self)

    # -- recording --------------------------------------------------------------------------------
    def entries(self) -> List[list]:
        """The recorded calls, oldest first (copies, fields as :data:`CALL_FIELDS`)."""
        n, cap, ring = self.pos, self.capacity, self.ring
        return [_public(ring[i % cap]) for i in range(max(0, n - cap), n)]

    # -- waiting (polling mode) --------------------------------------------------------------------
    def wait(self, req, e) -> None:
        """Polling mode: wait for ``req`` (entry ``e``): spin briefly, then back off; report and end
        the job at the deadline."""
        if req.Test():
            return
        t0 = _clock()
        spin_until = t0 + SPIN_S
        deadline = t0 + self.timeout
        pause = 5e-5
        exit_seen = None
        while not req.Test():
            now = _clock()
            if now < spin_until:
                continue
            if ((now > deadline and _phases.late(self, e, e[_IDX], t0, now))
                    or (now - t0 > PEEK_S and self._peek(e, t0, now))):
                self.expire(e, now - t0)
            if self.exited:
                if exit_seen is None:
                    if self._blocked_by_exit(e):
                        exit_seen = now
                elif now - exit_seen > EXIT_GRACE_S:
                    self.expire(e, now - t0)
            time.sleep(pause)
            pause = min(pause * 2, MAX_SLEEP_S)
            spin_until = _clock() + BURST_S

    def _blocked_by_exit(self, e) -> bool:
        """True when a rank this call needs has exited without making it."""
        key = (e[_GROUP], e[_RANKS])
        final = e[_OP] == _FINAL        # every rank makes the last exchange after announcing its exit
        for r, last in self.exited.items():
            if r not in e[_RANKS]:
                continue
            if e[_PEER] is not None or last.get(key, -1) < e[_SEQ] - (1 if final else 0):
                return True
        return False

    # -- the monitor thread -------------------------------------------------------------------------
    def _in_flight(self):
        """(slot, start of the wait) of the calls the main thread is blocked in now."""
        out = []
        c = self.ring[(self.pos - 1) % self.capacity]   # the newest call: blocking and not done?
        if c[_BLK] and c[_T1] is None:
            out.append((c, c[_T0]))
        w = self.cur_wait
        if w is not None:
            out.append((w[0], w[2]))
        return out

    def _monitor(self) -> None:
        exit_seen: Dict[int, float] = {}
        while True:
            self._drain()
            if self._stop.is_set():
                if self._exit_notices >= self._expected_notices:
                    return
                time.sleep(1e-3)
                continue
            nap = LISTEN_S
            if not self.polling:
                now = _clock()
                for e, t0 in self._in_flight():
                    if _phases.late(self, e, e[_IDX], t0, now) or (now - t0 > PEEK_S and self._peek(e, t0, now)):
                        self.expire(e, now - t0)
                    nap = min(nap, max(t0 + self.timeout, self.deadlines.get(e[_IDX], 0.0)) - now)
                    if self.exited and self._blocked_by_exit(e):
                        seen = exit_seen.setdefault(e[_IDX], now)
                        if now - seen > EXIT_GRACE_S:
                            self.expire(e, now - t0)
                        nap = min(nap, seen + EXIT_GRACE_S - now + 1e-3)
            self._stop.wait(max(nap, 1e-3))

    _expected_notices = 0


    def _drain(self) -> None:
        """Receive and handle every message waiting on the watchdog communicator (thread-safe:
        matched probes, so the monitor and a polling main thread may both drain)."""
        status = MPI.Status()
        while True:
            m = self.comm.Improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            if m is None:
                return
            buf = bytearray(status.Get_count(MPI.BYTE))
            src, tag = status.Get_source(), status.Get_tag()
            m.Recv([buf, MPI.BYTE])
            with self._count_lock:
                self._nrecv[src] += 1
            self._handle(src, tag, pickle.loads(bytes(buf)))

    def _post(self, msg: bytes, dest: int, tag: int) -> None:
        """Send ``msg`` to world rank ``dest`` on the watchdog communicator (counted: see ``_quiesce``)."""
        with self._count_lock:
            self._nsent[dest] += 1
            self._sends.append(self.comm.Isend([msg, MPI.BYTE], dest=dest, tag=tag))
    def _nap(self, seconds: float) -> None:
        """Sleep ``seconds`` while answering questions."""
        end = time.monotonic() + seconds
        while True:
            self._drain()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.01, left))

    def _handle(self, src: int, tag: int, msg) -> None:
        if tag == _ASK:                # a rank is about to end the job with a report
            _phases.run_cleanups(self)
            first = self.reporter is None
            if first or src < self.reporter:
                self.reporter = src
            if first and self.record:
                try:
                    self.dump()
                except OSError:
                    pass
            out = pickle.dumps(self.state())
            self._post(out, src, _STATE)
        elif tag == _STATE:
            self._answers[src] = msg
        elif tag == _EXIT:
            self.exited[src] = msg
            self._exit_notices += 1
        elif tag == _PEEK:             # another rank's question while it waits: what is this rank doing?
            out = pickle.dumps((msg[1], self.state()))
            self._post(out, src, _PEEKED)
        elif tag == _PEEKED:
            self._peeked[src] = msg

