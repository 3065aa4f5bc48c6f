"""``torch.cuda``'s common names over CuPy, answering as a CPU host does where there is no GPU.

``is_available()`` and ``device_count()`` tell whether CuPy sees a GPU; ``set_device(i)`` makes
GPU ``i`` current there and does nothing on a host without one (so a GPU script ported by its
imports runs on a CPU cluster: its ``.to(rank)`` is the CPU, :func:`axonmpi.backend.index_device`).

Example:
    >>> import axonmpi as torch
    >>> device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
"""
from __future__ import annotations

import time

from . import backend as _be

__all__ = ["is_available", "device_count", "set_device", "current_device", "synchronize", "manual_seed",
           "manual_seed_all", "Event", "memory_allocated", "max_memory_allocated", "empty_cache", "is_bf16_supported"]


def is_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    return _be.cupy_available()


def device_count() -> int:
    """The number of GPUs CuPy sees (0 without CuPy)."""
    return _be.device_count()


def set_device(device) -> None:
    """Make GPU ``device`` (an index, ``"cuda:i"`` or a Device) current; nothing without a GPU."""
    cp = _be.get_cupy()
    if cp is None:
        return
    dev = _be.Device(device) if not isinstance(device, int) else _be.Device("cuda", device)
    if dev.type == "cuda":
        cp.cuda.Device(dev.index).use()


def current_device() -> int:
    """The current GPU's index (0 without a GPU)."""
    cp = _be.get_cupy()
    return 0 if cp is None else int(cp.cuda.Device().id)


def synchronize(device=None) -> None:
    """Wait for the GPU's work (nothing without a GPU)."""
    cp = _be.get_cupy()
    if cp is not None:
        cp.cuda.Device().synchronize()


def manual_seed(seed: int) -> None:
    """Seed axonmpi's generators (the host one and CuPy's): ``axonmpi.manual_seed``."""
    from .random import manual_seed as _ms
    _ms(seed)


manual_seed_all = manual_seed


def memory_allocated(device=None) -> int:
    """Bytes in use in CuPy's memory pool (0 without a GPU)."""
    cp = _be.get_cupy()
    return 0 if cp is None else int(cp.get_default_memory_pool().used_bytes())


def max_memory_allocated(device=None) -> int:
    """Bytes held by CuPy's memory pool (its peak is not tracked; 0 without a GPU)."""
    cp = _be.get_cupy()
    return 0 if cp is None else int(cp.get_default_memory_pool().total_bytes())


def empty_cache() -> None:
    """Free CuPy's unused pool blocks (nothing without a GPU)."""
    cp = _be.get_cupy()
    if cp is not None:
        cp.get_default_memory_pool().free_all_blocks()


class Event:
    """``torch.cuda.Event(enable_timing=True)``: ``record()`` then ``a.elapsed_time(b)`` in milliseconds
    (a CuPy event on a GPU, the host clock after a synchronize otherwise)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._t = None
        self._ev = None

    def record(self, stream=None) -> None:
        cp = _be.get_cupy()
        if cp is not None:
            self._ev = cp.cuda.Event()
            self._ev.record()
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        if self._ev is not None:
            self._ev.synchronize()

    def elapsed_time(self, end: "Event") -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("Event.elapsed_time: record() both events first")
        if self._ev is not None and end._ev is not None:
            cp = _be.get_cupy()
            end._ev.synchronize()
            return float(cp.cuda.get_elapsed_time(self._ev, end._ev))
        return (end._t - self._t) * 1000.0


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """torch's ``torch.cuda.is_bf16_supported``: False (axonmpi computes bfloat16 only under mixed precision)."""
    return False


def __getattr__(name: str):
    if name == "amp":                     # torch.cuda.amp.GradScaler / autocast: axonmpi.amp's
        from . import amp
        return amp
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
