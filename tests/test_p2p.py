"""Point-to-point: batch_isend_irecv, isend/irecv and send/recv against closed-form messages at 1-4 ranks."""
import numpy as np
import pytest

import axonmpi
from axonmpi import P2POp, batch_isend_irecv

DTYPES = [np.float64, np.float32, np.int32, np.int64, np.float16, np.uint8, np.complex128]


@pytest.fixture(autouse=True, params=["native-half", "no-half"])
def half_mode(request, monkeypatch):
    """Every test twice: the MPI library's float16 type, and the fallback for libraries without one."""
    if request.param == "no-half":
        monkeypatch.setenv("AXONMPI_MPI_FLOAT16", "0")
    else:
        monkeypatch.delenv("AXONMPI_MPI_FLOAT16", raising=False)
    return request.param


def _msg(src, dst, tag=0):
    """What group rank ``src`` sends ``dst``: shape and dtype depend on both ends (closed form)."""
    dtype = DTYPES[(src + 2 * dst + tag) % len(DTYPES)]
    shape = (src + 1, dst + 2)
    vals = np.arange(int(np.prod(shape))) % 7 + 10 * src + dst + tag     # small: exact in float16
    return vals.reshape(shape).astype(dtype)


def _empty_for(src, dst, tag=0):
    m = _msg(src, dst, tag)
    return np.full(m.shape, 99, m.dtype)


def _shuffled(ops, seed):
    order = np.random.default_rng(seed).permutation(len(ops))
    return [ops[i] for i in order]


@pytest.mark.mpi(min_size=1)
def test_ring_both_directions_any_order(world):
    """Send to next (tag 1) and previous (tag 2), receive from both; at 1 and 2 ranks the
    neighbours coincide (rank itself at 1), so the tags tell the messages apart."""
    n, r = world.world_size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    for trial in range(3):
        from_prv, from_nxt = _empty_for(prv, r, 1), _empty_for(nxt, r, 2)
        ops = [P2POp(axonmpi.isend, _msg(r, nxt, 1), nxt, tag=1),
               P2POp(axonmpi.isend, _msg(r, prv, 2), prv, tag=2),
               P2POp(axonmpi.irecv, from_prv, prv, tag=1),
               P2POp(axonmpi.irecv, from_nxt, nxt, tag=2)]
        ops = _shuffled(ops, 100 * trial + r)
        works = batch_isend_irecv(ops)
        assert len(works) == 4
        results = [w.wait() for w in works]
        for o, res in zip(ops, results):
            if o.op is axonmpi.irecv:
                assert res is o.tensor
            else:
                assert res is None
        np.testing.assert_array_equal(from_prv, _msg(prv, r, 1))
        np.testing.assert_array_equal(from_nxt, _msg(nxt, r, 2))
        assert from_prv.dtype == _msg(prv, r, 1).dtype


@pytest.mark.mpi(min_size=1)
def test_pairwise_exchange_every_peer_including_self(world):
    n, r = world.world_size, world.rank
    got = {j: _empty_for(j, r) for j in range(n)}
    ops = [P2POp(axonmpi.isend, _msg(r, j), j) for j in range(n)]
    ops += [P2POp(axonmpi.irecv, got[j], j) for j in range(n)]
    works = batch_isend_irecv(_shuffled(ops, r))
    while not all(w.is_completed() for w in works):
        pass
    for j in range(n):
        np.testing.assert_array_equal(got[j], _msg(j, r))


@pytest.mark.mpi(min_size=2)
def test_sends_listed_first_with_large_messages_do_not_deadlock(world):
    """Messages above every eager limit (2 MiB), all sends before all receives: blocking sends
    in this order would deadlock; a batch must not."""
    n, r = world.world_size, world.rank
    size = 1 << 18                                             # float64: 2 MiB per message
    peers = [j for j in range(n) if j != r]
    got = {j: np.empty(size) for j in peers}
    ops = [P2POp(axonmpi.isend, np.full(size, 1000.0 * r + j), j) for j in peers]
    ops += [P2POp(axonmpi.irecv, got[j], j) for j in peers]
    for w in batch_isend_irecv(ops)[::-1]:                     # wait in reverse order too
        w.wait()
    for j in peers:
        assert got[j][0] == 1000.0 * j + r and got[j][-1] == 1000.0 * j + r


@pytest.mark.mpi(min_size=1)
def test_non_contiguous_arrays_and_tags_matched_out_of_order(world):
    n, r = world.world_size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    src = np.arange(24.0).reshape(4, 6)[:, ::2] + r            # non-contiguous send (4, 3)
    base = np.zeros((3, 8))
    target = base[:, ::2].T                                    # non-contiguous receive (4, 3)
    a, b = np.empty(2, np.int64), np.empty(5, np.int32)
    ops = [P2POp(axonmpi.irecv, b, prv, tag=8),                # receives listed in the other tag order
           P2POp(axonmpi.irecv, target, prv, tag=3),
           P2POp(axonmpi.irecv, a, prv, tag=7),
           P2POp(axonmpi.isend, np.array([r, 7]), nxt, tag=7),
           P2POp(axonmpi.isend, np.arange(5, dtype=np.int32) + r, nxt, tag=8),
           P2POp(axonmpi.isend, src, nxt, tag=3)]
    works = batch_isend_irecv(ops)
    assert works[1].wait() is target
    for w in works:
        w.wait()
    np.testing.assert_array_equal(target, np.arange(24.0).reshape(4, 6)[:, ::2] + prv)
    np.testing.assert_array_equal(base[:, 1::2], 0)           # untouched between the strided columns
    assert a.tolist() == [prv, 7] and b.tolist() == list(range(prv, prv + 5))


@pytest.mark.mpi(min_size=1)
def test_batch_on_a_reversed_subgroup_uses_group_ranks(world):
    n, r = world.world_size, world.rank
    g = world.new_group(list(range(n))[::-1], name="reversed")
    me, size = g.rank, g.size
    to = (me + 1) % size                                       # group ranks
    got = np.empty(1, np.int64)
    works = batch_isend_irecv([P2POp(axonmpi.isend, np.array([r]), to, group=g),
                               P2POp(axonmpi.irecv, got, (me - 1) % size, group=g)])
    [w.wait() for w in works]
    assert got[0] == g.ranks[(me - 1) % size]                  # the world rank of the sender


@pytest.mark.mpi(min_size=1)
def test_bad_batches_are_loud_and_start_nothing(world):
    n, r = world.world_size, world.rank
    good = P2POp(axonmpi.isend, np.ones(2), (r + 1) % n, tag=5)
    with pytest.raises(ValueError, match=rf"rank {r}: batch_isend_irecv op 1 \(irecv\) peer={n} is out of "
                                         rf"range for world of size {n} \(valid: 0..{n - 1}"):
        batch_isend_irecv([good, P2POp(axonmpi.irecv, np.empty(2), n)])
    with pytest.raises(ValueError, match="peer=-1 is out of range"):
        batch_isend_irecv([P2POp(axonmpi.isend, np.ones(2), -1)])
    with pytest.raises(TypeError, match="peer must be an int group rank"):
        batch_isend_irecv([P2POp(axonmpi.isend, np.ones(2), 0.0)])
    with pytest.raises(ValueError, match="must be axonmpi.isend or axonmpi.irecv, got send"):
        P2POp(axonmpi.send, np.ones(2), 0)
    with pytest.raises(ValueError, match="non-empty list"):
        batch_isend_irecv([])
    with pytest.raises(TypeError, match="op 1 must be a P2POp"):
        batch_isend_irecv([good, ("isend", np.ones(2), 0)])
    with pytest.raises(ValueError, match=rf"rank {r}: batch_isend_irecv op 0 tag=-3 must be an int in 0\.\."):
        batch_isend_irecv([P2POp(axonmpi.isend, np.ones(2), 0, tag=-3)])
    other = world.split(0)
    with pytest.raises(ValueError, match="op 1 is on split.*all ops of one batch use one group"):
        batch_isend_irecv([good, P2POp(axonmpi.irecv, np.empty(2), 0, group=other)])
    with pytest.raises(ValueError, match="read-only"):
        ro = np.empty(2)
        ro.flags.writeable = False
        batch_isend_irecv([P2POp(axonmpi.irecv, ro, 0)])
    # nothing of the refused batches was started: the next message with tag 5 is the real one
    got = np.empty(2)
    works = batch_isend_irecv([P2POp(axonmpi.isend, np.full(2, float(r)), (r + 1) % n, tag=5),
                               P2POp(axonmpi.irecv, got, (r - 1) % n, tag=5)])
    [w.wait() for w in works]
    assert got.tolist() == [float((r - 1) % n)] * 2


@pytest.mark.mpi(min_size=2)
def test_single_isend_irecv_and_blocking_pairs(world):
    n, r = world.world_size, world.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    target = np.zeros((3, 4))[:, ::2]                          # non-contiguous irecv target
    w_recv = axonmpi.irecv(target, src=prv, tag=4)
    w_send = axonmpi.isend(np.full((3, 2), r + 0.5), dst=nxt, tag=4)
    assert w_recv.wait() is target and w_send.wait() is None
    np.testing.assert_array_equal(target, prv + 0.5)
    if r % 2 == 0 and r + 1 < n:
        axonmpi.send(_msg(r, r + 1), dst=r + 1)
    elif r % 2 == 1:
        want = _msg(r - 1, r)
        fortran = np.empty(want.shape, want.dtype, order="F")  # not C-contiguous: filled through a copy
        got = axonmpi.recv(fortran, src=r - 1)
        assert got is fortran
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=rf"tag=-1 must be an int in 0\.\.{world.default_group.max_tag}"):
        axonmpi.isend(np.ones(1), dst=nxt, tag=-1)
