"""Count the bytes every rank moves through the MPI backend, per group, between optimizer steps.

Used by ``bench/hybrid.py``: ``python bench/_backend_count.py OUT SCRIPT ARGS...`` (under mpiexec) wraps
the methods of :class:`axonmpi.distributed.backends.mpi.MPIBackend`, runs ``SCRIPT`` as ``__main__``
and writes ``OUT.<rank>.json``: one snapshot of the counters per ``Optimizer.zero_grad`` call (the
start of each training step), so the difference of two consecutive snapshots is one step's traffic.

What one call counts (the convention of :mod:`axonmpi.plan`'s volumes): all-reduce, reduce,
reduce-scatter and all-to-all: the send buffer; all-gather(v) and broadcast: the whole (gathered)
buffer; point-to-point: every buffer sent *and* received.  Object collectives (pickles) and
barriers count calls only (``calls`` counts every call, for the latency term).  Each snapshot also
holds ``_clock``: this rank's CPU seconds and the wall clock, for the cores the job got in effect.
"""
from __future__ import annotations

import json
import runpy
import sys
import time


def install():
    """Wrap the backend's methods; returns ``(counts, snapshots)`` (``counts[group name]``: bytes, calls)."""
    from axonmpi.distributed.backends import mpi as M
    from axonmpi.optim import optimizer as O

    counts = {}
    snaps = []
    depth = [0]

    def add(group, nbytes):
        c = counts.setdefault(group.name, [0, 0])
        c[0] += int(nbytes)
        c[1] += 1

    def wrap(name, size_of):
        fn = getattr(M.MPIBackend, name)

        def inner(self, *a, **kw):
            if depth[0] == 0:     # a float16 call re-enters on float32 copies: count the outer call once
                add(self.group, size_of(*a))
            depth[0] += 1
            try:
                return fn(self, *a, **kw)
            finally:
                depth[0] -= 1
        setattr(M.MPIBackend, name, inner)

    for name in ("allreduce", "iallreduce", "reduce", "reduce_scatter", "ireduce_scatter", "alltoallv"):
        wrap(name, lambda send, *a: send.nbytes)
    for name in ("allgather", "iallgather", "allgatherv"):
        wrap(name, lambda send, recv, *a: recv.nbytes)
    for name in ("broadcast", "send", "recv", "isend", "irecv"):
        wrap(name, lambda buf, *a: buf.nbytes)
    wrap("batch_isend_irecv", lambda ops: sum(o.buf.nbytes for o in ops))
    for name in ("barrier", "broadcast_object", "allgather_object", "gather_object", "alltoall_object"):
        wrap(name, lambda *a: 0)
    zero = O.Optimizer.zero_grad

    def zero_grad(self, *a, **kw):
        snap = {k: list(v) for k, v in counts.items()}
        snap["_clock"] = [time.process_time(), time.perf_counter()]    # CPU seconds of this rank, wall seconds
        snaps.append(snap)
        return zero(self, *a, **kw)
    O.Optimizer.zero_grad = zero_grad
    return counts, snaps


def main():
    out, script, *args = sys.argv[1:]
    counts, snaps = install()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    import axonmpi
    rank = axonmpi.get_world().rank if axonmpi.is_initialized() else 0
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"snapshots": snaps, "final": counts}, f)


if __name__ == "__main__":
    main()
