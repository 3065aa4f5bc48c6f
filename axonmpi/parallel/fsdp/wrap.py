"""Which submodules become FSDP units: the default rule, auto-wrap policies (by type or size), nested FSDP."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Iterator, List, Tuple, Type, Union

from ...nn import Module
from ...nn.module import ModuleDict, ModuleList, Sequential

__all__ = ["ModuleWrapPolicy", "SizeWrapPolicy", "size_based_auto_wrap_policy", "transformer_auto_wrap_policy",
           "find_units", "is_fsdp", "plan_units",
           "unwrapped_named_modules", "unwrapped_state_items"]

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


def size_based_auto_wrap_policy(module: Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8)) -> bool:
    """PyTorch's policy: look into every module; wrap one whose not-yet-wrapped parameters number
    at least ``min_num_params``. Use ``functools.partial(size_based_auto_wrap_policy, min_num_params=N)``."""
    return True if recurse else nonwrapped_numel >= min_num_params


def transformer_auto_wrap_policy(module: Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[Type[Module]] = ()) -> bool:
    """PyTorch's policy: wrap every instance of ``transformer_layer_cls`` (a set of classes).
    Use ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def _is_torch_style(policy: Callable) -> bool:
    """True for PyTorch's ``policy(module, recurse, nonwrapped_numel)`` callables (partials included)."""
    try:
        params = [p for p in inspect.signature(policy).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return False
    return len(params) == 3


class _TorchPolicy:
    """Adapts a PyTorch policy ``(module, recurse, nonwrapped_numel)`` to a set of units.

    [Note: PyTorch policies here]
    PyTorch walks bottom-up: where ``policy(m, recurse=True, numel)`` allows, it wraps the
    children first, then wraps ``m`` when ``policy(m, recurse=False, nonwrapped_numel)`` holds
    for the parameters not wrapped below it. Units here do not nest, so of the modules that walk
    wraps, the innermost ones (no wrapped module below them) become units; the parameters a
    PyTorch wrapper would hold around them belong to the root unit. The numbers are the same
    either way (FSDP is exact); only the grouping of the leftovers differs.
    """

    def __init__(self, policy: Callable, root: Module):
        self.policy, self.units = policy, set()
        self._visit(root, True)

    def _visit(self, m: Module, is_root: bool) -> "tuple[int, bool]":
        """(this subtree's parameters left unwrapped, whether a unit lies inside it)."""
        total = sum(p.data.size for p in m.parameters())
        own = sum(p.data.size for p in m.parameters(recurse=False))
        left, inner = own, False
        if self.policy(m, True, total):
            for child in m.children():
                if child is None or is_fsdp(child):
                    continue
                n, u = self._visit(child, False)
                left, inner = left + n, inner or u
        else:
            left = total
        if not is_root and not isinstance(m, _CONTAINERS) and self.policy(m, False, left):
            if not inner:
                self.units.add(id(m))
            return 0, True
        return left, inner

    def __call__(self, module: Module) -> bool:
        return id(module) in self.units


def _as_policy(policy: Policy, root: Module = None) -> Callable[[Module], bool]:
    if policy is None:
        return lambda m: any(True for _ in m.parameters())
    if isinstance(policy, bool):
        raise TypeError(f"auto_wrap_policy={policy!r}: expected a callable, a module class set or an int")
    if isinstance(policy, int):
        return SizeWrapPolicy(policy)
    if isinstance(policy, type) and issubclass(policy, Module):
        return ModuleWrapPolicy([policy])
    if callable(policy):
        return _TorchPolicy(policy, root) if root is not None and _is_torch_style(policy) else policy
    try:
        classes = list(policy)
    except TypeError:
        raise TypeError(f"auto_wrap_policy={policy!r}: expected a callable(module) -> bool, a set of "
                        "module classes or a minimum parameter count") from None
    return ModuleWrapPolicy(classes)


def is_fsdp(module: Any) -> bool:
    """True for a :class:`FullyShardedDataParallel` instance (without importing the runtime)."""
    return bool(getattr(type(module), "_is_fsdp", False))


def plan_units(root: Module, policy: Policy = None) -> List[Tuple[str, Module, bool]]:
    """``(qualified name, module, nested)`` of every unit below ``root`` and every FSDP instance in it.

    The walk is pre-order in registration order. A nested FSDP instance (``nested=True``) is
    kept as given: it is not looked into (its units are its own) and the policy is not asked
    about it; one may lie inside a policy unit (the unit then holds it). Otherwise ``policy``
    picks units as :func:`find_units` describes. Names are the unwrapped module's (a nested
    FSDP adds no ``module.`` component), so ``FSDP(Sequential(FSDP(a), b))`` names its inner
    instance ``"0"``.
    """
    pred = _as_policy(policy, root)
    out: List[Tuple[str, Module, bool]] = []

    def walk(mod: Module, prefix: str, in_unit: bool) -> None:
        for name, child in mod.named_children():
            if child is None:
                continue
            q = f"{prefix}.{name}" if prefix else name
            if is_fsdp(child):
                out.append((q, child, True))
            elif not in_unit and not isinstance(child, _CONTAINERS) and pred(child):
                out.append((q, child, False))
                walk(child, q, True)          # only nested FSDP instances below a unit
            else:
                walk(child, q, in_unit)

    walk(root, "", False)
    return out


def find_units(root: Module, policy: Policy = None) -> List[Tuple[str, Module]]:
    """The ``(qualified name, module)`` of every unit below ``root``, in registration order.

    Default (``policy=None``): each child holding parameters is a unit, looking through
    containers (so each block of a ``ModuleList`` of transformer blocks is one). With a policy,
    the first module on each path from the root for which ``policy(module)`` is true. The
    parameters not inside any unit belong to the root unit. Nested FSDP instances are not
    looked into (see :func:`plan_units`).

    Example:
        >>> [n for n, _ in find_units(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)))]
        ['0', '2']
    """
    return [(q, m) for q, m, nested in plan_units(root, policy) if not nested]


def unwrapped_named_modules(root: Module, prefix: str = "") -> Iterator[Tuple[str, Module]]:
    """``named_modules()`` as if every nested FSDP wrapper were replaced by the module it wraps.

    Each module once, ``root`` first; an FSDP instance is not yielded, its wrapped module is,
    under the FSDP instance's name (PyTorch's names without ``_fsdp_wrapped_module``).
    """
    memo = set()

    def walk(mod: Module, pre: str) -> Iterator[Tuple[str, Module]]:
        while is_fsdp(mod):
            mod = mod.module
        if id(mod) in memo:
            return
        memo.add(id(mod))
        yield pre, mod
        for name, child in mod.named_children():
            if child is not None:
                yield from walk(child, f"{pre}.{name}" if pre else name)

    yield from walk(root, prefix)


def unwrapped_state_items(root: Module, kind: str = "state") -> Iterator[Tuple[str, Any]]:
    """``(unwrapped name, tensor)``: ``kind="state"`` parameters then persistent buffers per module
    (the state-dict order: a tensor shared by two modules appears under both names), ``"params"`` /
    ``"buffers"`` only those, each tensor once (``named_parameters()`` order)."""
    seen = set()
    for pre, m in unwrapped_named_modules(root):
        for name, t in list(m.own_state_items(kind)):
            if kind != "state" and id(t) in seen:
                continue
            seen.add(id(t))
            yield (f"{pre}.{name}" if pre else name), t
