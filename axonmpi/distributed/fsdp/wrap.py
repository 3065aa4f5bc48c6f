"""``torch.distributed.fsdp.wrap``'s path: torch's auto-wrap policies (the library's own) and
``enable_wrap`` / ``wrap`` for wrapping by hand."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

from ...parallel.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

__all__ = ["size_based_auto_wrap_policy", "transformer_auto_wrap_policy", "ModuleWrapPolicy", "enable_wrap", "wrap"]

# The wrapper of the innermost enable_wrap block and its keyword arguments (torch's _ConfigAutoWrap):
# set only inside a `with enable_wrap(...)` block, restored when it ends.
_ACTIVE: List[Tuple[Any, Dict[str, Any]]] = []


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any = None, **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside the block, :func:`wrap` wraps modules in ``wrapper_cls`` (default: torch's-signature FSDP)
    with ``wrapper_kwargs``.

    Example:
        >>> with enable_wrap(wrapper_cls=FSDP, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP):
        ...     model = nn.Sequential(wrap(block1), wrap(block2), head)
        >>> model = FSDP(model)               # the root adopts the inner units
    """
    if wrapper_cls is None:
        from .fully_sharded_data_parallel import FullyShardedDataParallel as wrapper_cls
    _ACTIVE.append((wrapper_cls, dict(wrapper_kwargs)))
    try:
        yield
    finally:
        _ACTIVE.pop()


def wrap(module: Any, **wrap_overrides: Any) -> Any:
    """Inside :func:`enable_wrap`: ``wrapper_cls(module, **kwargs, **wrap_overrides)``; outside: ``module``."""
    if not _ACTIVE:
        return module
    cls, kwargs = _ACTIVE[-1]
    return cls(module, **{**kwargs, **wrap_overrides})
