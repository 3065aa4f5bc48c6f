"""ProcessGroup: a set of world ranks with its own MPI communicator."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI

    from .world import World

__all__ = ["ProcessGroup", "GroupMembershipError"]


# Debug mode's signature exchange uses the top tags of every group's communicator.
DEBUG_TAGS = 2048


#: torch.distributed's ``group.WORLD``: ``None`` means the default group (all ranks) everywhere here.
WORLD = None


def _user_tag_ub(comm) -> int:
    from mpi4py import MPI

    ub = comm.Get_attr(MPI.TAG_UB)
    return int(ub if ub is not None else 32767) - DEBUG_TAGS


class GroupMembershipError(RuntimeError):
    """Raised when a rank uses a group it does not belong to."""


class ProcessGroup:
    """A process group: the world ranks ``ranks`` talking over one mpi4py communicator.

    Groups are made by :meth:`World.new_group` and :meth:`World.split` (both collective
    over the parent group) and are never constructed by hand. A rank that is not a
    member of a group still receives a ``ProcessGroup`` object (so all ranks can run the
    same code); on it ``is_member`` is False, ``rank`` is -1 and every collective raises
    :class:`GroupMembershipError`.

    Attributes:
        rank: this process's rank inside the group (``-1`` on non-members).
        size: number of members.
        ranks: world ranks of the members, in group-rank order.
        comm: the underlying ``mpi4py.MPI.Intracomm`` (``None`` on non-members).
        name: a label used in error messages.
        max_tag: the largest point-to-point tag users may pass (``MPI_TAG_UB`` less the
            tags debug mode reserves; at least 30719 on every MPI).

    Example:
        >>> world = axonmpi.init()
        >>> evens = world.new_group(range(0, world.world_size, 2))
        >>> if evens.is_member:
        ...     total = axonmpi.all_reduce(np.array([world.rank]), group=evens)
    """

    __slots__ = ("comm", "rank", "size", "ranks", "name", "world", "max_tag", "_index", "_backends", "_host",
                 "_freed", "_debug_seq", "_debug_pending", "_watched", "_check", "_sig_shape")

    def __init__(self, world: "World", comm: "Optional[MPI.Intracomm]", ranks: Sequence[int],
                 name: str = "group"):
        self.world = world
        self.comm = comm
        self.ranks: Tuple[int, ...] = tuple(int(r) for r in ranks)
        self.size = len(self.ranks)
        self.rank = comm.Get_rank() if comm is not None else -1
        self.name = name
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self.max_tag = _user_tag_ub(comm) if comm is not None else -1
        self._backends = {}   # backend name -> Backend, made on first use by the collectives
        self._host = None     # the MPI backend for host arrays and objects (also in _backends)
        self._freed = False
        self._debug_seq = 0   # debug mode: checks made on this group (picks their message tags)
        self._debug_pending = []  # debug mode: sends of a timed-out check, kept until they complete
        self._watched = None      # the WatchedComm its MPI backends share (per-group call numbers)
        self._sig_shape = None    # the shape the caller passed to the collective in flight (for the check)
        # the always-on collective check's own communicator (axonmpi.distributed.watchdog, _Checks):
        # duplicated here, where every member makes the group together (Dup is collective)
        wd = getattr(world, "watchdog", None)
        self._check = (comm.Dup() if comm is not None and self.size > 1 and wd is not None and wd.check
                       else None)

    # -- membership and rank translation -------------------------------------------------
    @property
    def is_member(self) -> bool:
        """True when the calling process belongs to this group."""
        return self.comm is not None

    def contains(self, world_rank: int) -> bool:
        """True when world rank ``world_rank`` is a member."""
        return int(world_rank) in self._index

    def group_rank(self, world_rank: int) -> int:
        """Translate a world rank to its rank in this group (ValueError if not a member)."""
        try:
            return self._index[int(world_rank)]
        except KeyError:
            raise ValueError(
                f"world rank {world_rank} is not a member of {self.name} {list(self.ranks)}"
            ) from None

    def world_rank(self, group_rank: int) -> int:
        """Translate a rank of this group to its world rank."""
        if not 0 <= int(group_rank) < self.size:
            raise ValueError(
                f"group rank {group_rank} out of range for {self.name} of size {self.size} "
                f"(valid: 0..{self.size - 1})"
            )
        return self.ranks[int(group_rank)]

    def check_member(self) -> None:
        """Raise :class:`GroupMembershipError` if the caller is not a member."""
        if self.comm is None:
            raise GroupMembershipError(
                f"rank {self.world.rank} is not a member of {self.name} {list(self.ranks)}; "
                "only member ranks may call collectives on it (check group.is_member first)"
            )

    # -- lifecycle --------------------------------------------------------------------------
    def barrier(self) -> None:
        """Block until every member has reached this call (:func:`axonmpi.barrier` on this group)."""
        self.check_member()
        from .collectives import barrier  # collectives import this module

        barrier(self)

    def free(self) -> None:
        """Release the communicator (the World's default group is freed by ``World.destroy``)."""
        if self._freed:
            return
        self._freed = True
        w = self._watched
        if w is not None and getattr(w, "ck", None) is not None:
            ck = w.ck
            try:
                ck.final()                     # collective, as free is: a mismatch still raises
                ck.settle(True)
            finally:
                w.ck = None
                ck.close()
        for b in self._backends.values():
            b.close()
        self._backends.clear()
        self._host = None
        if self._check is not None:
            try:
                self._check.Free()
            except Exception:  # MPI already finalized
                pass
            self._check = None
        if self.comm is not None and not self.world._is_builtin_comm(self.comm):
            try:
                self.comm.Free()
            except Exception:  # MPI already finalized
                pass
        self.comm = None

    def __repr__(self) -> str:
        me = f"rank={self.rank}" if self.is_member else "not a member"
        shown = list(self.ranks) if self.size <= 16 else f"{list(self.ranks[:8])}...({self.size})"
        return f"ProcessGroup({self.name}, size={self.size}, ranks={shown}, {me})"
