"""Loss scaling for float16 training: ``GradScaler`` with PyTorch's semantics (inf check agreed across ranks)."""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from .backend import get_array_module
from .distributed import ReduceOp, all_reduce, resolve_group

__all__ = ["GradScaler", "autocast"]


class GradScaler:
    """Scale the loss so float16 gradients do not underflow; skip steps whose gradients overflow.

    ``scale(loss)`` multiplies the loss by the current scale; ``unscale_(optimizer)`` divides
    the optimizer's gradients by it and checks them for inf/nan (the flag is all-reduced over
    ``group``, so every rank skips the same steps even when only one rank's shard overflowed);
    ``step(optimizer)`` steps unless an inf/nan was found; ``update()`` halves the scale
    (``backoff_factor``) after an overflow and doubles it (``growth_factor``) after
    ``growth_interval`` clean steps in a row. ``skipped`` is True after a ``step`` that an inf/nan
    skipped (a trainer logs it and goes on: see :mod:`axonmpi.finite`).

    Args:
        init_scale: the first scale.
        growth_factor: multiplier after ``growth_interval`` steps without inf/nan.
        backoff_factor: multiplier after a step with inf/nan.
        growth_interval: clean steps between growths.
        enabled: False makes every method a pass-through.
        group: ranks that agree on the inf check (default: all ranks).

    Example:
        >>> scaler = GradScaler()
        >>> scaler.scale(loss).backward()
        >>> scaler.unscale_(opt); model.clip_grad_norm_(1.0)
        >>> scaler.step(opt); scaler.update()
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *, group=None):
        if not init_scale > 0:
            raise ValueError(f"GradScaler: init_scale must be > 0, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"GradScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"GradScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if int(growth_interval) < 1:
            raise ValueError(f"GradScaler: growth_interval must be >= 1, got {growth_interval}")
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.enabled = bool(enabled)
        self.skipped = False        # the last step() found an inf/nan and did not step
        self._group = group
        self._growth_tracker = 0
        self._per_opt: Dict[int, Dict[str, Any]] = {}

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self.enabled

    @property
    def group(self):
        """The ranks that agree on the inf check (default: all ranks)."""
        return resolve_group(self._group)

    def scale(self, outputs):
        """``outputs * scale`` (a Tensor, or a list/tuple of them)."""
        if not self.enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(o * self._scale for o in outputs)
        return outputs * self._scale

    def unscale_(self, optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale, in place, and record whether any is inf/nan.

        Raises:
            RuntimeError: when called twice for one optimizer before :meth:`update`.
        """
        if not self.enabled:
            return
        st = self._per_opt.setdefault(id(optimizer), {"unscaled": False, "found_inf": None})
        if st["unscaled"]:
            raise RuntimeError("GradScaler.unscale_() was already called on this optimizer since the last update()")
        group = resolve_group(self._group)
        grads = [p.grad.data for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for a in grads:
            if a.dtype == np.float16:
                # torch: "Attempting to unscale FP16 gradients."  1/scale in float16 rounds (to 0
                # from scale 2**25 on), so the gradients would be silently wrong.
                raise ValueError(f"rank {group.rank}: GradScaler.unscale_ got a float16 gradient (shape "
                                 f"{tuple(a.shape)}); keep float32 master parameters and compute in "
                                 "float16 (FSDP/DDP mixed_precision, or cast the model to float32), as "
                                 "torch.amp.GradScaler requires")
        inv = 1.0 / self._scale
        bad = 0.0
        for a in grads:
            xp = get_array_module(a)
            if a.dtype.itemsize < 4:  # bfloat16: unscale in float32, round once
                a[...] = (a.astype(np.float32) * np.float32(inv)).astype(a.dtype)
            else:
                a *= np.asarray(inv, a.dtype)
            if a.size and not bool(xp.isfinite(a).all()):
                bad = 1.0
        found = all_reduce(np.array(bad), ReduceOp.MAX, group)
        st["unscaled"] = True
        st["found_inf"] = bool(found > 0)

    def step(self, optimizer, *args, **kwargs):
        """Unscale if needed, then ``optimizer.step()`` unless an inf/nan was found (returns its result or None)."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        st = self._per_opt.get(id(optimizer))
        if st is None or not st["unscaled"]:
            self.unscale_(optimizer)
            st = self._per_opt[id(optimizer)]
        self.skipped = bool(st["found_inf"])
        if self.skipped:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Optional[float] = None) -> None:
        """Adjust the scale after the step(s) of this iteration (or set it to ``new_scale``)."""
        if not self.enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
        else:
            found = any(st["found_inf"] for st in self._per_opt.values())
            if found:
                self._scale *= self.backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self.growth_interval:
                    self._scale *= self.growth_factor
                    self._growth_tracker = 0
        self._per_opt = {}

    def state_dict(self) -> Dict[str, Any]:
        """The scaler's state under PyTorch's keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``); ``{}`` when disabled (as PyTorch).  Save it with the
        checkpoint so a resumed run continues with the same scale and growth count.

        Example:
            >>> GradScaler(init_scale=8.0).state_dict()["scale"]
            8.0
        """
        if not self.enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (values read from a checkpoint may be NumPy scalars).

        Raises:
            RuntimeError: ``state`` is empty (saved by a disabled scaler) while this one is enabled.
            KeyError: a key is missing, naming it.
        """
        if not self.enabled:
            return
        if not state:
            raise RuntimeError("GradScaler.load_state_dict: the state dict is empty, possibly because it was saved "
                               "from a disabled GradScaler")
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
                   if k not in state]
        if missing:
            raise KeyError(f"GradScaler.load_state_dict: the state dict lacks {missing} (has {sorted(state)})")
        self._scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])


class autocast:
    """``torch.amp.autocast`` / ``torch.autocast``: accepted as a no-op where it asks for float32 (or is disabled),
    which is what it does on a CPU host running float32 code. Lower precisions are not built as an autocast here
    (use a strategy's ``MixedPrecision``): ``dtype=torch.bfloat16`` / ``float16`` raises NotImplementedError.

    Example:
        >>> with autocast(device_type="cuda", dtype=np.float32):
        ...     loss = model(x).sum()
    """

    def __init__(self, device_type: str = "cuda", dtype=None, enabled: bool = True, cache_enabled=None):
        import numpy as np
        self.device_type, self.enabled = device_type, bool(enabled)
        self.dtype = None if dtype is None else np.dtype(dtype)
        if self.enabled and self.dtype is not None and self.dtype != np.float32:
            raise NotImplementedError(
                f"autocast(dtype={self.dtype}) is not built: axonmpi computes in the parameters' dtype; run float32 "
                "(nanoGPT: --dtype=float32) or use parallelize(..., mixed_precision=MixedPrecision(...))")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __call__(self, fn):
        return fn
