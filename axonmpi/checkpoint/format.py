"""On-disk layout of a checkpoint: names, format version, key paths, value encoding, manifest types.

A checkpoint is a directory::

    step-00001000/
      index.h5             written last, by group rank 0: the manifest + one virtual dataset per array
      shard-00000.h5       the pieces group rank 0 writes (only ranks that own data write a shard)
      shard-00001.h5
      ...

``index.h5`` holds, for a state ``{"model": {"w": ..., "b": ...}, "step": 7}``:

* ``/model/w``, ``/model/b``: HDF5 *virtual datasets* of the global shape that stitch the pieces
  in the shard files (relative source paths, so the directory can be moved). Plain
  ``h5py.File("index.h5")["model/w"][...]`` returns the full array; ``h5dump`` prints it.
* ``/step``: small values (Python scalars, strings, None, lists/tuples) as plain datasets, for
  people; ints beyond 64 bits (RNG states) as decimal strings.
* ``/_axonmpi/manifest`` (the authoritative manifest, UTF-8 JSON): the root attributes; per
  entry its key path (str/int keys as given), kind, dtype, global shape, Python type and, for
  small values, the exact value; the data files and their sizes as written; and the piece table
  ``{entry, file, dset, offsets, shape, block_rows, crc_start, crc_count, byte_offset}`` — one
  row per stored piece: which file and dataset hold which block of which entry, and where its
  contiguous bytes start in the file.
* ``/_axonmpi/checksums`` (uint64): a checksum per block of at most 4 MiB (runs of rows along the
  piece's axis 0; see :mod:`axonmpi.checkpoint.checksum`), so a rank reading a slice verifies
  just the blocks it reads.
* root attributes: ``format``, ``format_version`` (2), ``library_version``, ``created``,
  ``world_size``, ``group_size``, ``group_ranks``, ``writers``, ``checksum_algorithm``
  (``xxh3_64``), ``checksum`` (CRC-32 of the manifest and the checksums).

Format 1 (read, not written) kept the manifest in separate datasets (``/_axonmpi/entries``,
``files``, ``pieces/*``, uint32 ``checksums`` by ``axonmpi.pagesum64``) and no offsets or sizes.

:mod:`axonmpi.checkpoint.index` writes and reads it; :mod:`axonmpi.checkpoint.read` never reads
arrays through the virtual datasets (HDF5 would return fill values for a missing source file);
it reads the shard files and checks every block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "INDEX_NAME", "META_GROUP", "ARRAY_KINDS", "CheckpointError",
    "CheckpointMismatchError",
    "Entry", "Piece", "Manifest", "shard_name", "key_name", "flatten", "unflatten",
    "encode_value", "decode_value",
]

FORMAT_NAME = "axonmpi-checkpoint"
FORMAT_VERSION = 2  # 2: xxh3_64 block checksums stored as uint64; 1: axonmpi.pagesum64 as uint32 (still read)
INDEX_NAME = "index.h5"
META_GROUP = "_axonmpi"
ARRAY_KINDS = "biufc"  # bool, signed, unsigned, float, complex


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read: missing/extra entries, a missing, truncated or
    corrupt shard, a changed shape, a failure on another rank."""


class CheckpointMismatchError(CheckpointError):
    """An intact checkpoint does not fit the template it is loaded into: other entries, another
    shape or another dtype. Not damage: :class:`~axonmpi.checkpoint.CheckpointManager` never sets
    such a checkpoint aside; the message names the first entry and what to change."""


def shard_name(group_rank: int) -> str:
    """File name of the shard written by ``group_rank``."""
    return f"shard-{int(group_rank):05d}.h5"


# -- keys ---------------------------------------------------------------------------------------
def _check_key(k: Any, parents: Tuple, rank: int) -> str:
    where = key_name(parents) or "<root>"
    if isinstance(k, bool) or not isinstance(k, (str, int, np.integer)):
        raise TypeError(
            f"rank {rank}: checkpoint keys must be str or int; {where} has key {k!r} of type "
            f"{type(k).__name__}"
        )
    s = str(int(k)) if not isinstance(k, str) else k
    if isinstance(k, str):
        if not k or k in (".", "..") or "/" in k:
            raise ValueError(
                f"rank {rank}: checkpoint key {k!r} under {where} is not allowed: keys map to HDF5 "
                "group names, so they must be non-empty, not '.'/'..', and contain no '/' "
                "(nest dicts instead of using '/' in a key)"
            )
        if not parents and k == META_GROUP:
            raise ValueError(f"rank {rank}: top-level key {META_GROUP!r} is reserved for checkpoint metadata")
    return s


def key_name(keys: Sequence[Any]) -> str:
    """The HDF5 path of a key path: ``("model", 0, "w") → "model/0/w"``."""
    return "/".join(str(k) for k in keys)


def flatten(state: Any, rank: int = 0) -> List[Tuple[Tuple, Any]]:
    """``[(key_path, leaf), ...]`` in insertion order; an empty dict is a leaf. Checks keys."""
    if not isinstance(state, dict):
        raise TypeError(f"rank {rank}: checkpoint state must be a dict, got {type(state).__name__}")
    out: List[Tuple[Tuple, Any]] = []
    seen: Dict[str, Tuple] = {}

    def walk(d: dict, parents: Tuple) -> None:
        names = {}
        for k, v in d.items():
            s = _check_key(k, parents, rank)
            if s in names:
                raise ValueError(
                    f"rank {rank}: keys {names[s]!r} and {k!r} under {key_name(parents) or '<root>'} "
                    "both map to the HDF5 name " + repr(s)
                )
            names[s] = k
            path = parents + (int(k) if isinstance(k, np.integer) else k,)
            if isinstance(v, dict) and v:
                walk(v, path)
            else:
                out.append((path, v))
                seen[key_name(path)] = path

    walk(state, ())
    return out


def unflatten(items: Iterable[Tuple[Sequence[Any], Any]]) -> dict:
    """Inverse of :func:`flatten`."""
    root: dict = {}
    for keys, v in items:
        d = root
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        if isinstance(v, dict) and not v and isinstance(d.get(keys[-1]), dict):
            continue
        d[keys[-1]] = v
    return root


# -- small values (exact JSON with tags for tuples and int-keyed dicts) ------------------------
def _to_json(x: Any, where: str, rank: int) -> Any:
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x)
    if isinstance(x, np.generic) and x.dtype.kind in "biuf":
        return x.item()
    if isinstance(x, list):
        return [_to_json(v, where, rank) for v in x]
    if isinstance(x, tuple):
        return {"__tuple__": [_to_json(v, where, rank) for v in x]}
    if isinstance(x, dict):
        items = []
        for k, v in x.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise TypeError(f"rank {rank}: {where} holds a dict with key {k!r}; keys must be str or int")
            items.append([k, _to_json(v, where, rank)])
        return {"__dict__": items}
    raise TypeError(
        f"rank {rank}: {where} holds a {type(x).__name__} inside a list/tuple; lists and tuples may "
        "hold only scalars, strings, None and nested lists/tuples/dicts of them (put arrays in dicts)"
    )


def _from_json(x: Any) -> Any:
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    if isinstance(x, dict):
        if "__tuple__" in x:
            return tuple(_from_json(v) for v in x["__tuple__"])
        return {k: _from_json(v) for k, v in x["__dict__"]}
    return x


def encode_value(v: Any, where: str, rank: int) -> Tuple[str, Any]:
    """``(pytype, json_value)`` for a small value leaf; TypeError for anything else."""
    if v is None:
        return "none", None
    if isinstance(v, bool):
        return "bool", v
    if isinstance(v, int):
        return "int", int(v)
    if isinstance(v, float):
        return "float", v
    if isinstance(v, str):
        return "str", v
    if isinstance(v, dict):  # only empty dicts reach here
        return "dict", None
    if isinstance(v, (list, tuple)):
        return ("tuple" if isinstance(v, tuple) else "list"), _to_json(v, where, rank)
    raise TypeError(
        f"rank {rank}: {where} has unsupported type {type(v).__name__}; a checkpoint state holds "
        "dicts of NumPy/CuPy arrays, ShardedArray, Python scalars, str, None and lists/tuples of "
        "scalars (for a module/optimizer/sampler pass obj.state_dict(), or use "
        "axonmpi.checkpoint.training_state)"
    )


def decode_value(pytype: str, v: Any) -> Any:
    if pytype == "dict":
        return {}
    if pytype == "float":
        return float(v)
    if pytype in ("list", "tuple"):
        return _from_json(v)
    return v


# -- manifest ----------------------------------------------------------------------------------
@dataclass
class Entry:
    """One leaf of the state: an array (``kind="array"``) or a small value (``kind="value"``)."""

    keys: Tuple
    kind: str
    pytype: str  # array: "ndarray" | "sharded" | "npscalar"; value: "int", "float", "str", ...
    dtype: Optional[str] = None
    shape: Tuple[int, ...] = ()
    value: Any = None
    pieces: List["Piece"] = field(default_factory=list)
    view_shape: Optional[Tuple[int, ...]] = None  # stored flattened (FSDP/ZeRO): the array's own shape

    @property
    def name(self) -> str:
        return key_name(self.keys)

    @property
    def full_shape(self) -> Tuple[int, ...]:
        """The array's own shape: ``view_shape`` for a flattened parameter, else the stored ``shape``."""
        return tuple(self.view_shape) if self.view_shape is not None else tuple(self.shape)

    @property
    def nbytes(self) -> int:
        if self.kind != "array":
            return 0
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        d = {"keys": list(self.keys), "kind": self.kind, "pytype": self.pytype}
        if self.kind == "array":
            d.update(dtype=self.dtype, shape=list(self.shape))
            if self.view_shape is not None:
                d["view_shape"] = list(self.view_shape)
        else:
            d["value"] = self.value
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Entry":
        vs = d.get("view_shape")
        return cls(tuple(d["keys"]), d["kind"], d["pytype"], d.get("dtype"), tuple(d.get("shape", ())),
                   d.get("value"), view_shape=None if vs is None else tuple(vs))


@dataclass
class Piece:
    """A stored block of an entry: ``dset`` in ``file`` holds ``global[offsets : offsets+shape]``."""

    entry: int
    file: str
    dset: str
    offsets: Tuple[int, ...]
    shape: Tuple[int, ...]
    block_rows: int
    checksums: List[int]  # one per block of ``block_rows`` rows, by the index's checksum algorithm
    byte_offset: int = -1  # where the contiguous data starts in ``file`` (-1: unknown, read through HDF5)

    @property
    def slices(self) -> Tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape))


@dataclass
class Manifest:
    """Everything in ``index.h5`` except the virtual datasets."""

    entries: List[Entry]
    attrs: Dict[str, Any]
    file_bytes: Dict[str, int] = field(default_factory=dict)  # size of each data file as written (format 2)

    def by_name(self) -> Dict[str, Entry]:
        """Entries by HDF5 path (``"model/w"``)."""
        return {e.name: e for e in self.entries}

    @property
    def checksum_algorithm(self) -> str:
        """The block checksum the index records (format 1 checkpoints: ``axonmpi.pagesum64``)."""
        return str(self.attrs.get("checksum_algorithm", "axonmpi.pagesum64"))


