"""Count the bytes every rank moves through the MPI backend, per group, between optimizer steps.

Used by ``bench/hybrid.py``: ``python bench/_backend_count.py OUT SCRIPT ARGS...`` (under mpiexec) counts
through :func:`axonmpi.distributed.backends.counting.count_traffic`, runs ``SCRIPT`` as ``__main__``
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


_ACTIVE = None


def install():
    """Start :func:`axonmpi.distributed.backends.counting.count_traffic` for the rest of the process;
    returns ``(per_group, snapshots)``: ``per_group()`` gives ``{group name: [bytes, calls]}`` so far."""
    from axonmpi.distributed.backends.counting import count_traffic
    from axonmpi.optim import optimizer as O

    global _ACTIVE
    _ACTIVE = count_traffic()                  # kept referenced: left on until the process ends
    counter = _ACTIVE.__enter__()
    snaps = []

    def per_group():
        out = {}
        for (group, _method, _dtype), (nbytes, calls) in counter.table.items():
            c = out.setdefault(group, [0, 0])
            c[0] += nbytes
            c[1] += calls
        return out
    zero = O.Optimizer.zero_grad

    def zero_grad(self, *a, **kw):
        snap = per_group()
        snap["_clock"] = [time.process_time(), time.perf_counter()]    # CPU seconds of this rank, wall seconds
        snaps.append(snap)
        return zero(self, *a, **kw)
    O.Optimizer.zero_grad = zero_grad
    return per_group, snaps


def main():
    out, script, *args = sys.argv[1:]
    per_group, snaps = install()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    import axonmpi
    rank = axonmpi.get_world().rank if axonmpi.is_initialized() else 0
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"snapshots": snaps, "final": per_group()}, f)


if __name__ == "__main__":
    main()
