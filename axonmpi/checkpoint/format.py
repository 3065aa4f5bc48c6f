"""On-disk layout of a checkpoint: names, format version, key paths, value encoding, checksums, the index.

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
* ``/_axonmpi/entries``: JSON (the authoritative manifest): per entry its key path (str/int keys
  as given), kind, dtype, global shape, Python type and, for small values, the exact value.
* ``/_axonmpi/pieces/{entry,file,dset,offsets,shape,block_rows,crc_start,crc_count}`` and
  ``/_axonmpi/checksums``: one row per stored piece — which file and dataset hold which block of
  which entry, and a :func:`checksum` per block of at most :data:`BLOCK_BYTES` bytes (runs of rows
  along the piece's axis 0), so a rank reading a slice verifies just the blocks it reads.
* root attributes: ``format``, ``format_version``, ``library_version``, ``created``,
  ``world_size``, ``group_size``, ``group_ranks``, ``writers``, ``checksum_algorithm``,
  ``checksum`` (CRC-32 of the manifest itself).

:mod:`axonmpi.checkpoint.io` never reads arrays through the virtual datasets (HDF5 would return
fill values for a missing source file); it reads the shard files and checks every block.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "INDEX_NAME", "META_GROUP", "BLOCK_BYTES", "CheckpointError",
    "Entry", "Piece", "Manifest", "shard_name", "key_name", "flatten", "unflatten",
    "encode_value", "decode_value", "block_rows", "block_crcs", "write_index", "read_index",
]

FORMAT_NAME = "axonmpi-checkpoint"
FORMAT_VERSION = 1
INDEX_NAME = "index.h5"
META_GROUP = "_axonmpi"
BLOCK_BYTES = 4 << 20  # checksum granularity (and the smallest unit a sliced read fetches)
ARRAY_KINDS = "biufc"
CHECKSUM_ALGORITHM = "axonmpi.pagesum64"  # per block of rows; recorded in the index so it can evolve  # bool, signed, unsigned, float, complex


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read: missing/extra entries, a missing, truncated or
    corrupt shard, a changed shape, a failure on another rank."""


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


def _is_sharded(x: Any) -> bool:
    from .sharded import ShardedArray
    return isinstance(x, ShardedArray)


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


# -- checksums ------------------------------------------------------------------------------------
def block_rows(shape: Sequence[int], itemsize: int) -> int:
    """Rows (along axis 0) per checksum block of a piece of ``shape``."""
    if len(shape) == 0:
        return 1
    row = itemsize * int(np.prod(shape[1:], dtype=np.int64))
    return max(1, BLOCK_BYTES // max(row, 1))


def nblocks(shape: Sequence[int], brows: int) -> int:
    if len(shape) == 0:
        return 1
    return max(1, math.ceil(shape[0] / brows))


_PAGE_WORDS = 512  # 4 KiB pages of 64-bit words
_WEIGHTS = np.arange(1, 1 << 14, dtype=np.uint64)
_MASK64 = (1 << 64) - 1


def checksum(u: np.ndarray) -> int:
    """32-bit checksum of the bytes ``u`` (a 1-D uint8 array): algorithm ``axonmpi.pagesum64``.

    The bytes are read as little-endian 64-bit words in 4 KiB pages; ``s1`` is the sum of all
    words and ``s2`` the sum of the page sums weighted by page number (both mod 2**64, a
    Fletcher-style pair), and the result is the CRC-32 of ``(length, s1, s2, trailing bytes)``.
    Any single flipped bit, truncation, zeroed or swapped page changes it. It runs at
    NumPy-reduction speed (~30 GB/s in cache, about 10x zlib.crc32), so verifying a load
    costs little beside the read itself.
    """
    n = u.nbytes
    nw = n // 8
    w = u[: nw * 8].view("<u8")
    k = nw // _PAGE_WORDS
    s1 = s2 = 0
    if k:
        pages = w[: k * _PAGE_WORDS].reshape(k, _PAGE_WORDS).sum(axis=1, dtype=np.uint64)
        s1 = int(pages.sum(dtype=np.uint64))
        wts = _WEIGHTS[:k] if k <= _WEIGHTS.size else np.arange(1, k + 1, dtype=np.uint64)
        s2 = int((pages * wts).sum(dtype=np.uint64))
    s1 = (s1 + int(w[k * _PAGE_WORDS:].sum(dtype=np.uint64))) & _MASK64
    return zlib.crc32(struct.pack("<QQQ", n, s1, s2) + u[nw * 8:].tobytes())


def block_crcs(a: np.ndarray, brows: int) -> List[int]:
    """The :func:`checksum` of each block of ``brows`` rows of the C-contiguous array ``a``."""
    u = a.reshape(-1).view(np.uint8)
    if a.ndim == 0:
        return [checksum(u)]
    step = brows * (u.nbytes // a.shape[0] if a.shape[0] else 0)
    n = nblocks(a.shape, brows)
    return [checksum(u[i * step:(i + 1) * step]) for i in range(n)]


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

    @property
    def name(self) -> str:
        return key_name(self.keys)

    @property
    def nbytes(self) -> int:
        if self.kind != "array":
            return 0
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict:
        d = {"keys": list(self.keys), "kind": self.kind, "pytype": self.pytype}
        if self.kind == "array":
            d.update(dtype=self.dtype, shape=list(self.shape))
        else:
            d["value"] = self.value
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Entry":
        return cls(tuple(d["keys"]), d["kind"], d["pytype"], d.get("dtype"), tuple(d.get("shape", ())),
                   d.get("value"))


@dataclass
class Piece:
    """A stored block of an entry: ``dset`` in ``file`` holds ``global[offsets : offsets+shape]``."""

    entry: int
    file: str
    dset: str
    offsets: Tuple[int, ...]
    shape: Tuple[int, ...]
    block_rows: int
    crcs: List[int]

    @property
    def slices(self) -> Tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape))


@dataclass
class Manifest:
    """Everything in ``index.h5`` except the virtual datasets."""

    entries: List[Entry]
    attrs: Dict[str, Any]

    def by_name(self) -> Dict[str, Entry]:
        return {e.name: e for e in self.entries}


def _manifest_crc(entries_json: bytes, cols: Dict[str, np.ndarray], crcs: np.ndarray) -> int:
    c = zlib.crc32(entries_json)
    for k in sorted(cols):
        if k != "dset":
            c = zlib.crc32(np.ascontiguousarray(cols[k]).view(np.uint8), c)
        else:
            c = zlib.crc32("\0".join(cols[k]).encode(), c)
    return zlib.crc32(crcs.view(np.uint8), c)


def _piece_columns(entries: List[Entry]) -> Tuple[Dict[str, Any], np.ndarray, List[str]]:
    pieces = [p for e in entries for p in e.pieces]
    maxnd = max([len(p.shape) for p in pieces], default=0)
    files = sorted({p.file for p in pieces})
    fid = {f: i for i, f in enumerate(files)}
    n = len(pieces)
    cols = {
        "entry": np.array([p.entry for p in pieces], np.int64),
        "file": np.array([fid[p.file] for p in pieces], np.int64),
        "dset": [p.dset for p in pieces],
        "offsets": np.full((n, maxnd), -1, np.int64),
        "shape": np.full((n, maxnd), -1, np.int64),
        "block_rows": np.array([p.block_rows for p in pieces], np.int64),
        "crc_count": np.array([len(p.crcs) for p in pieces], np.int64),
    }
    for i, p in enumerate(pieces):
        cols["offsets"][i, :len(p.offsets)] = p.offsets
        cols["shape"][i, :len(p.shape)] = p.shape
    cols["crc_start"] = np.concatenate([[0], np.cumsum(cols["crc_count"])[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
    crcs = np.array([c for p in pieces for c in p.crcs], np.uint32)
    return cols, crcs, files


def write_index(path: str, entries: List[Entry], attrs: Dict[str, Any]) -> None:
    """Write ``index.h5`` at ``path``: manifest, piece table, values and one virtual dataset per array."""
    import h5py

    entries_json = json.dumps([e.to_json() for e in entries]).encode()
    cols, crcs, files = _piece_columns(entries)
    with h5py.File(path, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        f.attrs["checksum"] = np.uint32(_manifest_crc(entries_json, cols, crcs))
        meta = f.create_group(META_GROUP)
        meta.create_dataset("entries", data=np.frombuffer(entries_json, np.uint8))
        meta["entries"].attrs["encoding"] = "utf-8 JSON"
        meta.create_dataset("files", data=np.array(files, dtype=h5py.string_dtype()), dtype=h5py.string_dtype())
        pg = meta.create_group("pieces")
        for k, v in cols.items():
            if k == "dset":
                pg.create_dataset(k, data=np.array(v, dtype=object), dtype=h5py.string_dtype(), shape=(len(v),))
            else:
                pg.create_dataset(k, data=v)
        meta.create_dataset("checksums", data=crcs)
        for e in entries:
            _write_entry_view(f, e, h5py)


def _write_entry_view(f, e: Entry, h5py) -> None:
    name = e.name
    if e.kind == "value":
        v = e.value
        if e.pytype == "dict":
            f.require_group(name)
            return
        if e.pytype == "none":
            ds = f.create_dataset(name, data=h5py.Empty("f"))
        elif e.pytype in ("list", "tuple"):
            ds = f.create_dataset(name, data=json.dumps(v), dtype=h5py.string_dtype())
        elif e.pytype == "int" and not (-2**63 <= v < 2**63):
            ds = f.create_dataset(name, data=str(v), dtype=h5py.string_dtype())
        elif e.pytype == "str":
            ds = f.create_dataset(name, data=v, dtype=h5py.string_dtype())
        else:
            ds = f.create_dataset(name, data=v)
        ds.attrs["axonmpi_type"] = e.pytype
        return
    dt = np.dtype(e.dtype)
    if int(np.prod(e.shape, dtype=np.int64)) == 0:
        ds = f.create_dataset(name, shape=e.shape, dtype=dt)
    else:
        ds = _virtual_dataset(f, name, e, dt, h5py)
    ds.attrs["axonmpi_type"] = e.pytype


def _virtual_dataset(f, name: str, e: Entry, dt: np.dtype, h5py):
    """One virtual dataset stitching ``e``'s pieces (HDF5's low-level calls: ~3x faster than VirtualLayout)."""
    h5d, h5p, h5s, h5t = h5py.h5d, h5py.h5p, h5py.h5s, h5py.h5t
    dcpl = h5p.create(h5p.DATASET_CREATE)
    for p in e.pieces:
        vspace = h5s.create_simple(e.shape) if e.shape else h5s.create(h5s.SCALAR)
        if p.shape:
            vspace.select_hyperslab(tuple(p.offsets), tuple(p.shape))
        sspace = h5s.create_simple(p.shape) if p.shape else h5s.create(h5s.SCALAR)
        dcpl.set_virtual(vspace, p.file.encode(), p.dset.encode(), sspace)
    parent, _, leaf = name.rpartition("/")
    grp = f.require_group(parent) if parent else f
    space = h5s.create_simple(e.shape) if e.shape else h5s.create(h5s.SCALAR)
    dsid = h5d.create(grp.id, leaf.encode(), h5t.py_create(dt, logical=True), space, dcpl=dcpl)
    return h5py.Dataset(dsid)


def read_index(path: str) -> Manifest:
    """Read and verify the manifest of ``index.h5`` (raises :class:`CheckpointError`)."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint index {path} is missing (not a checkpoint, or an unfinished save)") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint index {path} cannot be opened (truncated or corrupt?): {e}") from None
    with f:
        try:
            attrs = {k: _plain(v) for k, v in f.attrs.items()}
            if attrs.get("format") != FORMAT_NAME:
                raise CheckpointError(f"{path} is not an axonmpi checkpoint index (format={attrs.get('format')!r})")
            if int(attrs.get("format_version", 0)) > FORMAT_VERSION:
                raise CheckpointError(
                    f"{path} has format version {attrs['format_version']}; this axonmpi reads up to "
                    f"{FORMAT_VERSION} (upgrade axonmpi)"
                )
            algo = attrs.get("checksum_algorithm", CHECKSUM_ALGORITHM)
            if algo != CHECKSUM_ALGORITHM:
                raise CheckpointError(f"{path} uses checksum algorithm {algo!r}; this axonmpi knows {CHECKSUM_ALGORITHM!r}")
            meta = f[META_GROUP]
            entries_json = meta["entries"][()].tobytes()
            files = [s.decode() if isinstance(s, bytes) else s for s in meta["files"][()]]
            pg = meta["pieces"]
            cols = {k: pg[k][()] for k in pg.keys()}
            cols["dset"] = [s.decode() if isinstance(s, bytes) else s for s in cols["dset"]]
            crcs = meta["checksums"][()].astype(np.uint32)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"checkpoint index {path} is damaged: {type(e).__name__}: {e}") from None
    if _manifest_crc(entries_json, cols, crcs) != int(attrs.get("checksum", -1)):
        raise CheckpointError(f"checkpoint index {path}: manifest checksum mismatch (corrupt index)")
    entries = [Entry.from_json(d) for d in json.loads(entries_json.decode())]
    for i in range(len(cols["entry"])):
        e = entries[int(cols["entry"][i])]
        nd = len(e.shape)
        s, c = int(cols["crc_start"][i]), int(cols["crc_count"][i])
        e.pieces.append(Piece(
            int(cols["entry"][i]), files[int(cols["file"][i])], cols["dset"][i],
            tuple(int(v) for v in cols["offsets"][i, :nd]), tuple(int(v) for v in cols["shape"][i, :nd]),
            int(cols["block_rows"][i]), [int(v) for v in crcs[s:s + c]],
        ))
    return Manifest(entries, attrs)


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v
