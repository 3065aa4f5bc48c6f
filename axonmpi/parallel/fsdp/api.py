"""FSDP configuration: sharding strategies, CPU offload modes, mixed precision, memory figures."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from ...enums import coerce_enum

__all__ = ["ShardingStrategy", "CPUOffload", "MixedPrecision", "FSDPMemoryStats"]


class ShardingStrategy(enum.Enum):
    """How FSDP spreads parameters, gradients and optimizer state over the data-parallel ranks.

    NO_SHARD: every rank holds everything; gradients all-reduced (DDP-equivalent).
    SHARD_GRAD_OP: ZeRO-2. Parameters kept whole from forward through backward, gradients
        reduce-scattered, optimizer state and update sharded.
    FULL_SHARD: ZeRO-3. Each unit's parameters all-gathered just before its forward and again
        before its backward, freed right after each.
    HYBRID_SHARD: FULL_SHARD inside a shard group (default: the ranks of one node), replicated
        across shard groups; gradients reduce-scattered in the shard group, then all-reduced
        across the replicas.
    """

    NO_SHARD = "no_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    FULL_SHARD = "full_shard"
    HYBRID_SHARD = "hybrid_shard"

    @classmethod
    def coerce(cls, value: Any) -> "ShardingStrategy":
        """Accept the enum, its value or its name (``"full_shard"``, ``"FULL_SHARD"``)."""
        return coerce_enum(cls, value, "sharding_strategy")


class CPUOffload(enum.Enum):
    """Where the sharded state lives.

    NONE: everything on the compute device.
    OPTIMIZER_STATES: the parameter shards, their gradients and so the optimizer state and
        update live on the host; units are gathered on the compute device for compute.
    FULL: as OPTIMIZER_STATES, and the reduced gradient shard is also produced on the host
        (the device keeps only gathered units while they compute).

    On a CPU-only machine host and device are the same; the modes then run the same numbers.
    """

    NONE = "none"
    OPTIMIZER_STATES = "optimizer_states"
    FULL = "full"

    @classmethod
    def coerce(cls, value: Any) -> "CPUOffload":
        """Accept the enum, its value/name, ``True`` (FULL) or ``False``/``None`` (NONE)."""
        return coerce_enum(cls, value, "cpu_offload", aliases={None: cls.NONE, False: cls.NONE, True: cls.FULL})


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision compute with full-precision master shards.

    Args:
        param_dtype: dtype units are gathered and computed in (e.g. ``np.float16``).
        reduce_dtype: dtype gradients are reduced in (default: ``param_dtype``).
        buffer_dtype: dtype module buffers are cast to (default: unchanged).

    Example:
        >>> MixedPrecision(param_dtype=np.float16, reduce_dtype=np.float32)
    """

    param_dtype: Optional[Any] = None
    reduce_dtype: Optional[Any] = None
    buffer_dtype: Optional[Any] = None

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            v = getattr(self, field)
            if v is None:
                continue
            if isinstance(v, str) and v.lower() in ("bfloat16", "bf16"):
                try:
                    import ml_dtypes  # noqa: F401
                except ImportError:
                    raise TypeError(f"MixedPrecision({field}={v!r}): bfloat16 needs the ml_dtypes package "
                                    "with NumPy; install it or use float16") from None
                v = ml_dtypes.bfloat16
            try:
                dt = np.dtype(v)
            except TypeError:
                raise TypeError(f"MixedPrecision({field}={v!r}) is not a dtype") from None
            if dt.kind != "f" and dt.name != "bfloat16":
                raise TypeError(f"MixedPrecision({field}={dt}) must be a floating dtype")
            object.__setattr__(self, field, dt)


@dataclass(frozen=True)
class FSDPMemoryStats:
    """Memory of one rank, measured from the arrays alive (MiB = 2**20 bytes).

    Attributes:
        peak_memory_mb: the highest sharded state + gathered units in flight seen since the
            last reset (``params_mb + grads_mb + optimizer_state_mb + peak gathered``).
        current_allocation_mb: ``params_mb + grads_mb + optimizer_state_mb + gathered_mb`` now.
        params_mb: the parameter shards (padded chunks) this rank owns.
        grads_mb: the gradient shards plus any full (unsharded) gradient buffers alive.
        optimizer_state_mb: the optimizer state arrays of this rank's parameters.
        gathered_mb: the full (gathered) unit buffers alive now, including prefetches in flight.
    """

    peak_memory_mb: float
    current_allocation_mb: float
    params_mb: float
    grads_mb: float
    optimizer_state_mb: float
    gathered_mb: float
