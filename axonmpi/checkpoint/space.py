"""The bytes a checkpoint takes on disk, from its plan: the data plus HDF5's overhead, measured from h5py.

[Note: the overhead constants]
HDF5 (h5py 3, the library's default "earliest" file format, contiguous datasets) spends, measured by
``tests/test_checkpoint_space.py::test_constants_match_h5py`` on files of 1 to 5,000 datasets:

- a file: superblock, root group and the first 2 KiB metadata block (``FILE``);
- a dataset: its object header with dataspace, datatype and layout messages, and its share of the
  parent group's B-tree (about 370 B: ``DATASET``);
- a group: its symbol-table B-tree node and local heap (about 1,040 B: ``GROUP``);
- a link name: the local heap keeps it (8-byte aligned, the heap grows by doubling): up to 2 B per
  character (``NAME``); a virtual dataset's mapping names its source file and dataset again in the
  global heap;
- a virtual dataset's source block: the selections of the mapping (``VDS_BLOCK``);
- an attribute of a few bytes (``axonmpi_type``) in the object header (``ATTR``).

The index also holds the manifest (its JSON is built here as ``write_index`` builds it, with the
widest numbers the save can write in it) and 8 bytes per block checksum. The estimate is meant to be
an upper bound within about 10% of what the save writes (the test compares both for small, many and
large entries, at 1 and several ranks); each writer also reserves its file's blocks before HDF5
writes (``write._reserve``), which catches an estimate that falls short.
"""
from __future__ import annotations

import json
from typing import Dict, List, Set

import numpy as np

from ..log import human
from .format import Entry, Piece
from .plan import WritePlan

__all__ = ["checkpoint_bytes", "shard_bytes", "index_bytes"]

FILE = 2048
DATASET = 400
GROUP = 1100
NAME = 2
VDS_BLOCK = 64
ATTR = 48
ATTRS_JSON = 640       # the root attributes (format, versions, created, group ranks ...) in the manifest
ROOT_ATTRS = 2048      # ... and as HDF5 attributes of the index's root group (a second object-header chunk)
_WIDE = 10 ** 12       # a byte offset or file size as wide as a save writes it in the manifest




def _names(paths: List[str]) -> int:
    """HDF5 overhead of the links and groups holding datasets at ``paths`` (without the datasets)."""
    groups: Set[str] = set()
    total = 0
    for path in paths:
        parts = path.split("/")
        total += NAME * len(parts[-1])
        for i in range(1, len(parts)):
            groups.add("/".join(parts[:i]))
    return total + sum(GROUP + NAME * len(g.rpartition("/")[2]) for g in groups)


def _data_bytes(plan: WritePlan, p: Piece) -> int:
    return int(np.prod(p.shape, dtype=np.int64)) * np.dtype(plan.entries[p.entry].dtype).itemsize


def shard_bytes(plan: WritePlan, pieces: List[Piece]) -> int:
    """Bytes of a shard file holding ``pieces`` (one contiguous dataset each, named ``p.dset``)."""
    if not pieces:
        return 0
    return (FILE + sum(_data_bytes(plan, p) for p in pieces) + DATASET * len(pieces)
            + _names([p.dset for p in pieces]))


def _blocks(p: Piece) -> int:
    return -(-p.shape[0] // max(p.block_rows, 1)) if p.shape else 1


def _manifest_bytes(entries: List[Entry]) -> int:
    """Length of the manifest JSON ``write_index`` writes for ``entries`` (numbers at their widest)."""
    from .index import _piece_columns
    cols, _, files = _piece_columns(entries)
    pieces = [p for e in entries for p in e.pieces]
    n = len(pieces)
    cols["crc_count"] = np.array([_blocks(p) for p in pieces], np.int64)
    cols["crc_start"] = np.full(n, _WIDE, np.int64)
    cols["byte_offset"] = np.full(n, _WIDE, np.int64)
    doc = {"attrs": {}, "entries": [e.to_json() for e in entries], "files": files,
           "file_bytes": [_WIDE] * len(files),
           "pieces": {k: (v if k == "dset" else v.tolist()) for k, v in cols.items()}}
    return len(json.dumps(doc).encode()) + ATTRS_JSON


def index_bytes(plan: WritePlan) -> int:
    """Bytes of ``index.h5``: the manifest, the block checksums, one dataset (virtual for an array) per entry."""
    entries = plan.entries
    pieces = plan.pieces()
    total = FILE + ROOT_ATTRS + 2 * DATASET + GROUP + _manifest_bytes(entries) + 8 * sum(_blocks(p) for p in pieces)
    for e in entries:
        if e.kind == "value":
            if e.pytype != "dict":
                total += DATASET + ATTR + 2 * len(json.dumps(e.value))
            continue
        total += DATASET + ATTR
    total += _names([e.name for e in entries if not (e.kind == "value" and e.pytype == "dict")])
    total += sum(VDS_BLOCK + NAME * (len(p.file) + len(p.dset)) for p in pieces)
    return total


def checkpoint_bytes(plan: WritePlan, collective: bool) -> int:
    """Bytes the whole checkpoint takes on its file system: every writer's file and the index."""
    if collective:
        return shard_bytes(plan, plan.pieces()) + index_bytes(plan)
    return sum(shard_bytes(plan, ps) for ps in plan.by_writer.values()) + index_bytes(plan)
