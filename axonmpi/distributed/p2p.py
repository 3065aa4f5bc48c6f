"""Point-to-point: send, recv, isend, irecv, P2POp, batch_isend_irecv (conventions:
:mod:`axonmpi.distributed.collectives`)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from .backends.base import P2PBuffer
from .group import ProcessGroup
from .work import Work
from .interop import any_array, any_array_p2p
from .host_staging import _ND, _Staged, _as_array, _backend, _check_dtype, _flat, _group

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]


def _check_peer(g, peer, what, allow_self=False):
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
        raise TypeError(f"rank {g.world.rank}: {what} must be an int group rank, got {peer!r}")
    if not 0 <= peer < g.size:
        raise ValueError(
            f"rank {g.world.rank}: {what}={peer} is out of range for {g.name} of size {g.size} "
            f"(valid: 0..{g.size - 1}; ranks are group-relative)"
        )
    if peer == g.rank and not allow_self:
        raise ValueError(
            f"rank {g.world.rank}: {what}={peer} is this rank itself; a self-send would hang "
            "(pair it with its receive in one batch_isend_irecv)"
        )
    return int(peer)


def _check_tag(g, tag, what="tag"):
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag <= g.max_tag:
        raise ValueError(f"rank {g.world.rank}: {what}={tag!r} must be an int in 0..{g.max_tag}")
    return int(tag)


def _send_buf(g, x, what):
    """(backend, the contiguous buffer to send) for array ``x``."""
    x = _as_array(x, what)
    _check_dtype(g, x.dtype, what)
    be = _backend(g, x)
    return be, _Staged(be, x).host(_flat(x))


def _recv_buf(g, x, what):
    """(x, backend, buffer the backend fills, finish) for receiving into array ``x``.

    The backend writes straight into ``x`` when it can (contiguous, memory it moves);
    otherwise into a temporary that ``finish()`` copies into ``x``.
    """
    x = _as_array(x, what)
    _check_dtype(g, x.dtype, what)
    if type(x) is _ND and not x.flags.writeable:
        raise ValueError(f"rank {g.world.rank}: {what} is read-only; a receive writes into it")
    be = _backend(g, x)
    stage = _Staged(be, x)
    if not stage.dev and x.flags.c_contiguous:
        return x, be, x.reshape(-1), None
    buf = stage.empty(x, x.size)

    def finish():
        stage.fill(x, buf)
        return x

    return x, be, buf, finish


@any_array
def send(x, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> None:
    """Send array ``x`` to group rank ``dst`` (blocking). The receiver needs a buffer of the same size."""
    g = _group(group)
    dst = _check_peer(g, dst, "dst")
    tag = _check_tag(g, tag)
    be, buf = _send_buf(g, x, "x")
    be.send(buf, dst, tag)


@any_array
def recv(x, src: int, group: Optional[ProcessGroup] = None, tag: int = 0):
    """Receive into array ``x`` (in place) from group rank ``src``; return ``x``."""
    g = _group(group)
    src = _check_peer(g, src, "src")
    tag = _check_tag(g, tag)
    x, be, buf, finish = _recv_buf(g, x, "x")
    be.recv(buf, src, tag)
    return x if finish is None else finish()


@any_array
def isend(x, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Work:
    """Non-blocking :func:`send`; returns a :class:`Work` (keep it and ``wait()`` on it).

    ``x`` must stay unmodified until the Work completes (it may be sent from in place).
    """
    g = _group(group)
    dst = _check_peer(g, dst, "dst")
    tag = _check_tag(g, tag)
    be, buf = _send_buf(g, x, "x")
    return Work(be.isend(buf, dst, tag), keep=buf)


@any_array
def irecv(x, src: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Work:
    """Non-blocking :func:`recv` into ``x``; ``wait()`` returns ``x`` once filled."""
    g = _group(group)
    src = _check_peer(g, src, "src")
    tag = _check_tag(g, tag)
    x, be, buf, finish = _recv_buf(g, x, "x")
    if finish is None:
        return Work(be.irecv(buf, src, tag), result=x, keep=x)
    return Work(be.irecv(buf, src, tag), finish=finish, keep=buf)


class P2POp:
    """One point-to-point operation for :func:`batch_isend_irecv` (PyTorch's ``P2POp``).

    Args:
        op: :func:`axonmpi.isend` or :func:`axonmpi.irecv`.
        tensor: the NumPy/CuPy array to send, or to receive into (in place).
        peer: the group rank to send to or receive from (with ``group=None``, the world rank,
            as in PyTorch). May be this rank itself when the batch also holds the other end.
        group: the process group (default: all ranks). Every op of a batch uses one group.
        tag: message tag, an int in ``0..group.max_tag`` (matched by the MPI backend).

    Example:
        >>> ops = [P2POp(axonmpi.isend, x, (r + 1) % n), P2POp(axonmpi.irecv, y, (r - 1) % n)]
        >>> for work in axonmpi.batch_isend_irecv(ops):
        ...     work.wait()
    """

    __slots__ = ("op", "tensor", "peer", "group", "tag")

    def __init__(self, op, tensor, peer: int, group: Optional[ProcessGroup] = None, tag: int = 0):
        if type(tensor).__name__ in ("Tensor", "Parameter") and type(tensor).__module__.startswith("axonmpi."):
            tensor = tensor.data                   # torch's P2POp(dist.isend, tensor, peer): moves its array
        kind = getattr(op, "_p2p_op", op)          # torch_api's isend/irecv (the Tensor forms) name these
        if kind is not isend and kind is not irecv:
            name = getattr(op, "__name__", repr(op))
            raise ValueError(f"P2POp op must be axonmpi.isend or axonmpi.irecv, got {name}")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag

    def __repr__(self) -> str:
        shape = getattr(self.tensor, "shape", "?")
        return f"P2POp({self.op.__name__}, shape={shape}, peer={self.peer}, tag={self.tag})"


@any_array_p2p
def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> List[Work]:
    """Start a batch of sends and receives together; return one :class:`Work` per op, in order.

    PyTorch's ``batch_isend_irecv``. The operations may be listed in any order — all sends
    before all receives included — without deadlock, as long as each peer posts the matching
    operations; a rank may send to itself within a batch. Every argument is checked on every
    op before anything starts. Arrays must stay alive and unmodified (sends) or unread
    (receives) until their Work completes; ``wait()`` on a receive returns its array.

    Args:
        p2p_op_list: a non-empty list of :class:`P2POp`, all on one group.

    Returns:
        A list of :class:`Work`, one per op.

    Example (a ring over all ranks):
        >>> r, n = axonmpi.rank(), axonmpi.world_size()
        >>> got = np.empty(3)
        >>> works = axonmpi.batch_isend_irecv([
        ...     P2POp(axonmpi.irecv, got, (r - 1) % n), P2POp(axonmpi.isend, np.full(3, r), (r + 1) % n)])
        >>> [w.wait() for w in works]              # got == rank r - 1's values
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError(f"batch_isend_irecv needs a non-empty list of P2POp, got {p2p_op_list!r}")
    for i, o in enumerate(p2p_op_list):
        if not isinstance(o, P2POp):
            raise TypeError(f"batch_isend_irecv op {i} must be a P2POp, got {type(o).__name__}")
    g = _group(p2p_op_list[0].group)
    plans = []
    for i, o in enumerate(p2p_op_list):
        if o.group is not p2p_op_list[0].group and _group(o.group) is not g:
            raise ValueError(
                f"rank {g.world.rank}: batch_isend_irecv op {i} is on {_group(o.group).name}, op 0 on "
                f"{g.name}; all ops of one batch use one group"
            )
        what = f"batch_isend_irecv op {i} ({o.op.__name__}) peer"
        peer = _check_peer(g, o.peer, what, allow_self=True)
        tag = _check_tag(g, o.tag, f"batch_isend_irecv op {i} tag")
        if getattr(o.op, "_p2p_op", o.op) is isend:
            be, buf = _send_buf(g, o.tensor, f"op {i} tensor")
            plans.append((be, P2PBuffer(True, buf, peer, tag), None, buf))
        else:
            x, be, buf, finish = _recv_buf(g, o.tensor, f"op {i} tensor")
            plans.append((be, P2PBuffer(False, buf, peer, tag), finish, x))
    reqs: List[Any] = [None] * len(plans)
    by_backend = {}
    for i, (be, pb, _, _) in enumerate(plans):
        by_backend.setdefault(id(be), (be, []))[1].append(i)
    for be, idx in by_backend.values():
        for i, req in zip(idx, be.batch_isend_irecv([plans[i][1] for i in idx])):
            reqs[i] = req
    works = []
    for (be, pb, finish, x), req in zip(plans, reqs):
        if pb.is_send:
            works.append(Work(req, keep=pb.buf))
        elif finish is None:
            works.append(Work(req, result=x, keep=x))
        else:
            works.append(Work(req, finish=finish, keep=pb.buf))
    return works
