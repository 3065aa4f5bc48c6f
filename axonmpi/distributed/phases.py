"""Known long phases (a checkpoint save or load, a first step): the watchdog waits while they make progress.

[Note: long phases and the watchdog's deadline]
A rank writing a 4 GiB checkpoint on a slow file system spends minutes outside MPI while the other
ranks wait for it in the save's next collective; with a deadline of ``AXONMPI_TIMEOUT`` seconds they
used to end the job as a hang, naming the writer as "in no axonmpi call". Code that knows it enters
a long phase says so with :func:`long_phase` (a stack per process, kept on the World's watchdog) and
calls :func:`heartbeat` as it makes progress (the checkpoint writer beats after every 64 MiB written
and every piece read). Each rank's state, which the watchdog's monitors exchange when a wait runs
long, carries its phases. When a wait reaches its deadline the monitor asks the ranks the call waits
for (:func:`late`): if one of them is in a phase whose last heartbeat is younger than the deadline
(or still within the phase's ``budget_s``), the wait's deadline moves to that heartbeat plus the
deadline, and the job goes on; a rank stuck in a phase (no heartbeat for a whole deadline) is
reported as before, and the report names its phase ("in CheckpointManager.save > checkpoint.save,
writing 2.1 GiB to ckpt/step-100 (1.0 GiB done; no progress for 10.2 s)"). When a job is ended by
the watchdog, every rank's monitor removes what its phases registered for cleanup (the save's
``.tmp-*`` folder) before the abort.
"""
from __future__ import annotations

import contextlib
import shutil
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

__all__ = ["long_phase", "heartbeat", "current_phases", "describe", "RAISE_DEADLINE"]

RAISE_DEADLINE = "raise the deadline with AXONMPI_TIMEOUT=<seconds> or axonmpi.init(timeout=<seconds>)"
_REASK_FLOOR_S = 5.0   # the shortest wait before asking a silent rank again (phases.late)


class _Phase:
    __slots__ = ("name", "detail", "started", "beat", "done", "total", "budget_s", "cleanup", "thread")

    def __init__(self, name: str, detail: str, total: Optional[int], budget_s: float):
        self.name, self.detail, self.total, self.budget_s = name, detail, total, float(budget_s)
        self.thread = threading.get_ident()     # heartbeats go to the calling thread's innermost phase
        self.started = self.beat = time.monotonic()
        self.done = 0
        self.cleanup: List[Callable[[], None]] = []


def _stack() -> Optional[list]:
    from . import world as _world
    w = _world._WORLD
    wd = None if w is None or w._destroyed else w.watchdog
    return None if wd is None else wd.phases


def _innermost() -> Optional[_Phase]:
    me = threading.get_ident()
    for ph in reversed(_stack() or []):
        if ph.thread == me:
            return ph
    return None


@contextlib.contextmanager
def long_phase(name: str, detail: str = "", *, total_bytes: Optional[int] = None,
               budget_s: float = 0.0) -> Iterator[Optional[_Phase]]:
    """Mark this rank as in a known long phase for the ``with`` block (see the Note above).

    Args:
        name: what the rank is in, as a report names it (``"CheckpointManager.save"``).
        detail: what it does there (``"writing 2.1 GiB to ckpt/step-100"``); the phase's ``detail``
            attribute may be changed inside the block.
        total_bytes: the bytes the phase moves, when known (reports say how many are done).
        budget_s: seconds the phase counts as alive without a heartbeat (a first step that compiles).

    Yields:
        The phase (None without a watchdog): ``heartbeat()`` reports progress on it.

    Example:
        >>> with long_phase("first step", budget_s=1800):
        ...     loss = train_step(batch)
    """
    stack = _stack()
    if stack is None:
        yield None
        return
    ph = _Phase(name, detail, total_bytes, budget_s)
    stack.append(ph)
    try:
        yield ph
    finally:
        stack.remove(ph)


def heartbeat(nbytes: int = 0) -> None:
    """Report progress in the innermost long phase of this rank (``nbytes`` more bytes done); cheap, thread-safe."""
    ph = _innermost()
    if ph is not None:
        ph.beat = time.monotonic()
        ph.done += int(nbytes)


def on_cleanup(fn: Callable[[], None]) -> None:
    """Run ``fn`` (once) when the watchdog ends the job while this rank is in its innermost long phase."""
    ph = _innermost()
    if ph is not None:
        ph.cleanup.append(fn)


def remove_tree_on_abort(path: str) -> None:
    """:func:`on_cleanup` removing the folder ``path`` (a save's temporary folder)."""
    on_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))


def current_phases(wd) -> List[Dict[str, Any]]:
    """This rank's phases (all threads'), outermost first, as plain data for the watchdog's state (ages in seconds)."""
    now = time.monotonic()
    return [{"name": p.name, "detail": p.detail, "since": now - p.started, "beat": now - p.beat,
             "done": p.done, "total": p.total, "budget_s": p.budget_s} for p in list(wd.phases)]


def describe(phases: List[Dict[str, Any]], age: float = 0.0) -> str:
    """"in A > B, <detail> (<done> done; no progress for <s> s)" for a rank's phases (``age``: seconds since
    the state was taken)."""
    if not phases:
        return ""
    from ..log import human
    inner = phases[-1]
    text = "in " + " > ".join(p["name"] for p in phases)
    detail = next((p["detail"] for p in reversed(phases) if p["detail"]), "")
    if detail:
        text += ", " + detail
    done = f"{human(inner['done'])} done; " if inner["done"] else ""
    return text + f" ({done}no progress for {inner['beat'] + age:.1f} s, in it for {inner['since'] + age:.1f} s)"


def _alive(phases: List[Dict[str, Any]], age: float, timeout: float) -> Optional[float]:
    """Seconds the phases of a rank stay alive from now (None: not in a live phase)."""
    if not phases:
        return None
    inner = phases[-1]
    left = max(timeout - (inner["beat"] + age), max(p["budget_s"] - (p["since"] + age) for p in phases))
    return left if left > 0 else None


def late(wd, e, idx: int, t0: float, now: float) -> bool:
    """True when the watchdog's call ``e`` (call index ``idx``, waited on since ``t0``) is past its deadline and
    no rank it waits for is in a long phase that still makes progress; when one is, the call's deadline moves
    (``wd.deadlines``) and this is False."""
    if now - t0 <= wd.timeout or now <= wd.deadlines.get(idx, 0.0):
        return False
    if len(wd.deadlines) > 64:
        wd.deadlines.clear()
    want = wd._peers(e)
    answers = wd._ask_states(want)
    left = [x for x in (_alive(st.get("phases") or [], 0.0, wd.timeout) for st in answers.values()) if x]
    if not left and set(want) - set(answers):
        # a rank that did not answer within ANSWER_S may be starved, not dead (a loaded node: a healthy slow save
        # was ended so): ask once more after another deadline before the verdict
        # (twice, each after the deadline or 30 s, whichever is shorter, but not before 5 s: a starved monitor
        # thread answers late, and under a 2 s deadline three asks 2 s apart still ended a healthy save)
        asked = wd.__dict__.setdefault("_unanswered", {})
        if asked.get(idx, 0) < 2:
            asked[idx] = asked.get(idx, 0) + 1
            wd.deadlines[idx] = now + max(min(wd.timeout, 30.0), _REASK_FLOOR_S)
            return False
    if not left:
        return True
    wd.deadlines[idx] = now + max(left)
    return False


def run_cleanups(wd) -> None:
    """The job is being ended by the watchdog: run every cleanup this rank's phases registered (once)."""
    for ph in list(getattr(wd, "phases", [])):
        fns, ph.cleanup = ph.cleanup, []
        for fn in fns:
            try:
                fn()
            except Exception:     # a cleanup must never stop the report
                pass
