"""Work handles for non-blocking collectives and point-to-point calls, and their continuations."""
from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["Work"]


class _After:
    """Request-like adapter: a continuation's "request" is the completion of its parent Work."""

    __slots__ = ("parent",)

    def __init__(self, parent: "Work"):
        self.parent = parent

    def Wait(self) -> None:  # noqa: N802 - the request protocol (Wait/Test) of mpi4py
        self.parent.wait()

    def Test(self) -> bool:  # noqa: N802
        return self.parent.is_completed()


class Work:
    """Handle of a non-blocking operation.

    ``wait()`` blocks until the operation is done and returns its result (the output
    array, or ``None``); ``is_completed()`` tests without blocking. Buffers handed to the
    operation stay referenced by the handle until it completes, so they cannot be freed
    under MPI's feet; ``then(fn)`` chains a continuation without touching the handle.

    Example:
        >>> work = axonmpi.all_reduce(grad, async_op=True)
        >>> ...                      # compute while the reduction runs
        >>> grad = work.wait()
    """

    __slots__ = ("_req", "_finish", "_result", "_done", "_keep", "_error")

    def __init__(self, request=None, result: Any = None, finish: Optional[Callable[[], Any]] = None,
                 keep: Any = None):
        self._req = request
        self._finish = finish
        self._result = result
        self._keep = keep
        self._error = None
        self._done = request is None
        if self._done and finish is not None:
            self._complete()
            if self._error is not None:
                raise self._error

    def _complete(self) -> None:
        self._done = True
        fin, self._finish = self._finish, None
        try:
            if fin is not None:
                out = fin()
                if out is not None:
                    self._result = out
        except BaseException as e:  # kept, and raised by every wait()
            self._error = e
        finally:
            self._keep = None
            self._req = None

    def wait(self) -> Any:
        """Block until done; return the result (raise what the completion step raised)."""
        if not self._done:
            self._req.Wait()
            self._complete()
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        """True when done (drives MPI progress; finishes the operation if it just completed)."""
        if not self._done and self._req.Test():
            self._complete()
        return self._done

    def result(self) -> Any:
        """The result, waiting if needed (same as :meth:`wait`)."""
        return self.wait()

    def then(self, fn: Callable[[Any], Any]) -> "Work":
        """A Work that completes once this one has completed and ``fn(result)`` has run.

        ``fn`` receives this Work's result; its return value is the new Work's result (``None``
        keeps ``None``). ``fn`` runs exactly once, when the new Work is waited on or tested
        complete (at once if this Work is already done). This Work, and so every buffer it
        keeps, stays referenced until then. An exception from ``fn`` is raised by ``wait()``.

        Args:
            fn: the continuation, ``fn(result) -> new_result``.

        Returns:
            The chained :class:`Work`.

        Example:
            >>> half = grad.astype(np.float16)
            >>> w = axonmpi.all_reduce(half, out=half, async_op=True)
            >>> w2 = w.then(lambda h: np.copyto(grad, h) or grad)   # upcast when done
            >>> w2.wait() is grad
            True
        """
        if not callable(fn):
            raise TypeError(f"Work.then needs a callable(result), got {fn!r}")
        parent = self

        def run():
            return fn(parent.wait())

        work = Work(_After(self), finish=run)
        if self._done:
            work.is_completed()
        return work

    def __repr__(self) -> str:
        return f"Work({'completed' if self._done else 'pending'})"
