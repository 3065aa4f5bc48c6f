"""The one module-swap walker every strategy uses: each submodule slot ``(parent, name, child, qualified
name)``, listed before any swap, and :func:`swap_modules`, which puts a strategy's replacement in a slot."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from ..nn.module import Module

__all__ = ["module_slots", "swap_modules"]


def module_slots(module: Module) -> List[Tuple[Module, str, Module, str]]:
    """``(parent, attribute name, child, qualified name)`` for every submodule, in ``named_modules`` order.

    The list is taken whole before the caller swaps anything: a module swapped in is not visited, the
    module it replaced (and that module's children) still are.

    Example:
        >>> [q for _, _, _, q in module_slots(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))]
        ['0', '1']
    """
    out = []
    for qname, m in module.named_modules():
        for name, child in list(m.named_children()):
            if child is not None:
                out.append((m, name, child, f"{qname}.{name}" if qname else name))
    return out


def swap_modules(module: Module,
                 fn: Callable[[Module, str, Module, str], Optional[Module]]) -> List[Tuple[str, Module]]:
    """Call ``fn(parent, name, child, qualified_name)`` on every slot of :func:`module_slots`; where it returns
    a module, that module takes the child's place (in place, ``setattr(parent, name, new)``).

    Returns:
        ``(qualified name, new module)`` of every swap, in walk order.

    Example:
        >>> swap_modules(model, lambda p, n, c, q: nn.GELU() if type(c) is nn.ReLU else None)
    """
    swapped = []
    for parent, name, child, qname in module_slots(module):
        new = fn(parent, name, child, qname)
        if new is not None:
            setattr(parent, name, new)
            swapped.append((qname, new))
    return swapped
