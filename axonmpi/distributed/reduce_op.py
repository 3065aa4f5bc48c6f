"""ReduceOp: the reductions collectives understand, and how each maps onto MPI for a dtype."""
from __future__ import annotations

import enum

import numpy as np
from mpi4py import MPI
from ..enums import coerce_enum

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """Reduction for :func:`all_reduce`, :func:`reduce_scatter` and friends.

    ``MEAN`` (alias ``AVG``) sums then divides by the group size; it needs a floating or
    complex dtype. On ``bool`` arrays SUM/MAX act as logical OR and PRODUCT/MIN as AND.
    ``BAND``/``BOR``/``BXOR`` need integer or bool arrays.
    """

    SUM = "sum"
    MEAN = "mean"
    AVG = "mean"  # alias of MEAN
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @classmethod
    def coerce(cls, op) -> "ReduceOp":
        """Accept a ReduceOp or its name (``"sum"``, ``"avg"``, ...)."""
        return coerce_enum(cls, op, "reduce op", aliases={"prod": cls.PRODUCT, "PROD": cls.PRODUCT})


_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM, ReduceOp.MEAN: MPI.SUM, ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD, ReduceOp.BAND: MPI.BAND, ReduceOp.BOR: MPI.BOR, ReduceOp.BXOR: MPI.BXOR,
}
_BOOL_OPS = {
    ReduceOp.SUM: MPI.LOR, ReduceOp.MAX: MPI.LOR, ReduceOp.BOR: MPI.LOR,
    ReduceOp.PRODUCT: MPI.LAND, ReduceOp.MIN: MPI.LAND, ReduceOp.BAND: MPI.LAND, ReduceOp.BXOR: MPI.LXOR,
}
_cache = {}


def mpi_op(op: ReduceOp, dtype: np.dtype, rank: int = -1):
    """The MPI.Op implementing ``op`` on ``dtype``; TypeError for unsupported pairs."""
    key = (op, dtype)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    kind = "f" if dtype.name == "bfloat16" else dtype.kind  # ml_dtypes' bfloat16 is kind "V"
    where = f"rank {rank}: " if rank >= 0 else ""
    if kind == "b":
        if op is ReduceOp.MEAN:
            raise TypeError(f"{where}ReduceOp.MEAN needs a floating dtype, got bool")
        res = _BOOL_OPS[op]
    elif kind in "fc" and op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        raise TypeError(f"{where}{op.name} needs an integer or bool dtype, got {dtype}")
    elif kind == "c" and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"{where}{op.name} is undefined for complex dtype {dtype}")
    elif kind in "iu" and op is ReduceOp.MEAN:
        raise TypeError(
            f"{where}ReduceOp.MEAN needs a floating dtype, got {dtype}; use SUM and divide, "
            "or cast to float first"
        )
    elif kind not in "biufc":
        raise TypeError(f"{where}cannot reduce arrays of dtype {dtype} (numeric dtypes only)")
    else:
        res = _MPI_OPS[op]
    _cache[key] = res
    return res
