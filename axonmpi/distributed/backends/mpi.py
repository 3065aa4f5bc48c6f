"""MPI backend: collectives on an mpi4py communicator (host buffers, or device buffers if CUDA-aware)."""
from __future__ import annotations


import numpy as np
from mpi4py import MPI

from ... import env as _env
from ..reduce_op import mpi_op
from .base import Backend

__all__ = ["MPIBackend", "cuda_aware_mpi"]


def cuda_aware_mpi() -> bool:
    """True when ``AXONMPI_CUDA_AWARE_MPI=1``: device buffers then go to MPI without staging.

    MPI libraries offer no portable query, so this is the user's declaration; without it
    CuPy arrays are staged through host memory (correct everywhere, slower).
    """
    return _env.get_bool("AXONMPI_CUDA_AWARE_MPI")


def _displs(counts):
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


class MPIBackend(Backend):
    """Collectives over ``group.comm`` with mpi4py's buffer (upper-case) methods."""

    name = "mpi"

    def __init__(self, group, device_buffers: bool = False) -> None:
        super().__init__(group)
        self.comm = group.comm
        self.rank = group.rank
        self.host_only = not device_buffers

    def _op(self, op, buf):
        return mpi_op(op, buf.dtype, self.rank)

    def allreduce(self, send, recv, op):
        self.comm.Allreduce(MPI.IN_PLACE if send is recv else send, recv, self._op(op, recv))

    def iallreduce(self, send, recv, op):
        return self.comm.Iallreduce(MPI.IN_PLACE if send is recv else send, recv, self._op(op, recv))

    def broadcast(self, buf, root):
        self.comm.Bcast(buf, root=root)

    def allgather(self, send, recv):
        self.comm.Allgather(send, recv)

    def iallgather(self, send, recv):
        return self.comm.Iallgather(send, recv)

    def allgatherv(self, send, recv, counts):
        self.comm.Allgatherv(send, [recv, (list(counts), _displs(counts))])

    def reduce_scatter(self, send, recv, counts, op):
        counts = list(counts)
        if all(c == counts[0] for c in counts):
            self.comm.Reduce_scatter_block(send, recv, self._op(op, send))
        else:
            self.comm.Reduce_scatter(send, recv, counts, self._op(op, send))

    def ireduce_scatter(self, send, recv, counts, op):
        counts = list(counts)
        if all(c == counts[0] for c in counts):
            return self.comm.Ireduce_scatter_block(send, recv, self._op(op, send))
        return self.comm.Ireduce_scatter(send, recv, counts, self._op(op, send))

    def reduce(self, send, recv, op, root):
        if self.rank == root and send is recv:
            self.comm.Reduce(MPI.IN_PLACE, recv, self._op(op, recv), root=root)
        else:
            self.comm.Reduce(send, recv if self.rank == root else None, self._op(op, send), root=root)

    def gatherv(self, send, recv, counts, root):
        rbuf = [recv, (list(counts), _displs(counts))] if self.rank == root else None
        self.comm.Gatherv(send, rbuf, root=root)

    def scatterv(self, send, counts, recv, root):
        sbuf = [send, (list(counts), _displs(counts))] if self.rank == root else None
        self.comm.Scatterv(sbuf, recv, root=root)

    def alltoallv(self, send, scounts, recv, rcounts):
        self.comm.Alltoallv([send, (list(scounts), _displs(scounts))],
                            [recv, (list(rcounts), _displs(rcounts))])

    def send(self, buf, dst, tag):
        self.comm.Send(buf, dest=dst, tag=tag)

    def recv(self, buf, src, tag):
        self.comm.Recv(buf, source=src, tag=tag)

    def isend(self, buf, dst, tag):
        return self.comm.Isend(buf, dest=dst, tag=tag)

    def irecv(self, buf, src, tag):
        return self.comm.Irecv(buf, source=src, tag=tag)

    def barrier(self):
        self.comm.Barrier()


