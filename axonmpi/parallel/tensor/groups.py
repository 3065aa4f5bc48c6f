"""The process groups of tensor parallelism, taken from a :class:`ProcessGrid` (default: the current World's).

Roles (AxoNN's, see ``docs/grid.md``): ``row`` is the grid's ``row_group`` (the row coordinate
varies; it shards a Linear's out_features), ``col`` the ``col_group`` (shards in_features),
``depth`` the ``depth_group`` (splits each weight block, FSDP-like), ``intra`` the whole
tensor-parallel block and ``data`` the replicas of it.  With 8 ranks and
(G_intra_r, G_intra_c, G_intra_d) = (2, 2, 2): column groups [0,1] [2,3] [4,5] [6,7], row groups
[0,2] [1,3] [4,6] [5,7], depth groups [0,4] [1,5] [2,6] [3,7], one intra group [0..7].
Nothing is cached here: the groups belong to the grid, which owns and frees them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ...distributed import ProcessGrid, ProcessGroup, get_grid

__all__ = ["TensorParallelGroups", "default_groups", "one_d_group"]


@dataclass(frozen=True)
class TensorParallelGroups:
    """The groups one rank's tensor-parallel layers use (AxoNN 3-D and the Megatron 1-D default).

    Attributes:
        row, col, depth, intra, data: the grid's ``row_group``, ``col_group``, ``depth_group``,
            ``intra_group`` and ``data_group``.
        replica: the groups over which a replicated (not tensor-parallel) parameter's gradient is
            summed in easy mode (every rank of one pipeline stage): the World's group of all ranks
            when ``G_inter == 1``, else ``(data, intra)`` (summing over both is the same sum).

    Example:
        >>> grid = axonmpi.ProcessGrid(axonmpi.get_world(), G_intra_c=2)    # at 2 ranks
        >>> g = TensorParallelGroups.from_grid(grid)
        >>> g.sizes
        (1, 2, 1)
        >>> fc = intra_layer.Linear(8, 8, groups=g)
        >>> grid.free()                                                     # when done with fc
    """

    row: ProcessGroup
    col: ProcessGroup
    depth: ProcessGroup
    intra: ProcessGroup
    data: ProcessGroup
    replica: Tuple[ProcessGroup, ...]

    @classmethod
    def from_grid(cls, grid: ProcessGrid) -> "TensorParallelGroups":
        """The groups of ``grid`` (no communication; the grid keeps owning them).

        Args:
            grid: any :class:`ProcessGrid` (the World's, or one built on it and freed by its owner).

        Returns:
            The :class:`TensorParallelGroups` of this rank in ``grid``.

        Example:
            >>> g = TensorParallelGroups.from_grid(axonmpi.get_grid())
        """
        if not isinstance(grid, ProcessGrid):
            raise TypeError(f"TensorParallelGroups.from_grid needs a ProcessGrid, got {type(grid).__name__}")
        replica = ((grid.group_for("world"),) if grid.G_inter == 1 else (grid.data_group, grid.intra_group))
        return cls(row=grid.row_group, col=grid.col_group, depth=grid.depth_group, intra=grid.intra_group,
                   data=grid.data_group, replica=replica)

    @property
    def sizes(self) -> Tuple[int, int, int]:
        """``(G_intra_r, G_intra_c, G_intra_d)``."""
        return self.row.size, self.col.size, self.depth.size

    @property
    def replica_size(self) -> int:
        """Number of ranks a replicated parameter's gradient is summed over."""
        n = 1
        for g in self.replica:
            n *= g.size
        return n

    @property
    def rank(self) -> int:
        """This process's world rank (for error messages)."""
        return self.row.world.rank


def default_groups() -> TensorParallelGroups:
    """This rank's groups in the current World's grid (``axonmpi.init(G_intra_r=..., ...)``).

    Returns:
        ``TensorParallelGroups.from_grid(axonmpi.get_grid())``; on the trivial grid every
        tensor-parallel group has one rank (serial layers, data parallel over all ranks).

    Example:
        >>> axonmpi.init(G_intra_r=2, G_intra_d=2)          # 4 ranks
        >>> default_groups().sizes
        (2, 1, 2)
    """
    return TensorParallelGroups.from_grid(get_grid())


def one_d_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    """The group of a Megatron 1-D layer: ``group`` if given, else the current grid's ``intra_group``.

    With ``axonmpi.init(G_intra_c=N)`` that is N-way tensor parallelism; on the trivial grid it
    has one rank (the layer is serial).

    Example:
        >>> axonmpi.init(G_intra_c=2)                       # 2 ranks
        >>> one_d_group(None).size
        2
    """
    return get_grid().group_for("tensor") if group is None else group
