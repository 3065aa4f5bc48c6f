"""Timelines: per-rank Chrome/Perfetto traces of collectives, forward/backward, pipeline, FSDP and checkpoints.

``AXONMPI_TRACE=DIR`` traces a whole run (from ``axonmpi.init()`` to exit); ``with
axonmpi.profile(DIR):`` traces a block. Each rank writes ``DIR/trace_rank<r>.json`` (Chrome's
trace-event format: open it in https://ui.perfetto.dev or chrome://tracing);
``axonmpi trace merge DIR`` writes ``DIR/trace.json``, one timeline with a row per rank.
Collectives come from the flight recorder (:mod:`axonmpi.distributed.watchdog`), so they are
traced when the watchdog is on (the default). Imports only :mod:`axonmpi.env` and :mod:`axonmpi.log`
(it sits below :mod:`axonmpi.distributed`, whose watchdog feeds it).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import json
import os
import time
from typing import Iterator, List, Optional

__all__ = ["Tracer", "profile", "span", "traced", "active", "merge", "load_trace", "analyze"]

_clock = time.perf_counter
_ACTIVE: "Optional[Tracer]" = None   # the tracer of this process while a trace runs


class Tracer:
    """Collects one rank's events and writes them as a Chrome trace.

    Attributes:
        directory: where ``trace_rank<rank>.json`` is written.
        rank: the rank (the trace's process id, so merged ranks get one row each).
        events: complete events ``(name, category, start, end, args)`` in ``perf_counter`` seconds.
        calls: flight-recorder entries of the collectives made while tracing.
    """

    def __init__(self, directory: str, rank: int):
        self.directory, self.rank = str(directory), int(rank)
        self.events: List[tuple] = []
        self.calls: List[list] = []
        self.wall0, self.t0 = time.time(), _clock()

    def _us(self, t: float) -> float:
        return (t - self.t0 + self.wall0) * 1e6

    def to_chrome(self) -> dict:
        """The trace as Chrome's JSON object (``traceEvents``, ``displayTimeUnit``)."""
        ev = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}}]
        for name, cat, t0, t1, args in self.events:
            ev.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": 0,
                       "ts": self._us(t0), "dur": max(0.0, (t1 - t0) * 1e6), "args": args})
        now = _clock()
        for e in self.calls:   # see watchdog.CALL_FIELDS
            seq, op, group, ranks, count, dtype, nbytes, peer, t0, t1, file, line = e[:12]
            t1 = now if t1 is None else t1
            ev.append({"name": op, "cat": "collective", "ph": "X", "pid": self.rank, "tid": 1,
                       "ts": self._us(t0), "dur": max(0.0, (t1 - t0) * 1e6),
                       "args": {"seq": seq, "group": group, "ranks": list(ranks), "count": count,
                                "dtype": str(dtype), "bytes": nbytes, "peer": peer,
                                "site": f"{os.path.basename(file)}:{line}"}})
        ev.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1, "args": {"name": "communication"}})
        ev.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "compute"}})
        return {"traceEvents": ev, "displayTimeUnit": "ms"}

    def write(self) -> str:
        """Write ``directory/trace_rank<rank>.json``; return its path."""
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"trace_rank{self.rank}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome(), f)
        return path


def active() -> "Optional[Tracer]":
    """The running tracer, or None."""
    return _ACTIVE


class _Span:
    __slots__ = ("tr", "name", "cat", "args", "t0")

    def __init__(self, tr, name, cat, args):
        self.tr, self.name, self.cat, self.args = tr, name, cat, args

    def __enter__(self):
        self.t0 = _clock()
        return self

    def __exit__(self, *exc):
        self.tr.events.append((self.name, self.cat, self.t0, _clock(), self.args))
        return False


_NULL = contextlib.nullcontext()


def span(name: str, cat: str = "axonmpi", **args):
    """A context manager timing a block as one event (nothing, cheaply, when no trace runs).

    Example:
        >>> with axonmpi.trace.span("checkpoint.write", "checkpoint", step=7):
        ...     write_shards()
    """
    tr = _ACTIVE
    if tr is None:
        return _NULL
    return _Span(tr, name, cat, args)


def traced(name: str, cat: str):
    """Decorator: each call of the function is one event while a trace runs (a check otherwise)."""
    def deco(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            tr = _ACTIVE
            if tr is None:
                return fn(*args, **kwargs)
            t0 = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                tr.events.append((name, cat, t0, _clock(), {}))
        return run
    return deco


def start(directory: str, rank: int) -> Tracer:
    """Start tracing this process into ``directory`` (used by :func:`profile` and ``AXONMPI_TRACE``)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError(f"rank {rank}: a trace into {_ACTIVE.directory!r} already runs; "
                           "end it before starting another")
    _ACTIVE = Tracer(directory, rank)
    return _ACTIVE


def stop() -> Optional[str]:
    """Stop the running trace and write it; return the file written (None when none ran)."""
    global _ACTIVE
    tr, _ACTIVE = _ACTIVE, None
    return None if tr is None else tr.write()


def start_from_env(rank: int) -> None:
    """Trace the whole run when ``AXONMPI_TRACE`` names a folder (written at exit)."""
    from .env import get_str
    d = get_str("AXONMPI_TRACE")
    if d and _ACTIVE is None:
        start(d, rank)
        atexit.register(stop)


@contextlib.contextmanager
def profile(directory: "str | os.PathLike") -> Iterator[Tracer]:
    """Trace the block into ``directory/trace_rank<r>.json`` (every rank of the World).

    Example:
        >>> with axonmpi.profile("traces/"):
        ...     for step in range(3):
        ...         train_step()
        >>> # then: axonmpi trace merge traces/   (one timeline in traces/trace.json)
    """
    from .log import rank_info      # the World's rank once axonmpi.init ran (this module sits below distributed)
    tr = start(os.fspath(directory), rank_info()[0])
    try:
        yield tr
    finally:
        stop()


def load_trace(path: str) -> dict:
    """Read one trace file (raises ValueError naming the file when it is not a Chrome trace)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise ValueError(f"{path} is not a Chrome trace (no 'traceEvents')")
    return data


def merge(directory: "str | os.PathLike", out: Optional[str] = None) -> str:
    """Merge every ``trace_rank*.json`` of ``directory`` into one timeline; return its path.

    Raises:
        FileNotFoundError: no ``trace_rank*.json`` in ``directory``.
    """
    directory = os.fspath(directory)
    files = sorted(glob.glob(os.path.join(directory, "trace_rank*.json")))
    if not files:
        raise FileNotFoundError(f"no trace_rank*.json in {directory!r}; write them with AXONMPI_TRACE={directory} "
                                f"or `with axonmpi.profile({directory!r}):`")
    events = []
    for p in files:
        events.extend(load_trace(p)["traceEvents"])
    out = out or os.path.join(directory, "trace.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return out


def _site(c: dict) -> str:
    return f"{os.path.basename(str(c.get('file')))}:{c.get('line')}"


def _what(c: dict) -> str:
    peer = f" peer {c['peer']}" if c.get("peer") is not None else ""
    tag = f" tag {c['tag']}" if c.get("peer") is not None and c.get("tag", -1) != -1 else ""
    shape = f", shape {tuple(c['shape'])}" if isinstance(c.get("shape"), list) else ""
    root = f", root {c['root']}" if c.get("root", -1) not in (-1, None) else ""
    return f"{c['op']}({c['count']} x {c['dtype']}{shape}{root}{peer}{tag}) at {_site(c)}"


def analyze(directory: "str | os.PathLike") -> str:
    """Read the flight records (``flight_rank*.json``) of ``directory``; name the first divergence.

    For each group, calls are lined up by their per-group sequence number. The first number
    where the ranks disagree (another op, count or dtype, or some ranks never made the call,
    or it never completed) is reported with every rank's call and file:line.

    Raises:
        FileNotFoundError: no ``flight_rank*.json`` in ``directory``.
    """
    directory = os.fspath(directory)
    files = sorted(glob.glob(os.path.join(directory, "flight_rank*.json")))
    if not files:
        raise FileNotFoundError(f"no flight_rank*.json in {directory!r} (the watchdog writes them there when "
                                "AXONMPI_FLIGHT_DIR names it; axonmpi.distributed.dump_flight_record() on demand)")
    records = {}
    for p in files:
        with open(p, encoding="utf-8") as f:
            d = json.load(f)
        records[d["rank"]] = d
    lines = [f"flight records of ranks {sorted(records)} in {directory}"]
    groups = {}
    for r, d in records.items():
        for c in d["calls"]:
            if c["op"] in ("send", "recv", "collective check"):
                continue        # point-to-point numbers count one rank's calls; they do not line up (nor does
                                # the always-on check's last exchange at exit)
            groups.setdefault((c["group"], tuple(c["ranks"])), {}).setdefault(r, {})[c["seq"]] = c
    found = []
    for (name, ranks), per_rank in sorted(groups.items()):
        have = [r for r in ranks if r in records]
        lo = max(min(per_rank.get(r, {0: None})) for r in have)          # the ring may have dropped old calls
        hi = max(max(per_rank.get(r, {-1: None})) for r in have)
        for seq in range(lo, hi + 1):
            calls = {r: per_rank.get(r, {}).get(seq) for r in have}
            sigs: dict = {}
            for r, c in calls.items():
                key = "never made it" if c is None else (_what(c) + (" (never completed)" if c["t_end"] is None else ""))
                sigs.setdefault(key, []).append(r)
            if len(sigs) > 1:
                text = "; ".join(f"ranks {rs}: {k}" for k, rs in sigs.items())
                missing = [r for r, c in calls.items() if c is None]
                last = ""
                for r in missing:
                    mine = per_rank.get(r, {})
                    prev = [c for q, c in mine.items() if q < seq]
                    if prev:
                        c = max(prev, key=lambda c: c["seq"])
                        last += f" Rank {r}'s last call on {name} is #{c['seq']} {_what(c)}."
                found.append((seq, f"group {name} (ranks {list(ranks)}): first divergence at call #{seq}: {text}.{last}"))
                break
    if not found:
        lines.append("no divergence: every group's calls agree on every rank")
    else:
        lines += [t for _, t in sorted(found, key=lambda x: x[0])]
    return "\n".join(lines)
