"""``Module`` (parameters, buffers, submodules, state dicts, modes, hooks) and the containers."""
from __future__ import annotations

import itertools
from collections import OrderedDict, namedtuple
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Tuple

import numpy as np

from .. import trace as _trace

from ..autograd.function import RemovableHandle
from ..autograd.tensor import Tensor
from ..backend import Device, as_device, get_array_module, is_floating, to_device, to_host, to_target
from .parameter import Parameter

__all__ = ["IncompatibleKeys", "Module", "ModuleDict", "ModuleList", "Sequential"]

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class Module:
    """Base class of layers and models (PyTorch's ``nn.Module`` semantics).

    Assigning a :class:`Parameter` or a ``Module`` to an attribute registers it; buffers are
    registered with :meth:`register_buffer`.  ``state_dict()`` keys are dotted paths
    (``"blocks.3.attn.qkv.bias"``) with host NumPy copies as values.

    Example:
        >>> class Net(Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = Linear(3, 2)
        ...     def forward(self, x):
        ...         return self.fc(x)
    """

    def __init__(self) -> None:
        d = self.__dict__
        d["_parameters"] = OrderedDict()
        d["_buffers"] = OrderedDict()
        d["_non_persistent"] = set()
        d["_modules"] = OrderedDict()
        d["_forward_pre_hooks"] = {}
        d["_forward_hooks"] = {}
        d["training"] = True

    # -- registration ----------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        d = self.__dict__
        if "_parameters" not in d:
            if isinstance(value, (Parameter, Module)):
                raise AttributeError(f"call Module.__init__() before assigning {name!r}")
            object.__setattr__(self, name, value)
            return
        if isinstance(value, Parameter):       # replacing one keeps its place (state-dict order), as PyTorch
            if name not in d["_parameters"]:
                self._drop(name)
            d["_parameters"][name] = value
        elif isinstance(value, Module):
            if name not in d["_modules"]:
                self._drop(name)
            d["_modules"][name] = value
        elif name in d["_parameters"]:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to parameter {name!r} "
                                "(expected Parameter or None)")
            d["_parameters"][name] = None
        elif name in d["_buffers"]:
            if value is not None and not isinstance(value, Tensor):
                value = Tensor(value)
            d["_buffers"][name] = value
        elif name in d["_modules"]:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} to submodule {name!r}")
            d["_modules"][name] = None
        object.__setattr__(self, name, value)

    def _drop(self, name: str) -> None:
        d = self.__dict__
        for key in ("_parameters", "_buffers", "_modules"):
            d[key].pop(name, None)
        d["_non_persistent"].discard(name)

    def __delattr__(self, name: str) -> None:
        self._drop(name)
        object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Optional[Parameter]) -> None:
        """Register ``param`` (or a ``None`` placeholder) under ``name``."""
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(
                f"register_parameter({name!r}): expected Parameter or None, got {type(param).__name__}")
        self._drop(name)
        self.__dict__["_parameters"][name] = param
        object.__setattr__(self, name, param)

    def register_buffer(self, name: str, tensor: Optional[Any], persistent: bool = True) -> None:
        """Register a non-trainable Tensor (saved in ``state_dict`` when ``persistent``)."""
        if tensor is not None and not isinstance(tensor, Tensor):
            tensor = Tensor(tensor)
        self._drop(name)
        self.__dict__["_buffers"][name] = tensor
        if not persistent:
            self.__dict__["_non_persistent"].add(name)
        object.__setattr__(self, name, tensor)

    def add_module(self, name: str, module: Optional["Module"]) -> None:
        """Register ``module`` as a child named ``name``."""
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"add_module({name!r}): expected Module, got {type(module).__name__}")
        self._drop(name)
        self.__dict__["_modules"][name] = module
        object.__setattr__(self, name, module)

    register_module = add_module

    # -- forward ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Compute the output; subclasses override it (call the module, not ``forward``, so hooks run)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward()")

    def __call__(self, *args, **kwargs):
        if self._forward_pre_hooks:
            for hook in list(self._forward_pre_hooks.values()):
                r = hook(self, args)
                if r is not None:
                    args = r if isinstance(r, tuple) else (r,)
        tr = _trace._ACTIVE
        if tr is None:
            out = self.forward(*args, **kwargs)
        else:                                   # a timeline runs (axonmpi.profile / AXONMPI_TRACE)
            t0 = _trace._clock()
            out = self.forward(*args, **kwargs)
            tr.events.append((type(self).__name__ + ".forward", "forward", t0, _trace._clock(), {}))
        if self._forward_hooks:
            for hook in list(self._forward_hooks.values()):
                r = hook(self, args, out)
                if r is not None:
                    out = r
        return out

    def register_forward_pre_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(module, args) -> None | new args`` runs before ``forward``."""
        handle = RemovableHandle(self._forward_pre_hooks)
        self._forward_pre_hooks[handle._key] = hook
        return handle

    def register_forward_hook(self, hook: Callable) -> RemovableHandle:
        """``hook(module, args, output) -> None | new output`` runs after ``forward``."""
        handle = RemovableHandle(self._forward_hooks)
        self._forward_hooks[handle._key] = hook
        return handle

    # -- traversal -------------------------------------------------------------------------
    def named_modules(self, memo=None, prefix: str = "") -> Iterator[Tuple[str, "Module"]]:
        """All modules (self first) with dotted names, each once."""
        if memo is None:
            memo = set()
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is not None:
                yield from m.named_modules(memo, f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator["Module"]:
        """All modules of the tree, ``self`` first, each once."""
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator[Tuple[str, "Module"]]:
        """Direct submodules with their attribute names."""
        seen = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self) -> Iterator["Module"]:
        """Direct submodules."""
        for _, m in self.named_children():
            yield m

    def _named_members(self, attr: str, prefix: str, recurse: bool, skip=None):
        seen = set()
        mods = self.named_modules(prefix=prefix) if recurse else [(prefix, self)]
        for mod_prefix, m in mods:
            for name, v in getattr(m, attr).items():
                if v is None or id(v) in seen or (skip is not None and skip(m, name)):
                    continue
                seen.add(id(v))
                yield (f"{mod_prefix}.{name}" if mod_prefix else name), v

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[Tuple[str, Parameter]]:
        """(dotted name, Parameter) pairs; shared parameters appear once."""
        return self._named_members("_parameters", prefix, recurse)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """All parameters (of submodules too when ``recurse``), each once."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator[Tuple[str, Tensor]]:
        """Buffers with dotted names (``"bn.running_mean"``)."""
        return self._named_members("_buffers", prefix, recurse)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        """All buffers, each once."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def get_submodule(self, target: str) -> "Module":
        """The submodule at dotted path ``target`` (``""`` is self)."""
        m = self
        for part in filter(None, target.split(".")):
            if part not in m._modules:
                raise AttributeError(f"{type(m).__name__} has no submodule {part!r} (path {target!r})")
            m = m._modules[part]
        return m

    def get_parameter(self, target: str) -> Parameter:
        """The parameter at dotted path ``target`` (``"0.weight"``); AttributeError naming the path if absent."""
        mod, _, name = target.rpartition(".")
        m = self.get_submodule(mod)
        if name not in m._parameters:
            raise AttributeError(f"no parameter {target!r}")
        return m._parameters[name]

    # -- state -----------------------------------------------------------------------------
    def _state_items(self) -> Iterator[Tuple[str, Tensor]]:
        """(key, tensor) for every entry of the state dict (parameters then buffers per module)."""
        for mod_prefix, m in self.named_modules(memo=None):
            for name, t in m.own_state_items():
                yield (f"{mod_prefix}.{name}" if mod_prefix else name), t

    def own_state_items(self, kind: str = "state") -> Iterator[Tuple[str, Tensor]]:
        """This module's own entries (not its submodules'), in state-dict order, ``None`` ones left out:
        ``kind="state"`` its parameters then its persistent buffers; ``"params"`` its parameters;
        ``"buffers"`` all its buffers (persistent or not).

        Example:
            >>> [n for n, _ in nn.Linear(2, 3).own_state_items()]
            ['weight', 'bias']
        """
        if kind not in ("state", "params", "buffers"):
            raise ValueError(f"own_state_items: kind={kind!r}; expected 'state', 'params' or 'buffers'")
        if kind in ("state", "params"):
            for name, p in self._parameters.items():
                if p is not None:
                    yield name, p
        if kind in ("state", "buffers"):
            for name, b in self._buffers.items():
                if b is not None and (kind == "buffers" or name not in self._non_persistent):
                    yield name, b

    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """OrderedDict of host NumPy copies of parameters and persistent buffers (PyTorch key names)."""
        return OrderedDict((k, np.array(to_host(t.data), copy=True)) for k, t in self._state_items())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy values into the existing arrays in place (keeping their dtype and device).

        Raises ``RuntimeError`` listing every missing key, unexpected key (when ``strict``) and
        shape mismatch at once.  Returns ``IncompatibleKeys(missing_keys, unexpected_keys)``.
        """
        own = OrderedDict(self._state_items())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        mismatched = []
        for k, t in own.items():
            if k in state_dict:
                v = state_dict[k]
                shape = tuple(v.shape) if hasattr(v, "shape") else np.shape(v)
                if tuple(shape) != tuple(t.data.shape):
                    mismatched.append(f"{k}: checkpoint shape {tuple(shape)}, model shape {tuple(t.data.shape)}")
        errors = []
        if strict and missing:
            errors.append("missing keys: " + ", ".join(repr(k) for k in missing))
        if strict and unexpected:
            errors.append("unexpected keys: " + ", ".join(repr(k) for k in unexpected))
        if mismatched:
            errors.append("shape mismatches: " + "; ".join(mismatched))
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n  "
                               + "\n  ".join(errors))
        for k, t in own.items():
            if k in state_dict:
                v = state_dict[k]
                v = v.data if isinstance(v, Tensor) else v
                xp = get_array_module(t.data)
                src = to_device(v, t.device) if xp is not np else to_host(v)
                t.data[...] = src.astype(t.data.dtype, copy=False) if hasattr(src, "astype") else src
        return IncompatibleKeys(missing, unexpected)

    # -- modes / grads / devices -----------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """Set training mode (affects dropout) on this module and all submodules."""
        for m in self.modules():
            m.__dict__["training"] = bool(mode)
        return self

    def eval(self) -> "Module":
        """Set evaluation mode."""
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        """Set ``requires_grad`` of every parameter; returns ``self``."""
        for p in self.parameters():
            p.requires_grad = requires_grad
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients: to ``None`` (default) or zero them in place."""
        for p in self.parameters():
            owner = getattr(p, "__dict__", {}).get("_local_owner")
            if owner is not None:        # its gradient is a piece of an FSDP flat chunk's (nn/parameter.py)
                owner[0].zero_piece_grad(owner[1])
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.data[...] = 0

    def _apply_arrays(self, fn: Callable[[Any], Any]) -> "Module":
        for t in itertools.chain(self.parameters(), self.buffers()):
            t.data = fn(t.data)
            if t.grad is not None:
                t.grad.data = fn(t.grad.data)
        return self

    def to(self, device=None, dtype=None) -> "Module":
        """Move parameters and buffers to ``device`` and/or cast floating ones to ``dtype`` (in place).

        An int device is PyTorch's ``module.to(rank)``: GPU ``rank`` where there are GPUs, else the
        CPU (:func:`axonmpi.backend.index_device`)."""
        if device is not None and not isinstance(device, (str, Device, int, np.integer)):
            device, dtype = None, device                      # module.to(np.float64)
        if device is not None:
            dev = to_target(device)             # "cuda:{LOCAL_RANK}" on a host without a GPU: the CPU
            self._apply_arrays(lambda a: to_device(a, dev))
        if dtype is not None:
            dt = np.dtype(dtype)
            self._apply_arrays(lambda a: a.astype(dt) if is_floating(a.dtype) and a.dtype.kind != "c" else a)
        return self

    def cpu(self) -> "Module":
        """Move parameters and buffers to the host; returns ``self``."""
        return self.to("cpu")

    def float(self) -> "Module":
        """Cast floating parameters and buffers to float32; returns ``self``."""
        return self.to(dtype=np.float32)

    def double(self) -> "Module":
        """Cast floating parameters and buffers to float64; returns ``self``."""
        return self.to(dtype=np.float64)

    def apply(self, fn: Callable[["Module"], None]) -> "Module":
        """Call ``fn`` on every submodule (children first) and then on self."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Total number of parameter elements."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    # -- repr ------------------------------------------------------------------------------
    def extra_repr(self) -> str:
        """Extra text shown inside this module's ``repr`` (its hyper-parameters)."""
        return ""

    def __repr__(self) -> str:
        lines = []
        for name, m in self._modules.items():
            body = repr(m).replace("\n", "\n  ")
            lines.append(f"({name}): {body}")
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        head = f"{type(self).__name__}(" + (f"{extra}" if extra else "")
        return head + "\n  " + "\n  ".join(lines) + "\n)"


class Sequential(Module):
    """Modules applied in order; children are named ``"0"``, ``"1"``, ... (or by an OrderedDict)."""

    def __init__(self, *modules: Any):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], (OrderedDict, dict)):
            for name, m in modules[0].items():
                self.add_module(name, m)
        else:
            for i, m in enumerate(modules):
                self.add_module(str(i), m)

    def forward(self, x):
        """Apply the modules in order."""
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, idx):
        mods = list(self._modules.values())
        if isinstance(idx, slice):
            return Sequential(*mods[idx])
        return mods[idx]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module: Module) -> "Sequential":
        """Add ``module`` at the end; returns ``self``."""
        self.add_module(str(len(self._modules)), module)
        return self


class ModuleList(Module):
    """A list of submodules, named ``"0"``, ``"1"``, ... (no forward)."""

    def __init__(self, modules: Optional[Iterable[Module]] = None):
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __getitem__(self, idx):
        mods = list(self._modules.values())
        if isinstance(idx, slice):
            return ModuleList(mods[idx])
        return mods[idx]

    def __setitem__(self, idx: int, module: Module) -> None:
        key = list(self._modules.keys())[idx]
        self.add_module(key, module)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, module: Module) -> "ModuleList":
        """Add ``module`` at the end; returns ``self``."""
        self.add_module(str(len(self._modules)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> "ModuleList":
        """Add ``modules`` at the end; returns ``self``."""
        for m in modules:
            self.append(m)
        return self

    def insert(self, index: int, module: Module) -> None:
        """Insert ``module`` before position ``index``."""
        mods = list(self._modules.values())
        mods.insert(index, module)
        for k in list(self._modules):
            self._drop(k)
            object.__delattr__(self, k)
        for m in mods:
            self.append(m)


class ModuleDict(Module):
    """An ordered mapping of names to submodules (no forward)."""

    def __init__(self, modules: Optional[Mapping[str, Module]] = None):
        super().__init__()
        if modules is not None:
            for k, m in modules.items():
                self.add_module(k, m)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        delattr(self, key)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def keys(self):
        """The names, in insertion order."""
        return self._modules.keys()

    def values(self):
        """The modules, in insertion order."""
        return self._modules.values()

    def items(self):
        """``(name, module)`` pairs, in insertion order."""
        return self._modules.items()
