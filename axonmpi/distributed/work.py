"""Work handles for non-blocking collectives and point-to-point calls."""
from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["Work"]


class Work:
    """Handle of a non-blocking operation.

    ``wait()`` blocks until the operation is done and returns its result (the output
    array, or ``None``); ``is_completed()`` tests without blocking. Buffers stay referenced
    by the handle until it completes, so they cannot be freed under MPI's feet.

    Example:
        >>> work = axonmpi.all_reduce(grad, async_op=True)
        >>> ...                      # compute while the reduction runs
        >>> grad = work.wait()
    """

    __slots__ = ("_req", "_finish", "_result", "_done", "_keep")

    def __init__(self, request=None, result: Any = None, finish: Optional[Callable[[], Any]] = None,
                 keep: Any = None):
        self._req = request
        self._finish = finish
        self._result = result
        self._keep = keep
        self._done = request is None
        if self._done and finish is not None:
            self._complete()

    def _complete(self) -> None:
        self._done = True
        fin, self._finish = self._finish, None
        if fin is not None:
            out = fin()
            if out is not None:
                self._result = out
        self._keep = None
        self._req = None

    def wait(self) -> Any:
        """Block until done; return the result."""
        if not self._done:
            self._req.Wait()
            self._complete()
        return self._result

    def is_completed(self) -> bool:
        """True when done (drives MPI progress; finishes the operation if it just completed)."""
        if not self._done and self._req.Test():
            self._complete()
        return self._done

    def result(self) -> Any:
        """The result, waiting if needed (same as :meth:`wait`)."""
        return self.wait()

    def __repr__(self) -> str:
        return f"Work({'completed' if self._done else 'pending'})"
