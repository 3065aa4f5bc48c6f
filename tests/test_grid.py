"""The 5-D process grid: AxoNN's rank order and groups for every factorisation of 1-4 ranks, init errors,
and grid-aware data loading (each rank's sample indices written out by hand)."""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

import axonmpi
from axonmpi.data import TensorDataset
from axonmpi.distributed import GridCoords, ProcessGrid
from axonmpi.distributed.world import World

GROUPS = ("data_group", "inter_group", "depth_group", "row_group", "col_group", "intra_group", "model_group")


def factorisations(n):
    """Every ordered (G_data, G_inter, G_r, G_c, G_d) with product n."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    return [f for f in itertools.product(divs, repeat=5) if int(np.prod(f)) == n]


def test_factorisation_counts():
    # ordered 5-factorisations: 1 -> 1, prime p -> 5, 4 = 2*2 -> C(2+4, 4) = 15
    assert [len(factorisations(n)) for n in (1, 2, 3, 4)] == [1, 5, 5, 15]


def axonn_layout(w, GD, GI, GR, GC, GZ):
    """AxoNN's communication_handle, written out: coords of world rank w and the members of each group."""
    G_intra = GR * GC * GZ
    intra = w % G_intra
    col = intra % GC
    row = (intra // GC) % GR
    depth = intra // (GC * GR)
    inter = (w // G_intra) % GI
    data = w // (GI * G_intra)

    def W(d, i, z, r, c):
        return (((d * GI + i) * GZ + z) * GR + r) * GC + c

    block = [data * GI * G_intra + inter * G_intra + k for k in range(G_intra)]
    cube = np.array(block).reshape(GZ, GR, GC)          # AxoNN: reshape(G_intra_d, G_intra_r, G_intra_c)
    groups = {
        "data_group": [k * GI * G_intra + inter * G_intra + intra for k in range(GD)],
        "inter_group": [W(data, k, depth, row, col) for k in range(GI)],
        "depth_group": cube[:, row, col].tolist(),
        "row_group": cube[depth, :, col].tolist(),     # AxoNN's outer group
        "col_group": cube[depth, row, :].tolist(),     # AxoNN's inner group
        "intra_group": block,
        "model_group": [data * GI * G_intra + k for k in range(GI * G_intra)],
    }
    return (data, inter, depth, row, col), groups


@pytest.mark.mpi(min_size=1)
def test_every_factorisation_matches_axonn(world):
    n, me = world.world_size, world.rank
    for GD, GI, GR, GC, GZ in factorisations(n):
        label = f"G_data={GD} G_inter={GI} G_r={GR} G_c={GC} G_d={GZ}"
        before = len(world._groups)
        grid = ProcessGrid(world, G_data=GD, G_inter=GI, G_intra_r=GR, G_intra_c=GC, G_intra_d=GZ)
        try:
            assert (grid.G_data, grid.G_inter, grid.G_intra_r, grid.G_intra_c, grid.G_intra_d) == (GD, GI, GR, GC, GZ)
            want_coords, want_groups = axonn_layout(me, GD, GI, GR, GC, GZ)
            assert grid.coords == GridCoords(*want_coords), label
            assert isinstance(grid.coords, GridCoords) and grid.coords.col == want_coords[4]
            for w in range(n):                         # round trip for every rank
                c = grid.coords_of(w)
                assert c == axonn_layout(w, GD, GI, GR, GC, GZ)[0] and grid.rank_of(c) == w, (label, w)
            for name in GROUPS:
                g = getattr(grid, name)
                want = want_groups[name]
                assert list(g.ranks) == want, (label, name, g.ranks, want)
                assert g.rank == want.index(me) and g.size == len(want)
                if g.size == 1:
                    assert g.comm == MPI.COMM_SELF, (label, name)   # no split for a group of one
                # collectives inside the group: closed-form sum, and group order == .ranks order
                assert axonmpi.all_reduce(np.array([me], dtype=np.int64), group=g)[0] == sum(want), (label, name)
                assert axonmpi.all_gather(np.array([me]), group=g).tolist() == want, (label, name)
                assert axonmpi.all_reduce(np.array([1.0]), group=g)[0] == len(want)
            # one Split per group kind with more than one rank, none for size-1 kinds
            split = sum(1 for name in GROUPS if len(want_groups[name]) > 1)
            assert len(world._groups) - before == split, label
            assert grid.data_replicas == (GD * GZ, GZ * want_coords[0] + want_coords[2])
        finally:
            grid.free()
        assert len(world._groups) == before
        assert all(getattr(grid, name).comm is None for name in GROUPS)
        with pytest.raises(ValueError, match=f"rank {me}: .*data_group.* was freed"):
            axonmpi.all_reduce(np.ones(1), group=grid.data_group)


@pytest.mark.mpi(min_size=1)
def test_expert_groups_are_built_at_init_with_one_split_per_kind(world):
    """``expert_parallel=EP``: the expert and expert-data groups are made with the grid, one Split per kind of
    more than one rank (EP 1: none, the expert-data group is the data group); the closed form; group_for."""
    n, me = world.world_size, world.rank
    for ep in [d for d in range(1, n + 1) if n % d == 0]:
        before = len(world._groups)
        base = len(world._groups)
        plain = ProcessGrid(world)
        plain_splits = len(world._groups) - base
        plain.free()
        grid = ProcessGrid(world, expert_parallel=ep)
        try:
            expert, expert_data = grid.expert_group_ranks(ep)
            assert expert == tuple(range(me // ep * ep, me // ep * ep + ep))
            assert expert_data == tuple(range(me % ep, n, ep))
            assert grid.group_for("expert").ranks == expert and grid.group_for("expert_data").ranks == expert_data
            assert grid.expert_groups() == (grid.group_for("expert"), grid.group_for("expert_data"))
            extra = 0 if ep == 1 else (ep > 1) + (n // ep > 1)
            assert len(world._groups) - before == plain_splits + extra, (ep, len(world._groups) - before)
            if ep == 1:
                assert grid.group_for("expert_data") is grid.data_group and grid.group_for("expert").size == 1
            assert axonmpi.all_reduce(np.array([me]), group=grid.group_for("expert"))[0] == sum(expert)
            assert axonmpi.all_reduce(np.array([me]), group=grid.group_for("expert_data"))[0] == sum(expert_data)
            other = next((d for d in range(1, n + 1) if n % d == 0 and d != ep), None)
            if other is not None:
                with pytest.raises(ValueError, match=rf"rank {me}: expert_parallel={other} but the grid's expert "
                                                     rf"groups are built for expert_parallel={ep}"):
                    grid.expert_groups(other)
        finally:
            grid.free()
        assert len(world._groups) == before
    before = len(world._groups)
    with pytest.raises(ValueError, match=rf"rank {me}: expert_parallel={n + 1} must be a positive int that divides"):
        ProcessGrid(world, expert_parallel=n + 1)
    assert len(world._groups) == before              # refused before any Split
    if world.grid.expert_parallel == 1:
        with pytest.raises(ValueError, match=rf"rank {me}: axonmpi.init asked for expert_parallel=2 but the World's "
                                             r"grid has expert_parallel=1 .*destroy\(\) first"):
            axonmpi.init(expert_parallel=2)


@pytest.mark.mpi(min_size=4)
def test_two_by_two_layout_by_hand(world):
    """G_data=2, G_intra_c=2 on 4 ranks, every group written out (the example in docs/grid.md)."""
    if world.world_size != 4:
        pytest.skip("a 4-rank layout")
    grid = ProcessGrid(world, G_data=2, G_intra_c=2)
    try:
        r = world.rank
        assert grid.coords == [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 0, 0, 0, 0), (1, 0, 0, 0, 1)][r]
        assert grid.data_group.ranks == [(0, 2), (1, 3), (0, 2), (1, 3)][r]
        assert grid.col_group.ranks == grid.intra_group.ranks == grid.model_group.ranks == [(0, 1), (2, 3)][r // 2]
        assert grid.row_group.ranks == grid.depth_group.ranks == grid.inter_group.ranks == (r,)
        assert grid.describe() == (
            "ProcessGrid(G_data=2, G_inter=1, G_intra_r=1, G_intra_c=2, G_intra_d=1) on 4 ranks\n"
            "rank  data  inter  depth  row  col\n"
            "   0     0      0      0    0    0\n"
            "   1     0      0      0    0    1\n"
            "   2     1      0      0    0    0\n"
            "   3     1      0      0    0    1")
        assert repr(grid) == grid.describe()
    finally:
        grid.free()


@pytest.mark.mpi(min_size=1)
def test_grid_of_the_world_and_node_layout(world):
    grid = axonmpi.get_grid()
    assert grid is world.grid and axonmpi.distributed.get_grid() is grid
    assert grid.sizes == {"G_data": world.world_size, "G_inter": 1, "G_intra_r": 1, "G_intra_c": 1, "G_intra_d": 1,
                          "G_context": 1}
    assert grid.data_group.ranks == tuple(range(world.world_size))
    assert grid.coords == GridCoords(world.rank, 0, 0, 0, 0)
    assert (grid.local_rank, grid.local_size, grid.node_index) == (world.local_rank, world.local_size, world.node_rank)
    assert world.node_index == world.node_rank
    # init() without sizes, or with the same grid (explicit or derived), returns the existing World
    assert axonmpi.init() is world and axonmpi.init(G_data=world.world_size) is world
    assert axonmpi.init(G_inter=1, G_data=None) is world


@pytest.mark.mpi(min_size=2)
def test_init_with_another_grid_names_both(world):
    n = world.world_size
    with pytest.raises(ValueError) as e:
        axonmpi.init(G_intra_c=n)
    msg = str(e.value)
    assert f"rank {world.rank}" in msg
    assert f"G_data=1, G_inter=1, G_intra_r=1, G_intra_c={n}, G_intra_d=1" in msg     # asked
    assert f"G_data={n}, G_inter=1, G_intra_r=1, G_intra_c=1, G_intra_d=1" in msg     # existing
    assert axonmpi.get_world() is world and world.grid.G_data == n                   # nothing changed


@pytest.mark.mpi(min_size=1)
def test_bad_sizes_name_every_factor(world):
    n = world.world_size
    with pytest.raises(ValueError) as e:
        ProcessGrid(world, G_data=n, G_inter=2, G_intra_r=3)
    msg = str(e.value)
    for part in (f"G_data={n}", "G_inter=2", "G_intra_r=3", "G_intra_c=1", "G_intra_d=1", f"{6 * n}",
                 f"world size {n}", f"rank {world.rank}"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match=rf"G_intra_c=0.*bad: G_intra_c.*{n} ranks"):
        ProcessGrid(world, G_intra_c=0)
    with pytest.raises(ValueError, match=r"G_intra_d=1\.5.*bad: G_intra_d"):
        ProcessGrid(world, G_intra_d=1.5)
    with pytest.raises(ValueError, match=r"G_inter=True"):
        ProcessGrid(world, G_inter=True)
    with pytest.raises(ValueError, match=rf"world size {n} does not divide by .* = {2 * n}"):
        ProcessGrid(world, G_inter=2 * n)
    with pytest.raises(ValueError, match="out of range"):
        world.grid.coords_of(n)
    with pytest.raises(ValueError, match="not valid for grid shape"):
        world.grid.rank_of((0, 1, 0, 0, 0))


@pytest.mark.serial
def test_init_errors_and_grid_in_a_fresh_process():
    """init with a bad product fails before any World exists; destroy() frees the grid's groups."""
    import subprocess
    import sys

    from axonmpi.testing import mpiexec_env

    code = (
        "import axonmpi, numpy as np\n"
        "try:\n"
        "    axonmpi.init(G_data=2, G_intra_r=2)\n"
        "except ValueError as e:\n"
        "    assert 'G_data=2, G_inter=1, G_intra_r=2, G_intra_c=1, G_intra_d=1' in str(e) and 'world size 1' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('bad grid accepted')\n"
        "assert not axonmpi.is_initialized()\n"
        "g = axonmpi.get_grid(); w = axonmpi.get_world(); assert g is w.grid and g.G_data == 1\n"
        "dg = g.data_group; axonmpi.distributed.destroy(); assert dg.comm is None\n"
        "w2 = axonmpi.init(G_inter=1, G_data=1); assert w2 is not w and w2.grid.sizes['G_data'] == 1\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=mpiexec_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


@pytest.mark.mpi(min_size=2)
def test_world_built_with_a_grid(world):
    """A second World on a duplicate of COMM_WORLD, built with a grid, exposes it as ``.grid``."""
    n = world.world_size
    comm = MPI.COMM_WORLD.Dup()
    w2 = World(comm, abort_on_exception=False, G_intra_r=n)
    try:
        assert w2.grid.sizes["G_intra_r"] == n and w2.grid.G_data == 1
        assert w2.grid.row_group.ranks == tuple(range(n)) and w2.grid.data_group.size == 1
    finally:
        w2.destroy()
        comm.Free()
    assert w2.grid.row_group.comm is None


# -- grid-aware data loading ----------------------------------------------------------------------------
def _local_batches(world, sizes, n_items, global_batch, **kw):
    """Indices of each local batch create_dataloader gives this rank under grid ``sizes``."""
    grid = ProcessGrid(world, **sizes)
    old = world.grid
    world.grid = grid                                    # the grid create_dataloader(group=None) reads
    try:
        loader = axonmpi.create_dataloader(TensorDataset(np.arange(n_items)), global_batch_size=global_batch,
                                           shuffle=False, **kw)
        return [b[0].tolist() for b in loader], grid.coords
    finally:
        world.grid = old
        grid.free()


# world rank -> that rank's batches; written by hand from PyTorch's DistributedSampler(num_replicas, rank)
# with num_replicas = G_data*G_d, rank = G_d*data + depth, shuffle=False, drop_last=True, 10 items.
EXPECTED = {
    (4, "G_data=2,G_d=2"): (dict(G_data=2, G_intra_d=2), 4, [[[0], [4]], [[1], [5]], [[2], [6]], [[3], [7]]]),
    (4, "G_data=2,G_r=2"): (dict(G_data=2, G_intra_r=2), 4,
                            [[[0, 2], [4, 6]], [[0, 2], [4, 6]], [[1, 3], [5, 7]], [[1, 3], [5, 7]]]),
    (4, "G_inter=2,G_d=2"): (dict(G_inter=2, G_intra_d=2), 4,
                             [[[0, 2], [4, 6]], [[1, 3], [5, 7]], [[0, 2], [4, 6]], [[1, 3], [5, 7]]]),
    (4, "G_c=2,G_d=2"): (dict(G_intra_c=2, G_intra_d=2), 2,
                         [[[0], [2], [4], [6], [8]], [[0], [2], [4], [6], [8]],
                          [[1], [3], [5], [7], [9]], [[1], [3], [5], [7], [9]]]),
    (4, "G_r=4"): (dict(G_intra_r=4), 5, [[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]] * 4),
    (3, "G_data=3"): (dict(G_data=3), 3, [[[0], [3], [6]], [[1], [4], [7]], [[2], [5], [8]]]),
    (3, "G_d=3"): (dict(G_intra_d=3), 3, [[[0], [3], [6]], [[1], [4], [7]], [[2], [5], [8]]]),
    (3, "G_c=3"): (dict(G_intra_c=3), 4, [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 3),
    (2, "G_d=2"): (dict(G_intra_d=2), 4, [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]),
    (2, "G_c=2"): (dict(G_intra_c=2), 3, [[[0, 1, 2], [3, 4, 5], [6, 7, 8]]] * 2),
    (2, "G_inter=2"): (dict(G_inter=2), 5, [[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]] * 2),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("key", sorted(EXPECTED), ids=[f"{k[0]}:{k[1]}" for k in sorted(EXPECTED)])
def test_dataloader_indices_by_hand(world, key):
    n_ranks, _ = key
    if world.world_size != n_ranks:
        pytest.skip(f"layout for {n_ranks} ranks")
    sizes, global_batch, expected = EXPECTED[key]
    got, _ = _local_batches(world, sizes, 10, global_batch)
    assert got == expected[world.rank]


@pytest.mark.mpi(min_size=2)
def test_block_ranks_share_batches_and_replicas_partition(world):
    """For every factorisation: ranks equal in (data, depth) read identical batches, and the batches of
    the G_data*G_d replicas together are each global batch of the epoch order exactly once (shuffled)."""
    n = world.world_size
    for GD, GI, GR, GC, GZ in factorisations(n):
        sizes = dict(G_data=GD, G_inter=GI, G_intra_r=GR, G_intra_c=GC, G_intra_d=GZ)
        grid = ProcessGrid(world, **sizes)
        old, world.grid = world.grid, grid
        try:
            reps = GD * GZ
            loader = axonmpi.create_dataloader(TensorDataset(np.arange(23)), global_batch_size=2 * reps, seed=7)
            loader.set_epoch(1)
            mine = [b[0].tolist() for b in loader]
            key = (grid.coords.data, grid.coords.depth)
        finally:
            world.grid = old
            grid.free()
        everyone = axonmpi.all_gather_object((key, mine))
        by_key = {}
        for k, batches in everyone:
            assert by_key.setdefault(k, batches) == batches, (sizes, k)   # same block -> same samples
        assert len(by_key) == reps
        perm = np.random.default_rng((7, 1)).permutation(23)[: 23 // reps * reps]
        for step in range(len(mine)):
            got = sorted(i for (d, z), b in by_key.items() for i in b[step])
            assert got == sorted(perm[step * 2 * reps:(step + 1) * 2 * reps].tolist()), (sizes, step)
            for (d, z), b in by_key.items():          # replica GZ*d+z takes perm[rank::reps]
                rr = GZ * d + z
                assert b[step] == perm[rr::reps][step * 2:(step + 1) * 2].tolist(), (sizes, d, z)


@pytest.mark.mpi(min_size=2)
def test_dataloader_batch_must_divide_replicas(world):
    n = world.world_size
    grid = ProcessGrid(world, G_data=1, G_intra_d=n)
    old, world.grid = world.grid, grid
    try:
        with pytest.raises(ValueError) as e:
            axonmpi.create_dataloader(TensorDataset(np.arange(40)), global_batch_size=2 * n + 1)
        msg = str(e.value)
        assert f"rank {world.rank}" in msg and f"global_batch_size={2 * n + 1}" in msg
        assert f"G_data*G_intra_d {n}" in msg
        # an explicit group keeps today's behaviour: shard over that group
        loader = axonmpi.create_dataloader(TensorDataset(np.arange(4 * n)), global_batch_size=n, shuffle=False,
                                           group=world.default_group)
        assert [b[0].tolist() for b in loader] == [[world.rank + n * k] for k in range(4)]
    finally:
        world.grid = old
        grid.free()
