"""``torch.distributed``'s names and argument conventions over axonmpi's World and collectives.

A script written for ``torch.distributed`` runs with ``import axonmpi.distributed as dist`` in
place of ``import torch.distributed as dist``:

* ``init_process_group(backend=None, ...)``: the launcher (``mpiexec`` / ``srun``) decides the
  ranks; ``"nccl"``, ``"gloo"`` and ``"mpi"`` are accepted (see :func:`init_process_group`).
* ``is_initialized``, ``get_rank``, ``get_world_size``, ``new_group``, ``barrier``,
  ``destroy_process_group``, ``get_backend``, ``get_process_group_ranks``, ``get_global_rank``,
  ``get_group_rank``, ``broadcast_object_list``, ``all_gather_into_tensor``,
  ``reduce_scatter_tensor``, ``all_to_all_single``, ``monitored_barrier``.
* The collectives take axonmpi ``Tensor``\\ s **in place**, as torch's do, with torch's argument
  names and order (``op=ReduceOp.SUM``, ``group=``, ``src=``/``dst=``, ``async_op=``): they
  return ``None``, or a :class:`Work` with ``async_op=True``. As in torch, ``src`` and ``dst``
  are *global* ranks (``group_src=`` / ``group_dst=`` take ranks in the group).

The same names called on NumPy / CuPy arrays keep axonmpi's array conventions (out of place,
``out=``, ranks in the group: :mod:`axonmpi.distributed.collectives`), so existing code is
unchanged. ``distributed`` knows nothing of autograd: a Tensor is recognised as an object of
class ``axonmpi...Tensor`` whose ``.data`` is the array moved.
"""
from __future__ import annotations

import datetime
import warnings
from typing import Any, List, Optional

import numpy as np

from . import array_collectives as _ac
from . import object_collectives as _oc
from . import p2p as _p2p
from . import world as _world
from .group import ProcessGroup
from .reduce_op import ReduceOp
from .work import Work

__all__ = [
    "Backend", "GroupMember", "init_process_group", "is_initialized", "is_available",
    "is_mpi_available", "is_nccl_available", "is_gloo_available", "is_torchelastic_launched",
    "get_rank", "get_world_size", "get_backend", "new_group", "destroy_process_group",
    "get_process_group_ranks", "get_global_rank", "get_group_rank", "monitored_barrier",
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
    "send", "recv", "isend", "irecv", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list",
]

_SUM = ReduceOp.SUM


class Backend(str):
    """torch.distributed's backend names. axonmpi moves host arrays over MPI and CuPy arrays over NCCL
    (where CuPy has it) or MPI; ``GLOO`` is accepted and means MPI."""
    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"

    def __new__(cls, name: str):
        low = str(name).lower()
        if low not in ("undefined", "gloo", "nccl", "mpi", "auto"):
            raise ValueError(f"unknown backend {name!r}; expected 'nccl', 'gloo', 'mpi' or None")
        return str.__new__(cls, low)


class GroupMember:
    """torch's ``GroupMember``: ``WORLD`` is the default group (``None`` here means the same)."""
    WORLD = None
    NON_GROUP_MEMBER = object()




def _is_tensor(x) -> bool:
    t = type(x)
    return t.__name__ in ("Tensor", "Parameter") and t.__module__.startswith("axonmpi.")


def _arr(x, what: str = "tensor"):
    """The array a Tensor holds, made a writable array in place first where it is a NumPy scalar (a 0-d
    result such as a loss) or read-only, so an in-place collective can write into it."""
    if not _is_tensor(x):
        raise TypeError(f"rank {_rank()}: {what} must be an axonmpi Tensor (torch.distributed's form), "
                        f"got {type(x).__name__}")
    a = x.data
    if isinstance(a, np.generic) or (type(a) is np.ndarray and not a.flags.writeable):
        a = x.data = np.array(a)
    return a


def _rank() -> int:
    w = _world._WORLD
    return w.rank if w is not None else 0


_WARNED_OUTSIDE = set()


def _outside(group, name: str) -> bool:
    """torch's rule for a group this rank is not in (``new_group([0, 1])`` on rank 2): the collective does
    nothing there and returns None, with a warning (once per name), as torch's do."""
    if group is None:
        return False
    out = group is GroupMember.NON_GROUP_MEMBER or (isinstance(group, ProcessGroup) and not group.is_member)
    if out and name not in _WARNED_OUTSIDE:
        _WARNED_OUTSIDE.add(name)
        warnings.warn(f"rank {_rank()}: {name} on a group this rank is not in does nothing (as in "
                      "torch.distributed); call it on the group's ranks only", stacklevel=3)
    return out


def _grp(group) -> ProcessGroup:
    if group is GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"rank {_rank()}: this rank is not in the group it passed (NON_GROUP_MEMBER)")
    return _world.resolve_group(group)


def _group_rank(g: ProcessGroup, global_rank, group_rank, what: str) -> int:
    """torch: ``src``/``dst`` are global ranks; ``group_src``/``group_dst`` ranks in the group."""
    if group_rank is not None:
        if global_rank is not None and g.world_rank(int(group_rank)) != int(global_rank):
            raise ValueError(f"rank {g.world.rank}: {what}={global_rank} and group_{what}={group_rank} disagree")
        return int(group_rank)
    if global_rank is None:
        raise ValueError(f"rank {g.world.rank}: pass {what}= (a global rank) or group_{what}= (a rank of {g.name})")
    r = int(global_rank)
    if not g.contains(r):
        raise ValueError(f"rank {g.world.rank}: {what}={r} is a global rank (as in torch.distributed) and is not "
                         f"in {g.name}'s ranks {list(g.ranks)}; pass group_{what}= for a rank inside the group")
    return g.group_rank(r)


def _done(async_op: bool, work: Optional[Work] = None):
    if not async_op:
        if work is not None:
            work.wait()
        return None
    return work if work is not None else Work(result=None)


# -- process group lifecycle ------------------------------------------------------------------
_NOTES = {
    "gloo": "backend 'gloo' runs on MPI here (host arrays always move over MPI)",
    "nccl": "backend 'nccl' asked for but CuPy's NCCL with a GPU is not available on this host: "
            "host arrays move over MPI",
}


def _map_backend(backend) -> str:
    """torch's backend string -> axonmpi.init's ``backend``; a note where the meaning differs."""
    if backend is None:
        return "auto"
    spec = str(backend).lower()
    if "," in spec or ":" in spec:          # "cpu:gloo,cuda:nccl": the device part decides
        parts = dict(p.split(":", 1) for p in spec.split(",") if ":" in p)
        spec = parts.get("cuda", parts.get("cpu", "undefined"))
    if spec in ("undefined", "auto"):
        return "auto"
    if spec == "mpi":
        return "mpi"
    if spec == "gloo":
        return "auto"
    if spec == "nccl":
        from .backends.nccl import nccl_available
        if nccl_available():
            return "nccl"
        warnings.warn(_NOTES["nccl"], stacklevel=3)
        return "auto"
    raise ValueError(f"rank {_rank()}: init_process_group(backend={backend!r}): expected None, 'nccl', "
                     f"'gloo', 'mpi' or 'cpu:gloo,cuda:nccl'")


def init_process_group(backend=None, init_method: Optional[str] = None, timeout=None, world_size: int = -1,
                       rank: int = -1, store=None, group_name: str = "", pg_options=None, device_id=None):
    """torch.distributed's ``init_process_group``: make the World of all ranks of the launch.

    The launcher (``mpiexec``, ``srun``) decides the ranks, so ``init_method``, ``store`` and the
    ``MASTER_ADDR``/``MASTER_PORT`` variables are not needed (they are accepted and ignored).
    ``world_size`` and ``rank``, when given, must agree with the launch (else ValueError naming
    both). ``backend``: ``None`` lets axonmpi choose (MPI for host arrays, NCCL for CuPy arrays
    where available); ``"mpi"`` is MPI for everything; ``"gloo"`` means MPI (CPU); ``"nccl"`` is
    NCCL where CuPy has it, and MPI with a warning otherwise (so a GPU script runs on a CPU
    cluster). ``timeout`` (a ``timedelta`` or seconds) is the watchdog's limit. A second call
    raises, as torch's does. A later ``axonmpi.init(G_intra_r=..., ...)`` (AxoNN's ``ax.init``)
    lays its grid over this World. ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and
    ``MASTER_ADDR`` are then in ``os.environ`` as torchrun sets them (a value already there that disagrees
    with the launch raises ValueError).

    Example:
        >>> import axonmpi.distributed as dist
        >>> dist.init_process_group("gloo")
        >>> dist.get_rank(), dist.get_world_size()
    """
    if _world.is_initialized() and getattr(_world._WORLD, "_from_process_group", False):
        raise RuntimeError(f"rank {_rank()}: trying to initialize the default process group twice; "
                           "call destroy_process_group() first")
    be = _map_backend(backend)
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if _world.is_initialized():
        w = _world._WORLD
    else:
        w = _world.init(backend=be, timeout=timeout)
        w._from_process_group = True
        w._regrid_ok = True
    if world_size is not None and int(world_size) not in (-1, w.world_size):
        raise ValueError(f"rank {w.rank}: init_process_group(world_size={world_size}) but the launcher started "
                         f"{w.world_size} ranks; pass -1 or start {world_size} ranks (mpiexec -n {world_size})")
    if rank is not None and int(rank) not in (-1, w.rank):
        raise ValueError(f"rank {w.rank}: init_process_group(rank={rank}) but the launcher made this process rank "
                         f"{w.rank}; leave rank= out (the launcher decides)")
    if str(backend).lower() == "gloo" and w.rank == 0 and not getattr(w, "_noted_gloo", False):
        w._noted_gloo = True
    from .rank_env import publish_rank_env
    publish_rank_env(w)                 # RANK, LOCAL_RANK, WORLD_SIZE, ... as torchrun's (docs/porting.md)
    return None


def is_initialized() -> bool:
    """True when a World exists (made by ``init_process_group`` or ``axonmpi.init``)."""
    return _world.is_initialized()


def is_available() -> bool:
    """Always True (torch's ``dist.is_available``)."""
    return True


def is_mpi_available() -> bool:
    return True


def is_gloo_available() -> bool:
    """True: 'gloo' is accepted and runs on MPI."""
    return True


def is_nccl_available() -> bool:
    from .backends.nccl import nccl_available
    return bool(nccl_available())


def is_torchelastic_launched() -> bool:
    return False


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (default: all ranks); -1 where it is not a member (torch's rule)."""
    if group is None:
        return _world.get_world().rank
    if group is GroupMember.NON_GROUP_MEMBER:
        return -1
    return group.rank


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """The number of ranks in ``group`` (default: all ranks); -1 where this rank is not a member."""
    if group is None:
        return _world.get_world().world_size
    if group is GroupMember.NON_GROUP_MEMBER or not group.is_member:
        return -1
    return group.size


def get_backend(group: Optional[ProcessGroup] = None) -> str:
    """``"nccl"`` when device arrays of the World go over NCCL, else ``"mpi"``."""
    w = _grp(group).world
    from .backends.nccl import BackendKind, nccl_available
    return "nccl" if w.backend is BackendKind.NCCL or (w.backend is BackendKind.AUTO and nccl_available()
                                                       and w.device.type == "cuda") else "mpi"


def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization: bool = False,
              group_desc: Optional[str] = None, device_id=None) -> ProcessGroup:
    """A group of the given global ranks (all ranks when ``None``). Every rank calls it, as in torch;
    ranks outside the group get a non-member group (``get_rank(g) == -1``)."""
    w = _world.get_world()
    if backend is not None:
        _map_backend(backend)
    ranks = list(range(w.world_size)) if ranks is None else sorted(int(r) for r in ranks)
    return w.new_group(ranks, name=group_desc)


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    """Free ``group``, or with ``None`` the whole World (collective, as torch's)."""
    if group is None:
        _world.destroy()
    else:
        group.free()


def get_process_group_ranks(group: Optional[ProcessGroup]) -> List[int]:
    """The global ranks of ``group`` in group-rank order."""
    return list(_world.resolve_group(group).ranks if group is not None else range(_world.get_world().world_size))


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    return _grp(group).world_rank(int(group_rank))


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    return _grp(group).group_rank(int(global_rank))


def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False, device_ids=None):
    """Block until every rank of ``group`` arrives; ``async_op=True`` returns a completed Work."""
    _ac.barrier(group)
    return _done(async_op)


def monitored_barrier(group: Optional[ProcessGroup] = None, timeout=None, wait_all_ranks: bool = False):
    """:func:`barrier` (a hang is reported by the watchdog, ``axonmpi.init(timeout=...)``)."""
    _ac.barrier(group)


# -- collectives: torch's form on Tensors, axonmpi's on arrays ---------------------------------------
def all_reduce(tensor, op: ReduceOp = _SUM, group: Optional[ProcessGroup] = None, *args, async_op: bool = False,
               **kw):
    """torch: reduce ``tensor`` over ``group`` **in place**; ``None`` (or a Work with ``async_op=True``).

    On an array (NumPy/CuPy, torch's tensors via interop) this is axonmpi's out-of-place
    :func:`axonmpi.distributed.array_collectives.all_reduce` (``out=``, returns the result): pass the Tensor
    (``param.grad``), not its array (``param.grad.data``), for torch's in-place reduction (docs/porting.md).

    Example:
        >>> t = axonmpi.ones(3) * (dist.get_rank() + 1)
        >>> dist.all_reduce(t, op=dist.ReduceOp.SUM)     # t is now the sum over ranks
    """
    if not _is_tensor(tensor):
        return _ac.all_reduce(tensor, op, group, *args, async_op=async_op, **kw)
    if _outside(group, "all_reduce"):
        return None
    x = _arr(tensor)
    w = _ac.all_reduce(x, op, _grp(group), out=x, async_op=async_op)
    return w if async_op else None


def broadcast(tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None, async_op: bool = False,
              group_src: Optional[int] = None):
    """torch: copy global rank ``src``'s ``tensor`` into every rank's ``tensor`` (in place).

    On an array: axonmpi's :func:`~axonmpi.distributed.array_collectives.broadcast` (``src`` a
    rank of the group; returns the array).
    """
    if not _is_tensor(tensor):
        return _ac.broadcast(tensor, 0 if src is None else src, group, async_op=async_op)
    if _outside(group, "broadcast"):
        return None
    g = _grp(group)
    s = _group_rank(g, src, group_src, "src")
    x = _arr(tensor)
    if not x.flags.c_contiguous:
        buf = np.ascontiguousarray(x) if type(x) is np.ndarray else x.copy()
        _ac.broadcast(buf, s, g)
        x[...] = buf
    else:
        _ac.broadcast(x, s, g)
    return _done(async_op)


def reduce(tensor, dst: Optional[int] = None, op: ReduceOp = _SUM, group: Optional[ProcessGroup] = None,
           async_op: bool = False, group_dst: Optional[int] = None):
    """torch: reduce onto global rank ``dst``'s ``tensor`` (in place there; others keep theirs).

    On an array: axonmpi's ``reduce`` (result on ``dst``, ``None`` elsewhere)."""
    if not _is_tensor(tensor):
        return _ac.reduce(tensor, 0 if dst is None else dst, op, group)
    if _outside(group, "reduce"):
        return None
    g = _grp(group)
    d = _group_rank(g, dst, group_dst, "dst")
    res = _ac.reduce(_arr(tensor), d, op, g)
    if res is not None:
        tensor.data[...] = res
    return _done(async_op)


def all_gather(tensor_list, tensor=None, group: Optional[ProcessGroup] = None, async_op: bool = False, **kw):
    """torch: ``all_gather(tensor_list, tensor)`` fills ``tensor_list[i]`` with rank ``i``'s ``tensor``.

    With an array first: axonmpi's ``all_gather(x, axis=0, group=None, uneven=, out=)``."""
    if not isinstance(tensor_list, list):
        if tensor is None:
            return _ac.all_gather(tensor_list, group=group, async_op=async_op, **kw)
        return _ac.all_gather(tensor_list, tensor, group, async_op=async_op, **kw)   # (x, axis, group)
    g = _grp(group)
    x = _arr(tensor)
    if len(tensor_list) != g.size:
        raise ValueError(f"rank {g.world.rank}: all_gather needs a tensor_list of {g.size} tensors (one per rank "
                         f"of {g.name}), got {len(tensor_list)}")
    res = _ac.all_gather(x.reshape((1,) + x.shape), 0, g)
    for i, t in enumerate(tensor_list):
        _arr(t, f"tensor_list[{i}]")[...] = res[i]
    return _done(async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group: Optional[ProcessGroup] = None,
                           async_op: bool = False):
    """torch: ranks' ``input_tensor`` concatenated (or stacked) along dim 0 into ``output_tensor``."""
    g = _grp(group)
    x, out = _arr(input_tensor, "input_tensor"), _arr(output_tensor, "output_tensor")
    if out.size != x.size * g.size:
        raise ValueError(f"rank {g.world.rank}: all_gather_into_tensor: output has {out.size} elements, needs "
                         f"{g.size} x {x.size} (input shape {tuple(x.shape)} from each of {g.size} ranks)")
    out[...] = _ac.all_gather(np.ascontiguousarray(x) if type(x) is np.ndarray else x, 0, g).reshape(out.shape)
    return _done(async_op)


def reduce_scatter(output, input_list=None, op: ReduceOp = _SUM, group: Optional[ProcessGroup] = None,
                   async_op: bool = False, **kw):
    """torch: ``reduce_scatter(output, input_list, op)``: ``output`` on rank ``i`` is the reduction of every
    rank's ``input_list[i]``. With an array first: axonmpi's ``reduce_scatter(x, op, group, out=)``."""
    if not _is_tensor(output) or not isinstance(input_list, (list, tuple)):
        if input_list is None:
            return _ac.reduce_scatter(output, op, group, async_op=async_op, **kw)
        return _ac.reduce_scatter(output, input_list, op if group is None else group, async_op=async_op, **kw)
    g = _grp(group)
    if len(input_list) != g.size:
        raise ValueError(f"rank {g.world.rank}: reduce_scatter needs an input_list of {g.size} tensors, "
                         f"got {len(input_list)}")
    arrs = [_arr(t, f"input_list[{i}]") for i, t in enumerate(input_list)]
    xp = type(arrs[0]) is np.ndarray and np or __import__("axonmpi").backend.get_array_module(arrs[0])
    res = _ac.reduce_scatter(xp.stack(arrs), op, g)
    _arr(output, "output")[...] = res[0]
    return _done(async_op)


def reduce_scatter_tensor(output, input, op: ReduceOp = _SUM, group: Optional[ProcessGroup] = None,
                          async_op: bool = False):
    """torch: reduce ``input`` (size ``group size x output``) over ranks; rank ``i`` gets chunk ``i``."""
    g = _grp(group)
    x, out = _arr(input, "input"), _arr(output, "output")
    if x.size != out.size * g.size:
        raise ValueError(f"rank {g.world.rank}: reduce_scatter_tensor: input has {x.size} elements, needs "
                         f"{g.size} x {out.size} (the output's)")
    res = _ac.reduce_scatter(x.reshape((g.size, -1)), op, g)
    out[...] = res.reshape(out.shape)
    return _done(async_op)


def gather(tensor, gather_list=None, dst: Optional[int] = None, group: Optional[ProcessGroup] = None,
           async_op: bool = False, group_dst: Optional[int] = None):
    """torch: ``gather(tensor, gather_list, dst)``: on ``dst`` the ranks' tensors fill ``gather_list``.

    With an array first: axonmpi's ``gather(x, dst, group)`` (the list on ``dst``)."""
    if not _is_tensor(tensor):
        if gather_list is not None and not isinstance(gather_list, list):     # (x, dst, group)
            return _ac.gather(tensor, gather_list, dst if group is None else group)
        return _ac.gather(tensor, 0 if dst is None else dst, group)
    g = _grp(group)
    d = _group_rank(g, 0 if dst is None and group_dst is None else dst, group_dst, "dst")
    res = _ac.gather(tensor.data, d, g)
    if g.rank == d:
        if gather_list is None or len(gather_list) != g.size:
            raise ValueError(f"rank {g.world.rank}: gather's destination needs a gather_list of {g.size} tensors, "
                             f"got {None if gather_list is None else len(gather_list)}")
        for i, t in enumerate(gather_list):
            _arr(t, f"gather_list[{i}]")[...] = res[i]
    return _done(async_op)


def scatter(tensor, scatter_list=None, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
            async_op: bool = False, group_src: Optional[int] = None):
    """torch: ``scatter(tensor, scatter_list, src)``: rank ``i``'s ``tensor`` gets ``scatter_list[i]`` of ``src``.

    With an array or list first: axonmpi's ``scatter(chunks, src, group)``."""
    if not _is_tensor(tensor):
        if scatter_list is not None and not isinstance(scatter_list, list):   # (chunks, src, group)
            return _ac.scatter(tensor, scatter_list, src if group is None else group)
        return _ac.scatter(tensor, 0 if src is None else src, group)
    g = _grp(group)
    s = _group_rank(g, 0 if src is None and group_src is None else src, group_src, "src")
    chunks = [_arr(t, f"scatter_list[{i}]") for i, t in enumerate(scatter_list)] if g.rank == s else None
    _arr(tensor)[...] = _ac.scatter(chunks, s, g)
    return _done(async_op)


def all_to_all(output_tensor_list, input_tensor_list=None, group: Optional[ProcessGroup] = None,
               async_op: bool = False):
    """torch: ``all_to_all(output_list, input_list)``: ``output_list[j]`` gets rank ``j``'s ``input_list[i]``
    (``i`` this rank). With one array or list: axonmpi's ``all_to_all(x, group)`` (returns the result)."""
    if input_tensor_list is None or isinstance(input_tensor_list, ProcessGroup):
        return _ac.all_to_all(output_tensor_list, input_tensor_list if group is None else group)
    g = _grp(group)
    res = _ac.all_to_all([_arr(t, f"input_tensor_list[{i}]") for i, t in enumerate(input_tensor_list)], g)
    for i, t in enumerate(output_tensor_list):
        _arr(t, f"output_tensor_list[{i}]")[...] = res[i].reshape(t.data.shape)
    return _done(async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group: Optional[ProcessGroup] = None, async_op: bool = False):
    """torch: split ``input`` along dim 0 (evenly, or by ``input_split_sizes``), send piece ``j`` to rank ``j``,
    and concatenate what arrives into ``output``."""
    g = _grp(group)
    x, out = _arr(input, "input"), _arr(output, "output")
    n = x.shape[0] if x.ndim else 0
    sizes = list(input_split_sizes) if input_split_sizes else [n // g.size] * g.size
    if sum(sizes) != n:
        raise ValueError(f"rank {g.world.rank}: all_to_all_single: input_split_sizes {sizes} sum to {sum(sizes)}, "
                         f"the input has {n} rows")
    bounds = np.cumsum([0] + sizes)
    pieces = [x[bounds[i]:bounds[i + 1]] for i in range(g.size)]
    res = _ac.all_to_all(pieces, g)
    xp = __import__("axonmpi").backend.get_array_module(x)
    out[...] = xp.concatenate(res).reshape(out.shape)
    return _done(async_op)


# -- point to point ---------------------------------------------------------------------------------
def send(tensor, dst: Optional[int] = None, group: Optional[ProcessGroup] = None, tag: int = 0,
         group_dst: Optional[int] = None) -> None:
    """torch: send ``tensor`` to global rank ``dst``. On an array: axonmpi's ``send`` (``dst`` in the group)."""
    if not _is_tensor(tensor):
        return _p2p.send(tensor, dst, group, tag)
    g = _grp(group)
    _p2p.send(tensor.data, _group_rank(g, dst, group_dst, "dst"), g, tag)


def recv(tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None, tag: int = 0,
         group_src: Optional[int] = None):
    """torch: receive into ``tensor`` (in place) from global rank ``src``; returns ``src``.

    ``src=None`` (any source) is not supported: MPI matching here needs the sender; pass it.
    On an array: axonmpi's ``recv`` (``src`` in the group; returns the array)."""
    if not _is_tensor(tensor):
        return _p2p.recv(tensor, src, group, tag)
    g = _grp(group)
    if src is None and group_src is None:
        raise ValueError(f"rank {g.world.rank}: recv(src=None) (any sender) is not supported; pass src=")
    s = _group_rank(g, src, group_src, "src")
    _p2p.recv(_arr(tensor), s, g, tag)
    return g.world_rank(s)


def isend(tensor, dst: Optional[int] = None, group: Optional[ProcessGroup] = None, tag: int = 0,
          group_dst: Optional[int] = None) -> Work:
    """torch: non-blocking :func:`send`; returns a Work."""
    if not _is_tensor(tensor):
        return _p2p.isend(tensor, dst, group, tag)
    g = _grp(group)
    return _p2p.isend(tensor.data, _group_rank(g, dst, group_dst, "dst"), g, tag)


def irecv(tensor, src: Optional[int] = None, group: Optional[ProcessGroup] = None, tag: int = 0,
          group_src: Optional[int] = None) -> Work:
    """torch: non-blocking :func:`recv` into ``tensor``; returns a Work."""
    if not _is_tensor(tensor):
        return _p2p.irecv(tensor, src, group, tag)
    g = _grp(group)
    if src is None and group_src is None:
        raise ValueError(f"rank {g.world.rank}: irecv(src=None) (any sender) is not supported; pass src=")
    return _p2p.irecv(_arr(tensor), _group_rank(g, src, group_src, "src"), g, tag)


# -- objects -------------------------------------------------------------------------------------------
def broadcast_object_list(object_list: list, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
                          device=None, group_src: Optional[int] = None) -> None:
    """torch: every rank's ``object_list`` becomes global rank ``src``'s (in place, same length)."""
    g = _grp(group)
    s = _group_rank(g, 0 if src is None and group_src is None else src, group_src, "src")
    got = _oc.broadcast_object(list(object_list) if g.rank == s else None, s, g)
    if len(got) != len(object_list):
        raise ValueError(f"rank {g.world.rank}: broadcast_object_list: src has {len(got)} objects, this rank's "
                         f"list {len(object_list)}; pass lists of one length")
    object_list[:] = got


def all_gather_object(object_list, obj: Any = None, group: Optional[ProcessGroup] = None):
    """torch: ``all_gather_object(object_list, obj)`` fills ``object_list`` (group size long) in place.

    axonmpi's form ``all_gather_object(obj, group=None)`` returns the list."""
    if obj is None or isinstance(obj, ProcessGroup):
        return _oc.all_gather_object(object_list, obj if group is None else group)
    g = _grp(group)
    got = _oc.all_gather_object(obj, g)
    if len(object_list) != g.size:
        raise ValueError(f"rank {g.world.rank}: all_gather_object needs an object_list of {g.size} entries, "
                         f"got {len(object_list)}")
    object_list[:] = got
    return None


def gather_object(obj, object_gather_list=None, dst: Optional[int] = None, group: Optional[ProcessGroup] = None,
                  group_dst: Optional[int] = None):
    """torch: ``gather_object(obj, object_gather_list, dst)`` fills the list on ``dst`` in place.

    axonmpi's form ``gather_object(obj, dst=0, group=None)`` returns the list on ``dst``."""
    if object_gather_list is None or not isinstance(object_gather_list, list):
        d = object_gather_list if object_gather_list is not None else (0 if dst is None else dst)
        return _oc.gather_object(obj, d, group)
    g = _grp(group)
    d = _group_rank(g, 0 if dst is None and group_dst is None else dst, group_dst, "dst")
    got = _oc.gather_object(obj, d, g)
    if g.rank == d:
        object_gather_list[:] = got
    return None


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list=None,
                        src: Optional[int] = None, group: Optional[ProcessGroup] = None,
                        group_src: Optional[int] = None) -> None:
    """torch: ``scatter_object_output_list[0]`` becomes ``scatter_object_input_list[i]`` of ``src`` on rank ``i``."""
    g = _grp(group)
    s = _group_rank(g, 0 if src is None and group_src is None else src, group_src, "src")
    objs = _oc.broadcast_object(list(scatter_object_input_list) if g.rank == s else None, s, g)
    scatter_object_output_list[0] = objs[g.rank]


isend._p2p_op = _p2p.isend      # P2POp(dist.isend, ...) with these names works as with p2p's
irecv._p2p_op = _p2p.irecv
