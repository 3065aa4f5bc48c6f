"""Gradient-recording mode: ``no_grad``, ``enable_grad``, ``set_grad_enabled``, ``is_grad_enabled``."""
from __future__ import annotations

import functools
import threading

__all__ = ["enable_grad", "is_grad_enabled", "no_grad", "set_grad_enabled"]

_MODE = threading.local()


def is_grad_enabled() -> bool:
    """True when operations on tensors that require grad are recorded for backward."""
    return getattr(_MODE, "enabled", True)


def _set(mode: bool) -> None:
    _MODE.enabled = bool(mode)


class _ModeContext:
    """A fixed mode usable as ``with m():``, ``@m`` and ``@m()`` (subclasses fix ``_MODE_VALUE``)."""

    _MODE_VALUE = True

    def __new__(cls, fn=None):
        self = super().__new__(cls)
        self._prev = []
        if fn is not None:  # used bare as a decorator: @no_grad
            return self(fn)
        return self

    def __init__(self, fn=None):
        pass

    def __enter__(self):
        self._prev.append(is_grad_enabled())
        _set(self._MODE_VALUE)
        return self

    def __exit__(self, *exc):
        _set(self._prev.pop())
        return False

    def __call__(self, fn):
        cls = type(self)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with cls():
                return fn(*args, **kwargs)

        return wrapper


class no_grad(_ModeContext):
    """Disable gradient recording in a block or a decorated function (``@no_grad`` or ``@no_grad()``).

    Example:
        >>> with no_grad():
        ...     y = model(x)          # no graph is built
    """

    _MODE_VALUE = False


class enable_grad(_ModeContext):
    """Re-enable gradient recording inside a ``no_grad`` block or a decorated function."""

    _MODE_VALUE = True


class set_grad_enabled:
    """Set gradient recording on or off: as a call, a context manager or a decorator (PyTorch's).

    Called as a plain function it switches the mode at once (for this thread) and keeps it; used
    in ``with`` it restores the previous mode on exit; used as ``@set_grad_enabled(mode)`` it
    applies ``mode`` inside each call of the function only.

    Args:
        mode: True to record operations for backward, False not to.

    Example:
        >>> set_grad_enabled(False)      # off from here on
        >>> with set_grad_enabled(True):
        ...     pass                     # on inside the block, off again after it
        >>> set_grad_enabled(True)
    """

    def __init__(self, mode: bool) -> None:
        self.mode = bool(mode)
        self.prev = is_grad_enabled()
        _set(self.mode)

    def __enter__(self):
        _set(self.mode)
        return self

    def __exit__(self, *exc):
        _set(self.prev)
        return False

    def __call__(self, fn):
        _set(self.prev)  # decorating does not change the mode of the caller
        mode = self.mode

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with set_grad_enabled(mode):
                return fn(*args, **kwargs)

        return wrapper
