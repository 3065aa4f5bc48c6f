"""The pipeline's bubble and in-flight micro-batches, from ``schedules.simulate`` (cached).

The bubble of a schedule does not grow with the micro-batches once every rank reaches its steady
state, so the schedule is simulated with ``min(m, p)`` micro-batches (1F1B) or ``min(m, 2p)`` (the
interleaved schedule, a multiple of ``p``, fills its warm-up only then; ZB-H1 and ZBV settle only then) and the per-micro-batch work of the rest is added: the step is
``m (F + B + W) v + bubble`` for one rank's ``v`` chunks of ``F``, ``B``, ``W`` seconds each.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Tuple

from ..parallel.pipeline.schedules import make_schedule, simulate

__all__ = ["bubble_and_peak"]

_SCALE = 12


@lru_cache(maxsize=4096)
def _sim(kind: str, p: int, m: int, v: int, f: int, b: int, w: int, c: int) -> Tuple[float, int]:
    s = make_schedule(kind, p, m, v)
    r = simulate(s, forward_time=f, backward_time=b, weight_time=w, comm_time=c)
    return float(max(r.bubble)), int(r.peak_activations[0])


def bubble_and_peak(kind: str, p: int, m: int, v: int, f: float, b: float, w: float, comm: float = 0.0
                    ) -> Tuple[float, int]:
    """(bubble seconds of the busiest rank, micro-batch chunks held at once on rank 0) for ``p`` stages,
    ``m`` micro-batches, ``v`` chunks per rank; ``f``, ``b``, ``w`` one chunk's forward, input-gradient and
    weight-gradient seconds (a schedule that does not split the backward runs ``b + w`` at once), ``comm``
    the seconds a point-to-point transfer takes.

    Example:
        >>> bubble_and_peak("1f1b", 4, 8, 1, 1.0, 2.0, 0.0)     # (p - 1)(F + B), p in flight
        (9.0, 4)
    """
    if p == 1:
        return 0.0, 1
    ms = min(m, p if kind in ("1f1b", "gpipe") else 2 * p)      # 1F1B: p already reaches the steady state
    if kind == "interleaved":
        if m % p:
            raise ValueError(f"the interleaved schedule needs micro-batches m={m} to be a multiple of pp={p}")
        ms = max(p, ms - ms % p)
    unit = max(f + b + w, 1e-30) / _SCALE                    # integer times: exact and cacheable
    fi, bi, wi, ci = (int(round(x / unit)) for x in (f, b, w, comm))
    if w == 0 and comm == 0:
        # an unsplit backward: the bubble scales with F + B whatever their ratio (1F1B's (p-1)(F+B)), so one
        # simulation at F:B = 1:2 serves every ratio
        fi, bi = _SCALE // 3, _SCALE - _SCALE // 3
    bub, peak = _sim(kind, p, ms, v, max(fi, 1), max(bi, 1), wi, ci)
    return bub * unit, peak
