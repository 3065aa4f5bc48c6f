"""Parameters used outside the module that owns them (a tied head written ``F.linear(h, self.emb.weight)``).

FSDP gathers a unit's parameters only around that unit's forward and backward; a parameter of
unit ``emb`` read by the root's ``forward`` after ``emb`` has resharded is an empty array (NumPy:
``matmul ... size 0 is different from 8``).  At wrap time :func:`find_outside_uses` reads the
source of every module class in the tree (``ast``: the ``self.a.b...`` attribute chains of its
``forward`` and of the methods ``forward`` calls; metadata reads such as ``.dtype`` or
``get_array_module(self.emb.weight.data)`` excepted) and resolves each chain on the live modules; a chain that reaches a
parameter of another unit is an outside use.  FSDP then keeps that parameter in the root unit
(gathered from forward to the end of backward, as torch's FSDP advice: put the modules sharing a
weight in one unit or the root), so the model trains exactly as the serial one; a parameter that
cannot move (it belongs to a nested FSDP instance) is refused, naming it and both users.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types
import weakref
from typing import Dict, List, NamedTuple, Tuple

from ...nn import Module
from ...nn.parameter import Parameter

__all__ = ["OutsideUse", "find_outside_uses"]

_META_CALLS = {"get_array_module", "device_of", "isinstance", "type", "id"}
_META_ATTRS = {"dtype", "device", "ndim", "requires_grad"}
_SOURCE_CHAINS: "weakref.WeakKeyDictionary[type, List[Tuple[Tuple[str, ...], str]]]" = weakref.WeakKeyDictionary()
_CLASS_METHODS: "weakref.WeakKeyDictionary[type, Dict[str, Tuple[ast.AST, str, str, int]]]" = weakref.WeakKeyDictionary()


class OutsideUse(NamedTuple):
    param: str          # the parameter's qualified (unwrapped) name
    user: str           # the module whose code reads it ("" the root), qualified name
    where: str          # "Class.method (file:line)"
    pid: int            # id() of the parameter


def _own_methods(klass: type) -> Dict[str, Tuple[ast.AST, str, str, int]]:
    """The methods ``klass`` defines (its ``__dict__``), each parsed from its own source lines, once per class.
    (``inspect.getsource`` of a class parses its whole file, and the classes the tensor-parallel swaps make --
    subclasses of the user's, with no source of their own -- cost a whole-file parse each: about a second a
    wrap at 8 ranks.)"""
    got = _CLASS_METHODS.get(klass)
    if got is not None:
        return got
    got = {}
    for name, fn in vars(klass).items():
        if not isinstance(fn, types.FunctionType):
            continue
        try:
            lines, first = inspect.getsourcelines(fn)
            fname = (inspect.getsourcefile(fn) or "?").rsplit("/", 1)[-1]
            # a class around the dedented lines: a body indented less than its ``def`` (a multi-line string)
            # still parses
            tree = ast.parse("class _:\n" + textwrap.indent(textwrap.dedent("".join(lines)), "    "))
        except (OSError, TypeError, SyntaxError):
            continue
        node = tree.body[0].body[0]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            got[name] = (node, klass.__name__, fname, first - 1)     # line numbers count the class line
    _CLASS_METHODS[klass] = got
    return got


def _chains(cls: type) -> List[Tuple[Tuple[str, ...], str]]:
    """``(("emb", "weight"), "Net.forward (net.py:12)")`` for every ``self.x.y...`` read in ``cls.forward``
    and the methods it calls as ``self.method(...)`` (transitively), in the classes' own source."""
    if cls in _SOURCE_CHAINS:
        return _SOURCE_CHAINS[cls]
    methods: Dict[str, Tuple[ast.AST, str, str, int]] = {}     # name -> (node, class, file, first line)
    for klass in cls.__mro__:
        if klass is Module or klass is object or not issubclass(klass, Module):
            continue
        for name, entry in _own_methods(klass).items():
            methods.setdefault(name, entry)
    out: List[Tuple[Tuple[str, ...], str]] = []
    pending, done = ["forward"], set()
    while pending:
        name = pending.pop()
        if name in done or name not in methods:
            continue
        done.add(name)
        node, kname, fname, first = methods[name]
        meta = set()     # reads of metadata only (dtype, device, array module): an empty shard answers them
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                fn = sub.func.attr if isinstance(sub.func, ast.Attribute) else getattr(sub.func, "id", "")
                if fn in _META_CALLS:
                    meta.update(id(x) for a in sub.args for x in ast.walk(a))
            elif isinstance(sub, ast.Attribute) and sub.attr in _META_ATTRS:
                meta.update(id(x) for x in ast.walk(sub.value))
        for sub in ast.walk(node):
            if id(sub) in meta:
                continue
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) \
                    and isinstance(sub.func.value, ast.Name) and sub.func.value.id == "self":
                pending.append(sub.func.attr)
            if not isinstance(sub, ast.Attribute):
                continue
            names, cur = [], sub
            while isinstance(cur, ast.Attribute):
                names.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "self" and len(names) >= 2:
                out.append((tuple(reversed(names)), f"{kname}.{name} ({fname}:{first + sub.lineno - 1})"))
    _SOURCE_CHAINS[cls] = out
    return out


def _resolve(mod: Module, chain: Tuple[str, ...]):
    """Follow ``chain`` through registered submodules; the Parameter it ends at (owner path) or None."""
    path: List[str] = []
    cur = mod
    for i, name in enumerate(chain):
        subs = getattr(cur, "_modules", None)
        params = getattr(cur, "_parameters", None)
        if params is not None and name in params and isinstance(params[name], Parameter):
            return (path, name, params[name]) if i >= 1 else None   # own parameter: not an outside use
        if subs is not None and name in subs and subs[name] is not None:
            cur = subs[name]
            while hasattr(cur, "module") and type(cur).__name__ == "FullyShardedDataParallel":
                cur = cur.module
            path.append(name)
            continue
        return None
    return None


def find_outside_uses(named_modules, owner_of) -> List[OutsideUse]:
    """Every read of a parameter through a submodule chain whose owning unit (``owner_of(id(p))``:
    the unit's name, or None when the parameter is not this FSDP's) does not enclose the reader.

    ``named_modules``: ``(qualified name, module)`` of the unwrapped tree, root ``""`` first.
    ``owner_of``: id(parameter) -> unit name, ``""`` for the root unit.
    """
    uses: List[OutsideUse] = []
    seen = set()
    for qname, mod in named_modules:
        for chain, where in _chains(type(mod)):
            got = _resolve(mod, chain)
            if got is None:
                continue
            path, leaf, p = got
            pname = ".".join(([qname] if qname else []) + path + [leaf])
            key = (id(p), qname)
            if key in seen:
                continue
            seen.add(key)
            unit = owner_of(id(p))
            if unit == "":
                continue                         # the root unit is gathered for the whole step
            if unit is not None and (qname == unit or qname.startswith(unit + ".")):
                continue                         # read inside its own unit's forward
            uses.append(OutsideUse(pname, qname, where, id(p)))
    return uses
