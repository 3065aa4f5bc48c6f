"""The sharding vocabulary (axonmpi.distributed.sharding): one uneven-chunk rule, ShardedArray, at 1-4 ranks."""
import numpy as np
import pytest

import axonmpi.checkpoint
import axonmpi.distributed
from axonmpi.distributed import sharding
from axonmpi.distributed.sharding import ShardedArray, chunk_bounds, chunk_sizes


def test_one_rule_exported_everywhere():
    assert axonmpi.distributed.chunk_sizes is chunk_sizes and axonmpi.distributed.chunk_bounds is chunk_bounds
    assert axonmpi.distributed.collectives.chunk_sizes is chunk_sizes
    assert axonmpi.checkpoint.ShardedArray is ShardedArray
    assert sharding.__all__ == ["chunk_sizes", "chunk_bounds", "ShardedArray", "FlatLayout", "FlatSegment",
                                "compact_slots", "expand_slots"]
    assert axonmpi.parallel.FlatLayout is sharding.FlatLayout        # one layout type for DDP, FSDP and ZeRO


def test_chunk_rule_closed_form():
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(2, 3) == [1, 1, 0]
    assert chunk_sizes(0, 2) == [0, 0]
    assert [chunk_bounds(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    for n in range(0, 30):
        for p in range(1, 7):
            q, r = divmod(n, p)
            assert chunk_sizes(n, p) == [q + 1] * r + [q] * (p - r)
            bounds = [chunk_bounds(n, p, i) for i in range(p)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert [b - a for a, b in bounds] == chunk_sizes(n, p)
            assert [len(c) for c in np.array_split(np.arange(n), p)] == chunk_sizes(n, p)


def test_chunk_rule_rejects_bad_input():
    with pytest.raises(ValueError, match="parts must be an int >= 1, got 0"):
        chunk_sizes(4, 0)
    with pytest.raises(ValueError, match=r"index 4 out of range for 4 parts \(valid: 0..3\)"):
        chunk_bounds(10, 4, 4)
    with pytest.raises(ValueError, match="n must be >= 0"):
        chunk_sizes(-1, 2)


def test_sharded_array_checks_its_block():
    a = ShardedArray(np.zeros((2, 3)), (5, 3), (3, 0))
    assert a.slices == (slice(3, 5), slice(0, 3)) and a.shape == (5, 3) and a.local_shape == (2, 3)
    with pytest.raises(ValueError, match=r"does not fit in global shape \(5, 3\)"):
        ShardedArray(np.zeros((3, 3)), (5, 3), (3, 0))
    with pytest.raises(ValueError, match="must agree"):
        ShardedArray(np.zeros(3), (5, 3), (0, 0))
    with pytest.raises(ValueError, match=r"chunk 2 of 4 along axis 0 of \(10, 6\) has shape \(2, 6\)"):
        ShardedArray.from_chunks(np.zeros((3, 6)), (10, 6), axis=0, rank=2, parts=4)
    with pytest.raises(ValueError, match="axis 2 out of range"):
        ShardedArray.zeros((10, 6), axis=2, rank=0, parts=1)
    with pytest.raises(ValueError, match=r"rank 4 out of range for 4 parts"):
        ShardedArray.zeros((10, 6), rank=4, parts=4)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape,axis", [((10, 6), 0), ((10, 6), 1), ((7, 3, 5), -1), ((2,), 0)])
def test_chunks_of_the_group_tile_the_array(world, shape, axis):
    """Each rank's from_global block, gathered, rebuilds the array (sizes that do not divide)."""
    full = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    sa = ShardedArray.from_global(full, axis=axis)
    np.testing.assert_array_equal(sa.local, full[sa.slices])
    ax = axis % len(shape)
    assert sa.local_shape[ax] == chunk_sizes(shape[ax], world.world_size)[world.rank]
    blocks = axonmpi.distributed.all_gather_object((sa.offsets, sa.local))
    rebuilt = np.full(shape, np.nan)
    for off, local in blocks:
        rebuilt[tuple(slice(o, o + n) for o, n in zip(off, local.shape))] = local
    np.testing.assert_array_equal(rebuilt, full)
    z = ShardedArray.zeros(shape, np.float32, axis=axis)
    assert z.offsets == sa.offsets and z.local_shape == sa.local_shape and z.dtype == np.float32
