"""Reading a checkpoint in one process: CheckpointReader, every block read checked against its checksum.

[Note: what a read verifies]
A block is the unit of checksumming (at most 4 MiB of whole rows of a piece). Every read path
— :meth:`CheckpointReader.read`, :meth:`~CheckpointReader.read_block`, ``to_dict``, :func:`load`,
and the ``axonmpi ckpt`` commands — reads whole blocks and compares their checksums before the
data is returned, so no caller can see unverified bytes unless it asked for ``verify=False``
(then :attr:`CheckpointReader.verify` is False and the docs of that flag say what is lost).
:meth:`CheckpointReader.verify_all` checks every block of every piece and lists every problem.

[Note: how a verified read keeps up with a raw one]
Datasets that save writes are contiguous and unfiltered, so their bytes are the array's bytes
at ``Dataset.id.get_offset()``: the reader fetches them with ``os.preadv`` one checksum block
(<= 4 MiB) at a time, straight into the destination, and hashes the block while it is still
in cache (xxh3 runs at tens of GB/s; a second pass over memory would cost more than the hash).
The check happens before the next block is read, so there is no pending state to lose: a
read that returns has been verified. Other layouts (chunked, filtered: not written by
axonmpi) are read through h5py.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from ..distributed import phases as _phases
from .checksum import block_checksums, checksum_function
from .format import INDEX_NAME, CheckpointError, Entry, Manifest, Piece, decode_value, key_name, unflatten
from .index import read_index

__all__ = ["CheckpointReader", "Problem", "is_checkpoint", "resolve_path"]


class Problem(NamedTuple):
    """One defect found by :meth:`CheckpointReader.verify_all` or :meth:`~CheckpointReader.file_problems`."""

    entry: str   # entry name, or "" for a file-level problem
    file: str    # shard file name inside the checkpoint directory
    message: str


def is_checkpoint(path: "str | os.PathLike") -> bool:
    """True when ``path`` is a directory holding a checkpoint index."""
    return os.path.isfile(os.path.join(os.fspath(path), INDEX_NAME))


def resolve_path(path: "str | os.PathLike") -> str:
    """The checkpoint directory for ``path`` (also a path to its index.h5, or a crash's ``.old-*``)."""
    path = os.fspath(path)
    if os.path.basename(path) == INDEX_NAME and os.path.isfile(path):
        return os.path.dirname(path) or "."
    if is_checkpoint(path):
        return path
    if not os.path.exists(path):
        asides = [p for p in glob.glob(glob.escape(path) + ".old-*") if is_checkpoint(p)]
        if asides:  # a save crashed between its two renames: the previous checkpoint is here
            return max(asides, key=os.path.getmtime)
        raise CheckpointError(f"no checkpoint at {path}")
    raise CheckpointError(f"{path} is not an axonmpi checkpoint (no {INDEX_NAME}; an unfinished save?)")


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


class CheckpointReader:
    """Read a checkpoint directory in one process (no MPI needed), verifying every block read.

    Args:
        path: the checkpoint directory (or its ``index.h5``).
        manifest: an already-read manifest (``load`` passes the one rank 0 read), else read here.
        verify: check each block read against its stored checksum (default). ``verify=False``
            trusts the storage: a missing or truncated shard still raises, flipped bytes do not.

    Example:
        >>> with CheckpointReader("ckpt/step-100") as r:
        ...     print(r.names())
        ...     w = r.read("model/w")                  # full array
        ...     rows = r.read("model/w", (slice(0, 8),))   # only the blocks holding rows 0..7
    """

    def __init__(self, path: "str | os.PathLike", manifest: Optional[Manifest] = None, *, verify: bool = True):
        self.verify = bool(verify)
        self.path = resolve_path(path) if manifest is None else os.fspath(path)
        self.manifest = manifest if manifest is not None else read_index(os.path.join(self.path, INDEX_NAME))
        self._by_name = self.manifest.by_name()
        self._checksum = checksum_function(self.manifest.checksum_algorithm)
        self._files: Dict[str, Any] = {}
        self._fds: Dict[str, int] = {}

    # -- lookup --
    @property
    def attrs(self) -> Dict[str, Any]:
        """Root attributes of the index (format, versions, world layout, checksum algorithm, ...)."""
        return self.manifest.attrs

    def names(self) -> List[str]:
        """Entry names (HDF5 paths) in save order."""
        return [e.name for e in self.manifest.entries]

    def entry(self, name: "str | Sequence") -> Entry:
        """The manifest :class:`Entry` for a name (``"model/w"``) or key path (``("model", "w")``)."""
        key = name if isinstance(name, str) else key_name(name)
        try:
            return self._by_name[key]
        except KeyError:
            raise KeyError(f"checkpoint {self.path} has no entry {key!r}") from None

    def files(self) -> List[str]:
        """The data files the index refers to (shard files, or ``data.h5``), sorted."""
        return sorted({p.file for e in self.manifest.entries for p in e.pieces})

    # -- reading --
    def value(self, e: Entry) -> Any:
        """The Python value of a small-value entry."""
        return decode_value(e.pytype, e.value)

    def read(self, name: "str | Sequence", region: Optional[Sequence[slice]] = None, *,
             out: Optional[np.ndarray] = None) -> Any:
        """The array (or value) of an entry; ``region`` (slices with unit step) reads a block only."""
        e = self.entry(name)
        if e.kind != "array":
            return self.value(e)
        if region is None:
            off, shp = (0,) * len(e.shape), e.shape
        else:
            region = tuple(region) + (slice(None),) * (len(e.shape) - len(tuple(region)))
            idx = [s.indices(n) for s, n in zip(region, e.shape)]
            if any(st != 1 for _, _, st in idx):
                raise ValueError(f"region {region} of {e.name}: only unit-step slices are supported")
            off = tuple(a for a, _, _ in idx)
            shp = tuple(max(0, b - a) for a, b, _ in idx)
        res = self.read_block(e, off, shp, out)
        return res[()] if e.pytype == "npscalar" and region is None else res

    def read_block(self, e: Entry, offsets: Sequence[int], shape: Sequence[int],
                   out: Optional[np.ndarray] = None) -> np.ndarray:
        """Fill ``out`` (C-contiguous, the entry's dtype; allocated if None) with ``global[offsets:+shape]``.

        Every block read is verified before this returns (unless the reader has ``verify=False``);
        a mismatch raises :class:`CheckpointError` naming the entry, file, dataset and block.
        """
        dt = np.dtype(e.dtype)
        offsets, shape = tuple(int(v) for v in offsets), tuple(int(v) for v in shape)
        if out is None:
            out = np.empty(shape, dt)
        covered = 0
        for p in e.pieces:
            lo = tuple(max(a, b) for a, b in zip(p.offsets, offsets))
            hi = tuple(min(a + n, b + m) for a, n, b, m in zip(p.offsets, p.shape, offsets, shape))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            covered += _size([h - l for l, h in zip(lo, hi)])
            self._read_part(e, p, lo, hi, offsets, out)
            _phases.heartbeat(_size([h - l for l, h in zip(lo, hi)]) * dt.itemsize)   # a long load is not a hang
        if covered != _size(shape):
            raise CheckpointError(
                f"entry {e.name!r} in {self.path}: the stored pieces cover {covered} of the {_size(shape)} "
                f"elements requested (offsets {offsets}, shape {shape}); the index is damaged"
            )
        return out

    def _file(self, e: Entry, fname: str):
        f = self._files.get(fname)
        if f is None:
            import h5py
            full = os.path.join(self.path, fname)
            try:
                f = h5py.File(full, "r")
            except FileNotFoundError:
                raise CheckpointError(f"entry {e.name!r}: shard file {full} is missing") from None
            except OSError as ex:
                raise CheckpointError(
                    f"entry {e.name!r}: shard file {full} cannot be opened (truncated or corrupt): {ex}"
                ) from None
            self._files[fname] = f
        return f

    def _dataset(self, e: Entry, p: Piece):
        """Piece ``p``'s dataset (a low-level h5py ``DatasetID``), checked against the index."""
        import h5py
        full = os.path.join(self.path, p.file)
        f = self._file(e, p.file)
        try:
            ds = h5py.h5d.open(f.id, p.dset.encode())
        except Exception:
            raise CheckpointError(f"entry {e.name!r}: shard file {full} has no dataset {p.dset!r}") from None
        dt = np.dtype(e.dtype)
        if tuple(ds.shape) != p.shape or ds.dtype != dt:
            raise CheckpointError(
                f"entry {e.name!r}: dataset {p.dset!r} in {full} has shape {tuple(ds.shape)} and dtype "
                f"{ds.dtype}; the index records shape {p.shape} and dtype {dt} (changed shape)"
            )
        return ds

    @staticmethod
    def _offset(ds) -> Optional[int]:
        """Byte offset of ``ds``'s data when it is contiguous and unfiltered (raw reads), else None."""
        import h5py
        try:
            plist = ds.get_create_plist()
            if plist.get_layout() == h5py.h5d.CONTIGUOUS and plist.get_nfilters() == 0:
                return ds.get_offset()
        except Exception:
            pass
        return None

    def _fd(self, e: Entry, p: Piece) -> int:
        """An open descriptor of ``p.file``; on first use its size is compared with the index's record."""
        fd = self._fds.get(p.file)
        if fd is not None:
            return fd
        full = os.path.join(self.path, p.file)
        try:
            fd = os.open(full, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"entry {e.name!r}: shard file {full} is missing") from None
        except OSError as ex:
            raise CheckpointError(f"entry {e.name!r}: shard file {full} cannot be opened: {ex}") from None
        size, want = os.fstat(fd).st_size, self.manifest.file_bytes.get(p.file)
        if want is not None and size != want:
            os.close(fd)
            self._dataset(e, p)  # names a truncated file or a changed dataset where HDF5 sees one
            raise CheckpointError(
                f"entry {e.name!r}: shard file {full} has {size} bytes, the index records {want} "
                f"({'truncated' if size < want else 'rewritten'} after the save)"
            )
        self._fds[p.file] = fd
        return fd

    def _locate(self, e: Entry, p: Piece):
        """``(dataset or None, byte offset or None)``: the raw offset from the index (format 2) or from HDF5."""
        if p.byte_offset >= 0:
            self._fd(e, p)
            return None, p.byte_offset
        ds = self._dataset(e, p)
        return ds, self._offset(ds)

    def _read_rows(self, e: Entry, p: Piece, ds, off: Optional[int], buf: np.ndarray, r0: int, r1: int) -> None:
        """Rows ``r0:r1`` of piece ``p`` into the C-contiguous ``buf``: raw from byte ``off``, or via h5py."""
        full = os.path.join(self.path, p.file)
        try:
            if off is None:
                import h5py
                if p.shape:
                    h5py.Dataset(ds).read_direct(buf, source_sel=np.s_[r0:r1])
                else:
                    h5py.Dataset(ds).read_direct(buf)
                return
            row = buf.nbytes // (r1 - r0) if p.shape and r1 > r0 else buf.nbytes
            mv = memoryview(buf.reshape(-1).view(np.uint8))
            pos, done, fd = off + r0 * row, 0, self._fd(e, p)
            while done < mv.nbytes:
                n = os.preadv(fd, [mv[done:]], pos + done)
                if n <= 0:
                    raise CheckpointError(
                        f"entry {e.name!r}: shard file {full} is truncated: dataset {p.dset!r} needs bytes "
                        f"{pos}..{pos + mv.nbytes}, the file ends at {pos + done}"
                    )
                done += n
        except CheckpointError:
            raise
        except Exception as ex:
            raise CheckpointError(
                f"entry {e.name!r}: reading {p.dset!r} from {full} failed (truncated or corrupt file?): {ex}"
            ) from None

    def _read_part(self, e: Entry, p: Piece, lo, hi, base, out: np.ndarray) -> None:
        ds, off = self._locate(e, p)
        dt = np.dtype(e.dtype)
        dsel = tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, base))
        dest = out[dsel] if dsel else out
        if not p.shape:
            buf = np.empty((), dt)
            self._read_rows(e, p, ds, off, buf, 0, 1)
            self._check(e, p, buf, 0)
            out[()] = buf
            return
        br = p.block_rows
        plo = [l - o for l, o in zip(lo, p.offsets)]
        phi = [h - o for h, o in zip(hi, p.offsets)]
        b0, b1 = plo[0] // br, -(-phi[0] // br)
        r0, r1 = b0 * br, min(b1 * br, p.shape[0])
        whole_rows = all(plo[i] == 0 and phi[i] == p.shape[i] for i in range(1, len(p.shape)))
        direct = (whole_rows and plo[0] == r0 and phi[0] == r1 and dest.flags.c_contiguous
                  and dest.dtype == dt)
        buf = dest if direct else np.empty((r1 - r0,) + p.shape[1:], dt)
        for b in range(b0, b1):  # block by block: each is hashed while it is still in cache
            lo_r, hi_r = b * br - r0, min((b + 1) * br, p.shape[0]) - r0
            part = buf[lo_r:hi_r]
            self._read_rows(e, p, ds, off, part, lo_r + r0, hi_r + r0)
            self._check(e, p, part, b)
        if not direct:
            dest[...] = buf[(slice(plo[0] - r0, phi[0] - r0),) + tuple(slice(a, b) for a, b in zip(plo[1:], phi[1:]))]

    def _check(self, e: Entry, p: Piece, buf: np.ndarray, b0: int) -> None:
        """Compare the checksums of the whole blocks in ``buf`` (first block ``b0``) with the index."""
        if not self.verify:
            return
        got = block_checksums(buf, p.block_rows, self._checksum)
        want = p.checksums[b0:b0 + len(got)]
        if got != want:
            if p.byte_offset >= 0:
                self._dataset(e, p)  # a changed dataset is named as such, not as flipped bytes
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want)) + b0
            raise CheckpointError(
                f"entry {e.name!r}: checksum mismatch in {os.path.join(self.path, p.file)} (dataset {p.dset!r}, "
                f"block {k}: rows {k * p.block_rows}.. of the piece at offsets {p.offsets}); the file is corrupt"
            )

    def to_dict(self) -> dict:
        """Everything as a nested dict of full arrays and values (every block verified).

        Arrays saved flattened with a ``view_shape`` (FSDP/ZeRO parameters and optimizer state)
        come back in that shape.
        """
        return unflatten([(e.keys, self._full(e)) for e in self.manifest.entries])

    def _full(self, e: Entry) -> Any:
        if e.kind != "array":
            return self.value(e)
        res = self.read_block(e, (0,) * len(e.shape), e.shape)
        return res[()] if e.pytype == "npscalar" else res.reshape(e.full_shape)

    # -- integrity --
    def file_problems(self) -> List[Problem]:
        """Missing, unreadable and short data files (no block is read; see :meth:`verify_all`).

        A file is short when a dataset of a piece it holds ends beyond the file's size.
        """
        import h5py
        out: List[Problem] = []
        for fname in self.files():
            full = os.path.join(self.path, fname)
            if not os.path.isfile(full):
                out.append(Problem("", fname, f"{full} is missing"))
                continue
            size = os.path.getsize(full)
            want = self.manifest.file_bytes.get(fname)
            if want is not None and size != want:
                out.append(Problem("", fname, f"{full} has {size} bytes, the index records {want} "
                                              f"({'short: truncated' if size < want else 'rewritten'} after the save)"))
                continue
            try:
                with h5py.File(full, "r") as f:
                    for e in self.manifest.entries:
                        for p in e.pieces:
                            if p.file != fname:
                                continue
                            ds = f.get(p.dset)
                            if ds is None:
                                out.append(Problem(e.name, fname, f"{full} has no dataset {p.dset!r}"))
                                continue
                            off = ds.id.get_offset()
                            end = (off or 0) + ds.id.get_storage_size()
                            if off is not None and end > size:
                                out.append(Problem(e.name, fname, f"{full} is short: dataset {p.dset!r} ends at "
                                                                  f"byte {end}, the file has {size} bytes (truncated)"))
            except OSError as ex:
                out.append(Problem("", fname, f"{full} cannot be opened ({size} bytes; truncated or corrupt): {ex}"))
        return out

    def coverage_problems(self) -> List[Problem]:
        """Array entries whose pieces do not tile the entry's shape exactly (a gap, an overlap, a piece out of
        bounds), as :meth:`verify_all` would not see them: each piece's checksums can be valid."""
        from .plan import _overlap
        out: List[Problem] = []
        for e in self.manifest.entries:
            if e.kind != "array":
                continue
            shape, where = tuple(e.shape), (e.pieces[0].file if e.pieces else INDEX_NAME)
            size = int(np.prod(shape, dtype=object))     # exact however large the index claims it is
            outside = [p for p in e.pieces if len(p.offsets) != len(shape) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(p.offsets, p.shape, shape))]
            if outside:
                p = outside[0]
                out.append(Problem(e.name, where, f"piece {p.file}:{p.dset} at offsets {tuple(p.offsets)} shape "
                                                  f"{tuple(p.shape)} lies outside the entry's shape {shape}"))
                continue
            bad = _overlap([p for p in e.pieces if int(np.prod(p.shape, dtype=object))])
            if bad is not None:
                a, b = e.pieces[bad[0]], e.pieces[bad[1]]
                out.append(Problem(e.name, where, f"pieces at offsets {tuple(a.offsets)} shape {tuple(a.shape)} and "
                                                  f"{tuple(b.offsets)} shape {tuple(b.shape)} overlap"))
                continue
            covered = sum(int(np.prod(p.shape, dtype=object)) for p in e.pieces)
            if covered != size:
                out.append(Problem(e.name, where, f"the pieces cover {covered} of the {size} elements of the entry's "
                                                  f"shape {shape} (a damaged or hand-edited index)"))
        return out

    def verify_all(self, files: Optional[Sequence[str]] = None) -> List[Problem]:
        """Read every block of every piece and check it; return every problem found (empty: all good).

        ``files`` limits the check to the pieces stored in those data files (ranks split a
        verification so).

        Example:
            >>> with CheckpointReader("ckpt/step-100") as r:
            ...     assert r.verify_all() == []
        """
        if not self.verify:
            raise CheckpointError("verify_all() needs a reader made with verify=True")
        out: List[Problem] = []
        only = None if files is None else set(files)
        for e in self.manifest.entries:
            for p in e.pieces:
                if only is not None and p.file not in only:
                    continue
                try:
                    ds, off = self._locate(e, p)
                    dt = np.dtype(e.dtype)
                    if not p.shape:
                        buf = np.empty((), dt)
                        self._read_rows(e, p, ds, off, buf, 0, 1)
                        self._check(e, p, buf, 0)
                        continue
                    for r0 in range(0, p.shape[0], p.block_rows):
                        r1 = min(r0 + p.block_rows, p.shape[0])
                        buf = np.empty((r1 - r0,) + p.shape[1:], dt)
                        self._read_rows(e, p, ds, off, buf, r0, r1)
                        self._check(e, p, buf, r0 // p.block_rows)
                except CheckpointError as ex:
                    out.append(Problem(e.name, p.file, str(ex)))
        return out

    def close(self) -> None:
        """Close the open shard files (every block read has been compared already)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for f in self._files.values():
            try:
                f.close()
            except Exception:
                pass
        self._files.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
