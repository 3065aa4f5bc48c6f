"""Default tensor-parallel groups: the one place that turns the rank grid into row/column/depth groups.

Ranks are laid out as AxoNN's grid (column fastest)::

    world rank = ((data * G_intra_d + depth) * G_intra_r + row) * G_intra_c + col

so with 8 ranks and (G_r, G_c, G_d) = (2, 2, 2): column groups [0,1] [2,3] [4,5] [6,7]
(the column coordinate varies), row groups [0,2] [1,3] [4,6] [5,7], depth groups [0,4] [1,5]
[2,6] [3,7], and one intra group [0..7].  ``row_group`` is the group along which the row
coordinate varies (it splits a weight's out_features), ``col_group`` the one along which the
column coordinate varies (it splits in_features).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ...distributed import ProcessGroup, get_world

__all__ = ["TensorParallelGroups", "default_groups"]

_CONFIG: Dict[str, Tuple[int, int, int]] = {}   # the grid sizes the tests set until the 5-D grid lands
_CACHE: Dict[tuple, "TensorParallelGroups"] = {}


@dataclass(frozen=True)
class TensorParallelGroups:
    """The groups one rank belongs to; sizes ``G_r, G_c, G_d, G_data``."""

    row: ProcessGroup
    col: ProcessGroup
    depth: ProcessGroup
    intra: ProcessGroup
    data: ProcessGroup
    world: ProcessGroup
    sizes: Tuple[int, int, int]


def _set_grid_sizes(G_intra_r: int = 1, G_intra_c: int = 1, G_intra_d: int = 1) -> None:
    """Choose the intra-layer grid used when a layer is given no groups (G_data = world / product)."""
    sizes = (int(G_intra_r), int(G_intra_c), int(G_intra_d))
    if min(sizes) < 1:
        raise ValueError(f"grid sizes must be >= 1, got (G_r, G_c, G_d) = {sizes}")
    _CONFIG["sizes"] = sizes


def default_groups() -> TensorParallelGroups:
    """This rank's row/column/depth/intra/data groups of the current World (collective on first use)."""
    world = get_world()
    G_r, G_c, G_d = _CONFIG.get("sizes", (1, 1, 1))
    n = world.world_size
    intra = G_r * G_c * G_d
    if n % intra:
        raise ValueError(
            f"rank {world.rank}: world size {n} is not divisible by G_intra_r*G_intra_c*G_intra_d "
            f"= {G_r}*{G_c}*{G_d} = {intra}")
    key = (id(world), G_r, G_c, G_d)
    if key in _CACHE:
        return _CACHE[key]
    r = world.rank
    col = r % G_c
    row = (r // G_c) % G_r
    depth = (r // (G_c * G_r)) % G_d
    data = r // intra
    groups = TensorParallelGroups(
        row=world.split((data * G_d + depth) * G_c + col, row, name="row"),
        col=world.split(r // G_c, col, name="col"),
        depth=world.split((data * G_r + row) * G_c + col, depth, name="depth"),
        intra=world.split(data, r % intra, name="intra"),
        data=world.split(r % intra, data, name="data"),
        world=world.default_group,
        sizes=(G_r, G_c, G_d),
    )
    _CACHE[key] = groups
    return groups


def one_d_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    """The group of a Megatron 1-D layer: ``group`` if given, else the intra group (all ranks when no grid)."""
    if group is not None:
        return group
    if "sizes" not in _CONFIG:
        return get_world().default_group
    return default_groups().intra
