"""Step 4 of the composer: activation checkpointing (a module's forward recomputed in backward).

``True`` checkpoints every child of the unit it is given (the model; a pipeline stage is one unit, run as one
checkpoint); fnmatch patterns name modules of the model.  Names and parameters are unchanged; the recomputed
forward draws the same dropout masks (:func:`axonmpi.nn.checkpoint` keeps the random state).
"""
from __future__ import annotations

import fnmatch
from typing import Any, List

from ...nn.module import Module

__all__ = ["apply", "targets"]


def targets(module: Module, spec: Any, rank: int) -> List[Module]:
    """The modules ``spec`` names: ``True``, every child of ``module``; patterns on ``named_modules()``."""
    if spec is True:
        return [m for _, m in module.named_children()]
    pats = [spec] if isinstance(spec, str) else list(spec)
    found = [m for q, m in module.named_modules() if q and any(fnmatch.fnmatchcase(q, p) for p in pats)]
    if not found:
        raise ValueError(f"rank {rank}: activation_checkpointing={spec!r} matches no module of the model")
    return found


def apply(module: Module, spec: Any, rank: int, *, whole: bool = False) -> int:
    """Checkpoint what ``spec`` names in ``module`` (``whole``: ``module`` itself, as one unit); returns how many."""
    from ...nn.checkpointing import checkpoint
    if spec in (None, False):
        return 0
    mods = [module] if whole else targets(module, spec, rank)
    for m in mods:
        fwd = m.forward
        # keyword arguments (a module's positions=, [Note: positions]) reach the recomputed forward unchanged
        object.__setattr__(m, "forward", lambda *a, _f=fwd, **k: checkpoint(lambda *b: _f(*b, **k), *a) if k
                           else checkpoint(_f, *a))
    return len(mods)
