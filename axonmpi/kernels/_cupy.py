"""CuPy kernels as data (source strings, checked on CPU) compiled on first use and cached per process."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict

from ..backend import get_cupy

__all__ = ["CupyKernel", "KERNELS", "define", "kernel"]

# float math for every element type (half, bfloat16 through float; float64 in double): T -> accumulate type
PREAMBLE = r"""
template <typename T> struct acc_t { typedef float type; };
template <> struct acc_t<double> { typedef double type; };
"""


@dataclass(frozen=True)
class CupyKernel:
    """One CuPy kernel's source: ``kind`` is ``elementwise``, ``reduction`` or ``raw``."""
    name: str
    kind: str
    in_params: str = ""
    out_params: str = ""
    body: str = ""
    reduce_expr: str = ""
    post_map_expr: str = ""
    identity: str = ""
    code: str = ""

    def params(self):
        """(type, name) of every parameter (elementwise and reduction kernels)."""
        out = []
        for part in (self.in_params + "," + self.out_params).split(","):
            toks = part.split()
            if toks:
                out.append((" ".join(toks[:-1]), toks[-1]))
        return out


KERNELS: Dict[str, CupyKernel] = {}
_COMPILED: dict = {}


def define(name: str, kind: str, **source) -> CupyKernel:
    """Register a kernel's source under ``name`` (done at import: plain strings, no CuPy needed)."""
    if name in KERNELS:
        raise ValueError(f"CuPy kernel {name!r} is defined twice")
    if not re.fullmatch(r"axonmpi_[a-z0-9_]+", name):
        raise ValueError(f"CuPy kernel name {name!r} must match axonmpi_[a-z0-9_]+")
    k = KERNELS[name] = CupyKernel(name=name, kind=kind, **source)
    return k


def kernel(name: str):
    """The compiled CuPy kernel ``name`` (compiled on first call, then cached)."""
    k = _COMPILED.get(name)
    if k is not None:
        return k
    cp = get_cupy()
    if cp is None:
        raise RuntimeError(f"CuPy kernel {name} needs CuPy and a CUDA device (pip install 'axonmpi[cuda12]')")
    s = KERNELS[name]
    if s.kind == "elementwise":
        k = cp.ElementwiseKernel(s.in_params, s.out_params, s.body, s.name, preamble=PREAMBLE)
    elif s.kind == "reduction":
        k = cp.ReductionKernel(s.in_params, s.out_params, s.body, s.reduce_expr, s.post_map_expr, s.identity,
                               s.name, preamble=PREAMBLE)
    elif s.kind == "raw":
        k = cp.RawKernel(PREAMBLE + s.code, s.name)
    else:
        raise ValueError(f"CuPy kernel {name}: unknown kind {s.kind!r}")
    _COMPILED[name] = k
    return k
