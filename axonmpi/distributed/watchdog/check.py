"""The always-on collective check: each group's calls compared across its ranks, batched.

[Note: the always-on collective check]
Every collective through a :class:`WatchedComm` is also checked across its group, debug mode or not
(``AXONMPI_CHECK_COLLECTIVES=1``, the default). Each call's signature is ``(op code, wire dtype
number, shape, root, reduce op)``: the shape the caller passed (the collective notes it on the group,
``group._sig_shape``, when the backend gets a flat buffer; ``-1`` for the v-collectives, whose counts
differ by design). The check runs on the group's check communicator (a duplicate made with the
group, used for nothing else), so it covers the group too.

A per-call exchange costs a second small collective per call (about 8 us on a loop of one-element
all-reduces), so the check is batched: each call only appends ``(signature, ring entry)`` to the
group's window; every ``AXONMPI_CHECK_EVERY`` calls (64), at every barrier (an exchange point: the
window is compared before it returns) and at exit or ``free`` (the last exchange, after the exit is
announced), the window is hashed and a persistent non-blocking ``Allreduce(SUM)`` of five uint64 lanes
starts: two ``b``-bit hashes ``h1, h2`` of the window, their squares, and the window's all-to-all
balance. ``n * sum(h^2) == sum(h)^2`` holds only when all ``n`` hashes are equal, and with
``b = (63 - log2 n) / 2`` the sums are exact. The balance: for every count an ``Alltoallv`` sends,
the sender adds a 64-bit mix of (call, source, destination, count) and the receiver subtracts the mix
of the count it expects, so the group's sum is 0 (mod 2^64) only when every receiver expects what
its sender sends. Exchanges are verified in order at the next exchange (waiting for them before a
blocking call: they completed once every rank entered the window's calls; a rank must not block in a
later call while another raises for an earlier one), so a mismatch MPI completes without complaint is
raised within two windows; ``AXONMPI_CHECK_EVERY=1`` verifies each call's exchange before it returns.
A difference is seen at the same exchange on every rank; the ranks then send their windows to group
rank 0 point-to-point on the check communicator
(:func:`axonmpi.distributed.debug.name_window_mismatch`, debug mode's protocol), which names the
first call they disagree on, or the counts that do not match, and every rank raises
:class:`~axonmpi.distributed.debug.CollectiveMismatchError`.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
from mpi4py import MPI

from .record import _BLK, _FINAL, _IDX, _M64, _NO_ROOT, _clock, _site

__all__: List[str] = []   # private to the watchdog package

_SLOTS = 4                     # exchanges in flight per group before the oldest must be verified
_LANES = 5                     # h1, h1^2, h2, h2^2, all-to-all balance (uint64, summed)


class _Checks:
    """One group's always-on collective check, batched (see the Note at the top): the signatures of the
    calls since the last exchange, and a ring of persistent ``Allreduce(SUM)`` exchanges of their hash on
    the group's check communicator, verified in order."""

    def __init__(self, group, comm, wd, wc):
        self.group, self.comm, self.wd, self.wc = group, comm, wd, wc
        self.every = wd.check_every
        self.strict = self.every == 1   # verify after every call (the result is never handed back unchecked)
        self.win: List[tuple] = []      # (signature, ring entry, its call index, extra) of the calls not exchanged
        self.first = 0                  # the call number of win[0]
        self.a2a = 0                    # the window's all-to-all balance (mod 2^64)
        self.sbuf = np.zeros((_SLOTS, _LANES), np.uint64)
        self.rbuf = np.zeros((_SLOTS, _LANES), np.uint64)
        self.reqs = [None] * _SLOTS
        self.pending: List[tuple] = []  # (slot, window, first call number) of exchanges started, in order
        self.started = 0                # exchanges started
        self.persistent = True          # MPI-4 persistent collectives; else one Iallreduce per exchange
        n = max(group.size, 2)
        self.bits = (63 - (n - 1).bit_length()) // 2     # n * (2^bits)^2 < 2^64: the sums are exact
        self.mask = (1 << self.bits) - 1

    @property
    def calls(self) -> int:
        """Collective calls made on the group so far."""
        return self.first + len(self.win)

    def _request(self, k):
        if self.persistent:
            try:
                return self.comm.Allreduce_init(self.sbuf[k], self.rbuf[k], MPI.SUM)
            except (NotImplementedError, AttributeError):   # below MPI 4: the same order on every rank
                self.persistent = False
        return self.comm.Iallreduce(self.sbuf[k], self.rbuf[k], MPI.SUM)

    def exchange(self, e, block: bool) -> None:
        """Verify the earlier exchanges (waiting for them before a blocking call ``e``: they completed once
        every rank entered their calls; a rank must not block in a call while another raises for an earlier
        one), then start the exchange of the window (which holds ``e``'s own signature last)."""
        if self.pending:
            try:
                self.settle(block, e)
            except BaseException:
                if self.win and self.win[-1][1] is e:
                    self.win.pop()     # this call never starts
                e[_BLK] = False
                raise
        if len(self.pending) >= _SLOTS:
            self.settle(True, e, upto=1)
        win = self.win
        h = hash(tuple([w[0] for w in win])) & _M64
        h1, h2 = h & self.mask, (h >> 32) & self.mask
        k = self.started % _SLOTS
        sb = self.sbuf[k]
        sb[0], sb[1], sb[2], sb[3], sb[4] = h1, h1 * h1, h2, h2 * h2, self.a2a
        req = self.reqs[k]
        if req is None or not self.persistent:
            req = self.reqs[k] = self._request(k)
        if self.persistent:
            req.Start()
        self.pending.append((k, win, self.first))
        self.started += 1
        self.first += len(win)
        self.win = []
        self.a2a = 0

    def settle(self, wait: bool, e=None, upto: Optional[int] = None) -> None:
        """Verify the pending exchanges in order; without ``wait``, stop at one not yet complete."""
        n = 0
        while self.pending and (upto is None or n < upto):
            k, win, first = self.pending[0]
            req = self.reqs[k]
            if not req.Test():
                if not wait:
                    return
                self._wait(req, e if e is not None else (win[-1][1] if win else None))
            self.pending.pop(0)
            n += 1
            r = [int(v) for v in self.rbuf[k]]
            size = self.group.size
            if size * r[1] != r[0] * r[0] or size * r[3] != r[2] * r[2] or r[4] != 0:
                self._mismatch(win, first, r[4] != 0)

    def final(self) -> None:
        """Start the exchange of what is left (exit, ``free``): every rank that used the group makes it."""
        if self.calls or self.pending:
            e = self.wc._rec(_FINAL, 0, None, None, True, (0, 0, 0, _NO_ROOT, 0))
            self.exchange(e, False)

    def _wait(self, req, e) -> None:
        """A watched wait for an exchange (the monitor holds its deadline, naming ``e``)."""
        wd = self.wd
        if e is None:
            req.Wait()
            return
        if wd.polling:
            wd.wait(req, e)
            return
        wd.cur_wait = (e, e[_IDX], _clock())
        try:
            req.Wait()
        finally:
            wd.cur_wait = None

    def _mismatch(self, win, first: int, counts: bool) -> None:
        from ..debug import CollectiveMismatchError, name_window_mismatch
        g = self.group
        mine = [(first + i, sig, _site(e, idx), extra) for i, (sig, e, idx, extra) in enumerate(win)]
        lines = name_window_mismatch(g, self.comm, mine, timeout=min(self.wd.timeout, 60.0))
        what = "all-to-all counts" if counts else "collective calls"
        last = first + len(win) - 1
        calls = f"#{first}" if last <= first else f"#{first}-#{last}"
        raise CollectiveMismatchError(
            f"rank {g.world.rank}: ranks of {g.name} disagree on {what} {calls} (found by the always-on "
            f"check, which compares every {self.every} calls, at barriers and at exit; AXONMPI_CHECK_EVERY=1 "
            f"compares each call before it returns):\n{lines}")

    def close(self) -> None:
        for req in self.reqs:
            if req is not None:
                try:
                    if req.Test():
                        req.Free()
                except Exception:
                    pass
        self.reqs = [None] * _SLOTS

