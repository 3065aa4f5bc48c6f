"""Gradient clipping: closed-form norms and scaled gradients, locally and over a process group."""
import math

import numpy as np
import pytest

from axonmpi.autograd import Tensor
from axonmpi.nn import Parameter
from axonmpi.optim import clip_grad_norm_, clip_grad_value_, grad_norm


def _params(*grads, dtype=np.float64):
    ps = []
    for g in grads:
        p = Parameter(np.zeros(np.shape(g), dtype=dtype))
        p.grad = None if g is None else Tensor(np.asarray(g, dtype=dtype))
        ps.append(p)
    return ps


def test_l2_norm_and_scaling_closed_form():
    ps = _params([[3.0, 0.0], [0.0, 0.0]], [4.0], None)  # total 2-norm 5
    total = clip_grad_norm_(ps, max_norm=1.0)
    assert isinstance(total, float) and total == pytest.approx(5.0, abs=1e-12)
    coef = 1.0 / (5.0 + 1e-6)
    np.testing.assert_allclose(ps[0].grad.data, [[3 * coef, 0], [0, 0]], rtol=1e-14)
    np.testing.assert_allclose(ps[1].grad.data, [4 * coef], rtol=1e-14)
    assert grad_norm(ps) == pytest.approx(1.0, abs=1e-6)


def test_no_scaling_below_max_norm_and_in_place():
    ps = _params([0.3, -0.4])
    arr = ps[0].grad.data
    assert clip_grad_norm_(iter(ps), max_norm=1.0) == pytest.approx(0.5, abs=1e-15)  # generators work
    assert ps[0].grad.data is arr
    np.testing.assert_array_equal(arr, [0.3, -0.4])


@pytest.mark.parametrize("norm_type,want", [(1.0, 10.0), (3.0, 100 ** (1 / 3)), (math.inf, 4.0)])
def test_other_norms(norm_type, want):
    ps = _params([2.0, -3.0], [[-4.0]], [1.0])
    total = clip_grad_norm_(ps, max_norm=0.5, norm_type=norm_type)
    assert total == pytest.approx(want, rel=1e-13)
    np.testing.assert_allclose(ps[0].grad.data, np.array([2.0, -3.0]) * 0.5 / (want + 1e-6), rtol=1e-13)


def test_float32_large_and_float16_grads():
    rng = np.random.default_rng(0)
    g = rng.standard_normal((1000, 300)).astype(np.float32)
    ps = _params(g, dtype=np.float32)
    want = float(np.sqrt((g.astype(np.float64) ** 2).sum()))
    assert clip_grad_norm_(ps, 1.0) == pytest.approx(want, rel=1e-5)
    assert ps[0].grad.data.dtype == np.float32
    h = _params(np.full(70000, 1.0), dtype=np.float16)  # sum of squares overflows float16
    assert grad_norm(h) == pytest.approx(math.sqrt(70000), rel=1e-6)


def test_nonfinite():
    ps = _params([1.0, np.inf])
    with pytest.raises(RuntimeError, match="inf"):
        clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    ps = _params([1.0, np.nan])
    assert math.isnan(clip_grad_norm_(ps, 1.0))
    assert np.isnan(ps[0].grad.data).all()  # PyTorch: the nan coefficient propagates


def test_empty_and_bad_arguments():
    assert clip_grad_norm_(_params(None), 1.0) == 0.0
    with pytest.raises(ValueError, match="-1"):
        clip_grad_norm_(_params([1.0]), -1)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(_params([1.0]), 1.0, norm_type=0)
    with pytest.raises(ValueError, match="-0.5"):
        clip_grad_value_(_params([1.0]), -0.5)


def test_clip_grad_value():
    ps = _params([-2.0, 0.1, 3.0], [[0.5, -0.7]])
    clip_grad_value_(ps, 0.5)
    np.testing.assert_array_equal(ps[0].grad.data, [-0.5, 0.1, 0.5])
    np.testing.assert_array_equal(ps[1].grad.data, [[0.5, -0.5]])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_group_reduces_sharded_norm(world, norm_type):
    """Rank r holds the shard [r + 1, -(r + 1)]: the global norm is over all shards."""
    g = world.default_group
    r, n = g.rank, g.size
    ps = _params([r + 1.0, -(r + 1.0)])
    total = clip_grad_norm_(ps, max_norm=1.0, norm_type=norm_type, group=g)
    if norm_type == 2.0:
        want = math.sqrt(2 * sum((k + 1) ** 2 for k in range(n)))
    else:
        want = float(n)
    assert total == pytest.approx(want, rel=1e-13)
    np.testing.assert_allclose(ps[0].grad.data, np.array([r + 1.0, -(r + 1.0)]) / (want + 1e-6), rtol=1e-13)


# -- partly sharded, partly replicated models (each element counted exactly once) ----------------
def _tagged(grad, group="unset"):
    p = _params(grad)[0]
    if group != "unset":
        p.shard_group = group
    return p


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_mixed_sharded_and_replicated_parameters(world, norm_type):
    """One model at any world size n, rank r, pair group (r // 2) of size t with group rank q:

    * R replicated (``shard_group = None``), grad [1, -2] everywhere (counts once, never times n);
    * S sharded over the world, uneven: rank k holds k+1 elements of value 2(k+1);
    * P = [1, 2, 3, 4, 5] sharded over the pair group (chunk q of t, first ones larger) -- at 3
      ranks rank 2 holds all of P in a group of one;
    * U untagged, sharded over the world via ``group=``: rank k holds [0.5 (k+1)];
    * E replicated likewise: grad [3];
    * Z sharded over the world, no grad on rank 0, [1] elsewhere (rank 0 still joins the reduction).
    """
    from axonmpi.distributed.collectives import chunk_bounds

    g = world.default_group
    r, n = g.rank, g.size
    pair = world.split(r // 2, key=r)
    q, t = pair.rank, pair.size
    full_p = np.arange(1.0, 6.0)
    lo, hi = chunk_bounds(5, t, q)
    params = [
        _tagged([1.0, -2.0], None),
        _tagged(np.full(r + 1, 2.0 * (r + 1)), g),
        _tagged(full_p[lo:hi], pair),
        _tagged([0.5 * (r + 1)]),
        _tagged([3.0], None),
        _tagged(None if r == 0 else [1.0], g),
    ]
    ks = np.arange(1, n + 1, dtype=np.float64)
    elements = np.concatenate([[1.0, -2.0], np.repeat(2 * ks, ks.astype(int)), full_p, 0.5 * ks, [3.0],
                               np.ones(n - 1)])
    if norm_type == math.inf:
        want = np.abs(elements).max()
    else:
        want = (np.abs(elements) ** norm_type).sum() ** (1 / norm_type)
    before = [None if p.grad is None else p.grad.numpy() for p in params]
    total = clip_grad_norm_(params, max_norm=0.5, norm_type=norm_type, group=g)
    assert total == pytest.approx(want, rel=1e-13), (r, n, total, want)
    coef = 0.5 / (want + 1e-6)
    for p, b in zip(params, before):
        if b is None:
            assert p.grad is None
        else:
            np.testing.assert_allclose(p.grad.numpy(), b * coef, rtol=1e-13)
    # the same model without any group: every parameter is replicated, the norm is local
    local = grad_norm(_params([3.0, 4.0]))
    assert local == pytest.approx(5.0, rel=1e-15)


def test_shard_group_attribute_reading():
    from axonmpi.optim.clip import shard_group_of

    p = _params([1.0])[0]
    assert shard_group_of(p, "g") == "g"
    p.shard_group = None
    assert shard_group_of(p, "g") is None
    p.shard_group = "tp"
    assert shard_group_of(p) == "tp"
    assert shard_group_of(Tensor([1.0]), "g") == "g"  # plain tensors carry no attributes


def test_axonn_tensor_parallel_tags_are_read():
    from axonmpi.optim.clip import shard_group_of

    p = _params([1.0])[0]
    p.is_tensor_parallel, p.process_group_for_norm_reduction = True, "tp"
    assert shard_group_of(p, "g") == "tp"
    p.is_tensor_parallel = False
    assert shard_group_of(p, "g") is None  # tagged replicated: does not inherit group=
    p.shard_group = "fsdp"
    assert shard_group_of(p, "g") == "fsdp"  # the explicit attribute wins


@pytest.mark.mpi(min_size=2)
def test_axonn_tags_count_shards_once(world):
    g = world.default_group
    r, n = g.rank, g.size
    shard = _params([float(r + 1)])[0]
    shard.is_tensor_parallel, shard.process_group_for_norm_reduction = True, g
    rep = _params([2.0])[0]
    rep.is_tensor_parallel = False
    want = math.sqrt(sum((k + 1) ** 2 for k in range(n)) + 4.0)
    assert clip_grad_norm_([shard, rep], 1e9, group=g) == pytest.approx(want, rel=1e-14)
