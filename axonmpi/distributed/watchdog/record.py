"""The flight recorder's entries: their fields, call sites, and call signatures as text.

A ring slot is a list: the 12 public fields of :data:`CALL_FIELDS`, then its call index, whether the
main thread blocks in it, the tag of a point-to-point call, the package function the user called (code
object) and the call's signature ``(op code, dtype number, shape, root, reduce op)``; the call site is
kept as code object + instruction offset and turned into file:line only when a record is read.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np
from mpi4py import MPI

__all__ = ["CALL_FIELDS", "call_site", "sig_text"]

SPIN_S = 20e-3         # polling mode: test in a tight loop this long before sleeping between tests
BURST_S = 2e-4         # polling mode: after each pause, test this long
MAX_SLEEP_S = 1e-3     # polling mode: the longest pause between two tests of a pending request
LISTEN_S = 0.1         # the monitor looks for questions (and exited ranks) this often
ANSWER_S = 2.0         # how long the reporting rank waits for the others' answers
EXIT_GRACE_S = 1.0     # a call involving an exited rank gets this long to complete anyway
PEEK_S = 1.0           # a call blocked this long: ask the ranks it waits for what they are doing (then 2, 4, .. s)
QUIET_S = 5.0          # a peer that used the group this recently is still at work there (no tag verdict yet)
# the same for a peer blocked in no call (computing: a pipeline stage's long forward); AXONMPI_WATCHDOG_IDLE_QUIET_S
IDLE_QUIET_S = float(os.environ.get("AXONMPI_WATCHDOG_IDLE_QUIET_S", "30"))
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


_DIST = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # .../axonmpi/distributed
_PKG = os.path.dirname(_DIST)                                         # .../axonmpi
_clock = time.perf_counter
_getframe = sys._getframe
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


def _site(e, idx) -> str:
    """``file:line`` of ring entry ``e`` while it still holds call ``idx`` (else ``?``)."""
    if e is None or e[_IDX] != idx or isinstance(e[_FILE], str):
        return "?" if e is None or e[_IDX] != idx or e[_FILE] == "?" else _where(e)
    return _where(_public(e))


# -- call signatures (see the Note on the always-on check, check.py) -----------------------------------
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

