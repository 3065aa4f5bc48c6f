"""The wrapped communicator: each group's MPI calls stamped into the flight recorder, watched and checked.

The calls themselves are generated from one table (``wrappers.py``, see its Note); this module holds
what they share: the stamp (:meth:`WatchedComm._rec`), the watched request (:class:`_Watched`), the
all-to-all balance, the per-peer counts and the translation of MPI errors.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from mpi4py import MPI

from ... import trace as _trace
from .check import _Checks
# _NO_ROOT, _VARIES, _mop, _IN_PLACE, _n, _dt, _dn: names the generated calls use (wrappers.py)
from .record import (_BLK, _FILE, _IDX, _INSIDE, _OUTSIDE, _M64, _NO_ROOT, _OP, _PEER, _PKG, _SEQ,  # noqa: F401
                     _T1, _VARIES, _a2a_term, _clock, _getframe, _mop, _public, _where)
from .wrappers import methods as _methods

if TYPE_CHECKING:
    from .monitor import Watchdog

__all__ = ["WatchedComm", "PolledComm"]

_IN_PLACE = MPI.IN_PLACE


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

    def _failed(self, err, e, collective: bool) -> None:
        """Turn the MPI error ``err`` of call ``e`` into an axonmpi error: the mismatch, when the other
        ranks' calls (asked through the watchdog) differ from this one. Returns for errors that are not MPI's."""
        if not isinstance(err, MPI.Exception):
            return
        from ..debug import CollectiveMismatchError, CollectiveMPIError
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

    def _a2a(self, s, r):
        """Add this rank's all-to-all counts to the window's balance (see check.py's Note: senders add, receivers
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

    def _p2p(self, e, peer, send):
        if send:
            self.sent[peer] += 1
            self.last_send[peer] = (e, e[_IDX])
        else:
            self.recvd[peer] += 1


for _name, _fn in {**_methods("block", globals()), **_methods("start", globals())}.items():
    setattr(WatchedComm, _name, _fn)


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


for _name, _fn in _methods("poll", globals()).items():
    setattr(PolledComm, _name, _fn)
del _name, _fn
