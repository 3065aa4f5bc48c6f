"""Context-parallel causal attention at 1, 2 and 4 ranks: bytes through the backend beside the formulas, and step time.

One invocation runs everything (it re-launches itself under ``mpiexec -n N``):

    python bench/context_parallel.py                        # B=1, T=1024, C=256, 8 heads, float32
    python bench/context_parallel.py --seq 512 --steps 3

Rows: serial ``CausalSelfAttention`` on the whole sequence (1 rank), then ``ContextParallelAttention``
with ``ring`` (K/V blocks around the group, isend/irecv overlapped with each block, causal load
balancing) and ``ulysses`` (all-to-all to head shards and back) over all N ranks, each rank holding
T/N tokens.  Step = forward + backward of the attention layer (qkv and proj included), median of
``--steps`` after one warm-up, the slowest rank's.  Bytes are counted at the MPI backend
(:func:`axonmpi.distributed.backends.counting.count_bytes`) on rank 0, per layer:

* ring forward: bytes sent = (P-1) x local K/V bytes = (P-1)/P of the sequence's K/V bytes;
  backward: (2P-1) x local K/V bytes (K/V on, then their gradients, and one hop home);
* Ulysses forward and backward each: all-to-all send buffers = 4 B T C / P elements (4 N h / P).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(a):
    import axonmpi
    from axonmpi import Tensor
    from axonmpi.distributed.backends.counting import count_bytes
    from axonmpi.nn import CausalSelfAttention
    from axonmpi.parallel.context import ContextParallelAttention
    world = axonmpi.init()
    g = world.default_group
    P = g.size
    dtype = np.dtype(a.dtype)
    rows = []
    x_full = np.random.default_rng(0).standard_normal((a.batch, a.seq, a.embed)).astype(dtype)
    algos = ["serial"] if P == 1 else ["ring", "ulysses"]
    if P == 1:
        algos += ["ring", "ulysses"]
    for algo in algos:
        axonmpi.manual_seed(0)
        if algo == "serial":
            m = CausalSelfAttention(a.embed, a.heads, dtype=dtype)
            x = x_full
        else:
            m = ContextParallelAttention(a.embed, a.heads, group=g, algo=algo, dtype=dtype)
            x = m.layout(a.seq).split(x_full, g.rank)

        def step():
            t = Tensor(x, requires_grad=True)
            y = m(t) if algo == "serial" else m(t, seq_len=a.seq)
            y.sum().backward()
            for p in m.parameters():
                p.grad = None

        step()
        times = []
        for _ in range(a.steps):
            axonmpi.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        t = float(axonmpi.all_reduce(np.array([np.median(times)]), op="max", group=g)[0])
        t_in = Tensor(x, requires_grad=True)
        with count_bytes() as fwd:
            y = m(t_in) if algo == "serial" else m(t_in, seq_len=a.seq)
        with count_bytes() as bwd:
            y.sum().backward()
        item = dtype.itemsize
        kv_local = 2 * a.batch * (a.seq // P) * a.embed * item
        if algo == "ring":
            f_meas, b_meas = fwd.total("send"), bwd.total("send")
            f_form, b_form = (P - 1) * kv_local, (2 * P - 1) * kv_local if P > 1 else 0
        elif algo == "ulysses":
            f_meas, b_meas = fwd.total("alltoall"), bwd.total("alltoall")
            f_form = b_form = 4 * a.batch * a.seq * a.embed * item // P if P > 1 else 0
        else:
            f_meas = b_meas = f_form = b_form = 0
        rows.append({"P": P, "algo": algo, "time_ms": t * 1e3, "fwd_bytes": f_meas, "fwd_formula": f_form,
                     "bwd_bytes": b_meas, "bwd_formula": b_form})
    if world.rank == 0:
        with open(a.out, "w") as f:
            json.dump(rows, f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024, help="sequence length T (divisible by 2*4)")
    p.add_argument("--embed", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return _worker(a)
    from axonmpi.testing import mpiexec_path, mpiexec_env
    import tempfile
    rows = []
    env = mpiexec_env({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    for n in [int(v) for v in a.ranks.split(",")]:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        args = [sys.argv[0] if sys.argv[0].endswith(".py") else __file__, "--worker", "--out", out,
                "--batch", str(a.batch), "--seq", str(a.seq), "--embed", str(a.embed), "--heads", str(a.heads),
                "--dtype", a.dtype, "--steps", str(a.steps)]
        r = subprocess.run([mpiexec_path(), "-n", str(n), sys.executable, *args], env=env, capture_output=True,
                           text=True)
        if r.returncode:
            sys.exit(f"mpiexec -n {n} failed:\n{r.stderr[-3000:]}")
        rows += json.load(open(out))
        os.unlink(out)
    serial = next(r["time_ms"] for r in rows if r["algo"] == "serial")
    print(f"causal attention layer, B={a.batch} T={a.seq} C={a.embed} heads={a.heads} {a.dtype}; "
          f"bytes per rank per layer (rank 0), counted at the MPI backend")
    head = (f"{'ranks':>5} {'algo':>8} {'step ms':>9} {'vs serial':>9} {'fwd bytes':>11} {'formula':>11} "
            f"{'bwd bytes':>11} {'formula':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['P']:>5} {r['algo']:>8} {r['time_ms']:>9.2f} {serial / r['time_ms']:>8.2f}x "
              f"{r['fwd_bytes']:>11,} {r['fwd_formula']:>11,} {r['bwd_bytes']:>11,} {r['bwd_formula']:>11,}")
    bad = [r for r in rows if r["fwd_bytes"] != r["fwd_formula"] or r["bwd_bytes"] != r["bwd_formula"]]
    print("measured bytes equal the formulas" if not bad else f"MISMATCH in {len(bad)} rows")


if __name__ == "__main__":
    main()
