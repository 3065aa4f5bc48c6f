"""The bottom layers import only downward (DESIGN.md's layer diagram), so no import circle can form there.

Every ``import`` / ``from ... import`` statement of the package is read with ``ast`` (those inside
functions too: a deferred import is still a dependency), resolved to a module of the package, and
checked against the layer each room may import. The circle this replaced: ``distributed/world.py``
imported ``checkpoint.preemption`` while ``log.py`` and ``trace.py`` imported ``distributed`` (an
18-file circle through ``checkpoint``).
"""
import ast
import functools
import os

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "axonmpi")

# room -> the rooms it may import (besides itself), bottom up
ALLOWED = {
    "env": set(),
    "enums": set(),
    "backend": {"env"},
    "log": {"env"},
    "trace": {"env", "log"},
    "distributed": {"env", "enums", "backend", "log", "trace"},
}


def _modules():
    mods = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = "axonmpi." + os.path.relpath(path, PKG)[:-3].replace(os.sep, ".")
                mods[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def _targets(mod, path, node, mods):
    """The package modules an import statement names (submodules where they exist)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            b = ".".join(base + ([node.module] if node.module else []))
        else:
            b = node.module or ""
        names = [f"{b}.{a.name}" if f"{b}.{a.name}" in mods else b for a in node.names]
    out = []
    for n in names:
        if n != "axonmpi" and not n.startswith("axonmpi."):
            continue
        while n not in mods and "." in n:
            n = n.rsplit(".", 1)[0]
        out.append(n)
    return out


def _graph():
    """module -> {imported module: line}; parsed once per test run (every test reads the same tree), a fresh copy
    each call so a test may change its own."""
    return {mod: dict(deps) for mod, deps in _parsed().items()}


@functools.lru_cache(maxsize=1)
def _parsed():
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        deps = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(mod, path, node, mods):
                    if t != mod:
                        deps.setdefault(t, node.lineno)
        graph[mod] = deps
    return graph


# torch's import paths under the import rule of docs/porting.md (torch.distributed.fsdp, torch.distributed.tensor,
# torch.distributed.device_mesh): aliases of the parallel layer's classes that sit under distributed/ only because
# torch's paths do; nothing in the library imports them, and axonmpi/__init__.py loads them last
TORCH_PATHS = ("axonmpi.distributed.fsdp", "axonmpi.distributed.tensor", "axonmpi.distributed._tensor",
               "axonmpi.distributed.device_mesh")


def _room(mod):
    if mod.startswith(TORCH_PATHS):
        return "torch paths (above parallel)"
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "axonmpi (the package root, which imports every room)"


def test_nothing_in_the_library_imports_the_torch_paths():
    bad = [f"{mod} (line {line}) imports {dep}" for mod, deps in sorted(_graph().items())
           if not mod.startswith(TORCH_PATHS) and mod != "axonmpi"
           for dep, line in sorted(deps.items()) if dep.startswith(TORCH_PATHS)]
    assert not bad, "the library imports torch's alias paths:\n" + "\n".join(bad)


def test_the_bottom_layers_import_only_downward():
    graph = _graph()
    bad = []
    for mod, deps in sorted(graph.items()):
        room = _room(mod)
        if room not in ALLOWED:
            continue
        for dep, line in sorted(deps.items()):
            other = _room(dep)
            if other != room and other not in ALLOWED[room]:
                bad.append(f"{mod} (line {line}) imports {dep}: {room} may import only {sorted(ALLOWED[room])}")
    assert not bad, "imports against the layers (DESIGN.md):\n" + "\n".join(bad)


def _cycle_through(graph, start):
    """A shortest import path from ``start`` back to itself, or None."""
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for u in frontier:
            for v in graph.get(u, ()):
                if v == start:
                    path = [u]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, u, start]
                if v not in prev:
                    prev[v] = u
                    nxt.append(v)
        frontier = nxt
    return None


def _node(mod):
    """``distributed`` is one node (its modules import each other, deferred, inside the room); others are modules."""
    if mod.startswith(TORCH_PATHS):
        return mod
    return "axonmpi.distributed" if mod.startswith("axonmpi.distributed.") else mod


@pytest.mark.parametrize("mod", ["axonmpi.distributed", "axonmpi.log", "axonmpi.trace", "axonmpi.checkpoint.preemption",
                                 "axonmpi.checkpoint.write", "axonmpi.backend"])
def test_no_import_circle_through_distributed_log_trace_and_preemption(mod):
    graph = {}
    for m, deps in _graph().items():
        graph.setdefault(_node(m), set()).update(_node(d) for d in deps if d != "axonmpi")   # the root imports all
    graph = {m: sorted(d - {m}) for m, d in graph.items()}
    cycle = _cycle_through(graph, mod)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_checker_sees_a_circle_when_there_is_one():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert _cycle_through(graph, "a") == ["a", "b", "c", "a"]
    assert _cycle_through(graph, "d") is None
    mods = {"axonmpi.distributed.world": "x/world.py", "axonmpi.checkpoint.preemption": "p.py", "axonmpi.checkpoint": "c/__init__.py"}
    node = ast.parse("from ..checkpoint.preemption import record_early_signals").body[0]
    assert _targets("axonmpi.distributed.world", "x/world.py", node, mods) == ["axonmpi.checkpoint.preemption"]


@pytest.mark.parametrize("room,forbidden", [("parallel", "models"), ("checkpoint", "models"), ("checkpoint", "parallel")])
def test_rooms_that_know_no_model(room, forbidden):
    """``parallel/`` (the composer and its axes) imports nothing from ``models/``: what a model needs it declares in
    its plan (issue 38); ``checkpoint/`` (generic sharded storage) imports neither models nor strategies (the
    export formats of models are passed in by ``axonmpi/interop.py``)."""
    bad = [f"{mod} (line {line}) imports {dep}" for mod, deps in sorted(_graph().items()) if _room(mod) == room
           for dep, line in sorted(deps.items()) if _room(dep) == forbidden]
    assert not bad, f"{room}/ imports {forbidden}/:\n" + "\n".join(bad)


def test_no_import_circle_through_the_checkpoint_cli_and_the_models():
    """Room by room (the checkpoint CLI once reached models/hf_gpt2, which reached checkpoint/safetensors_io):
    no circle passes through ``checkpoint``."""
    graph = {}
    for m, deps in _graph().items():
        if m.endswith(".__main__"):          # an entry point (python -m axonmpi.checkpoint): nothing imports it
            continue
        graph.setdefault(_room(m), set()).update(_room(d) for d in deps if d != "axonmpi")
    graph = {m: sorted(d - {m}) for m, d in graph.items()}
    cycle = _cycle_through(graph, "checkpoint")
    assert cycle is None, "import circle: " + " -> ".join(cycle)
