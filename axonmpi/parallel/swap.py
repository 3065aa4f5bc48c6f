"""The one module-swap walker every strategy uses: each submodule slot ``(parent, name, child, qualified
name)``, listed before any swap, and :func:`swap_modules`, which puts a strategy's replacement in a slot."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

from ..nn.module import Module

__all__ = ["hand_over", "keep_class", "keep_parameters", "mark_replaced", "module_slots", "swap_modules"]


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


def keep_parameters(new: Module, old: Module, adopted: set) -> None:
    """The serial module's Parameter objects carry on in ``new``, its replacement ([Note: a parameter keeps its
    identity] in ``nn/parameter.py``): each parameter of ``new`` named as one of ``old``'s hands its storage
    (``.data``: this rank's piece), its placement and tags to ``old``'s object, which takes its place in ``new``.
    So an optimizer built on the serial model before the swap holds the live parameters, and ``p.shape`` is
    still the serial shape.  ``adopted`` (ids) collects the objects kept; one already kept (a weight tied
    between two swapped modules, listed in ``adopted`` beforehand) is not kept here: the tie is re-made
    afterwards and the serial object then takes the tied one's place (``axes/tensor.py``'s ``_retie``).
    """
    from ..nn.parameter import Parameter
    olds = dict(old.named_parameters())
    for qual, m in new.named_modules():
        for name, p in list(m._parameters.items()):
            q = None if p is None else olds.get(f"{qual}.{name}" if qual else name)
            if q is None or q is p or id(q) in adopted or not isinstance(q, Parameter):
                continue
            hand_over(p, q)
            setattr(m, name, q)
            adopted.add(id(q))


def hand_over(new, old) -> None:
    """``old`` (the serial Parameter object) takes ``new``'s storage, placement and tags; the caller puts
    ``old`` where ``new`` was."""
    old.__dict__.pop("_global_shape", None)
    old.__dict__.pop("_replaced", None)
    old.__dict__.update(new.__dict__)
    old.data, old.grad = new.data, None
    old.requires_grad = new.requires_grad


def mark_replaced(before, module: Module, what: str) -> None:
    """Mark every parameter of ``before`` that ``module`` no longer holds: an optimizer stepping one raises at its
    first ``step()`` naming the fix, instead of training a tensor the model does not use."""
    live = {id(p) for p in module.parameters()}
    for p in before:
        if id(p) not in live and hasattr(p, "__dict__"):
            p.__dict__["_replaced"] = (
                f"this parameter (serial shape {tuple(p.data.shape)}) was replaced by {what} and the model no longer "
                "uses it; an optimizer built before the model was laid out holds it: build the optimizer from "
                "pm.parameters() after parallelize")


_KEPT_CLASSES = {}


def keep_class(new: Module, old: Module) -> Module:
    """``new`` (a strategy's replacement for ``old``) stays an instance of ``old``'s class, as DTensor's
    ``parallelize_module`` keeps an ``nn.Linear`` one: its class becomes a subclass of both (the strategy's
    first, so its forward and state run; named as the strategy's).  So ``isinstance(m, nn.Linear)`` in the
    user's code (minGPT's param groups, init rules) sees the serial module kinds.  Returns ``new``."""
    base = type(old)
    if isinstance(new, base):
        return new
    key = (type(new), base)
    cls = _KEPT_CLASSES.get(key)
    if cls is None:
        kind = type(new)
        cls = _KEPT_CLASSES[key] = type(kind.__name__, (kind, base),
                                       {"__module__": kind.__module__, "__doc__": kind.__doc__,
                                        "__qualname__": kind.__qualname__})
    new.__class__ = cls
    return new
