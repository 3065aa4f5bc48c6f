"""Gradient-recording mode: ``no_grad``, ``enable_grad``, ``set_grad_enabled``, ``is_grad_enabled``."""
from __future__ import annotations

import functools
import threading

__all__ = ["enable_grad", "is_grad_enabled", "no_grad", "set_grad_enabled"]

_MODE = threading.local()


def is_grad_enabled() -> bool:
    """True when operations on tensors that require grad are recorded for backward."""
    return getattr(_MODE, "enabled", True)


class set_grad_enabled:
    """Context manager / decorator that sets gradient recording on or off (thread-local)."""

    def __init__(self, mode: bool = True):
        self.mode = bool(mode)
        self._prev = []

    def __enter__(self):
        self._prev.append(is_grad_enabled())
        _MODE.enabled = self.mode
        return self

    def __exit__(self, *exc):
        _MODE.enabled = self._prev.pop()
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with type(self)(*self._args()):
                return fn(*args, **kwargs)

        return wrapper

    def _args(self):
        return (self.mode,)


class _FixedMode(set_grad_enabled):
    """A mode usable as ``with m():``, ``@m`` and ``@m()`` (subclasses fix ``_MODE_VALUE``)."""

    _MODE_VALUE = True

    def __new__(cls, fn=None):
        self = super().__new__(cls)
        if fn is not None:  # used bare as a decorator: @no_grad
            self.__init__()
            return self(fn)
        return self

    def __init__(self, fn=None):
        super().__init__(self._MODE_VALUE)

    def _args(self):
        return ()


class no_grad(_FixedMode):
    """Disable gradient recording in a block or a decorated function (``@no_grad`` or ``@no_grad()``).

    Example:
        >>> with no_grad():
        ...     y = model(x)          # no graph is built
    """

    _MODE_VALUE = False


class enable_grad(_FixedMode):
    """Re-enable gradient recording inside a ``no_grad`` block or a decorated function."""

    _MODE_VALUE = True
