"""Load an in-memory checkpoint (``MemoryCheckpointer.find``) into any template, resharding like an HDF5 load.

Every rank that serves a saved rank's slot maps it and shares its index (which array at which byte, with its
global shape and offsets) and values; every rank lists the boxes its template needs (a ``ShardedArray``'s block,
a whole array); every rank then computes the same plan -- for each box, the saved pieces that cover it, taken
from the requesting rank's own node where they are there -- and the pieces move with ``np.copyto`` (same node)
or one message per pair of ranks. The template's arrays are filled in place, as :func:`axonmpi.checkpoint.load`
fills them; values are the saved ones; ``rng`` is rebuilt from every saved rank's own state.
"""
from __future__ import annotations

import json
import math
import mmap
import pickle
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .. import backend as _be
from ..distributed.sharding import ShardedArray
from .format import CheckpointError, CheckpointMismatchError, flatten, key_name, unflatten

__all__ = ["MemoryCopy"]

_TAG_MOVE = 5311


def _box_and(ao, ash, bo, bsh) -> Optional[Tuple[tuple, tuple]]:
    lo = tuple(max(a, b) for a, b in zip(ao, bo))
    hi = tuple(min(a + m, b + n) for a, m, b, n in zip(ao, ash, bo, bsh))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _vol(shape) -> int:
    return math.prod(shape)


def _rel(box_off, off, shape) -> tuple:
    return tuple(slice(o - b, o - b + n) for o, b, n in zip(off, box_off, shape))


class MemoryCopy:
    """One step complete in node memory (``MemoryCheckpointer.find``): ``step``, ``world_size`` (the saving job's),
    and ``load(template)`` (collective). ``str()`` says where it is."""

    def __init__(self, mem, step: int, world_size: int, serve: Dict[int, Tuple[int, str]]):
        self.mem, self.step, self.world_size, self.serve = mem, int(step), int(world_size), serve
        self._maps: Dict[int, Tuple[mmap.mmap, np.ndarray]] = {}
        self._info: Optional[Dict[int, dict]] = None
        self._own_rng = False

    def __str__(self) -> str:
        here = sum(1 for o, (r, _) in self.serve.items() if r == o)
        return (f"node memory, step {self.step} of {self.world_size} ranks ({here} of {self.world_size} copies on "
                f"their own rank's node, the others from buddy nodes)")

    def _open(self) -> Dict[int, dict]:
        """Map the slots this rank serves; every saved rank's index and values, shared (collective, once)."""
        if self._info is not None:
            return self._info
        mine, err = {}, None
        for o, (r, path) in self.serve.items():
            if r != self.mem.rank:
                continue
            try:
                with open(path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                h = np.frombuffer(mm, np.int64, 8)
                body = np.frombuffer(mm, np.uint8, offset=64)
                a, n, ni = int(h[2]), int(h[3]), int(h[7])
                doc = pickle.loads(body[a + ni:a + n])
                doc["index"] = pickle.loads(body[a:a + ni])
                if (doc["run_id"], doc["owner"], doc["step"], int(h[1])) != (self.mem.run_id, o, self.step, self.step):
                    raise CheckpointError(f"{path} holds run {doc['run_id']} rank {doc['owner']} step {doc['step']}, "
                                          f"not run {self.mem.run_id} rank {o} step {self.step} (overwritten?)")
                self._maps[o] = (mm, body)
                mine[o] = {"index": doc["index"], "values": doc["values"]}
            except Exception as e:     # noqa: BLE001 - raised on every rank below
                err = f"rank {self.mem.rank}: memory copy of rank {o} step {self.step} ({path}): {e}"
        got = self.mem.comm.allgather((mine, err))
        errs = [e for _, e in got if e]
        if errs:
            raise CheckpointError("; ".join(errs))
        self._info = {o: d for m, _ in got for o, d in m.items()}
        return self._info

    def optimizer_keys(self) -> Dict[str, Dict[str, bool]]:
        """``{parameter name: {key: is an array}}`` of the saved optimizer state (as ``_optimizer_keys(path)``)."""
        keys: Dict[str, Dict[str, bool]] = {}
        for kp, *rest in self._open()[0]["index"]:
            if len(kp) == 4 and kp[:2] == ("optimizer", "state"):
                keys.setdefault(str(kp[2]), {})[str(kp[3])] = len(rest[3]) > 0
        for kp, v in self._open()[0]["values"]:
            if len(kp) == 4 and kp[:2] == ("optimizer", "state"):
                keys.setdefault(str(kp[2]), {})[str(kp[3])] = False
        return keys

    def close(self) -> None:
        """Drop the mappings of the served slots."""
        for mm, _ in self._maps.values():
            try:
                mm.close()
            except BufferError:
                pass
        self._maps = {}

    # -- load ---------------------------------------------------------------------------------------------------
    def _saved(self):
        """``(entries: name -> {keys, dtype, gshape, pieces [(owner, offsets, shape, byte)]}, values per owner)``."""
        info = self._open()
        entries: Dict[str, dict] = {}
        values: Dict[int, Dict[str, Tuple[tuple, Any]]] = {}
        names: Dict[tuple, str] = {}
        for o in range(self.world_size):
            for keys, kind, dt, shape, gshape, offs, view, byte in info[o]["index"]:
                name = names.get(keys)
                if name is None:
                    name = names[keys] = key_name(keys)
                e = entries.setdefault(name, {"keys": keys, "dtype": dt, "gshape": gshape, "view": view,
                                                       "pieces": [], "by_owner": {}})
                e["pieces"].append((o, offs, shape, byte))
                e["by_owner"][o] = e["pieces"][-1]
            values[o] = {key_name(k): (k, v) for k, v in info[o]["values"]}
        if "rng" not in values[0] and all("_axonmpi_own_rng" in values[o] for o in range(self.world_size)):
            rng = json.dumps([values[o]["_axonmpi_own_rng"][1] for o in range(self.world_size)])
            for o in range(self.world_size):
                values[o]["rng"] = (("rng",), rng)
            self._own_rng = True
        for o in range(self.world_size):
            values[o].pop("_axonmpi_own_rng", None)
        return entries, values

    def load(self, state: Optional[dict] = None, *, strict: bool = True) -> dict:
        """This step's state in this rank's layout (collective): ``state``'s arrays filled in place, as
        :func:`axonmpi.checkpoint.load` fills a template (any saved layout and rank count); None: everything, full."""
        rank = self.mem.rank
        entries, values = self._saved()
        vals = values[rank if rank < self.world_size else 0]
        tmpl = flatten(state, rank) if state is not None else [
            (e["keys"], None) for e in entries.values()] + [(k, None) for k, _ in vals.values()]
        items, needs = self._needs(tmpl, entries, vals, strict)
        mine = self._own_pieces(needs, entries)
        if all(self.mem.comm.allgather(mine is not None)):     # the same layout: every rank copies its own slot
            for (name, off, shp, fix), o in zip(needs, mine):
                fix["buf"][...] = self._piece(entries, name, o, off, shp)
        else:
            wanted = self.mem.comm.allgather([(n, off, shp) for n, off, shp, _ in needs])
            self._move(self._plan(wanted, entries), wanted, needs, entries)
        for fix in [n[3] for n in needs]:
            fix["done"](fix)
        return unflatten([(k, v() if callable(v) else v) for k, v in items])

    def _needs(self, tmpl, entries, vals, strict):
        """The leaves' values (or makers) and the boxes to fetch: ``[(name, box offsets, box shape, fix)]``."""
        rank = self.mem.rank
        wild = {key_name(k) for k, v in tmpl if v is None or (isinstance(v, dict) and not v)}
        names = {key_name(k) for k, _ in tmpl}
        saved = set(entries) | set(vals)

        def under_wild(n):
            parts = n.split("/")
            return any("/".join(parts[:i]) in wild for i in range(1, len(parts)))
        missing = [key_name(k) for k, v in tmpl if key_name(k) not in saved
                   and not (key_name(k) in wild and any(s.startswith(key_name(k) + "/") for s in saved))
                   and not (v is None and key_name(k) in ("meta/step", "meta/epoch"))]
        extra = sorted(n for n in saved if n not in names and not under_wild(n)
                       and not (n == "rng" and self._own_rng))        # each rank's own RNG, kept by save
        if strict and (missing or extra):
            raise CheckpointMismatchError(
                f"rank {rank}: the memory copy of step {self.step} does not fit the template: missing from it: "
                f"{missing}; in it but not in the template: {extra}. Build the template from the model and optimizer "
                "it was saved from, or pass strict=False")
        items, needs = [], []

        def whole(name):
            e = entries[name]
            buf = np.empty(e["gshape"], e["dtype"])
            needs.append((name, (0,) * len(e["gshape"]), tuple(e["gshape"]), {"buf": buf, "done": lambda f: None}))
            return buf
        for keys, leaf in tmpl:
            name = key_name(keys)
            if name not in entries:
                if name in vals:
                    items.append((keys, vals[name][1]))
                elif name in wild:
                    sub = [s for s in sorted(saved) if s.startswith(name + "/")]
                    for s in sub:
                        items.append((entries[s]["keys"], whole(s)) if s in entries else vals[s])
                    if not sub:
                        items.append((keys, leaf))
                else:
                    items.append((keys, leaf))
                continue
            items.append((keys, self._need_for(name, entries[name], leaf, needs, whole)))
        return items, needs

    def _need_for(self, name, e, leaf, needs, whole):
        """The leaf to return for saved array ``name``; the box it needs appended to ``needs``."""
        gshape, dt = tuple(e["gshape"]), np.dtype(e["dtype"])
        if isinstance(leaf, ShardedArray):
            if leaf.is_empty:
                return leaf
            target, off, shp = leaf.local, tuple(leaf.offsets), tuple(leaf.local_shape)
            tshape = tuple(leaf.global_shape)
        elif isinstance(leaf, np.ndarray) or _be.is_cupy_array(leaf):
            target, tshape = leaf, tuple(leaf.shape)
            off, shp = (0,) * len(tshape), tshape
        else:
            buf = whole(name)
            return (lambda: buf[()]) if isinstance(leaf, np.generic) else buf
        if _vol(tshape) != _vol(gshape) or (np.dtype(target.dtype) != dt):
            raise CheckpointMismatchError(
                f"rank {self.mem.rank}: entry {name!r} is saved in memory as {dt} of shape {gshape}, the template has "
                f"{np.dtype(target.dtype)} of shape {tshape}: build the model with the options it was saved with")
        if tshape == gshape:
            direct = isinstance(target, np.ndarray) and target.flags.c_contiguous and target.flags.writeable
            buf = target if direct else np.empty(shp, dt)

            def done(f, target=target, direct=direct):
                if not direct:
                    target[...] = f["buf"] if isinstance(target, np.ndarray) else _be.get_array_module(
                        target).asarray(f["buf"])
            needs.append((name, off, shp, {"buf": buf, "done": done}))
            return leaf
        # same elements in another shape (FSDP's flat blocks <-> a parameter's own shape): whole saved rows
        rs = _vol(gshape[1:]) if gshape else 1
        trs = _vol(tshape[1:]) if tshape else 1
        lo, hi = off[0] * trs if tshape else 0, (off[0] + shp[0]) * trs if tshape else 1
        r0, r1 = (lo // rs, -(-hi // rs)) if gshape else (0, 1)
        box_off, box_shp = ((r0,) + (0,) * (len(gshape) - 1), (r1 - r0,) + tuple(gshape[1:])) if gshape else ((), ())

        def done(f, target=target):
            flat = f["buf"].reshape(-1)[lo - r0 * rs: hi - r0 * rs]
            rows = flat.reshape((shp[0],) + tuple(tshape[1:])) if tshape else flat.reshape(())
            part = rows[(slice(None),) + tuple(slice(o, o + n) for o, n in zip(off[1:], shp[1:]))] if tshape else rows
            target[...] = part if isinstance(target, np.ndarray) else _be.get_array_module(target).asarray(part)
        needs.append((name, box_off, box_shp, {"buf": np.empty(box_shp, dt), "done": done}))
        return leaf

    def _own_pieces(self, needs, entries) -> Optional[List[int]]:
        """The owner whose slot this rank serves with exactly each needed box (its own rank's when it saved one), or
        None when some box needs another rank's pieces."""
        me = self.mem.rank
        mine = [o for o, (r, _) in self.serve.items() if r == me]
        out = []
        for name, off, shp, _ in needs:
            hit = None
            for o in ([me] if me in mine else []) + mine:
                p = entries[name]["by_owner"].get(o)
                if p is not None and tuple(p[1]) == tuple(off) and tuple(p[2]) == tuple(shp):
                    hit = o
                    break
            if hit is None:
                return None
            out.append(hit)
        return out

    def _plan(self, wanted: List[list], entries) -> List[Tuple[int, int, int, int, tuple, tuple]]:
        """``[(requester, need index, server, owner, offsets, shape)]``: the pieces that cover every box, each
        taken from the requester's own rank where it serves one (the same plan on every rank)."""
        serve = {o: r for o, (r, _) in self.serve.items()}
        plan = []
        for q, needs in enumerate(wanted):
            for i, (name, off, shp) in enumerate(needs):
                pieces = entries[name]["pieces"]
                whole = [p for p in pieces if _box_and(p[1], p[2], off, shp) == (tuple(off), tuple(shp))
                         or (not shp and not p[2])]
                if whole:
                    o = min(whole, key=lambda p: (serve[p[0]] != q, p[0]))[0]
                    plan.append((q, i, serve[o], o, tuple(off), tuple(shp)))
                    continue
                got: Dict[tuple, int] = {}
                for o, poff, pshp, _ in pieces:
                    x = _box_and(poff, pshp, off, shp)
                    if x is not None and (x not in got or serve[o] == q):
                        got[x] = o
                if sum(_vol(s) for _, s in got) != _vol(shp):
                    raise CheckpointError(
                        f"rank {q}: the memory copy of step {self.step} does not cover entry {name!r} at offsets "
                        f"{off} shape {shp} (its pieces cover {sum(_vol(s) for _, s in got)} of {_vol(shp)} elements)")
                plan.extend((q, i, serve[o], o, x[0], x[1]) for x, o in sorted(got.items()))
        return plan

    def _piece(self, entries, name: str, owner: int, off, shp) -> np.ndarray:
        """The saved values of ``name`` in the box ``off:off+shp``, a view of ``owner``'s mapped slot."""
        e = entries[name]
        _, poff, pshp, byte = e["by_owner"][owner]
        dt = np.dtype(e["dtype"])
        a = self._maps[owner][1][byte:byte + _vol(pshp) * dt.itemsize].view(dt).reshape(pshp)
        return a[_rel(poff, off, shp)]

    def _move(self, plan, wanted, needs, entries) -> None:
        """Copy the planned pieces: from this rank's maps into its own boxes, or one message per pair of ranks."""
        rank, comm = self.mem.rank, self.mem.comm
        out: Dict[int, list] = {}
        into: Dict[int, list] = {}
        for q, i, s, o, off, shp in plan:
            if s == rank and q == rank:
                name, boff, _, fix = needs[i]
                fix["buf"][_rel(boff, off, shp)] = self._piece(entries, name, o, off, shp)
            elif s == rank:
                out.setdefault(q, []).append(self._piece(entries, wanted[q][i][0], o, off, shp))
            elif q == rank:
                into.setdefault(s, []).append((i, off, shp))
        reqs, bufs = [], []
        for q, parts in sorted(out.items()):
            buf = np.concatenate([np.ascontiguousarray(p).view(np.uint8).reshape(-1) for p in parts])
            bufs.append(buf)
            reqs.append(comm.Isend([buf, MPI.BYTE], dest=q, tag=_TAG_MOVE))
        recvd = []
        for s, parts in sorted(into.items()):
            n = sum(_vol(shp) * np.dtype(entries[needs[i][0]]["dtype"]).itemsize for i, _, shp in parts)
            buf = np.empty(n, np.uint8)
            reqs.append(comm.Irecv([buf, MPI.BYTE], source=s, tag=_TAG_MOVE))
            recvd.append((buf, parts))
        MPI.Request.Waitall(reqs)
        for buf, parts in recvd:
            at = 0
            for i, off, shp in parts:
                name, boff, _, fix = needs[i]
                dt = np.dtype(entries[name]["dtype"])
                n = _vol(shp) * dt.itemsize
                fix["buf"][_rel(boff, off, shp)] = buf[at:at + n].view(dt).reshape(shp)
                at += n
