"""argparse value types that refuse what makes no sense, naming the value (the CLIs' and the examples' flags)."""
from __future__ import annotations

import argparse

__all__ = ["count0", "positive", "positive_int"]


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


def count0(text: str) -> int:
    """A whole number >= 0 (0 meaning "none" or "the default")."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {n}")
    return n


def positive(text: str) -> float:
    """A number > 0 (a bandwidth, a rate, a size)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return x
