"""Array-module selection (NumPy or CuPy), devices and host staging; the only place that imports CuPy."""
from __future__ import annotations

import functools
import os
from typing import Any, Optional

import numpy as np

from . import env as _env

__all__ = [
    "matmul",
    "Device",
    "as_device",
    "cupy_available",
    "device_count",
    "device_of",
    "empty_pinned",
    "get_array_module",
    "get_cupy",
    "host_compute",
    "is_cupy_array",
    "to_device",
    "to_host",
    "to_host_pinned",
]


@functools.lru_cache(maxsize=None)
def get_cupy():
    """Return the ``cupy`` module, or ``None`` when CuPy or a CUDA device is unavailable.

    The import is attempted once and lazily, so CPU installs never touch CUDA.
    Set ``AXONMPI_DISABLE_CUPY=1`` to force the CPU path even where CuPy is installed.
    """
    if _env.get_bool("AXONMPI_DISABLE_CUPY"):
        return None
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a CUDA runtime that fails to load
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:
        return None
    return cupy


def cupy_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible."""
    return get_cupy() is not None


def device_count() -> int:
    """Number of visible CUDA devices (0 without CuPy)."""
    cp = get_cupy()
    return 0 if cp is None else int(cp.cuda.runtime.getDeviceCount())


def is_cupy_array(a: Any) -> bool:
    """True when ``a`` is a CuPy ndarray (never imports CuPy for NumPy inputs)."""
    mod = type(a).__module__
    return mod.startswith("cupy")


def is_floating(dtype) -> bool:
    """True for float and complex dtypes, and ml_dtypes' bfloat16 (whose NumPy kind is "V")."""
    return dtype.kind in "fc" or dtype.name == "bfloat16"


def get_array_module(*arrays: Any):
    """Return ``cupy`` if any argument is a CuPy array, else ``numpy`` (Chainer's convention).

    Arguments may also be objects with a ``.data`` array attribute (e.g. ``axonmpi.Tensor``).
    """
    for a in arrays:
        if isinstance(a, np.ndarray):  # its .data is a memoryview, which ml_dtypes' bfloat16 refuses
            continue
        if is_cupy_array(a):
            return get_cupy()
        inner = getattr(a, "data", None)
        if inner is not None and is_cupy_array(inner):
            return get_cupy()
    return np


class Device:
    """A compute device: ``Device("cpu")`` or ``Device("cuda:1")``.

    Example:
        >>> Device("cuda:0").type, Device("cuda:0").index
        ('cuda', 0)
    """

    __slots__ = ("type", "index")

    def __init__(self, spec: "str | Device" = "cpu", index: Optional[int] = None):
        if isinstance(spec, Device):
            self.type, self.index = spec.type, spec.index
            return
        if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):   # torch.device(0) is cuda:0
            spec, index = "cuda", int(spec)
        if not isinstance(spec, str):
            raise TypeError(f"device must be a str like 'cpu' or 'cuda:0', got {spec!r}")
        kind, _, idx = spec.partition(":")
        kind = kind.strip().lower()
        if kind not in ("cpu", "cuda", "gpu"):
            raise ValueError(f"unknown device {spec!r}; expected 'cpu', 'cuda' or 'cuda:<index>'")
        kind = "cuda" if kind == "gpu" else kind
        if idx:
            if kind == "cpu":
                raise ValueError(f"device {spec!r}: the CPU takes no index")
            try:
                index = int(idx)
            except ValueError:
                raise ValueError(f"device {spec!r}: index {idx!r} is not an integer") from None
        if kind == "cuda" and index is None:
            index = 0
        if index is not None and index < 0:
            raise ValueError(f"device {spec!r}: index must be >= 0")
        self.type, self.index = kind, (index if kind == "cuda" else None)

    @property
    def xp(self):
        """The array module for this device (``numpy`` or ``cupy``)."""
        if self.type == "cpu":
            return np
        cp = get_cupy()
        if cp is None:
            raise RuntimeError(
                f"device {self} needs CuPy and a CUDA GPU; install axonmpi[cuda12] "
                "or use device='cpu'"
            )
        return cp

    def __eq__(self, other) -> bool:
        try:
            other = as_device(other)
        except (TypeError, ValueError):
            return NotImplemented
        return self.type == other.type and self.index == other.index

    def __hash__(self) -> int:
        return hash((self.type, self.index))

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"


def as_device(spec: "str | Device | int | None") -> Device:
    """Coerce ``spec`` to a :class:`Device` (``None`` means CPU; an int, see :func:`index_device`)."""
    if spec is None:
        return Device("cpu")
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        return index_device(spec)
    return spec if isinstance(spec, Device) else Device(spec)


def index_device(index: int) -> Device:
    """What PyTorch's ``.to(rank)`` / ``device_ids=[rank]`` name: GPU ``index`` where CuPy sees GPUs
    (``index % device_count()``, so one rank per GPU on each node), and the CPU on a host without one,
    so a GPU script ported by its imports runs on a CPU cluster.

    Example:
        >>> index_device(0)          # Device('cpu') without a GPU, Device('cuda:0') with one
    """
    index = int(index)
    if index < 0:
        raise ValueError(f"device index must be >= 0, got {index}")
    n = device_count() if cupy_available() else 0
    return Device("cuda", index % n) if n else Device("cpu")


def to_target(device: Any) -> Device:
    """The device a ``.to(device)`` call moves to: :func:`index_device` for an int, and for ``"cuda"`` /
    ``"cuda:i"`` on a host where CuPy sees no GPU the CPU, with one warning per process (torch's scripts name
    ``cuda:{LOCAL_RANK}`` in their DDP branch: it runs on a CPU cluster unchanged, as ``.to(rank)`` does).

    Example:
        >>> to_target("cuda:1")      # Device('cpu') without a GPU (warns once), Device('cuda:1') with one
    """
    if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
        return index_device(int(device))
    dev = Device(device) if not isinstance(device, Device) else device
    if dev.type == "cuda" and not cupy_available():
        import warnings             # Python's default filter shows it once per calling line
        warnings.warn(f"axonmpi: {dev} asked for on a host where CuPy sees no GPU: running on the CPU",
                      RuntimeWarning, stacklevel=3)
        return Device("cpu")
    return dev


def device_of(a: Any) -> Device:
    """The device holding array ``a``."""
    if is_cupy_array(a):
        return Device("cuda", int(a.device.id))
    return Device("cpu")


def to_host(a: Any) -> np.ndarray:
    """Return ``a`` as a host NumPy array (no copy when it already is one)."""
    if is_cupy_array(a):
        return a.get()
    return np.asarray(a)


def to_device(a: Any, device: "str | Device | None") -> Any:
    """Move array ``a`` to ``device`` (no copy when it is already there)."""
    dev = as_device(device)
    if dev.type == "cpu":
        return to_host(a)
    cp = dev.xp
    with cp.cuda.Device(dev.index):
        if is_cupy_array(a) and int(a.device.id) == dev.index:
            return a
        return cp.asarray(a)



def empty_pinned(n: int, dtype) -> np.ndarray:
    """A 1-D host array of ``n`` elements in page-locked (pinned) memory from CuPy's pinned pool.

    Pinned buffers make host staging of device arrays (an MPI that is not CUDA-aware) copy at
    full PCIe speed. Without CuPy it is a plain ``numpy.empty``.

    Example:
        >>> buf = empty_pinned(1024, np.float32)     # host memory the GPU can DMA into
    """
    cp = get_cupy()
    if cp is None:
        return np.empty(n, dtype)
    import cupyx
    return cupyx.empty_pinned((int(n),), dtype)


def to_host_pinned(a: Any) -> np.ndarray:
    """``a`` copied into a new pinned host array (host arrays are returned as they are)."""
    if not is_cupy_array(a):
        return np.asarray(a)
    out = empty_pinned(a.size, a.dtype).reshape(a.shape)
    get_cupy().ascontiguousarray(a).get(out=out)   # no stream given: a synchronous copy
    return out


# -- batched half-precision products on CuPy -------------------------------------------------------------------
# [Note: batched bf16 matmul on CuPy]  CuPy 14 sends a 2-D bfloat16 product to cuBLAS (gemmEx, fp32 accumulation)
# but a batched (3-D and up) one to its integer GEMM path, which fails ("data type 'E' not understood", seen on
# an H200 with CuPy 14.2), and a batched float16 one through float32 copies.  ``matmul`` sends them to cuBLAS'
# strided-batched GEMM (half operands, fp32 accumulation, tensor cores); its first use per dtype is checked
# against the float32 product, and if cuBLAS refuses or differs, every later call takes the float32 route
# (correct, slower), said once.
_HALF_BATCHED: dict = {}      # dtype name -> True (cuBLAS works) / False (float32 route)
_CUDA_TYPES = {"bfloat16": 14, "float16": 2}     # cudaDataType: CUDA_R_16BF, CUDA_R_16F


def matmul(a: Any, b: Any) -> Any:
    """``a @ b`` (NumPy's rules); on CuPy a batched bfloat16 / float16 product through cuBLAS' strided-batched
    GEMM ([Note: batched bf16 matmul on CuPy])."""
    if type(a) is np.ndarray:       # the host: NumPy's own product (the hot path: no dtype name lookup)
        return a @ b
    name = getattr(getattr(a, "dtype", None), "name", "")
    if name not in _CUDA_TYPES or not is_cupy_array(a) or (a.ndim <= 2 and b.ndim <= 2) or a.ndim < 2 \
            or b.ndim < 2 or getattr(b.dtype, "name", "") != name:
        return a @ b
    ok = _HALF_BATCHED.get(name)
    if ok is False:
        return _half_via_float32(a, b)
    if ok is None:
        want = _half_via_float32(a, b)
        try:
            got = _half_batched_cublas(a, b)
            xp = get_cupy()
            err = float(xp.abs(got.astype(np.float32) - want.astype(np.float32)).max()) / \
                max(float(xp.abs(want.astype(np.float32)).max()), 1e-30)
            ok = err < 2e-2
        except Exception as e:  # noqa: BLE001 - any refusal of cuBLAS: the float32 route, said once
            err, ok = repr(e), False
        _HALF_BATCHED[name] = ok
        if not ok:
            import logging
            logging.getLogger("axonmpi.backend").warning(
                "batched %s matmul through cuBLAS strided-batched GEMM failed its check (%s): products take the "
                "float32 route", name, err)
        return got if ok else want
    return _half_batched_cublas(a, b)


def _half_via_float32(a, b):
    return (a.astype(np.float32) @ b.astype(np.float32)).astype(a.dtype)


def _operand(x):
    """``(contiguous storage, transposed?)`` of a batched matrix operand: a C-contiguous array as it is, the
    transpose of one (``y.swapaxes(-1, -2)``) as that one with a transpose flag, else a contiguous copy."""
    if x.flags.c_contiguous:
        return x, False
    t = x.swapaxes(-1, -2)
    if t.flags.c_contiguous:
        return t, True
    return get_cupy().ascontiguousarray(x), False


def _half_batched_cublas(a, b):
    cp = get_cupy()
    from cupy_backends.cuda.libs import cublas
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.shape[-2] != k:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    a = cp.broadcast_to(a, batch + (m, k)) if a.shape[:-2] != batch else a
    b = cp.broadcast_to(b, batch + (k, n)) if b.shape[:-2] != batch else b
    sa, ta = _operand(a)
    sb, tb = _operand(b)
    count = int(np.prod(batch, dtype=np.int64)) if batch else 1
    c = cp.empty(batch + (m, n), a.dtype)
    if count == 0 or m == 0 or n == 0:
        return c
    if k == 0:
        c[...] = 0
        return c
    dt = _CUDA_TYPES[a.dtype.name]
    # row-major C = A @ B is column-major C^T = B^T @ A^T: the first operand is b, the second a
    handle = cp.cuda.device.get_cublas_handle()
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    try:
        cublas.gemmStridedBatchedEx(
            handle, cublas.CUBLAS_OP_T if tb else cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T if ta else cublas.CUBLAS_OP_N,
            n, m, k, one.ctypes.data,
            sb.data.ptr, dt, k if tb else n, k * n,
            sa.data.ptr, dt, m if ta else k, m * k,
            zero.ctypes.data, c.data.ptr, dt, n, m * n,
            count, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    return c


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def host_compute() -> dict:
    """What does the host's arithmetic: the CPU, the BLAS NumPy calls (library, version, the kernels it
    picked, its threads) and anything in the environment that slows it.

    GEMMs run in NumPy's BLAS; elementwise kernels are NumPy ufuncs written in place (see
    ``[Note: elementwise]`` in ``axonmpi/autograd/ops_nn.py``). On the machines this was measured on
    (docs/performance.md) no other BLAS from the package registries was faster than the
    OpenBLAS of NumPy's wheels, so there is no optional BLAS to pick.

    Example:
        >>> host_compute()["blas"]        # e.g. 'scipy-openblas 0.3.31.188.0'
    """
    out = {"cpu": _cpu_model(), "cores": os.cpu_count(), "blas": "unknown", "kernels": None, "threads": None,
           "notes": []}
    try:
        from threadpoolctl import threadpool_info
        libs = [d for d in threadpool_info() if d.get("user_api") == "blas"]
    except Exception:  # threadpoolctl missing or unable to inspect this process
        libs = []
    mine = [d for d in libs if "numpy" in (d.get("filepath") or "")] or libs
    if mine:
        d = mine[0]
        prefix = d.get("prefix") or ""
        name = "scipy-openblas" if prefix.startswith("libscipy_openblas") else d.get("internal_api") or prefix
        out["blas"] = f"{name} {d.get('version') or ''}".strip()
        out["kernels"], out["threads"] = d.get("architecture"), d.get("num_threads")
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if os.environ.get(var):
            out["notes"].append(f"{var}={os.environ[var]} is set: OpenBLAS uses those kernels, not the CPU's own "
                                "(slower on a current NumPy; unset it where NumPy's OpenBLAS supports the CPU)")
    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS")
    if threads is None and (out["threads"] or 1) > 1:
        out["notes"].append("OMP_NUM_THREADS is unset: with several ranks per node set it to cores / ranks "
                            "(axonmpi run --threads N does)")
    return out
