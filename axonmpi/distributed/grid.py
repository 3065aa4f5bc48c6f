"""ProcessGrid: AxoNN's 5-D rank grid (data x inter x depth x row x col), plus Megatron's context dimension, and its named process groups."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .group import ProcessGroup

if TYPE_CHECKING:  # pragma: no cover
    from .world import World

__all__ = ["ProcessGrid", "GridCoords", "Layout", "resolve_grid_sizes", "GROUP_DIMS", "ROLES"]


class GridCoords(NamedTuple):
    """Coordinates of one rank in the grid: AxoNN's five, slowest-varying first, then ``context``.

    ``context`` (the rank's sequence chunk, Megatron's CP rank) comes last so that AxoNN's five-field
    form keeps working (``GridCoords(0, 0, 0, 0, 1)``); in the rank order it varies just faster
    than ``data`` (see :class:`ProcessGrid`).
    """

    data: int
    inter: int
    depth: int
    row: int
    col: int
    context: int = 0

    def __eq__(self, other):
        # AxoNN's five-field form compares equal where the context coordinate is 0
        if type(other) is tuple and len(other) == 5:
            return self.context == 0 and tuple(self)[:5] == other
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return tuple.__hash__(tuple(self)[:5] if self.context == 0 else tuple(self))


_DIMS = GridCoords._fields                        # ("data", "inter", "depth", "row", "col", "context")
# the rank order, slowest-varying first: world = data x context x inter x depth x row x col
_ORDER = ("data", "context", "inter", "depth", "row", "col")
_SIZE_OF = {"data": "G_data", "context": "G_context", "inter": "G_inter", "depth": "G_intra_d",
            "row": "G_intra_r", "col": "G_intra_c"}

# Which coordinates vary inside each named group (the others are fixed and pick the group).
GROUP_DIMS: Dict[str, Tuple[str, ...]] = {
    "data_group": ("data",),
    "inter_group": ("inter",),
    "depth_group": ("depth",),
    "row_group": ("row",),
    "col_group": ("col",),
    "intra_group": ("depth", "row", "col"),
    "model_group": ("inter", "depth", "row", "col"),
    "context_group": ("context",),
    "data_context_group": ("data", "context"),
}


# The one role -> group table every default reads (``ProcessGrid.group_for``).
ROLES: Dict[str, str] = {
    "data": "data_group", "pipeline": "inter_group", "inter": "inter_group", "tensor": "intra_group",
    "intra": "intra_group", "depth": "depth_group", "row": "row_group", "col": "col_group",
    "model": "model_group", "context": "context_group", "data_context": "data_context_group",
    "expert": "expert_group", "expert_data": "expert_data_group",
}


def _describe_sizes(sizes: Dict[str, object]) -> str:
    order = ("G_data", "G_inter", "G_intra_r", "G_intra_c", "G_intra_d")
    if sizes.get("G_context", 1) != 1:
        order = ("G_data", "G_context") + order[1:]
    return ", ".join(f"{k}={sizes[k]!r}" for k in order)


def resolve_grid_sizes(world_size: int, *, G_inter=1, G_data=None, G_intra_r=1, G_intra_c=1, G_intra_d=1,
                       G_context=1, rank: Optional[int] = None) -> Dict[str, int]:
    """Check the grid sizes against ``world_size``; ``G_data=None`` takes what is left.

    Returns:
        ``{"G_data": ..., "G_inter": ..., "G_intra_r": ..., "G_intra_c": ..., "G_intra_d": ...,
        "G_context": ...}``.

    Raises:
        ValueError: a size that is not a positive int, or a product that is not ``world_size``;
            the message names every factor, the product and the world size.

    Example:
        >>> resolve_grid_sizes(8, G_intra_c=2, G_inter=2)["G_data"]
        2
    """
    given = {"G_data": G_data, "G_inter": G_inter, "G_intra_r": G_intra_r, "G_intra_c": G_intra_c,
             "G_intra_d": G_intra_d, "G_context": G_context}
    who = f"rank {rank}: " if rank is not None else ""
    bad = [k for k, v in given.items()
           if not (v is None and k == "G_data")
           and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1)]
    if bad:
        raise ValueError(
            f"{who}grid sizes must be positive ints (G_data may be None), got {_describe_sizes(given)} "
            f"(bad: {', '.join(bad)}) for a world of {world_size} ranks")
    sizes = {k: (None if v is None else int(v)) for k, v in given.items()}
    others = sizes["G_inter"] * sizes["G_intra_r"] * sizes["G_intra_c"] * sizes["G_intra_d"] * sizes["G_context"]
    names = ("G_context*" if sizes["G_context"] != 1 else "") + "G_inter*G_intra_r*G_intra_c*G_intra_d"
    if sizes["G_data"] is None:
        if world_size % others:
            raise ValueError(
                f"{who}grid {_describe_sizes(given)}: world size {world_size} does not divide by "
                f"{names} = {others}, so G_data cannot be derived; "
                f"use a world size that is a multiple of {others} or change the sizes")
        sizes["G_data"] = world_size // others
    elif sizes["G_data"] * others != world_size:
        raise ValueError(
            f"{who}grid {_describe_sizes(given)}: the product G_data*{names} = "
            f"{sizes['G_data'] * others} must equal the world size {world_size}")
    return sizes


class ProcessGrid:
    """AxoNN's 5-D process grid over a :class:`World`, with one :class:`ProcessGroup` per role.

    Rank order, exactly as AxoNN's ``communication_handle`` (column fastest, data slowest), with
    Megatron's context dimension between data and inter (``G_context = 1``: AxoNN's order)::

        world = ((((data*G_context + context)*G_inter + inter)*G_intra_d + depth)*G_intra_r + row)*G_intra_c + col

    Groups (each a ``ProcessGroup`` whose ``.ranks`` lists world ranks in group-rank order;
    group rank = the varying coordinates in the same slowest-first order):

    ============== ============================ =========================================
    group          varies (others fixed)        AxoNN name / use
    ============== ============================ =========================================
    data_group     data                         data_parallel_group: DDP, FSDP
    inter_group    inter                        the pipeline (p2p_mpi_comm)
    depth_group    depth                        depth_intra_layer_parallel_group (Z)
    row_group      row                          outer_intra_layer_parallel_group: shards
                                                a Linear's out_features (size G_intra_r)
    col_group      col                          inner_intra_layer_parallel_group: shards
                                                a Linear's in_features (size G_intra_c)
    intra_group    depth, row, col              intra_layer_group: one tensor-parallel block
    model_group    inter, depth, row, col       one model replica
    context_group  context                      Megatron's CP group: sequence chunks of
                                                the same samples (ring / Ulysses attention)
    data_context_  data, context                gradients reduce here under context
    group                                       parallelism (Megatron's dp_cp group)
    expert_group   EP consecutive data coords   expert parallelism: each holds E/EP experts
    expert_data_   every EP-th data coord       the ranks holding the same experts: expert
    group                                       gradients reduce here
    ============== ============================ =========================================

    Making a grid is collective over the World: one ``Comm.Split`` per group kind whose groups
    have more than one rank; groups of size 1 use ``MPI.COMM_SELF`` (no split, nothing to free),
    and a kind with the ranks of another (``data_context_group`` without context, the
    expert-data group at ``expert_parallel=1``) is that group (no second communicator).
    ``expert_parallel`` is fixed at init: the two expert kinds cost at most two splits, for that
    one EP, and none at the default EP of 1 (see :meth:`expert_group_ranks`).

    Args:
        world: the World to lay out.
        G_inter, G_data, G_intra_r, G_intra_c, G_intra_d: the five sizes (see
            :func:`resolve_grid_sizes`; ``G_data=None`` takes what is left).
        G_context: context-parallel ranks per sample (default 1).
        expert_parallel: EP of the expert groups (divides ``G_data``; default 1: every rank holds
            every expert, the expert-data group is the data group).

    Example (4 ranks, ``G_data=2, G_intra_c=2``)::

        >>> grid = axonmpi.init(G_data=2, G_intra_c=2).grid
        >>> grid.coords                    # on world rank 3
        GridCoords(data=1, inter=0, depth=0, row=0, col=1)
        >>> grid.col_group.ranks, grid.data_group.ranks
        ((2, 3), (1, 3))
    """

    def __init__(self, world: "World", *, G_inter=1, G_data=None, G_intra_r=1, G_intra_c=1, G_intra_d=1,
                 G_context=1, expert_parallel: int = 1):
        sizes = resolve_grid_sizes(world.world_size, G_inter=G_inter, G_data=G_data, G_intra_r=G_intra_r,
                                   G_intra_c=G_intra_c, G_intra_d=G_intra_d, G_context=G_context, rank=world.rank)
        self.world = world
        self.G_data = sizes["G_data"]
        self.G_inter = sizes["G_inter"]
        self.G_intra_r = sizes["G_intra_r"]
        self.G_intra_c = sizes["G_intra_c"]
        self.G_intra_d = sizes["G_intra_d"]
        self.G_context = sizes["G_context"]
        self._shape = GridCoords(self.G_data, self.G_inter, self.G_intra_d, self.G_intra_r, self.G_intra_c,
                                 self.G_context)
        self._extent = tuple(getattr(self._shape, d) for d in _ORDER)     # in the rank order
        self.rank = world.rank
        self.world_size = world.world_size
        self.coords = self.coords_of(self.rank)
        self.expert_parallel = self._check_expert_parallel(expert_parallel)     # before any Split
        self._groups: Dict[str, ProcessGroup] = {}
        self._freed = False
        for name, varying in GROUP_DIMS.items():
            if name == "data_context_group" and self.G_context == 1:
                self._groups[name] = self._groups["data_group"]     # the same ranks: no second communicator
                continue
            self._groups[name] = self._make_group(name, varying)
        expert, expert_data = self.expert_group_ranks(self.expert_parallel)
        for name, ranks in (("expert_group", expert), ("expert_data_group", expert_data)):
            if self.expert_parallel == 1 and name == "expert_data_group":
                self._groups[name] = self._groups["data_group"]     # EP 1: the same ranks, no second communicator
            else:
                self._groups[name] = self._split(name, ranks, min(ranks))

    # -- sizes and coordinates -----------------------------------------------------------
    @property
    def sizes(self) -> Dict[str, int]:
        """The sizes as a dict (``G_data, G_inter, G_intra_r, G_intra_c, G_intra_d, G_context``)."""
        return {"G_data": self.G_data, "G_inter": self.G_inter, "G_intra_r": self.G_intra_r,
                "G_intra_c": self.G_intra_c, "G_intra_d": self.G_intra_d, "G_context": self.G_context}

    @property
    def G_intra(self) -> int:
        """Ranks in one tensor-parallel block: ``G_intra_r * G_intra_c * G_intra_d``."""
        return self.G_intra_r * self.G_intra_c * self.G_intra_d

    @property
    def shape(self) -> GridCoords:
        """Extent per coordinate: ``GridCoords(G_data, G_inter, G_intra_d, G_intra_r, G_intra_c, G_context)``."""
        return self._shape

    def coords_of(self, world_rank: int) -> GridCoords:
        """The grid coordinates of ``world_rank`` (ValueError outside ``0..world_size-1``)."""
        if isinstance(world_rank, bool) or not isinstance(world_rank, numbers.Integral) \
                or not 0 <= world_rank < self.world_size:
            raise ValueError(f"rank {self.rank}: world rank {world_rank!r} is out of range for a grid of "
                             f"{self.world_size} ranks (valid: 0..{self.world_size - 1})")
        out: Dict[str, int] = {}
        r = int(world_rank)
        for name, extent in zip(reversed(_ORDER), reversed(self._extent)):
            out[name] = r % extent
            r //= extent
        return GridCoords(**out)

    def rank_of(self, coords: Sequence[int]) -> int:
        """The world rank at ``coords`` (a :class:`GridCoords`, or 5 or 6 ints in its order; 5: context 0)."""
        c = tuple(coords)
        if len(c) == 5:
            c = c + (0,)
        if len(c) != 6 or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < n
                              for v, n in zip(c, self._shape)):
            raise ValueError(f"rank {self.rank}: coords {coords!r} are not valid for grid shape "
                             f"{tuple(self._shape)} (order: {', '.join(_DIMS)})")
        named = dict(zip(_DIMS, c))
        r = 0
        for name, extent in zip(_ORDER, self._extent):
            r = r * extent + int(named[name])
        return r

    # -- groups --------------------------------------------------------------------------
    @property
    def data_group(self) -> ProcessGroup:
        """Ranks with the same inter/depth/row/col: gradients of replicated weights reduce here."""
        return self._groups["data_group"]

    @property
    def inter_group(self) -> ProcessGroup:
        """The pipeline: ranks with the same data/depth/row/col; group rank = stage."""
        return self._groups["inter_group"]

    @property
    def depth_group(self) -> ProcessGroup:
        """Ranks differing only in depth (AxoNN's Z / FSDP-like dimension of a block)."""
        return self._groups["depth_group"]

    @property
    def row_group(self) -> ProcessGroup:
        """Ranks differing only in row (AxoNN's outer group: shards a Linear's out_features)."""
        return self._groups["row_group"]

    @property
    def col_group(self) -> ProcessGroup:
        """Ranks differing only in col (AxoNN's inner group: shards a Linear's in_features)."""
        return self._groups["col_group"]

    @property
    def intra_group(self) -> ProcessGroup:
        """All ``G_intra_d*G_intra_r*G_intra_c`` ranks of this rank's tensor-parallel block."""
        return self._groups["intra_group"]

    @property
    def model_group(self) -> ProcessGroup:
        """All ranks holding one model replica: ``inter x depth x row x col``."""
        return self._groups["model_group"]

    @property
    def context_group(self) -> ProcessGroup:
        """Ranks differing only in context: they hold different sequence chunks of the same samples."""
        return self._groups["context_group"]

    @property
    def data_context_group(self) -> ProcessGroup:
        """Ranks differing in data or context: gradients of every parameter reduce here under context parallelism."""
        return self._groups["data_context_group"]

    @property
    def expert_group(self) -> ProcessGroup:
        """The ``expert_parallel`` consecutive data ranks splitting the experts (see :meth:`expert_group_ranks`)."""
        return self._groups["expert_group"]

    @property
    def expert_data_group(self) -> ProcessGroup:
        """The ranks holding the same experts (``G_data / expert_parallel``): expert gradients reduce here."""
        return self._groups["expert_data_group"]

    @property
    def is_trivial(self) -> bool:
        """True when the grid has no pipeline, tensor or context dimension (only data: every rank one replica)."""
        return self.G_inter == 1 and self.G_intra == 1 and self.G_context == 1

    def group_for(self, role: str) -> ProcessGroup:
        """The group of ``role`` for this rank: the one role -> group helper every default reads.

        Roles: ``"data"`` (the data group; on the trivial grid the World's group of all ranks, so
        defaults keep meaning "every rank"), ``"pipeline"``/``"inter"``, ``"tensor"``/``"intra"``,
        ``"depth"``, ``"row"``, ``"col"``, ``"model"``, ``"context"`` (Megatron's CP group: the
        sequence chunks of one sample), ``"data_context"`` (data x context: where gradients are
        reduced under context parallelism), ``"world"``; ``"expert"`` and ``"expert_data"`` (the
        expert and expert-data groups of the grid's ``expert_parallel``, built at init).

        Example:
            >>> axonmpi.init(G_intra_c=2).grid.group_for("data").ranks     # on rank 3 of 4
            (1, 3)
        """
        if role == "world" or (role == "data" and self.is_trivial):
            return self.world.default_group
        name = ROLES.get(role)
        if name is None:
            raise ValueError(f"rank {self.rank}: unknown group role {role!r}; expected one of "
                             f"{sorted(set(ROLES) | {'world'})}")
        return self._groups[name]

    # -- expert parallelism: two groups carved from the data dimension -----------------------
    def expert_group_ranks(self, expert_parallel: int,
                           world_rank: Optional[int] = None) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """World ranks of the expert group and the expert-data group holding ``world_rank`` (closed form).

        ``expert_parallel`` (EP) divides ``G_data``; data coordinate ``d = e * EP + i`` puts a rank at
        place ``i`` of expert group ``e`` (EP consecutive data ranks, as Megatron and DeepSpeed carve
        them), and at place ``e`` of expert-data group ``i`` (``G_data / EP`` ranks). The other
        coordinates are fixed in both.

        Example (8 ranks, pure data parallel, EP=4): rank 5 -> expert ``(4, 5, 6, 7)``, expert-data ``(1, 5)``.
        """
        ep = self._check_expert_parallel(expert_parallel)
        base = self.coords if world_rank is None else self.coords_of(world_rank)
        e, i = divmod(base.data, ep)
        expert = tuple(self.rank_of(base._replace(data=e * ep + j)) for j in range(ep))
        edp = tuple(self.rank_of(base._replace(data=f * ep + i)) for f in range(self.G_data // ep))
        return expert, edp

    def _check_expert_parallel(self, expert_parallel) -> int:
        if isinstance(expert_parallel, bool) or not isinstance(expert_parallel, numbers.Integral) \
                or expert_parallel < 1 or self.G_data % expert_parallel:
            raise ValueError(f"rank {self.rank}: expert_parallel={expert_parallel!r} must be a positive int that "
                             f"divides G_data={self.G_data} (the expert group is carved from the data dimension)")
        return int(expert_parallel)

    def expert_groups(self, expert_parallel: Optional[int] = None) -> Tuple[ProcessGroup, ProcessGroup]:
        """``(expert_group, expert_data_group)``, built at init for the grid's ``expert_parallel``.

        No communication. ``expert_parallel`` (optional) must be the grid's: another EP raises,
        naming the fix (build the grid with it: ``axonmpi.init(..., expert_parallel=EP)``).

        Example (4 ranks, ``init(expert_parallel=2)``): rank 3 -> expert ranks ``(2, 3)``, expert-data ranks ``(1, 3)``.
        """
        if expert_parallel is not None:
            self.check_expert_parallel(expert_parallel)
        return self._groups["expert_group"], self._groups["expert_data_group"]

    def check_expert_parallel(self, expert_parallel: int) -> int:
        """``expert_parallel`` when it is the grid's EP; else ValueError naming both and the fix."""
        ep = self._check_expert_parallel(expert_parallel)
        if ep != self.expert_parallel:
            raise ValueError(
                f"rank {self.rank}: expert_parallel={ep} but the grid's expert groups are built for expert_parallel="
                f"{self.expert_parallel} (fixed at init, one Split per kind); build the grid with "
                f"axonmpi.init(..., expert_parallel={ep}) or ProcessGrid(world, ..., expert_parallel={ep})")
        return ep

    def group_ranks(self, name: str, world_rank: Optional[int] = None) -> Tuple[int, ...]:
        """World ranks of the ``name`` group (a key of ``GROUP_DIMS``) that holds ``world_rank``.

        Closed form, no communication; defaults to this rank's group.
        """
        if name not in GROUP_DIMS:
            raise ValueError(f"rank {self.rank}: unknown grid group {name!r}; "
                             f"expected one of {list(GROUP_DIMS)}")
        base = self.coords if world_rank is None else self.coords_of(world_rank)
        varying = [_DIMS.index(d) for d in _ORDER if d in GROUP_DIMS[name]]     # slowest first
        ranks = []
        for k in range(self._count(varying)):
            c = list(base)
            for i in reversed(varying):
                c[i] = k % self._shape[i]
                k //= self._shape[i]
            ranks.append(self.rank_of(c))
        return tuple(ranks)

    def _count(self, dims: Sequence[int]) -> int:
        n = 1
        for i in dims:
            n *= self._shape[i]
        return n

    def _make_group(self, name: str, varying: Sequence[str]) -> ProcessGroup:
        color = 0
        for d in _ORDER:
            if d not in varying:
                color = color * getattr(self._shape, d) + getattr(self.coords, d)
        return self._split(name, self.group_ranks(name), color)

    def _split(self, name: str, ranks: Tuple[int, ...], color: int) -> ProcessGroup:
        """The group of ``ranks`` (this rank's; ``color`` tells the groups of one kind apart): one
        ``Comm.Split`` on every rank of the World, or ``MPI.COMM_SELF`` for a group of one."""
        from mpi4py import MPI

        if len(ranks) == 1:
            return ProcessGroup(self.world, MPI.COMM_SELF, ranks, name=name)
        key = ranks.index(self.rank)
        comm = self.world._comm.Split(color, key)
        if comm.Get_size() != len(ranks) or comm.Get_rank() != key:  # pragma: no cover - MPI contract
            raise RuntimeError(f"rank {self.rank}: Split for {name} gave size {comm.Get_size()} rank "
                               f"{comm.Get_rank()}, expected {len(ranks)} and {key} ({ranks})")
        g = ProcessGroup(self.world, comm, ranks, name=name)
        self.world._groups.append(g)
        return g

    # -- node layout (from the World's Split_type(COMM_TYPE_SHARED)) ---------------------
    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return self.world.local_rank

    @property
    def local_size(self) -> int:
        """Number of ranks on this node."""
        return self.world.local_size

    @property
    def node_index(self) -> int:
        """Index of this node (0..num_nodes-1)."""
        return self.world.node_rank

    # -- data loading ---------------------------------------------------------------------
    @property
    def data_replicas(self) -> Tuple[int, int]:
        """``(num_replicas, rank)`` for sampling: AxoNN's ``(G_data*G_intra_d, G_intra_d*data + depth)``.

        Ranks that differ only in inter, row or col read the same samples.
        """
        return self.G_data * self.G_intra_d, self.G_intra_d * self.coords.data + self.coords.depth

    # -- lifecycle and printing ------------------------------------------------------------
    def free(self) -> None:
        """Free the grid's communicators (collective; ``World.destroy`` frees the World's grid)."""
        if self._freed:
            return
        self._freed = True
        for g in {id(g): g for g in self._groups.values()}.values():
            g.free()
            if g in self.world._groups:
                self.world._groups.remove(g)

    def describe(self, *, print_: bool = False, max_rows: Optional[int] = None) -> str:
        """The layout as a table, world rank -> coordinates; ``print_=True`` prints it on rank 0.

        Args:
            print_: also print the table on world rank 0 (returned on every rank).
            max_rows: show at most this many ranks (head and tail) for large worlds.

        Example (``G_data=2, G_intra_c=2`` on 4 ranks)::

            ProcessGrid(G_data=2, G_inter=1, G_intra_r=1, G_intra_c=2, G_intra_d=1) on 4 ranks
            rank  data  inter  depth  row  col
               0     0      0      0    0    0
               1     0      0      0    0    1
               2     1      0      0    0    0
               3     1      0      0    0    1
        """
        ep = f", expert_parallel={self.expert_parallel}" if self.expert_parallel != 1 else ""
        head = f"ProcessGrid({_describe_sizes(self.sizes)}{ep}) on {self.world_size} ranks"
        dims = _DIMS if self.G_context > 1 else _DIMS[:5]
        cols = ("rank",) + dims
        widths = [max(len(c), len(str(self.world_size - 1))) for c in cols]
        lines = [head, "  ".join(c.rjust(w) for c, w in zip(cols, widths))]
        shown = list(range(self.world_size))
        cut = None
        if max_rows is not None and self.world_size > max_rows:
            half = max(1, max_rows // 2)
            shown = shown[:half] + shown[-half:]
            cut = half
        for i, r in enumerate(shown):
            if cut is not None and i == cut:
                lines.append(f"... {self.world_size - 2 * cut} more ranks ...")
            vals = (r,) + tuple(self.coords_of(r))[:len(dims)]
            lines.append("  ".join(str(v).rjust(w) for v, w in zip(vals, widths)))
        text = "\n".join(lines)
        if print_ and self.rank == 0:
            print(text, flush=True)
        return text

    def __repr__(self) -> str:
        return self.describe(max_rows=32)


@dataclass(frozen=True)
class Layout:
    """AxoNN's five sizes of a run.

    Example:
        >>> Layout(G_data=2, G_inter=2).world_size
        4
    """
    G_data: int = 1
    G_inter: int = 1
    G_intra_r: int = 1
    G_intra_c: int = 1
    G_intra_d: int = 1
    G_context: int = 1

    @classmethod
    def from_grid(cls, grid: "ProcessGrid") -> "Layout":
        """The sizes of ``grid``."""
        return cls(grid.G_data, grid.G_inter, grid.G_intra_r, grid.G_intra_c, grid.G_intra_d,
                   getattr(grid, "G_context", 1))

    @property
    def world_size(self) -> int:
        """The product of the sizes."""
        return self.G_data * self.G_inter * self.tensor_size * self.G_context

    @property
    def tensor_size(self) -> int:
        """``G_intra_r * G_intra_c * G_intra_d``."""
        return self.G_intra_r * self.G_intra_c * self.G_intra_d

    def as_dict(self) -> Dict[str, int]:
        """``{"G_data": .., "G_inter": .., "G_intra_r": .., "G_intra_c": .., "G_intra_d": ..}``."""
        out = {"G_data": self.G_data, "G_inter": self.G_inter, "G_intra_r": self.G_intra_r,
               "G_intra_c": self.G_intra_c, "G_intra_d": self.G_intra_d}
        if self.G_context != 1:
            out["G_context"] = self.G_context
        return out

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.as_dict().items())
