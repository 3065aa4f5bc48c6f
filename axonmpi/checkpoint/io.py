"""save / load of sharded checkpoints, and CheckpointReader for reading one without MPI.

[Note: the save protocol]
1. Group rank 0 makes ``<path>.tmp-<uuid>`` and broadcasts its name.
2. Every rank flattens its state into a plan (entry names, dtypes, shapes, its block of each
   ShardedArray); one ``all_gather_object`` gives every rank every plan. All ranks check the
   plans agree and compute the same assignment: each distinct block of a ShardedArray is
   written by the lowest group rank holding it; each plain array (assumed replicated over the
   group) is written once, by the rank with the fewest bytes so far (largest arrays first), so
   writes of replicated state are spread over the ranks too. Small values go in the index.
3. Each rank writes its pieces to ``shard-<group rank>.h5`` with a checksum per block, closes
   and fsyncs it. A ``gather_object`` to rank 0 confirms every rank finished (or carries its
   error).
4. Rank 0 writes ``index.h5`` last (manifest, checksums, virtual datasets), fsyncs it and the
   directory, then swaps the directory into place: ``renameat2(RENAME_EXCHANGE)`` where Linux
   offers it (atomic: the path always holds a complete checkpoint), else rename the old one to
   ``<path>.old-<uuid>`` and the new one to ``<path>`` (a crash between the two leaves the old
   one at ``.old-*``, which :func:`load` finds). The old checkpoint is removed only after the
   new one is in place. The outcome is broadcast: an error on any rank raises on every rank
   and nothing is renamed.
"""
from __future__ import annotations

import ctypes
import datetime
import errno
import glob
import os
import shutil
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import backend as _be
from .format import (
    ARRAY_KINDS, CHECKSUM_ALGORITHM, FORMAT_NAME, FORMAT_VERSION, INDEX_NAME, CheckpointError, Entry, Manifest, Piece,
    block_crcs, block_rows, checksum, encode_value, decode_value, flatten, key_name, read_index, shard_name,
    unflatten, write_index,
)
from .sharded import ShardedArray

__all__ = ["save", "load", "CheckpointReader", "CheckpointError", "is_checkpoint"]

_FAULT_ENV = "AXONMPI_CKPT_FAULT"  # test-only fault injection: "<point>[:<group rank>[:raise]]"


# -- small plumbing ------------------------------------------------------------------------------
def _fault(point: str, rank: int) -> None:
    spec = os.environ.get(_FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] != point or (len(parts) > 1 and parts[1] not in ("", "*") and int(parts[1]) != rank):
        return
    if len(parts) > 2 and parts[2] == "raise":
        raise RuntimeError(f"injected fault {point} on rank {rank} ({_FAULT_ENV}={spec})")
    os._exit(17)


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_exchange(a: str, b: str) -> bool:
    """Atomically swap paths ``a`` and ``b`` (Linux ``renameat2``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")


def is_checkpoint(path: str) -> bool:
    """True when ``path`` is a directory holding a checkpoint index."""
    return os.path.isfile(os.path.join(os.fspath(path), INDEX_NAME))


def _resolve(path: str) -> str:
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


_SAME_TYPE = {c.__name__: c for c in (TypeError, ValueError, KeyError, FileExistsError, FileNotFoundError,
                                       PermissionError, NotImplementedError, CheckpointError)}


def _describe(error: Optional[BaseException]) -> Optional[Tuple[str, str]]:
    return None if error is None else (type(error).__name__, str(error))


def _agree(g, error: Optional[BaseException], what: str) -> None:
    """Raise on every rank if any rank of ``g`` failed (collective)."""
    msg = _describe(error)
    msgs = g.comm.allgather(msg) if g.size > 1 else [msg]
    _raise_from(msgs, error, what, g)


def _raise_from(msgs: List[Optional[Tuple[str, str]]], error: Optional[BaseException], what: str, g) -> None:
    """Re-raise this rank's own error, or one of the first failing rank's type naming every failure."""
    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if not bad:
        return
    if error is not None:
        raise error
    lines = "; ".join(f"rank {r}: {t}: {m}" for r, (t, m) in bad)
    cls = _SAME_TYPE.get(bad[0][1][0], CheckpointError)
    raise cls(f"rank {g.rank}: {what} failed on group rank(s) {[r for r, _ in bad]}: {lines}")


def _host(a: Any) -> np.ndarray:
    a = np.asarray(_be.to_host(a))  # not ascontiguousarray: it makes 0-d arrays 1-d
    return a if a.flags.c_contiguous else a.copy(order="C")


# -- planning ------------------------------------------------------------------------------------
def _plan(state: dict, rank: int, debug: bool) -> Tuple[list, Dict[str, Any]]:
    """This rank's view of ``state``: ``(records, arrays)``; records are small and picklable."""
    records, arrays = [], {}
    for keys, v in flatten(state, rank):
        name = key_name(keys)
        where = f"state[{']['.join(repr(k) for k in keys)}]"
        if isinstance(v, ShardedArray):
            arr, pytype, block = v.local, "sharded", (v.offsets, v.local_shape)
            shape = v.global_shape
        elif isinstance(v, (np.ndarray, np.generic)) or _be.is_cupy_array(v):
            arr, pytype, block = v, ("npscalar" if isinstance(v, np.generic) else "ndarray"), None
            shape = tuple(int(s) for s in np.shape(v))
        else:
            pytype, value = encode_value(v, where, rank)
            records.append((name, keys, "value", pytype, None, (), None, value, None))
            continue
        dt = np.dtype(arr.dtype)
        if dt.kind not in ARRAY_KINDS or dt.names is not None:
            raise TypeError(
                f"rank {rank}: {where} has dtype {dt}; checkpoints store bool, int, uint, float and "
                "complex arrays (store strings as str values)"
            )
        crc = None
        if debug and block is None:
            crc = checksum(_host(arr).reshape(-1).view(np.uint8))
        arrays[name] = arr
        records.append((name, keys, "array", pytype, dt.str, shape, block, None, crc))
    return records, arrays


def _check_plans(plans: List[list]) -> None:
    """All ranks must hold the same entries with the same kind, dtype and global shape."""
    ref = plans[0]
    problems = []
    ref_names = [r[0] for r in ref]
    for rank, plan in enumerate(plans[1:], 1):
        names = [r[0] for r in plan]
        if names != ref_names:
            only_here = sorted(set(names) - set(ref_names))
            only_ref = sorted(set(ref_names) - set(names))
            problems.append(
                f"rank {rank} has entries {only_here} that rank 0 lacks and lacks {only_ref}"
                if (only_here or only_ref) else f"rank {rank} lists the entries in another order"
            )
            continue
        for a, b in zip(ref, plan):
            if a[2:6] != b[2:6]:
                problems.append(f"entry {a[0]!r}: rank 0 has {a[3]} {a[4]} {a[5]}, rank {rank} has {b[3]} {b[4]} {b[5]}")
            elif a[8] is not None and a[8] != b[8]:
                problems.append(f"entry {a[0]!r}: plain array differs between rank 0 and rank {rank} "
                                "(plain arrays must be replicated; wrap per-rank data in ShardedArray)")
    if problems:
        raise CheckpointError("ranks disagree on the checkpoint state: " + "; ".join(problems))


def _overlaps(boxes: List[Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> Optional[Tuple[int, int]]:
    if len(boxes) < 2 or not boxes[0][0]:
        return None
    lo = np.array([b[0] for b in boxes], np.int64)
    hi = lo + np.array([b[1] for b in boxes], np.int64)
    ov = np.all((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :]), axis=2)
    np.fill_diagonal(ov, False)
    if ov.any():
        i, j = np.argwhere(ov)[0]
        return int(i), int(j)
    return None


def _assign(plans: List[list], collective: bool) -> Tuple[List[Entry], Dict[int, List[int]]]:
    """Entries with their pieces (CRCs still empty) and, per writer rank, the indices of its pieces."""
    ref = plans[0]
    nranks = len(plans)
    entries: List[Entry] = []
    load = [0] * nranks
    replicated = []
    all_pieces: List[Tuple[int, Piece]] = []  # (writer, piece)

    def piece(i, e, writer, off, shp):
        dset = e.name if not collective else f"r{writer:05d}/{e.name}"
        fname = shard_name(writer) if not collective else "data.h5"
        return Piece(i, fname, dset, tuple(off), tuple(shp), block_rows(shp, np.dtype(e.dtype).itemsize), [])

    for i, rec in enumerate(ref):
        name, keys, kind, pytype, dtype, shape, block, value, _ = rec
        e = Entry(tuple(keys), kind, pytype, dtype, tuple(shape), value)
        entries.append(e)
        if kind != "array" or int(np.prod(shape, dtype=np.int64)) == 0:
            continue
        if pytype != "sharded":
            replicated.append(i)
            continue
        owner: Dict[Tuple, int] = {}
        for r, plan in enumerate(plans):
            off, shp = plan[i][6]
            if int(np.prod(shp, dtype=np.int64)) == 0:
                continue
            owner.setdefault((tuple(off), tuple(shp)), r)
        boxes = list(owner)
        bad = _overlaps(boxes)
        if bad is not None:
            a, b = boxes[bad[0]], boxes[bad[1]]
            raise CheckpointError(
                f"entry {name!r}: the blocks of ranks {owner[a]} (offsets {a[0]}, shape {a[1]}) and "
                f"{owner[b]} (offsets {b[0]}, shape {b[1]}) overlap without being equal"
            )
        covered = sum(int(np.prod(s, dtype=np.int64)) for _, s in boxes)
        total = int(np.prod(shape, dtype=np.int64))
        if covered != total:
            raise CheckpointError(
                f"entry {name!r}: the ranks' blocks cover {covered} of the {total} elements of global "
                f"shape {tuple(shape)}; ShardedArray blocks must tile the global array"
            )
        for (off, shp), r in owner.items():
            all_pieces.append((r, piece(i, e, r, off, shp)))
            load[r] += int(np.prod(shp, dtype=np.int64)) * np.dtype(dtype).itemsize
    replicated.sort(key=lambda i: -entries[i].nbytes)
    for i in replicated:
        r = int(np.argmin(load))
        e = entries[i]
        all_pieces.append((r, piece(i, e, r, (0,) * len(e.shape), e.shape)))
        load[r] += e.nbytes
    all_pieces.sort(key=lambda wp: (wp[1].entry, wp[0]))
    mine: Dict[int, List[int]] = {}
    for k, (r, p) in enumerate(all_pieces):
        entries[p.entry].pieces.append(p)
        mine.setdefault(r, []).append(k)
    return entries, mine


def _pieces_flat(entries: List[Entry]) -> List[Piece]:
    return [p for e in entries for p in e.pieces]


def _write_shard(fname: str, jobs: List[Tuple[Piece, Any]], rank: int, fsync: bool) -> List[List[int]]:
    """Write the pieces; a worker thread checksums each piece while h5py writes it (NumPy reductions free the GIL)."""
    import h5py
    from concurrent.futures import ThreadPoolExecutor
    futures = []
    with ThreadPoolExecutor(1, thread_name_prefix="axonmpi-ckpt-crc") as pool, h5py.File(fname, "w") as f:
        for n, (p, arr) in enumerate(jobs):
            if n == len(jobs) // 2:
                _fault("mid_shard", rank)
            a = _host(arr)
            futures.append(pool.submit(block_crcs, a, p.block_rows))
            f.create_dataset(p.dset, data=a)
        out = [fu.result() for fu in futures]
    if fsync:
        _fsync_path(fname)
    return out


def _write_collective(fname: str, g, pieces: List[Piece], jobs: List[Tuple[Piece, Any]], entries,
                      fsync: bool) -> List[List[int]]:
    import h5py
    out = []
    with h5py.File(fname, "w", driver="mpio", comm=g.comm) as f:
        for p in pieces:  # metadata operations are collective: every rank creates every dataset
            f.create_dataset(p.dset, shape=p.shape, dtype=np.dtype(entries[p.entry].dtype))
        for p, arr in jobs:
            a = _host(arr)
            out.append(block_crcs(a, p.block_rows))
            f[p.dset].write_direct(a)
    if fsync and g.rank == 0:
        _fsync_path(fname)
    return out


def _check_target(path: str, overwrite: bool) -> None:
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise FileExistsError(f"checkpoint {path} exists (pass overwrite=True to replace it)")
    if not os.path.isdir(path) or os.path.islink(path) or not (is_checkpoint(path) or not os.listdir(path)):
        raise FileExistsError(
            f"refusing to replace {path}: it exists and is not an axonmpi checkpoint directory"
        )


def _commit(tmp: str, path: str, rank: int, fsync: bool = True) -> None:
    """Move the finished ``tmp`` directory to ``path``; the old checkpoint goes only afterwards.

    With ``fsync=False`` the directory fsyncs are skipped too (on ext4 they would force the new
    files' data out and make a "no fsync" save as slow as a durable one); the swap stays atomic.
    """
    parent = os.path.dirname(os.path.abspath(path))

    def sync_dir(d):
        if fsync:
            _fsync_path(d, directory=True)

    sync_dir(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
        sync_dir(parent)
        return
    force_two_step = os.environ.get(_FAULT_ENV, "").startswith("after_aside")
    if not force_two_step and _rename_exchange(tmp, path):
        sync_dir(parent)
        _fault("before_cleanup", rank)
        shutil.rmtree(tmp)  # now the old checkpoint
        return
    aside = f"{path}.old-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    _fault("after_aside", rank)
    os.rename(tmp, path)
    sync_dir(parent)
    _fault("before_cleanup", rank)
    shutil.rmtree(aside)


# -- save ----------------------------------------------------------------------------------------
def save(path: "str | os.PathLike", state: dict, group=None, *, overwrite: bool = True,
         fsync: bool = True, collective: bool = False) -> str:
    """Save ``state`` from every rank of ``group`` to the checkpoint directory ``path``.

    Collective over ``group`` (default: all ranks); every rank passes its own ``state`` with
    the same keys. Leaves may be :class:`ShardedArray` (this rank's block of a global array),
    NumPy/CuPy arrays (assumed replicated over the group and written once), NumPy scalars,
    Python ``int``/``float``/``bool``/``str``/``None``, lists/tuples of those, and nested
    dicts (str or int keys; no ``/`` in keys).

    Args:
        path: the checkpoint directory to create or replace (atomically; see the module notes).
        state: nested dict of the above.
        group: the process group saving together (default: all ranks).
        overwrite: replace an existing checkpoint at ``path`` (never a non-checkpoint path).
        fsync: flush files and directories to stable storage before the rename.
        collective: write one shared ``data.h5`` with HDF5's MPI-IO driver instead of a file
            per rank; needs h5py built with parallel HDF5 (``h5py.get_config().mpi``), else
            NotImplementedError.

    Returns:
        ``path``.

    Example:
        >>> w = ShardedArray.from_chunks(my_rows, (1024, 512), axis=0)
        >>> axonmpi.checkpoint.save("ckpt/step-100", {"model": {"w": w, "b": bias}, "step": 100})
    """
    from ..distributed import resolve_group
    import h5py

    g = resolve_group(group)
    path = os.fspath(path)
    if collective and not h5py.get_config().mpi:
        raise NotImplementedError(
            "save(collective=True) writes one shared file with HDF5's MPI-IO driver, which needs h5py "
            "built against parallel HDF5; this h5py is serial (h5py.get_config().mpi is False, as for "
            "the PyPI wheels). Use the default (one shard file per rank), or install h5py with "
            "HDF5_MPI=ON against a parallel HDF5."
        )
    comm, rank = g.comm, g.rank

    # 1. rank 0 makes the temporary directory
    tmp, err = None, None
    if rank == 0:
        try:
            _check_target(path, overwrite)
            parent = os.path.dirname(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            os.mkdir(tmp)
        except Exception as e:
            err = e
    tmp, msg = comm.bcast((tmp, _describe(err)), root=0) if g.size > 1 else (tmp, _describe(err))
    _raise_from([msg], err, f"save to {path}", g)

    agreed = False  # True where a failure is raised by every rank at the same point
    try:
        # 2. plans → assignment (identical on every rank)
        err, plan, arrays = None, None, {}
        try:
            plan, arrays = _plan(state, rank, g.world.debug)
        except Exception as e:
            err = e
        payload = (plan, _describe(err))
        gathered = comm.allgather(payload) if g.size > 1 else [payload]
        agreed = True
        _raise_from([m for _, m in gathered], err, f"save to {path}", g)
        plans = [p for p, _ in gathered]
        _check_plans(plans)
        entries, mine = _assign(plans, collective)
        pieces = _pieces_flat(entries)
        agreed = False

        # 3. write this rank's pieces
        err, crcs = None, []
        try:
            jobs = [(pieces[k], arrays[entries[pieces[k].entry].name]) for k in mine.get(rank, [])]
            jobs = [(p, a.local if isinstance(a, ShardedArray) else a) for p, a in jobs]
            _fault("before_shard", rank)
            if collective:
                crcs = _write_collective(os.path.join(tmp, "data.h5"), g, pieces, jobs, entries, fsync)
            elif jobs:
                crcs = _write_shard(os.path.join(tmp, shard_name(rank)), jobs, rank, fsync)
            _fault("after_shard", rank)
        except Exception as e:
            err = e
        payload = (crcs, _describe(err))
        results = comm.gather(payload, root=0) if g.size > 1 else [payload]

        # 4. rank 0: index, rename
        err2 = None
        if rank == 0:
            try:
                _raise_from([m for _, m in results], err, f"save to {path}", g)
                for r, ks in mine.items():
                    for k, c in zip(ks, results[r][0]):
                        pieces[k].crcs = c
                _fault("before_index", rank)
                index = os.path.join(tmp, INDEX_NAME)
                write_index(index, entries, _attrs(g, sorted(mine)))
                if fsync:
                    _fsync_path(index)
                _fault("after_index", rank)
                _commit(tmp, path, rank, fsync)
            except Exception as e:
                err2 = e if err is None else err
        status = comm.bcast(_describe(err2), root=0) if g.size > 1 else _describe(err2)
        agreed = True
        if status is not None:
            if err is not None:
                raise err
            _raise_from([status], err2, f"save to {path}", g)
    except BaseException:
        if rank == 0 and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if agreed and g.size > 1:
            comm.Barrier()  # every rank returns only after the temporary directory is gone
        raise
    return path


def _attrs(g, writers: List[int]) -> Dict[str, Any]:
    import h5py
    from .. import __version__
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "library_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": g.world.world_size,
        "group_size": g.size,
        "group_ranks": np.array(g.ranks, np.int64),
        "writers": np.array(writers, np.int64),
        "h5py_version": h5py.version.version,
        "hdf5_version": h5py.version.hdf5_version,
    }


# -- reading -------------------------------------------------------------------------------------
class CheckpointReader:
    """Read a checkpoint directory in one process (no MPI needed), verifying every block read.

    Example:
        >>> with CheckpointReader("ckpt/step-100") as r:
        ...     print(r.names())
        ...     w = r.read("model/w")                  # full array
        ...     rows = r.read("model/w", (slice(0, 8),))   # only the blocks holding rows 0..7
    """

    def __init__(self, path: "str | os.PathLike", manifest: Optional[Manifest] = None, *, verify: bool = True):
        self.verify = bool(verify)  # check each block read against its stored checksum
        self.path = _resolve(os.fspath(path)) if manifest is None else os.fspath(path)
        self.manifest = manifest if manifest is not None else read_index(os.path.join(self.path, INDEX_NAME))
        self._by_name = self.manifest.by_name()
        self._files: Dict[str, Any] = {}
        self._pool = None      # a worker thread verifying checksums while the next block is read
        self._pending: list = []

    # -- lookup --
    @property
    def attrs(self) -> Dict[str, Any]:
        """Root attributes of the index (format, versions, world layout, ...)."""
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
        self.flush()
        return res[()] if e.pytype == "npscalar" and region is None else res

    def read_block(self, e: Entry, offsets: Sequence[int], shape: Sequence[int],
                   out: Optional[np.ndarray] = None) -> np.ndarray:
        """Fill ``out`` (C-contiguous, the entry's dtype; allocated if None) with ``global[offsets:+shape]``.

        Checksums are verified by a worker thread; call :meth:`flush` before trusting ``out``
        (:meth:`read`, :meth:`to_dict` and :func:`load` do).
        """
        dt = np.dtype(e.dtype)
        offsets, shape = tuple(int(v) for v in offsets), tuple(int(v) for v in shape)
        if out is None:
            out = np.empty(shape, dt)
        total = int(np.prod(shape, dtype=np.int64))
        covered = 0
        for p in e.pieces:
            lo = tuple(max(a, b) for a, b in zip(p.offsets, offsets))
            hi = tuple(min(a + n, b + m) for a, n, b, m in zip(p.offsets, p.shape, offsets, shape))
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            covered += int(np.prod([h - l for l, h in zip(lo, hi)], dtype=np.int64))
            self._read_part(e, p, lo, hi, offsets, out)
        if covered != total:
            raise CheckpointError(
                f"entry {e.name!r} in {self.path}: the stored pieces cover {covered} of the {total} elements "
                f"requested (offsets {offsets}, shape {shape}); the index is damaged"
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

    def _read_part(self, e: Entry, p: Piece, lo, hi, base, out: np.ndarray) -> None:
        full = os.path.join(self.path, p.file)
        f = self._file(e, p.file)
        dt = np.dtype(e.dtype)
        try:
            ds = f[p.dset]
        except KeyError:
            raise CheckpointError(f"entry {e.name!r}: shard file {full} has no dataset {p.dset!r}") from None
        if tuple(ds.shape) != p.shape or ds.dtype != dt:
            raise CheckpointError(
                f"entry {e.name!r}: dataset {p.dset!r} in {full} has shape {tuple(ds.shape)} and dtype "
                f"{ds.dtype}; the index records shape {p.shape} and dtype {dt} (changed shape)"
            )
        dsel = tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, base))
        dest = out[dsel] if dsel else out
        try:
            if not p.shape:
                buf = np.empty((), dt)
                ds.read_direct(buf)
                if self.verify:
                    self._verify(e, p, full, block_crcs(buf, 1), 0)
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
            ds.read_direct(buf, source_sel=np.s_[r0:r1])
        except CheckpointError:
            raise
        except Exception as ex:
            raise CheckpointError(
                f"entry {e.name!r}: reading {p.dset!r} from {full} failed (truncated or corrupt file?): {ex}"
            ) from None
        if not direct:
            dest[...] = buf[(slice(plo[0] - r0, phi[0] - r0),) + tuple(slice(a, b) for a, b in zip(plo[1:], phi[1:]))]
        if not self.verify:
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="axonmpi-ckpt-verify")
        self._pending.append((self._pool.submit(block_crcs, buf, br), e, p, full, b0))

    def flush(self) -> None:
        """Wait for the checksums of every block read so far; raise :class:`CheckpointError` on a mismatch."""
        pending, self._pending = self._pending, []
        for fut, e, p, full, b0 in pending:
            self._verify(e, p, full, fut.result(), b0)

    def _verify(self, e: Entry, p: Piece, full: str, got: List[int], b0: int) -> None:
        want = p.crcs[b0:b0 + len(got)]
        if got != want:
            k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) + b0
            raise CheckpointError(
                f"entry {e.name!r}: checksum mismatch in {full} (dataset {p.dset!r}, block {k}: rows "
                f"{k * p.block_rows}.. of the piece at offsets {p.offsets}); the file is corrupt"
            )

    def to_dict(self) -> dict:
        """Everything as a nested dict of full arrays and values."""
        out = unflatten((e.keys, self._read_deferred(e)) for e in self.manifest.entries)
        self.flush()
        return out

    def _read_deferred(self, e: Entry) -> Any:
        if e.kind != "array":
            return self.value(e)
        res = self.read_block(e, (0,) * len(e.shape), e.shape)
        return res[()] if e.pytype == "npscalar" else res

    def close(self) -> None:
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
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


# -- load ----------------------------------------------------------------------------------------
def load(path: "str | os.PathLike", state: Optional[dict] = None, group=None, *, strict: bool = True,
         cast: bool = False, verify: bool = True) -> dict:
    """Load a checkpoint into this rank's current layout, whatever layout it was saved from.

    Collective over ``group`` (default: all ranks). With a template ``state`` (same nested
    keys as saved), each rank reads only the blocks it needs, straight from the shard files,
    and every block read is checksum-verified:

    * a :class:`ShardedArray` leaf gets its block ``global[offsets : offsets+local.shape]``
      filled in place (any saved sharding, any saved world size);
    * a NumPy/CuPy array leaf gets the full array, in place (shapes must match);
    * a ``None`` leaf gets the saved value or full array; an empty-dict leaf gets everything
      saved under that key (e.g. an optimizer's not-yet-created ``state``);
    * any other leaf (scalar, str, list) is replaced by the saved value.

    Without a template every rank gets everything as full arrays and values.

    Args:
        path: the checkpoint directory.
        state: template (nested dict), or None.
        group: the process group loading together (default: all ranks); errors on any rank
            raise on all.
        strict: entries missing from the checkpoint or present only in it raise a
            :class:`CheckpointError` listing them all; ``strict=False`` skips both.
        cast: allow a template array dtype different from the saved dtype (values are cast).
        verify: check every block read against its stored checksum (default). ``verify=False``
            skips that pass for speed on storage you trust; the index is still checked, and a
            missing or truncated shard still raises, but silently flipped bits go unnoticed.

    Returns:
        The loaded nested dict (template arrays are the same objects, filled in place).

    Example:
        >>> w = ShardedArray.zeros((1024, 512), np.float32, axis=1)     # another layout
        >>> out = axonmpi.checkpoint.load("ckpt/step-100", {"model": {"w": w, "b": bias}, "step": 0})
        >>> out["step"]
        100
    """
    from ..distributed import resolve_group

    g = resolve_group(group)
    comm, rank = g.comm, g.rank
    payload, err = None, None
    if rank == 0:
        try:
            real = _resolve(os.fspath(path))
            payload = (real, read_index(os.path.join(real, INDEX_NAME)))
        except Exception as e:
            err = e
    payload, msg = comm.bcast((payload, _describe(err)), root=0) if g.size > 1 else (payload, _describe(err))
    _raise_from([msg], err, f"load of {path}", g)
    real, manifest = payload
    reader = CheckpointReader(real, manifest, verify=verify)
    result, err = None, None
    try:
        result = _fill(reader, state, rank, strict, cast)
        reader.flush()
    except Exception as e:
        err = e
    finally:
        reader.close()
    _agree(g, err, f"load of {path}")
    return result


def _fill(reader: CheckpointReader, state: Optional[dict], rank: int, strict: bool, cast: bool) -> dict:
    saved = reader.manifest.entries
    if state is None:
        return reader.to_dict()
    tmpl = flatten(state, rank)
    by_name = reader._by_name
    wild = {key_name(k): k for k, v in tmpl if v is None or (isinstance(v, dict) and not v)}
    tnames = {key_name(k) for k, _ in tmpl}

    def under_wild(name: str) -> bool:
        parts = name.split("/")
        return any("/".join(parts[:i]) in wild for i in range(1, len(parts)))

    missing = [n for n in (key_name(k) for k, _ in tmpl) if n not in by_name and not (
        n in wild and any(s.name.startswith(n + "/") for s in saved))]
    extra = [e.name for e in saved if e.name not in tnames and not under_wild(e.name)]
    if strict and (missing or extra):
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing}")
        if extra:
            parts.append(f"in the checkpoint but not in the template: {extra}")
        raise CheckpointError(f"rank {rank}: {reader.path}: " + "; ".join(parts) + " (strict=False skips them)")
    items, problems = [], []
    for keys, leaf in tmpl:
        name = key_name(keys)
        e = by_name.get(name)
        if e is None:
            if name in wild:
                sub = [s for s in saved if s.name.startswith(name + "/")]
                if sub:
                    items.extend((s.keys, reader.read(s.name)) for s in sub)
                    continue
            items.append((keys, leaf))
            continue
        try:
            items.append((keys, _fill_one(reader, e, leaf, cast)))
        except CheckpointError as ex:
            problems.append(str(ex))
    if problems:
        raise CheckpointError(f"rank {rank}: {reader.path}: " + "; ".join(problems))
    return unflatten(items)


def _fill_one(reader: CheckpointReader, e: Entry, leaf: Any, cast: bool) -> Any:
    is_arr = isinstance(leaf, (ShardedArray, np.ndarray)) or _be.is_cupy_array(leaf)
    if e.kind != "array":
        if is_arr:
            raise CheckpointError(f"entry {e.name!r}: the checkpoint holds a {e.pytype} value, the template an array")
        return reader.value(e)
    if not is_arr:
        if isinstance(leaf, np.generic):
            return reader.read_block(e, (0,) * len(e.shape), e.shape).astype(leaf.dtype if cast else e.dtype)[()]
        return reader.read(e.name)
    if isinstance(leaf, ShardedArray):
        target, off, shp = leaf.local, leaf.offsets, leaf.local_shape
        if leaf.global_shape != e.shape:
            raise CheckpointError(
                f"entry {e.name!r}: saved global shape {e.shape}, template ShardedArray global shape "
                f"{leaf.global_shape} (changed shape)"
            )
    else:
        target, off, shp = leaf, (0,) * len(e.shape), e.shape
        if tuple(leaf.shape) != e.shape:
            raise CheckpointError(f"entry {e.name!r}: saved shape {e.shape}, template shape {tuple(leaf.shape)} (changed shape)")
    dt = np.dtype(e.dtype)
    if target.dtype != dt and not cast:
        raise CheckpointError(
            f"entry {e.name!r}: saved dtype {dt}, template dtype {target.dtype} (pass cast=True to convert)"
        )
    on_host = isinstance(target, np.ndarray)
    if on_host and target.dtype == dt and target.flags.c_contiguous and target.flags.writeable:
        reader.read_block(e, off, shp, target)
    else:
        if on_host and not target.flags.writeable:
            raise CheckpointError(f"entry {e.name!r}: the template array is read-only; load fills arrays in place")
        buf = reader.read_block(e, off, shp)
        if on_host:
            target[...] = buf
        else:
            target[...] = _be.get_array_module(target).asarray(buf).astype(target.dtype, copy=False)
    return leaf
