"""Gather the whole training state (model, optimizer, scheduler, sampler, RNG, step) and restore it."""
from __future__ import annotations

import inspect
import json
from typing import Any, Dict, Optional

__all__ = ["training_state", "restore_training_state"]


def _state_dict(obj: Any, what: str) -> Any:
    if not hasattr(obj, "state_dict"):
        raise TypeError(f"{what} must have a state_dict() method, got {type(obj).__name__}")
    return obj.state_dict()


def _load_state_dict(obj: Any, sd: Any, what: str, strict: bool) -> None:
    if not hasattr(obj, "load_state_dict"):
        raise TypeError(f"{what} must have a load_state_dict() method, got {type(obj).__name__}")
    try:
        takes_strict = "strict" in inspect.signature(obj.load_state_dict).parameters
    except (TypeError, ValueError):
        takes_strict = False
    if takes_strict:
        obj.load_state_dict(sd, strict=strict)
    else:
        obj.load_state_dict(sd)


def _unwrap(model, optimizer):
    """A recipe object (``HybridGPT``: it has ``checkpoint_state(optimizer)``) stands for the model and optimizer it
    names; anything else is returned as it is."""
    if model is not None and not hasattr(model, "state_dict") and callable(getattr(model, "checkpoint_state", None)):
        return model.checkpoint_state(optimizer)
    return model, optimizer


def training_state(model=None, optimizer=None, scheduler=None, sampler=None, *, rng: bool = True,
                   step: Optional[int] = None, epoch: Optional[int] = None, extra: Optional[dict] = None,
                   group=None) -> Dict[str, Any]:
    """The full training state as a checkpoint ``state`` dict (collective when ``rng=True``).

    Every object is duck-typed: anything with ``state_dict()`` works (a module, an optimizer,
    an LR scheduler, a sampler or data loader); a recipe object such as ``HybridGPT`` (no ``state_dict()``, a
    ``checkpoint_state(optimizer)``) stands for the model and optimizer it lays out.  Sharded state stays sharded, under the serial
    parameter names: an FSDP model gives its ``sharded_state_dict()`` and ``optim_state_dict(optimizer)``
    (each rank's blocks of the flattened parameters and optimizer moments, nothing gathered), a
    ``ZeroRedundancyOptimizer`` its ``sharded_state_dict()``.  Load with this rank's
    ``training_state(...)`` as the template and :func:`restore_training_state`, at any world size. The RNG states of all ranks of ``group`` are
    gathered and stored as one JSON string (they hold ints wider than 64 bits), so each rank
    resumes its own stream.

    Returns:
        ``{"model": ..., "optimizer": ..., "scheduler": ..., "sampler": ..., "rng": "<json>",
        "meta": {"step": ..., "epoch": ..., "world_size": ...}, "extra": ...}`` (absent parts
        left out).

    Example:
        >>> mgr.save(step, training_state(model, opt, sampler=loader.sampler, step=step))
    """
    from ..distributed import all_gather_object, resolve_group
    model, optimizer = _unwrap(model, optimizer)
    state: Dict[str, Any] = {}
    sharded_model = model is not None and callable(getattr(model, "optim_state_dict", None))
    sharded_opt = optimizer is not None and callable(getattr(optimizer, "sharded_state_dict", None))
    for key, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("sampler", sampler)):
        if obj is not None and not (key == "model" and sharded_model) \
                and not (key == "optimizer" and (sharded_model or sharded_opt)):
            state[key] = _state_dict(obj, key)
    if model is not None and callable(getattr(model, "optim_state_dict", None)):   # FSDP: sharded blocks
        state["model"] = model.sharded_state_dict()
        if optimizer is not None:
            state["optimizer"] = model.optim_state_dict(optimizer)
    elif optimizer is not None and callable(getattr(optimizer, "sharded_state_dict", None)):  # ZeRO
        state["optimizer"] = optimizer.sharded_state_dict()
    g = resolve_group(group)
    if rng:
        from .. import random as _random
        state["rng"] = json.dumps(all_gather_object(_random.get_rng_state(), group=g))
    # step and epoch are always present (None when not given), so the state of a fresh model is a
    # template that takes any saved step: mgr.load_latest(training_state(model, opt))
    state["meta"] = {"world_size": g.size, "step": None if step is None else int(step),
                     "epoch": None if epoch is None else int(epoch)}
    if extra is not None:
        if not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
        state["extra"] = extra
    return state


def restore_training_state(loaded: Dict[str, Any], model=None, optimizer=None, scheduler=None, sampler=None,
                           *, rng: bool = True, strict: bool = True, group=None) -> Dict[str, Any]:
    """Put a loaded :func:`training_state` back into the given objects; returns ``meta`` (+ ``extra``).

    The RNG: with the same number of ranks each rank gets its own saved state; on fewer ranks
    than saved, identical saved states are applied everywhere; otherwise (also 1 -> 2 ranks,
    where every rank would get the same stream) rank ``r`` takes saved state ``r % n`` and a
    warning says the random streams are not a continuation.

    Example:
        >>> loaded = axonmpi.checkpoint.load(mgr.latest())
        >>> meta = restore_training_state(loaded, model, opt, sampler=loader.sampler)
        >>> start = meta["step"]
    """
    from ..distributed import resolve_group
    if loaded is None:
        raise ValueError(
            "restore_training_state(None, ...): nothing was loaded. CheckpointManager.load_latest() returns None "
            "when its folder holds no checkpoint (a fresh run): restore only when it returned a state "
            "(loaded = mgr.load_latest(...); if loaded is not None: restore_training_state(loaded, model, opt))")
    if not isinstance(loaded, dict):
        raise TypeError(f"restore_training_state: loaded must be the dict that load()/load_latest() returned, "
                        f"got {type(loaded).__name__}")
    model, optimizer = _unwrap(model, optimizer)
    for key, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler), ("sampler", sampler)):
        if obj is None:
            continue
        if key not in loaded:
            raise KeyError(f"the loaded state has no {key!r} entry (saved keys: {sorted(loaded)})")
        if key == "optimizer" and model is not None and callable(getattr(model, "load_optim_state_dict", None)):
            model.load_optim_state_dict(obj, loaded[key])     # FSDP: named, sharded optimizer state
            continue
        _load_state_dict(obj, loaded[key], key, strict)
    if rng and "rng" in loaded:
        from .. import random as _random
        g = resolve_group(group)
        states = json.loads(loaded["rng"])
        if len(states) == g.size or (g.size < len(states) and all(s == states[0] for s in states)):
            mine = states[g.rank % len(states)]
        else:
            from ..log import get_logger
            get_logger(__name__).warning(
                "RNG states were saved by %d ranks and are restored on %d: rank %d takes state %d",
                len(states), g.size, g.rank, g.rank % len(states))
            mine = states[g.rank % len(states)]
        _random.set_rng_state(mine)
    meta = dict(loaded.get("meta", {}))
    if "extra" in loaded:
        meta["extra"] = loaded["extra"]
    return meta
