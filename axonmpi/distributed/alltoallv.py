"""Variable-count all-to-all of rows: exchange the counts, then one ``alltoallv`` of the rows.

The token dispatcher of expert parallelism (``axonmpi.parallel.moe``) moves a different number of
rows to each rank every step. :func:`exchange_counts` tells every rank what it will receive, and
:func:`all_to_all_v` moves the rows: the piece a rank keeps for itself is copied locally, so the
backend moves exactly the rows that leave the rank (what a byte counter on the backend sees).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from .. import backend as _be
from .array_collectives import all_to_all
from .host_staging import _Staged, _backend, _check_dtype, _debug, _group
from .group import ProcessGroup

__all__ = ["exchange_counts", "all_to_all_v"]


def _counts(g, counts, what) -> np.ndarray:
    c = np.asarray(_be.to_host(counts) if _be.is_cupy_array(counts) else counts)
    if c.ndim != 1 or c.shape[0] != g.size or (c.size and (c.dtype.kind not in "iu" or c.min() < 0)):
        raise ValueError(f"rank {g.world.rank}: {what} must be {g.size} non-negative ints (one per rank of "
                         f"{g.name}), got {c.tolist() if c.size < 64 else c.shape}")
    return c.astype(np.int64)


def exchange_counts(counts, group: Optional[ProcessGroup] = None) -> np.ndarray:
    """Send row ``j`` of ``counts`` (shape ``(size, m)`` ints) to rank ``j``; return the rows received.

    Row ``i`` of the result is what rank ``i`` sent to this rank. Host int64 arrays (one small
    ``alltoallv`` of ``size * m`` int64 over the backend).

    Example (2 ranks, each sends ``[[r, r], [10 + r, 10 + r]]``):
        >>> exchange_counts(np.array([[r, r], [10 + r, 10 + r]]))    # on rank 1
        array([[10, 10], [11, 11]])
    """
    g = _group(group)
    c = np.ascontiguousarray(np.asarray(counts, dtype=np.int64))
    if c.ndim != 2 or c.shape[0] != g.size:
        raise ValueError(f"rank {g.world.rank}: exchange_counts needs a ({g.size}, m) array of counts "
                         f"(one row per rank of {g.name}), got shape {c.shape}")
    return c.copy() if g.size == 1 else all_to_all(c, group=g)


def all_to_all_v(x, send_counts: Sequence[int], recv_counts: Optional[Sequence[int]] = None,
                 group: Optional[ProcessGroup] = None) -> Tuple[object, np.ndarray]:
    """Send rows ``[sum(send_counts[:j]), sum(send_counts[:j+1]))`` of ``x`` to rank ``j``.

    Args:
        x: an array (NumPy or CuPy) whose axis 0 holds ``sum(send_counts)`` rows; the other axes
            (the row shape) are the same on every rank, and so is the dtype.
        send_counts: rows for each rank of the group, in group-rank order.
        recv_counts: rows coming from each rank, when already known (e.g. the reverse of an
            earlier exchange); ``None`` exchanges them first (:func:`exchange_counts`).
        group: the group (default: the World's).

    Returns:
        ``(rows, recv_counts)``: the rows received, source rank by source rank (this rank's own
        piece in its place), and the counts as a host int64 array.

    Example:
        >>> out, rc = all_to_all_v(tokens, [3, 0, 5, 1], group=grid.group_for("expert"))
    """
    g = _group(group)
    p = g.size
    xp = _be.get_array_module(x)
    x = xp.ascontiguousarray(x)
    sc = _counts(g, send_counts, "send_counts")
    if x.ndim == 0 or int(sc.sum()) != x.shape[0]:
        raise ValueError(f"rank {g.world.rank}: all_to_all_v sends {int(sc.sum())} rows (send_counts "
                         f"{sc.tolist()}) but x has shape {x.shape}")
    _check_dtype(g, x.dtype, "all_to_all_v")
    rc = exchange_counts(sc.reshape(p, 1), g).reshape(p) if recv_counts is None \
        else _counts(g, recv_counts, "recv_counts")
    row = x.shape[1:]
    width = int(np.prod(row, dtype=np.int64))
    _debug(g, "all_to_all_v", row=row, dtype=x.dtype)
    out = xp.empty((int(rc.sum()),) + row, x.dtype)
    me = g.rank
    s0, r0 = int(sc[:me].sum()), int(rc[:me].sum())
    if sc[me] != rc[me]:
        raise ValueError(f"rank {g.world.rank}: all_to_all_v keeps {int(sc[me])} rows for itself but "
                         f"recv_counts says {int(rc[me])}")
    out[r0:r0 + int(rc[me])] = x[s0:s0 + int(sc[me])]
    if p == 1:
        return out, rc
    # the off-rank pieces only: the self piece never reaches the backend (every rank still calls it)
    keep_s = np.ones(x.shape[0], bool)
    keep_s[s0:s0 + int(sc[me])] = False
    keep_r = np.ones(out.shape[0], bool)
    keep_r[r0:r0 + int(rc[me])] = False
    send = x[xp.asarray(keep_s)] if sc[me] else x
    scnt = sc.copy()
    scnt[me] = 0
    rcnt = rc.copy()
    rcnt[me] = 0
    be = _backend(g, send)
    stage = _Staged(be, send)
    hsend = stage.host(send.reshape(-1))
    recv = stage.empty(hsend, int(rcnt.sum()) * width)
    be.alltoallv(hsend, (scnt * width).tolist(), recv, (rcnt * width).tolist())
    got = stage.back(recv, send).reshape((-1,) + row)
    if rc[me]:
        out[xp.asarray(keep_r)] = got
    else:
        out = got
    return out, rc

