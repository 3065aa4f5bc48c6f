"""Communication backends under the collectives: MPI (always) and NCCL (CuPy GPUs)."""
from .base import Backend
from .mpi import MPIBackend, cuda_aware_mpi

__all__ = ["Backend", "MPIBackend", "cuda_aware_mpi"]
