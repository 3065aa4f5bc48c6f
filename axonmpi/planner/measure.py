"""Measure this allocation for the cost model: a GEMM's rate, our autograd's other kernels, the bandwidth
and latency a collective gets between computation, the cores the ranks get -- and the load they ran under.

``axonmpi plan --measure`` (and ``bench/hybrid.py``) call :func:`measure_bandwidth` under ``mpiexec``/``srun`` on
every rank; :func:`hardware_from_measured` turns its numbers into the :class:`~.hardware.HardwareSpec` the
one cost model (:mod:`.estimate`) plans with (``cpu.json`` is one such measurement, saved).  Figures
measured while other jobs load the machine describe that load, not the machine: :func:`load_report` says
how loaded it was, and ``--save-hardware`` refuses to save figures measured above one runnable task per
core (:func:`check_load`).
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

from .hardware import HardwareSpec

__all__ = ["KERNELS", "check_load", "hardware_from_measured", "load_report", "measure_bandwidth",
           "measure_kernels"]

#: The kernels ``measure_kernels`` times and ``measure_bandwidth`` adds (``HardwareSpec.measured``'s keys).
KERNELS = ("attn_flops", "gelu", "layernorm", "softmax", "add", "adam", "copy", "mem_cores")
#: DDP's bucket (``parallel.ddp``; the estimate counts its calls by it): the size the after-backward all-reduce
#: is measured at.
BUCKET_BYTES = 25 * 2 ** 20
#: Interleaved pairs of loops (without, with the collective) whose differences' median a per-call cost is.
PAIRS = 5


def load_report() -> Tuple[float, int]:
    """(1-minute load average, usable cores) of this machine (``os.getloadavg``; ``(0.0, cores)`` where the
    system has no load average)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return float(load), int(os.cpu_count() or cores)


def check_load(load: float, cores: int) -> Optional[str]:
    """A message naming the load when figures measured now cannot be trusted: a load average (taken before
    the measurement's own ranks start to count in it) above the machine's cores, else ``None``.

    Example:
        >>> check_load(15.0, 2)
        'load average 15.0 on 2 cores: other jobs were running, and figures measured now describe them, not this machine'
        >>> check_load(1.5, 2) is None
        True
    """
    if load > cores:
        return (f"load average {load:.1f} on {cores} cores: other jobs were running, and figures measured now "
                f"describe them, not this machine")
    return None


def hardware_from_measured(bw: Dict[str, float], ranks_per_node: int, name: str = "measured",
                           description: str = "") -> HardwareSpec:
    """The :class:`HardwareSpec` of what :func:`measure_bandwidth` measured (its dict, or a hardware file's
    ``measured``): the GEMM rate as the fp32 (and, halved, fp64) matrix rate, the bandwidth between
    computation inside a node, the one between nodes' leaders, the latency a call adds, the cores."""
    flops = float(bw["flops"])
    copy = 2 * 4 / bw["copy"] if bw.get("copy") else 0.0        # bytes read + written per second (float32)
    intra = float(bw["intra"])
    return HardwareSpec(
        name=name, gpus_per_node=int(ranks_per_node), matrix_flops={"fp32": flops, "fp64": flops / 2},
        vector_flops=flops / 8, memory_bw=copy or 10e9, memory_bytes=_memory_per_rank(ranks_per_node),
        intra_bw=intra, intra_latency=float(bw.get("latency", 0.0)), nic_bw=float(bw.get("inter") or intra),
        inter_latency=float(bw.get("latency", 0.0)), cores=float(bw.get("cores", 0.0)),
        description=description, source="axonmpi.planner.measure", measured={k: float(v) for k, v in bw.items()})


def _memory_per_rank(ranks: int) -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(ranks, 1)
    except (ValueError, OSError, AttributeError):
        return 16 * 2.0 ** 30


def _paired(loop, pairs: int = PAIRS) -> float:
    """The median over ``pairs`` interleaved runs of ``loop(False)`` and ``loop(True)`` of their difference:
    what the collective adds to the loop.  Interleaving (rather than the better of two of each, one kind
    after the other) keeps a change in the machine's speed during the measurement from landing on one kind
    only (2026-11-28, a shared 2-core machine: the same GEMM ran at 67 to 88 GFLOP/s seconds apart)."""
    import statistics
    loop(True)                                    # warm-up: the transport's buffers
    return statistics.median(loop(True) - loop(False) for _ in range(pairs))


def _collective_seconds(call, repeats: int) -> float:
    """:func:`_seconds` of a collective ``call``, after one call and a barrier (every rank starts together)."""
    from ..distributed import barrier
    call()
    barrier()
    return _seconds(call, repeats)


def _seconds(fn, repeats: int) -> float:
    """The median wall seconds of ``repeats`` calls of ``fn`` after one to warm up."""
    import statistics
    import time
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_kernels(width: int = 512, seq: int = 128, heads: int = 8, rows: int = 256, dtype: str = "float32",
                    repeats: int = 9) -> Dict[str, float]:
    """Time our autograd's kernels other than the Linears' GEMMs, forward + backward, on this rank
    (no MPI): what a step spends besides the GEMMs, per unit of work (``Hardware``'s fields).

    Returns seconds per element of ``gelu`` (``rows x 4 width``; tanh, as ``nn.MLP``), ``layernorm``
    (``rows x width``, with weight and bias), ``softmax`` (per attention score of ``rows / seq``
    sequences: the scale, the causal mask and the softmax), ``add`` (a residual add), ``copy`` (a copy
    of ``2^22`` elements), seconds per parameter of ``adam`` (``AdamW.step`` and the gradient
    clipping's norm, over ``2^22`` parameters), and ``attn_flops``: the flop rate of the attention
    core's two batched matmuls ``q k^T`` and ``a v`` (forward + backward, 3x the forward's flops).
    The median of ``repeats``.

    Example:
        >>> k = measure_kernels(64, 16, 2, rows=32, repeats=1)
        >>> k["gelu"] > 0 and k["attn_flops"] > 0
        True
    """
    import numpy as np

    from ..autograd import Tensor, ops, ops_nn
    from ..optim import AdamW
    from ..optim.clip import clip_grad_norm_
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    seqs = max(1, rows // seq)
    hd = max(1, width // heads)

    def leaf(*shape):
        return Tensor(rng.standard_normal(shape).astype(dt), requires_grad=True)

    def seconds(fn) -> float:
        return _seconds(fn, repeats)

    def fwd_bwd(make):
        def run():
            y = make()
            y.backward(np.ones(y.shape, dt))
        return run

    h4, x = leaf(rows, 4 * width), leaf(rows, width)
    w, b, r = leaf(width), leaf(width), leaf(rows, width)
    q, k, v = leaf(seqs, heads, seq, hd), leaf(seqs, heads, hd, seq), leaf(seqs, heads, seq, hd)
    sc = leaf(seqs, heads, seq, seq)
    future = np.triu(np.ones((seq, seq), dtype=bool), k=1)
    out = {"gelu": seconds(fwd_bwd(lambda: ops_nn.gelu(h4, approximate="tanh"))) / h4.data.size,   # nn.MLP's
           "layernorm": seconds(fwd_bwd(lambda: ops_nn.layer_norm(x, width, w, b))) / x.data.size,
           "softmax": seconds(fwd_bwd(lambda: ops_nn.softmax(ops_nn.masked_fill(sc * 0.125, future, -np.inf), -1)))
           / sc.data.size,
           "add": seconds(fwd_bwd(lambda: x + r)) / x.data.size}
    flops = 3.0 * 2 * (2.0 * seqs * heads * seq * seq * hd)
    out["attn_flops"] = flops / seconds(fwd_bwd(lambda: ops.matmul(ops.matmul(q, k), v)))
    p = leaf(1 << 22)                      # beyond the caches, as a model's parameters are
    p.grad = Tensor(rng.standard_normal(p.data.shape).astype(dt))
    opt = AdamW([p], lr=1e-3, weight_decay=0.01)

    def step():
        clip_grad_norm_([p], 1.0)
        opt.step()
    out["adam"] = seconds(step) / p.data.size
    big = np.ones(1 << 22, dt)                     # beyond the caches, as a model's gradients are
    into = np.empty_like(big)
    out["copy"] = seconds(lambda: np.copyto(into, big)) / big.size
    return out


def measure_bandwidth(nbytes: int = 1 << 22, repeats: int = 9, gemm: int = 512, *, width: int = 512,
                      seq: int = 128, heads: int = 8, dtype: str = "float32") -> Dict[str, float]:
    """Time all-reduces and a GEMM on this allocation (collective; call on every rank under mpiexec/srun).

    Returns ``{"intra", "intra_alone", "inter", "latency", "flops", "cores", "bucket", "bucket_latency"}``
    and the kernels':

    * ``intra``: bus bandwidth ``2 (p-1)/p n / t`` (bytes/s) of an all-reduce of ``nbytes`` among the
      ranks of one node *between GEMMs* (``t``: what it adds to a loop of GEMMs run on every rank at
      once, less ``latency``; what a step meets: where ranks share cores, a transfer moves only while
      both ends hold a core); ``intra_alone``: the same back to back, the *median* of ``repeats``
      (for information; ``intra`` when a node has one rank); ``inter``: the back-to-back one among
      one rank per node (``intra`` on one node);
    * ``latency``: what an 8-byte all-reduce of all ranks adds to a loop of GEMMs (one between each):
      a collective's cost when ranks compute between collectives, as in a step (where ranks share
      cores, mostly the wait for the others' turn on a core; on dedicated cores, the latency);
    * ``flops``: a float32 ``gemm``-cube GEMM's rate on one rank while the node's other ranks sleep;
    * ``cores``: the cores the node's ranks get in effect: the sum over the node's ranks of their GEMM
      rate over a loop they all run at once, / ``flops``, at most the cores the process may use;
    * ``bucket``, ``bucket_latency``: the after-backward regime (:func:`_after_backward`): an in-place
      all-reduce of one DDP bucket, and an 8-byte one, back to back over the node's ranks;
    * ``measure_kernels``' numbers (the other kernels, timed on one rank while the others sleep; at
      the model's ``width``, ``seq``, ``heads`` and ``dtype``) and ``mem_cores``: the cores in effect,
      as ``cores``, of a memory-bound loop (AdamW's streams over ``2^22`` elements).

    Example:
        >>> bw = measure_bandwidth(1 << 16)          # under mpiexec -n 4 on one node
        >>> bw["intra"] > 0 and bw["flops"] > 0 and 0 < bw["cores"] <= os.cpu_count()
        True
    """
    import os
    import time

    import numpy as np

    from ..distributed import all_reduce, barrier, get_world, init, is_initialized
    world = get_world() if is_initialized() else init()

    def timed(group) -> float:
        if group is None or group.size <= 1:
            return 0.0
        x = np.ones(max(1, nbytes // 8))
        p = group.size
        return 2.0 * (p - 1) / p * x.nbytes / _collective_seconds(lambda: all_reduce(x, group=group), repeats)

    node = world.split(world.node_index, name="plan-node")
    leaders = world.split(0 if world.local_rank == 0 else None, name="plan-leaders")
    intra = timed(node)
    inter = timed(leaders) if world.local_rank == 0 else 0.0
    vals = all_reduce(np.array([intra, inter]), op="max")
    intra, inter = float(vals[0]), float(vals[1])
    a = np.ones((gemm, gemm), np.float32)
    avail = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def on_first_rank(fn):
        """``fn()`` on each node's first rank while the others sleep (a rank waiting in a blocking MPI call
        would spin on a core): they poll a non-blocking all-reduce that the first rank joins when done."""
        out = fn() if world.local_rank == 0 else None
        done = all_reduce(np.zeros(1), async_op=True)
        while not done.is_completed():
            time.sleep(0.002)
        return out

    def alone_and_cores(fn) -> Tuple[float, float]:
        """Calls of ``fn`` a second on local rank 0 while the others sleep, and the cores the node's ranks
        get in effect: their rates running it all at once, summed, over that."""
        fn()
        barrier()
        alone = on_first_rank(lambda: 1.0 / _seconds(fn, repeats)) or 0.0
        barrier()
        t0 = time.perf_counter()               # all ranks at once: each rank's rate over the whole loop, so
        for _ in range(3 * repeats):           # the scheduler's time slices average out (one call's timing
            fn()                               # catches a rank that waited a whole slice, or none)
        shared = 3 * repeats / (time.perf_counter() - t0)
        alone = float(all_reduce(np.array([alone]), op="max")[0])
        shared = float(all_reduce(np.array([shared]), op="sum", group=node)[0])    # the node's ranks together
        return alone, (min(float(avail), shared / alone) if alone > 0 else float(avail))

    alone, cores = alone_and_cores(lambda: a @ a)
    alone *= 2.0 * gemm ** 3
    small = np.zeros(1)

    def loop(sync: bool) -> float:
        barrier()
        t0 = time.perf_counter()
        for _ in range(3 * repeats):
            a @ a
            if sync:
                all_reduce(small)
        return time.perf_counter() - t0

    lat = max(0.0, _paired(loop)) / (3 * repeats) if world.world_size > 1 else 0.0
    med = float(all_reduce(np.array([lat]), op="max")[0])
    between = _between_gemms(a, node, nbytes, repeats, med) if node.size > 1 else 0.0
    after = _after_backward(node, repeats) if node.size > 1 else {}
    # the other kernels, alone (the others sleep), and the memory-bound loop (AdamW) on all ranks at once
    barrier()
    kern = on_first_rank(lambda: measure_kernels(width, seq, heads, dtype=dtype, repeats=repeats)) or {}
    kern = {k: float(all_reduce(np.array([kern.get(k, 0.0)]), op="max")[0]) for k in KERNELS if k != "mem_cores"}
    p = np.ones(1 << 22, np.float32)       # beyond the caches
    m1, m2 = np.zeros_like(p), np.zeros_like(p)

    def adam_like():                   # AdamW's streams: two moments, the update, the parameter
        m1.__imul__(0.9).__iadd__(p)
        m2.__imul__(0.95).__iadd__(p * p)
        p.__isub__(1e-9 * m1 / (np.sqrt(m2) + 1.0))

    kern["mem_cores"] = alone_and_cores(adam_like)[1]
    if between > 0:                    # what a step meets; the plain all-reduce's kept for information
        intra, inter = between, (inter if inter > 0 else between)
    return {"intra": intra, "inter": inter if inter > 0 else intra, "latency": med, "flops": alone,
            "cores": cores, "intra_alone": float(vals[0]), **after, **kern}


def _after_backward(group, repeats: int) -> Dict[str, float]:
    """The regime of the gradient reductions after the backward (DDP's buckets, AxoNN's per-tensor
    all-reduces, the replicated parameters'): every rank of the group arrives from the same backward and
    the calls run back to back, each in place on a gradient buffer the step keeps.  ``bucket``: the bus
    bandwidth ``2 (p-1)/p n / t`` of an in-place all-reduce of one DDP bucket (``BUCKET_BYTES``) back to
    back; ``bucket_latency``: an 8-byte one's time back to back.  The median of ``repeats`` calls, the
    slowest rank's.  (2026-11-28, 4 ranks on 2 cores: 1.2-1.8 GB/s and 0.07-0.16 ms, where a 4 MiB
    all-reduce between GEMMs got 0.7-1.3 GB/s and 0.6-1.5 ms a call: waiting for a core.)"""
    import numpy as np

    from ..distributed import all_reduce
    x = np.zeros(BUCKET_BYTES // 4, np.float32)
    small = np.zeros(1)

    def timed(buf) -> float:
        return _collective_seconds(lambda: all_reduce(buf, group=group, out=buf), repeats)
    p = group.size
    t_big, t_small = timed(x), timed(small)
    t = all_reduce(np.array([t_big, t_small]), op="max", group=group)
    return {"bucket": 2.0 * (p - 1) / p * x.nbytes / float(t[0]), "bucket_latency": float(t[1])}


def _between_gemms(a, group, nbytes: int, repeats: int, latency: float) -> float:
    """Bus bandwidth ``2 (p-1)/p n / t`` of an all-reduce of ``nbytes`` over ``group`` (a node's ranks) where
    ranks compute between collectives, as in a step: ``t`` is what one such all-reduce adds to a loop of
    GEMMs (``a @ a``) on every rank at once, less ``latency`` (what an 8-byte one adds).  Where ranks
    share cores the transfer only runs while both ends hold a core, so this is several times below the
    bandwidth of back-to-back all-reduces (2026-11-27, 4 ranks on 2 cores: 0.6-0.8 against 1.9 GB/s).
    The smallest over the group's ranks (the collective waits for the slowest); 0.0 if unmeasurable."""
    import time

    import numpy as np

    from ..distributed import all_reduce, barrier
    x = np.zeros(max(1, nbytes // 8))
    n = 3 * repeats

    def loop(sync: bool) -> float:
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            a @ a
            if sync:
                all_reduce(x, group=group)
        return time.perf_counter() - t0

    extra = _paired(loop) / n - latency
    p = group.size
    bw = 2.0 * (p - 1) / p * x.nbytes / extra if extra > 0 else 0.0
    return float(all_reduce(np.array([bw]), op="min", group=group)[0])
