"""One rule for turning a user's string (or member) into an enum member: ``coerce_enum``."""
from __future__ import annotations

import enum
from typing import Any, Mapping, Optional, Type, TypeVar

__all__ = ["coerce_enum"]

E = TypeVar("E", bound=enum.Enum)


def coerce_enum(cls: Type[E], value: Any, what: str, *, aliases: Optional[Mapping[Any, E]] = None) -> E:
    """The member of ``cls`` that ``value`` names: the member itself, its value, or its name (strings in
    any case, surrounding blanks ignored), or an entry of ``aliases``.

    Raises:
        ValueError: ``unknown <what> <value>; expected one of [<values>]``.

    Example:
        >>> coerce_enum(ShardingStrategy, "FULL_SHARD", "sharding_strategy")
        <ShardingStrategy.FULL_SHARD: 'full_shard'>
    """
    if isinstance(value, cls):
        return value
    try:
        if aliases is not None and value in aliases:
            return aliases[value]
    except TypeError:            # an unhashable value names no alias
        pass
    if isinstance(value, str):
        key = value.strip()
        for m in cls:
            if key.lower() == str(m.value).lower():
                return m
        for name, m in cls.__members__.items():      # names, aliases included
            if key.upper() == name:
                return m
    else:
        for m in cls:
            if not isinstance(value, bool) and value == m.value:
                return m
    raise ValueError(f"unknown {what} {value!r}; expected one of {[m.value for m in cls]}")
