"""Collectives on picklable Python objects: broadcast_object, all_gather_object, gather_object (over MPI)."""
from __future__ import annotations

from typing import Any, List, Optional

from .group import ProcessGroup
from .host_staging import _check_root, _debug, _group, _host_backend

__all__ = ["broadcast_object", "all_gather_object", "gather_object"]


def broadcast_object(obj: Any, src: int = 0, group: Optional[ProcessGroup] = None) -> Any:
    """Broadcast any picklable object from group rank ``src``; every rank returns it."""
    g = _group(group)
    src = _check_root(g, src, "src")
    _debug(g, "broadcast_object", src=src)
    return _host_backend(g).broadcast_object(obj, src) if g.size > 1 else obj


def all_gather_object(obj: Any, group: Optional[ProcessGroup] = None) -> List[Any]:
    """Gather a picklable object from every rank onto every rank (list in group-rank order)."""
    g = _group(group)
    _debug(g, "all_gather_object")
    return _host_backend(g).allgather_object(obj) if g.size > 1 else [obj]


def gather_object(obj: Any, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[List[Any]]:
    """Gather a picklable object on group rank ``dst`` (list there, ``None`` elsewhere)."""
    g = _group(group)
    dst = _check_root(g, dst, "dst")
    _debug(g, "gather_object", dst=dst)
    return _host_backend(g).gather_object(obj, dst) if g.size > 1 else [obj]
