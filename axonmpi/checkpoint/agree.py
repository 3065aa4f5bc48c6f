"""Failure agreement for collective checkpoint calls: an error on any rank raises on every rank.

Every exchange goes through the axonmpi object collectives on the caller's group, so debug mode
(``AXONMPI_DEBUG=1``) checks that all ranks reach the same step of a save or load.
"""
from __future__ import annotations

import re
from typing import Any, List, Optional, Tuple

from ..distributed.collectives import all_gather_object, broadcast_object
from .format import CheckpointError, CheckpointMismatchError
from .runlock import FolderInUseError

__all__ = ["describe", "agree", "share", "raise_from"]

_SAME_TYPE = {c.__name__: c for c in (TypeError, ValueError, KeyError, FileExistsError, FileNotFoundError,
                                       PermissionError, NotImplementedError, CheckpointError, CheckpointMismatchError,
                                       FolderInUseError)}

Outcome = Optional[Tuple[str, str]]  # None, or (exception type name, message)


def describe(error: Optional[BaseException]) -> Outcome:
    """A picklable summary of ``error`` (None when there is none)."""
    return None if error is None else (type(error).__name__, str(error))


def raise_from(outcomes: List[Outcome], error: Optional[BaseException], what: str, g) -> None:
    """Re-raise this rank's own error, or one of the first failing rank's type naming every failure."""
    bad = [(r, m) for r, m in enumerate(outcomes) if m is not None]
    if not bad:
        return
    if error is not None:
        raise error
    lines = "; ".join(f"rank {r}: {t}: {m}" for r, (t, m) in bad)
    text = f"rank {g.rank}: {what} failed on group rank(s) {[r for r, _ in bad]}: {lines}"
    t, m = bad[0][1]
    code = re.match(r"\[Errno (\d+)\]", m)
    if t == "OSError" and code:        # a full disk (ENOSPC) on one rank is an OSError with its errno everywhere
        raise OSError(int(code.group(1)), text)
    raise _SAME_TYPE.get(t, CheckpointError)(text)


def agree(g, error: Optional[BaseException], what: str) -> None:
    """Collective over ``g``: raise on every rank if any rank passed an error."""
    raise_from(all_gather_object(describe(error), group=g), error, what, g)


def share(g, value: Any, error: Optional[BaseException], what: str, src: int = 0) -> Any:
    """Collective over ``g``: broadcast ``value`` from ``src``, or raise everywhere its error."""
    value, outcome = broadcast_object((value, describe(error)), src=src, group=g)
    raise_from([outcome], error, what, g)
    return value
