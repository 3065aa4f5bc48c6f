"""DDP's communication hooks (as ``torch.distributed.algorithms.ddp_comm_hooks``): how a full bucket is reduced.

``DistributedDataParallel(..., comm_hook=...)`` takes one of these (or ``"allreduce"`` / ``"fp16"``); each gets the
bucket and the group and returns the :class:`~axonmpi.distributed.Work` of its non-blocking reduction.
"""
from __future__ import annotations

from ..backend import get_array_module
from ..distributed import ReduceOp, Work, all_reduce

__all__ = ["allreduce_hook", "fp16_compress_hook"]


def allreduce_hook(bucket: "GradientBucket", group) -> Work:
    """Default hook: sum the (pre-scaled) bucket in place with one non-blocking all-reduce."""
    return all_reduce(bucket.buffer, ReduceOp.SUM, group, out=bucket.buffer, async_op=True)


def fp16_compress_hook(bucket: "GradientBucket", group) -> Work:
    """Halve the bytes on the wire: all-reduce a float16 copy, then upcast into the bucket.

    The bucket is already scaled by 1/size, which keeps the float16 sum in range; the upcast
    back to the bucket's dtype is exact, so the only error is float16 rounding of the terms.
    """
    xp = get_array_module(bucket.buffer)
    half = bucket.buffer.astype(xp.float16)
    buf = bucket.buffer

    def upcast(h):
        buf[...] = h
        return buf

    return all_reduce(half, ReduceOp.SUM, group, out=half, async_op=True).then(upcast)


_HOOKS = {None: allreduce_hook, "allreduce": allreduce_hook, "fp16": fp16_compress_hook}
