"""The always-on watchdog and flight recorder: every MPI wait has a deadline, every call is recorded.

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
deadline.

[Note: the always-on collective check]
Every collective through a :class:`WatchedComm` is also checked across its group, debug mode or not
(``AXONMPI_CHECK_COLLECTIVES=1``, the default). Each call's signature is ``(op code, wire dtype
number, shape, root, reduce op)``: the shape the caller passed (the collective notes it on the group,
``group._sig_shape``, when the backend gets a flat buffer; ``-1`` for the v-collectives, whose counts
differ by design). The check runs on the group's check communicator (a duplicate made with the
group, used for nothing else), so it covers the group too.

A per-call exchange costs a second small collective per call (about 8 us on a loop of one-element
all-reduces), so the check is batched: each call only appends ``(signature, ring entry)`` to the
group's window; every ``AXONMPI_CHECK_EVERY`` calls (64), at every barrier (an exchange point: the
window is compared before it returns) and at exit or ``free`` (the last exchange, after the exit is
announced), the window is hashed and a persistent non-blocking ``Allreduce(SUM)`` of five uint64 lanes
starts: two ``b``-bit hashes ``h1, h2`` of the window, their squares, and the window's all-to-all
balance. ``n * sum(h^2) == sum(h)^2`` holds only when all ``n`` hashes are equal, and with
``b = (63 - log2 n) / 2`` the sums are exact. The balance: for every count an ``Alltoallv`` sends,
the sender adds a 64-bit mix of (call, source, destination, count) and the receiver subtracts the mix
of the count it expects, so the group's sum is 0 (mod 2^64) only when every receiver expects what
its sender sends. Exchanges are verified in order at the next exchange (waiting for them before a
blocking call: they completed once every rank entered the window's calls; a rank must not block in a
later call while another raises for an earlier one), so a mismatch MPI completes without complaint is
raised within two windows; ``AXONMPI_CHECK_EVERY=1`` verifies each call's exchange before it returns.
A difference is seen at the same exchange on every rank; the ranks then send their windows to group
rank 0 point-to-point on the check communicator
(:func:`axonmpi.distributed.debug.name_window_mismatch`, debug mode's protocol), which names the
first call they disagree on, or the counts that do not match, and every rank raises
:class:`~axonmpi.distributed.debug.CollectiveMismatchError`.

Mismatches MPI cannot complete hang instead. A call blocked ``PEEK_S`` asks the ranks it waits for
(their monitors answer on the watchdog communicator, ``_PEEK``) for their state: the calls they are
blocked in, their last collectives per group with signatures, their last sends with tags. When two
questions in a row show the same cause (different collectives, roots or shapes at one call number,
two groups with the same members, a rank outside an API the others are in, a tag nobody sends, a
rank that finished without the call), the job ends at once with it (:meth:`Watchdog.cause`). An MPI
error in a collective asks the same question (:meth:`Watchdog.ask_about`) and becomes the mismatch
it shows, else :class:`~axonmpi.distributed.debug.CollectiveMPIError` naming the op, group and site.

[Note: point-to-point accounting]
Each :class:`WatchedComm` counts the sends it posts to and the receives it posts from each peer.
At exit (the watchdog's exit barrier, or ``World.destroy``) the ranks exchange the counts
(``Ialltoall`` on the watchdog communicator): a rank whose sends to a peer outnumber that peer's
receives from it names them and its last send's call site, and the job ends with exit 1 (from
``destroy()``: a ``RuntimeError`` on every rank). A send nobody receives is otherwise invisible:
small messages complete eagerly.

``AXONMPI_WATCHDOG=0`` turns off the deadlines (no monitor thread, no exit announcements);
``AXONMPI_FLIGHT_RECORDER=0`` turns off the call-site capture and the flight-record files (the
watchdog then keeps a short ring for its deadlines and reports without file:line). Both off:
plain mpi4py calls.
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

import numpy as np
from mpi4py import MPI

from .. import trace as _trace
from . import phases as _phases

__all__ = ["Watchdog", "WatchedComm", "PolledComm", "CALL_FIELDS", "call_site", "dump_flight_record"]

SPIN_S = 20e-3         # polling mode: test in a tight loop this long before sleeping between tests
BURST_S = 2e-4         # polling mode: after each pause, test this long
MAX_SLEEP_S = 1e-3     # polling mode: the longest pause between two tests of a pending request
LISTEN_S = 0.1         # the monitor looks for questions (and exited ranks) this often
ANSWER_S = 2.0         # how long the reporting rank waits for the others' answers
EXIT_GRACE_S = 1.0     # a call involving an exited rank gets this long to complete anyway
PEEK_S = 1.0           # a call blocked this long: ask the ranks it waits for what they are doing (then 2, 4, .. s)
QUIET_S = 5.0          # a peer that used the group this recently is still at work there (no tag verdict yet)
PEEK_MAX_S = 30.0      # the longest pause between two such questions about one call
_ASK, _STATE, _EXIT, _PEEK, _PEEKED = 1, 2, 3, 4, 5

# one flight-recorder entry is a list: these are its fields, in order (entries() gives them so;
# a ring slot has five more: its call index, whether the main thread blocks in it, the tag of a
# point-to-point call, the package function the user called (code object) and the call's signature
# (op code, dtype number, shape, root, reduce op); it keeps the call site as code object + offset)
CALL_FIELDS = ("seq", "op", "group", "ranks", "count", "dtype", "bytes", "peer", "t_start", "t_end",
               "file", "line")
(_SEQ, _OP, _GROUP, _RANKS, _COUNT, _DTYPE, _BYTES, _PEER, _T0, _T1, _FILE, _LINE, _IDX, _BLK, _TAG, _API,
 _SIG) = range(17)

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../axonmpi
_clock = time.perf_counter
_getframe = sys._getframe
_said_polling = False
_INSIDE: set = set()    # file names of frames inside the package (skipped when finding the call site)
_OUTSIDE: set = set()   # ... and outside it


def call_site(depth: int = 2):
    """(file, line) of the first frame outside the axonmpi package, ``depth`` frames up or more."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_PKG):
        f = f.f_back
    if f is None:
        return "?", 0
    return f.f_code.co_filename, f.f_lineno


def _line(code, lasti: int) -> int:
    """The source line of instruction offset ``lasti`` in ``code``."""
    for a, b, line in code.co_lines():
        if a <= lasti < b:
            return line if line is not None else code.co_firstlineno
    return code.co_firstlineno


def _public(e) -> list:
    """A ring slot as a 12-field entry (a copy): bytes computed, call site as file and line."""
    out = list(e[:12])
    if out[_BYTES] is None:
        d = out[_DTYPE]
        out[_BYTES] = out[_COUNT] * d.itemsize if d is not None else 0
    code = out[_FILE]
    if not isinstance(code, str):
        out[_FILE], out[_LINE] = code.co_filename, _line(code, out[_LINE])
    return out


_DIST = os.path.dirname(os.path.abspath(__file__))   # .../axonmpi/distributed


def _api_name(code) -> Optional[str]:
    """``CheckpointManager.save`` for the code object of the package function the user called (None for the
    collectives themselves: their op names them)."""
    if code is None or code.co_filename.startswith(_DIST):
        return None
    return getattr(code, "co_qualname", code.co_name)


def _full(e) -> list:
    """A ring slot as the 12 public fields, then (at the slot's indices) its call index, tag, API name and
    signature: what a peek sends."""
    return _public(e) + [e[_IDX], False, e[_TAG], _api_name(e[_API]), e[_SIG]]


def _where(e) -> str:
    return f"{os.path.basename(e[_FILE])}:{e[_LINE]}"


def _desc(e, now: float) -> str:
    peer = f" with group rank {e[_PEER]}" if e[_PEER] is not None else ""
    return f"{e[_OP]} #{e[_SEQ]} on {e[_GROUP]}{peer} at {_where(e)}"


def _call_text(f) -> str:
    """``all_reduce(shape=(4, 2), dtype=float64, op=SUM) call #3 at train.py:40 (in CheckpointManager.save)``."""
    sig = f[_SIG] if len(f) > _SIG else None
    what = sig_text(sig) if sig else f"{f[_OP]}(count={f[_COUNT]})"
    api = f[_API] if len(f) > _API and isinstance(f[_API], str) else None
    api = f" (in {api})" if api else ""
    return f"{what} call #{f[_SEQ]} at {_where(f)}{api}"


def _by_call(calls: Dict[int, list]) -> Dict[str, List[int]]:
    """``{call text: [world ranks]}`` for the ranks' calls (what each called, grouped)."""
    out: Dict[str, List[int]] = {}
    for r in sorted(calls):
        out.setdefault(_call_text(calls[r]), []).append(r)
    return out


class Watchdog:
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
        from ..env import get_float
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

    # -- naming the cause of a hang while it lasts (see the Note on the always-on check) ---------------
    def _peek(self, e, t0: float, now: float) -> bool:
        """For call ``e`` (blocked since ``t0``): ask the ranks it waits for what they are doing (after
        ``PEEK_S``, then at growing pauses); True once their answers show a cause (kept in ``_cause``):
        different collectives, roots, shapes or groups, a call they skipped, a tag nobody sends."""
        if self._cause is not None:
            return True
        if e[_T1] is not None:
            return False
        st = self._peek_at.get(e[_IDX])
        if st is None:
            if len(self._peek_at) > 64:
                self._peek_at.clear()
            st = self._peek_at[e[_IDX]] = [now, PEEK_S, -1, now, None]
        nxt, pause, asked, at = st[:4]
        if asked >= 0:              # a question is out: decide once every rank asked answered (or in time)
            want = self._peers(e)
            got = {r: a[1] for r, a in list(self._peeked.items()) if a[0] == asked and r in want}
            if len(got) < len(want) and now - at < ANSWER_S:
                return False
            st[2] = -1
            try:
                cause = self.cause(_full(e), got)
                # a cause must be seen by two questions in a row (a long transfer can look like a mismatch
                # for a moment: a broadcast's root already in its next call while the others still receive)
                seen, st[4] = (len(st) > 4 and st[4] == cause), cause
                if cause is not None and not seen:
                    st[0], st[1] = now + PEEK_S, pause
                    return False
            except Exception as err:      # a question must never end the monitor
                cause = None
                sys.stderr.write(f"[axonmpi] watchdog: rank {self.rank} could not read the other ranks' answers "
                                 f"({type(err).__name__}: {err})\n")
            if cause is not None:
                self._cause = cause
                return True
            st[0], st[1] = now + pause, min(pause * 2, PEEK_MAX_S)
            return False
        if now < nxt:
            return False
        self._peek_round += 1
        msg = pickle.dumps(("peek", self._peek_round))
        for r in self._peers(e):
            self._post(msg, r, _PEEK)
        st[2], st[3] = self._peek_round, now
        return False

    def _peers(self, e) -> List[int]:
        """World ranks whose state explains call ``e``: its peer, or the other members of its group."""
        ranks = list(e[_RANKS])
        if e[_PEER] is not None:
            return [ranks[e[_PEER]]]
        return [r for r in ranks if r != self.rank]

    def ask_about(self, e) -> Optional[str]:
        """Main thread, after an MPI error in collective ``e``: ask the group's ranks (their monitors answer)
        what they called as this call; the lines naming who called what, or None when nobody answered."""
        if self.comm is None:
            return None
        got = self._ask_states(self._peers(e))
        if not got:
            return None
        calls = self._calls_at(_full(e), got)
        return "\n".join(f"  world ranks {ranks} called {what}" for what, ranks in _by_call(calls).items())

    def _ask_states(self, want: List[int]) -> Dict[int, Any]:
        """Ask world ranks ``want`` for their state (their monitors answer); the answers within ``ANSWER_S``."""
        self._peek_round += 1
        rnd = self._peek_round
        msg = pickle.dumps(("peek", rnd))
        for r in want:
            self._post(msg, r, _PEEK)
        end = time.monotonic() + ANSWER_S
        while time.monotonic() < end:
            self._drain()
            if all(self._peeked.get(r, (None,))[0] == rnd for r in want):
                break
            time.sleep(0.005)
        return {r: a[1] for r, a in list(self._peeked.items()) if a[0] == rnd and r in want}

    def _calls_at(self, e, answers, seq: Optional[int] = None) -> Dict[int, list]:
        """Each rank's call number ``seq`` (default ``e``'s) on ``e``'s group, in flight or recent; this rank's too."""
        key = (e[_GROUP], e[_RANKS])
        seq = e[_SEQ] if seq is None else seq
        calls = {}
        for r, st in list(answers.items()) + [(self.rank, None)]:
            pool = [e] if st is None else []
            if st is None and seq != e[_SEQ]:
                mine = self.state()
                pool = mine["flight"] + mine["recent"].get(key, [])
            elif st is not None:
                pool = st["flight"] + st["recent"].get(key, [])
            for f in pool:
                if (f[_GROUP], f[_RANKS]) == key and f[_PEER] is None and f[_SEQ] == seq:
                    calls[r] = f
                    break
        return calls

    def cause(self, e, answers: Dict[int, Any]) -> Optional[str]:
        """The cause of the hang of call ``e`` (a full entry) that the other ranks' states show, or None."""
        key, ranks = (e[_GROUP], e[_RANKS]), tuple(e[_RANKS])
        if e[_PEER] is not None:
            return self._p2p_cause(e, answers)
        waiting = {self.rank: e}       # each rank's collective it is blocked in on this group
        others = []
        for r, st in answers.items():
            for f in st.get("blocked", []):
                if f[_PEER] is not None:
                    continue
                fk = (f[_GROUP], tuple(f[_RANKS]))
                if fk == key:
                    waiting[r] = f
                elif sorted(f[_RANKS]) == sorted(ranks):
                    others.append(f"world rank {r} waits in {_desc(f, 0)}: {f[_GROUP]} is a different group with the "
                                  f"same members {sorted(ranks)} as {e[_GROUP]}, where this rank waits ({_desc(e, 0)})")
        if others:
            return "; ".join(others) + "."
        done = sorted(r for r, f in waiting.items() if f[_OP] == _FINAL and f[_SEQ] <= e[_SEQ])
        waiting = {r: f for r, f in waiting.items() if f[_OP] != _FINAL or r == self.rank}
        if done and e[_OP] != _FINAL:
            return (f"world ranks {done} finished (their script ended or called sys.exit; they wait in the exit "
                    f"barrier) without making call #{e[_SEQ]} on {e[_GROUP]}, which this rank waits in "
                    f"({_call_text(e)}): they made fewer collectives on the group.")
        seq = min(f[_SEQ] for f in waiting.values())     # the first call the ranks may disagree on
        calls = self._calls_at(e, answers, seq)
        lines = _by_call(calls)
        if len(lines) > 1:
            sigs = {r: f[_SIG] for r, f in calls.items()}
            kinds = {s[0] for s in sigs.values() if s}
            what = "different collectives"
            if len(kinds) == 1:
                if len({s[3] for s in sigs.values()}) > 1:
                    what = "the same collective with different roots"
                elif len({tuple(s[2]) if isinstance(s[2], (tuple, list)) else s[2] for s in sigs.values()}) > 1:
                    what = "the same collective with different shapes"
                else:
                    what = "the same collective with different arguments"
            text = (f"ranks of {e[_GROUP]} called {what} as call #{seq}: "
                    + "; ".join(f"world ranks {rs} {w}" for w, rs in lines.items()) + ".")
            apis = {r: f[_API] for r, f in calls.items()}
            for a in sorted({x for x in apis.values() if x}):   # the API one side is in (save, ...)
                inside = sorted(r for r, x in apis.items() if x == a)
                outside = sorted(r for r in calls if apis[r] != a)
                if outside:
                    text += (f" World ranks {outside} are not in {a} (ranks {inside} are): a rank that skipped "
                             f"{a}, or called it elsewhere.")
                    break
            return text
        return None     # the same calls so far (ranks at later calls may still be finishing this one): not knowable

    def _p2p_cause(self, e, answers) -> Optional[str]:
        """A blocked send/receive: what its peer does with this rank (the tags it sends, or that it waits too)."""
        peer = e[_RANKS][e[_PEER]]
        st = answers.get(peer)
        if st is None:
            return None
        me_g = e[_RANKS].index(self.rank)
        key = (e[_GROUP], e[_RANKS])
        mine = f"{e[_OP]} {'from' if e[_OP] == 'recv' else 'to'} world rank {peer} with tag {e[_TAG]}"
        for f in st.get("blocked", []):
            if (f[_GROUP], f[_RANKS]) == key and f[_PEER] == me_g and f[_OP] != e[_OP] and f[_TAG] != e[_TAG]:
                return (f"world rank {peer} waits in {f[_OP]} with tag {f[_TAG]} at {_where(f)}; this rank waits in "
                        f"{mine} at {_where(e)}: the tags differ")
            if (f[_GROUP], f[_RANKS]) == key and f[_PEER] == me_g and f[_OP] == e[_OP]:
                return (f"world rank {peer} waits in {f[_OP]} {'from' if f[_OP] == 'recv' else 'to'} this rank too "
                        f"(tag {f[_TAG]} at {_where(f)}): each waits for the other")
        if e[_OP] == "recv":
            # a peer still busy on this group (a call finished or started on it within QUIET_S) may yet send the
            # tag: an interleaved pipeline sends its chunks' tags in turn, and a slow step (a first JIT compile)
            # must not read as a mismatch
            ages = [f[_T1] for k, f in st.get("last", {}).items() if k == key and f[_T1] is not None]
            ages += [f[_T0] for f in st.get("flight", []) if (f[_GROUP], f[_RANKS]) == key and f[_OP] != _FINAL]
            if ages and min(ages) < QUIET_S:
                return None
            sent = [f for f in st["sends"].get((e[_GROUP], e[_RANKS], self.rank), [])]
            tags = sorted({f[_TAG] for f in sent})
            if sent and e[_TAG] not in tags:
                return (f"world rank {peer} sent {len(sent)} message(s) to this rank on {e[_GROUP]} with tag(s) {tags} "
                        f"(the last at {_where(sent[-1])}) and none with tag {e[_TAG]}, which this rank waits for at "
                        f"{_where(e)}: a tag nobody sends")
        return None

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

    def _quiesce(self) -> None:
        """After every rank's monitor stopped: receive (and drop) the messages still addressed to this rank --
        a question or an answer sent after its monitor's last look -- then complete this rank's own sends.
        Without it a send nobody receives (a large answer goes by rendezvous) blocks its rank's exit for ever
        while the others wait in ``MPI_Finalize``."""
        theirs = np.zeros(self.size, np.int64)
        self.comm.Alltoall(self._nsent, theirs)       # theirs[q]: how many rank q sent to this rank
        status = MPI.Status()
        for q in range(self.size):
            for _ in range(int(theirs[q] - self._nrecv[q])):
                self.comm.Probe(source=q, tag=MPI.ANY_TAG, status=status)
                self.comm.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE], source=q, tag=status.Get_tag())
                self._nrecv[q] += 1
        MPI.Request.Waitall(self._sends)

    def _nap(self, seconds: float) -> None:
        """Sleep ``seconds`` while answering questions."""
        end = time.monotonic() + seconds
        while True:
            self._drain()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.01, left))

    # -- the report ---------------------------------------------------------------------------------
    def state(self) -> dict:
        """This rank's calls in flight, last completed call per group, the last collectives per group and
        the last sends to each peer (what a report, and a peek, needs); entries as :func:`_full` gives them."""
        now = _clock()
        flight, last, lastc, recent, sends = [], {}, {}, {}, {}
        n, cap, ring = self.pos, self.capacity, self.ring
        for i in range(max(0, n - cap), n):
            slot = ring[i % cap]
            if slot[_IDX] != i:
                continue
            e = _full(slot)
            key = (e[_GROUP], e[_RANKS])
            if e[_T1] is None:
                flight.append(e)
            else:
                last[key] = e
                if e[_PEER] is None and e[_OP] != _FINAL:
                    lastc[key] = e
            if e[_PEER] is None:
                recent.setdefault(key, []).append(e)
            elif e[_OP] == "send":
                sends.setdefault(key + (e[_RANKS][e[_PEER]],), []).append(e)
        recent = {k: v[-16:] for k, v in recent.items()}
        sends = {k: v[-8:] for k, v in sends.items()}
        for e in {id(x): x for x in flight + list(last.values()) + list(lastc.values())}.values():
            e[_T0] = now - e[_T0]                        # seconds ago (clocks differ between ranks)
            e[_T1] = None if e[_T1] is None else now - e[_T1]
        blocked = []                                   # the calls the main thread is blocked in (not merely posted)
        for slot, _ in self._in_flight():
            if slot[_T1] is None and all(b[_IDX] != slot[_IDX] for b in blocked):
                blocked.append(_full(slot))
        return {"rank": self.rank, "flight": flight, "blocked": blocked, "last": last, "lastc": lastc,
                "recent": recent, "sends": sends, "exiting": self.rank in self.exited,
                "phases": _phases.current_phases(self)}

    def expire(self, e, waited: float) -> None:
        """Ask every rank for its state, print one root-cause paragraph, write flight records, abort."""
        if self._expiring:
            return
        self._expiring = True
        e = _full(e)
        path = self.dump() if self.record else None
        # ranks waiting on one call time out together: the lowest asks first, the others see its
        # question during their pause and leave the report to it
        self._nap(0.3 * min(self.rank, 10))
        if self.reporter is not None and self.reporter < self.rank:
            self._nap(ANSWER_S + 10)                 # the reporting rank aborts the job meanwhile
        if self.reporter is None or self.reporter > self.rank:
            self.reporter = self.rank
        msg = pickle.dumps(("ask", self.rank))
        for r in range(self.size):
            if r != self.rank:
                self._post(msg, r, _ASK)
        end = time.monotonic() + ANSWER_S
        while len(self._answers) < self.size - 1 and time.monotonic() < end:
            self._nap(0.01)
        if self.reporter is not None and self.reporter < self.rank:
            self._nap(ANSWER_S + 5)                  # a lower rank reports and aborts the job
        text = self.explain(e, waited, dict(self._answers), path)
        _phases.run_cleanups(self)                   # a save's .tmp-* folder goes with the job
        sys.stdout.flush()
        _report_fatal(text)
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
        calls = {self.rank: e}
        for r in others:
            st = answers.get(r)
            if st is None:
                silent.append(r)
                continue
            mine = [f for f in st["flight"] if (f[_GROUP], f[_RANKS]) == key and f[_SEQ] == e[_SEQ]
                    and f[_PEER] is None and f[_OP] != _FINAL]
            last = st["last"].get(key)
            lastc = st.get("lastc", {}).get(key)
            if e[_PEER] is None and (mine or (lastc is not None and lastc[_SEQ] >= e[_SEQ])):
                arrived.append(r)
                if mine:
                    calls[r] = mine[0]
                continue
            done = (f"its last completed call on {e[_GROUP]} was {_desc(last, 0)} ({last[_T1]:.1f} s ago)"
                    if last is not None else f"it has completed no call on {e[_GROUP]}")
            if st["exiting"]:
                now = "it has exited (its script ended or called sys.exit) and waits in the exit barrier"
            elif st["flight"]:
                now = "it is waiting in " + "; ".join(f"{_desc(f, 0)} (for {f[_T0]:.1f} s)" for f in st["flight"])
            elif st.get("phases"):
                now = (f"it is {_phases.describe(st['phases'])}; if that phase is healthy but slow, "
                       f"{_phases.RAISE_DEADLINE}")
            else:
                now = ("it is in no axonmpi call (computing, or stuck in user code; a computation that is this long "
                       f"by design: {_phases.RAISE_DEADLINE})")
            behind.append(f"rank {r}: {done}; {now}")
        head = (f"[axonmpi] watchdog: rank {self.rank} waited {waited:.1f} s (AXONMPI_TIMEOUT={self.timeout:g}) "
                f"in {what} (group ranks {ranks})" + (f" while {_phases.describe(_phases.current_phases(self))}"
                                                     if self.phases else "") + ".")
        parts = [head]
        cause = self._cause
        if cause is None and len(e) > _SIG:
            try:
                cause = self.cause(e, {r: st for r, st in answers.items() if st is not None})
            except Exception:   # a report must never fail for want of a cause
                cause = None
        if cause is not None:
            parts.append("Cause: " + cause.rstrip(".") + ".")
        if behind:
            parts.append("Behind: " + " | ".join(behind) + ".")
        if silent:
            parts.append(f"Ranks {silent} did not answer within {ANSWER_S:g} s (dead, or their process is wedged).")
        if e[_PEER] is None and len(arrived) > 1:
            parts.append(f"Ranks {sorted(arrived)} reached call #{e[_SEQ]} on {e[_GROUP]}.")
            kinds = {}
            for r, f in sorted(calls.items()):
                dt = f" x {f[_DTYPE]}" if f[_DTYPE] is not None else ""
                kinds.setdefault(f"{f[_OP]}({f[_COUNT]}{dt}) at {_where(f)}", []).append(r)
            if len(kinds) > 1 and cause is None:
                parts.append("They called different collectives: " +
                             "; ".join(f"ranks {rs} {k}" for k, rs in kinds.items()) + ".")
        if path is None:
            parts.append("No flight records (AXONMPI_FLIGHT_RECORDER=0). Ending the job (exit 1).")
        else:
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
        n, cap = self.pos, self.capacity
        for i in range(max(0, n - cap), n):
            slot = self.ring[i % cap]
            e = _public(slot)
            d = dict(zip(CALL_FIELDS, e))
            d["ranks"] = list(d["ranks"])
            sig = slot[_SIG]
            if sig:                       # the call's signature: shape (collectives that compare it), root
                d["shape"] = list(sig[2]) if isinstance(sig[2], tuple) else None
                d["root"] = sig[3]
            d["tag"] = slot[_TAG]
            d["api"] = _api_name(slot[_API])
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

    # -- lifecycle ---------------------------------------------------------------------------------
    def _at_exit(self) -> None:
        """Tell the others this rank has ended, wait for all (answering questions), stop the listener."""
        if self._closed:
            return
        last = {}
        for e in self.entries():
            if e[_PEER] is None:
                last[(e[_GROUP], e[_RANKS])] = e[_SEQ]
        self.exited[self.rank] = last
        msg = pickle.dumps(last)
        for r in range(self.size):
            if r != self.rank:
                self._post(msg, r, _EXIT)
        self._expected_notices = self.size - 1
        self._settle_checks()          # after the announcement: a rank waiting for a call this one never made hears of it
        bad = self._finish()
        if bad:
            sys.stdout.flush()
            sys.stderr.write("".join(f"[axonmpi] {line}\n" for line in self._bad_exit) or
                             f"[axonmpi] rank {self.rank}: another rank found an error at exit (above); exiting 1\n")
            sys.stderr.flush()
            try:
                MPI.Finalize()
            finally:
                os._exit(1)

    def _settle_checks(self) -> None:
        """At exit: every group's last window is exchanged and verified (all started first, then waited
        for: the groups' order may differ between ranks)."""
        from .debug import CollectiveMismatchError
        live = [c.ck for c in self._comms if c.ck is not None and not c.group._freed]
        for ck in live:
            try:
                ck.final()
            except CollectiveMismatchError as err:
                self._bad_exit.append(f"at exit: {err}")
        for ck in live:
            try:
                ck.settle(True)
            except CollectiveMismatchError as err:
                self._bad_exit.append(f"at exit: {err}")

    def _poll(self, req) -> None:
        pause = 1e-4
        while not req.Test():          # the monitor answers questions meanwhile
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _account(self) -> bool:
        """Compare point-to-point counts (see the Note at the top): this rank's sends to each peer against
        the receives that peer posted from it. Returns True when any rank found a problem (or a
        mismatch at exit); this rank's findings go to ``_bad_exit``."""
        n = self.size
        sent, recvd = np.zeros(n, np.int64), np.zeros(n, np.int64)
        last = {}
        for c in self._comms:
            for gi, w in enumerate(c.ranks):
                if c.sent[gi]:
                    sent[w] += c.sent[gi]
                    last[w] = (c.name, c.last_send[gi])
                if c.recvd[gi]:
                    recvd[w] += c.recvd[gi]
        theirs = np.zeros(n, np.int64)
        self._poll(self.comm.Ialltoall(recvd, theirs))
        for q in range(n):
            if sent[q] > theirs[q]:
                name, (e, idx) = last[q]
                site = ""
                if e[_IDX] == idx and not isinstance(e[_FILE], str):
                    site = f", the last from {_where(_public(e))}"
                self._bad_exit.append(
                    f"rank {self.rank}: {sent[q] - theirs[q]} send(s) to rank {q} were never received: rank "
                    f"{self.rank} sent {sent[q]} message(s) to rank {q} (on {name}{site}), rank {q} posted "
                    f"{theirs[q]} receive(s) from rank {self.rank}; exiting 1")
        flag = np.array([1 if self._bad_exit else 0], np.int64)
        anybad = np.zeros(1, np.int64)
        self._poll(self.comm.Iallreduce(flag, anybad, MPI.MAX))
        return bool(anybad[0])

    def close(self) -> None:
        """Stop the listener and free the communicator (collective: ``World.destroy``). Raises
        ``RuntimeError`` on every rank when a send was never received."""
        if self._closed or self._thread is None:
            self._closed = True
            if self.comm is not None:
                self.comm.Free()
                self.comm = None
            return
        self._settle_checks()
        if self._finish():
            lines = self._bad_exit or [f"rank {self.rank}: another rank found sends that were never received"]
            self._bad_exit = []
            raise RuntimeError("\n".join(lines))

    def _finish(self) -> bool:
        bad = self._account()
        req = self.comm.Ibarrier()     # the monitor answers questions meanwhile
        self._poll(req)
        self._stop.set()
        self._thread.join()
        self._quiesce()
        self._sends.clear()
        self._closed = True
        try:
            atexit.unregister(self._at_exit)
            self.comm.Free()
        except Exception:
            pass
        return bad


# -- MPI errors the MPI library makes fatal ------------------------------------------------------------
# MPICH 5 ends the process from inside a blocking collective on some errors whatever the
# communicator's error handler (a truncation in MPI_Allreduce: "Fatal error in internal_Allreduce_c:
# Message truncated", exit 142), so no Python exception is raised. A C-level exit handler then names
# the call this rank was in, from the flight recorder's newest entry. It is registered with
# ``__cxa_atexit`` under a handle of its own, and a Python ``atexit`` handler runs and removes it
# (``__cxa_finalize``) before the interpreter shuts down: a Python callback must never run after that.
_EXIT_HOOK = None
_HOOK_WD: list = []
_NORMAL_EXIT = [False]


def _name_fatal_mpi_errors(wd: "Watchdog") -> None:
    global _EXIT_HOOK
    _HOOK_WD[:] = [wd]
    if _EXIT_HOOK is not None:
        return
    _EXIT_HOOK = False
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        hook = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_on_c_exit)
        handle = ctypes.create_string_buffer(1)       # a unique "DSO handle" for __cxa_finalize
        libc.__cxa_atexit.argtypes = [ctypes.c_void_p] * 3
        libc.__cxa_finalize.argtypes = [ctypes.c_void_p]
        if libc.__cxa_atexit(ctypes.cast(hook, ctypes.c_void_p), None, ctypes.addressof(handle)) != 0:
            return

        def remove():
            _NORMAL_EXIT[0] = True
            libc.__cxa_finalize(ctypes.addressof(handle))   # runs it now (a no-op), drops it
        atexit.register(remove)
        _EXIT_HOOK = (hook, handle, libc, remove)     # kept alive for the life of the process
    except Exception:                                 # not glibc: MPI's own message only
        pass


def _on_c_exit(_arg) -> None:
    try:
        if _NORMAL_EXIT[0] or not _HOOK_WD:
            return
        wd = _HOOK_WD[0]
        if wd._expiring or wd._closed:
            return
        e = wd.ring[(wd.pos - 1) % wd.capacity]
        w = wd.cur_wait
        if w is not None:
            e = w[0]
        elif not (e[_BLK] and e[_T1] is None):
            return
        pe = _public(e)
        peer = f" with group rank {pe[_PEER]}" if pe[_PEER] is not None else ""
        where = f" at {_where(pe)}" if pe[_FILE] != "?" else ""
        dt = f", dtype={pe[_DTYPE]}" if pe[_DTYPE] is not None else ""
        os.write(2, (f"[axonmpi] rank {wd.rank}: the MPI library ended this process inside {pe[_OP]} #{pe[_SEQ]} "
                     f"on {pe[_GROUP]}{peer} (this rank passed count={pe[_COUNT]}{dt}){where}; MPI's reason is "
                     "above. Every rank of a collective must pass the same element count and dtype "
                     "(AXONMPI_DEBUG=1 names what each rank passed, before the call)\n").encode())
    except Exception:
        pass


def dump_flight_record(path: Optional[str] = None) -> str:
    """Write this rank's flight record now (JSON; default ``AXONMPI_FLIGHT_DIR/flight_rank<r>.json``)."""
    from .world import get_world
    wd = get_world().watchdog
    if wd is None or not wd.record:
        raise RuntimeError("the flight recorder is off (AXONMPI_FLIGHT_RECORDER=0); nothing to dump")
    return wd.dump(path)


# -- the always-on collective check (see the Note at the top) ---------------------------------------
_SLOTS = 4                     # exchanges in flight per group before the oldest must be verified
_LANES = 5                     # h1, h1^2, h2, h2^2, all-to-all balance (uint64, summed)
_VARIES = -1                   # shape not compared (v-collectives: counts differ by design)
_NO_ROOT = -1
_OPCODE = {"all_reduce": 1, "reduce": 2, "reduce_scatter": 3, "broadcast": 4, "all_gather": 5, "gather": 6,
           "scatter": 7, "all_to_all": 8, "barrier": 9, "broadcast_object": 10, "all_gather_object": 11,
           "gather_object": 12, "all_to_all_object": 13}   # ints: str hashes are salted per process
_OPNAME = {v: k for k, v in _OPCODE.items()}
_ROOTED = (2, 4, 6, 7, 10, 12)
_FINAL = "collective check"    # the op of the last exchange (exit, free)
_MOPS: Dict[int, int] = {}     # id(MPI.Op) -> its handle (MPI.Op objects are unhashable)
_MOP_KEEP: list = []           # ... kept alive so an id is never reused
_MOP_NAMES = {}
_DTYPES: Dict[int, Any] = {}   # dtype.num -> dtype (for messages)
_M64 = (1 << 64) - 1


def _mop(op) -> int:
    c = _MOPS.get(id(op))
    if c is None:
        c = _MOPS[id(op)] = op.py2f()
        _MOP_KEEP.append(op)
    return c


def _mop_name(code: int) -> str:
    if not _MOP_NAMES:
        for n in ("SUM", "PROD", "MIN", "MAX", "BAND", "BOR", "BXOR", "LAND", "LOR", "LXOR", "MAXLOC", "MINLOC"):
            _MOP_NAMES[getattr(MPI, n).py2f()] = n
    return _MOP_NAMES.get(code, f"user op {code}")


def _dtype_name(num: int) -> str:
    if not _DTYPES:
        for c in np.typecodes["All"]:
            try:
                d = np.dtype(c)
            except TypeError:
                continue
            _DTYPES.setdefault(d.num, d)
    d = _DTYPES.get(num)
    return str(d) if d is not None else f"dtype #{num}"


def sig_text(sig) -> str:
    """A call signature ``(opcode, dtype num, shape, root, reduce op)`` as ``all_reduce(shape=(4, 2), ...)``."""
    code, dtn, shape, root, redop = sig
    if code == 0:
        return "the always-on check's last exchange (at exit or free)"
    fields = []
    if isinstance(shape, (tuple, list)) and code not in (9, 10, 11, 12, 13):
        fields.append(f"shape={tuple(shape)}")
    if dtn:
        fields.append(f"dtype={_dtype_name(dtn)}")
    if redop:
        fields.append(f"op={_mop_name(redop)}")
    if root != _NO_ROOT:
        fields.append(f"root={root}")
    return f"{_OPNAME.get(code, code)}({', '.join(fields)})"


def _a2a_term(n: int, src: int, dst: int, count: int) -> int:
    """The all-to-all balance term of ``count`` elements from group rank ``src`` to ``dst`` in call ``n``
    (a 64-bit mix: senders add it, receivers subtract it; the group's sum is 0 when counts agree)."""
    x = (n * 0x9E3779B97F4A7C15 + src * 0xBF58476D1CE4E5B9 + dst * 0x94D049BB133111EB + count + 1) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class _Checks:
    """One group's always-on collective check, batched (see the Note at the top): the signatures of the
    calls since the last exchange, and a ring of persistent ``Allreduce(SUM)`` exchanges of their hash on
    the group's check communicator, verified in order."""

    def __init__(self, group, comm, wd, wc):
        self.group, self.comm, self.wd, self.wc = group, comm, wd, wc
        self.every = wd.check_every
        self.strict = self.every == 1   # verify after every call (the result is never handed back unchecked)
        self.win: List[tuple] = []      # (signature, ring entry, its call index, extra) of the calls not exchanged
        self.first = 0                  # the call number of win[0]
        self.a2a = 0                    # the window's all-to-all balance (mod 2^64)
        self.sbuf = np.zeros((_SLOTS, _LANES), np.uint64)
        self.rbuf = np.zeros((_SLOTS, _LANES), np.uint64)
        self.reqs = [None] * _SLOTS
        self.pending: List[tuple] = []  # (slot, window, first call number) of exchanges started, in order
        self.started = 0                # exchanges started
        self.persistent = True          # MPI-4 persistent collectives; else one Iallreduce per exchange
        n = max(group.size, 2)
        self.bits = (63 - (n - 1).bit_length()) // 2     # n * (2^bits)^2 < 2^64: the sums are exact
        self.mask = (1 << self.bits) - 1

    @property
    def calls(self) -> int:
        """Collective calls made on the group so far."""
        return self.first + len(self.win)

    def _request(self, k):
        if self.persistent:
            try:
                return self.comm.Allreduce_init(self.sbuf[k], self.rbuf[k], MPI.SUM)
            except (NotImplementedError, AttributeError):   # below MPI 4: the same order on every rank
                self.persistent = False
        return self.comm.Iallreduce(self.sbuf[k], self.rbuf[k], MPI.SUM)

    def exchange(self, e, block: bool) -> None:
        """Verify the earlier exchanges (waiting for them before a blocking call ``e``: they completed once
        every rank entered their calls; a rank must not block in a call while another raises for an earlier
        one), then start the exchange of the window (which holds ``e``'s own signature last)."""
        if self.pending:
            try:
                self.settle(block, e)
            except BaseException:
                if self.win and self.win[-1][1] is e:
                    self.win.pop()     # this call never starts
                e[_BLK] = False
                raise
        if len(self.pending) >= _SLOTS:
            self.settle(True, e, upto=1)
        win = self.win
        h = hash(tuple([w[0] for w in win])) & _M64
        h1, h2 = h & self.mask, (h >> 32) & self.mask
        k = self.started % _SLOTS
        sb = self.sbuf[k]
        sb[0], sb[1], sb[2], sb[3], sb[4] = h1, h1 * h1, h2, h2 * h2, self.a2a
        req = self.reqs[k]
        if req is None or not self.persistent:
            req = self.reqs[k] = self._request(k)
        if self.persistent:
            req.Start()
        self.pending.append((k, win, self.first))
        self.started += 1
        self.first += len(win)
        self.win = []
        self.a2a = 0

    def settle(self, wait: bool, e=None, upto: Optional[int] = None) -> None:
        """Verify the pending exchanges in order; without ``wait``, stop at one not yet complete."""
        n = 0
        while self.pending and (upto is None or n < upto):
            k, win, first = self.pending[0]
            req = self.reqs[k]
            if not req.Test():
                if not wait:
                    return
                self._wait(req, e if e is not None else (win[-1][1] if win else None))
            self.pending.pop(0)
            n += 1
            r = [int(v) for v in self.rbuf[k]]
            size = self.group.size
            if size * r[1] != r[0] * r[0] or size * r[3] != r[2] * r[2] or r[4] != 0:
                self._mismatch(win, first, r[4] != 0)

    def final(self) -> None:
        """Start the exchange of what is left (exit, ``free``): every rank that used the group makes it."""
        if self.calls or self.pending:
            e = self.wc._rec(_FINAL, 0, None, None, True, (0, 0, 0, _NO_ROOT, 0))
            self.exchange(e, False)

    def _wait(self, req, e) -> None:
        """A watched wait for an exchange (the monitor holds its deadline, naming ``e``)."""
        wd = self.wd
        if e is None:
            req.Wait()
            return
        if wd.polling:
            wd.wait(req, e)
            return
        wd.cur_wait = (e, e[_IDX], _clock())
        try:
            req.Wait()
        finally:
            wd.cur_wait = None

    def _mismatch(self, win, first: int, counts: bool) -> None:
        from .debug import CollectiveMismatchError, name_window_mismatch
        g = self.group
        mine = [(first + i, sig, _site(e, idx), extra) for i, (sig, e, idx, extra) in enumerate(win)]
        lines = name_window_mismatch(g, self.comm, mine, timeout=min(self.wd.timeout, 60.0))
        what = "all-to-all counts" if counts else "collective calls"
        last = first + len(win) - 1
        calls = f"#{first}" if last <= first else f"#{first}-#{last}"
        raise CollectiveMismatchError(
            f"rank {g.world.rank}: ranks of {g.name} disagree on {what} {calls} (found by the always-on "
            f"check, which compares every {self.every} calls, at barriers and at exit; AXONMPI_CHECK_EVERY=1 "
            f"compares each call before it returns):\n{lines}")

    def close(self) -> None:
        for req in self.reqs:
            if req is not None:
                try:
                    if req.Test():
                        req.Free()
                except Exception:
                    pass
        self.reqs = [None] * _SLOTS


def _site(e, idx) -> str:
    """``file:line`` of ring entry ``e`` while it still holds call ``idx`` (else ``?``)."""
    if e is None or e[_IDX] != idx or isinstance(e[_FILE], str):
        return "?" if e is None or e[_IDX] != idx or e[_FILE] == "?" else _where(e)
    return _where(_public(e))


class _Watched:
    """A request whose ``Wait()`` has the watchdog's deadline and records completion.

    ``Wait()`` is MPI's own blocking wait (the monitor thread holds the deadline), or in polling
    mode :meth:`Watchdog.wait`; ``Test()`` is one ``MPI_Test`` (it never sleeps). With
    ``AXONMPI_CHECK_EVERY=1`` completion also verifies the collective's check (``ck``)."""

    __slots__ = ("req", "wd", "e", "i", "done", "ck", "wc")

    def __init__(self, req, wd, e, ck=None, wc=None):
        self.req, self.wd, self.e, self.i, self.done = req, wd, e, e[_IDX], False
        self.ck, self.wc = ck, wc

    def _end(self):
        self.done = True
        e = self.e
        if e[_IDX] == self.i:          # the ring slot still holds this call
            e[_T1] = _clock()
        ck = self.ck
        if ck is not None and ck.strict:
            ck.settle(True)

    def Wait(self):  # noqa: N802 - mpi4py's request protocol
        if self.done:
            return
        wd = self.wd
        try:
            if wd.polling:
                wd.wait(self.req, self.e)
            else:
                wd.cur_wait = (self.e, self.i, _clock())
                try:
                    self.req.Wait()
                finally:
                    wd.cur_wait = None
        except MPI.Exception as err:
            self.wc._failed(err, self.e, self.ck is not None or self.e[_PEER] is None)
            raise
        self._end()

    def Test(self) -> bool:  # noqa: N802
        if self.done:
            return True
        try:
            flag = self.req.Test()
        except MPI.Exception as err:
            self.wc._failed(err, self.e, self.e[_PEER] is None)
            raise
        if flag:
            self._end()
            return True
        return False


def _n(buf):
    """(count, dtype) of a buffer spec: an array, ``[array, (counts, displs)]``, IN_PLACE or None."""
    if isinstance(buf, list):
        buf = buf[0]
    if buf is None or buf is MPI.IN_PLACE:
        return 0, None
    return buf.size, buf.dtype


def _dt(buf):
    """The dtype of a buffer spec (None for IN_PLACE / None)."""
    if isinstance(buf, list):
        buf = buf[0]
    if buf is None or buf is MPI.IN_PLACE:
        return None
    return buf.dtype


def _dn(dtype) -> int:
    return dtype.num if dtype is not None else 0


class WatchedComm:
    """The slice of an mpi4py communicator the MPI backend uses, with deadlines and recording.

    Every call is stamped into the flight recorder (:meth:`_rec`) with its signature (op, dtype,
    shape, root, reduce op; tag for point-to-point); blocking calls are the ordinary blocking MPI
    calls, marked as the call in flight for the monitor thread while they run; non-blocking calls
    return a request whose ``Wait()`` is marked the same way. Collectives are checked across the
    group (:class:`_Checks`); point-to-point calls are counted per peer (compared at exit); MPI errors
    become :class:`~axonmpi.distributed.debug.CollectiveMPIError` (or the mismatch that caused them).
    """

    def __init__(self, group, wd: Watchdog):
        self.group, self.wd, self.raw = group, wd, group.comm
        self.name, self.ranks = group.name, group.ranks
        self.seq = 0                # collective calls on the group (the call numbers every rank shares)
        self.pseq = 0               # point-to-point calls (this rank's own count)
        try:   # an MPI error raises here (and is named) instead of MPICH's fatal abort
            self.raw.Set_errhandler(MPI.ERRORS_RETURN)
        except Exception:
            pass
        chk = getattr(group, "_check", None)
        self.ck = _Checks(group, chk, wd, self) if chk is not None else None
        n = group.size
        self.sent = [0] * n         # sends posted to each group rank
        self.recvd = [0] * n        # receives posted from each group rank
        self.last_send = [None] * n  # (ring entry, call index) of the last send to each group rank
        wd._comms.append(self)

    def Get_attr(self, key):  # noqa: N802
        return self.raw.Get_attr(key)

    def _rec(self, op, count, dtype, peer=None, blocking=False, sig=None, tag=-1):
        """Stamp a call into the ring (in place; its slot is returned, ``t_end`` set at completion)."""
        wd = self.wd
        if peer is None:
            s = self.seq
            self.seq = s + 1
        else:
            s = self.pseq
            self.pseq = s + 1
        i = wd.pos
        wd.pos = i + 1
        code, lasti, api = "?", 0, None
        if wd.record:
            # frames: 0 here, 1 this comm's method, 2 the backend's method (always in the package);
            # each frame walked costs a frame object, so start at 3 (the collective, or a caller).
            # The last package frame before the user's is the API the user called (``api``).
            f = _getframe(3)
            while f is not None:
                c = f.f_code
                fn = c.co_filename
                if fn in _INSIDE:
                    api = c
                    f = f.f_back
                elif fn in _OUTSIDE:
                    code, lasti = c, f.f_lasti
                    break
                elif fn.startswith(_PKG):
                    _INSIDE.add(fn)
                else:
                    _OUTSIDE.add(fn)
        if _trace._ACTIVE is None:
            e = wd.ring[i % wd.capacity]
            e[:] = (s, op, self.name, self.ranks, count, dtype, None, peer, _clock(), None, code, lasti, i, blocking,
                    tag, api, sig)
        else:                          # tracing: a fresh entry, shared with the tracer
            e = [s, op, self.name, self.ranks, count, dtype, None, peer, _clock(), None, code, lasti, i, blocking,
                 tag, api, sig]
            e[:12] = _public(e)
            wd.ring[i % wd.capacity] = e
            _trace._ACTIVE.calls.append(e)
        return e

    def _shape(self, buf):
        """The shape the collective's caller passed (noted by the collective on the group), else ``buf``'s."""
        g = self.group
        sh = g._sig_shape
        if sh is None:
            return buf.shape if buf is not None and buf is not MPI.IN_PLACE else ()
        g._sig_shape = None
        return sh

    def _col(self, op, buf, sig, block=True, count=None, dtype=None):
        """Stamp collective ``op`` with signature ``sig`` and add it to the group's check window."""
        if count is None:
            count, dtype = _n(buf)
        e = self._rec(op, count, dtype, None, block, sig)
        ck = self.ck
        if ck is not None:
            win = ck.win
            win.append((sig, e, e[_IDX], None))
            if len(win) >= ck.every:
                ck.exchange(e, block)
        return e

    def _failed(self, err, e, collective: bool) -> None:
        """Turn the MPI error ``err`` of call ``e`` into an axonmpi error: the mismatch, when the other
        ranks' calls (asked through the watchdog) differ from this one. Returns for errors that are not MPI's."""
        if not isinstance(err, MPI.Exception):
            return
        from .debug import CollectiveMismatchError, CollectiveMPIError
        if collective and self.wd.watch and self.wd.size > 1:
            lines = self.wd.ask_about(e)
            if lines:
                raise CollectiveMismatchError(
                    f"rank {self.wd.rank}: ranks of {self.name} disagree on collective call #{e[_SEQ]} (MPI failed "
                    f"it: {MPI.Get_error_string(err.Get_error_class())}):\n{lines}") from err
        try:
            text = [ln.strip() for ln in err.Get_error_string().splitlines() if ln.strip()]
            what = MPI.Get_error_string(err.Get_error_class())
            last = text[-1] if text else ""
            last = last.split(":", 1)[1].strip() if last.count(":") and "(" in last.split(":", 1)[0] else last
        except Exception:
            what, last = str(err), ""
        pe = _public(e)
        where = f" at {_where(pe)}" if pe[_FILE] != "?" else ""
        peer = f" with group rank {e[_PEER]}" if e[_PEER] is not None else ""
        raise CollectiveMPIError(
            f"rank {self.wd.rank}: {e[_OP]} #{e[_SEQ]} on {self.name}{peer} (group ranks {list(self.ranks)}){where} "
            f"failed in MPI: {what}" + (f" ({last})" if last and last != what else "")
            + (". Every rank of a collective must pass the same element count and dtype" if collective else
               ". The receive buffer must hold the whole message")) from err

    def _run(self, e, fn, *args, **kw):
        """Run the blocking MPI call ``fn`` for ``e`` (stamped with ``blocking=True``: the monitor
        watches the newest stamp while its ``t_end`` is unset)."""
        try:
            out = fn(*args, **kw)
        except BaseException as err:
            e[_BLK] = False
            self._failed(err, e, False)
            raise
        e[_T1] = _clock()
        return out

    def _runc(self, e, fn, *args, **kw):
        """:meth:`_run` for a collective (with ``AXONMPI_CHECK_EVERY=1`` its check is verified after it)."""
        try:
            out = fn(*args, **kw)
        except BaseException as err:
            e[_BLK] = False
            self._failed(err, e, True)
            raise
        e[_T1] = _clock()
        ck = self.ck
        if ck is not None and ck.strict:
            ck.settle(True)
        return out

    # reductions (the hot ones written out: no extra Python call on the fast path)
    def Allreduce(self, s, r, op):  # noqa: N802
        g = self.group
        sh = g._sig_shape
        if sh is None:
            sh = r.shape
        else:
            g._sig_shape = None
        dt = r.dtype
        sig = (1, dt.num, sh, _NO_ROOT, _mop(op))
        e = self._rec("all_reduce", r.size, dt, None, True, sig)
        ck = self.ck
        if ck is not None:
            win = ck.win
            win.append((sig, e, e[_IDX], None))
            if len(win) >= ck.every:
                ck.exchange(e, True)
        try:
            self.raw.Allreduce(s, r, op)
        except BaseException as err:
            e[_BLK] = False
            self._failed(err, e, True)
            raise
        e[_T1] = _clock()
        if ck is not None and ck.strict:
            ck.settle(True)

    def Iallreduce(self, s, r, op):  # noqa: N802
        e = self._col("all_reduce", r, (1, r.dtype.num, self._shape(r), _NO_ROOT, _mop(op)), False)
        return _Watched(self.raw.Iallreduce(s, r, op), self.wd, e, self.ck, self)

    def Reduce(self, s, r, op, root):  # noqa: N802
        b = s if s is not MPI.IN_PLACE else r
        e = self._col("reduce", b, (2, b.dtype.num, self._shape(b), root, _mop(op)))
        self._runc(e, self.raw.Reduce, s, r, op, root=root)

    def Reduce_scatter_block(self, s, r, op):  # noqa: N802
        g = self.group
        sh = g._sig_shape
        if sh is None:
            sh = s.shape
        else:
            g._sig_shape = None
        dt = s.dtype
        sig = (3, dt.num, sh, _NO_ROOT, _mop(op))
        e = self._rec("reduce_scatter", s.size, dt, None, True, sig)
        ck = self.ck
        if ck is not None:
            win = ck.win
            win.append((sig, e, e[_IDX], None))
            if len(win) >= ck.every:
                ck.exchange(e, True)
        try:
            self.raw.Reduce_scatter_block(s, r, op)
        except BaseException as err:
            e[_BLK] = False
            self._failed(err, e, True)
            raise
        e[_T1] = _clock()
        if ck is not None and ck.strict:
            ck.settle(True)

    def Ireduce_scatter_block(self, s, r, op):  # noqa: N802
        e = self._col("reduce_scatter", s, (3, s.dtype.num, self._shape(s), _NO_ROOT, _mop(op)), False)
        return _Watched(self.raw.Ireduce_scatter_block(s, r, op), self.wd, e, self.ck, self)

    def Reduce_scatter(self, s, r, counts, op):  # noqa: N802
        e = self._col("reduce_scatter", s, (3, s.dtype.num, self._shape(s), _NO_ROOT, _mop(op)))
        self._runc(e, self.raw.Reduce_scatter, s, r, counts, op)

    def Ireduce_scatter(self, s, r, counts, op):  # noqa: N802
        e = self._col("reduce_scatter", s, (3, s.dtype.num, self._shape(s), _NO_ROOT, _mop(op)), False)
        return _Watched(self.raw.Ireduce_scatter(s, r, counts, op), self.wd, e, self.ck, self)

    # data movement
    def Bcast(self, buf, root):  # noqa: N802
        g = self.group
        sh = g._sig_shape
        if sh is None:
            sh = buf.shape
        else:
            g._sig_shape = None
        dt = buf.dtype
        sig = (4, dt.num, sh, root, 0)
        e = self._rec("broadcast", buf.size, dt, None, True, sig)
        ck = self.ck
        if ck is not None:
            win = ck.win
            win.append((sig, e, e[_IDX], None))
            if len(win) >= ck.every:
                ck.exchange(e, True)
        try:
            self.raw.Bcast(buf, root=root)
        except BaseException as err:
            e[_BLK] = False
            self._failed(err, e, True)
            raise
        e[_T1] = _clock()
        if ck is not None and ck.strict:
            ck.settle(True)

    def Allgather(self, s, r):  # noqa: N802
        g = self.group
        sh = g._sig_shape
        if sh is None:
            sh = s.shape
        else:
            g._sig_shape = None
        dt = r.dtype
        sig = (5, dt.num, sh, _NO_ROOT, 0)
        e = self._rec("all_gather", r.size, dt, None, True, sig)
        ck = self.ck
        if ck is not None:
            win = ck.win
            win.append((sig, e, e[_IDX], None))
            if len(win) >= ck.every:
                ck.exchange(e, True)
        try:
            self.raw.Allgather(s, r)
        except BaseException as err:
            e[_BLK] = False
            self._failed(err, e, True)
            raise
        e[_T1] = _clock()
        if ck is not None and ck.strict:
            ck.settle(True)

    def Iallgather(self, s, r):  # noqa: N802
        e = self._col("all_gather", r, (5, r.dtype.num, self._shape(s), _NO_ROOT, 0), False)
        return _Watched(self.raw.Iallgather(s, r), self.wd, e, self.ck, self)

    def Allgatherv(self, s, r):  # noqa: N802
        self.group._sig_shape = None
        e = self._col("all_gather", r, (5, _dn(_dt(s)), _VARIES, _NO_ROOT, 0))
        self._runc(e, self.raw.Allgatherv, s, r)

    def Gatherv(self, s, r, root):  # noqa: N802
        self.group._sig_shape = None
        e = self._col("gather", s, (6, _dn(_dt(s)), _VARIES, root, 0))
        self._runc(e, self.raw.Gatherv, s, r, root=root)

    def Scatterv(self, s, r, root):  # noqa: N802
        self.group._sig_shape = None
        e = self._col("scatter", r, (7, _dn(_dt(r)), _VARIES, root, 0))
        self._runc(e, self.raw.Scatterv, s, r, root=root)

    def _a2a(self, s, r):
        """Add this rank's all-to-all counts to the window's balance (see the Note: senders add, receivers
        subtract, per (call, source, destination, count)); returns the counts for a mismatch report."""
        ck = self.ck
        sc, rc = list(s[1][0]), list(r[1][0])
        if ck is not None:
            n, me = ck.calls, self.group.rank
            b = ck.a2a
            for j, c in enumerate(sc):
                b += _a2a_term(n, me, j, int(c))
            for j, c in enumerate(rc):
                b -= _a2a_term(n, j, me, int(c))
            ck.a2a = b & _M64
        return sc, rc

    def Alltoallv(self, s, r):  # noqa: N802
        self.group._sig_shape = None
        sc, rc = self._a2a(s, r)
        sig = (8, _dn(_dt(s)), _VARIES, _NO_ROOT, 0)
        e = self._rec("all_to_all", *_n(s), None, True, sig)
        ck = self.ck
        if ck is not None:
            win = ck.win
            win.append((sig, e, e[_IDX], (tuple(sc), tuple(rc))))
            if len(win) >= ck.every:
                ck.exchange(e, True)
        self._runc(e, self.raw.Alltoallv, s, r)

    def Barrier(self):  # noqa: N802
        """A barrier is an exchange point: the window (this call last) is compared before it returns."""
        e = self._rec("barrier", 0, None, None, True, (9, 0, (), _NO_ROOT, 0))
        ck = self.ck
        if ck is not None:
            ck.win.append((e[_SIG], e, e[_IDX], None))
            ck.exchange(e, True)
        self._run(e, self.raw.Barrier)
        if ck is not None:
            ck.settle(True, e)

    # point-to-point (sequence numbers count this rank's calls on the group; they need not match;
    # sends and receives are counted per peer and compared at exit)
    def _p2p(self, e, peer, send):
        if send:
            self.sent[peer] += 1
            self.last_send[peer] = (e, e[_IDX])
        else:
            self.recvd[peer] += 1

    def Send(self, buf, dest, tag):  # noqa: N802
        e = self._rec("send", buf.size, buf.dtype, dest, True, None, tag)
        self._p2p(e, dest, True)
        self._run(e, self.raw.Send, buf, dest=dest, tag=tag)

    def Recv(self, buf, source, tag):  # noqa: N802
        e = self._rec("recv", buf.size, buf.dtype, source, True, None, tag)
        self._p2p(e, source, False)
        self._run(e, self.raw.Recv, buf, source=source, tag=tag)

    def Isend(self, buf, dest, tag):  # noqa: N802
        e = self._rec("send", buf.size, buf.dtype, dest, False, None, tag)
        self._p2p(e, dest, True)
        return _Watched(self.raw.Isend(buf, dest=dest, tag=tag), self.wd, e, None, self)

    def Irecv(self, buf, source, tag):  # noqa: N802
        e = self._rec("recv", buf.size, buf.dtype, source, False, None, tag)
        self._p2p(e, source, False)
        return _Watched(self.raw.Irecv(buf, source=source, tag=tag), self.wd, e, None, self)

    # picklable objects
    def bcast(self, obj, root):
        e = self._col("broadcast_object", None, (10, 0, 0, root, 0), count=0)
        return self._runc(e, self.raw.bcast, obj, root=root)

    def allgather(self, obj):
        e = self._col("all_gather_object", None, (11, 0, 0, _NO_ROOT, 0), count=0)
        return self._runc(e, self.raw.allgather, obj)

    def gather(self, obj, root):
        e = self._col("gather_object", None, (12, 0, 0, root, 0), count=0)
        return self._runc(e, self.raw.gather, obj, root=root)

    def alltoall(self, objs):
        e = self._col("all_to_all_object", None, (13, 0, 0, _NO_ROOT, 0), count=0)
        return self._runc(e, self.raw.alltoall, objs)


class PolledComm(WatchedComm):
    """Polling mode (MPI below ``THREAD_MULTIPLE``): blocking calls run as their non-blocking
    twin plus :meth:`Watchdog.wait` (the main thread holds the deadline). Object collectives
    first pass a watched ``Ibarrier`` (every rank has arrived), then run as usual."""

    def _w(self, e, req, collective=True):
        e[_BLK] = True
        try:
            self.wd.wait(req, e)
        except MPI.Exception as err:
            e[_BLK] = False
            self._failed(err, e, collective)
            raise
        e[_T1] = _clock()
        ck = self.ck
        if collective and ck is not None and ck.strict:
            ck.settle(True)

    def Allreduce(self, s, r, op):  # noqa: N802
        e = self._col("all_reduce", r, (1, r.dtype.num, self._shape(r), _NO_ROOT, _mop(op)))
        self._w(e, self.raw.Iallreduce(s, r, op))

    def Reduce(self, s, r, op, root):  # noqa: N802
        b = s if s is not MPI.IN_PLACE else r
        e = self._col("reduce", b, (2, b.dtype.num, self._shape(b), root, _mop(op)))
        self._w(e, self.raw.Ireduce(s, r, op, root=root))

    def Reduce_scatter_block(self, s, r, op):  # noqa: N802
        e = self._col("reduce_scatter", s, (3, s.dtype.num, self._shape(s), _NO_ROOT, _mop(op)))
        self._w(e, self.raw.Ireduce_scatter_block(s, r, op))

    def Reduce_scatter(self, s, r, counts, op):  # noqa: N802
        e = self._col("reduce_scatter", s, (3, s.dtype.num, self._shape(s), _NO_ROOT, _mop(op)))
        self._w(e, self.raw.Ireduce_scatter(s, r, counts, op))

    def Bcast(self, buf, root):  # noqa: N802
        e = self._col("broadcast", buf, (4, buf.dtype.num, self._shape(buf), root, 0))
        self._w(e, self.raw.Ibcast(buf, root=root))

    def Allgather(self, s, r):  # noqa: N802
        e = self._col("all_gather", r, (5, r.dtype.num, self._shape(s), _NO_ROOT, 0))
        self._w(e, self.raw.Iallgather(s, r))

    def Allgatherv(self, s, r):  # noqa: N802
        self.group._sig_shape = None
        e = self._col("all_gather", r, (5, _dn(_dt(s)), _VARIES, _NO_ROOT, 0))
        self._w(e, self.raw.Iallgatherv(s, r))

    def Gatherv(self, s, r, root):  # noqa: N802
        self.group._sig_shape = None
        e = self._col("gather", s, (6, _dn(_dt(s)), _VARIES, root, 0))
        self._w(e, self.raw.Igatherv(s, r, root=root))

    def Scatterv(self, s, r, root):  # noqa: N802
        self.group._sig_shape = None
        e = self._col("scatter", r, (7, _dn(_dt(r)), _VARIES, root, 0))
        self._w(e, self.raw.Iscatterv(s, r, root=root))

    def Alltoallv(self, s, r):  # noqa: N802
        self.group._sig_shape = None
        sc, rc = self._a2a(s, r)
        sig = (8, _dn(_dt(s)), _VARIES, _NO_ROOT, 0)
        e = self._rec("all_to_all", *_n(s), None, True, sig)
        ck = self.ck
        if ck is not None:
            ck.win.append((sig, e, e[_IDX], (tuple(sc), tuple(rc))))
            if len(ck.win) >= ck.every:
                ck.exchange(e, True)
        self._w(e, self.raw.Ialltoallv(s, r))

    def Barrier(self):  # noqa: N802
        e = self._rec("barrier", 0, None, None, True, (9, 0, (), _NO_ROOT, 0))
        ck = self.ck
        if ck is not None:
            ck.win.append((e[_SIG], e, e[_IDX], None))
            ck.exchange(e, True)
        self._w(e, self.raw.Ibarrier(), False)
        if ck is not None:
            ck.settle(True, e)

    def Send(self, buf, dest, tag):  # noqa: N802
        e = self._rec("send", buf.size, buf.dtype, dest, False, None, tag)
        self._p2p(e, dest, True)
        self._w(e, self.raw.Isend(buf, dest=dest, tag=tag), False)

    def Recv(self, buf, source, tag):  # noqa: N802
        e = self._rec("recv", buf.size, buf.dtype, source, False, None, tag)
        self._p2p(e, source, False)
        self._w(e, self.raw.Irecv(buf, source=source, tag=tag), False)

    def _arrive(self, op, sig):
        self._w(self._col(op, None, sig, count=0), self.raw.Ibarrier())

    def bcast(self, obj, root):
        self._arrive("broadcast_object", (10, 0, 0, root, 0))
        return self.raw.bcast(obj, root=root)

    def allgather(self, obj):
        self._arrive("all_gather_object", (11, 0, 0, _NO_ROOT, 0))
        return self.raw.allgather(obj)

    def gather(self, obj, root):
        self._arrive("gather_object", (12, 0, 0, root, 0))
        return self.raw.gather(obj, root=root)

    def alltoall(self, objs):
        self._arrive("all_to_all_object", (13, 0, 0, _NO_ROOT, 0))
        return self.raw.alltoall(objs)


def _report_fatal(text: str) -> None:
    """Write a report the job ends on where it survives the abort: ``sys.stderr`` and the process's stderr file
    descriptor when they differ (a test runner capturing ``sys.stderr`` loses what it holds when the process is
    killed)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    try:
        if not (hasattr(sys.stderr, "fileno") and sys.stderr.fileno() == 2):
            os.write(2, (text + "\n").encode("utf-8", "replace"))
    except (OSError, ValueError, AttributeError):
        try:
            os.write(2, (text + "\n").encode("utf-8", "replace"))
        except OSError:
            pass
