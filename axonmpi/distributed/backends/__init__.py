"""Communication backends under the collectives: the documented Backend contract, MPI and NCCL.

Which backend serves an array on a group (:func:`device_backend` for CuPy arrays): NCCL when
``axonmpi.init(backend=...)`` is ``"nccl"``, or ``"auto"`` and CuPy has NCCL; otherwise MPI,
directly when it is CUDA-aware (:func:`cuda_aware_mpi`), else staged through host memory. Host
arrays and object collectives always use the group's MPI backend (the test stand-in
``AXONMPI_FAKE_NCCL=1`` with ``backend="nccl"`` routes host arrays through NCCL too).
"""
from .base import Backend, P2PBuffer
from .mpi import CudaAwareMPIBackend, MPIBackend, cuda_aware_mpi, mpi_has_float16, query_cuda_support
from .nccl import BackendKind, NcclBackend, NcclBackendError, nccl_available, nccl_library, nccl_version

__all__ = ["Backend", "P2PBuffer", "MPIBackend", "CudaAwareMPIBackend", "NcclBackend", "NcclBackendError",
           "BackendKind", "cuda_aware_mpi", "query_cuda_support", "mpi_has_float16", "nccl_available",
           "nccl_library", "nccl_version", "device_backend", "host_backend"]


def host_backend(group) -> Backend:
    """A new backend for the group's host arrays: MPI (NCCL only on the test stand-in, when asked)."""
    if group.world.nccl_for_host_arrays:
        return NcclBackend(group)
    return MPIBackend(group)


def device_backend(group) -> "Backend | None":
    """The group's NCCL backend for CuPy arrays when the World's backend choice gives NCCL, else ``None``.

    ``None`` means MPI serves CuPy arrays (directly when :func:`cuda_aware_mpi`, else staged).
    Nothing NCCL-related is created before the first device collective.
    """
    kind = group.world.backend
    if kind is BackendKind.NCCL or (kind is BackendKind.AUTO and nccl_available()):
        return NcclBackend(group)
    return None
