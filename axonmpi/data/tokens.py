"""Token files on disk: nanoGPT's header-free ``.bin`` of uint16/uint32 ids, memory-mapped, as next-token windows.

[Note: the token file layout]  A token file is the token ids of the whole corpus, one after the other, as
little-endian unsigned integers of one width and nothing else: no header, no document boundaries (put an
end-of-text id between documents when you write it).  nanoGPT's ``prepare.py`` writes exactly this with
``np.array(ids, dtype=np.uint16).tofile("train.bin")`` (GPT-2's 50,257 ids fit in uint16; a larger vocabulary
needs uint32).  Because there is no header the width must be known: a ``meta.json`` beside the file
(``{"dtype": "uint16", "vocab_size": 50257, ...}``, what ``examples/prepare_data.py`` writes) says it, else
the caller passes it (``--data-dtype``), else uint16 as nanoGPT.  A folder holds ``train.bin`` and
``val.bin`` and that ``meta.json``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .dataset import Dataset, _check_index

__all__ = ["TOKEN_DTYPES", "META_FILE", "TokenFileDataset", "open_tokens", "read_token_meta", "token_files",
           "write_token_file"]

TOKEN_DTYPES = ("uint16", "uint32")
META_FILE = "meta.json"


def read_token_meta(path: str) -> Dict[str, Any]:
    """The ``meta.json`` of a token folder (or of the folder holding a token file); ``{}`` when there is none."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    meta = os.path.join(folder, META_FILE)
    if not os.path.isfile(meta):
        return {}
    with open(meta, encoding="utf-8") as f:
        return json.load(f)


def token_files(path: str) -> Tuple[str, Optional[str]]:
    """``(train, val)`` files of ``path``: a folder's ``train.bin`` and ``val.bin`` (``val`` None when absent), or
    a single ``.bin`` file (``val`` None: the caller holds out its tail)."""
    if os.path.isdir(path):
        train, val = os.path.join(path, "train.bin"), os.path.join(path, "val.bin")
        if not os.path.isfile(train):
            raise FileNotFoundError(f"--data {path!r}: the folder has no train.bin (write one with "
                                    "examples/prepare_data.py, or pass the .bin file itself)")
        return train, (val if os.path.isfile(val) else None)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path!r}: no such file or folder")
    return path, None


def open_tokens(path: str, dtype: Optional[str] = None) -> np.memmap:
    """The token ids of ``path`` memory-mapped read-only, of ``dtype`` (default: ``meta.json``'s, else uint16)."""
    meta = read_token_meta(path)
    if dtype is not None and meta.get("dtype") not in (None, dtype):
        raise ValueError(f"{path!r}: dtype {dtype!r} given but {META_FILE} beside it says {meta['dtype']!r}; "
                         "leave --data-dtype out to use the file's")
    name = dtype or meta.get("dtype") or "uint16"
    if name not in TOKEN_DTYPES:
        raise ValueError(f"{path!r}: token dtype {name!r}; expected one of {TOKEN_DTYPES}")
    size = os.path.getsize(path)
    width = np.dtype(name).itemsize
    if size % width:
        raise ValueError(f"{path!r}: {size} bytes is not a whole number of {name} tokens ({width} bytes each): "
                         "the file is cut short or has another dtype")
    if size == 0:
        raise ValueError(f"{path!r} is empty")
    return np.memmap(path, dtype=np.dtype(name).newbyteorder("<"), mode="r")


def write_token_file(path: str, ids, dtype: str) -> int:
    """Write ``ids`` as a header-free little-endian ``dtype`` token file (through a temporary name); returns the
    count.  Raises ValueError when an id does not fit ``dtype``."""
    ids = np.asarray(ids)
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype {dtype!r}; expected one of {TOKEN_DTYPES}")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids in [{ids.min()}, {ids.max()}] do not fit {dtype}; use uint32")
    tmp = path + ".tmp"
    ids.astype(np.dtype(dtype).newbyteorder("<")).tofile(tmp)
    os.replace(tmp, path)
    return int(ids.size)


class TokenFileDataset(Dataset):
    """Next-token windows of a token file: sample ``i`` is ``(t[s:s+T], t[s+1:s+T+1])`` with ``s = i * stride``,
    as int64, read from the memory map (nothing is loaded whole).

    Args:
        tokens: a path (memory-mapped with :func:`open_tokens`) or a 1-D integer array.
        block_size: window length ``T``.
        stride: tokens between consecutive windows' starts (default ``T``: non-overlapping windows, so an epoch
            reads each token once and the sampler's permutation has ``len / T`` entries; 1: every offset,
            like the character corpus).
        dtype: the file's token dtype when ``tokens`` is a path (default: its ``meta.json``'s, else uint16).

    Example:
        >>> ds = TokenFileDataset(np.arange(10, dtype=np.uint16), 4)
        >>> len(ds), ds[1][0].tolist()
        (2, [4, 5, 6, 7])
    """

    def __init__(self, tokens, block_size: int, stride: Optional[int] = None, dtype: Optional[str] = None):
        self.path = os.fspath(tokens) if isinstance(tokens, (str, os.PathLike)) else None
        self.tokens = open_tokens(self.path, dtype) if self.path is not None else np.asarray(tokens)
        if self.tokens.ndim != 1 or not np.issubdtype(self.tokens.dtype, np.integer):
            raise ValueError(f"tokens must be a 1-D integer array, got shape {self.tokens.shape} "
                             f"dtype {self.tokens.dtype}")
        stride = block_size if stride is None else stride
        if not isinstance(block_size, int) or not 1 <= block_size < len(self.tokens):
            raise ValueError(f"block_size must be an int in [1, {len(self.tokens)}) for {self.path or 'the tokens'} "
                             f"({len(self.tokens)} tokens), got {block_size!r}")
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be an int >= 1, got {stride!r}")
        self.block_size, self.stride = block_size, stride
        self._n = (len(self.tokens) - 1 - block_size) // stride + 1
        self._offsets = np.arange(block_size + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int):
        s = _check_index(index, self._n) * self.stride
        w = np.asarray(self.tokens[s:s + self.block_size + 1], dtype=np.int64)
        return w[:-1].copy(), w[1:].copy()

    def get_batch(self, indices: np.ndarray):
        """``(x, y)`` of shape ``(len(indices), T)`` as int64, gathered from the memory map in one indexing call."""
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.stride
        w = np.asarray(self.tokens[starts + self._offsets], dtype=np.int64)
        return w[:, :-1], w[:, 1:]

    def max_token(self) -> int:
        """The largest id in the file (one pass over the memory map, in chunks)."""
        hi, step = 0, 1 << 24
        for s in range(0, len(self.tokens), step):
            hi = max(hi, int(self.tokens[s:s + step].max()))
        return hi

    def __repr__(self) -> str:
        return (f"TokenFileDataset({self.path or 'array'}, {len(self.tokens)} tokens of {self.tokens.dtype.name}, "
                f"block_size={self.block_size}, stride={self.stride}, {self._n} windows)")
