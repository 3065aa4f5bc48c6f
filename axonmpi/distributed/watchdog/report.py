"""The report a hang ends on: this rank's state, the root-cause paragraph, flight-record files, MPI's fatal exits."""
from __future__ import annotations

import atexit
import json
import os
import pickle
import sys
import time
from typing import Any, Dict, Optional

from mpi4py import MPI

from .. import phases as _phases
from .record import (_ASK, _BLK, _DTYPE, _FILE, _FINAL, _GROUP, _IDX, _OP, _PEER, _RANKS, _SEQ, _SIG, _T0, _T1,
                     _TAG, _API, _COUNT, ANSWER_S, CALL_FIELDS, _api_name, _clock, _desc, _full, _public, _where)

__all__ = ["dump_flight_record"]


class _Report:
    """The part of :class:`~axonmpi.distributed.watchdog.Watchdog` that writes what a hang report needs."""

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
    from ..world import get_world
    wd = get_world().watchdog
    if wd is None or not wd.record:
        raise RuntimeError("the flight recorder is off (AXONMPI_FLIGHT_RECORDER=0); nothing to dump")
    return wd.dump(path)



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
