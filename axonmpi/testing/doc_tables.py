"""Porting tables in the docs: their rows and the ``axonmpi`` names they give (for the tests that check them)."""
from __future__ import annotations

import importlib
import re
from typing import Any, List

__all__ = ["table_rows", "axonmpi_names", "resolve"]


def table_rows(path: str, heading: str, header: str, columns: int = 3) -> List[List[str]]:
    """The cells of the Markdown table under ``heading`` in ``path`` whose header line starts with ``header``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert heading in text, f"{path} lost its '{heading}' table"
    lines = text[text.index(heading):].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == columns, line
        rows.append(cells)
    return rows


def axonmpi_names(cell: str) -> List[str]:
    """The backticked ``axonmpi...`` names of a cell, call arguments dropped."""
    names = []
    for span in re.findall(r"`([^`]+)`", cell):
        span = span.split("(")[0].strip()
        if span == "axonmpi" or span.startswith("axonmpi."):
            names.append(span)
    return names


def resolve(dotted: str) -> Any:
    """The object a dotted name gives: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)
