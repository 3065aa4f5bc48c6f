"""The CuPy / NCCL API our never-run-on-CI GPU code calls exists in the installed CuPy (CPU; no GPU needed).

``import cupy`` and ``cupy.cuda.nccl`` load without a device, so every attribute the device code
references (array functions reached as ``xp.NAME``, ``cupy.cuda`` streams and events, the NCCL
module functions, constants and ``NcclCommunicator`` methods) is looked up here, and the CPU
stand-in :mod:`axonmpi.testing.fake_nccl` is checked to take the same arguments as the real
methods (their Cython docstrings carry the signatures). Skipped when CuPy is not installed.
"""
import importlib.metadata
import inspect
import pathlib
import re

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install 'axonmpi[cuda12]')")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NCCL_SRC = ROOT / "axonmpi" / "distributed" / "backends" / "nccl.py"


def _nccl_module():
    from cupy.cuda import nccl
    if not getattr(nccl, "available", False):
        pytest.skip("CuPy is installed without NCCL (pip install nvidia-nccl-cu12)")
    return nccl


def _sources():
    for sub in ("axonmpi", "bench", "examples"):
        for p in sorted((ROOT / sub).rglob("*.py")):
            yield p, p.read_text(encoding="utf-8")


def _resolve(mod, dotted):
    obj = mod
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.serial
def test_every_array_function_the_code_calls_exists_in_numpy_and_cupy():
    """``xp.NAME`` (the array module of the arguments) must exist in both NumPy and CuPy."""
    missing = []
    for p, text in _sources():
        for name in sorted(set(re.findall(r"\bxp\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)", text))):
            for mod in (np, cupy):
                try:
                    _resolve(mod, name)
                except AttributeError:
                    missing.append(f"{p.relative_to(ROOT)}: {mod.__name__}.{name}")
    assert not missing, missing


@pytest.mark.serial
def test_every_cupy_attribute_the_code_names_exists():
    """``cupy.X`` / ``cp.X`` / ``get_cupy().X`` chains (``cp`` being the cupy module) resolve."""
    import cupy.cuda.nccl  # noqa: F401 - a submodule that ``cupy.cuda`` loads only on import
    pat = re.compile(r"(?:\bcupy|\bcp|get_cupy\(\))\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
    missing, seen = [], 0
    for p, text in _sources():
        for chain in sorted(set(pat.findall(text))):
            parts = chain.split(".")
            obj, ok = cupy, True
            for i, part in enumerate(parts):   # stop at a call/attribute of an instance (e.g. .get)
                try:
                    obj = getattr(obj, part)
                except AttributeError:
                    if i == 0 or inspect.ismodule(obj):
                        ok = False
                    break
                if not (inspect.ismodule(obj) or inspect.isclass(obj)):
                    break
            seen += 1
            if not ok:
                missing.append(f"{p.relative_to(ROOT)}: cupy.{chain}")
    assert seen > 5
    assert not missing, missing
    import cupyx
    assert callable(cupyx.empty_pinned)            # axonmpi.backend.empty_pinned
    assert callable(cupy.cuda.runtime.getDeviceCount) and callable(cupy.cuda.runtime.runtimeGetVersion)
    assert callable(cupy.cuda.runtime.driverGetVersion) and callable(cupy.get_default_memory_pool)


@pytest.mark.serial
def test_nccl_module_has_every_name_the_backend_uses():
    nccl = _nccl_module()
    from axonmpi.distributed.backends import nccl as ours
    for name in [*ours._INT_KINDS.values(), *ours._OPS.values(), "NCCL_AVG", "get_unique_id", "get_version",
                 "groupStart", "groupEnd", "NcclCommunicator", "NcclError"]:
        assert hasattr(nccl, name), f"cupy.cuda.nccl has no {name}"
    text = NCCL_SRC.read_text(encoding="utf-8")
    used = set(re.findall(r"\bcomm\.([A-Za-z_]+)\b", text)) | set(re.findall(r"self\._comm\.([A-Za-z_]+)\b", text))
    used |= {m for m in re.findall(r"comm\.(\w+), _ptr", text)}
    assert {"allReduce", "reduce", "reduceScatter", "broadcast", "allGather", "send", "recv"} <= used, used
    for m in used:
        assert hasattr(nccl.NcclCommunicator, m), f"NcclCommunicator has no {m}"
    for m in ("destroy", "rank_id", "size"):
        assert hasattr(nccl.NcclCommunicator, m)
    assert len(nccl.get_unique_id()) == 128          # works without a GPU; bytes on CuPy >= 14


def _doc_params(obj):
    """Parameter names from a Cython docstring's first line ``name(self, intptr_t a, size_t b, ...)``."""
    first = (obj.__doc__ or "").strip().splitlines()[0]
    inside = first[first.index("(") + 1:first.rindex(")")]
    names = [p.strip().split()[-1].split("=")[0] for p in inside.split(",") if p.strip()]
    return [n for n in names if n != "self"]


@pytest.mark.serial
def test_stand_in_takes_the_real_arguments():
    """fake_nccl's NcclCommunicator methods have the real methods' parameters, in order."""
    nccl = _nccl_module()
    from axonmpi.testing import fake_nccl
    for m in ("allReduce", "reduce", "reduceScatter", "broadcast", "bcast", "allGather", "send", "recv",
              "destroy", "rank_id", "size"):
        real = _doc_params(getattr(nccl.NcclCommunicator, m))
        fake = [p for p in inspect.signature(getattr(fake_nccl.NcclCommunicator, m)).parameters if p != "self"]
        assert len(real) == len(fake), f"{m}: real {real} vs stand-in {fake}"
    real_init = _doc_params(nccl.NcclCommunicator)
    fake_init = list(inspect.signature(fake_nccl.NcclCommunicator.__init__).parameters)[1:]
    assert real_init[:3] == fake_init == ["ndev", "commId", "rank"], (real_init, fake_init)


@pytest.mark.serial
def test_cuda_streams_and_events_have_what_the_backend_calls():
    cuda = cupy.cuda
    assert "non_blocking" in _doc_params(cuda.Stream.__init__)
    assert "disable_timing" in _doc_params(cuda.Event.__init__)
    assert "~Stream.ptr" in cuda.Stream.__doc__        # an instance attribute: documented, not on the class
    for cls, m in ((cuda.Stream, "wait_event"), (cuda.Stream, "synchronize"), (cuda.Event, "record"),
                   (cuda.Event, "synchronize"), (cuda.Event, "done")):
        assert hasattr(cls, m), f"{cls.__name__}.{m}"
    assert callable(cuda.get_current_stream) and hasattr(cuda, "Device")
    from axonmpi.testing import fake_nccl
    for m in ("wait_event", "synchronize"):
        assert hasattr(fake_nccl.cuda.Stream, m)
    for m in ("record", "synchronize", "done"):
        assert hasattr(fake_nccl.cuda.Event, m)


@pytest.mark.serial
def test_nccl_version_decodes_the_installed_library(monkeypatch):
    nccl = _nccl_module()
    from axonmpi.distributed.backends import nccl as ours
    monkeypatch.setattr(ours, "nccl_library", lambda: nccl)
    got = ours.nccl_version()
    assert re.fullmatch(r"2\.\d+\.\d+", got), got
    try:
        pkg = importlib.metadata.version("nvidia-nccl-cu12")
    except importlib.metadata.PackageNotFoundError:
        return
    assert got == ".".join(pkg.split(".")[:3]), (got, pkg)


@pytest.mark.serial
def test_without_a_gpu_axonmpi_stays_on_the_cpu():
    """CuPy importable but no device: get_cupy() is None, so the GPU tests skip instead of failing."""
    from axonmpi import backend
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        n = 0
    if n:
        pytest.skip("a GPU is visible here")
    assert backend.get_cupy() is None and backend.device_count() == 0 and not backend.cupy_available()
    from axonmpi.distributed.backends import nccl_available
    import os
    if os.environ.get("AXONMPI_FAKE_NCCL", "0") in ("0", ""):
        assert not nccl_available()
