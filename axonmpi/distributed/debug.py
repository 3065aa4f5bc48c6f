"""Debug mode (``AXONMPI_DEBUG=1``): check that all ranks of a group call the same collective alike."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

import numpy as np

from .. import env as _env

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "check_collective", "check_same_object"]

_SIG_BYTES = 1024


class CollectiveMismatchError(RuntimeError):
    """Ranks of a group called different collectives, or the same one with different arguments."""


class CollectiveTimeoutError(RuntimeError):
    """In debug mode, some ranks of a group never reached a collective the others entered."""


def _timeout() -> float:
    return _env.get_float("AXONMPI_DEBUG_TIMEOUT")


def _describe(sig: Tuple) -> str:
    name, fields = sig[0], sig[1:]
    return f"{name}(" + ", ".join(f"{k}={v}" for k, v in fields) + ")"


def check_collective(group, name: str, **fields: Any) -> None:
    """Raise on every rank of ``group`` unless all ranks pass the same ``name`` and ``fields``.

    Uses a fixed-size non-blocking all-gather of the call's signature, so a rank that never
    arrives is reported as a timeout (``AXONMPI_DEBUG_TIMEOUT`` seconds, default 300)
    instead of a silent hang.
    """
    sig = (name,) + tuple(sorted((k, _fmt(v)) for k, v in fields.items()))
    _exchange(group, sig, _describe(sig))


def check_same_object(group, obj: Tuple, what: str) -> None:
    """Raise on every rank unless all ranks of ``group`` pass an equal ``obj`` (for group setup)."""
    _exchange(group, (what, ("value", repr(obj))), what)


def _fmt(v: Any) -> str:
    if isinstance(v, np.dtype):
        return str(v)
    if hasattr(v, "name") and hasattr(v, "value"):  # enum
        return v.name
    return repr(v) if not isinstance(v, str) else v


def _exchange(group, sig: Tuple, text: str) -> None:
    comm = group.comm
    raw = repr(sig).encode()[:_SIG_BYTES]
    send = np.zeros(_SIG_BYTES + 4, np.uint8)
    send[:4] = np.frombuffer(np.uint32(len(raw)).tobytes(), np.uint8)
    send[4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
    recv = np.empty((group.size, _SIG_BYTES + 4), np.uint8)
    req = comm.Iallgather(send, recv)
    deadline = time.monotonic() + _timeout()
    delay = 1e-5
    while not req.Test():
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"rank {group.world.rank}: waited {_timeout():.0f} s in {text} on {group.name} "
                f"{list(group.ranks)}; some ranks of the group never called it (they are stuck "
                "elsewhere or called a different sequence of collectives)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    sigs: List[bytes] = []
    for row in recv:
        n = int(np.frombuffer(row[:4].tobytes(), np.uint32)[0])
        sigs.append(row[4:4 + n].tobytes())
    if all(s == sigs[0] for s in sigs):
        return
    by_sig: Dict[bytes, List[int]] = {}
    for grank, s in enumerate(sigs):
        by_sig.setdefault(s, []).append(group.ranks[grank])
    lines = []
    for s, ranks in by_sig.items():
        try:
            desc = _describe(eval(s.decode(), {"__builtins__": {}}))  # our own repr of str tuples
        except Exception:
            desc = s.decode(errors="replace")
        lines.append(f"  world ranks {ranks} called {desc}")
    raise CollectiveMismatchError(
        f"rank {group.world.rank}: ranks of {group.name} disagree on a collective:\n" + "\n".join(lines)
    )
