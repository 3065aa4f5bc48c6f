"""Map-style datasets: the ``Dataset`` protocol, ``TensorDataset`` and ``Subset``."""
from __future__ import annotations

import operator
from typing import Any, Sequence

import numpy as np

from ..backend import is_cupy_array

__all__ = ["Dataset", "TensorDataset", "Subset"]


class Dataset:
    """A map-style dataset: ``len(ds)`` samples, ``ds[i]`` returns sample ``i``.

    Subclasses implement ``__len__`` and ``__getitem__``. They may also implement
    ``get_batch(indices)`` returning an already collated batch for an integer index
    array; :class:`~axonmpi.data.DataLoader` then uses it instead of collating
    samples one by one (the fast path for array-backed datasets).
    """

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement __len__")

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__")


def _check_index(index: Any, n: int) -> int:
    """Return ``index`` as a non-negative int below ``n`` (negative indices count from the end)."""
    i = operator.index(index)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"index {index} is out of range for a dataset of {n} samples")
    return i


def _is_tensor(a: Any) -> bool:
    from ..autograd import Tensor
    return isinstance(a, Tensor)


def _as_tensor(a: Any) -> Any:
    from ..autograd import Tensor
    return Tensor._wrap(a)


def _as_array(a: Any) -> Any:
    """``a`` itself when it is a NumPy/CuPy array, the array inside a ``Tensor``, else ``np.asarray(a)``."""
    if isinstance(a, np.ndarray) or is_cupy_array(a):
        return a
    inner = getattr(a, "data", None)
    if isinstance(inner, np.ndarray) or is_cupy_array(inner):
        return inner
    return np.asarray(a)


class TensorDataset(Dataset):
    """Rows of equally long arrays: ``ds[i] == (a[i], b[i], ...)``.

    Args:
        *arrays: NumPy or CuPy arrays (or objects with a ``.data`` array, like
            ``axonmpi.Tensor``) sharing their first dimension. What was given as an
            ``axonmpi.Tensor`` comes back as Tensors (samples and ``DataLoader`` batches, as
            torch's ``TensorDataset`` does); arrays come back as arrays.

    Example:
        >>> ds = TensorDataset(np.zeros((4, 3)), np.arange(4))
        >>> x, y = ds[1]; x.shape, int(y)
        ((3,), 1)
    """

    def __init__(self, *arrays: Any):
        if not arrays:
            raise ValueError("TensorDataset needs at least one array")
        self._tensors = tuple(_is_tensor(a) for a in arrays)
        arrays = tuple(_as_array(a) for a in arrays)
        lengths = [len(a) for a in arrays]
        if any(n != lengths[0] for n in lengths):
            raise ValueError(f"TensorDataset arrays must share their first dimension, got lengths {lengths}")
        self.arrays = arrays

    def _out(self, rows: tuple) -> tuple:
        return tuple(_as_tensor(r) if t else r for r, t in zip(rows, self._tensors))

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, index: int) -> tuple:
        i = _check_index(index, len(self))
        return self._out(tuple(a[i] for a in self.arrays))

    def get_batch(self, indices: np.ndarray) -> tuple:
        """Rows ``indices`` of every array, gathered with one fancy-indexing call each."""
        return self._out(tuple(a[indices] for a in self.arrays))


class Subset(Dataset):
    """The samples of ``dataset`` at ``indices``, in that order.

    Example:
        >>> Subset(TensorDataset(np.arange(10)), [7, 3])[1]
        (3,)
    """

    def __init__(self, dataset: Dataset, indices: Sequence[int]):
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(dataset)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"Subset indices must lie in [-{n}, {n}) for a dataset of {n} samples")
        self.dataset = dataset
        self.indices = np.where(idx < 0, idx + n, idx)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(self.indices[_check_index(index, len(self))])]

    @property
    def get_batch(self):
        """The wrapped dataset's ``get_batch`` with indices mapped; absent when it has none."""
        inner = getattr(self.dataset, "get_batch", None)
        if inner is None:
            raise AttributeError(f"{type(self.dataset).__name__} has no get_batch fast path")
        return lambda indices: inner(self.indices[indices])
