"""The World: every rank of the job, its node layout, device and groups; the one piece of global state."""
from __future__ import annotations

import numbers
import os
import sys
import threading
import time
import traceback
from typing import Iterable, List, Optional

from mpi4py import MPI

from .. import backend as _devices
from .grid import ProcessGrid, resolve_grid_sizes
from .group import ProcessGroup

__all__ = ["World", "init", "get_world", "get_grid", "is_initialized", "destroy", "resolve_group", "role_group"]

_WORLD: Optional["World"] = None  # the single current World (see DESIGN.md)


class World:
    """All ranks of the job, made by :func:`axonmpi.init`.

    Attributes:
        rank, world_size: this process's rank and the number of ranks.
        local_rank, local_size: rank and count on this node (``Comm.Split_type(COMM_TYPE_SHARED)``,
            not launcher variables, so it works with mpiexec, srun and anything else).
        node_rank, num_nodes: index of this node and number of nodes (``node_index`` is an alias).
        default_group: the group of all ranks (collectives use it when ``group=None``).
        device: ``cpu``, or ``cuda:<local_rank % device_count>`` when CuPy and a GPU are present
            (the count CuPy sees honours ``CUDA_VISIBLE_DEVICES``, so Slurm's per-task binding,
            which leaves each rank one GPU, gives ``cuda:0`` everywhere).
        backend: the :class:`~axonmpi.distributed.backends.BackendKind` for device arrays
            (``AUTO``: NCCL when available, else MPI). Host arrays and objects go over MPI.
        debug: True when ``AXONMPI_DEBUG=1`` (collectives check their arguments across ranks).
        grid: the :class:`ProcessGrid` (AxoNN's 5-D layout; the trivial grid is pure data parallel).
    """

    def __init__(self, comm: Optional["MPI.Intracomm"] = None, *, debug: Optional[bool] = None,
                 abort_on_exception: bool = True, G_inter: int = 1, G_data: Optional[int] = None,
                 G_intra_r: int = 1, G_intra_c: int = 1, G_intra_d: int = 1, device: str = "auto",
                 backend: str = "auto", timeout: Optional[float] = None, G_context: int = 1,
                 expert_parallel: int = 1):
        from .backends.nccl import BackendKind, nccl_available
        if abort_on_exception:   # first: an error in the arguments below prints once, not once per rank
            install_abort_on_exception(comm if comm is not None else MPI.COMM_WORLD)
        base = comm if comm is not None else MPI.COMM_WORLD
        from .signals import announce_early, mark_ready, record_early_signals
        record_early_signals()   # Slurm's USR1 during start-up: MPICH's C handler would swallow it
        mark_ready()             # the job template forwards a held SIGUSR1 once every rank is here
        sizes = resolve_grid_sizes(base.Get_size(), G_inter=G_inter, G_data=G_data, G_intra_r=G_intra_r,
                                   G_intra_c=G_intra_c, G_intra_d=G_intra_d, G_context=G_context,
                                   rank=base.Get_rank())
        self._base_comm = base
        self._comm = base.Dup()
        self.rank = self._comm.Get_rank()
        self.world_size = self._comm.Get_size()
        announce_early(self.rank)   # a signal between `import axonmpi` and here: kept for the first handler
        from .. import log as _log
        _log.set_rank(self.rank, self.world_size)   # log lines name the rank (log.py sits below distributed)
        if debug is None:
            from ..env import get_bool
            debug = get_bool("AXONMPI_DEBUG")
        self.debug = bool(debug)
        self._destroyed = False
        self.watchdog = None
        timeout = _check_timeout(timeout, self.rank)
        from ..env import get_bool, get_float, get_str
        watch, record = get_bool("AXONMPI_WATCHDOG"), get_bool("AXONMPI_FLIGHT_RECORDER")
        if self.world_size > 1 and (watch or record):
            from .watchdog import Watchdog
            self.watchdog = Watchdog(self._comm, timeout=timeout, dump_dir=get_str("AXONMPI_FLIGHT_DIR"),
                                     capacity=max(1, int(get_float("AXONMPI_FLIGHT_RECORDER_SIZE"))),
                                     watch=watch, record=record,
                                     polling=True if get_bool("AXONMPI_WATCHDOG_POLLING") else None,
                                     check=get_bool("AXONMPI_CHECK_COLLECTIVES"))

        node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = node.Get_rank()
        self.local_size = node.Get_size()
        leaders = self._comm.Split(0 if self.local_rank == 0 else MPI.UNDEFINED, key=self.rank)
        info = None
        if leaders != MPI.COMM_NULL:
            info = (leaders.Get_rank(), leaders.Get_size())
            leaders.Free()
        self.node_rank, self.num_nodes = node.bcast(info, root=0)
        self.local_ranks = tuple(node.allgather(self.rank))
        node.Free()

        try:
            self.backend = BackendKind.coerce(backend)
        except ValueError as e:
            raise ValueError(f"rank {self.rank}: {e}") from None
        self.device = _bind_device(device, self.local_rank, self.rank)
        if self.device.type == "cuda":
            _devices.get_cupy().cuda.Device(self.device.index).use()
        self.gpu_sharers = _ranks_sharing_a_gpu(self._comm, self.device, self.node_rank)
        if self.gpu_sharers and self.backend is not BackendKind.MPI:
            # [Note: ranks sharing a GPU] NCCL refuses two members of one communicator on the
            # same device ("Duplicate GPU detected"), so device arrays go over MPI instead.
            shared = ", ".join("+".join(map(str, g)) for g in self.gpu_sharers)
            if self.backend is BackendKind.NCCL:
                raise RuntimeError(
                    f"rank {self.rank}: backend='nccl' but ranks {shared} share one GPU, and NCCL refuses "
                    "two ranks of a communicator on one device. Give each rank its own GPU (srun "
                    "--gpus-per-task=1, or one rank per GPU with mpiexec), or use backend='auto'/'mpi'")
            self.backend = BackendKind.MPI
            if self.rank == 0:
                from ..log import get_logger
                get_logger("axonmpi.world").warning(
                    "ranks %s share a GPU: NCCL needs one GPU per rank, so CuPy arrays go over MPI "
                    "(staged through pinned host memory unless the MPI is CUDA-aware)", shared)
        if self.backend is BackendKind.NCCL and not nccl_available():
            raise RuntimeError(
                f"rank {self.rank}: backend='nccl' needs CuPy with NCCL and a GPU (pip install "
                "'axonmpi[cuda12]'); none is available here. Use backend='auto' or 'mpi'")

        self.default_group = ProcessGroup(self, self._comm, range(self.world_size), name="world")
        self._groups: List[ProcessGroup] = []
        from .launch import apply_launch_defaults
        apply_launch_defaults(self)  # one BLAS thread per rank on shared nodes; launcher/MPI mismatch

        self.grid = ProcessGrid(self, **sizes, expert_parallel=expert_parallel)
        from ..trace import start_from_env
        start_from_env(self.rank)

    @property
    def nccl_for_host_arrays(self) -> bool:
        """True when host arrays go through the NCCL backend too: only with ``backend='nccl'``
        on the test stand-in (``AXONMPI_FAKE_NCCL=1``)."""
        from .backends.nccl import BackendKind, _fake_requested
        return self.backend is BackendKind.NCCL and _fake_requested()

    @property
    def node_index(self) -> int:
        """Index of this node (alias of ``node_rank``)."""
        return self.node_rank

    # -- groups --------------------------------------------------------------------------
    def new_group(self, ranks: Iterable[int], *, parent: Optional[ProcessGroup] = None,
                  name: Optional[str] = None) -> ProcessGroup:
        """Make a group of the given world ranks.

        Collective over ``parent`` (default: all ranks): every rank of the parent must call it
        with the same ``ranks``. Group rank ``i`` is ``ranks[i]``. Ranks outside the group get
        a non-member object (``is_member == False``).

        Example (4 ranks):
            >>> g = world.new_group([3, 1])   # on rank 3: g.rank == 0; on rank 1: g.rank == 1
        """
        parent = self._check_alive_group(parent)
        ranks = [int(r) for r in ranks]
        if not ranks:
            raise ValueError(f"rank {self.rank}: new_group needs at least one rank, got []")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"rank {self.rank}: new_group ranks contain duplicates: {ranks}")
        bad = [r for r in ranks if not parent.contains(r)]
        if bad:
            raise ValueError(
                f"rank {self.rank}: new_group ranks {bad} are not in the parent group "
                f"{list(parent.ranks)} (world size {self.world_size})"
            )
        if self.debug:
            from .debug import check_same_object
            check_same_object(parent, ("new_group", tuple(ranks)), what="new_group(ranks)")
        member = self.rank in ranks
        color = 0 if member else MPI.UNDEFINED
        key = ranks.index(self.rank) if member else 0
        comm = parent.comm.Split(color, key)
        g = ProcessGroup(self, comm if member else None, ranks,
                         name=name or f"group{len(self._groups) + 1}")
        self._groups.append(g)
        return g

    def split(self, color: Optional[int], key: Optional[int] = None, *,
              parent: Optional[ProcessGroup] = None, name: Optional[str] = None) -> ProcessGroup:
        """Split ``parent`` (default: all ranks) into groups by ``color``; ranks ordered by ``key``.

        Collective over the parent. ``color=None`` leaves this rank out (it gets a non-member
        group of no ranks). ``key`` defaults to the parent rank.

        Example (4 ranks): ``world.split(world.rank % 2)`` gives groups [0, 2] and [1, 3].
        """
        parent = self._check_alive_group(parent)
        if color is not None and (not isinstance(color, (int,)) or color < 0):
            raise ValueError(f"rank {self.rank}: split color must be a non-negative int or None, got {color!r}")
        key = parent.rank if key is None else int(key)
        mpi_color = MPI.UNDEFINED if color is None else int(color)
        comm = parent.comm.Split(mpi_color, key)
        if comm == MPI.COMM_NULL:
            g = ProcessGroup(self, None, (), name=name or "split(None)")
        else:
            members = comm.allgather(self.rank)
            g = ProcessGroup(self, comm, members, name=name or f"split(color={color})")
        self._groups.append(g)
        return g

    def _check_alive_group(self, group: Optional[ProcessGroup]) -> ProcessGroup:
        if self._destroyed:
            raise RuntimeError("this World was destroyed; call axonmpi.init() again")
        g = self.default_group if group is None else group
        if not isinstance(g, ProcessGroup):
            raise TypeError(f"rank {self.rank}: expected a ProcessGroup, got {type(g).__name__}")
        if g.world is not self:
            raise ValueError(f"rank {self.rank}: {g!r} belongs to another (destroyed) World")
        g.check_member()
        return g

    def _is_builtin_comm(self, comm) -> bool:
        return comm is self._base_comm or comm == MPI.COMM_WORLD or comm == MPI.COMM_SELF

    # -- lifecycle ----------------------------------------------------------------------
    def barrier(self) -> None:
        """Block until every rank reaches this call (through the default group's backend)."""
        self.default_group.barrier()

    def destroy(self) -> None:
        """Free every group and communicator of this World (collective over all ranks)."""
        if self._destroyed:
            return
        self.grid.free()
        for g in self._groups:
            g.free()
        self._groups.clear()
        self.default_group.free()  # frees self._comm, the World's duplicate of COMM_WORLD
        if self.watchdog is not None:
            self.watchdog.close()
        self._destroyed = True
        from .. import log as _log
        _log.set_rank(None)

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
                f"local_size={self.local_size}, node_rank={self.node_rank}, num_nodes={self.num_nodes}, "
                f"device={self.device})")


def init(comm: "Optional[MPI.Intracomm] | int" = None, G_data: Optional[int] = None, G_intra_r: int = 1,
         G_intra_c: int = 1, G_intra_d: int = 1, *, G_inter: Optional[int] = None, debug: Optional[bool] = None,
         abort_on_exception: bool = True, device: str = "auto", backend: str = "auto",
         timeout: Optional[float] = None, G_context: int = 1, expert_parallel: int = 1) -> World:
    """Create (once) and return the current :class:`World` and its :class:`ProcessGrid`.

    Idempotent: a later call with no grid sizes, or with the same grid, returns the same World;
    a later call asking for another grid raises. Works under ``mpiexec``/``srun`` and as a
    plain ``python script.py`` (a world of one).

    Two call forms: ``init(comm)`` / ``init(G_inter=2, ...)``, and AxoNN's positional order
    ``init(G_inter, G_data, G_intra_r=1, G_intra_c=1, G_intra_d=1)`` (an int first means G_inter).

    Args:
        comm: the communicator to build the World on (default ``MPI.COMM_WORLD``), or, as in
            AxoNN, ``G_inter`` given positionally.
        G_inter, G_data, G_intra_r, G_intra_c, G_intra_d: AxoNN's grid sizes (pipeline, data,
            tensor row / column / depth). ``G_data=None`` takes what is left:
            ``world_size // (G_inter*G_intra_r*G_intra_c*G_intra_d)``. All defaults: pure data
            parallel.
        G_context: context-parallel ranks (Megatron's CP size): ranks holding different sequence
            chunks of the same samples; world = G_data x G_context x G_inter x G_intra_r x
            G_intra_c x G_intra_d.
        expert_parallel: EP of the grid's expert groups (``group_for("expert")``, ``"expert_data"``),
            built at init: EP consecutive data ranks split a MoE's experts (divides ``G_data``).
        debug: check collective arguments across ranks (default: ``AXONMPI_DEBUG`` env var).
        abort_on_exception: end the whole job (``MPI_Abort``) when any rank dies of an
            uncaught exception, after printing its traceback, instead of leaving others hanging.
        device: ``"auto"`` (GPU ``local_rank % n_gpus`` when CuPy sees one, else CPU), ``"cpu"``,
            or ``"cuda"`` (raises without a GPU). Local rank comes from
            ``Split_type(COMM_TYPE_SHARED)``; the GPU count honours ``CUDA_VISIBLE_DEVICES``.
        backend: who moves device (CuPy) arrays: ``"auto"`` (NCCL when CuPy has it, else MPI:
            directly when CUDA-aware, else staged through the host), ``"mpi"`` or ``"nccl"``
            (raises where NCCL is missing). Host arrays and object collectives always use MPI,
            except on the test stand-in (``AXONMPI_FAKE_NCCL=1``), where ``"nccl"`` routes
            host arrays through the NCCL backend as well.
        timeout: seconds any collective or point-to-point wait may last before the watchdog
            ends the job with a root-cause report (default ``AXONMPI_TIMEOUT``, 600). A later
            ``init(timeout=...)`` or ``init(debug=...)`` changes the running World's value
            (call it on every rank).

    Raises:
        ValueError: sizes that are not positive ints or whose product is not the world size
            (every factor and the world size are named), or a grid other than the existing
            World's (both grids are named).

    Example:
        >>> import axonmpi
        >>> world = axonmpi.init()                       # or axonmpi.init(G_intra_c=2) for 2-way TP
        >>> print(world.rank, world.world_size, world.grid.coords)
    """
    global _WORLD
    if isinstance(comm, numbers.Integral) and not isinstance(comm, bool):   # AxoNN: init(G_inter, G_data, ...)
        if G_inter is not None:
            raise TypeError(f"init: G_inter given twice (positionally as {comm} and as G_inter={G_inter})")
        comm, G_inter = None, int(comm)
    G_inter = 1 if G_inter is None else G_inter
    asked = dict(G_data=G_data, G_inter=G_inter, G_intra_r=G_intra_r, G_intra_c=G_intra_c,
                 G_intra_d=G_intra_d, G_context=G_context)
    if _WORLD is None or _WORLD._destroyed:
        _WORLD = World(comm, debug=debug, abort_on_exception=abort_on_exception, device=device,
                       backend=backend, timeout=timeout, expert_parallel=expert_parallel, **asked)
        return _WORLD
    if debug is not None:
        _WORLD.debug = bool(debug)
    if timeout is not None:
        t = _check_timeout(timeout, _WORLD.rank)
        if _WORLD.watchdog is not None:
            _WORLD.watchdog.timeout = t
    from .backends.nccl import BackendKind
    if backend != "auto" and BackendKind.coerce(backend) is not _WORLD.backend:
        raise ValueError(f"rank {_WORLD.rank}: axonmpi.init asked for backend={backend!r} but the World has "
                         f"backend={_WORLD.backend.value!r}; call axonmpi.distributed.destroy() first to change it")
    if device != "auto" and _devices.as_device(device).type != _WORLD.device.type:
        raise ValueError(f"rank {_WORLD.rank}: axonmpi.init asked for device={device!r} but the World is on "
                         f"{_WORLD.device}; call axonmpi.distributed.destroy() first to change it")
    if asked != dict(G_data=None, G_inter=1, G_intra_r=1, G_intra_c=1, G_intra_d=1, G_context=1):
        have = _WORLD.grid.sizes
        want = resolve_grid_sizes(_WORLD.world_size, rank=_WORLD.rank, **asked)
        if want != have and getattr(_WORLD, "_regrid_ok", False):
            # torch.distributed.init_process_group() then AxoNN's ax.init(G_...): lay the grid over
            # the World the process group made (its trivial grid was never handed out for a grid role)
            _WORLD._regrid_ok = False
            _WORLD.grid.free()
            _WORLD.grid = ProcessGrid(_WORLD, **want, expert_parallel=expert_parallel)
            return _WORLD
        if want != have:
            fmt = lambda d: ", ".join(f"{k}={d[k]}" for k in have)  # noqa: E731
            raise ValueError(
                f"rank {_WORLD.rank}: axonmpi.init asked for the grid ({fmt(want)}) but the World "
                f"already has the grid ({fmt(have)}); call axonmpi.distributed.destroy() first to "
                "change it")
    if expert_parallel != 1 and expert_parallel != _WORLD.grid.expert_parallel:
        raise ValueError(f"rank {_WORLD.rank}: axonmpi.init asked for expert_parallel={expert_parallel!r} but the "
                         f"World's grid has expert_parallel={_WORLD.grid.expert_parallel} (its expert groups are built "
                         "at init); call axonmpi.distributed.destroy() first to change it, or make a second grid: "
                         f"axonmpi.ProcessGrid(world, **world.grid.sizes, expert_parallel={expert_parallel!r})")
    return _WORLD


def _ranks_sharing_a_gpu(comm, device, node_rank: int) -> List[tuple]:
    """The groups of ranks (each of two or more) bound to the same physical GPU of one node.

    Collective over ``comm``. GPUs are told apart by PCI bus id, so ranks that see the device under
    different ``CUDA_VISIBLE_DEVICES`` numbers still compare equal. Empty on the CPU.
    """
    key = None
    if device.type == "cuda":
        key = (node_rank, _devices.get_cupy().cuda.runtime.deviceGetPCIBusId(device.index))
    return gpu_sharers(comm.allgather(key))


def gpu_sharers(keys) -> List[tuple]:
    """Ranks grouped by equal GPU key (``None``: a CPU rank, never grouped); only groups of two or more.

    Example:
        >>> gpu_sharers([(0, "0000:1b"), (0, "0000:1b"), (0, "0000:3d"), None])
        [(0, 1)]
    """
    by_gpu: dict = {}
    for r, k in enumerate(keys):
        if k is not None:
            by_gpu.setdefault(k, []).append(r)
    return [tuple(rs) for rs in by_gpu.values() if len(rs) > 1]


def _check_timeout(timeout, rank: int) -> float:
    """``timeout`` in seconds (``AXONMPI_TIMEOUT`` when None); a non-positive number raises."""
    if timeout is None:
        from ..env import get_float
        return get_float("AXONMPI_TIMEOUT")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"rank {rank}: timeout={timeout!r} must be a number of seconds > 0 "
                         "(e.g. axonmpi.init(timeout=600))")
    return float(timeout)


def _bind_device(device, local_rank: int, rank: int):
    """The device of this rank: GPU ``local_rank % n_gpus`` (``auto``/``cuda``), or the CPU."""
    kind = str(device).lower()
    if kind not in ("auto", "cpu", "cuda"):
        raise ValueError(f"rank {rank}: device={device!r} is not a device choice; expected 'auto', 'cpu' or 'cuda'")
    if kind == "cpu":
        return _devices.Device("cpu")
    ndev = _devices.device_count()
    if ndev == 0:
        if kind == "cuda":
            raise RuntimeError(f"rank {rank}: device='cuda' but CuPy sees no GPU here (check "
                               "CUDA_VISIBLE_DEVICES, AXONMPI_DISABLE_CUPY and pip install 'axonmpi[cuda12]')")
        return _devices.Device("cpu")
    return _devices.Device("cuda", local_rank % ndev)


def is_initialized() -> bool:
    """True when :func:`init` has created a World that is not destroyed."""
    return _WORLD is not None and not _WORLD._destroyed


def get_world() -> World:
    """Return the current World, creating it on first use (as :func:`init` would)."""
    if _WORLD is None or _WORLD._destroyed:
        return init()
    return _WORLD


def get_grid() -> ProcessGrid:
    """Return the current World's :class:`ProcessGrid` (initializing a pure data-parallel World if needed).

    Example:
        >>> grid = axonmpi.get_grid()
        >>> grid.data_group.ranks, grid.coords
    """
    return get_world().grid


def destroy() -> None:
    """Destroy the current World and its grid (collective); a later :func:`init` makes a new one."""
    global _WORLD
    if _WORLD is not None:
        _WORLD.destroy()
    _WORLD = None


def resolve_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    """Return ``group``, or the current grid's ``group_for("world")`` (all ranks) for ``None``; check membership."""
    if group is None:
        w = _WORLD if (_WORLD is not None and not _WORLD._destroyed) else get_world()
        return w.grid.group_for("world")
    if type(group) is not ProcessGroup:
        raise TypeError(f"group must be an axonmpi ProcessGroup or None, got {type(group).__name__}")
    if group.comm is None:
        if group._freed or group.world._destroyed:
            raise ValueError(f"rank {group.world.rank}: {group!r} was freed or belongs to a destroyed World; "
                             "make groups from axonmpi.get_world() or use axonmpi.get_grid()'s")
        group.check_member()
    if group.world is not _WORLD:
        raise ValueError(
            f"rank {group.world.rank}: {group!r} belongs to another World than the current one; "
            "make groups from axonmpi.get_world()"
        )
    return group


def role_group(role: str, group: Optional[ProcessGroup] = None) -> ProcessGroup:
    """``group`` (checked as :func:`resolve_group` does) if given, else the current grid's group for ``role``.

    The one default every strategy reads: ``"data"`` is the grid's data group, which on the
    trivial grid is the World's group of all ranks (see :meth:`ProcessGrid.group_for`).

    Example:
        >>> axonmpi.init(G_inter=2)                  # 4 ranks
        >>> role_group("data").ranks                 # on rank 0
        (0, 2)
    """
    if group is not None:
        return resolve_group(group)
    return get_grid().group_for(role)


# -- fail loud: an uncaught exception on one rank ends the whole job ----------------------
_HOOK_INSTALLED = False
_INTERRUPTED = 130   # the shell's exit code for a job ended by SIGINT (Ctrl-C)


def install_abort_on_exception(comm: "MPI.Comm") -> None:
    """Make an uncaught exception on any rank print its traceback and ``MPI_Abort`` the job.

    Without this, the other ranks would wait forever in their next collective. Only installed
    when the job has more than one rank. Also:

    * Ctrl-C (``KeyboardInterrupt``) ends every rank with exit 130 and one line, no traceback;
    * exceptions Python reports as "ignored" (the unraisable hook, or a library calling
      ``sys.excepthook`` itself from running code) are printed and do not end the job;
    * ``os._exit(0)`` on a rank while its World is alive exits 1 instead: the launcher would
      otherwise kill the other ranks and may report the job as a success.
    """
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED or comm.Get_size() == 1:
        return
    _HOOK_INSTALLED = True
    rank, size = comm.Get_rank(), comm.Get_size()
    prev_hook = sys.excepthook

    def _say(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()
        # the launcher forwards our stderr asynchronously; MPI_Abort right away can kill the job
        # before the report reaches the user's terminal on a loaded node
        time.sleep(0.5)

    def _abort(exc_type, exc, tb, where="") -> None:
        code = 1
        try:
            sys.stdout.flush()
            if issubclass(exc_type, KeyboardInterrupt):
                code = _INTERRUPTED   # every rank gets SIGINT from the launcher: the lowest one speaks
                if rank:
                    time.sleep(1.0 + 0.1 * min(rank, 20))
                _say(f"[axonmpi] interrupted (Ctrl-C) on rank {rank} of {size}; ending all ranks (exit 130)\n")
                return
            # when several ranks fail together (the same bad value everywhere), the lowest one
            # reports first and its MPI_Abort ends the others before they print a copy
            if rank:
                time.sleep(1.5 + 0.1 * min(rank, 20))
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            first = (str(exc).strip().splitlines() or [""])[0]
            _say(
                f"[axonmpi rank {rank}/{size}] uncaught exception{where}; aborting all ranks:\n{text}"
                f"[axonmpi] root cause: rank {rank} of {size} raised {exc_type.__name__}: {first} "
                f"(the other {size - 1} rank(s) are aborted)\n"
            )
        finally:
            MPI.COMM_WORLD.Abort(code)

    def excepthook(exc_type, exc, tb):
        # The interpreter calls the hook for an uncaught exception after the stack has unwound;
        # a caller still on the stack means running code reports an error it then ignores
        # (h5py's cleanup does, for ENOSPC): print it, let the code go on.
        if _has_caller():
            return prev_hook(exc_type, exc, tb)
        _abort(exc_type, exc, tb)

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        _abort(args.exc_type, args.exc_value, args.exc_traceback,
               where=f" in thread {getattr(args.thread, 'name', '?')}")

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
    _guard_os_exit(rank, size)


def _has_caller() -> bool:
    """True when the excepthook was called by running Python code (not by the interpreter at exit)."""
    try:
        sys._getframe(2)   # 0: here, 1: excepthook, 2: whoever called it
    except ValueError:
        return False
    return True


def _guard_os_exit(rank: int, size: int) -> None:
    """``os._exit(0)`` from this process while a World is alive exits 1 (see install_abort_on_exception)."""
    real_exit, pid = os._exit, os.getpid()

    def _exit(code=0):
        if code == 0 and os.getpid() == pid and _WORLD is not None and not _WORLD._destroyed:
            try:
                sys.stderr.write(f"[axonmpi] rank {rank} of {size} called os._exit(0) while the job runs; "
                                 "exiting 1 so the job ends as a failure (call axonmpi.distributed.destroy() "
                                 "first to end on purpose)\n")
                sys.stderr.flush()
            finally:
                real_exit(1)
        real_exit(code)

    os._exit = _exit
