"""Which submodules become FSDP units: the default rule and auto-wrap policies (by type or size)."""
from __future__ import annotations

from typing import Any, Callable, Iterable, List, Tuple, Type, Union

from ...nn import Module
from ...nn.module import ModuleDict, ModuleList, Sequential

__all__ = ["ModuleWrapPolicy", "SizeWrapPolicy", "find_units"]

_CONTAINERS = (ModuleList, ModuleDict, Sequential)


class ModuleWrapPolicy:
    """Make every submodule of the given types its own unit.

    Example:
        >>> FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    """

    def __init__(self, module_classes: Iterable[Type[Module]]):
        self.module_classes = tuple(module_classes)
        if not self.module_classes:
            raise ValueError("ModuleWrapPolicy needs at least one module class")

    def __call__(self, module: Module) -> bool:
        return isinstance(module, self.module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self.module_classes]})"


class SizeWrapPolicy:
    """Make a submodule a unit when it holds at least ``min_num_params`` parameter elements.

    The walk goes top-down and stops at the first module that qualifies, so the units are the
    largest subtrees above the threshold whose parent is not a unit itself; containers
    (``ModuleList``/``Sequential``/``ModuleDict``) are looked into, never wrapped whole.
    """

    def __init__(self, min_num_params: int):
        if int(min_num_params) < 1:
            raise ValueError(f"SizeWrapPolicy: min_num_params must be >= 1, got {min_num_params}")
        self.min_num_params = int(min_num_params)

    def __call__(self, module: Module) -> bool:
        return sum(p.data.size for p in module.parameters()) >= self.min_num_params

    def __repr__(self) -> str:
        return f"SizeWrapPolicy(min_num_params={self.min_num_params})"


Policy = Union[None, int, Callable[[Module], bool], Iterable[Type[Module]]]


def _as_policy(policy: Policy) -> Callable[[Module], bool]:
    if policy is None:
        return lambda m: any(True for _ in m.parameters())
    if isinstance(policy, bool):
        raise TypeError(f"auto_wrap_policy={policy!r}: expected a callable, a module class set or an int")
    if isinstance(policy, int):
        return SizeWrapPolicy(policy)
    if isinstance(policy, type) and issubclass(policy, Module):
        return ModuleWrapPolicy([policy])
    if callable(policy):
        return policy
    try:
        classes = list(policy)
    except TypeError:
        raise TypeError(f"auto_wrap_policy={policy!r}: expected a callable(module) -> bool, a set of "
                        "module classes or a minimum parameter count") from None
    return ModuleWrapPolicy(classes)


def find_units(root: Module, policy: Policy = None) -> List[Tuple[str, Module]]:
    """The ``(qualified name, module)`` of every unit below ``root``, in registration order.

    Default (``policy=None``): each child holding parameters is a unit, looking through
    containers (so each block of a ``ModuleList`` of transformer blocks is one). With a policy,
    the first module on each path from the root for which ``policy(module)`` is true. The
    parameters not inside any unit belong to the root unit.

    Example:
        >>> [n for n, _ in find_units(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)))]
        ['0', '2']
    """
    pred = _as_policy(policy)
    out: List[Tuple[str, Module]] = []

    def walk(mod: Module, prefix: str) -> None:
        for name, child in mod.named_children():
            if child is None:
                continue
            q = f"{prefix}.{name}" if prefix else name
            if not isinstance(child, _CONTAINERS) and pred(child):
                out.append((q, child))
            else:
                walk(child, q)

    walk(root, "")
    return out
