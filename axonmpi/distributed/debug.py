"""Debug mode (``AXONMPI_DEBUG=1``): check that all ranks of a group call the same collective alike.

[Note: how a debug check names the ranks that never arrive]
Each check is a point-to-point exchange on the group's communicator with tags that users
cannot pass (the top ``DEBUG_TAGS`` tags, see :mod:`axonmpi.distributed.group`). Every rank
sends its call's signature to group rank 0, the collector, which acknowledges each one as it
arrives, compares them once all are in, and sends every rank the verdict (agree, or which
ranks called what). When a rank does not arrive within ``AXONMPI_DEBUG_TIMEOUT`` seconds, the
collector knows exactly who is missing and every rank that did arrive raises
:class:`CollectiveTimeoutError` naming them; a rank whose signature the collector never
acknowledges names the collector. Nothing is left in flight: the collector only receives
messages that have arrived (probe, then receive), and a signature send that was never
received stays referenced by the group until it completes. (A non-blocking collective, as
used before, cannot be cancelled or freed while pending: a late rank would then write into
freed memory.) After a timeout the group's collectives no longer line up; the uncaught
exception ends the job (see :func:`axonmpi.init`).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from .. import env as _env

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "CollectiveMPIError", "check_collective",
           "check_same_object", "name_window_mismatch"]

_SIG_CHARS = 4096
_ACK = b"A"
_OK = b"OK"
_MISMATCH = b"MISMATCH\n"
_TIMEOUT = b"TIMEOUT\n"


class CollectiveMismatchError(RuntimeError):
    """Ranks of a group called different collectives, or the same one with different arguments."""


class CollectiveTimeoutError(RuntimeError):
    """In debug mode, some ranks of a group never reached a collective the others entered."""


class CollectiveMPIError(RuntimeError):
    """The MPI library failed a collective or point-to-point call (truncation, ...); the message names the
    op, the group, the call site and MPI's own error string (the ``mpi4py.MPI.Exception`` is the cause)."""


def _timeout(group=None) -> float:
    """``AXONMPI_DEBUG_TIMEOUT``, or the watchdog's deadline (``AXONMPI_TIMEOUT``) when it is shorter:
    the signature exchange polls, so the watchdog's monitor does not see it waiting."""
    t = _env.get_float("AXONMPI_DEBUG_TIMEOUT")
    wd = getattr(getattr(group, "world", None), "watchdog", None)
    if wd is not None and wd.watch:
        t = min(t, float(wd.timeout))
    return t


def _fmt(v: Any) -> str:
    if isinstance(v, np.dtype):
        return str(v)
    if hasattr(v, "name") and hasattr(v, "value"):  # enum
        return v.name
    return repr(v) if not isinstance(v, str) else v


def _describe(name: str, fields: Dict[str, Any]) -> str:
    text = f"{name}(" + ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(fields.items())) + ")"
    return text[:_SIG_CHARS]


def _rank_list(ranks: List[int]) -> str:
    """``[0, 2]``; long lists as ranges: ``[0-255, 257-511] (511 ranks)``."""
    ranks = sorted(ranks)
    if len(ranks) <= 16:
        return str(ranks)
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return "[" + ", ".join(runs) + f"] ({len(ranks)} ranks)"


def check_collective(group, name: str, **fields: Any) -> None:
    """Raise on every rank of ``group`` unless all ranks pass the same ``name`` and ``fields``.

    The signature holds the group's call number and the caller's file:line, so a rank that
    skipped a call and went on to another of the same shape from another line is caught there,
    naming both lines. (A skip inside a loop pairs with the next pass of the same line; the
    watchdog names it when the counts run out, see :mod:`axonmpi.distributed.watchdog`.)
    A rank that never arrives is reported after ``AXONMPI_DEBUG_TIMEOUT`` seconds (default
    300) by a :class:`CollectiveTimeoutError` on every rank that did, naming the missing
    world ranks, instead of a silent hang.
    """
    import os
    from .watchdog import call_site
    file, line = call_site()
    desc = _describe(name, fields)
    _exchange(group, f"{desc} call #{group._debug_seq} at {os.path.basename(file)}:{line}", desc)


def check_same_object(group, obj: Any, what: str) -> None:
    """Raise on every rank unless all ranks of ``group`` pass an equal ``obj`` (for group setup)."""
    _exchange(group, _describe(what, {"value": repr(obj)}), what)


def _tags(group, seq: int):
    """The (to collector, from collector) tags of check number ``seq`` on ``group``."""
    base = group.max_tag + 1
    slot = seq % ((group.comm.Get_attr(MPI.TAG_UB) - base + 1) // 2)
    return base + 2 * slot, base + 2 * slot + 1


def _poll(comm, source: int, tag: int, deadline: Optional[float], status):
    """Receive the next message from ``source`` with ``tag`` once it has arrived; None when the
    deadline passes first. Nothing is posted before the message is there."""
    delay = 1e-5
    while not comm.Iprobe(source=source, tag=tag, status=status):
        if deadline is not None and time.monotonic() > deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    buf = bytearray(status.Get_count(MPI.BYTE))
    comm.Recv([buf, MPI.BYTE], source=status.Get_source(), tag=tag)
    return bytes(buf)


def _exchange(group, sig: str, text: str) -> None:
    if group.size == 1:
        return
    group._debug_pending[:] = [p for p in group._debug_pending if not p[0].Test()]
    seq = group._debug_seq
    group._debug_seq += 1
    up, down = _tags(group, seq)
    where = f"rank {group.world.rank}: "
    if group.rank == 0:
        verdict = _collect(group, sig, text, up, down)
    else:
        verdict = _report(group, sig, text, up, down)
    if verdict == _OK:
        return
    if verdict.startswith(_MISMATCH):
        raise CollectiveMismatchError(
            where + f"ranks of {group.name} disagree on a collective:\n" + verdict[len(_MISMATCH):].decode()
        )
    raise CollectiveTimeoutError(where + verdict[len(_TIMEOUT):].decode())


def _collect(group, sig: str, text: str, up: int, down: int, comm=None, timeout=None, judge=None) -> bytes:
    """Group rank 0: gather the signatures (until the timeout), decide (``judge``: a function of every
    rank's signature giving the verdict; default: all equal), tell every rank that came."""
    comm = group.comm if comm is None else comm
    size, timeout = group.size, _timeout(group) if timeout is None else timeout
    sigs = {0: sig}
    sends = []
    status = MPI.Status()
    deadline = time.monotonic() + timeout
    while len(sigs) < size:
        msg = _poll(comm, MPI.ANY_SOURCE, up, deadline, status)
        if msg is None:
            break
        src = status.Get_source()
        sigs[src] = msg.decode(errors="replace")
        sends.append(comm.Isend([_ACK, MPI.BYTE], dest=src, tag=down))
    if len(sigs) < size:
        missing = [group.ranks[i] for i in range(size) if i not in sigs]
        came = [group.ranks[i] for i in sorted(sigs)]
        verdict = _TIMEOUT + (
            f"waited {timeout:.0f} s in {text} on {group.name}: world ranks {_rank_list(missing)} never "
            f"called it (stuck elsewhere, finished, or called a different sequence of collectives); "
            f"world ranks {_rank_list(came)} did"
        ).encode()
    elif judge is not None:
        verdict = judge(sigs)
    elif all(s == sig for s in sigs.values()):
        verdict = _OK
    else:
        by_sig: Dict[str, List[int]] = {}
        for grank in range(size):
            by_sig.setdefault(sigs[grank], []).append(group.ranks[grank])
        lines = [f"  world ranks {_rank_list(ranks)} called {s}" for s, ranks in by_sig.items()]
        verdict = _MISMATCH + "\n".join(lines).encode()
    for src in sigs:
        if src != 0:
            sends.append(comm.Isend([verdict, MPI.BYTE], dest=src, tag=down))
    MPI.Request.Waitall(sends)      # each receiver has sent and is waiting: these complete
    return verdict


def _report(group, sig: str, text: str, up: int, down: int, comm=None, timeout=None) -> bytes:
    """Any other rank: send the signature to rank 0, wait for its acknowledgement, then the verdict."""
    comm = group.comm if comm is None else comm
    timeout = _timeout(group) if timeout is None else timeout
    payload = sig.encode()
    req = comm.Isend([payload, MPI.BYTE], dest=0, tag=up)
    status = MPI.Status()
    ack = _poll(comm, 0, down, time.monotonic() + timeout, status)
    if ack is None:
        if not req.Test():
            group._debug_pending.append((req, payload))  # completes if rank 0 ever receives it
        return _TIMEOUT + (
            f"waited {timeout:.0f} s in {text} on {group.name}: world rank {group.ranks[0]} (group rank 0, "
            "which collects the debug checks) never called it (stuck elsewhere, finished, called a "
            "different sequence of collectives, or gave up on this check earlier); other ranks may be "
            "missing too"
        ).encode()
    req.Wait()                                        # rank 0 has received it
    verdict = _poll(comm, 0, down, time.monotonic() + timeout + 60, status)  # within rank 0's timeout
    if verdict is None:
        return _TIMEOUT + (
            f"world rank {group.ranks[0]} received this rank's {text} on {group.name} but sent no "
            f"verdict within {timeout + 60:.0f} s"
        ).encode()
    return verdict


# -- the always-on check's slow path -----------------------------------------------------------------
# [Note: naming a mismatch the always-on check found]
# The always-on check (axonmpi.distributed.watchdog, ``_Checks``) compares a hash of the signatures of a
# window of collective calls (every AXONMPI_CHECK_EVERY calls, at barriers and at exit); when the sums
# of an exchange show that the hashes (or the all-to-all counts) differ, every rank of the group learns
# it from the same summed lanes, at the same exchange, and comes here with its own window: each call's
# number, signature (op, dtype, shape, root, reduce op), call site and, for all-to-alls, its counts.
# The windows travel as in debug mode (to group rank 0, which finds the first call the ranks disagree
# on, or the counts that do not match, and names who called what), point-to-point on the check's own
# communicator with two fixed tags: its persistent collectives may be started further on some ranks
# than on others, so no collective may follow.
_SLOW_UP, _SLOW_DOWN = 1, 2


def _judge_windows(group, sigs: Dict[int, str]) -> bytes:
    """Group rank 0: the verdict on every rank's window (JSON lists of [call, signature, site, counts])."""
    import json
    from .watchdog import sig_text
    wins = {g: json.loads(s) for g, s in sigs.items()}
    nums = sorted({c[0] for w in wins.values() for c in w})
    for n in nums:
        at = {g: next((c for c in w if c[0] == n), None) for g, w in wins.items()}
        if len({json.dumps(c[1]) if c else None for c in at.values()}) > 1:
            by: Dict[str, List[int]] = {}
            for g in sorted(at):
                c = at[g]
                text = (f"called {sig_text(c[1])} call #{n} at {c[2]}" if c else
                        f"made no call #{n} on {group.name} in this window (its calls end at "
                        f"#{max([x[0] for x in wins[g]], default=n - 1)})")
                by.setdefault(text, []).append(group.ranks[g])
            return _MISMATCH + "\n".join(f"  world ranks {_rank_list(r)} {t}" for t, r in by.items()).encode()
    for n in nums:
        at = {g: next((c for c in w if c[0] == n), None) for g, w in wins.items()}
        if any(c is None or c[3] is None for c in at.values()):
            continue
        send = {g: c[3][0] for g, c in at.items()}
        recv = {g: c[3][1] for g, c in at.items()}
        bad = [f"world rank {group.ranks[j]} expects {recv[j][i]} element(s) from world rank {group.ranks[i]}, "
               f"which sends {send[i][j]}" for i in sorted(at) for j in sorted(at)
               if i < len(recv[j]) and j < len(send[i]) and send[i][j] != recv[j][i]]
        if bad:
            site = at[0][2] if 0 in at else "?"
            return _MISMATCH + (f"  all_to_all call #{n} at {site}: the receive counts do not match what the "
                                f"senders send: " + "; ".join(bad[:8])
                                + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")).encode()
    return _OK


def name_window_mismatch(group, comm, window, timeout: float) -> str:
    """Exchange this rank's ``window`` (``[(call number, signature, site, counts)]``) over ``comm`` (the
    group's check communicator) and return the lines naming which world ranks called what (or, after
    ``timeout`` s, who never answered)."""
    import json
    mine = json.dumps([[n, list(sig), site, extra] for n, sig, site, extra in window])
    if group.rank == 0:
        verdict = _collect(group, mine, "the always-on check's windows", _SLOW_UP, _SLOW_DOWN, comm=comm,
                           timeout=timeout, judge=lambda sigs: _judge_windows(group, sigs))
    else:
        verdict = _report(group, mine, "the always-on check's windows", _SLOW_UP, _SLOW_DOWN, comm=comm,
                          timeout=timeout)
    if verdict.startswith(_MISMATCH):
        return verdict[len(_MISMATCH):].decode()
    if verdict == _OK:   # a hash collision of equal windows cannot happen; fields not shown differ
        return "  every rank called the same sequence (the signature hashes differed in fields not shown)"
    return "  " + verdict[len(_TIMEOUT):].decode()
