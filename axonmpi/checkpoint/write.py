"""save: write a sharded checkpoint from every rank of a group, crash-safe.

[Note: the save protocol]
1. Group rank 0 makes ``<path>.tmp-<uuid>`` and broadcasts its name.
2. Every rank flattens its state into a plan (:mod:`axonmpi.checkpoint.plan`); one
   ``all_gather_object`` gives every rank every plan; all ranks check the plans agree and
   compute the same :class:`~axonmpi.checkpoint.plan.WritePlan` (who writes which block).
3. Each rank writes its pieces to ``shard-<group rank>.h5`` with a checksum per block, closes
   and fsyncs it. A ``gather_object`` to rank 0 confirms every rank finished (or carries its
   error) and brings rank 0 the checksums.
4. Rank 0 writes ``index.h5`` last (manifest, checksums, virtual datasets), fsyncs it and the
   directory, then swaps the directory into place: ``renameat2(RENAME_EXCHANGE)`` where Linux
   offers it (atomic: the path always holds a complete checkpoint), else rename the old one to
   ``<path>.old-<uuid>`` and the new one to ``<path>`` (a crash between the two leaves the old
   one at ``.old-*``, which :func:`~axonmpi.checkpoint.load` finds). The old checkpoint is
   removed only after the new one is in place. The outcome is broadcast: an error on any rank
   raises on every rank and nothing is renamed.

Every exchange is an axonmpi collective on the group, so debug mode checks them.
"""
from __future__ import annotations

import ctypes
import datetime
import errno
import json
import os
import shutil
import uuid
from typing import Any, Dict, List, NamedTuple, Tuple

import numpy as np

from .. import trace as _trace
from ..distributed.collectives import all_gather_object, barrier, broadcast_object, gather_object
from ..distributed import phases as _phases
from ..distributed.sharding import ShardedArray
from .agree import describe, raise_from, share
from .checksum import CHECKSUM_ALGORITHM, block_checksums
from .format import FORMAT_NAME, FORMAT_VERSION, INDEX_NAME, CheckpointError, Piece, shard_name
from .index import write_index
from .plan import WritePlan, assign, check_plans, host_array, plan_state
from .read import is_checkpoint
from ..log import human
from .space import DATASET, FILE, checkpoint_bytes, index_bytes, shard_bytes

__all__ = ["save"]

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


# -- disk space -----------------------------------------------------------------------------------
# [Note: disk space is agreed, not raced]
# HDF5 that meets ENOSPC while it flushes its metadata leaves the library in a state in which
# closing or freeing its objects raises again, prints its error stack and can crash the process
# (a segmentation fault at 1 rank, "Can't decrement id ref count" at 4). So HDF5 must never meet
# a full disk. Group rank 0 measures the free space once, right after it made the temporary folder
# and before any rank writes, and sends it with the folder's name; once the plans are exchanged
# every rank knows the bytes every writer will write (the same WritePlan everywhere), so all ranks
# compare the same two numbers and agree without another message: a save that fits goes ahead, one
# that does not raises the same OSError(ENOSPC) on every rank, naming the bytes needed and free,
# before anything is written. (Each rank measuring for itself raced: a rank that looked after
# another had reserved its shard saw that much less free and refused a save that fits.) Each
# writer then reserves its file's blocks (fallocate, FALLOC_FL_KEEP_SIZE) before HDF5 writes to it,
# which catches a disk that another process fills meanwhile; that error too is one OSError(ENOSPC).
_FALLOC_FL_KEEP_SIZE = 1
_human = human


def _needed(plan: WritePlan, collective: bool) -> int:
    """Bytes the whole checkpoint needs on its file system (see ``space.py``'s note on the constants)."""
    return checkpoint_bytes(plan, collective)


def _free_bytes(path: str) -> int:
    """Bytes free for this process on ``path``'s file system (tests replace it)."""
    return shutil.disk_usage(path).free


def _no_space(folder: str, needed: int, rank: int, free: "int | None" = None, what: str = "the checkpoint") -> OSError:
    have = "" if free is None else f", {free} bytes ({_human(free)}) are free"
    return OSError(errno.ENOSPC, f"No space left on device: rank {rank}: {what} needs {needed} bytes "
                                 f"({_human(needed)}) in {folder}{have}; free space there or save to another "
                                 "folder (nothing was written; the previous checkpoint is intact)")


def _is_no_space(e: BaseException) -> bool:
    """True for a full disk, as Python (errno 28) or as HDF5's message text ("errno = 28") says it."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "errno = 28" in str(e)


def _ours(e: BaseException) -> bool:
    """True for an error made by :func:`_no_space` (it already names the folder and the bytes)."""
    return isinstance(e, OSError) and str(e.strerror or "").startswith("No space left on device: rank")


def _check_space(folder: str, needed: int, free: "int | None", rank: int) -> None:
    """Every rank, with the same ``needed`` (from the agreed plan) and ``free`` (group rank 0's measure)."""
    if free is not None and free < needed:
        raise _no_space(folder, needed, rank, free)


def _reserve(fname: str, nbytes: int, rank: int) -> bool:
    """Reserve ``nbytes`` of blocks for ``fname`` without changing its size; False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    fd = os.open(fname, os.O_WRONLY)
    try:
        if fn(fd, _FALLOC_FL_KEEP_SIZE, 0, int(nbytes)) == 0:
            return True
        err = ctypes.get_errno()
    finally:
        os.close(fd)
    if err == errno.ENOSPC:
        try:
            free = _free_bytes(os.path.dirname(os.path.abspath(fname)))
        except OSError:
            free = None
        raise _no_space(os.path.dirname(os.path.dirname(os.path.abspath(fname))), nbytes, rank, free,
                        what=f"its file {os.path.basename(fname)}")
    return False   # EOPNOTSUPP (NFS, some parallel file systems), ENOSYS, ...: the free-space check stands


def _trim(fname: str) -> None:
    """Give back the reserved blocks past the end of ``fname`` (shrinking frees blocks beyond EOF)."""
    size = os.path.getsize(fname)
    os.truncate(fname, size + 1)
    os.truncate(fname, size)


class _Written(NamedTuple):
    """What a rank reports to rank 0: per piece it wrote its block checksums and byte offset, file
    sizes, and the block checksums of the ShardedArray blocks it holds as a replica (not written)."""

    checksums: List[List[int]]
    byte_offsets: List[int]
    file_bytes: Dict[str, int]
    replica_sums: List[Tuple[int, Tuple[int, ...], List[int]]] = []   # (entry, offsets, sums)


def _replica_sums(plan: WritePlan, arrays: Dict[str, Any], rank: int) -> List[Tuple[int, Tuple[int, ...], List[int]]]:
    """Checksums of this rank's copies of blocks another rank writes (see plan.py's note on replicas)."""
    out = []
    for rep in plan.replicas.get(rank, []):
        e = plan.entries[rep.entry]
        a = arrays[e.name]
        local = host_array(a.local if isinstance(a, ShardedArray) else a)
        rows = next(p.block_rows for p in e.pieces if tuple(p.offsets) == tuple(rep.block.offsets))
        out.append((rep.entry, tuple(rep.block.offsets), block_checksums(local, rows)))
    return out


def _check_replicas(plan: WritePlan, results) -> None:
    """Rank 0: raise naming the entry, the block and the ranks when replicas of a block differ."""
    problems = []
    for r, (w, _) in enumerate(results):
        for i, offsets, sums in (w.replica_sums if w is not None else []):
            e = plan.entries[i]
            piece = next(p for p in e.pieces if tuple(p.offsets) == offsets)
            owner = next(o for o, ps in plan.by_writer.items() if any(q is piece for q in ps))
            if list(piece.checksums) != list(sums):
                problems.append(f"entry {e.name!r}: ranks {owner} and {r} hold different data for its block at offsets "
                                f"{offsets} (shape {tuple(piece.shape)})")
    if problems:
        raise CheckpointError(
            "replicas of a ShardedArray block differ: " + "; ".join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            + ". Ranks that hold the same block (offsets and shape) must hold the same values: a replica diverged "
            "(an update or a gradient not reduced over the ranks that share it), or pass blocks of their own "
            "offsets. Nothing was saved; the previous checkpoint is intact")


def _write_shard(fname: str, jobs: List[Tuple[Piece, Any]], rank: int, fsync: bool,
                 need: "int | None" = None) -> _Written:
    """Write the pieces; a worker thread checksums each piece while h5py writes it (xxhash frees the GIL).

    The file's blocks are reserved before HDF5 writes to it (see ``_reserve``): ``need`` bytes (default: the
    data plus ``space.DATASET`` per piece and ``space.FILE``).
    """
    import h5py
    from concurrent.futures import ThreadPoolExecutor
    futures, offsets = [], []
    if need is None:
        need = FILE + sum(int(np.prod(p.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize + DATASET for p, a in jobs)
    with ThreadPoolExecutor(1, thread_name_prefix="axonmpi-ckpt-checksum") as pool, h5py.File(fname, "w") as f:
        reserved = _reserve(fname, need, rank)
        for n, (p, arr) in enumerate(jobs):
            if n == len(jobs) // 2:
                _fault("mid_shard", rank)
            a = host_array(arr)
            futures.append(pool.submit(block_checksums, a, p.block_rows))
            ds = _write_beating(f, p.dset, a)
            off = ds.id.get_offset()
            offsets.append(-1 if off is None else int(off))
        sums = [fu.result() for fu in futures]
    if reserved:
        _trim(fname)
    if fsync:
        _fsync_path(fname)
    return _Written(sums, offsets, {os.path.basename(fname): os.path.getsize(fname)})


_BEAT_BYTES = 64 << 20   # the writer reports progress to the watchdog after each this many bytes


def _write_beating(f, name: str, a: np.ndarray):
    """``f.create_dataset(name, data=a)``, written in slabs of ``_BEAT_BYTES`` with a heartbeat after each (see
    distributed/phases.py: a slow healthy write is not a hang)."""
    if a.nbytes <= _BEAT_BYTES or a.ndim == 0 or a.shape[0] < 2:
        ds = f.create_dataset(name, data=a)
        _phases.heartbeat(a.nbytes)
        return ds
    ds = f.create_dataset(name, shape=a.shape, dtype=a.dtype)
    rows = max(1, _BEAT_BYTES // max(1, a[0].nbytes))
    for r0 in range(0, a.shape[0], rows):
        ds.write_direct(a, np.s_[r0:r0 + rows], np.s_[r0:r0 + rows])
        _phases.heartbeat(a[r0:r0 + rows].nbytes)
    return ds


def _write_collective(fname: str, g, plan: WritePlan, jobs: List[Tuple[Piece, Any]], fsync: bool) -> _Written:
    """All pieces into one ``data.h5`` through HDF5's MPI-IO driver (dataset creation is collective)."""
    import h5py
    sums = []
    with h5py.File(fname, "w", driver="mpio", comm=g.comm) as f:
        for p in plan.pieces():  # metadata operations are collective: every rank creates every dataset
            f.create_dataset(p.dset, shape=p.shape, dtype=np.dtype(plan.entries[p.entry].dtype))
        for p, arr in jobs:
            a = host_array(arr)
            sums.append(block_checksums(a, p.block_rows))
            f[p.dset].write_direct(a)
    if fsync and g.rank == 0:
        _fsync_path(fname)
    return _Written(sums, [-1] * len(sums), {})  # offsets and size unknown here: read through HDF5


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
@_trace.traced("checkpoint.save", "checkpoint")
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
    with _phases.long_phase("checkpoint.save", f"saving {os.fspath(path)}") as phase:
        return _save(phase, path, state, group, overwrite=overwrite, fsync=fsync, collective=collective)


def _save(phase, path, state: dict, group=None, *, overwrite: bool = True, fsync: bool = True,
          collective: bool = False) -> str:
    """:func:`save` inside its long phase (``phase``: None without a watchdog)."""
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
    rank = g.rank
    what = f"save to {path}"
    h5py._errors.silence_errors()   # per thread (h5py does it for the main thread only): no HDF5 error stack on stderr

    # 1. rank 0 makes the temporary directory and measures the free space once (before anyone writes)
    tmp, free, err = None, None, None
    if rank == 0:
        try:
            _check_target(path, overwrite)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
            os.mkdir(tmp)
            free = _free_bytes(tmp)
        except Exception as e:
            err = e
    tmp, free = share(g, (tmp, free), err, what)
    _phases.remove_tree_on_abort(tmp)   # a job the watchdog ends leaves no .tmp-* behind

    agreed = False  # True where a failure is raised by every rank at the same point
    try:
        # 2. plans -> who writes what (identical on every rank)
        err, mine, arrays = None, None, {}
        try:
            mine, arrays = plan_state(state, rank, g.world.debug)
        except Exception as e:
            err = e
        gathered = all_gather_object((mine, describe(err)), group=g)
        agreed = True
        raise_from([m for _, m in gathered], err, what, g)
        plans = [p for p, _ in gathered]
        check_plans(plans)
        plan = assign(plans, collective)
        folder = os.path.dirname(os.path.abspath(path))
        _check_space(folder, _needed(plan, collective), free, rank)   # the same verdict on every rank
        agreed = False
        if phase is not None:
            mine_bytes = shard_bytes(plan, plan.by_writer.get(rank, []))
            phase.detail, phase.total = f"writing {human(mine_bytes)} to {tmp}", mine_bytes

        # 3. write this rank's pieces
        err, written = None, _Written([], [], {})
        try:
            jobs = [(p, arrays[plan.entries[p.entry].name]) for p in plan.by_writer.get(rank, [])]
            jobs = [(p, a.local if isinstance(a, ShardedArray) else a) for p, a in jobs]
            _fault("before_shard", rank)
            if collective:
                written = _write_collective(os.path.join(tmp, "data.h5"), g, plan, jobs, fsync)
            elif jobs:
                with _trace.span("checkpoint.write_shard", "checkpoint"):
                    written = _write_shard(os.path.join(tmp, shard_name(rank)), jobs, rank, fsync,
                                           shard_bytes(plan, plan.by_writer[rank]))
            if plan.replicas.get(rank):
                written = written._replace(replica_sums=_replica_sums(plan, arrays, rank))
            _fault("after_shard", rank)
        except Exception as e:
            err = _no_space(os.path.dirname(os.path.abspath(path)), _needed(plan, collective), rank) if (
                _is_no_space(e) and not _ours(e)) else e
        results = gather_object((written, describe(err)), dst=0, group=g)

        # 4. rank 0: index, rename
        err2 = None
        if rank == 0:
            try:
                raise_from([m for _, m in results], err, what, g)
                file_bytes: Dict[str, int] = {}
                for r, pieces in plan.by_writer.items():
                    w = results[r][0]
                    for p, sums, off in zip(pieces, w.checksums, w.byte_offsets):
                        p.checksums, p.byte_offset = sums, off
                    file_bytes.update(w.file_bytes)
                _check_replicas(plan, results)
                _fault("before_index", rank)
                index = os.path.join(tmp, INDEX_NAME)
                reserved = []
                write_index(index, plan.entries, _attrs(g, plan.writers), file_bytes,
                            on_open=lambda: reserved.append(_reserve(index, index_bytes(plan), rank)))
                if any(reserved):
                    _trim(index)
                if fsync:
                    _fsync_path(index)
                _fault("after_index", rank)
                _commit(tmp, path, rank, fsync)
            except Exception as e:
                if err is None and _is_no_space(e) and not _ours(e):
                    e = _no_space(os.path.dirname(os.path.abspath(path)), _needed(plan, collective), rank)
                err2 = e if err is None else err
        outcome = broadcast_object(describe(err2), src=0, group=g)
        agreed = True
        if outcome is not None:
            if err is not None:
                raise err  # this rank's own error, with its traceback
            raise_from([outcome], err2, what, g)
    except BaseException:
        if rank == 0 and tmp and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if agreed and g.size > 1:
            barrier(group=g)  # every rank returns only after the temporary directory is gone
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
