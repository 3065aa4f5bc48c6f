"""axonmpi: MPI-native distributed deep learning on NumPy/CuPy and HDF5."""
from __future__ import annotations

__version__ = "0.1.0"

from . import backend
from .backend import Device, get_array_module
