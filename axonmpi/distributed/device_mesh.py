"""``torch.distributed.device_mesh``'s names over the process grid: ``init_device_mesh``, ``DeviceMesh``.

A torch ``DeviceMesh`` of shape ``(n,)`` or ``(dp, tp)`` is laid over a :class:`ProcessGrid` with
``G_data=dp, G_intra_c=tp`` (a 1-D mesh is ``(1, n)``: its one dimension is the grid's tensor
group, which is all ranks). ``mesh["tp"]`` (the last dimension) is the grid's column group: what
:func:`axonmpi.distributed.tensor.parallel.parallelize_module` splits layers over; ``mesh["dp"]``
(the first) is the data group. Meshes of three or more dimensions raise ``NotImplementedError``
(``axonmpi.init(G_inter=, G_context=, ...)`` names the other axes; docs/grid.md).

Example (4 ranks)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh["tp"].get_group().ranks          # (0, 1) on ranks 0 and 1, (2, 3) on ranks 2 and 3
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from . import world as _world
from .grid import ProcessGrid
from .group import ProcessGroup

__all__ = ["DeviceMesh", "init_device_mesh"]

_ROLES = ("data_group", "col_group")         # the mesh's dimensions, slowest first, as grid groups


class DeviceMesh:
    """torch's ``DeviceMesh`` over a :class:`ProcessGrid` (built by :func:`init_device_mesh`).

    Attributes:
        device_type: the type given (``"cuda"`` / ``"cpu"``); arrays go where the World puts them.
        grid: the :class:`ProcessGrid` the mesh lies over.
        mesh_dim_names: the names of the dimensions (or None).
    """

    def __init__(self, device_type: str, grid: ProcessGrid, dims: Sequence[int],
                 mesh_dim_names: Optional[Tuple[str, ...]] = None):
        self.device_type = str(device_type)
        self.grid = grid
        self._dims = tuple(dims)                 # indices into _ROLES
        self.mesh_dim_names = None if mesh_dim_names is None else tuple(mesh_dim_names)

    @property
    def ndim(self) -> int:
        return len(self._dims)

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.grid.group_for(_role(d)).size for d in self._dims)

    @property
    def mesh(self) -> np.ndarray:
        """World ranks laid out in the mesh's shape (this rank's slice for a sub-mesh)."""
        if self.ndim == 1:
            return np.asarray(self.get_group().ranks)
        return np.arange(self.grid.world_size).reshape(self.shape)

    def size(self, mesh_dim: Optional[int] = None) -> int:
        """The number of ranks in the mesh, or along ``mesh_dim``."""
        return int(np.prod(self.shape)) if mesh_dim is None else self.shape[self._index(mesh_dim)]

    def get_group(self, mesh_dim=None) -> ProcessGroup:
        """The process group of ``mesh_dim`` (an index or a name; a 1-D mesh's own group by default)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"rank {self.grid.rank}: a {self.ndim}-D mesh has one group per dimension; "
                                 f"pass mesh_dim (0..{self.ndim - 1} or one of {self.mesh_dim_names})")
            mesh_dim = 0
        return self.grid.group_for(_role(self._dims[self._index(mesh_dim)]))

    def get_rank(self) -> int:
        """This process's world rank (torch's ``DeviceMesh.get_rank``)."""
        return self.grid.rank

    def get_local_rank(self, mesh_dim=None) -> int:
        """This rank's index along ``mesh_dim`` (a 1-D mesh's own by default)."""
        return self.get_group(mesh_dim).rank

    def get_coordinate(self) -> Tuple[int, ...]:
        return tuple(self.grid.group_for(_role(d)).rank for d in self._dims)

    def _index(self, mesh_dim) -> int:
        if isinstance(mesh_dim, str):
            if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"rank {self.grid.rank}: mesh dimension {mesh_dim!r} not in {self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        i = int(mesh_dim)
        if not 0 <= i < self.ndim:
            raise IndexError(f"rank {self.grid.rank}: mesh_dim={mesh_dim} out of range for a {self.ndim}-D mesh")
        return i

    @property
    def is_tensor_dim(self) -> bool:
        """True for a 1-D mesh along the grid's tensor (column) group: what ``parallelize_module`` splits over."""
        return self._dims == (1,)

    def __getitem__(self, name) -> "DeviceMesh":
        names = (name,) if isinstance(name, str) else tuple(name)
        if len(names) != 1:
            raise NotImplementedError(f"rank {self.grid.rank}: slicing several dimensions {names} out of a mesh")
        i = self._index(names[0])
        return DeviceMesh(self.device_type, self.grid, (self._dims[i],), (names[0],))

    def __repr__(self) -> str:
        names = "" if self.mesh_dim_names is None else f", mesh_dim_names={self.mesh_dim_names}"
        return f"DeviceMesh('{self.device_type}', {self.mesh.tolist()}{names})"


def _role(dim: int) -> str:
    return {0: "data", 1: "col"}[dim]


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Optional[Sequence[str]] = None) -> DeviceMesh:
    """torch's ``init_device_mesh``: a 1-D ``(n,)`` or 2-D ``(dp, tp)`` mesh over all ranks.

    Initializes the World when it is not (as torch's initializes the default process group). When the
    World's grid is the trivial one a process group made, the grid becomes ``G_data=dp, G_intra_c=tp``
    (so every default reads it); otherwise a second :class:`ProcessGrid` is built beside it.

    Raises:
        ValueError: a shape whose product is not the number of ranks, names that do not match it.
        NotImplementedError: three or more dimensions.
    """
    shape = tuple(int(s) for s in mesh_shape)
    fresh = not _world.is_initialized()
    w = _world.get_world()
    if len(shape) not in (1, 2):
        raise NotImplementedError(f"rank {w.rank}: init_device_mesh({shape}): meshes of 1 or 2 dimensions (dp, tp) "
                                  "are served; name more axes with axonmpi.init(G_inter=, G_context=, ...)")
    if int(np.prod(shape)) != w.world_size:
        raise ValueError(f"rank {w.rank}: init_device_mesh(mesh_shape={shape}) covers {int(np.prod(shape))} ranks "
                         f"but the launcher started {w.world_size}; run with mpiexec -n {int(np.prod(shape))}")
    if mesh_dim_names is not None and len(tuple(mesh_dim_names)) != len(shape):
        raise ValueError(f"rank {w.rank}: mesh_dim_names={tuple(mesh_dim_names)} do not match mesh_shape={shape}")
    dp, tp = (1, shape[0]) if len(shape) == 1 else shape
    want = dict(G_data=dp, G_inter=1, G_intra_r=1, G_intra_c=tp, G_intra_d=1, G_context=1)
    grid = w.grid
    if grid.sizes != want:
        if fresh or getattr(w, "_regrid_ok", False):
            w._regrid_ok = True                 # a World this call (or a process group) made: lay the mesh's grid
            grid = _world.init(G_data=dp, G_intra_c=tp).grid
        else:
            grid = ProcessGrid(w, G_data=dp, G_intra_c=tp)
    dims = (1,) if len(shape) == 1 else (0, 1)
    names = None if mesh_dim_names is None else tuple(mesh_dim_names)
    return DeviceMesh(device_type, grid, dims, names)
