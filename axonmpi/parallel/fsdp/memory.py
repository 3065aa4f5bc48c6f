"""FSDP memory: measured from the arrays alive, and estimated by the ZeRO paper's formulas."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .api import CPUOffload, FSDPMemoryStats, MixedPrecision, ShardingStrategy

__all__ = ["MemoryEstimate", "estimate_memory", "measure", "optimizer_state_bytes"]

_MB = float(1 << 20)

# bytes of optimizer state per parameter: (full precision, mixed precision with fp32 master copy)
_K = {"adam": (8, 12), "adamw": (8, 12), "sgd": (0, 4), "sgd_momentum": (4, 8)}


def optimizer_state_bytes(optimizer, params=None) -> int:
    """Bytes of the arrays in ``optimizer.state`` (restricted to ``params`` when given)."""
    if optimizer is None:
        return 0
    keep = None if params is None else {id(p) for p in params}
    total = 0
    for p, st in optimizer.state.items():
        if keep is not None and id(p) not in keep:
            continue
        for v in st.values():
            if hasattr(v, "nbytes") and getattr(v, "ndim", 0) > 0:
                total += int(v.nbytes)
    return total


def measure(fsdp, optimizer, peak_gathered: int) -> FSDPMemoryStats:
    """Count this rank's bytes: flat shards, gradient shards and unsharded gradients, optimizer
    state, gathered units (see :meth:`FullyShardedDataParallel.memory_stats`)."""
    params = grads = 0
    flats = []
    for u in fsdp._all_units:
        f = u.flat
        if f is None:
            continue
        flats.append(f)
        params += int(f._shard.nbytes)
        if f.grad is not None:
            grads += int(f.grad.data.nbytes)
        if f.full_grad is not None:         # the parameters' .grad are views of it
            grads += int(f.full_grad.nbytes)
        else:               # unsharded gradients not yet packed (e.g. under no_sync); not views of f.grad
            views = {id(t) for t in f._piece_grads}
            grads += sum(int(p.grad.data.nbytes) for p in f.params
                         if p.grad is not None and id(p.grad) not in views)
    for _, p in getattr(fsdp, "_frozen", ()):       # frozen parameters: replicated, whole on every rank
        params += int(p.data.nbytes) + int(getattr(fsdp._frozen_master.get(id(p)), "nbytes", 0))
    opt = optimizer_state_bytes(optimizer, flats + [q for f in flats for q in f.params])  # on chunks or originals
    gathered = fsdp._gathered_bytes()
    base = params + grads + opt
    return FSDPMemoryStats(
        peak_memory_mb=(base + max(peak_gathered, gathered)) / _MB,
        current_allocation_mb=(base + gathered) / _MB,
        params_mb=params / _MB, grads_mb=grads / _MB, optimizer_state_mb=opt / _MB, gathered_mb=gathered / _MB)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory of the model state by the ZeRO paper's formulas (MiB).

    Attributes:
        params_mb, grads_mb, optimizer_state_mb: the three parts on the device.
        total_mb: their sum (device).
        host_mb: what CPU offload moves to the host (not in ``total_mb``).
        formula: the formula, e.g. ``"(4+4+8)Psi/N"``.
    """

    params_mb: float
    grads_mb: float
    optimizer_state_mb: float
    total_mb: float
    host_mb: float
    formula: str


def estimate_memory(module_or_num_params: Any, sharding_strategy=ShardingStrategy.FULL_SHARD, group_size: int = 1,
                    optimizer: str = "adam", mixed_precision: Optional[MixedPrecision] = None,
                    cpu_offload=CPUOffload.NONE) -> MemoryEstimate:
    """Per-rank parameter + gradient + optimizer-state memory of a strategy (ZeRO paper, section 5).

    With ``Psi`` parameters and ``N = group_size`` (the shard group size for HYBRID_SHARD):
    fp32 training holds 4 bytes of parameter, 4 of gradient and ``K`` of optimizer state per
    parameter (Adam: K = 8); mixed precision 2 + 2 + K with K = 12 (fp32 master, two moments).
    NO_SHARD keeps all of it; SHARD_GRAD_OP (ZeRO-2) shards gradients and optimizer state:
    ``P Psi + (G + K) Psi / N``; FULL_SHARD / HYBRID_SHARD (ZeRO-3) shard all three:
    ``(P + G + K) Psi / N``. Gathered units and activations come on top.

    Args:
        module_or_num_params: a Module or an FSDP model (its parameter count is used) or an int.
        sharding_strategy: a :class:`ShardingStrategy`.
        group_size: ranks the state is sharded over.
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"`` or ``"sgd_momentum"``.
        mixed_precision: a :class:`MixedPrecision` with 16-bit ``param_dtype``, or None.
        cpu_offload: a :class:`CPUOffload`; offloaded parts are counted in ``host_mb``.

    Returns:
        A :class:`MemoryEstimate`.

    Example:
        >>> estimate_memory(10_000_000, ShardingStrategy.FULL_SHARD, 4).total_mb   # 16 B * 10M / 4
        38.14697265625
    """
    m = module_or_num_params
    if isinstance(m, (int, np.integer)):
        psi = int(m)
    else:     # an FSDP model counts its flat parameters' full sizes
        psi = sum(int(getattr(p, "total_numel", p.data.size)) for p in m.parameters())
    psi = int(psi)
    n = int(group_size)
    if n < 1:
        raise ValueError(f"estimate_memory: group_size must be >= 1, got {group_size}")
    strategy = ShardingStrategy.coerce(sharding_strategy)
    offload = CPUOffload.coerce(cpu_offload)
    if optimizer not in _K:
        raise ValueError(f"estimate_memory: unknown optimizer {optimizer!r}; expected one of {sorted(_K)}")
    low = mixed_precision is not None and mixed_precision.param_dtype is not None and \
        np.dtype(mixed_precision.param_dtype).itemsize < 4
    pb, gb = (2, 2) if low else (4, 4)
    k = _K[optimizer][1 if low else 0]
    if strategy is ShardingStrategy.NO_SHARD:
        p, g, o, f = pb, gb, k, f"({pb}+{gb}+{k})Psi"
        p_div = g_div = o_div = 1
    elif strategy is ShardingStrategy.SHARD_GRAD_OP:
        p_div, g_div, o_div, f = 1, n, n, f"{pb}Psi+({gb}+{k})Psi/N"
    else:
        p_div = g_div = o_div = n
        f = f"({pb}+{gb}+{k})Psi/N"
    params, grads, opt = pb * psi / p_div, gb * psi / g_div, k * psi / o_div
    host = 0.0
    if offload is not CPUOffload.NONE:
        host = opt + grads + (params if offload is CPUOffload.FULL else 0.0)
        opt = grads = 0.0
        if offload is CPUOffload.FULL:
            params = 0.0
    return MemoryEstimate(params / _MB, grads / _MB, opt / _MB, (params + grads + opt) / _MB, host / _MB, f)


class MemoryForms:
    """The memory methods of :class:`~axonmpi.parallel.fsdp.FullyShardedDataParallel`."""

    def memory_stats(self, optimizer=None, *, reset_peak: bool = False) -> FSDPMemoryStats:
        """This rank's memory, measured from the arrays alive (see :class:`FSDPMemoryStats`).

        Args:
            optimizer: the optimizer over ``parameters()``, to count its state.
            reset_peak: start a new peak window after reading.
        """
        self._check_root("memory_stats")
        stats = measure(self, optimizer, self._peak_gathered)
        if reset_peak:
            self._peak_gathered = self._gathered_bytes()
        return stats

    def reset_peak_memory_stats(self) -> None:
        """Start a new window for ``peak_memory_mb``."""
        self._peak_gathered = self._gathered_bytes()

    estimate_memory = staticmethod(estimate_memory)
