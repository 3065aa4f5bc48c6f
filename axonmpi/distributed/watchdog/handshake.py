"""The exit handshake: ranks announce their exit, settle the collective checks and compare point-to-point counts.

[Note: point-to-point accounting]
Each :class:`WatchedComm` counts the sends it posts to and the receives it posts from each peer.
At exit (the watchdog's exit barrier, or ``World.destroy``) the ranks exchange the counts
(``Ialltoall`` on the watchdog communicator): a rank whose sends to a peer outnumber that peer's
receives from it names them and its last send's call site, and the job ends with exit 1 (from
``destroy()``: a ``RuntimeError`` on every rank). A send nobody receives is otherwise invisible:
small messages complete eagerly.


A rank whose Python process ends (end of script, ``sys.exit``) announces it on the watchdog
communicator and waits for the others in a barrier that answers questions. A rank waiting on
a call that an exited rank never made reports within ``EXIT_GRACE_S`` instead of after the
"""
from __future__ import annotations

import atexit
import os
import pickle
import sys
import time
from typing import List

import numpy as np
from mpi4py import MPI

from .record import _EXIT, _FILE, _IDX, _public, _where

__all__: List[str] = []   # private to the watchdog package


class _Handshake:
    """The part of :class:`~axonmpi.distributed.watchdog.Watchdog` that ends a job together (see the Note at
    the top)."""

    def _at_exit(self) -> None:
        """Tell the others this rank has ended, wait for all (answering questions), stop the listener."""
        if self._closed:
            return
        last = self._exit_notice()
        self.exited[self.rank] = last
        msg = pickle.dumps(last)
        for r in range(self.size):
            if r != self.rank:
                self._post(msg, r, _EXIT)
        self._expected_notices = self.size - 1
        self._settle_checks()   # after the announcement: a rank waiting for a call this one never made hears of it
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

    def _exit_notice(self) -> dict:
        """What an exiting rank tells the others: the number of its last collective call on each group (keyed
        by name and ranks), read from each group's own counter -- not from the flight ring, which forgets a
        group's calls once they are older than its capacity: a rank then read as having made no call on a group
        whose last exchange it was about to make, and a passing job ended with exit 1.  Groups of one name and
        ranks (a tied "embedding" group per pipelined model) share a key, so the largest number counts: a call
        the exited rank never made on one of them may then be found at the deadline instead of within
        ``EXIT_GRACE_S``, but a call it did make is never taken for one it did not."""
        last = {}
        for c in self._comms:
            if c.seq:
                key = (c.name, c.ranks)
                last[key] = max(last.get(key, -1), c.seq - 1)
        return last

    def _settle_checks(self) -> None:
        """At exit: every group's last window is exchanged and verified (all started first, then waited
        for: the groups' order may differ between ranks)."""
        from ..debug import CollectiveMismatchError
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

