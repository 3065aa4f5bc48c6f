"""The always-on watchdog and flight recorder: every MPI wait has a deadline, every call is recorded.

[Note: how a hang is explained]
Each group's MPI backend talks through a :class:`WatchedComm`: blocking MPI calls become their
non-blocking twins plus :meth:`Watchdog.wait`, which tests the request in a tight loop for
``SPIN_S`` (20 ms; the fast path: a non-blocking call plus ``Test`` is as fast as the blocking call),
then sleeps between bursts of tests (0.2 ms) with a growing pause (up to 1 ms), so a rank waiting for a late
peer uses little CPU. Each call is first written to the per-rank ring buffer (the flight
recorder): per-group sequence number, op, group, element count, dtype, bytes, start and end
time, and the user's file:line. When a wait passes its deadline (``AXONMPI_TIMEOUT``, default
600 s, or ``init(timeout=)``), the rank asks every other rank for its state over a
communicator duplicated for the watchdog alone (a wedged group cannot block it). A listener
thread on each rank answers (its calls in flight and its last completed call per group) and
writes its flight record; the asking rank names the ranks that are behind, at which call of
which group, their last completed call and its file:line, in one paragraph, writes its own
record and ends the job (``MPI_Abort``, exit 1). When several ranks time out together, the
lowest one reports and the others wait for its abort.

A rank whose Python process ends (end of script, ``sys.exit``) announces it on the watchdog
communicator and waits for the others in a barrier that answers questions. A rank waiting on
a call that an exited rank never made reports at once instead of after the deadline.
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from mpi4py import MPI

from .. import trace as _trace

__all__ = ["Watchdog", "WatchedComm", "CALL_FIELDS", "call_site", "dump_flight_record"]

SPIN_S = 20e-3         # test in a tight loop this long before sleeping between tests
BURST_S = 2e-4         # after each pause, test this long (multi-round collectives progress only in tests)
MAX_SLEEP_S = 1e-3     # the longest pause between two tests of a pending request
LISTEN_S = 0.02        # how often the listener thread looks for questions
ANSWER_S = 2.0         # how long the reporting rank waits for the others' answers
EXIT_GRACE_S = 1.0     # a call involving an exited rank gets this long to complete anyway
_ASK, _STATE, _EXIT = 1, 2, 3

# one flight-recorder entry is a list: these are its fields, in order
CALL_FIELDS = ("seq", "op", "group", "ranks", "count", "dtype", "bytes", "peer", "t_start", "t_end",
               "file", "line")
_SEQ, _OP, _GROUP, _RANKS, _COUNT, _DTYPE, _BYTES, _PEER, _T0, _T1, _FILE, _LINE = range(12)

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../axonmpi
_clock = time.perf_counter


def call_site(depth: int = 2):
    """(file, line) of the first frame outside the axonmpi package, ``depth`` frames up or more."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_PKG):
        f = f.f_back
    if f is None:
        return "?", 0
    return f.f_code.co_filename, f.f_lineno


def _where(e) -> str:
    return f"{os.path.basename(e[_FILE])}:{e[_LINE]}"


def _desc(e, now: float) -> str:
    peer = f" with group rank {e[_PEER]}" if e[_PEER] is not None else ""
    return f"{e[_OP]} #{e[_SEQ]} on {e[_GROUP]}{peer} at {_where(e)}"


class Watchdog:
    """Deadline, backoff and root-cause report for one World's MPI waits; the flight recorder.

    Made by :class:`~axonmpi.distributed.World` (one per World); its communicator is a
    duplicate of the World's, used for nothing else.

    Attributes:
        timeout: seconds a wait may last before the job is ended with a report.
        capacity: entries kept in the ring buffer (``AXONMPI_FLIGHT_RECORDER_SIZE``).
        dump_dir: where flight records are written on expiry (``AXONMPI_FLIGHT_DIR``).
    """

    def __init__(self, comm, *, timeout: float, capacity: int, dump_dir: str):
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = float(timeout)
        self.capacity = int(capacity)
        self.dump_dir = dump_dir
        self.ring: List[Optional[list]] = [None] * self.capacity
        self.pos = 0
        self.exited: Dict[int, Dict[Any, int]] = {}   # world rank -> {group key: its last seq}
        self.reporter: Optional[int] = None            # the lowest rank reporting a hang, if any
        self._answers: Dict[int, Any] = {}
        self._last: Dict[Any, int] = {}                # group key -> last seq started here
        self._sends: List[Any] = []
        self._stop = threading.Event()
        self._exit_notices = 0
        self._closed = False
        self._thread = None
        if self.size > 1:
            self._thread = threading.Thread(target=self._listen, name="axonmpi-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self._at_exit)

    # -- recording (hot path) ---------------------------------------------------------------
    def record(self, op: str, group, seq: int, count: int, dtype, nbytes: int, peer=None) -> list:
        """Append a call to the ring buffer and return its entry (``t_end`` set when it completes)."""
        f = sys._getframe(2)
        while f.f_code.co_filename.startswith(_PKG):
            f = f.f_back
            if f is None:
                break
        e = [seq, op, group.name, group.ranks, count, dtype, nbytes, peer, _clock(), None,
             f.f_code.co_filename if f is not None else "?", f.f_lineno if f is not None else 0]
        i = self.pos
        self.ring[i % self.capacity] = e
        tr = _trace._ACTIVE
        if tr is not None:
            tr.calls.append(e)
        self.pos = i + 1
        return e

    def entries(self) -> List[list]:
        """The recorded calls, oldest first."""
        n, cap = self.pos, self.capacity
        if n <= cap:
            return list(self.ring[:n])
        k = n % cap
        return self.ring[k:] + self.ring[:k]

    # -- waiting ---------------------------------------------------------------------------------
    def wait(self, req, e) -> None:
        """Wait for ``req`` (entry ``e``): spin briefly, then back off; report and end the job at the deadline."""
        if req.Test():
            e[_T1] = _clock()
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
            if now > deadline:
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
        e[_T1] = _clock()

    def _blocked_by_exit(self, e) -> bool:
        """True when a rank this call needs has exited without making it."""
        key = (e[_GROUP], e[_RANKS])
        for r, last in self.exited.items():
            if r not in e[_RANKS]:
                continue
            if e[_PEER] is not None or last.get(key, -1) < e[_SEQ]:
                return True
        return False

    # -- the report ---------------------------------------------------------------------------------
    def state(self) -> dict:
        """This rank's calls in flight and last completed call per group (what a report needs)."""
        now = _clock()
        flight, last = [], {}
        for e in self.entries():
            if e[_T1] is None:
                flight.append(list(e))
            else:
                last[(e[_GROUP], e[_RANKS])] = list(e)
        for e in flight + list(last.values()):
            e[_T0] = now - e[_T0]                        # seconds ago (clocks differ between ranks)
            e[_T1] = None if e[_T1] is None else now - e[_T1]
        return {"rank": self.rank, "flight": flight, "last": last, "exiting": self.rank in self.exited}

    def expire(self, e, waited: float) -> None:
        """Ask every rank for its state, print one root-cause paragraph, write flight records, abort."""
        path = self.dump()
        # ranks waiting on one call time out together: the lowest asks first, the others see its
        # question during their pause and leave the report to it
        time.sleep(0.3 * min(self.rank, 10))
        if self.reporter is not None and self.reporter < self.rank:
            time.sleep(ANSWER_S + 10)                # the reporting rank aborts the job meanwhile
        if self.reporter is None or self.reporter > self.rank:
            self.reporter = self.rank
        msg = pickle.dumps(("ask", self.rank))
        for r in range(self.size):
            if r != self.rank:
                self._sends.append(self.comm.Isend([msg, MPI.BYTE], dest=r, tag=_ASK))
        end = time.monotonic() + ANSWER_S
        while len(self._answers) < self.size - 1 and time.monotonic() < end:
            time.sleep(0.01)
        if self.reporter is not None and self.reporter < self.rank:
            time.sleep(ANSWER_S + 5)                 # a lower rank reports and aborts the job
        text = self.explain(e, waited, dict(self._answers), path)
        sys.stdout.flush()
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        time.sleep(0.3)                              # let the launcher forward the report
        MPI.COMM_WORLD.Abort(1)

    def explain(self, e, waited: float, answers: Dict[int, Any], path: str) -> str:
        """The root-cause paragraph for a wait on entry ``e`` that lasted ``waited`` seconds."""
        key = (e[_GROUP], e[_RANKS])
        ranks = list(e[_RANKS])
        what = _desc(e, 0)
        if e[_PEER] is not None:
            others = [ranks[e[_PEER]]]
        else:
            others = [r for r in ranks if r != self.rank]
        behind, arrived, silent = [], [self.rank], []
        for r in others:
            st = answers.get(r)
            if st is None:
                silent.append(r)
                continue
            mine = [f for f in st["flight"] if (f[_GROUP], f[_RANKS]) == key and f[_SEQ] == e[_SEQ]]
            last = st["last"].get(key)
            if e[_PEER] is None and (mine or (last is not None and last[_SEQ] >= e[_SEQ])):
                arrived.append(r)
                continue
            done = (f"its last completed call on {e[_GROUP]} was {_desc(last, 0)} ({last[_T1]:.1f} s ago)"
                    if last is not None else f"it has completed no call on {e[_GROUP]}")
            if st["exiting"]:
                now = "it has exited (its script ended or called sys.exit) and waits in the exit barrier"
            elif st["flight"]:
                now = "it is waiting in " + "; ".join(f"{_desc(f, 0)} (for {f[_T0]:.1f} s)" for f in st["flight"])
            else:
                now = "it is in no axonmpi call (computing, or stuck in user code)"
            behind.append(f"rank {r}: {done}; {now}")
        head = (f"[axonmpi] watchdog: rank {self.rank} waited {waited:.1f} s (AXONMPI_TIMEOUT={self.timeout:g}) "
                f"in {what} (group ranks {ranks}).")
        parts = [head]
        if behind:
            parts.append("Behind: " + " | ".join(behind) + ".")
        if silent:
            parts.append(f"Ranks {silent} did not answer within {ANSWER_S:g} s (dead, or their process is wedged).")
        if e[_PEER] is None and len(arrived) > 1:
            parts.append(f"Ranks {sorted(arrived)} reached call #{e[_SEQ]} on {e[_GROUP]}.")
        parts.append(f"Flight records: {path} (axonmpi trace analyze {os.path.dirname(path)}). "
                     "Ending the job (exit 1).")
        return " ".join(parts)

    def dump(self, path: Optional[str] = None) -> str:
        """Write this rank's flight record (JSON) and return its path."""
        if path is None:
            path = os.path.abspath(os.path.join(self.dump_dir, f"flight_rank{self.rank}.json"))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        now = _clock()
        calls = []
        for e in self.entries():
            d = dict(zip(CALL_FIELDS, e))
            d["ranks"] = list(d["ranks"])
            d["dtype"] = str(d["dtype"])
            d["t_start"] = d["t_start"] - now
            d["t_end"] = None if d["t_end"] is None else d["t_end"] - now
            calls.append(d)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:     # renamed when complete: an abort never leaves half a file
            json.dump({"rank": self.rank, "world_size": self.size, "clock": "seconds before the dump",
                       "dumped_at": time.time(), "calls": calls}, f)
        os.replace(tmp, path)
        return path

    # -- the listener thread --------------------------------------------------------------------------
    def _listen(self) -> None:
        status = MPI.Status()
        while True:
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
                buf = bytearray(status.Get_count(MPI.BYTE))
                src, tag = status.Get_source(), status.Get_tag()
                self.comm.Recv([buf, MPI.BYTE], source=src, tag=tag)
                self._handle(src, tag, pickle.loads(bytes(buf)))
            if self._stop.wait(LISTEN_S) and self._exit_notices >= self._expected_notices:
                return

    _expected_notices = 0

    def _handle(self, src: int, tag: int, msg) -> None:
        if tag == _ASK:
            first = self.reporter is None
            if first or src < self.reporter:
                self.reporter = src
            if first:
                try:
                    self.dump()
                except OSError:
                    pass
            out = pickle.dumps(self.state())
            self._sends.append(self.comm.Isend([out, MPI.BYTE], dest=src, tag=_STATE))
        elif tag == _STATE:
            self._answers[src] = msg
        elif tag == _EXIT:
            self.exited[src] = msg
            self._exit_notices += 1

    # -- lifecycle ---------------------------------------------------------------------------------
    def _at_exit(self) -> None:
        """Tell the others this rank has ended, wait for all (answering questions), stop the listener."""
        if self._closed:
            return
        last = {}
        for e in self.entries():
            last[(e[_GROUP], e[_RANKS])] = e[_SEQ]
        self.exited[self.rank] = last
        msg = pickle.dumps(last)
        for r in range(self.size):
            if r != self.rank:
                self._sends.append(self.comm.Isend([msg, MPI.BYTE], dest=r, tag=_EXIT))
        self._expected_notices = self.size - 1
        self._finish()

    def close(self) -> None:
        """Stop the listener and free the communicator (collective: ``World.destroy``)."""
        if self._closed or self._thread is None:
            self._closed = True
            return
        self._finish()

    def _finish(self) -> None:
        req = self.comm.Ibarrier()
        pause = 1e-4
        while not req.Test():
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        self._stop.set()
        self._thread.join()
        MPI.Request.Waitall(self._sends)
        self._sends.clear()
        self._closed = True
        try:
            atexit.unregister(self._at_exit)
            self.comm.Free()
        except Exception:
            pass


def dump_flight_record(path: Optional[str] = None) -> str:
    """Write this rank's flight record now (JSON; default ``AXONMPI_FLIGHT_DIR/flight_rank<r>.json``)."""
    from .world import get_world
    wd = get_world().watchdog
    if wd is None:
        raise RuntimeError("the flight recorder is off (AXONMPI_FLIGHT_RECORDER=0); nothing to dump")
    return wd.dump(path)


class _Watched:
    """A request whose ``Wait()`` has the watchdog's deadline and records completion."""

    __slots__ = ("req", "wd", "e")

    def __init__(self, req, wd, e):
        self.req, self.wd, self.e = req, wd, e

    def Wait(self):  # noqa: N802 - mpi4py's request protocol
        if self.e[_T1] is None:
            self.wd.wait(self.req, self.e)

    def Test(self) -> bool:  # noqa: N802
        if self.e[_T1] is not None:
            return True
        if self.req.Test():
            self.e[_T1] = _clock()
            return True
        return False


def _n(buf):
    """(count, dtype, bytes) of a buffer spec: an array, ``[array, (counts, displs)]``, IN_PLACE or None."""
    if isinstance(buf, list):
        buf = buf[0]
    if buf is None or buf is MPI.IN_PLACE:
        return 0, None, 0
    return buf.size, buf.dtype, buf.nbytes


class WatchedComm:
    """The slice of an mpi4py communicator the MPI backend uses, with deadlines and recording.

    Blocking calls run as their non-blocking twin plus :meth:`Watchdog.wait`; non-blocking
    calls return a request whose ``Wait()`` is watched. Object collectives first pass a
    watched ``Ibarrier`` (every rank has arrived), then run as usual.
    """

    def __init__(self, group, wd: Watchdog):
        self.group, self.wd, self.raw = group, wd, group.comm
        self.seq = 0

    def Get_attr(self, key):  # noqa: N802
        return self.raw.Get_attr(key)

    def _start(self, op, buf, peer=None):
        s = self.seq
        self.seq = s + 1
        c, d, b = _n(buf)
        return self.wd.record(op, self.group, s, c, d, b, peer)

    # reductions
    def Allreduce(self, s, r, op):  # noqa: N802
        e = self._start("all_reduce", r)
        self.wd.wait(self.raw.Iallreduce(s, r, op), e)

    def Iallreduce(self, s, r, op):  # noqa: N802
        e = self._start("all_reduce", r)
        return _Watched(self.raw.Iallreduce(s, r, op), self.wd, e)

    def Reduce(self, s, r, op, root):  # noqa: N802
        e = self._start("reduce", s if s is not MPI.IN_PLACE else r)
        self.wd.wait(self.raw.Ireduce(s, r, op, root=root), e)

    def Reduce_scatter_block(self, s, r, op):  # noqa: N802
        e = self._start("reduce_scatter", s)
        self.wd.wait(self.raw.Ireduce_scatter_block(s, r, op), e)

    def Ireduce_scatter_block(self, s, r, op):  # noqa: N802
        e = self._start("reduce_scatter", s)
        return _Watched(self.raw.Ireduce_scatter_block(s, r, op), self.wd, e)

    def Reduce_scatter(self, s, r, counts, op):  # noqa: N802
        e = self._start("reduce_scatter", s)
        self.wd.wait(self.raw.Ireduce_scatter(s, r, counts, op), e)

    def Ireduce_scatter(self, s, r, counts, op):  # noqa: N802
        e = self._start("reduce_scatter", s)
        return _Watched(self.raw.Ireduce_scatter(s, r, counts, op), self.wd, e)

    # data movement
    def Bcast(self, buf, root):  # noqa: N802
        e = self._start("broadcast", buf)
        self.wd.wait(self.raw.Ibcast(buf, root=root), e)

    def Allgather(self, s, r):  # noqa: N802
        e = self._start("all_gather", r)
        self.wd.wait(self.raw.Iallgather(s, r), e)

    def Iallgather(self, s, r):  # noqa: N802
        e = self._start("all_gather", r)
        return _Watched(self.raw.Iallgather(s, r), self.wd, e)

    def Allgatherv(self, s, r):  # noqa: N802
        e = self._start("all_gather", r)
        self.wd.wait(self.raw.Iallgatherv(s, r), e)

    def Gatherv(self, s, r, root):  # noqa: N802
        e = self._start("gather", s)
        self.wd.wait(self.raw.Igatherv(s, r, root=root), e)

    def Scatterv(self, s, r, root):  # noqa: N802
        e = self._start("scatter", r)
        self.wd.wait(self.raw.Iscatterv(s, r, root=root), e)

    def Alltoallv(self, s, r):  # noqa: N802
        e = self._start("all_to_all", s)
        self.wd.wait(self.raw.Ialltoallv(s, r), e)

    def Barrier(self):  # noqa: N802
        e = self._start("barrier", None)
        self.wd.wait(self.raw.Ibarrier(), e)

    # point-to-point (sequence numbers count this rank's calls on the group; they need not match)
    def Send(self, buf, dest, tag):  # noqa: N802
        e = self._start("send", buf, dest)
        self.wd.wait(self.raw.Isend(buf, dest=dest, tag=tag), e)

    def Recv(self, buf, source, tag):  # noqa: N802
        e = self._start("recv", buf, source)
        self.wd.wait(self.raw.Irecv(buf, source=source, tag=tag), e)

    def Isend(self, buf, dest, tag):  # noqa: N802
        e = self._start("send", buf, dest)
        return _Watched(self.raw.Isend(buf, dest=dest, tag=tag), self.wd, e)

    def Irecv(self, buf, source, tag):  # noqa: N802
        e = self._start("recv", buf, source)
        return _Watched(self.raw.Irecv(buf, source=source, tag=tag), self.wd, e)

    # picklable objects: a watched barrier first, so the blocking call below finds every rank there
    def _arrive(self, op):
        e = self._start(op, None)
        self.wd.wait(self.raw.Ibarrier(), e)

    def bcast(self, obj, root):
        self._arrive("broadcast_object")
        return self.raw.bcast(obj, root=root)

    def allgather(self, obj):
        self._arrive("all_gather_object")
        return self.raw.allgather(obj)

    def gather(self, obj, root):
        self._arrive("gather_object")
        return self.raw.gather(obj, root=root)

    def alltoall(self, objs):
        self._arrive("all_to_all_object")
        return self.raw.alltoall(objs)
