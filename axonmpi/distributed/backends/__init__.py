"""Communication backends under the collectives: the documented Backend contract and its MPI implementation.

An NCCL backend for CuPy arrays (``nccl.py``, communicators bootstrapped over MPI) is planned;
until it lands, CuPy arrays go over MPI (directly when it is CUDA-aware, else via the host).
"""
from .base import Backend, P2PBuffer
from .mpi import CudaAwareMPIBackend, MPIBackend, cuda_aware_mpi, mpi_has_float16

__all__ = ["Backend", "P2PBuffer", "MPIBackend", "CudaAwareMPIBackend", "cuda_aware_mpi", "mpi_has_float16"]
