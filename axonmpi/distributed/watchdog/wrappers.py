"""The wrapped MPI calls, written once: a table of the calls and the one body each mode gives them.

[Note: why the wrapper bodies are generated]
Every call a :class:`~axonmpi.distributed.watchdog.WatchedComm` wraps does the same few steps: note the
signature the group's check compares (op code, dtype, shape, root, reduce op), stamp the call into the
flight recorder, add it to the check's window, make the MPI call, stamp its end (or turn its MPI error
into an axonmpi error). A small all-reduce costs ~5 us in MPI and each extra Python call ~0.1 us, so a
generic wrapper (a closure taking ``*args``, helper calls per step) would cost the hot calls more than
the watchdog itself. The table below names each call once; :func:`methods` writes its body as straight
code (no helper calls on the fast path), the way :mod:`dataclasses` writes ``__init__``. Each body's
source is kept (``source(name, mode)``, and in tracebacks through :mod:`linecache`).

Modes: ``"block"`` (WatchedComm: MPI's own blocking call, which the monitor thread watches), ``"start"``
(WatchedComm's non-blocking calls: a watched request) and ``"poll"`` (PolledComm, below
``THREAD_MULTIPLE``: the non-blocking twin, waited on by polling in the main thread).
"""
from __future__ import annotations

import linecache
import os
from typing import Callable, Dict, List, NamedTuple

__all__: List[str] = []   # private to the watchdog package

FIXED, VARIES, ALLTOALL, OBJECT, BARRIER, P2P = "fixed", "varies", "alltoall", "object", "barrier", "p2p"


class _Call(NamedTuple):
    """One wrapped mpi4py call."""
    name: str        # mpi4py's (blocking) method
    args: str        # its arguments as the backend passes them
    call: str        # the arguments passed on to mpi4py
    op: str          # the flight recorder's op name
    code: int        # the signature's op code (record._OPCODE; 0 for point-to-point)
    kind: str        # FIXED shape, VARIES (v-collectives), ALLTOALL, OBJECT, BARRIER, P2P
    counted: str     # the buffer whose elements and dtype are recorded
    described: str   # the buffer whose shape (FIXED) or dtype (VARIES) the signature takes; P2P: the peer
    root: str        # the root argument, else _NO_ROOT
    redop: str       # the reduce op's code, else 0
    twin: str        # the non-blocking twin (polling mode; "start"); P2P: "send" or "recv"
    start: bool      # WatchedComm offers the twin too (Iallreduce ...)


_C = _Call
_CALLS = (
    # reductions
    _C("Allreduce", "s, r, op", "s, r, op", "all_reduce", 1, FIXED, "r", "r", "_NO_ROOT", "_mop(op)",
       "Iallreduce", True),
    _C("Reduce", "s, r, op, root", "s, r, op, root=root", "reduce", 2, FIXED, "(s if s is not _IN_PLACE else r)",
       "b", "root", "_mop(op)", "Ireduce", False),
    _C("Reduce_scatter_block", "s, r, op", "s, r, op", "reduce_scatter", 3, FIXED, "s", "s", "_NO_ROOT",
       "_mop(op)", "Ireduce_scatter_block", True),
    _C("Reduce_scatter", "s, r, counts, op", "s, r, counts, op", "reduce_scatter", 3, FIXED, "s", "s", "_NO_ROOT",
       "_mop(op)", "Ireduce_scatter", True),
    # data movement
    _C("Bcast", "buf, root", "buf, root=root", "broadcast", 4, FIXED, "buf", "buf", "root", "0", "Ibcast", False),
    _C("Allgather", "s, r", "s, r", "all_gather", 5, FIXED, "r", "s", "_NO_ROOT", "0", "Iallgather", True),
    _C("Allgatherv", "s, r", "s, r", "all_gather", 5, VARIES, "r", "s", "_NO_ROOT", "0", "Iallgatherv", False),
    _C("Gatherv", "s, r, root", "s, r, root=root", "gather", 6, VARIES, "s", "s", "root", "0", "Igatherv", False),
    _C("Scatterv", "s, r, root", "s, r, root=root", "scatter", 7, VARIES, "r", "r", "root", "0", "Iscatterv", False),
    _C("Alltoallv", "s, r", "s, r", "all_to_all", 8, ALLTOALL, "s", "s", "_NO_ROOT", "0", "Ialltoallv", False),
    _C("Barrier", "", "", "barrier", 9, BARRIER, "", "", "_NO_ROOT", "0", "Ibarrier", False),
    # point-to-point (sequence numbers count this rank's calls on the group; sends and receives are
    # counted per peer and compared at exit)
    _C("Send", "buf, dest, tag", "buf, dest=dest, tag=tag", "send", 0, P2P, "buf", "dest", "", "", "send", True),
    _C("Recv", "buf, source, tag", "buf, source=source, tag=tag", "recv", 0, P2P, "buf", "source", "", "", "recv",
       True),
    # picklable objects (polling mode: a watched Ibarrier first, every rank has arrived)
    _C("bcast", "obj, root", "obj, root=root", "broadcast_object", 10, OBJECT, "", "", "root", "0", "", False),
    _C("allgather", "obj", "obj", "all_gather_object", 11, OBJECT, "", "", "_NO_ROOT", "0", "", False),
    _C("gather", "obj, root", "obj, root=root", "gather_object", 12, OBJECT, "", "", "root", "0", "", False),
    _C("alltoall", "objs", "objs", "all_to_all_object", 13, OBJECT, "", "", "_NO_ROOT", "0", "", False),
)
_SOURCES: Dict[tuple, str] = {}


def _twin(c: _Call) -> str:
    if c.kind == P2P:
        return "I" + c.name.lower()
    return c.twin


def _stamp(c: _Call, mode: str) -> List[str]:
    """Lines that note the signature, stamp the call and add it to the group's check window (``e``, ``ck``)."""
    if c.kind == P2P:
        peer, send = c.described, c.twin == "send"
        return [f"e = self._rec({c.op!r}, buf.size, buf.dtype, {peer}, {mode == 'block'}, None, tag)",
                f"self._p2p(e, {peer}, {send})"]
    blocking = mode != "start"
    out, buf = [], c.counted
    if buf and not buf.isidentifier():
        out.append(f"b = {buf}")
        buf = "b"
    extra = "None"
    if c.kind == FIXED:
        out += ["g = self.group", "sh = g._sig_shape", "if sh is None:", f"    sh = {c.described}.shape", "else:",
                "    g._sig_shape = None"]
        sig, count = f"({c.code}, {buf}.dtype.num, sh, {c.root}, {c.redop})", f"{buf}.size, {buf}.dtype"
    elif c.kind in (VARIES, ALLTOALL):
        out.append("self.group._sig_shape = None")
        if c.kind == ALLTOALL:
            out.append("sc, rc = self._a2a(s, r)")
            extra = "(tuple(sc), tuple(rc))"
        sig, count = f"({c.code}, _dn(_dt({c.described})), _VARIES, {c.root}, 0)", f"*_n({buf})"
    else:
        shape = "()" if c.kind == BARRIER else "0"
        sig, count = f"({c.code}, 0, {shape}, {c.root}, {c.redop})", "0, None"
    out += [f"sig = {sig}", f"e = self._rec({c.op!r}, {count}, None, {blocking}, sig)", "ck = self.ck",
            "if ck is not None:", "    win = ck.win", f"    win.append((sig, e, e[_IDX], {extra}))"]
    if c.kind == BARRIER:            # a barrier is an exchange point: the window is compared before it returns
        out.append("    ck.exchange(e, True)")
    else:
        out += ["    if len(win) >= ck.every:", f"        ck.exchange(e, {blocking})"]
    return out


def _finish(c: _Call, mode: str) -> List[str]:
    """Lines that make the MPI call and complete the stamp (or turn its MPI error into an axonmpi error)."""
    collective = c.kind not in (P2P, BARRIER)   # _failed asks the others only about collectives
    twin = f"self.raw.{_twin(c)}({c.call})"
    if mode == "start":
        return [f"return _Watched({twin}, self.wd, e, {'ck' if c.kind != P2P else 'None'}, self)"]
    if mode == "poll":
        if c.kind == OBJECT:
            return ["self._w(e, self.raw.Ibarrier())", f"return self.raw.{c.name}({c.call})"]
        out = [f"self._w(e, {twin}{'' if collective else ', False'})"]
    else:
        out = ["try:", f"    out = self.raw.{c.name}({c.call})", "except BaseException as err:", "    e[_BLK] = False",
               f"    self._failed(err, e, {collective})", "    raise", "e[_T1] = _clock()"]
        if collective:
            out += ["if ck is not None and ck.strict:", "    ck.settle(True)"]
    if c.kind == BARRIER:
        out += ["if ck is not None:", "    ck.settle(True, e)"]
    return out + (["return out"] if mode == "block" else [])


def source(name: str, mode: str) -> str:
    """The generated source of method ``name`` in ``mode`` ("block", "start" or "poll")."""
    return _SOURCES[(name, mode)]


def methods(mode: str, namespace: dict) -> Dict[str, Callable]:
    """The methods of ``mode`` ("block" and "start": WatchedComm; "poll": PolledComm), compiled in
    ``namespace`` (the module whose names the bodies use)."""
    out = {}
    here = os.path.dirname(os.path.abspath(__file__))
    for c in _CALLS:
        if mode == "start" and not c.start:
            continue
        name = _twin(c) if mode == "start" else c.name
        body = _stamp(c, mode) + _finish(c, mode)
        text = (f"def {name}(self{', ' if c.args else ''}{c.args}):  # noqa: N802\n"
                + "".join(f"    {line}\n" for line in body))
        filename = os.path.join(here, f"<{mode} {name}>")   # inside the package: never taken for a call site
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        scope: dict = {}
        exec(compile(text, filename, "exec"), namespace, scope)   # noqa: S102 - the table above, nothing else
        out[name] = scope[name]
        _SOURCES[(name, mode)] = text
    return out
