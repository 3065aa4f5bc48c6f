"""Placement: where one parameter lives -- the groups that shard it (and how) and the groups that replicate it.

Every strategy records a :class:`Placement` on the parameters it owns (``set_placement``), and
generic code reads it with :func:`placement_of`: gradient sync (``parallel/grad_sync.py``),
gradient clipping (``optim/clip.py``), DDP's and the pipeline's group checks.  It plays the
role of PyTorch's DTensor placements on a DeviceMesh.

Kinds of sharding (:class:`ShardKind`):

* ``DIM``: Megatron 1-D, the full tensor cut into equal slices along ``dim`` over the group;
* ``BLOCK``: AxoNN 3-D, one row x column block of the weight, flattened and cut into depth
  chunks, over the layer's intra-layer group;
* ``FLAT``: an FSDP flat chunk over the shard group (the chunk holds segments of several
  original parameters);
* ``STAGE``: the group's ranks hold different parameters altogether (pipeline stages): each
  rank's elements are its own, none shared.

Where a rank's elements sit in the full serial array is the placement's :attr:`Placement.cuts`:
the steps (:class:`Cut`) that take the full array (``full_shape``) to this rank's local array,
each one group splitting one dim (or the flattened array) into its ranks' chunks.  The sharded
state (``axonmpi.parallel.state``) gathers, cuts and checkpoints every parameter from these alone:

* Megatron column / row / vocab: ``(Cut(tp, 0),)``, ``(Cut(tp, 1),)``, ``(Cut(tp, 0),)``;
* Megatron's fused q/k/v weight: ``(Cut(tp, 0, parts=3),)`` (each of q, k, v split by heads);
* AxoNN 3-D weight: ``(Cut(outer, 0), Cut(inner, 1), Cut(depth, None))`` (the block, flattened,
  cut in depth chunks); its bias ``(Cut(outer, 0),)``;
* an expert-parallel stack of experts: ``(Cut(expert, 0),)`` (or the tensor-parallel dim);
* an FSDP flat parameter: ``(Cut(shard_group, None),)`` of the flat buffer (chunks by the uneven
  rule of ``distributed.sharding``); a replicated parameter: no cut.

A placement ``replicates`` over a group when every rank of that group holds identical values.
Code ported from AxoNN keeps working: :func:`set_placement` also writes AxoNN's tags
(``is_tensor_parallel``, ``process_group_for_norm_reduction``), and :func:`placement_of` reads a
parameter that carries only those tags (or a ``shard_group`` attribute) as a placement.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional, Tuple

__all__ = ["ShardKind", "Shard", "Cut", "Placement", "placement_of", "set_placement", "add_placement", "check_group"]


class ShardKind(enum.Enum):
    """How a group splits a parameter's elements (see the module docstring)."""

    DIM = "dim"
    BLOCK = "block"
    FLAT = "flat"
    STAGE = "stage"


@dataclass(frozen=True)
class Shard:
    """One sharding group of a parameter: ``group`` splits it by ``kind`` (``dim`` for ``DIM``)."""

    group: Any
    kind: ShardKind = ShardKind.DIM
    dim: Optional[int] = None

    def __repr__(self) -> str:
        name = getattr(self.group, "name", None) or "group"
        where = f", dim={self.dim}" if self.dim is not None else ""
        return f"Shard({name}{list(getattr(self.group, 'ranks', ()))}, {self.kind.value}{where})"


@dataclass(frozen=True)
class Cut:
    """One step from the full serial array to this rank's piece: ``group`` splits ``dim`` into its ranks'
    chunks (the uneven rule of ``distributed.sharding``: the first ``n % k`` one larger) and each rank
    keeps its own.  ``dim=None`` flattens the array first (an FSDP flat chunk, AxoNN's depth chunk);
    ``parts > 1`` views ``dim`` as ``parts`` equal pieces, each split so (a fused q/k/v weight).

    Example (AxoNN's weight: the row x column block, flattened, cut in depth chunks)::

        >>> (Cut(outer, 0), Cut(inner, 1), Cut(depth, None))
    """

    group: Any
    dim: Optional[int] = 0
    parts: int = 1

    def __repr__(self) -> str:
        name = getattr(self.group, "name", None) or "group"
        where = "flat" if self.dim is None else f"dim {self.dim}"
        return f"Cut({name}[{getattr(self.group, 'size', '?')}], {where}" + \
            (f", parts={self.parts})" if self.parts != 1 else ")")


def _nontrivial(groups):
    return tuple(g for g in groups if g is not None and getattr(g, "size", 2) > 1)


def _same(a, b) -> bool:
    return a is b or (getattr(a, "ranks", None) is not None and a.ranks == getattr(b, "ranks", None))


@dataclass(frozen=True)
class Placement:
    """Who holds which part of one parameter.

    Attributes:
        shards: the groups whose ranks hold different elements, each with its :class:`ShardKind`.
        replicas: the groups whose ranks hold identical values.
        full_shape: the serial (unsharded) shape, or ``None`` when the parameter is whole here.
        cuts: the :class:`Cut` steps from the full array to this rank's local one, in order; left
            out, one per ``DIM`` shard that names its dim (see :attr:`layout`).
        partial: groups over which this rank's gradient is a part of the parameter's gradient (sequence
            parallelism: each rank ran it on its own tokens): the finalize step sums it over them.
        tied: the group of ranks holding copies of one tied weight (the pipeline stages holding an
            embedding and its head): the finalize step sums the gradient over it; ``None``: not tied.
        counted: ``False`` on every copy of a tied weight but the first (clipping and norms count each
            element once).
        frozen: ``requires_grad=False``: in the state dicts with its serial value, never reduced or updated.

    Example (a Megatron column-parallel weight over a 2-rank tensor group, replicated over data)::

        >>> Placement(shards=(Shard(grid.intra_group, ShardKind.DIM, 0),), replicas=(grid.data_group,),
        ...           full_shape=(64, 32))
    """

    shards: Tuple[Shard, ...] = ()
    replicas: Tuple[Any, ...] = ()
    full_shape: Optional[Tuple[int, ...]] = field(default=None)
    cuts: Tuple[Cut, ...] = ()
    partial: Tuple[Any, ...] = ()
    tied: Any = None
    counted: bool = True
    frozen: bool = False

    @property
    def layout(self) -> Tuple[Cut, ...]:
        """The cuts from the full array to this rank's (its own, or one per dim-naming ``DIM`` shard)."""
        if self.cuts:
            return self.cuts
        return tuple(Cut(s.group, s.dim) for s in self.shards if s.kind is ShardKind.DIM and s.dim is not None)

    @property
    def shard_groups(self) -> Tuple[Any, ...]:
        """The groups of more than one rank that split the elements."""
        return _nontrivial(s.group for s in self.shards)

    @property
    def replica_groups(self) -> Tuple[Any, ...]:
        """The groups of more than one rank that hold identical copies."""
        return _nontrivial(self.replicas)

    @property
    def is_replicated(self) -> bool:
        """True when no group of more than one rank shards the parameter."""
        return not self.shard_groups

    def with_shard(self, shard: Shard) -> "Placement":
        """This placement with one more sharding group (no change when it is already there)."""
        if any(_same(s.group, shard.group) for s in self.shards):
            return self
        return replace(self, shards=self.shards + (shard,),
                       replicas=tuple(r for r in self.replicas if not _same(r, shard.group)))

    def with_partial(self, group: Any) -> "Placement":
        """This placement with ``group`` among the groups its gradient is summed over (no change when there)."""
        if group is None or any(_same(g, group) for g in self.partial):
            return self
        return replace(self, partial=self.partial + (group,))

    @property
    def partial_groups(self) -> Tuple[Any, ...]:
        """The groups of more than one rank the gradient is a part over (see ``partial``)."""
        return _nontrivial(self.partial)

    def with_replica(self, group: Any) -> "Placement":
        """This placement with one more replicating group (no change when it is already there)."""
        if group is None or any(_same(r, group) for r in self.replicas) \
                or any(_same(s.group, group) for s in self.shards):
            return self
        return replace(self, replicas=self.replicas + (group,))

    def describe(self) -> str:
        """A one-line description for error messages: ``shard over [...], replicate over [...]``."""
        def name(g):
            return f"{getattr(g, 'name', None) or 'group'}{list(getattr(g, 'ranks', ()))}"
        parts = [f"{s.kind.value} shard over {name(s.group)}" + (f" dim {s.dim}" if s.dim is not None else "")
                 for s in self.shards]
        parts += [f"replicated over {name(g)}" for g in self.replicas]
        parts += [f"gradient partial over {name(g)}" for g in self.partial]
        if self.tied is not None:
            parts.append(f"tied over {name(self.tied)}" + ("" if self.counted else " (a copy)"))
        if self.frozen:
            parts.append("frozen")
        shape = f", full shape {self.full_shape}" if self.full_shape is not None else ""
        cuts = f", cuts {list(self.cuts)}" if self.cuts else ""
        return (", ".join(parts) or "replicated (no group)") + shape + cuts


_REPLICATED = Placement()
_UNSET = object()


def placement_of(param: Any, default: Optional[Placement] = None) -> Placement:
    """The :class:`Placement` of ``param``.

    Read, in order: the placement a strategy set (:func:`set_placement`); a ``shard_group``
    attribute (sharded over it, ``None``: replicated); AxoNN's tags (``is_tensor_parallel`` with
    ``process_group_for_norm_reduction``); else ``default`` (a replicated placement when ``None``).

    Example:
        >>> placement_of(column_parallel.weight).shard_groups == (grid.intra_group,)
        True
    """
    pl = getattr(param, "placement", None)
    if isinstance(pl, Placement):
        return pl
    g = getattr(param, "shard_group", _UNSET)
    if g is not _UNSET:
        return _REPLICATED if g is None else Placement(shards=(Shard(g, ShardKind.FLAT),))
    tp = getattr(param, "is_tensor_parallel", _UNSET)
    if tp is not _UNSET:
        g = getattr(param, "process_group_for_norm_reduction", None)
        return Placement(shards=(Shard(g, ShardKind.BLOCK),)) if (tp and g is not None) else _REPLICATED
    return _REPLICATED if default is None else default


def set_placement(param: Any, placement: Placement) -> Any:
    """Record ``placement`` on ``param`` (and AxoNN's tags, for code ported from AxoNN); returns ``param``.

    ``process_group_for_norm_reduction`` is the one shard group when there is one (several:
    the first; clipping reads the placement, not the tag).
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"set_placement needs a Placement, got {type(placement).__name__}")
    param.placement = placement
    groups = [s.group for s in placement.shards if s.kind is not ShardKind.STAGE]
    param.is_tensor_parallel = bool(groups)
    param.process_group_for_norm_reduction = groups[0] if groups else None
    _report_full_shape(param, placement)
    return param


def _report_full_shape(param: Any, placement: Placement) -> None:
    """A Parameter cut by its placement reports the serial ``full_shape`` as its ``shape`` (``nn.Parameter``'s
    [Note: a parameter keeps its identity]); an FSDP flat chunk (``FLAT``) is the library's own buffer, not a
    model parameter, and keeps its local shape."""
    d = getattr(param, "__dict__", None)
    full = placement.full_shape
    if d is None or not callable(getattr(type(param), "to_local", None)) \
            or any(s.kind is ShardKind.FLAT for s in placement.shards):
        return
    if full is not None and tuple(full) != tuple(param.data.shape):
        d["_global_shape"] = tuple(int(n) for n in full)
    else:
        d.pop("_global_shape", None)


def add_placement(param: Any, *, shard: Optional[Shard] = None, replica: Any = None, partial: Any = None,
                  tied: Any = None, counted: Optional[bool] = None) -> Any:
    """Add a sharding group, a replicating group, a partial group and / or a tie to ``param``'s current
    placement; returns ``param``.

    Strategies that wrap others call it: DDP adds its data group as a replica, the pipeline its
    group as a ``STAGE`` shard.  The AxoNN tags are left as the layer set them.
    """
    pl = placement_of(param)
    if shard is not None:
        pl = pl.with_shard(shard)
    if replica is not None:
        pl = pl.with_replica(replica)
    if partial is not None:
        pl = pl.with_partial(partial)
    if tied is not None:
        pl = replace(pl, tied=tied)
    if counted is not None:
        pl = replace(pl, counted=bool(counted))
    param.placement = pl
    return param


def check_group(named_params: Iterable[Tuple[str, Any]], group: Any, what: str) -> None:
    """Refuse ``group`` when two of its ranks hold different parts of some parameter.

    Averaging over such a group mixes different shards (a tensor-parallel slice with its
    neighbour, stage 0's weights with stage 1's), which no later step can undo.

    Raises:
        ValueError: naming the parameter, its placement, the group and the fix.

    Example:
        >>> check_group(model.named_parameters(), grid.data_group, "DDP")    # fine
    """
    if group is None or group.size == 1:
        return
    mine = set(group.ranks)
    for name, p in named_params:
        pl = placement_of(p)
        for s in pl.shards:
            g = s.group
            if g is None or g.size == 1 or s.kind is ShardKind.FLAT:
                continue   # an FSDP chunk: FSDP's own (nested) business
            common = sorted(mine & set(g.ranks))
            if len(common) > 1:
                raise ValueError(
                    f"rank {group.world.rank}: {what} would average parameter {name!r} over group "
                    f"{group.name}{list(group.ranks)}, but its placement is {pl.describe()}: ranks {common} "
                    f"hold different parts of it. Use the ranks holding the same part -- leave the group "
                    f"out (the grid's data group, axonmpi.get_grid().data_group) or pass it explicitly")
