"""argparse value types that refuse what makes no sense, naming the value (the CLIs' and the examples' flags)."""
from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["count0", "positive", "positive_int"]


def _checked(text: str, cast: Callable, ok: Callable, expect: str):
    try:
        v = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expect}, got {text!r}") from None
    if not ok(v):
        raise argparse.ArgumentTypeError(f"expected {expect}, got {v}")
    return v


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    return _checked(text, int, lambda n: n >= 1, "a whole number >= 1")


def count0(text: str) -> int:
    """A whole number >= 0 (0 meaning "none" or "the default")."""
    return _checked(text, int, lambda n: n >= 0, "a whole number >= 0")


def positive(text: str) -> float:
    """A number > 0 (a bandwidth, a rate, a size)."""
    return _checked(text, float, lambda x: x > 0 and x != float("inf"), "a number > 0")
