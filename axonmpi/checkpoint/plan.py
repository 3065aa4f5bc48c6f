"""Save plans as data: each rank's view of its state, the cross-rank checks, and who writes which block.

[Note: who writes what]
Every rank flattens its state into a list of :class:`EntryPlan` (small, picklable); one
all-gather gives every rank every list, and :func:`assign` — a pure function, identical on
every rank — decides the pieces: each distinct block of a ShardedArray is written by the
lowest group rank holding it; each plain array (replicated over the group) is written once,
by the rank with the fewest bytes so far (largest arrays first), so replicated state is spread
over the ranks too. Small values go in the index. The result is a :class:`WritePlan`, which
can be printed and tested without MPI.

[Note: replicas of a ShardedArray block]
Several ranks may hold the same block (a tensor-parallel shard replicated over the data ranks):
one writes it, and every other holder is listed in ``WritePlan.replicas``. Those ranks checksum
their copy while the writers write (the same per-block xxh3 the writer records), send the sums
with their "done" message, and group rank 0 compares them with the writer's before it writes the
index: replicas that differ (a rank that diverged) fail the save on every rank, naming the entry,
the block and the ranks, instead of silently keeping the lowest rank's copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from .. import backend as _be
from ..distributed.sharding import ShardedArray
from .checksum import block_rows, xxh3_64
from .format import ARRAY_KINDS, CheckpointError, Entry, Piece, encode_value, flatten, key_name, shard_name

__all__ = ["Block", "EntryPlan", "Replica", "WritePlan", "plan_state", "check_plans", "assign", "host_array"]


class Block(NamedTuple):
    """Where a ShardedArray's block sits in its global array."""

    offsets: Tuple[int, ...]
    shape: Tuple[int, ...]


class EntryPlan(NamedTuple):
    """One leaf of one rank's state, as the planner sees it.

    ``block`` is the rank's :class:`Block` for a ShardedArray (None otherwise); ``value`` the JSON
    value of a small-value leaf; ``digest`` the xxh3 hash of a plain array's bytes (always: the
    plans are exchanged in one collective, so every save proves that plain arrays are replicated).
    """

    name: str
    keys: Tuple
    kind: str            # "array" | "value"
    pytype: str          # array: "ndarray" | "sharded" | "npscalar"; value: "int", "str", ...
    dtype: Optional[str]
    shape: Tuple[int, ...]
    block: Optional[Block] = None
    value: Any = None
    digest: Optional[int] = None
    view_shape: Optional[Tuple[int, ...]] = None  # a flattened array's own shape (ShardedArray.view_shape)

    @property
    def signature(self) -> Tuple:
        """What all ranks must agree on: kind, Python type, dtype and global shape."""
        return (self.kind, self.pytype, self.dtype, self.shape)


class Replica(NamedTuple):
    """A ShardedArray block a rank holds but does not write: ``owner`` writes the same block."""

    entry: int
    block: Block
    owner: int


@dataclass
class WritePlan:
    """The entries (with their pieces, checksums still empty), per writer the pieces it writes, and
    per rank the blocks it holds as a replica of another rank's (see the note on replicas)."""

    entries: List[Entry]
    by_writer: Dict[int, List[Piece]]
    replicas: Dict[int, List[Replica]] = field(default_factory=dict)

    @property
    def writers(self) -> List[int]:
        """Group ranks that write at least one piece."""
        return sorted(self.by_writer)

    def pieces(self) -> List[Piece]:
        """All pieces, in index order."""
        return [p for e in self.entries for p in e.pieces]

    def __str__(self) -> str:
        lines = []
        for r in self.writers:
            for p in self.by_writer[r]:
                lines.append(f"rank {r} -> {p.file}:{p.dset} offsets {p.offsets} shape {p.shape}")
        return "\n".join(lines)


def host_array(a: Any) -> np.ndarray:
    """``a`` as a C-contiguous host NumPy array (copied from the device or made contiguous if needed)."""
    a = np.asarray(_be.to_host(a))  # not ascontiguousarray: it makes 0-d arrays 1-d
    return a if a.flags.c_contiguous else a.copy(order="C")


def plan_state(state: dict, rank: int, debug: bool = False) -> Tuple[List[EntryPlan], Dict[str, Any]]:
    """This rank's plan of ``state`` and its arrays by entry name (the arrays stay local).

    Every plain array gets its xxh3 digest (``debug`` is accepted and changes nothing: the
    replication check is always on; ``bench/checkpoint.py`` prints its cost).

    Example:
        >>> plans, arrays = plan_state({"w": np.ones(3), "step": 7}, rank=0)
        >>> [(p.name, p.kind) for p in plans]
        [('w', 'array'), ('step', 'value')]
    """
    plans: List[EntryPlan] = []
    arrays: Dict[str, Any] = {}
    for keys, v in flatten(state, rank):
        name = key_name(keys)
        where = f"state[{']['.join(repr(k) for k in keys)}]"
        if isinstance(v, ShardedArray):
            arr, pytype, block = v.local, "sharded", Block(v.offsets, v.local_shape)
            shape, view = v.global_shape, v.view_shape
        elif isinstance(v, (np.ndarray, np.generic)) or _be.is_cupy_array(v):
            arr, pytype, block = v, ("npscalar" if isinstance(v, np.generic) else "ndarray"), None
            shape, view = tuple(int(s) for s in np.shape(v)), None
        else:
            pytype, value = encode_value(v, where, rank)
            plans.append(EntryPlan(name, keys, "value", pytype, None, (), value=value))
            continue
        dt = np.dtype(arr.dtype)
        if dt.kind not in ARRAY_KINDS or dt.names is not None:
            raise TypeError(
                f"rank {rank}: {where} has dtype {dt}; checkpoints store bool, int, uint, float and "
                "complex arrays (store strings as str values)"
            )
        digest = xxh3_64(host_array(arr).reshape(-1).view(np.uint8)) if block is None else None
        arrays[name] = arr
        plans.append(EntryPlan(name, keys, "array", pytype, dt.str, shape, block, None, digest, view))
    return plans, arrays


def check_plans(plans: List[List[EntryPlan]]) -> None:
    """Raise :class:`CheckpointError` naming every entry the ranks disagree on (names, types, shapes)."""
    ref = plans[0]
    problems = []
    ref_names = [p.name for p in ref]
    for rank, plan in enumerate(plans[1:], 1):
        names = [p.name for p in plan]
        if names != ref_names:
            only_here = sorted(set(names) - set(ref_names))
            only_ref = sorted(set(ref_names) - set(names))
            problems.append(
                f"rank {rank} has entries {only_here} that rank 0 lacks and lacks {only_ref}"
                if (only_here or only_ref) else f"rank {rank} lists the entries in another order"
            )
            continue
        for a, b in zip(ref, plan):
            if a.signature != b.signature:
                problems.append(f"entry {a.name!r}: rank 0 has {a.pytype} {a.dtype} {a.shape}, "
                                f"rank {rank} has {b.pytype} {b.dtype} {b.shape}")
            elif a.digest is not None and a.digest != b.digest:
                problems.append(f"entry {a.name!r}: plain array differs between rank 0 and rank {rank} "
                                "(plain arrays must be replicated; wrap per-rank data in ShardedArray)")
    if problems:
        raise CheckpointError("ranks disagree on the checkpoint state: " + "; ".join(problems))


def _overlap(blocks: List[Block]) -> Optional[Tuple[int, int]]:
    if len(blocks) < 2 or not blocks[0].offsets:
        return None
    lo = np.array([b.offsets for b in blocks], np.int64)
    hi = lo + np.array([b.shape for b in blocks], np.int64)
    ov = np.all((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :]), axis=2)
    np.fill_diagonal(ov, False)
    if ov.any():
        i, j = np.argwhere(ov)[0]
        return int(i), int(j)
    return None


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _owners(i: int, e: Entry, plans: List[List[EntryPlan]],
            replicas: Optional[Dict[int, List[Replica]]] = None) -> Dict[Block, int]:
    """The distinct blocks of sharded entry ``i`` and the lowest rank holding each; checks the tiling.

    Ranks holding a block another (lower) rank holds are added to ``replicas``."""
    owner: Dict[Block, int] = {}
    for r, plan in enumerate(plans):
        b = plan[i].block
        if _size(b.shape):
            key = Block(tuple(b.offsets), tuple(b.shape))
            first = owner.setdefault(key, r)
            if first != r and replicas is not None:
                replicas.setdefault(r, []).append(Replica(i, key, first))
    blocks = list(owner)
    bad = _overlap(blocks)
    if bad is not None:
        a, b = blocks[bad[0]], blocks[bad[1]]
        raise CheckpointError(
            f"entry {e.name!r}: the blocks of ranks {owner[a]} (offsets {a.offsets}, shape {a.shape}) and "
            f"{owner[b]} (offsets {b.offsets}, shape {b.shape}) overlap without being equal"
        )
    covered = sum(_size(b.shape) for b in blocks)
    if covered != _size(e.shape):
        raise CheckpointError(
            f"entry {e.name!r}: the ranks' blocks cover {covered} of the {_size(e.shape)} elements of global "
            f"shape {tuple(e.shape)}; ShardedArray blocks must tile the global array"
        )
    return owner


def assign(plans: List[List[EntryPlan]], collective: bool = False) -> WritePlan:
    """Decide who writes which block (see the note at the top of this module).

    Args:
        plans: every rank's plan, in group-rank order (already agreed by :func:`check_plans`).
        collective: one shared ``data.h5`` (datasets ``r<writer>/<name>``) instead of a shard per rank.

    Returns:
        The :class:`WritePlan`; identical on every rank given the same ``plans``.

    Example:
        >>> p0, _ = plan_state({"w": ShardedArray(np.ones(2), (3,), (0,))}, 0)
        >>> p1, _ = plan_state({"w": ShardedArray(np.ones(1), (3,), (2,))}, 1)
        >>> print(assign([p0, p1]))
        rank 0 -> shard-00000.h5:w offsets (0,) shape (2,)
        rank 1 -> shard-00001.h5:w offsets (2,) shape (1,)
    """
    nranks = len(plans)
    entries: List[Entry] = []
    replicas: Dict[int, List[Replica]] = {}
    load = [0] * nranks
    replicated: List[int] = []
    placed: List[Tuple[int, Piece]] = []  # (writer, piece)

    def piece(i: int, e: Entry, writer: int, b: Block) -> Piece:
        dset = e.name if not collective else f"r{writer:05d}/{e.name}"
        fname = shard_name(writer) if not collective else "data.h5"
        return Piece(i, fname, dset, tuple(b.offsets), tuple(b.shape),
                     block_rows(b.shape, np.dtype(e.dtype).itemsize), [])

    for i, p in enumerate(plans[0]):
        e = Entry(tuple(p.keys), p.kind, p.pytype, p.dtype, tuple(p.shape), p.value, view_shape=p.view_shape)
        entries.append(e)
        if p.kind != "array" or _size(p.shape) == 0:
            continue
        if p.pytype != "sharded":
            replicated.append(i)
            continue
        for b, r in _owners(i, e, plans, replicas).items():
            placed.append((r, piece(i, e, r, b)))
            load[r] += _size(b.shape) * np.dtype(p.dtype).itemsize
    replicated.sort(key=lambda i: -entries[i].nbytes)
    for i in replicated:
        r = int(np.argmin(load))
        e = entries[i]
        placed.append((r, piece(i, e, r, Block((0,) * len(e.shape), e.shape))))
        load[r] += e.nbytes
    placed.sort(key=lambda wp: (wp[1].entry, wp[0]))
    by_writer: Dict[int, List[Piece]] = {}
    for r, pc in placed:
        entries[pc.entry].pieces.append(pc)
        by_writer.setdefault(r, []).append(pc)
    return WritePlan(entries, by_writer, replicas)
