"""The World and process groups: layout, membership, rank translation, lifecycle."""
import numpy as np
import pytest

import axonmpi
from axonmpi.distributed import GroupMembershipError


@pytest.mark.mpi(min_size=1)
def test_world_layout(world):
    from mpi4py import MPI

    assert axonmpi.init() is world and axonmpi.get_world() is world
    assert world.rank == MPI.COMM_WORLD.Get_rank() and world.world_size == MPI.COMM_WORLD.Get_size()
    assert axonmpi.rank() == world.rank and axonmpi.world_size() == world.world_size
    assert axonmpi.is_main_process() == (world.rank == 0)
    # one node under a local mpiexec: local ranks equal world ranks
    assert world.num_nodes == 1 and world.node_rank == 0
    assert world.local_size == world.world_size and world.local_rank == world.rank
    assert world.node_index == world.node_rank == 0
    assert world.grid is axonmpi.get_grid() and world.grid.data_group.ranks == tuple(range(world.world_size))
    assert str(world.device) == "cpu" or str(world.device).startswith("cuda:")
    g = world.default_group
    assert g.size == world.world_size and g.rank == world.rank and g.ranks == tuple(range(world.world_size))


@pytest.mark.mpi(min_size=1)
def test_new_group_order_membership_and_translation(world):
    n, r = world.world_size, world.rank
    ranks = list(range(n))[::-1][: max(1, n - 1)]       # reversed, leaves rank 0 out when n > 1
    g = world.new_group(ranks)
    assert g.ranks == tuple(ranks) and g.size == len(ranks)
    if r in ranks:
        assert g.is_member and g.rank == ranks.index(r)
        assert g.world_rank(g.rank) == r and g.group_rank(r) == g.rank
        got = axonmpi.all_reduce(np.array([r]), group=g)
        assert got[0] == sum(ranks)
    else:
        assert not g.is_member and g.rank == -1
        with pytest.raises(GroupMembershipError, match=f"rank {r} is not a member"):
            axonmpi.all_reduce(np.ones(1), group=g)
    assert all(g.contains(k) for k in ranks) and not g.contains(n + 5)
    with pytest.raises(ValueError, match="not a member"):
        g.group_rank(n + 5)
    with pytest.raises(ValueError, match="out of range"):
        g.world_rank(len(ranks))


@pytest.mark.mpi(min_size=1)
def test_overlapping_groups(world):
    n, r = world.world_size, world.rank
    a = world.new_group(range(0, n))                # everyone
    b = world.new_group(range(n // 2, n))           # upper half, overlaps a
    s_a = axonmpi.all_reduce(np.array([1]), group=a)[0]
    assert s_a == n
    if b.is_member:
        assert axonmpi.all_reduce(np.array([r]), group=b)[0] == sum(range(n // 2, n))


@pytest.mark.mpi(min_size=1)
def test_split_by_color_and_key(world):
    n, r = world.world_size, world.rank
    g = world.split(r % 2, key=-r)                 # descending world rank inside each color
    members = sorted((k for k in range(n) if k % 2 == r % 2), reverse=True)
    assert g.ranks == tuple(members) and g.rank == members.index(r)
    left_out = world.split(None if r == 0 else 1)
    assert left_out.is_member == (r != 0)


@pytest.mark.mpi(min_size=1)
def test_new_group_bad_ranks(world):
    n = world.world_size
    with pytest.raises(ValueError, match="duplicates"):
        world.new_group([0, 0])
    with pytest.raises(ValueError, match=rf"\[{n}\] are not in the parent group"):
        world.new_group([0, n])
    with pytest.raises(ValueError, match="at least one rank"):
        world.new_group([])


@pytest.mark.serial
def test_plain_python_world_of_one_and_reinit():
    from axonmpi.testing import run_mpiexec  # noqa: F401 (import check)
    import subprocess
    import sys

    code = (
        "import axonmpi, numpy as np\n"
        "w = axonmpi.init(); assert w.world_size == 1 and w.rank == 0\n"
        "old = w.default_group; axonmpi.distributed.destroy()\n"
        "w2 = axonmpi.init(); assert w2 is not w\n"
        "try:\n"
        "    axonmpi.all_reduce(np.ones(1), group=old)\n"
        "except ValueError as e:\n"
        "    assert 'destroyed' in str(e) or 'another World' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('stale group accepted')\n"
        "print('ok', float(axonmpi.all_reduce(np.ones(1))[0]))\n"
    )
    from axonmpi.testing import mpiexec_env
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=mpiexec_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok 1.0"


@pytest.mark.serial
def test_rank_aware_logging(capsys):
    import logging

    log = axonmpi.get_logger("axonmpi.test", level=logging.INFO)
    log.info("hello %d", 3)
    err = capsys.readouterr().err
    assert "[rank 0/1] INFO axonmpi.test: hello 3" in err
    axonmpi.print0("only rank zero")
    assert capsys.readouterr().out == "only rank zero\n"
