"""Naming the cause of a hang while it lasts: the questions a blocked call asks the ranks it waits for.

Mismatches MPI cannot complete hang instead. A call blocked ``PEEK_S`` asks the ranks it waits for
(their monitors answer on the watchdog communicator, ``_PEEK``) for their state: the calls they are
blocked in, their last collectives per group with signatures, their last sends with tags. When two
questions in a row show the same cause (different collectives, roots or shapes at one call number,
two groups with the same members, a rank outside an API the others are in, a tag nobody sends, a
rank that finished without the call), the job ends at once with it (:meth:`Watchdog.cause`). An MPI
error in a collective asks the same question (:meth:`Watchdog.ask_about`) and becomes the mismatch
"""
from __future__ import annotations

import pickle
import sys
import time
from typing import Any, Dict, List, Optional

from .record import (_API, _FINAL, _GROUP, _IDX, _OP, _PEEK, _PEER, _RANKS, _SEQ, _SIG, _T0, _T1, _TAG, ANSWER_S,
                     PEEK_MAX_S, PEEK_S, QUIET_S, IDLE_QUIET_S, _by_call, _call_text, _desc, _full, _where)

__all__: List[str] = []   # private to the watchdog package


class _Diagnosis:
    """The part of :class:`~axonmpi.distributed.watchdog.Watchdog` that asks the other ranks what they are
    doing and reads a cause in their answers (see the Note at the top)."""

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
        # an answer to one of the two questions before this one counts too: the verdict on a silent rank asks three
        # times (phases.late), and a monitor thread starved on a loaded node answered each question after the
        # next one was out, so every answer was dropped and a healthy slow save was ended (make test, twice);
        # such an answer is a few seconds old at most, and a stale one only delays a verdict by one deadline
        def fresh(a):
            return a[0] is not None and a[0] >= rnd - 2

        end = time.monotonic() + ANSWER_S
        while time.monotonic() < end:
            self._drain()
            if all(fresh(self._peeked.get(r, (None,))) for r in want):
                break
            time.sleep(0.005)
        return {r: a[1] for r, a in list(self._peeked.items()) if fresh(a) and r in want}

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
            # a peer in no call is computing and may send the tag when it is done: a long stage under load took
            # over 5 s and was ended as a mismatch; it gets IDLE_QUIET_S (a peer blocked elsewhere cannot send)
            quiet = QUIET_S if st.get("blocked") else IDLE_QUIET_S
            if ages and min(ages) < quiet:
                return None
            sent = [f for f in st["sends"].get((e[_GROUP], e[_RANKS], self.rank), [])]
            tags = sorted({f[_TAG] for f in sent})
            if sent and e[_TAG] not in tags:
                return (f"world rank {peer} sent {len(sent)} message(s) to this rank on {e[_GROUP]} with tag(s) {tags} "
                        f"(the last at {_where(sent[-1])}) and none with tag {e[_TAG]}, which this rank waits for at "
                        f"{_where(e)}: a tag nobody sends")
        return None

