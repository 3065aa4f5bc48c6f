"""``torch.distributed.fsdp.fully_sharded_data_parallel``'s path: the library's FSDP with torch's
constructor arguments, and torch's configuration names.

[Note: why a subclass at torch's path]
The library's :class:`axonmpi.parallel.FullyShardedDataParallel` takes keyword options in its own
words (``group=``, ``cpu_offload=CPUOffload.FULL``, ``prefetch=``). A torch script passes torch's
(``process_group``, ``cpu_offload=CPUOffload(offload_params=True)``, ``backward_prefetch=``), some
positionally. The class here is that FSDP (a subclass, so ``isinstance`` and nesting hold) whose
constructor reads torch's signature and hands the library's the same choices; what it cannot honour
(``ignored_modules``, ``param_init_fn``, ``device_mesh``, ...) raises ``NotImplementedError`` naming
the argument. This module lives under ``distributed/`` by torch's name only: it imports the parallel
layer, and nothing in the library imports it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

from ...parallel.fsdp import CPUOffload as _Offload
from ...parallel.fsdp import FullyShardedDataParallel as _FSDP
from ...parallel.fsdp import MixedPrecision, ShardingStrategy

__all__ = ["FullyShardedDataParallel", "CPUOffload", "BackwardPrefetch", "MixedPrecision", "ShardingStrategy"]


@dataclass(frozen=True)
class CPUOffload:
    """torch's ``CPUOffload(offload_params=False)``: ``offload_params=True`` keeps the parameter shards,
    their gradients and the optimizer state on the host (the library's ``CPUOffload.FULL``)."""

    offload_params: bool = False


class BackwardPrefetch(enum.Enum):
    """torch's ``BackwardPrefetch``: when the next unit's all-gather is issued in backward.

    ``BACKWARD_PRE`` (torch's default): before this unit's gradient computation, non-blocking; that is
    the library's ``prefetch=True``. ``BACKWARD_POST`` (after it) is not built: it raises
    ``NotImplementedError`` at construction. ``None`` (no prefetch) is ``prefetch=False``.
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


def _offload(cpu_offload: Any, rank: int) -> _Offload:
    if cpu_offload is None:
        return _Offload.NONE
    if isinstance(cpu_offload, CPUOffload):
        return _Offload.FULL if cpu_offload.offload_params else _Offload.NONE
    return _Offload.coerce(cpu_offload)


class FullyShardedDataParallel(_FSDP):
    """torch's ``FullyShardedDataParallel(module, process_group=None, sharding_strategy=None, ...)``:
    the library's FSDP (``axonmpi.parallel.FullyShardedDataParallel``) built from torch's arguments.

    Args (torch's; see docs/fsdp.md for what each does here):
        process_group: the data-parallel group (default: the grid's data group); for HYBRID_SHARD a
            ``(shard_group, replicate_group)`` pair.
        sharding_strategy: a :class:`ShardingStrategy` (default FULL_SHARD).
        cpu_offload: ``CPUOffload(offload_params=True)`` or None.
        auto_wrap_policy: torch's policies (``functools.partial(size_based_auto_wrap_policy, ...)``,
            ``ModuleWrapPolicy``), or the library's forms.
        backward_prefetch: ``BackwardPrefetch.BACKWARD_PRE`` (default) or None; ``BACKWARD_POST`` raises.
        mixed_precision: a :class:`MixedPrecision` (``param_dtype``, ``reduce_dtype``, ``buffer_dtype``).
        device_id: the device the module moves to first (an int is GPU ``i``, the CPU on a host without one).
        sync_module_states: broadcast rank 0's parameters first (torch's default False: each rank keeps
            the values it built, which is the same model when every rank seeds alike).
        forward_prefetch, limit_all_gathers: accepted (the library's prefetch covers forward too;
            all-gathers are issued one unit ahead at most).
        use_orig_params: False (``parameters()`` are the flat shards); True raises.
        ignored_modules, param_init_fn, ignored_states, device_mesh: must be None (not built).
    """

    def __init__(self, module, process_group=None, sharding_strategy=None, cpu_offload=None, auto_wrap_policy=None,
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE, mixed_precision: Optional[MixedPrecision] = None,
                 ignored_modules=None, param_init_fn=None, device_id=None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True, use_orig_params: bool = False,
                 ignored_states=None, device_mesh=None):
        from ..world import get_world
        rank = get_world().rank
        for name, value in (("ignored_modules", ignored_modules), ("param_init_fn", param_init_fn),
                            ("ignored_states", ignored_states), ("device_mesh", device_mesh)):
            if value is not None:
                raise NotImplementedError(f"rank {rank}: FullyShardedDataParallel({name}=...) is not built here; "
                                          f"leave it out (docs/porting.md lists what FSDP takes)")
        if backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            raise NotImplementedError(f"rank {rank}: backward_prefetch=BackwardPrefetch.BACKWARD_POST is not built: "
                                      "use BACKWARD_PRE (the all-gather issued before the unit's backward) or None")
        if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
            raise TypeError(f"rank {rank}: backward_prefetch={backward_prefetch!r}; expected a BackwardPrefetch or None")
        super().__init__(module, group=process_group,
                         sharding_strategy=ShardingStrategy.FULL_SHARD if sharding_strategy is None else sharding_strategy,
                         cpu_offload=_offload(cpu_offload, rank), mixed_precision=mixed_precision,
                         auto_wrap_policy=auto_wrap_policy,
                         prefetch=backward_prefetch is not None or bool(forward_prefetch),
                         sync_module_states=bool(sync_module_states), device_id=device_id,
                         use_orig_params=use_orig_params)


FSDP = FullyShardedDataParallel
