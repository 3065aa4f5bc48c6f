"""In-memory checkpoints every N steps, replicated to a buddy rank on another node; restart from memory.

[Note: memory checkpoints and buddies]
Every rank keeps its state in two preallocated *slots* (double buffers): files in node-local memory
(``<AXONMPI_MEMORY_DIR>/axonmpi-<run key>/node<k>/r<rank>.<0|1>.slot``, ``/dev/shm`` by default), mapped into
the process. ``save(step, state)`` copies the state's arrays into the older slot with ``np.copyto`` (no pickle,
no HDF5 on the hot path: the slot's layout -- which array at which byte -- is made once and reused), appends the
small values (scheduler, sampler, step, this rank's RNG) as one short pickle and marks the slot complete. It then
posts a non-blocking send of the slot's bytes to its *buddy* -- the rank with the same local index on the next
node (node ``k`` -> node ``k+1 mod n``) -- which receives them straight into its own slot for this *ward*. The
exchange overlaps the next step (its forward, backward and collectives drive MPI's progress) and is completed at
the next ``save`` (or ``wait``): only then is the received slot marked complete. A slot is marked "being written"
before it is overwritten, so a crash at any moment leaves the previous step intact on both sides. Memory: four
slots per rank (its own two and its ward's two), each the size of its state.

A slot's header (64 bytes: magic, step -- -1 while being written --, array bytes, value bytes, world size,
owner, capacity) is written last. Its values pickle names the run key, owner and step, checked on load; another
run's copies live under another run key and are never seen.

:meth:`MemoryCheckpointer.find` (collective) lists the complete slots every node holds (in its own folder: the
"node" of ``AXONMPI_MEMORY_NODE_SIZE`` in tests; on real nodes every folder under the run's root, all in that
node's memory) and agrees on the newest step of which every saved rank's copy exists on some node; it returns a
:class:`~axonmpi.checkpoint.memory_load.MemoryCopy` that loads into any template, resharding as HDF5 checkpoints
do (another layout or rank count): each rank's pieces come from its own node's slots where they are there, else
over MPI from a rank whose node holds them. None when no step is complete in memory (a node and its buddy lost
together, a new run): the caller falls back to the HDF5 checkpoint (:func:`resume`, which logs which source and
step it used).

Nodes are the World's (``node_rank``); ``AXONMPI_MEMORY_NODE_SIZE=k`` makes ranks ``k*i .. k*i+k-1`` a node.
"""
from __future__ import annotations

import glob
import mmap
import os
import pickle
import re
import shutil
from typing import Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .. import backend as _be
from ..distributed.sharding import ShardedArray
from .format import flatten

__all__ = ["MemoryCheckpointer", "resume", "run_key", "node_layout"]

_NAME = re.compile(r"r(\d{5})\.([01])\.slot$")
_TAG_HDR, _TAG_BODY, _TAG_BIG = 5301, 5302, 5303
_HDR = 64                       # header bytes (8 int64)
_MAGIC = 0x41584D5331           # "AXMS1"
_ALIGN = 64
_OWN_RNG = "_axonmpi_own_rng"   # this rank's RNG state, when the state holds no gathered "rng"


def run_key(directory: str, new: bool = False) -> str:
    """The identity of the run saving into ``directory`` (made once, kept in ``.axonmpi-run-key``; collective):
    the jobs of one run share it, another run's memory copies are never taken for this one's. ``new``: a fresh run
    (``--overwrite``) takes a new key."""
    from ..distributed import broadcast_object, get_world
    key = None
    if get_world().rank == 0:
        path = os.path.join(directory, ".axonmpi-run-key")
        os.makedirs(directory, exist_ok=True)
        try:
            if new:
                raise FileNotFoundError(path)
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
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"AXONMPI_MEMORY_NODE_SIZE={k!r}: expected a number of ranks per node >= 1")
        return [r // int(k) for r in range(world.world_size)]
    return list(MPI.COMM_WORLD.allgather(world.node_rank))


def _pairs(nodes: List[int], rank: int) -> Tuple[Optional[int], Optional[int]]:
    """(buddy: the rank keeping copies of ``rank``'s slots, ward: the rank whose copies ``rank`` keeps)."""
    order = sorted(set(nodes))
    if len(order) < 2:
        return None, None
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    i, local = order.index(nodes[rank]), members[nodes[rank]].index(rank)
    nxt, prv = members[order[(i + 1) % len(order)]], members[order[(i - 1) % len(order)]]
    return (nxt[local] if local < len(nxt) else None), (prv[local] if local < len(prv) else None)


def read_header(path: str) -> Optional[np.ndarray]:
    """A slot file's header (int64[8]) when the slot is complete, else None."""
    try:
        with open(path, "rb") as f:
            h = np.frombuffer(f.read(_HDR), np.int64)
    except OSError:
        return None
    if h.size != 8 or h[0] != _MAGIC or h[1] < 0:
        return None
    return h


def _walk(d: dict, parents: tuple):
    """``flatten`` without its key checks (made by the first save of a layout)."""
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _walk(v, parents + (k,))
        else:
            yield parents + (k,), v


class _Slot:
    """One slot file mapped into memory: header + body (arrays, then the values pickle)."""

    def __init__(self, path: str, capacity: int):
        self.path, self.capacity = path, int(capacity)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != _HDR + self.capacity:
                os.ftruncate(fd, _HDR + self.capacity)
            self.mm = mmap.mmap(fd, _HDR + self.capacity)
        finally:
            os.close(fd)
        self.header = np.ndarray((8,), np.int64, buffer=self.mm)
        self.body = np.ndarray((self.capacity,), np.uint8, buffer=self.mm, offset=_HDR)
        self.views: Optional[list] = None     # typed views of the arrays' places (per layout)
        self.layout_id = None

    @property
    def step(self) -> int:
        """The step held (-1: none, or being written)."""
        return int(self.header[1]) if self.header[0] == _MAGIC else -1

    def begin(self) -> None:
        self.header[0] = _MAGIC
        self.header[1] = -1

    def commit(self, step: int, arrays: int, values: int, world: int, owner: int, index: int) -> None:
        self.header[2:8] = (arrays, values, world, owner, self.capacity, index)
        self.header[1] = step                 # last: the slot is complete

    def close(self) -> None:
        self.views = None
        self.header = self.body = None
        try:
            self.mm.close()
        except BufferError:                   # a view still alive (an MPI request): the mapping goes with it
            pass


def _array_of(leaf):
    a = leaf.local if isinstance(leaf, ShardedArray) else leaf
    return a if isinstance(a, np.ndarray) or _be.is_cupy_array(a) else None


class MemoryCheckpointer:
    """Checkpoints in node-local memory every ``every`` steps, each replicated to a buddy rank on another node.

    Collective over all ranks (made, saved, found and closed together). See the Note at the top of the module.

    Args:
        run_id: the run's identity (another run's copies are never used): :func:`run_key` of the checkpoint folder.
        root: the memory folder (default ``AXONMPI_MEMORY_DIR``, ``/dev/shm``); the copies go to
            ``<root>/axonmpi-<run_id>/node<k>``.
        every: save every this many steps (``should_save``).
        fresh: a new run: this run's memory copies left by an earlier job are removed.

    Example:
        >>> mem = MemoryCheckpointer(run_key(mgr.directory), every=1)
        >>> state, source = resume(mgr, mem, training_state(model, opt))     # memory, else HDF5
        >>> for step in ...: ...; mem.save(step, training_state(model, opt, step=step, rng=False))
        >>> mem.close()                          # a clean end removes the copies
    """

    def __init__(self, run_id: str, root: Optional[str] = None, *, every: int = 1, fresh: bool = False):
        from ..distributed import get_world
        from ..env import get_str
        self.world = get_world()
        self.rank, self.size = self.world.rank, self.world.world_size
        if isinstance(every, bool) or int(every) < 1:
            raise ValueError(f"rank {self.rank}: MemoryCheckpointer(every={every!r}): expected an int >= 1 (steps)")
        self.run_id, self.every = str(run_id), int(every)
        self.root = os.path.join(root or get_str("AXONMPI_MEMORY_DIR"), f"axonmpi-{self.run_id}")
        self.simulated = bool(get_str("AXONMPI_MEMORY_NODE_SIZE"))
        self.nodes = node_layout(self.world)
        self.buddy, self.ward = _pairs(self.nodes, self.rank)
        self.folder = os.path.join(self.root, f"node{self.nodes[self.rank]}")
        self.leader = self.rank == min(r for r, n in enumerate(self.nodes) if n == self.nodes[self.rank])
        self.comm = MPI.COMM_WORLD.Dup()
        if fresh:
            self._clear_node()
        os.makedirs(self.folder, exist_ok=True)
        self._own: List[Optional[_Slot]] = [None, None]
        self._wards: List[Optional[_Slot]] = [None, None]
        self._layout = None              # (signature, [(keys, dtype, shape, byte offset)], arrays bytes, index pickle)
        self._cap_sent = 0               # the body capacity our buddy has for us
        self._cap_ward = 0               # the body capacity we hold for our ward
        self._sends: list = []
        self._recv = None                # (header request, header array, body request or None, slot index)
        self._first = True               # the first save says how long a restart took (log_restart_time)

    # -- saving --------------------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """True every ``every`` steps."""
        return int(step) > 0 and int(step) % self.every == 0

    def _path(self, owner: int, k: int) -> str:
        return os.path.join(self.folder, f"r{owner:05d}.{k}.slot")

    def _slot(self, slots: list, owner: int, k: int, capacity: int) -> _Slot:
        s = slots[k]
        if s is None or s.capacity < capacity:
            if s is not None:
                s.close()
            s = slots[k] = _Slot(self._path(owner, k), capacity)
        return s

    def _older(self, slots: list, owner: int) -> int:
        """The slot to write next: the one not holding the newer complete step."""
        steps = []
        for k in (0, 1):
            if slots[k] is not None:
                steps.append(slots[k].step)
            else:
                h = read_header(self._path(owner, k))
                steps.append(-1 if h is None else int(h[1]))
        return 0 if steps[0] <= steps[1] else 1

    def _make_layout(self, arrays: list) -> tuple:
        sig = [(keys, a.dtype, a.shape) for keys, a, _ in arrays]
        if self._layout is not None and self._layout[0] == sig:
            return self._layout
        places, index, off = [], [], 0
        for keys, a, leaf in arrays:
            n = int(a.size) * a.dtype.itemsize
            places.append((keys, np.dtype(a.dtype), tuple(a.shape), off))
            if isinstance(leaf, ShardedArray):
                index.append((keys, "sharded", str(a.dtype), tuple(a.shape), tuple(leaf.global_shape),
                              tuple(leaf.offsets), leaf.view_shape, off))
            else:
                index.append((keys, "array", str(a.dtype), tuple(a.shape), tuple(a.shape), (0,) * a.ndim, None, off))
            off += -(-n // _ALIGN) * _ALIGN
        self._layout = (sig, places, off, pickle.dumps(index, protocol=5), id(sig))
        return self._layout

    def save(self, step: int, state: dict) -> None:
        """Copy ``state`` into this rank's older slot for ``step`` and start its replication to the buddy.

        Returns once the local copy is complete; the transfer completes at the next ``save`` or ``wait``. Pass
        ``training_state(..., rng=False)``: each rank's own RNG state is kept (no collective on the hot path)."""
        self._complete()
        step = int(step)
        arrays, values = [], []
        for keys, leaf in (_walk(state, ()) if self._layout is not None else flatten(state, self.rank)):
            a = _array_of(leaf)
            if a is None:
                values.append((keys, leaf))
            else:
                arrays.append((keys, a, leaf))
        if "rng" not in state:
            from .. import random as _random
            values.append(((_OWN_RNG,), _random.get_rng_state()))
        sig, places, nbytes, index, lid = self._make_layout(arrays)
        meta = index + pickle.dumps({"run_id": self.run_id, "owner": self.rank, "step": step,
                                     "world_size": self.size, "values": values}, protocol=5)
        need = nbytes + len(meta)
        k = self._older(self._own, self.rank)
        cap = self._own[k].capacity if self._own[k] is not None else 0
        slot = self._slot(self._own, self.rank, k, need if need <= cap else nbytes + 2 * len(meta) + 4096)
        slot.begin()
        if slot.layout_id != lid:
            slot.views = [slot.body[o:o + int(np.prod(shape, dtype=np.int64)) * dt.itemsize].view(dt).reshape(shape)
                          for _, dt, shape, o in places]
            slot.layout_id = lid
        for (_, a, _), view in zip(arrays, slot.views):
            if isinstance(a, np.ndarray):
                np.copyto(view, a)
            else:
                a.get(out=view)
        slot.body[nbytes:need] = np.frombuffer(meta, np.uint8)
        slot.commit(step, nbytes, len(meta), self.size, self.rank, len(index))
        self._exchange(slot, step, nbytes, len(meta))
        if self._first:
            self._first = False
            log_restart_time(None, f"the first step after it (step {step}) is done")

    def _exchange(self, slot: _Slot, step: int, nbytes: int, nmeta: int) -> None:
        """Post the non-blocking send of ``slot`` to the buddy and the receive of the ward's into our older slot."""
        if self.ward is not None:
            k = self._older(self._wards, self.ward)
            hdr = np.zeros(9, np.int64)
            hreq = self.comm.Irecv([hdr, MPI.INT64_T], source=self.ward, tag=_TAG_HDR)
            breq = None
            if self._cap_ward:
                w = self._slot(self._wards, self.ward, k, self._cap_ward)
                w.begin()
                breq = self.comm.Irecv([w.body[:self._cap_ward], MPI.BYTE], source=self.ward, tag=_TAG_BODY)
            self._recv = (hreq, hdr, breq, k)
        if self.buddy is not None:
            need = nbytes + nmeta
            big = need > self._cap_sent
            if big:
                self._cap_sent = slot.capacity
            head = np.array([step, nbytes, nmeta, self.size, self.rank, self._cap_sent, need, int(big),
                             len(self._layout[3])], np.int64)
            self._sends = [self.comm.Isend([head, MPI.INT64_T], dest=self.buddy, tag=_TAG_HDR),
                           self.comm.Isend([slot.body[:need], MPI.BYTE], dest=self.buddy,
                                           tag=_TAG_BIG if big else _TAG_BODY), head]

    def _complete(self, commit: bool = True) -> None:
        """Complete the exchange in flight: the ward's copy is received and marked complete, our send done."""
        if self._recv is not None:
            hreq, hdr, breq, k = self._recv
            self._recv = None
            hreq.Wait()
            step, nbytes, nmeta, world, owner, cap, need, big, nindex = (int(v) for v in hdr)
            if big:
                if breq is not None:
                    breq.Cancel()
                    breq.Wait()
                self._cap_ward = cap
                w = self._slot(self._wards, self.ward, k, cap)
                w.begin()
                self.comm.Recv([w.body[:need], MPI.BYTE], source=self.ward, tag=_TAG_BIG)
            else:
                breq.Wait()
                w = self._wards[k]
            if commit:
                w.commit(step, nbytes, nmeta, world, owner, nindex)
        if self._sends:
            MPI.Request.Waitall(self._sends[:2])
            self._sends = []

    def wait(self) -> None:
        """Complete the copies in flight (the exchange with the buddy)."""
        self._complete()

    def abandon(self) -> None:
        """What a job that dies leaves (in-process tests of a lost node): the transfers in flight finish, the received
        copy is not marked complete, the slots are unmapped (collective with the buddy and ward)."""
        self._complete(commit=False)
        for s in self._own + self._wards:
            if s is not None:
                s.close()
        self._own, self._wards = [None, None], [None, None]
        self.comm.Free()

    # -- finding and loading -------------------------------------------------------------------------------
    def _folders(self) -> List[str]:
        """The memory folders this rank's node holds: its own (simulated nodes), every one under the root (real)."""
        if self.simulated:
            return [self.folder]
        return sorted(glob.glob(os.path.join(self.root, "node*")))

    def holdings(self) -> List[Tuple[int, int, int, str]]:
        """``(owner, step, saved world size, path)`` of every complete slot this rank's node holds."""
        out = []
        for folder in self._folders():
            for p in glob.glob(os.path.join(folder, "r*.slot")):
                m = _NAME.search(p)
                h = read_header(p) if m else None
                if h is not None and int(h[5]) == int(m.group(1)):
                    out.append((int(m.group(1)), int(h[1]), int(h[4]), p))
        return out

    def find(self):
        """The newest step of which every saved rank's copy is in some node's memory, as a
        :class:`~axonmpi.checkpoint.memory_load.MemoryCopy` (load it into a template); None when there is none.
        Collective."""
        from .memory_load import MemoryCopy
        self.wait()
        held = self.comm.allgather(self.holdings())
        where: Dict[Tuple[int, int], Dict[int, List[Tuple[int, str]]]] = {}
        for r, lst in enumerate(held):
            for owner, step, world, path in lst:
                where.setdefault((step, world), {}).setdefault(owner, []).append((r, path))
        for step, world in sorted(where, reverse=True):
            owners = where[(step, world)]
            if all(o in owners for o in range(world)):
                load: Dict[int, int] = {}
                serve = {}
                for o in range(world):       # the owner's own rank where its node holds it, else the least loaded
                    cands = sorted(owners[o], key=lambda rp: (rp[0] != o, load.get(rp[0], 0), rp[0]))
                    serve[o] = cands[0]
                    load[cands[0][0]] = load.get(cands[0][0], 0) + 1
                copy = MemoryCopy(self, step, world, serve)
                copy._open()                 # collective: the served slots mapped, every index shared
                return copy
        return None

    def restore(self, state: Optional[dict] = None) -> Optional[Tuple[int, dict]]:
        """``(step, state)`` from the newest step complete in memory; None when none is (collective). ``state`` is
        filled in place as :func:`axonmpi.checkpoint.load` fills a template."""
        copy = self.find()
        if copy is None:
            return None
        return copy.step, copy.load(state)

    def discard_after(self, step: int) -> None:
        """Remove this node's copies of steps after ``step`` (a resume from ``step``: they belong to a lost future;
        collective)."""
        self.wait()
        self.comm.Barrier()
        if self.leader:
            for owner, s, _, path in self.holdings():
                if s > int(step):
                    try:
                        os.remove(path)
                    except FileNotFoundError:
                        pass
        self.comm.Barrier()

    def _clear_node(self) -> None:
        self.comm.Barrier()
        if self.leader:
            for folder in self._folders():
                shutil.rmtree(folder, ignore_errors=True)
        self.comm.Barrier()

    def memory_bytes(self) -> int:
        """Bytes of this rank's slots (its own and its ward's) in node memory."""
        return sum(_HDR + s.capacity for s in self._own + self._wards if s is not None)

    def close(self, remove: bool = True) -> None:
        """Complete the copies in flight; with ``remove`` (a clean end) delete this run's memory folders
        (collective)."""
        self.wait()
        for s in self._own + self._wards:
            if s is not None:
                s.close()
        self._own, self._wards = [None, None], [None, None]
        if remove:
            self._clear_node()
            if self.leader:
                try:
                    os.rmdir(self.root)      # the last node folder gone (each real node has its own root)
                except OSError:
                    pass
        self.comm.Free()


def resume(mgr, mem: Optional[MemoryCheckpointer], state: dict, log=None, **kw) -> Tuple[Optional[dict], str]:
    """Restore ``state`` from memory when every rank's copy of a step at least as new as ``mgr``'s newest HDF5
    checkpoint is there, else from that checkpoint (collective). Returns ``(loaded state or None, "memory step N" |
    "hdf5 step N" | "none")``; logs which. Keyword arguments go to ``mgr.load_latest``. Also
    ``mgr.load_latest(state, memory=mem)``."""
    from ..log import get_logger
    log = log or get_logger(__name__)
    log_restart_time(log)
    src = pick_source(mgr, mem, log)
    if src is not None:
        out = src.load(state)
        src.close()
        step = src.step
        log.info("resumed from memory: step %d (%s)", step, src)
        mem.discard_after(step)
        return out, f"memory step {step}"
    out = mgr.load_latest(state, **kw)
    if out is None:
        return None, "none"
    step = (out.get("meta") or {}).get("step")
    log.info("resumed from HDF5: step %s (%s)", step, mgr.latest())
    if mem is not None and step is not None:
        mem.discard_after(int(step))
    return out, f"hdf5 step {step}"


def pick_source(mgr, mem: Optional[MemoryCheckpointer], log=None):
    """The memory copy to resume from (a ``MemoryCopy``) when its step is at least ``mgr``'s newest HDF5 step, else
    None (collective); says why it is not used."""
    from ..distributed import broadcast_object
    from ..log import get_logger
    log = log or get_logger(__name__)
    if mem is None:
        return None
    src = mem.find()
    newest = broadcast_object(mgr.latest_step() if mem.rank == 0 else None) if mgr is not None else None
    if src is None:
        log.warning("no step is complete in node memory (a node and its buddy lost together, or a new run): "
                    "falling back to the HDF5 checkpoint%s", "" if newest is None else f" (step {newest})")
        return None
    if newest is not None and newest > src.step:
        log.info("the HDF5 checkpoint of step %d is newer than the memory copy of step %d: resuming from HDF5",
                 newest, src.step)
        src.close()
        return None
    return src


def log_restart_time(log, what: str = "resuming") -> None:
    """Say how long the restart took since the failed job step (``AXONMPI_FAILED_AT``, set by jobs/requeue.sh):
    at the resume and after the first new step (``MemoryCheckpointer.save``)."""
    import time
    from ..log import get_logger
    failed = os.environ.get("AXONMPI_FAILED_AT")
    if failed:
        try:
            (log or get_logger(__name__, rank0_only=True)).info(
                "restart %s inside the allocation: %s %.1f s after the failed job step",
                os.environ.get("AXONMPI_RESTART", "?"), what, time.time() - float(failed))
        except ValueError:
            pass
