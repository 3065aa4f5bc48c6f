"""In-memory checkpoints every N steps, replicated to a buddy rank on another node; restart from memory.

[Note: memory checkpoints and buddies]
``MemoryCheckpointer.save(step, state)`` copies this rank's state (its ``ShardedArray`` blocks, arrays and
values, as ``training_state`` gives them) into one blob, writes it into node-local memory
(``<root>/node<k>/``, ``/dev/shm/axonmpi-<run id>`` by default) on a background thread, and sends the same
bytes to its *buddy*: the rank with the same local index on the next node (ranks ``r`` of node ``k`` ->
node ``k+1 mod n``), which writes them into its node's folder. Sends and receives are non-blocking; they
are completed (and the received blob written, again on the background thread) at the next ``save`` or at
``wait()``, so the copy overlaps the steps between. Files are written to a temporary name and renamed
when complete; the newest two complete steps of each rank are kept (the previous one stays intact until
the new one is complete on both sides).

``restore(state)`` (collective; the same world size as the save) lists, on every rank, the blobs its node
holds for itself and for the rank it keeps copies of; the ranks agree on the newest step whose every
rank's blob exists on some node; a rank whose node lost its copy receives it from its buddy. Every blob
carries the run id, its rank, step and a CRC-32, checked before use. It returns None when no step is
complete in memory (two buddies lost together, another world size, a new run): the caller falls back to
the HDF5 checkpoint (:func:`resume`, which logs which source and step it used).

Nodes are the World's (``node_rank``); ``AXONMPI_MEMORY_NODE_SIZE=k`` makes ranks ``k*i .. k*i+k-1`` a
"node" (tests on one machine).
"""
from __future__ import annotations

import glob
import os
import pickle
import re
import shutil
import threading
import zlib
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .. import backend as _be
from ..distributed.sharding import ShardedArray
from .format import CheckpointError, flatten, unflatten

__all__ = ["MemoryCheckpointer", "resume", "run_key", "node_layout"]

_NAME = re.compile(r"r(\d{5})-s(\d{9})\.blob$")
_TAG_SIZE, _TAG_DATA = 5301, 5302


def run_key(directory: str) -> str:
    """The identity of the run saving into ``directory`` (made once, kept in ``.axonmpi-run-key``; collective):
    the jobs of one run share it, another run's memory copies are never taken for this one's."""
    from ..distributed import broadcast_object, get_world
    key = None
    if get_world().rank == 0:
        path = os.path.join(directory, ".axonmpi-run-key")
        os.makedirs(directory, exist_ok=True)
        try:
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except FileNotFoundError:
            import uuid
            key = uuid.uuid4().hex[:16]
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(key + "\n")
            os.replace(path + ".tmp", path)
    return broadcast_object(key)


def node_layout(world) -> List[int]:
    """The node index of every world rank (``AXONMPI_MEMORY_NODE_SIZE=k``: rank // k)."""
    from ..env import get_str
    k = get_str("AXONMPI_MEMORY_NODE_SIZE")
    if k:
        return [r // int(k) for r in range(world.world_size)]
    return list(MPI.COMM_WORLD.allgather(world.node_rank))


def _pairs(nodes: List[int], rank: int) -> Tuple[Optional[int], Optional[int]]:
    """(buddy: the rank keeping copies of ``rank``'s blobs, ward: the rank whose copies ``rank`` keeps)."""
    order = sorted(set(nodes))
    if len(order) < 2:
        return None, None
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    i, local = order.index(nodes[rank]), members[nodes[rank]].index(rank)
    nxt, prv = members[order[(i + 1) % len(order)]], members[order[(i - 1) % len(order)]]
    return (nxt[local] if local < len(nxt) else None), (prv[local] if local < len(prv) else None)


def _blob(state: dict, rank: int, step: int, run_id: str) -> bytes:
    """This rank's state as one pickle (the copy: arrays are copied into it once; its CRC-32 is added by the
    background thread that writes it, see ``_write``)."""
    items = []
    for keys, leaf in flatten(state, rank):
        if isinstance(leaf, ShardedArray):
            leaf = ("sharded", _be.to_host(leaf.local), tuple(leaf.global_shape), tuple(leaf.offsets))
        elif isinstance(leaf, np.ndarray) or _be.is_cupy_array(leaf):
            leaf = ("array", _be.to_host(leaf))
        else:
            leaf = ("value", leaf)
        items.append((keys, leaf))
    return pickle.dumps({"run_id": run_id, "rank": rank, "step": step, "items": items}, protocol=5)


def _open_blob(data: bytes, run_id: str, rank: int, step: int, where: str) -> list:
    """The items of a stored blob (``data``: the pickle and its CRC-32), checked."""
    body, crc = memoryview(data)[:-4], int.from_bytes(data[-4:], "little")
    if zlib.crc32(body) != crc:
        raise CheckpointError(f"memory checkpoint {where} is damaged (CRC-32 mismatch)")
    doc = pickle.loads(body)
    if (doc["run_id"], doc["rank"], doc["step"]) != (run_id, rank, step):
        raise CheckpointError(f"memory checkpoint {where} holds run {doc['run_id']} rank {doc['rank']} step "
                              f"{doc['step']}, not run {run_id} rank {rank} step {step}")
    return doc["items"]


def _fill(template: Optional[dict], items: list, rank: int) -> dict:
    """The saved leaves, copied into ``template``'s arrays in place where it has them."""
    have = dict(flatten(template, rank)) if template is not None else {}
    out = []
    for keys, (kind, *v) in items:
        t = have.get(tuple(keys))
        if kind == "sharded":
            if isinstance(t, ShardedArray):
                np.copyto(t.local, v[0])
            else:
                t = ShardedArray(v[0], v[1], v[2])
        elif kind == "array":
            if isinstance(t, np.ndarray) and t.shape == v[0].shape:
                np.copyto(t, v[0])
            else:
                t = v[0]
        else:
            t = v[0]
        out.append((keys, t))
    return unflatten(out)


class MemoryCheckpointer:
    """Checkpoints in node-local memory every ``every`` steps, each replicated to a buddy rank on another node.

    Collective over all ranks (made, saved, restored and closed together). See the Note at the top.

    Args:
        run_id: the run's identity (blobs of another run are never used): :func:`run_key` of the checkpoint folder.
        root: the memory folder (default ``/dev/shm/axonmpi-<run_id>``; ``AXONMPI_MEMORY_DIR`` sets it).
        every: save every this many steps (``should_save``).

    Example:
        >>> mem = MemoryCheckpointer(run_key(mgr.directory), every=1)
        >>> state, source = resume(mgr, mem, training_state(model, opt))     # memory, else HDF5
        >>> for step in ...: ...; mem.save(step, training_state(model, opt, step=step))
        >>> mem.close()                          # a clean end removes the copies
    """

    def __init__(self, run_id: str, root: Optional[str] = None, *, every: int = 1):
        from ..distributed import get_world
        self.world = get_world()
        self.rank, self.size = self.world.rank, self.world.world_size
        self.run_id, self.every = str(run_id), max(1, int(every))
        from ..env import get_str
        base = root or get_str("AXONMPI_MEMORY_DIR")
        self.root = os.path.join(base, f"axonmpi-{self.run_id}-w{self.size}")   # another world size: not found
        self.nodes = node_layout(self.world)
        self.buddy, self.ward = _pairs(self.nodes, self.rank)
        self.folder = os.path.join(self.root, f"node{self.nodes[self.rank]}")
        os.makedirs(self.folder, exist_ok=True)
        self.comm = MPI.COMM_WORLD.Dup()
        self._thread: Optional[threading.Thread] = None
        self._pending: list = []       # (requests, what to write when they complete)
        self.last_source = None

    def should_save(self, step: int) -> bool:
        """True every ``every`` steps."""
        return int(step) > 0 and int(step) % self.every == 0

    def _path(self, owner: int, step: int) -> str:
        return os.path.join(self.folder, f"r{owner:05d}-s{step:09d}.blob")

    def _write(self, owner: int, step: int, data: bytes) -> None:
        """Write ``owner``'s blob of ``step`` with its CRC-32, then drop its blobs older than the previous one."""
        tmp = self._path(owner, step) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.write(zlib.crc32(data).to_bytes(4, "little"))
        os.replace(tmp, self._path(owner, step))
        for old in sorted(self._steps(owner))[:-2]:
            try:
                os.remove(self._path(owner, old))
            except FileNotFoundError:
                pass

    def _write_all(self, jobs: list) -> None:
        for job in jobs:
            self._write(*job)

    def _steps(self, owner: int) -> List[int]:
        out = []
        for p in glob.glob(os.path.join(self.folder, f"r{owner:05d}-s*.blob")):
            m = _NAME.search(p)
            if m:
                out.append(int(m.group(2)))
        return out

    def save(self, step: int, state: dict) -> None:
        """Copy ``state`` into memory for ``step`` and start its replication to the buddy (returns at once:
        the writes run on a background thread, the transfer completes at the next ``save`` or ``wait``)."""
        self._join()
        jobs = self._received()
        step = int(step)
        data = _blob(state, self.rank, step, self.run_id)
        if self.buddy is not None:
            size_in = np.zeros(1, np.int64)
            self.comm.Sendrecv(np.array([len(data)], np.int64), dest=self.buddy, sendtag=_TAG_SIZE,
                               recvbuf=size_in, source=self.ward, recvtag=_TAG_SIZE)
            incoming = bytearray(int(size_in[0]))
            reqs = [self.comm.Isend([data, MPI.BYTE], dest=self.buddy, tag=_TAG_DATA),
                    self.comm.Irecv([incoming, MPI.BYTE], source=self.ward, tag=_TAG_DATA)]
            self._pending = [(reqs, self.ward, step, incoming, data)]
        self._thread = threading.Thread(target=self._write_all, args=([(self.rank, step, data)] + jobs,),
                                        name=f"axonmpi-memckpt-{step}", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _received(self) -> list:
        """Complete the exchange in flight; the (ward, step, bytes) writes it leaves to do."""
        jobs = []
        for reqs, ward, step, incoming, _ in self._pending:
            MPI.Request.Waitall(reqs)
            jobs.append((ward, step, incoming))
        self._pending = []
        return jobs

    def wait(self) -> None:
        """Complete the copies in flight: the local write, the exchange with the buddy and the received blob's write."""
        self._join()
        self._write_all(self._received())

    def restore(self, state: Optional[dict] = None) -> Optional[Tuple[int, dict]]:
        """``(step, state)`` from the newest step every rank's blob is in some node's memory; None when none is
        (collective). ``state`` is filled in place as :func:`axonmpi.checkpoint.load` fills a template."""
        self.wait()
        mine = {o: sorted(self._steps(o)) for o in {self.rank, self.ward} if o is not None}
        held = self.comm.allgather(mine)
        where: Dict[Tuple[int, int], int] = {}          # (owner, step) -> the rank serving it
        for r, d in enumerate(held):
            for o, steps in d.items():
                for s in steps:
                    if where.get((o, s)) != o:            # prefer the owner's own copy
                        where[(o, s)] = r
        steps = sorted({s for _, s in where}, reverse=True)
        step = next((s for s in steps if all((o, s) in where for o in range(self.size))), None)
        if step is None:
            return None
        data = None
        if where[(self.rank, step)] == self.rank:
            with open(self._path(self.rank, step), "rb") as f:
                data = f.read()
        for o in range(self.size):                       # serve the ranks whose copy only this node holds
            if o != self.rank and where[(o, step)] == self.rank:
                with open(self._path(o, step), "rb") as f:
                    blob = f.read()
                self.comm.send(len(blob), dest=o, tag=_TAG_SIZE)
                self.comm.Send([blob, MPI.BYTE], dest=o, tag=_TAG_DATA)
        if data is None:
            src = where[(self.rank, step)]
            n = self.comm.recv(source=src, tag=_TAG_SIZE)
            buf = bytearray(n)
            self.comm.Recv([buf, MPI.BYTE], source=src, tag=_TAG_DATA)
            data = bytes(buf)
            self.last_source = f"rank {src}'s node (buddy copy)"
            self._write(self.rank, step, data[:-4])      # this node holds its own copy again
        else:
            self.last_source = "this node"
        items = _open_blob(data, self.run_id, self.rank, step, f"of rank {self.rank} step {step}")
        return step, _fill(state, items, self.rank)

    def close(self, remove: bool = True) -> None:
        """Complete the copies in flight; with ``remove`` (a clean end) delete this run's memory folder (collective)."""
        self.wait()
        self.comm.Barrier()
        leader = self.rank == min(r for r, n in enumerate(self.nodes) if n == self.nodes[self.rank])
        if remove and leader:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.comm.Barrier()
        if remove and leader:
            try:
                os.rmdir(self.root)      # the last node folder gone (each real node has its own root)
            except OSError:
                pass
        self.comm.Free()


def resume(mgr, mem: Optional[MemoryCheckpointer], state: dict, log=None) -> Tuple[Optional[dict], str]:
    """Restore ``state`` from memory when every rank's copy of one step is there, else from ``mgr``'s newest HDF5
    checkpoint (collective). Returns ``(loaded state or None, "memory step N" | "hdf5 step N" | "none")``; logs
    which."""
    import time
    from ..log import get_logger
    log = log or get_logger(__name__)
    failed = os.environ.get("AXONMPI_FAILED_AT")      # set by jobs/requeue.sh when it restarts a failed job step
    if failed:
        log.info("restart %s inside the allocation: %.1f s from the failed job step to this resume",
                 os.environ.get("AXONMPI_RESTART", "?"), time.time() - float(failed))
    got = mem.restore(state) if mem is not None else None
    if got is not None:
        step, out = got
        log.info("resumed from memory: step %d (this rank's copy from %s)", step, mem.last_source)
        return out, f"memory step {step}"
    if mem is not None:
        log.warning("no step is complete in memory (a node and its buddy lost together, or a new run): "
                    "falling back to the HDF5 checkpoint")
    out = mgr.load_latest(state)
    if out is None:
        return None, "none"
    step = out.get("step", (out.get("meta") or {}).get("step")) if isinstance(out, dict) else None
    log.info("resumed from HDF5: step %s (%s)", step, mgr.latest())
    return out, f"hdf5 step {step}"
